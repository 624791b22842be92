#!/usr/bin/env bash
# Configures and builds flashmix (library, tests, flashmix-bench) into build/.
# Usage: scripts/build.sh [extra cmake args], e.g. -DFLASHMIX_CUDA_ARCHS=90a
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/scripts/setup.sh"
build=${FLASHMIX_BUILD_DIR:-$root/build}
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build "$build" -j "$(nproc)"
