#!/usr/bin/env bash
# Packs the GPU binaries of a build tree (flashmix_gpu_tests, flashmix-bench;
# debug info stripped), the copy-rate probe (bench/probes/copy_rates.cu,
# compiled here for sm_90a) and the layer timeline probe (layer_trace.cu) into .carry/<name>.tar.xz (git-ignored), the file a
# device run carries: ~8 MB against ~50 MB unpacked, so an A/B pair of builds
# fits the device tool's 64 MiB. On the device:
#   tar xJf .carry/<name>.tar.xz -C .carry  ->  .carry/<name>/{flashmix_gpu_tests,flashmix-bench,copy_rates,layer_trace}
# Usage: [STAGE_EP=0] scripts/stage_gpu_binaries.sh BUILD_DIR NAME
set -euo pipefail
build=${1:?usage: stage_gpu_binaries.sh BUILD_DIR NAME}
name=${2:?usage: stage_gpu_binaries.sh BUILD_DIR NAME}
root=$(cd "$(dirname "$0")/.." && pwd)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/$name" "$root/.carry"
cp "$build/tests/flashmix_gpu_tests" "$build/bench/flashmix-bench" "$stage/$name/"
# flashmix_ep's (built with NCCL): their tests and benchmark, one process per GPU.
# STAGE_EP=0 leaves them out (one-GPU runs: ~45 MB packed less).
for f in "$build/tests/flashmix_ep_gpu_tests" "$build/bench/flashmix-bench-ep"; do
  [ "${STAGE_EP:-1}" != 0 ] && [ -x "$f" ] && cp "$f" "$stage/$name/"
done
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
"$nvcc" -O3 -gencode=arch=compute_90a,code=sm_90a -o "$stage/$name/copy_rates" "$root/bench/probes/copy_rates.cu"
# The layer timeline probe (bench/probes/layer_trace.cu: CUPTI) against this build's library.
"$nvcc" -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I"$root/include" -o "$stage/$name/layer_trace" \
  "$root/bench/probes/layer_trace.cu" "$build/libflashmix.a" -lcupti -lcuda
strip --strip-debug "$stage/$name"/* 2>/dev/null || true
tar -C "$stage" -cf - "$name" | xz -6 -T0 > "$root/.carry/$name.tar.xz"
ls -l "$root/.carry/$name.tar.xz"
