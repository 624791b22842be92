#!/usr/bin/env bash
# The test command: builds everything (the Python binding too), then runs
# every test through CTest.
# CPU tests run everywhere; GPU tests (label `gpu`) run where there is a GPU
# and are reported as skipped (never as passed) where there is none.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# The Python binding and its tests are on here (nanobind, numpy, pytest and
# ml_dtypes from PyPI into .deps/python); -DFLASHMIX_PYTHON=OFF turns them off.
"$root/scripts/build.sh" -DFLASHMIX_PYTHON=ON "$@"
build=${FLASHMIX_BUILD_DIR:-$root/build}
cd "$build"
ctest --output-on-failure -j "$(nproc)"
