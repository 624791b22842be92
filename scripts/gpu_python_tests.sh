#!/usr/bin/env bash
# The Python binding's GPU tests on a GPU machine, built there: the binding is
# an extension module for that machine's Python (ABI), so it cannot be carried
# from the build machine. Uses that machine's python3 with nanobind, numpy,
# pytest and torch installed (scripts/setup_python.sh installs the first
# three where they are missing; torch is the caller's).
# Usage: [PYTEST=0] scripts/gpu_python_tests.sh BUILD_DIR [CUTLASS_INCLUDE_DIR]
#   BUILD_DIR            where to configure and build (fresh or reused)
#   CUTLASS_INCLUDE_DIR  has cutlass/cutlass.h (default: the project's .deps;
#                        without CUTLASS the FC2 tests run on the rows kernel)
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:?usage: gpu_python_tests.sh BUILD_DIR [CUTLASS_INCLUDE_DIR]}
cutlass=${2:-$root/.deps/cutlass/cutlass_library/source/include}
python3 -c "import nanobind, numpy, pytest" 2>/dev/null || "$root/scripts/setup_python.sh" >/dev/null || exit 1
# NCCL for flashmix_ep: FLASHMIX_NCCL_DIR, else the nvidia-nccl package beside torch (headers and library).
nccl=${FLASHMIX_NCCL_DIR:-$(python3 -c "import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])" 2>/dev/null)}
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release ${nccl:+-DFLASHMIX_NCCL_DIR="$nccl"} -DFLASHMIX_PYTHON=ON -DFLASHMIX_BUILD_BENCH=OFF -DFLASHMIX_BUILD_TESTS=OFF \
  -DFLASHMIX_CUDA_ARCHS="${FLASHMIX_CUDA_ARCHS:-90a}" -DFLASHMIX_CUTLASS_DIR="$cutlass" \
  -DPython_EXECUTABLE="$(command -v python3)" > "$build.configure.log" 2>&1 || { tail -30 "$build.configure.log"; exit 1; }
cmake --build "$build" --target flashmix_python -j "$(nproc)" > "$build.build.log" 2>&1 || { grep -m 20 -E "error" "$build.build.log"; tail -5 "$build.build.log"; exit 1; }
# PYTEST=0: build only (e.g. for bench/peers.py).
[ "${PYTEST:-1}" = 0 ] && exit 0
# pytest directly (the C++ test suites, and with them GoogleTest, are not built here).
PYTHONPATH="$build/python:$root/python${PYTHONPATH:+:$PYTHONPATH}" python3 -m pytest -p no:cacheprovider -q -rs \
  "$root/tests/python/test_binding_gpu.py" "$root/tests/python/test_binding_cpu.py" "$root/tests/python/test_ep_gpu.py"
