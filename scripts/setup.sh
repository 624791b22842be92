#!/usr/bin/env bash
# Installs what building flashmix needs, from Debian's packages, when it is
# missing: a C++17 compiler, CMake >= 3.25, GoogleTest. The CUDA toolkit
# (nvcc 12.8+ with CCCL and cuBLAS; 13.0 is what we build with) must already
# be on the machine: it is not a Debian package here, so we only check for it.
set -euo pipefail
need=()
command -v cmake >/dev/null 2>&1 || need+=(cmake)
command -v g++ >/dev/null 2>&1 || need+=(g++)
command -v make >/dev/null 2>&1 || need+=(make)
dpkg -s libgtest-dev >/dev/null 2>&1 || need+=(libgtest-dev)
dpkg -s git >/dev/null 2>&1 || need+=(git)
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}"
fi
if ! command -v nvcc >/dev/null 2>&1; then
  for d in /usr/local/cuda/bin /usr/local/cuda-13.0/bin; do
    [ -x "$d/nvcc" ] && export PATH="$d:$PATH" && break
  done
fi
command -v nvcc >/dev/null 2>&1 || { echo "setup: nvcc (CUDA toolkit) not found; install CUDA 13 first" >&2; exit 1; }
"$(dirname "${BASH_SOURCE[0]}")/setup_cutlass.sh" >/dev/null || echo "setup: no CUTLASS headers (scripts/setup_cutlass.sh failed): moe_fc2_finalize is built without its CUTLASS kernels (its own kernel serves every mode)" >&2
"$(dirname "${BASH_SOURCE[0]}")/setup_nccl.sh" >/dev/null || echo "setup: no NCCL (scripts/setup_nccl.sh failed): flashmix is built without its expert-parallel component flashmix_ep" >&2
echo "setup: $(cmake --version | head -1); $(nvcc --version | tail -1)"
