#!/usr/bin/env bash
# On the device: per-tile cycle profile of the FC2 rows kernel on a few cases
# (profiling build, scripts/tuning/profile_bench.sh) beside the same cases' times
# from the regular build. Usage: fc2_profile_round.sh DIR OUT [launch]
# DIR holds flashmix-bench and flashmix-bench-prof.
set -uo pipefail
dir=${1:?}; out=${2:?}; launch=${3:-10}
cases=${FC2_PROFILE_CASES:-"diag_deepseek_balanced_T1024_k8_E32_I2048_H7168 diag_deepseek_balanced_T1088_k8_E32_I2048_H7168 deepseek_ep_T1024_k8_E32_I2048_H7168 mixtral_T4096_k2_E8_I14336_H4096 qwen3moe_T4096_k8_E128_I768_H2048"}
for c in $cases; do
  echo "== $c"
  FLASHMIX_BENCH_FC2_TUNING=rows,0,0 FLASHMIX_FC2_PROFILE_LAUNCH=$launch "$dir/flashmix-bench-prof" --sweep --no-verify \
    --filter "moe_fc2/$c/atomic" --json /tmp/prof_$c.json > /tmp/prof_$c.log 2>&1
  grep -E "^moe_fc2" /tmp/prof_$c.log | head -2
  python3 scripts/tuning/fc2_profile.py /tmp/prof_$c.log ${FC2_PROFILE_KB:-0}
  FLASHMIX_BENCH_FC2_TUNING=rows,0,0 "$dir/flashmix-bench" --sweep --no-verify --filter "moe_fc2/$c/atomic" \
    --json /tmp/reg_$c.json 2>&1 | grep -E "^moe_fc2" | head -2
done
