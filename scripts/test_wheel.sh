#!/usr/bin/env bash
# The Python package as a user installs it: `pip install` of a clean copy of
# the tracked files (pyproject.toml; CUTLASS headers fetched at configure
# time, as there is no .deps/ in the copy) into a fresh virtual environment,
# then the binding's CPU tests against the installed package (imported from
# site-packages, not from the source tree).
# Usage: scripts/test_wheel.sh [extra pip args]; FLASHMIX_WHEEL_ARCHS
# (default 90a) picks the CUDA architectures, to keep the build short.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python=${PYTHON:-python3}

mkdir -p "$work/src"
git -C "$root" ls-files -z | (cd "$root" && xargs -0 cp --parents -t "$work/src")
"$python" -m venv "$work/venv"
pip="$work/venv/bin/python -m pip --disable-pip-version-check"
$pip install --quiet "numpy>=1.24" "pytest>=7" "ml_dtypes>=0.3"
echo "pip install of a clean copy of the tree (log: the CMake messages below)"
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
  $pip install -v "$work/src" -C "cmake.define.FLASHMIX_CUDA_ARCHS=${FLASHMIX_WHEEL_ARCHS:-90a}" "$@" \
  > "$work/pip.log" 2>&1 || { tail -n 60 "$work/pip.log"; exit 1; }
grep -E -e "-- flashmix:" "$work/pip.log" || true
# The copy has no .deps/: the package build must have fetched CUTLASS itself,
# or its FC2 would be the stub.
grep -q "flashmix: FC2 grouped GEMM with CUTLASS from" "$work/pip.log" ||
  { echo "test_wheel.sh: the package was built without CUTLASS"; exit 1; }
cd "$work"  # not the source tree: `import flashmix` must find the installed package
"$work/venv/bin/python" -c "import flashmix, sys; print('flashmix', flashmix.__version__, 'from', flashmix.__file__)"
PYTHONPATH="$root/tests/python" "$work/venv/bin/python" -m pytest -p no:cacheprovider -q \
  "$root/tests/python/test_binding_cpu.py"
