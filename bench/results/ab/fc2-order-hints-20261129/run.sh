#!/usr/bin/env bash
# FC2 experiment (order-hints.patch beside this file): slice-major tile order
# (FLASHMIX_FC2_ORDER=1) and L2 hints, W2 evict-first / rows evict-last
# (FLASHMIX_FC2_HINTS=1). Tests with both on, then a 2-round A/B of the four
# variants over every moe_fc2 / moe_fc2_fp8 case, summarised per case.
# Usage (on the GPU machine): run.sh BIN OUT_DIR
#   BIN: a folder holding flashmix_gpu_tests and flashmix-bench of a build
#   with the patch applied, or a .tar.xz with them under bin/.
set -u
bin=${1:?usage: run.sh BIN OUT_DIR}
out=${2:?usage: run.sh BIN OUT_DIR}
mkdir -p "$out"
if [ -f "$bin" ]; then
  mkdir -p /tmp/order-hints && tar -xJf "$bin" -C /tmp/order-hints && bin=/tmp/order-hints/bin
fi
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
echo "== FC2 tests, slice-major + hints"
FLASHMIX_FC2_ORDER=1 FLASHMIX_FC2_HINTS=1 timeout 240 "$bin/flashmix_gpu_tests" --gtest_brief=1 \
  --gtest_filter='MoeFc2Gpu.*:MoeForwardGpu.*' > /tmp/order-hints-tests.log 2>&1
echo "rc $?"
grep -E "^\[  (FAILED|PASSED|SKIPPED) |tests ran|Failure" /tmp/order-hints-tests.log | head -20
echo "== bench A/B (order, hints)"
for r in 1 2; do
  for v in 00 10 01 11; do
    FLASHMIX_FC2_ORDER=${v:0:1} FLASHMIX_FC2_HINTS=${v:1:1} timeout 120 "$bin/flashmix-bench" --no-verify \
      --filter moe_fc2 --json "$out/o_r${r}_v$v.json" > "/tmp/order-hints-b_${r}_$v.log" 2>&1 || echo "r$r v$v rc $?"
  done
done
# Median time per case and variant (v<order><hints>), the rounds side by side.
python3 - "$out"/o_*.json <<'PY'
import collections, json, re, sys
rows = collections.defaultdict(dict)
for f in sys.argv[1:]:
    m = re.search(r'_r(\d+)_v(\d+)\.json$', f)
    for x in json.load(open(f))['records']:
        rows[x['op'] + ' ' + x['case']].setdefault(m.group(2), []).append(x['median_us'])
for k in sorted(rows):
    print(f"{k:70s} " + "  ".join(f"v{v}: " + "/".join(f"{t:.1f}" for t in rows[k][v]) for v in sorted(rows[k])))
PY
