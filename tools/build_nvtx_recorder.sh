#!/usr/bin/env bash
# Build the NVTX injection recorder used by tests/observe/test_nvtx.py and tests/gpu/test_nvtx_recorded.py
# (benchmarks/run_all.sh builds it before its GPU tests).
#
#   tools/build_nvtx_recorder.sh [OUT_DIR]        # default OUT_DIR: .nvtxrec  ->  .nvtxrec/librecorder.so
#
# Uses $CC (default cc) and the NVTX v3 headers vendored under tests/observe/nvtx3/, or the folder that
# contains nvtx3/ given by $NVTX3_INCLUDE_DIR (e.g. /usr/local/cuda/include). Run it from any directory.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out_dir="${1:-$repo/.nvtxrec}"
include="${NVTX3_INCLUDE_DIR:-$repo/tests/observe}"
mkdir -p "$out_dir"
"${CC:-cc}" -shared -fPIC -O2 -Wall -Wextra -I"$include" \
  "$repo/tests/observe/nvtx_recorder.c" -o "$out_dir/librecorder.so" -lpthread
echo "$out_dir/librecorder.so"
