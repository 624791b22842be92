#!/usr/bin/env bash
# W4A8 wide FC1 tiles (fc1-mx-wide.patch beside this file): the FC1 and
# layer GPU tests (MXFP4 and FP8), memcheck and racecheck of the new test,
# then an A/B of FLASHMIX_FC1_MX_WIDE=0|1|2 (old tile, loaders convert, consumers
# convert) over the V4-Flash layer cases, two rounds, one process each.
# OUT_DIR gets the JSONs and summary.txt (7 files: the device returns at
# most 8); the full logs stay in /tmp/mx-wide-logs.
# Usage (on the GPU machine): run.sh BIN OUT_DIR
#   BIN: a folder holding flashmix_gpu_tests and flashmix-bench of a build
#   with the patch applied, or a .tar.xz with them under bin/.
set -u
bin=${1:?usage: run.sh BIN OUT_DIR}
out=${2:?usage: run.sh BIN OUT_DIR}
mkdir -p "$out" /tmp/mx-wide-logs
logs=/tmp/mx-wide-logs
if [ -f "$bin" ]; then
  mkdir -p /tmp/mx-wide && tar -xJf "$bin" -C /tmp/mx-wide && bin=/tmp/mx-wide/bin
fi
{
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
echo "== tests"
timeout 300 "$bin/flashmix_gpu_tests" --gtest_brief=1 \
  --gtest_filter='MoeFc1Gpu.*:MoeForwardGpu.Mxfp4*:MoeForwardGpu.Fp8*' > "$logs/tests.log" 2>&1
echo "rc $?"
grep -E "^\[  (FAILED|PASSED|SKIPPED) |tests ran|Failure|Expected|Which is|gpu=|differ" "$logs/tests.log" | head -40
for tool in memcheck racecheck; do
  echo "== $tool"
  timeout 240 compute-sanitizer --tool $tool "$bin/flashmix_gpu_tests" --gtest_brief=1 \
    --gtest_filter='MoeFc1Gpu.Mxfp4WideTiles' > "$logs/$tool.log" 2>&1
  echo "rc $?"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$logs/$tool.log" | head -5
done
echo "== bench A/B"
for r in 1 2; do for v in 0 1 2; do
  FLASHMIX_FC1_MX_WIDE=$v timeout 150 "$bin/flashmix-bench" --filter v4flash_ep8_T --json "$out/mxw_r${r}_v$v.json" \
    > "$logs/bench_r${r}_v$v.log" 2>&1 || echo "bench r$r v$v failed"
done; done
python3 - "$out"/mxw_r*.json <<'PY'
import collections, json, re, sys
rows = collections.defaultdict(dict)
for f in sys.argv[1:]:
    m = re.search(r'_r(\d+)_v(\d+)\.json$', f)
    for x in json.load(open(f))['records']:
        rows[x['op'] + ' ' + x['case']].setdefault('v' + m.group(2), []).append(
            f"{x['median_us']:.1f}({x.get('check', '')[:6]})")
for k in sorted(rows):
    print(f"{k:45s} " + "  ".join(v + ": " + "/".join(rows[k][v]) for v in sorted(rows[k])))
PY
} 2>&1 | tee "$out/summary.txt"
