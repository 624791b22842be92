#!/usr/bin/env bash
# On the device: FC2 kernel variants side by side. DIR holds one directory
# per build (flashmix-bench, optionally flashmix-bench-prof and
# flashmix_gpu_tests; scripts/tuning/profile_bench.sh links them from one tree
# with FC2_DEFS). For each build with a test binary: the FC2 GPU tests on
# our own kernel (rows); then scripts/tuning/ab_bench.sh over FILTER (ROUNDS rounds,
# interleaved); then, for each build with a profiling binary, the per-tile
# profile of the cases in FC2_PROFILE_CASES (fc2_profile_round.sh).
# SANITIZE_FILTER (a gtest filter): memcheck and racecheck on those tests too.
# VARIANT_TESTS (a gtest filter, default '*MoeFc2Gpu*') runs other tests
# instead (variants of another kernel: profile_bench.sh with SRC); a build's
# flashmix-bench-prof then runs FILTER once (its printed profile kept in
# OUT/<build>-prof.log) unless FC2_PROFILE_CASES is set.
# Usage: fc2_variant_round.sh DIR OUT FILTER ROUNDS BUILD...
set -uo pipefail
dir=${1:?}; out=${2:?}; filter=${3:?}; rounds=${4:?}; shift 4
status=0
for b in "$@"; do
  if [ -x "$dir/$b/flashmix_gpu_tests" ]; then
    echo "== $b: GPU tests ${VARIANT_TESTS:-*MoeFc2Gpu*}, FC2 on the rows kernel"
    FLASHMIX_TEST_FC2_KERNEL=rows "$dir/$b/flashmix_gpu_tests" --gtest_filter="${VARIANT_TESTS:-*MoeFc2Gpu*}" 2>&1 |
      grep -E "^\[  (FAILED|PASSED) |tests ran|Failure" | head -20
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    if [ -n "${SANITIZE_FILTER:-}" ]; then
      for tool in memcheck racecheck; do
        echo "== $b: $tool on $SANITIZE_FILTER (rows kernel)"
        FLASHMIX_TEST_FC2_KERNEL=rows compute-sanitizer --tool $tool --error-exitcode 99 "$dir/$b/flashmix_gpu_tests" \
          --gtest_filter="$SANITIZE_FILTER" 2>&1 | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^\[  (FAILED|PASSED) " | head -5
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      done
    fi
  fi
done
builds=()
for b in "$@"; do builds+=("$dir/$b"); done
scripts/tuning/ab_bench.sh "$out/ab" "$filter" "$rounds" "${builds[@]}" || status=1
for b in "$@"; do
  if [ -x "$dir/$b/flashmix-bench-prof" ] && [ -n "${FC2_PROFILE_CASES:-}" ]; then
    echo "== $b: profile"
    scripts/tuning/fc2_profile_round.sh "$dir/$b" "$out" 2>&1 | grep -v '^ *$'
  elif [ -x "$dir/$b/flashmix-bench-prof" ]; then
    echo "== $b: profiling build on $filter"
    "$dir/$b/flashmix-bench-prof" --filter "$filter" --no-verify > "$out/$b-prof.log" 2>&1 || status=1
    grep -E "^prof|^cycles|^timeline" "$out/$b-prof.log" | tail -24
  fi
done
exit $status
