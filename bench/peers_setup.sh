#!/usr/bin/env bash
# On the GPU machine: installs the peers that bench/peers_fetch.sh left in
# .whl/ and .peers/ into one folder (default /tmp/site) to put on PYTHONPATH
# for bench/peers.py, and prints what it put where. Reaches no network (pip
# --no-index). A peer that is absent or fails to install is only reported:
# bench/peers.py then records it as missing.
# Usage: bench/peers_setup.sh [SITE_DIR]
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
site=${1:-/tmp/site}
mkdir -p "$site"
shopt -s nullglob
echo "peers_setup: $(python3 --version 2>&1) into $site"

wheels=("$root"/.whl/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --root-user-action=ignore --upgrade \
    --target "$site" "${wheels[@]}" || echo "peers_setup: pip install of ${wheels[*]##*/} FAILED"
else
  echo "peers_setup: no wheels in $root/.whl (bench/peers_fetch.sh fetches them)"
fi

packs=("$root"/.peers/*.tar.xz)
for pack in "${packs[@]}"; do
  tar -C "$site" -xJf "$pack" && echo "peers_setup: unpacked ${pack##*/}" || echo "peers_setup: unpacking ${pack##*/} FAILED"
done
[ ${#packs[@]} -gt 0 ] || echo "peers_setup: no packs in $root/.peers (bench/peers_fetch.sh makes them)"

echo "peers_setup: in $site:"
for entry in "$site"/*; do
  printf '  %-44s %s\n' "${entry##*/}" "$(du -sh "$entry" | cut -f1)"
done
for lib in "$site"/sgl_kernel/sm90/*.so "$site"/deep_gemm/_C*.so; do
  echo "  $lib"
done
if [ -d "$site/triton_kernels" ]; then
  echo "  $site/triton_kernels ($(cat "$site/triton_kernels/PEER_SOURCE" 2>/dev/null || echo 'source unknown'))"
  # It imports torch and triton: what the import says here is what bench/peers.py will report.
  PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" python3 -c 'import triton, triton_kernels.matmul_ogs
print("peers_setup: import triton_kernels.matmul_ogs: ok (triton %s)" % triton.__version__)' 2>&1 | tail -1
fi
