#!/usr/bin/env bash
# Run the GPU tests and the benchmarks on a GPU machine, one after another, and pack what they wrote (JSON
# results, logs, TensorBoard runs) into $OUT/bundle.tgz.
#
#   PYTHONPATH=. bash benchmarks/run_all.sh                    # every step below
#   PYTHONPATH=. bash benchmarks/run_all.sh tests compute      # the steps named
#
# Steps (the default order): tests (python3 -m pytest -m gpu tests), ladder, peers, compute, feeds,
# overhead, advisor and, with two GPUs visible, ddp_scaling (named on a
# one-GPU machine it is skipped with a line saying so). By name only: parity (benchmarks/accuracy_parity.py
# --size gpu, which trains for a long time), jpeg, stores and models (benchmarks/<name>.py).
# Results go to $RES/<date>-<step>-<gpu>.json (ddp_scaling to $RES/<date>-ddp-scaling-<gpu>x2.json, parity
# into $RES). A failing step does not stop the others; each runs under timeout $SUITE_TIMEOUT (default 600 s).
# SUITE_DRY_RUN=1 prints each step's command and runs nothing.
set -u
dry="${SUITE_DRY_RUN:-0}"
OUT="${OUT:-/tmp/run_all_out}"
[ "$dry" = 1 ] || mkdir -p "$OUT"
# GPUs this process may use, counted before the one-GPU steps are pinned to the first of them
if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
  gpus=$(awk -F, '{print NF}' <<< "$CUDA_VISIBLE_DEVICES")
else
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
fi
visible="${CUDA_VISIBLE_DEVICES:-}"
first="${visible%%,*}"
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES="${first:-0}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
two="${visible:-0,1}"
# results are named after the GPU: "NVIDIA H200" -> h200
tag=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | awk '{print tolower($NF)}')
tag="${tag:-gpu}"
day=$(date -u +%F)
RES=/tmp/run_all/results; LOGS=/tmp/run_all/logs; TB=/tmp/run_all/tb
if [ "$dry" != 1 ]; then
  rm -rf /tmp/run_all  # the bundle holds this run only
  mkdir -p "$RES" "$LOGS" "$TB"
fi
steps=("$@")
if [ ${#steps[@]} -eq 0 ]; then
  steps=(tests ladder peers compute feeds overhead advisor)
  if [ "$gpus" -ge 2 ]; then steps+=(ddp_scaling); fi
fi
recorder=.nvtxrec/librecorder.so
summary=()
for name in "${steps[@]}"; do
  start=$(date +%s)
  if [ "$name" = ddp_scaling ] && [ "$gpus" -lt 2 ]; then
    echo "=== $name: skipped (needs two GPUs, $gpus visible)"
    summary+=("$name skipped: $gpus GPU(s)")
    continue
  fi
  if [ "$name" = tests ] && [ "$dry" != 1 ] && [ ! -f "$recorder" ]; then
    bash tools/build_nvtx_recorder.sh > "$LOGS/build_nvtx_recorder.log" 2>&1
  fi
  out="$RES/$day-${name//_/-}-$tag.json"
  case "$name" in
    tests) cmd=(python3 -m pytest -m gpu -q -p no:cacheprovider tests) ;;
    ladder|peers|compute|feeds|advisor|jpeg|stores|models) cmd=(python3 "benchmarks/$name.py" --out "$out") ;;
    overhead) cmd=(python3 benchmarks/overhead.py --out "$out" --tensorboard "$TB/overhead") ;;
    ddp_scaling) cmd=(env CUDA_VISIBLE_DEVICES="$two" python3 benchmarks/ddp_scaling.py --out "$RES/$day-ddp-scaling-${tag}x2.json") ;;
    parity) cmd=(python3 benchmarks/accuracy_parity.py --size gpu --out "$RES") ;;
    *) echo "=== $name: unknown step" >&2; summary+=("$name unknown"); continue ;;
  esac
  echo "=== $name: ${cmd[*]}"
  if [ "$dry" = 1 ]; then continue; fi
  NVTX_RECORDER_LIB="$PWD/$recorder" timeout "${SUITE_TIMEOUT:-600}" "${cmd[@]}" > "$LOGS/$name.log" 2>&1
  rc=$?
  tail -n "${SUITE_TAIL:-25}" "$LOGS/$name.log"
  summary+=("$name rc=$rc $(( $(date +%s) - start ))s")
  tar czf "$OUT/bundle.tgz" -C /tmp/run_all results logs tb 2>/dev/null
done
if [ "$dry" = 1 ]; then [ ${#summary[@]} -eq 0 ] || printf '%s\n' "${summary[@]}"; exit 0; fi
nvidia-smi --query-gpu=name,driver_version,memory.used,utilization.gpu --format=csv > "$LOGS/nvidia-smi.csv" 2>&1
tar czf "$OUT/bundle.tgz" -C /tmp/run_all results logs tb
echo "=== summary"; printf '%s\n' "${summary[@]}"
