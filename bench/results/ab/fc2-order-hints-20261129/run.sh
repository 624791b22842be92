#!/usr/bin/env bash
# FC2 experiment (patch bench/results/ab/fc2-order-hints-20261129/order-hints.patch):
# slice-major tile order (FLASHMIX_FC2_ORDER=1) and L2 hints, W2 evict-first /
# rows evict-last (FLASHMIX_FC2_HINTS=1). Tests with both on, then a 2-round A/B
# of the four variants over every moe_fc2 / moe_fc2_fp8 case.
set -u
mkdir -p /tmp/x && tar -xJf .carry/order.tar.xz -C /tmp/x
B=/tmp/x/bin
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
echo "== FC2 tests, slice-major + hints"
FLASHMIX_FC2_ORDER=1 FLASHMIX_FC2_HINTS=1 timeout 240 $B/flashmix_gpu_tests --gtest_brief=1 --gtest_filter='MoeFc2Gpu.*:MoeForwardGpu.*' > /tmp/t.log 2>&1; echo "rc $?"
grep -E "^\[  (FAILED|PASSED|SKIPPED) |tests ran|Failure" /tmp/t.log | head -20
echo "== bench A/B (order, hints)"
for r in 1 2; do
  for v in 00 10 01 11; do
    FLASHMIX_FC2_ORDER=${v:0:1} FLASHMIX_FC2_HINTS=${v:1:1} timeout 120 $B/flashmix-bench --no-verify --filter moe_fc2 --json $OUT/o_r${r}_v$v.json > /tmp/b_${r}_$v.log 2>&1 || echo "r$r v$v rc $?"
  done
done
python3 .carry/sum.py $OUT/o_*.json
