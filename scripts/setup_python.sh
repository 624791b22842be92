#!/usr/bin/env bash
# Installs what the Python binding needs to build and test, from PyPI, into a
# project-local prefix (no root, nothing installed system-wide):
#   nanobind   the binding library (build time; CMake finds it through
#              `python -m nanobind --cmake_dir`)
#   numpy, pytest, ml_dtypes   the tests (ml_dtypes: bfloat16 numpy arrays for
#              the CPU backend)
# torch is not installed here: the binding builds without it, and the torch
# tests skip where it is missing. Idempotent: nothing is downloaded when the
# packages already import from the prefix.
#
#   scripts/setup_python.sh [PREFIX]       (default: <repo>/.deps/python)
#
# Prints the prefix last; put it on PYTHONPATH (CMake does that itself).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
prefix=${1:-"$repo/.deps/python"}
python=${PYTHON:-python3}
packages=("nanobind>=2.0,<3" "numpy>=1.24" "pytest>=7" "ml_dtypes>=0.3")

have_all() {
  PYTHONPATH="$prefix" "$python" - <<'PY' >/dev/null 2>&1
import nanobind, numpy, pytest, ml_dtypes
assert int(nanobind.__version__.split(".")[0]) >= 2
PY
}

if ! have_all; then
  mkdir -p "$prefix"
  echo "installing ${packages[*]} into $prefix" >&2
  "$python" -m pip install --quiet --disable-pip-version-check --no-warn-script-location --root-user-action=ignore \
    --upgrade --target "$prefix" "${packages[@]}" >&2
  have_all || { echo "setup_python.sh: the packages do not import from $prefix with $python" >&2; exit 1; }
fi
echo "$prefix"
