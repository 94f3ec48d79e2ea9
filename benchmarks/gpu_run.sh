#!/usr/bin/env bash
# One GPU-host session step: `bash benchmarks/gpu_run.sh STAGE` with $OUT set; logs and JSON go to $OUT.
# Stages: tests (GPU tests), sampling, draft, attention, generate.
set -u
stage=$1; shift
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
case "$stage" in
  tests) timeout 300 python3 -m pytest -q -m gpu tests -p no:cacheprovider -rA 2>&1 | tail -40 | tee "$OUT/gpu_tests.log" ;;
  sampling) timeout 240 python3 benchmarks/bench_sampling.py --out "$OUT/sampling.json" "$@" 2>&1 | tee "$OUT/sampling.log" | tail -30 ;;
  draft) timeout 540 python3 benchmarks/bench_draft_loop.py --out "$OUT/draft_loop.json" "$@" 2>&1 | tee "$OUT/draft_loop.log" | tail -30 ;;
  attention) timeout 560 python3 benchmarks/bench_attention.py --out "$OUT/attention.json" "$@" 2>&1 | tee "$OUT/attention.log" | tail -40 ;;
  generate) timeout 560 python3 benchmarks/bench_generate.py --out "$OUT/generate.json" "$@" 2>&1 | tee "$OUT/generate.log" | tail -40 ;;
esac
