#!/usr/bin/env bash
# Links a flashmix-bench (or, with TARGET=flashmix_gpu_tests, the GPU test
# binary) whose FC2 rows kernel (sm90_fc2_rows_gemm.cu) is compiled with extra defines,
# from an already built tree, without touching it: the one object is
# recompiled into a copy of libflashmix.a.
# FC2_DEFS defaults to -DFLASHMIX_FC2_PROFILE (per-CTA cycle counts printed
# by the launch that FLASHMIX_FC2_PROFILE_LAUNCH names; scripts/tuning/fc2_profile.py
# sums them); any other -D of sm90_fc2_rows_gemm.cu can be given instead.
# SRC (another source file of the library, relative to the repository) and
# SRC_TARGET (the CMake target whose flags compile it, e.g.
# flashmix_mhc_sm90) recompile a different object the same way.
# Usage: [FC2_DEFS=...] [TARGET=...] [SRC=... SRC_TARGET=...] scripts/tuning/profile_bench.sh BUILD_DIR OUT_BINARY
set -euo pipefail
build=$(cd "${1:?usage: profile_bench.sh BUILD_DIR OUT_BINARY}" && pwd)
out=${2:?usage: profile_bench.sh BUILD_DIR OUT_BINARY}
defs=${DEFS:-${FC2_DEFS:--DFLASHMIX_FC2_PROFILE}}
target=${TARGET:-flashmix-bench}
case $target in
  flashmix-bench) dir=bench ;;
  flashmix_gpu_tests) dir=tests ;;
  *) echo "TARGET: flashmix-bench or flashmix_gpu_tests" >&2; exit 2 ;;
esac
root=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
src=${SRC:-src/moe/sm90_fc2_rows_gemm.cu}
src_target=${SRC_TARGET:-flashmix_fc2_sm90}
obj=$(basename "$src").o
flags=$(sed -n 's/^CUDA_FLAGS = //p' "$build/CMakeFiles/$src_target.dir/flags.make")
(cd "$build" && "$nvcc" --options-file "CMakeFiles/$src_target.dir/includes_CUDA.rsp" $flags \
  $defs -x cu -c "$root/$src" -o "$tmp/$obj")
cp "$build/libflashmix.a" "$tmp/libflashmix.a"
ar r "$tmp/libflashmix.a" "$tmp/$obj"
link=$(sed -e "s#\.\./libflashmix\.a#$tmp/libflashmix.a#" -e "s#-o $target#-o $(realpath -m "$out")#" \
  "$build/$dir/CMakeFiles/$target.dir/link.txt")
(cd "$build/$dir" && eval "$link")
ls -l "$out"
