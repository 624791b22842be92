#!/usr/bin/env bash
# Packs the GPU binaries of a build tree (flashmix_gpu_tests, flashmix-bench;
# debug info stripped), the copy-rate probe (bench/probes/copy_rates.cu,
# compiled here for sm_90a) and the layer timeline probe (layer_trace.cu)
# into .carry/<name>.tar.xz (git-ignored), the file a device run carries. The
# binaries hold mostly the same kernels, so xz runs with a dictionary larger
# than all of them together (one thread: blocks would split it): the second
# and later binaries cost little (2026-11-28: tests + bench + a second bench
# of another build, 125 MB stripped, packed into 26 MB; the default `xz -6`
# made 51 MB of tests + bench alone). STAGE_EXTRA="PATH[:NAME] ..." adds
# more binaries (an A/B partner build's flashmix-bench, say) under NAME.
# On the device:
#   tar xJf .carry/<name>.tar.xz -C .carry  ->  .carry/<name>/{flashmix_gpu_tests,flashmix-bench,copy_rates,layer_trace,...}
# Usage: [STAGE_EP=0] [STAGE_EXTRA="PATH[:NAME] ..."] scripts/stage_gpu_binaries.sh BUILD_DIR NAME
set -euo pipefail
build=${1:?usage: stage_gpu_binaries.sh BUILD_DIR NAME}
name=${2:?usage: stage_gpu_binaries.sh BUILD_DIR NAME}
root=$(cd "$(dirname "$0")/.." && pwd)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/$name" "$root/.carry"
cp "$build/tests/flashmix_gpu_tests" "$build/bench/flashmix-bench" "$stage/$name/"
# flashmix_ep's (built with NCCL): their tests and benchmark, one process per GPU.
# STAGE_EP=0 leaves them out (one-GPU runs).
for f in "$build/tests/flashmix_ep_gpu_tests" "$build/bench/flashmix-bench-ep"; do
  [ "${STAGE_EP:-1}" != 0 ] && [ -x "$f" ] && cp "$f" "$stage/$name/"
done
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
"$nvcc" -O3 -gencode=arch=compute_90a,code=sm_90a -o "$stage/$name/copy_rates" "$root/bench/probes/copy_rates.cu"
# The layer timeline probe (bench/probes/layer_trace.cu: CUPTI) against this build's library.
"$nvcc" -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I"$root/include" -o "$stage/$name/layer_trace" \
  "$root/bench/probes/layer_trace.cu" "$build/libflashmix.a" -lcupti -lcuda
for extra in ${STAGE_EXTRA:-}; do
  src=${extra%%:*}
  dst=$(basename "$src")
  [ "$extra" != "$src" ] && dst=${extra#*:}
  cp "$src" "$stage/$name/$dst"
done
strip --strip-debug "$stage/$name"/* 2>/dev/null || true
tar -C "$stage" -cf - "$name" | xz -T1 --lzma2=preset=6,dict=256MiB > "$root/.carry/$name.tar.xz"
ls -l "$root/.carry/$name.tar.xz"
