#!/usr/bin/env bash
# Configures and builds flashmix (library, tests, flashmix-bench) into build/.
# Usage: scripts/build.sh [extra cmake args], e.g. -DFLASHMIX_CUDA_ARCHS=90a
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/scripts/setup.sh"
# -DFLASHMIX_PYTHON=ON (the Python binding and its tests) needs nanobind, numpy
# and pytest in .deps/python.
for arg in "$@"; do
  case "${arg^^}" in -DFLASHMIX_PYTHON=ON | -DFLASHMIX_PYTHON:BOOL=ON) "$root/scripts/setup_python.sh" >/dev/null ;; esac
done
build=${FLASHMIX_BUILD_DIR:-$root/build}
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build "$build" -j "$(nproc)"
