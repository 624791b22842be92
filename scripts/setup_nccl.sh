#!/usr/bin/env bash
# Installs NCCL's headers and library from the PyPI package nvidia-nccl-cu13
# (the same NCCL PyTorch's CUDA 13 wheels depend on) into a project-local
# prefix, for flashmix's optional expert-parallel component (flashmix_ep,
# spec §14). --no-deps: the package has none we need.
#
#   scripts/setup_nccl.sh [PREFIX]        (default: <repo>/.deps/nccl)
#
# Prints NCCL's root last (it has include/nccl.h and lib/libnccl.so.2); pass it to CMake:
#   cmake -S . -B build -DFLASHMIX_NCCL_DIR="$(scripts/setup_nccl.sh | tail -1)"
# At run time the process loads whatever libnccl.so.2 the loader finds first
# (PyTorch's, in a torch process); flashmix uses only NCCL's 2.19+ host API.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
prefix=${1:-"$repo/.deps/nccl"}
version=${FLASHMIX_NCCL_VERSION:-"2.*"}

nccl_root() {
  local d="$prefix/nvidia/nccl"
  [ -f "$d/include/nccl.h" ] && [ -f "$d/lib/libnccl.so.2" ] && echo "$d"
}

# shellcheck source=scripts/pip_target.sh
source "$repo/scripts/pip_target.sh"
nccl_root >/dev/null || pip_target "$prefix" "nvidia-nccl-cu13==$version"
dir=$(nccl_root) || { echo "setup_nccl.sh: no include/nccl.h + lib/libnccl.so.2 under $prefix/nvidia/nccl" >&2; exit 1; }
echo "$dir"
