#!/usr/bin/env bash
# Copies the GPU binaries of a build tree into .carry/<name>/ (git-ignored), the
# folder a device run carries. Usage: scripts/stage_gpu_binaries.sh BUILD_DIR NAME
set -euo pipefail
build=${1:?usage: stage_gpu_binaries.sh BUILD_DIR NAME}
name=${2:?usage: stage_gpu_binaries.sh BUILD_DIR NAME}
root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/.carry/$name"
rm -rf "$dest" && mkdir -p "$dest"
cp "$build/tests/flashmix_gpu_tests" "$build/bench/flashmix-bench" "$dest/"
strip --strip-debug "$dest"/* 2>/dev/null || true
du -sh "$dest"
