#!/usr/bin/env bash
# DeepGEMM's block-FP8 m-grouped GEMM and flashmix's FC2 FP8 kernel under ncu
# on the same FC2 shape, in one device call (docs/fc2_grouped_gemm.md, open
# target "FP8 block scales behind DeepGEMM"): speed of light, scheduler and
# warp-state sections of one launch of each, side by side. Needs torch and
# the peers that bench/peers_fetch.sh leaves in .whl/ (unpacked here by
# bench/peers_setup.sh), and a flashmix-bench; not the Python binding.
# DeepGEMM runs through bench/probes/deepgemm_fp8_grouped.py (equal rows an
# expert, no padding), flashmix through the bench's `atomic` case (the
# environment passes through: FLASHMIX_FC2_FP8_ROWS_M=1 pins the
# token-rows-as-M tile). With warp-state sampling per SASS instruction
# (SourceCounters): OUT_DIR/{deepgemm,flashmix}_sass.csv.gz, summarised by
# bench/probes/sass_stalls.py (which warps wait where, on which barrier).
# Usage: bench/probes/ncu_fc2_fp8_vs_deepgemm.sh FLASHMIX_BENCH OUT_DIR [deepseek_ep|mixtral|qwen3]
set -uo pipefail
bench=${1:?usage: ncu_fc2_fp8_vs_deepgemm.sh FLASHMIX_BENCH OUT_DIR [SHAPE]}
out=${2:?usage: ncu_fc2_fp8_vs_deepgemm.sh FLASHMIX_BENCH OUT_DIR [SHAPE]}
shape=${3:-deepseek_ep}
root=$(cd "$(dirname "$0")/../.." && pwd)
case "$shape" in
  deepseek_ep) case_name=deepseek_ep_T1024_k8_E32_I2048_H7168 ;;
  mixtral) case_name=mixtral_T4096_k2_E8_I14336_H4096 ;;
  qwen3) case_name=qwen3moe_T4096_k8_E128_I768_H2048 ;;
  *) echo "ncu_fc2_fp8_vs_deepgemm: unknown shape $shape" >&2; exit 2 ;;
esac
mkdir -p "$out"
bash "$root/bench/peers_setup.sh" /tmp/site > "$out/peers_setup.log" 2>&1
sections=(--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis
          --section SchedulerStats --section WarpStateStats --section Occupancy --section SourceCounters)
# Skip the JIT warm-up call and the accuracy check's launches: the first timed call.
PYTHONPATH=/tmp/site timeout 240 ncu --clock-control none -k regex:sm90_fp8_gemm_1d2d --launch-skip 2 --launch-count 1 \
  "${sections[@]}" -o "$out/deepgemm" python3 "$root/bench/probes/deepgemm_fp8_grouped.py" "fc2_$shape" \
  > "$out/deepgemm.log" 2>&1 ||
  echo "ncu_fc2_fp8_vs_deepgemm: the DeepGEMM run failed (see $out/deepgemm.log)"
timeout 240 ncu --clock-control none -k regex:fc2_rows_gemm_kernel --launch-skip 2 --launch-count 1 "${sections[@]}" \
  -o "$out/flashmix" "$bench" --filter "moe_fc2_fp8/$case_name/atomic" --quick --no-verify > "$out/flashmix.log" 2>&1 ||
  echo "ncu_fc2_fp8_vs_deepgemm: the flashmix run failed (see $out/flashmix.log)"
for f in deepgemm flashmix; do
  [ -f "$out/$f.ncu-rep" ] || continue
  ncu -i "$out/$f.ncu-rep" --page details > "$out/$f.txt" 2>&1
  ncu -i "$out/$f.ncu-rep" --page source --print-source sass --csv 2>/dev/null | gzip > "$out/${f}_sass.csv.gz"
  rm -f "$out/$f.ncu-rep"
  echo "== $f"
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|Issue Slots Busy|Warp Cycles Per Issued|Executed Ipc Active|Achieved Occupancy|Registers Per Thread" "$out/$f.txt" | sed 's/  */ /g'
  python3 "$root/bench/probes/sass_stalls.py" "$out/${f}_sass.csv.gz" --top 12 | sed 's/^/   /'
done
