#!/usr/bin/env bash
# The test command: builds everything, then runs every test through CTest.
# CPU tests run everywhere; GPU tests (label `gpu`) run where there is a GPU
# and are reported as skipped (never as passed) where there is none.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/build.sh" "$@"
build=${FLASHMIX_BUILD_DIR:-$root/build}
cd "$build"
ctest --output-on-failure -j "$(nproc)"
