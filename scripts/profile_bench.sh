#!/usr/bin/env bash
# Links a flashmix-bench (or, with TARGET=flashmix_gpu_tests, the GPU test
# binary) whose FC2 configuration-3 kernel is compiled with extra defines,
# from an already built tree, without touching it: the one object is
# recompiled into a copy of libflashmix.a.
# FC2_DEFS defaults to -DFLASHMIX_FC2_PROFILE (per-CTA cycle counts printed
# by the launch that FLASHMIX_FC2_PROFILE_LAUNCH names; scripts/fc2_profile.py
# sums them); any other -D of sm90_fc2_rows_gemm.cu can be given instead.
# Usage: [FC2_DEFS=...] [TARGET=...] scripts/profile_bench.sh BUILD_DIR OUT_BINARY
set -euo pipefail
build=$(cd "${1:?usage: profile_bench.sh BUILD_DIR OUT_BINARY}" && pwd)
out=${2:?usage: profile_bench.sh BUILD_DIR OUT_BINARY}
defs=${FC2_DEFS:--DFLASHMIX_FC2_PROFILE}
target=${TARGET:-flashmix-bench}
case $target in
  flashmix-bench) dir=bench ;;
  flashmix_gpu_tests) dir=tests ;;
  *) echo "TARGET: flashmix-bench or flashmix_gpu_tests" >&2; exit 2 ;;
esac
root=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
flags=$(sed -n 's/^CUDA_FLAGS = //p' "$build/CMakeFiles/flashmix_fc2_sm90.dir/flags.make")
(cd "$build" && "$nvcc" --options-file CMakeFiles/flashmix_fc2_sm90.dir/includes_CUDA.rsp $flags \
  $defs -x cu -c "$root/src/moe/sm90_fc2_rows_gemm.cu" -o "$tmp/sm90_fc2_rows_gemm.cu.o")
cp "$build/libflashmix.a" "$tmp/libflashmix.a"
ar r "$tmp/libflashmix.a" "$tmp/sm90_fc2_rows_gemm.cu.o"
link=$(sed -e "s#\.\./libflashmix\.a#$tmp/libflashmix.a#" -e "s#-o $target#-o $(realpath -m "$out")#" \
  "$build/$dir/CMakeFiles/$target.dir/link.txt")
(cd "$build/$dir" && eval "$link")
ls -l "$out"
