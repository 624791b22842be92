#!/usr/bin/env bash
# Profiles single launches of bench cases with Nsight Compute on a GPU machine
# (clocks left alone), one report per case, plus a text summary of each.
# Usage: scripts/tuning/ncu_cases.sh BIN_DIR OUT_DIR NAME=FILTER=KERNEL_REGEX [...]
#   BIN_DIR  holds flashmix-bench (or is the .tar.xz stage_gpu_binaries.sh packs)
#   NAME     the report's name under OUT_DIR (NAME.ncu-rep, NAME.txt)
#   FILTER   flashmix-bench --filter text selecting the case
#   KERNEL_REGEX  which kernel of the case to profile (ncu -k regex:...)
# Environment: NCU_SET (default "full"), NCU_SKIP (matching launches skipped
# first, default 5: past the verification and warm-up launches).
set -uo pipefail
bin=${1:?usage: ncu_cases.sh BIN_DIR OUT_DIR NAME=FILTER=KERNEL_REGEX ...}
out=${2:?usage: ncu_cases.sh BIN_DIR OUT_DIR NAME=FILTER=KERNEL_REGEX ...}
shift 2
mkdir -p "$out"
source "$(dirname "$0")/../bin_dir.sh"
bin=$(bin_dir "$bin")
status=0
for spec in "$@"; do
  IFS='=' read -r name filter kernel <<< "$spec"
  echo "== ncu $name ($filter, kernel $kernel)"
  ncu --clock-control none --set "${NCU_SET:-full}" --import-source yes -k "regex:$kernel" -s "${NCU_SKIP:-5}" -c 1 \
    -f -o "$out/$name" "$bin/flashmix-bench" --filter "$filter" --no-verify > "$out/$name.log" 2>&1 || status=1
  ncu -i "$out/$name.ncu-rep" --print-summary none --page details > "$out/$name.txt" 2>&1 || status=1
  grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Registers Per|Achieved Occupancy|Issued Warp|No Eligible|One or More" \
    "$out/$name.txt" | head -20
done
exit $status
