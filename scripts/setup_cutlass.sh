#!/usr/bin/env bash
# Installs the CUTLASS/CuTe C++ headers the FC2 grouped GEMM is built on, from
# the PyPI package nvidia-cutlass (its wheel carries them under
# cutlass_library/source/include), into a project-local prefix. --no-deps: we
# need the headers only, not the Python stack it would pull in.
#
#   scripts/setup_cutlass.sh [PREFIX]       (default: <repo>/.deps/cutlass)
#
# Prints the include directory last; pass it to CMake:
#   cmake -S . -B build -DFLASHMIX_CUTLASS_DIR="$(scripts/setup_cutlass.sh | tail -1)"
# Any other CUTLASS 3.x/4.x checkout works too: point FLASHMIX_CUTLASS_DIR at its include/.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
prefix=${1:-"$repo/.deps/cutlass"}
version=${FLASHMIX_CUTLASS_VERSION:-"4.2.*"}

include_dir() {
  # The wheel's layout: <target>/cutlass_library/source/include/{cutlass,cute}
  local d="$prefix/cutlass_library/source/include"
  [ -f "$d/cutlass/cutlass.h" ] && [ -d "$d/cute" ] && echo "$d"
}

# shellcheck source=scripts/pip_target.sh
source "$repo/scripts/pip_target.sh"
include_dir >/dev/null || pip_target "$prefix" "nvidia-cutlass==$version"
dir=$(include_dir) || { echo "setup_cutlass.sh: no cutlass/cutlass.h under $prefix/cutlass_library/source/include" >&2; exit 1; }
echo "$dir"
