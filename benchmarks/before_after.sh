#!/usr/bin/env bash
# The same benchmarks on an old tree and on this one, in one run on one GPU (old, then new), then
# benchmarks/compare_runs.py over them: the 8B-head draft loop at B = 1, K = 5 (bench_draft_loop.py),
# generate at B = 1 (bench_generate.py --quick) and the real model at B = 1, greedy (bench_real_model.py).
#   bash benchmarks/before_after.sh OLD_TREE        ($OUT set; the GPU host's set-up of gpu_real_model.sh done)
# OLD_TREE: a copy of the old commit's files (git archive), without its assets: this tree's are linked in.
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
new=$PWD old=$(cd "$1" && pwd)
[ -e "$new/fspec/kernels" ] || ln -sfn "$new/kernels" "$new/fspec/kernels"
[ -e "$old/fspec/kernels" ] || ln -sfn "$old/kernels" "$old/fspec/kernels"
[ -e "$old/fspec/assets" ] || ln -sfn "$new/fspec/assets" "$old/fspec/assets"
run() {  # TREE TAG
  (cd "$1" && export PYTHONPATH=/tmp/site:$1 &&
    timeout 150 python3 benchmarks/bench_draft_loop.py --heads 8b --batch 1 --k 5 --no-step --reps 10 \
      --out "$OUT/draft_$2.json" > "$OUT/log_draft_$2.txt" 2>&1
    timeout 150 python3 benchmarks/bench_generate.py --quick --skip-hf --out "$OUT/generate_$2.json" \
      > "$OUT/log_generate_$2.txt" 2>&1
    timeout 150 python3 benchmarks/bench_real_model.py --batch 1 --temperature 0 --reps 3 --skip-hf \
      --new-tokens 128 --out "$OUT/real_$2.json" > "$OUT/log_real_$2.txt" 2>&1
    echo "$2: $(ls "$OUT" | grep -c "_$2.json") result files")
}
run "$old" old; run "$new" new
python3 benchmarks/compare_runs.py $(for b in draft generate real; do echo "$OUT/${b}_old.json $OUT/${b}_new.json"; done) --out "$OUT/compare.json"
