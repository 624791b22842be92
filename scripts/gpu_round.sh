#!/usr/bin/env bash
# One whole GPU round on a machine with an NVIDIA GPU, in one go:
#   1. the GPU tests (and the FC2 ones again with every mode on our own GEMM),
#   2. compute-sanitizer memcheck and racecheck on them,
#   3. flashmix-bench over the standard workloads with verification (JSON),
#   4. where BIN_DIR has it, the copy-rate probe's `l2mix` mode (bench/probes).
# Usage: scripts/gpu_round.sh BIN_DIR OUT_DIR [bench args...]
#   BIN_DIR holds flashmix_gpu_tests and flashmix-bench (built elsewhere is
#   fine), or is the .tar.xz that scripts/stage_gpu_binaries.sh packs them in.
# Environment: TEST_FILTER (gtest filter for the test run, default: all),
#   SANITIZE_FILTER (gtest filter for the sanitizer runs, default: all but the
#   largest cases and the tests that provoke a CUDA API error on purpose, which
#   memcheck would report), RACECHECK_FILTER (racecheck's own filter, default
#   SANITIZE_FILTER: racecheck over all of it outlasts a 10-minute device call),
#   STEP_TIMEOUT (seconds per step, default 540, so that a slow step leaves the
#   logs of the others), SKIP_SANITIZER=1, SKIP_BENCH=1, SKIP_TESTS=1,
#   SKIP_PROBES=1. The whole test suite alone runs past 7 minutes on an H200
#   (2026-11-28: mostly the mHC shape sweeps), so a round does not fit one
#   10-minute device call: split it over calls (SKIP_* per step), and the
#   tests themselves with googletest's own sharding, GTEST_TOTAL_SHARDS=2
#   GTEST_SHARD_INDEX=0 (then 1), which the test binary reads.
set -uo pipefail
bin=${1:?usage: gpu_round.sh BIN_DIR OUT_DIR [bench args...]}
out=${2:?usage: gpu_round.sh BIN_DIR OUT_DIR [bench args...]}
shift 2
mkdir -p "$out"
source "$(dirname "$0")/bin_dir.sh"
bin=$(bin_dir "$bin")
status=0
to="timeout ${STEP_TIMEOUT:-540}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$out/gpu.txt"

if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== GPU tests"
  $to "$bin/flashmix_gpu_tests" --gtest_filter="${TEST_FILTER:-*}" 2>&1 | tee "$out/gpu_tests.log" | grep -E "^\[  (FAILED|PASSED|SKIPPED) |tests ran|Failure|error" | head -60
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "GPU TESTS FAILED"; status=1; }
  # The FC2 tests once more with every mode on our own GEMM (the rows kernel;
  # by default atomic_fp32 runs on CUTLASS). Part of a full run, or of one whose
  # TEST_FILTER names the FC2 tests.
  case "${TEST_FILTER:-*}" in
    "*" | *MoeFc2*)
      echo "== FC2 GPU tests on the rows kernel"
      FLASHMIX_TEST_FC2_KERNEL=rows $to "$bin/flashmix_gpu_tests" --gtest_filter='*MoeFc2Gpu*' 2>&1 \
        | tee "$out/gpu_tests_fc2_rows.log" | grep -E "^\[  (FAILED|PASSED|SKIPPED) |tests ran|Failure|error" | head -20
      [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "FC2 ROWS KERNEL TESTS FAILED"; status=1; }
      ;;
  esac
fi

if [ -z "${SKIP_SANITIZER:-}" ]; then
  filter=${SANITIZE_FILTER:-"-*ManyTokens*:*OneTokenAndDecodeSizes*:*InvalidatedCapture*:*CudaErrorState*"}
  for tool in memcheck racecheck; do
    f=$filter
    [ "$tool" = racecheck ] && f=${RACECHECK_FILTER:-$filter}
    echo "== compute-sanitizer $tool ($f)"
    $to compute-sanitizer --tool "$tool" --error-exitcode 99 "$bin/flashmix_gpu_tests" --gtest_filter="$f" \
      > "$out/sanitizer_$tool.log" 2>&1
    rc=$?
    tail -n 3 "$out/sanitizer_$tool.log"
    [ $rc -eq 0 ] || { echo "SANITIZER $tool FAILED (rc $rc)"; grep -m 20 -E "=====|FAILED" "$out/sanitizer_$tool.log"; status=1; }
  done
fi

if [ -z "${SKIP_BENCH:-}" ]; then
  echo "== flashmix-bench"
  $to "$bin/flashmix-bench" --json "$out/bench.json" "$@" 2>&1 | tee "$out/bench.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "BENCH CHECKS FAILED"; status=1; }
fi
if [ -z "${SKIP_PROBES:-}" ] && [ -x "$bin/copy_rates" ]; then
  echo "== copy_rates l2mix (bench/probes)"
  $to "$bin/copy_rates" l2mix 2>&1 | tee "$out/probe_l2mix.log"
fi
exit $status
