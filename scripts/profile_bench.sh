#!/usr/bin/env bash
# Links a flashmix-bench whose FC2 configuration-3 kernel is compiled with
# -DFLASHMIX_FC2_PROFILE (per-CTA cycle counts printed by the launch that
# FLASHMIX_FC2_PROFILE_LAUNCH names; scripts/fc2_profile.py sums them), from
# an already built tree, without touching it: the one object is recompiled
# into a copy of libflashmix.a.
# Usage: scripts/profile_bench.sh BUILD_DIR OUT_BINARY
set -euo pipefail
build=$(cd "${1:?usage: profile_bench.sh BUILD_DIR OUT_BINARY}" && pwd)
out=${2:?usage: profile_bench.sh BUILD_DIR OUT_BINARY}
root=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
flags=$(sed -n 's/^CUDA_FLAGS = //p' "$build/CMakeFiles/flashmix_fc2_sm90.dir/flags.make")
(cd "$build" && "$nvcc" --options-file CMakeFiles/flashmix_fc2_sm90.dir/includes_CUDA.rsp $flags \
  -DFLASHMIX_FC2_PROFILE -x cu -c "$root/src/moe/sm90_fc2_rows_gemm.cu" -o "$tmp/sm90_fc2_rows_gemm.cu.o")
cp "$build/libflashmix.a" "$tmp/libflashmix.a"
ar r "$tmp/libflashmix.a" "$tmp/sm90_fc2_rows_gemm.cu.o"
link=$(sed -e "s#\.\./libflashmix\.a#$tmp/libflashmix.a#" -e "s#-o flashmix-bench#-o $(realpath -m "$out")#" \
  "$build/bench/CMakeFiles/flashmix-bench.dir/link.txt")
(cd "$build/bench" && eval "$link")
ls -l "$out"
