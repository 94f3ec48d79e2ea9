#!/usr/bin/env bash
# One GPU-host step: `bash benchmarks/gpu_run.sh STAGE [ARGS]` with $OUT set. Each stage writes its JSON to
# $OUT and appends the last lines of its log to $OUT/tails.log (full logs stay in $WORK, default
# /tmp/fspec-gpu): few, small files, so several stages fit in one call's returned files.
# Stages:
#   tests        the GPU tests (pytest -m gpu)
#   sampling     benchmarks/bench_sampling.py
#   draft        benchmarks/bench_draft_loop.py
#   attention    benchmarks/bench_attention.py
#   generate     benchmarks/bench_generate.py
#   overhead     benchmarks/bench_call_overhead.py (warm generate calls, B = 1: forced full acceptance and
#                target-only; TORCHINDUCTOR_* variables in the environment apply; a later --out names another file)
#   linear       benchmarks/bench_skinny_linear.py (fspec::skinny_linear vs cuBLAS; --sweep for configs)
#   host         benchmarks/bench_host_overhead.py (host µs of each piece of an eager sampling call; run it
#                alone: a compile in another process inflates every figure; carry .peers, which
#                gpu_prepare.sh makes, to time vLLM's eager Gumbel call in the same run)
#   scaling      benchmarks/bench_distill_scaling.py (two GPUs)
#   memcheck     compute-sanitizer memcheck over the kernel GPU tests (caching allocator off; graph tests
#                excluded: capture cannot allocate with the allocator off)
#   racecheck    compute-sanitizer racecheck over the same tests
#   memcheck-graphs  compute-sanitizer memcheck, caching allocator on, over the kernel GPU tests that capture
#                a CUDA graph (the q/k/v epilogue, the attention's early K/V and release)
#   ncu-sampling Nsight Compute speed-of-light of the Gumbel block kernel at B = 256, V = 128256
#   timelines    kernel_timeline.py (1B draft loop, K = 3, and decode step) once per "TAG:VAR=VALUE,..."
#                argument (environment variables; default: one run, "default:_"); the timelines stay in
#                $WORK/timelines, the summary lines go to tails.log
#   variants     bench_draft_loop.py (8B / 1B heads, B = 1, K = 5) and bench_call_overhead.py once per
#                "TAG:VAR=VALUE,..." argument, spread over the GPUs; $OUT/switches.json (switches.py) and
#                $OUT/variants.tgz
#   heads        build the default model once per "TAG:ARGS" argument, all at once on the one GPU (ARGS:
#                fspec.train.default_model options, "+" for spaces), then score each with bench_acceptance.py
#                (K = 5, every held-out file); $OUT/TAG.json is each train_log.json with that score under
#                "all_held_out_files", $OUT/best-TAG.tar.xz the built files of the best by greedy tau
set -u
stage=$1; shift
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
WORK=${WORK:-/tmp/fspec-gpu}
mkdir -p "$WORK"
cd "$(dirname "$0")/.."
log="$WORK/$stage.log"
kernel_tests=(tests/kernels/test_paged_attention.py tests/kernels/test_rope_kv_write.py tests/test_gpu.py
  -k "not graph and not generate and not draft_loop")
case "$stage" in
  tests) timeout 300 python3 -m pytest -q -m gpu tests -p no:cacheprovider -rA > "$log" 2>&1 ;;
  sampling) timeout 240 python3 benchmarks/bench_sampling.py --out "$OUT/sampling.json" "$@" > "$log" 2>&1 ;;
  draft) timeout 540 python3 benchmarks/bench_draft_loop.py --out "$OUT/draft_loop.json" "$@" > "$log" 2>&1 ;;
  attention) timeout 560 python3 benchmarks/bench_attention.py --out "$OUT/attention.json" "$@" > "$log" 2>&1 ;;
  generate) timeout 560 python3 benchmarks/bench_generate.py --out "$OUT/generate.json" "$@" > "$log" 2>&1 ;;
  overhead) timeout 400 python3 benchmarks/bench_call_overhead.py --out "$OUT/call_overhead.json" "$@" \
      > "$log" 2>&1 ;;
  host) timeout 200 python3 benchmarks/bench_host_overhead.py --out "$OUT/host_overhead.json" "$@" > "$log" 2>&1 ;;
  linear) timeout 500 python3 benchmarks/bench_skinny_linear.py --out "$OUT/skinny_linear.json" "$@" \
      > "$log" 2>&1 ;;
  scaling) timeout 300 python3 benchmarks/bench_distill_scaling.py --out "$OUT/distill_scaling.json" "$@" \
      > "$log" 2>&1 ;;
  memcheck) PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 300 compute-sanitizer --tool memcheck \
      --target-processes all python3 -m pytest -q -m gpu -p no:cacheprovider "${kernel_tests[@]}" > "$log" 2>&1 ;;
  memcheck-graphs) timeout 400 compute-sanitizer --tool memcheck --target-processes all python3 -m pytest -q \
      -m gpu -p no:cacheprovider tests/kernels/test_qkv_rope_write.py tests/kernels/test_attention_early_kv.py > "$log" 2>&1 ;;
  racecheck) timeout 400 compute-sanitizer --tool racecheck --target-processes all \
      python3 -m pytest -q -m gpu -p no:cacheprovider "${kernel_tests[@]}" > "$log" 2>&1 ;;
  ncu-sampling) timeout 300 ncu --kernel-name regex:_gumbel_block_kernel --launch-skip 3 --launch-count 1 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      python3 benchmarks/bench_sampling.py --batch 256 --vocab 128256 --rep 20 --out "$WORK/ncu.json" \
      > "$log" 2>&1 ;;
  timelines)
    # each argument "TAG:VAR=VALUE,VAR=VALUE" ("TAG:_" for none)
    [ $# -gt 0 ] || set -- default:_
    for v in "$@"; do
      tag=${v%%:*}; vars=${v#*:}; [ "$vars" = _ ] && vars=""
      env ${vars//,/ } timeout 150 python3 benchmarks/kernel_timeline.py "$WORK/timelines" --k 3 --tag "$tag"
    done > "$log" 2>&1 ;;
  variants)
    # each argument "TAG:VAR=VALUE,..." ("TAG:_" for none): bench_draft_loop.py (8B and 1B heads, B = 1,
    # K = 5) and bench_call_overhead.py under those switches, variants spread over the visible GPUs; the
    # JSONs go to $OUT/variants.tgz and switches.py's table of them to $OUT/switches.json
    # (the GPUs are those of CUDA_VISIBLE_DEVICES when it is set, so another stage can hold one meanwhile)
    ngpu=$(python3 -c 'import torch; print(max(1, torch.cuda.device_count()))')
    IFS=, read -r -a gpus <<< "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((ngpu - 1)))}"
    mkdir -p "$WORK/variants"; i=0; specs=()
    for v in "$@"; do
      tag=${v%%:*}; vars=${v#*:}; [ "$vars" = _ ] && vars=""; gpu=${gpus[$((i % ngpu))]}; i=$((i + 1))
      specs+=("run:$tag:${vars:--}:$WORK/variants/draft_$tag.json:$WORK/variants/co_$tag.json")
      ( env CUDA_VISIBLE_DEVICES=$gpu ${vars//,/ } timeout 280 python3 benchmarks/bench_draft_loop.py \
          --heads 8b 1b --batch 1 --k 5 --no-step --reps 20 --out "$WORK/variants/draft_$tag.json" &&
        env CUDA_VISIBLE_DEVICES=$gpu ${vars//,/ } timeout 200 python3 benchmarks/bench_call_overhead.py \
          --calls 5 --out "$WORK/variants/co_$tag.json" ) > "$WORK/variants/$tag.log" 2>&1 &
      if [ $((i % ngpu)) -eq 0 ]; then wait; fi
    done
    wait
    { for v in "$@"; do tail -5 "$WORK/variants/${v%%:*}.log"; done
      python3 benchmarks/switches.py --out "$OUT/switches.json" "${specs[@]}"; } > "$log" 2>&1
    tar czf "$OUT/variants.tgz" -C "$WORK" variants ;;
  heads)
    pids=()
    for spec in "$@"; do
      tag=${spec%%:*}; extra=${spec#*:}
      { timeout 500 python3 -m fspec.train.default_model --out "$WORK/$tag" --device cuda ${extra//+/ } &&
        timeout 60 python3 benchmarks/bench_acceptance.py --model "$WORK/$tag" --device cuda --ks 5 \
          --trained-only --out "$WORK/$tag-acc.json"; } > "$WORK/$tag.log" 2>&1 &
      pids+=($!)
    done
    rc=0; for p in "${pids[@]}"; do wait "$p" || rc=1; done
    for spec in "$@"; do tag=${spec%%:*}; tail -c 2000 "$WORK/$tag.log"; done > "$log" 2>&1
    best=$(python3 -c 'import json, sys
work, out, tags = sys.argv[1], sys.argv[2], [a.split(":")[0] for a in sys.argv[3:]]
tau = {}
for t in tags:
    log = json.load(open(f"{work}/{t}/train_log.json"))
    log["all_held_out_files"] = json.load(open(f"{work}/{t}-acc.json"))
    json.dump(log, open(f"{out}/{t}.json", "w"), indent=1)
    tau[t] = log["all_held_out_files"]["rows"][0]["acceptance_length"]  # K = 5, greedy
print(max(tau, key=tau.get))' "$WORK" "$OUT" "$@")
    tar -C "$WORK/$best" -cJf "$OUT/best-$best.tar.xz" --exclude=train_log.json . ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
rc=$?
{ echo "===== $stage $* (rc=$rc)"; grep -v "Host Frame\|DEBUG" "$log" | tail -c 12000; } >> "$OUT/tails.log"
echo "$stage rc=$rc" | tee -a "$OUT/stages.txt"
exit $rc
