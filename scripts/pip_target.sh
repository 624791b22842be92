# Sourced by scripts/setup_cutlass.sh and scripts/setup_nccl.sh (the build's
# PyPI dependencies, each into a project-local prefix).
#   pip_target PREFIX SPEC   installs the package SPEC ("name==version") with
#                            pip's --target PREFIX and --no-deps (the files it
#                            carries, not the Python stack it would pull in);
#                            quiet, messages on stderr. PYTHON picks the
#                            interpreter (default python3).
pip_target() {
  local prefix=$1 spec=$2
  mkdir -p "$prefix"
  echo "installing $spec (--no-deps) into $prefix" >&2
  "${PYTHON:-python3}" -m pip install --quiet --no-deps --disable-pip-version-check --root-user-action=ignore --target "$prefix" "$spec" >&2
}
