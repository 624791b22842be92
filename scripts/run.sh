#!/usr/bin/env bash
# The main job: builds flashmix, then runs flashmix-bench over the standard
# workloads, checking every case against the CPU reference, and writes
# bench/results/<gpu>-<date>.json. Without a GPU, flashmix-bench runs the CPU
# reference backend on small shapes and says so (no results file is kept).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/build.sh"
build=${FLASHMIX_BUILD_DIR:-$root/build}
if nvidia-smi -L >/dev/null 2>&1; then
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_')
  out="$root/bench/results/${gpu}-$(date -u +%Y%m%d-%H%M%S).json"
  "$build/bench/flashmix-bench" --json "$out" "$@"
else
  "$build/bench/flashmix-bench" "$@"
fi
