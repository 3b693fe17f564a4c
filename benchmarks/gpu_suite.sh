#!/usr/bin/env bash
# Run the GPU benchmark scripts and the GPU tests on a GPU machine, one after another, and pack everything
# (JSON results, logs, TensorBoard runs) into $OUT/bundle.tgz.
#
#   PYTHONPATH=. bash benchmarks/gpu_suite.sh                      # every step below
#   PYTHONPATH=. bash benchmarks/gpu_suite.sh monitor compute nvtx # the steps named
#
# Steps (the default order): tests, then benchmarks/gpu_<name>.py for monitor compute nvtx ladder dali
# dali_decode hdf5 workers pipeline_diag advisor advisor_scenarios compile idle, and with two GPUs visible
# ddp and ddp_scaling (named on a one-GPU machine, they are skipped with a line saying so). Also by name
# only: nvtx_record, dali_focus, advisor_decode, and parity (benchmarks/accuracy_parity.py --size gpu,
# which trains for a long time). Results go to $RES/<name>_<gpu>.json, or into $RES for the scripts that
# write into a folder. A failing step does not stop the others; each runs under timeout $SUITE_TIMEOUT
# (default 400 s). SUITE_DRY_RUN=1 prints each step's command and runs nothing.
set -u
dry="${SUITE_DRY_RUN:-0}"
OUT="${OUT:-/tmp/gpu_suite_out}"
[ "$dry" = 1 ] || mkdir -p "$OUT"
# GPUs this process may use, counted before the one-GPU steps are pinned to the first of them
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
visible="${CUDA_VISIBLE_DEVICES:-}"
first="${visible%%,*}"
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES="${first:-0}"
two="${visible:-0,1}"
# results are named after the GPU: "NVIDIA H200" -> h200
tag=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | awk '{print tolower($NF)}')
tag="${tag:-gpu}"
RES=/tmp/gpu_suite/results; LOGS=/tmp/gpu_suite/logs; TB=/tmp/gpu_suite/tb
if [ "$dry" != 1 ]; then
  # /tmp may hold files of a previous run: start empty so the bundle holds this run only
  rm -rf /tmp/gpu_suite
  mkdir -p "$RES" "$LOGS" "$TB"
fi
steps=("$@")
if [ ${#steps[@]} -eq 0 ]; then
  steps=(tests monitor compute nvtx ladder dali dali_decode hdf5 workers pipeline_diag advisor
         advisor_scenarios compile idle)
  if [ "$gpus" -ge 2 ]; then steps+=(ddp ddp_scaling); fi
fi
recorder=.nvtxrec/librecorder.so
summary=()
for name in "${steps[@]}"; do
  start=$(date +%s)
  case "$name" in
    ddp|ddp_scaling)
      if [ "$gpus" -lt 2 ]; then
        echo "=== $name: skipped (needs two GPUs, $gpus visible)"
        summary+=("$name skipped: $gpus GPU(s)")
        continue
      fi ;;
    nvtx|nvtx_record)
      if [ "$dry" != 1 ] && [ ! -f "$recorder" ]; then bash tools/build_nvtx_recorder.sh > "$LOGS/build_nvtx_recorder.log" 2>&1; fi ;;
  esac
  case "$name" in
    tests) cmd=(python3 -m pytest -m gpu -q -p no:cacheprovider tests) ;;
    monitor) cmd=(python3 benchmarks/gpu_monitor.py --out "$RES/monitor_$tag.json" --tb-dir "$TB/monitor") ;;
    nvtx) cmd=(python3 benchmarks/gpu_nvtx.py --recorder "$recorder" --out "$RES/nvtx_$tag.json") ;;
    nvtx_record) cmd=(python3 benchmarks/gpu_nvtx.py --record-only --recorder "$recorder" --out "$RES/nvtx_recorder_$tag.json") ;;
    dali_focus) cmd=(python3 benchmarks/gpu_dali.py --focus --budget-s 300 --out "$RES/dali_focus_$tag.json") ;;
    advisor) cmd=(python3 benchmarks/gpu_advisor.py --budget-s 200 --out "$RES/advisor_$tag.json") ;;
    advisor_decode) cmd=(python3 benchmarks/gpu_advisor.py --only decode-bound --out "$RES/advisor_decode_$tag.json") ;;
    advisor_scenarios|idle) cmd=(python3 "benchmarks/gpu_${name}.py" --out "$RES") ;;
    compile) cmd=(python3 benchmarks/gpu_compile.py --budget-s "$(( ${SUITE_TIMEOUT:-400} - 70 ))" --out "$RES") ;;
    ddp) cmd=(env CUDA_VISIBLE_DEVICES="$two" python3 benchmarks/gpu_ddp.py --out "$RES") ;;
    ddp_scaling)
      checks="$RES/ddp_checks_${tag}x2.json"
      if [ -f "$checks" ]; then extra=(--checks "$checks"); else extra=(); fi
      cmd=(env CUDA_VISIBLE_DEVICES="$two" python3 benchmarks/gpu_ddp_scaling.py "${extra[@]}" --out "$RES") ;;
    parity) cmd=(python3 benchmarks/accuracy_parity.py --size gpu --out "$RES") ;;
    *) cmd=(python3 "benchmarks/gpu_${name}.py" --out "$RES/${name}_$tag.json") ;;
  esac
  echo "=== $name: ${cmd[*]}"
  if [ "$dry" = 1 ]; then continue; fi
  NVTX_RECORDER_LIB="$PWD/$recorder" timeout "${SUITE_TIMEOUT:-400}" "${cmd[@]}" > "$LOGS/$name.log" 2>&1
  rc=$?
  tail -n "${SUITE_TAIL:-25}" "$LOGS/$name.log"
  summary+=("$name rc=$rc $(( $(date +%s) - start ))s")
  tar czf "$OUT/bundle.tgz" -C /tmp/gpu_suite results logs tb 2>/dev/null
done
if [ "$dry" = 1 ]; then [ ${#summary[@]} -eq 0 ] || printf '%s\n' "${summary[@]}"; exit 0; fi
nvidia-smi --query-gpu=name,driver_version,memory.used,utilization.gpu --format=csv > "$LOGS/nvidia-smi.csv" 2>&1
tar czf "$OUT/bundle.tgz" -C /tmp/gpu_suite results logs tb
echo "=== summary"; printf '%s\n' "${summary[@]}"
