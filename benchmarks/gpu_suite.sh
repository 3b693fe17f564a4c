#!/usr/bin/env bash
# Run GPU benchmark scripts and GPU tests on a GPU machine, one after another, and pack everything
# (JSON results, logs, TensorBoard runs) into $OUT/bundle.tgz (the device tool brings back at most 8 files).
#
#   PYTHONPATH=/tmp/site:. bash benchmarks/gpu_suite.sh monitor compute nvtx ...
#
# Each name runs benchmarks/gpu_<name>.py --out $RES/<name>.json (see the case table below for
# exceptions); "tests" runs the gpu-marked pytest tests. A failing step does not stop the others.
set -u
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
RES=/tmp/gpu_suite/results; LOGS=/tmp/gpu_suite/logs; TB=/tmp/gpu_suite/tb
# /tmp may hold files of a previous run: start empty so the bundle holds this run only
rm -rf /tmp/gpu_suite
mkdir -p "$RES" "$LOGS" "$TB"
summary=()
for name in "$@"; do
  start=$(date +%s)
  case "$name" in
    tests) cmd=(python3 -m pytest -m gpu -q -p no:cacheprovider tests) ;;
    monitor) cmd=(python3 benchmarks/gpu_monitor.py --out "$RES/monitor_h200.json" --tb-dir "$TB/monitor") ;;
    nvtx) cmd=(python3 benchmarks/gpu_nvtx.py --recorder .nvtxrec/librecorder.so --out "$RES/nvtx_h200.json") ;;
    ladder) cmd=(python3 benchmarks/gpu_ladder.py --out "$RES/ladder_h200.json") ;;
    nvtx_record) cmd=(python3 benchmarks/gpu_nvtx.py --record-only --recorder .nvtxrec/librecorder.so --out "$RES/nvtx_recorder_h200.json") ;;
    dali_focus) cmd=(python3 benchmarks/gpu_dali.py --focus --budget-s 300 --out "$RES/dali_focus_h200.json") ;;
    advisor) cmd=(python3 benchmarks/gpu_advisor.py --budget-s 200 --out "$RES/advisor_h200.json") ;;
    advisor_decode) cmd=(python3 benchmarks/gpu_advisor.py --only decode-bound --out "$RES/advisor_decode_h200.json") ;;
    ddp) cmd=(env CUDA_VISIBLE_DEVICES=0,1 python3 benchmarks/gpu_ddp.py --out "$RES/ddp_h200x2.json") ;;
    *) cmd=(python3 "benchmarks/gpu_${name}.py" --out "$RES/${name}_h200.json") ;;
  esac
  echo "=== $name: ${cmd[*]}"
  NVTX_RECORDER_LIB="$PWD/.nvtxrec/librecorder.so" timeout "${SUITE_TIMEOUT:-400}" "${cmd[@]}" > "$LOGS/$name.log" 2>&1
  rc=$?
  tail -n "${SUITE_TAIL:-25}" "$LOGS/$name.log"
  summary+=("$name rc=$rc $(( $(date +%s) - start ))s")
  tar czf "$OUT/bundle.tgz" -C /tmp/gpu_suite results logs tb 2>/dev/null
done
nvidia-smi --query-gpu=name,driver_version,memory.used,utilization.gpu --format=csv > "$LOGS/nvidia-smi.csv" 2>&1
tar czf "$OUT/bundle.tgz" -C /tmp/gpu_suite results logs tb
echo "=== summary"; printf '%s\n' "${summary[@]}"
