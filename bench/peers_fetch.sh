#!/usr/bin/env bash
# Fetches the peer libraries bench/peers.py runs beside flashmix, on a machine
# that reaches PyPI, into two git-ignored folders of the working tree that the
# GPU machine (which reaches no registry) gets with the tree:
#   .whl/    tokenspeed-deepgemm (DeepGEMM's m-grouped GEMMs), the wheel as it is (~10 MB)
#   .peers/  sgl_kernel-<v>-sm90.tar.xz: only sgl_kernel/sm90/common_ops.abi3.so (the
#            sm_90 ops library: apply_shuffle_mul_sum, moe_sum_reduce, ...), version.py
#            and the licence, out of the ~380 MB sglang-kernel wheel (~13 MB packed)
#            triton_kernels-<v>.tar.xz: the same wheel's copy of OpenAI's triton_kernels/
#            package (pure Python + Triton: matmul_ogs with MXFP4 weights, ...), with the
#            wheel's licence and a PEER_SOURCE line naming the wheel (~70 KB packed)
# bench/peers_setup.sh unpacks them on the GPU machine. Not part of the build or CI.
# The versions are the newest that load under torch 2.11 (newer builds need
# torch >= 2.12; docs/peers.md).
# Usage: bench/peers_fetch.sh            (env: SGL_VERSION, DEEPGEMM_VERSION, PYTHON_VERSION)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
sgl_version=${SGL_VERSION:-0.4.5}
deepgemm_version=${DEEPGEMM_VERSION:-2.5.0.post20260604}
py=${PYTHON_VERSION:-3.12}  # the GPU machine's Python (DeepGEMM's wheel is per CPython version)
whl="$root/.whl"
peers="$root/.peers"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Keep both folders out of git (the exclude file is shared by every worktree of the clone).
exclude="$(git -C "$root" rev-parse --git-common-dir 2>/dev/null)/info/exclude" || exclude=
if [ -n "$exclude" ] && [ -d "$(dirname "$exclude")" ]; then
  for line in /.whl/ /.peers/; do
    grep -qxF "$line" "$exclude" 2>/dev/null || echo "$line" >> "$exclude"
  done
fi

python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$tmp" \
  "sglang-kernel==$sgl_version" "tokenspeed-deepgemm==$deepgemm_version"

mkdir -p "$whl" "$peers"
rm -f "$whl"/tokenspeed_deepgemm-*.whl "$peers"/sgl_kernel-*.tar.xz "$peers"/triton_kernels-*.tar.xz
cp "$tmp"/tokenspeed_deepgemm-*.whl "$whl/"

# sgl-kernel: the sm_90 ops library alone (the bindings are torch.ops.sgl_kernel.*,
# loaded by bench/peers_adapters.py; the wheel's Python package is not needed).
unzip -q "$tmp"/sglang_kernel-*.whl 'sgl_kernel/sm90/common_ops.abi3.so' 'sgl_kernel/version.py' -d "$tmp/sgl"
unzip -q -p "$tmp"/sglang_kernel-*.whl '*.dist-info/licenses/LICENSE' > "$tmp/sgl/sgl_kernel/LICENSE"
tar -C "$tmp/sgl" -cf - sgl_kernel | xz -T0 -6 > "$peers/sgl_kernel-$sgl_version-sm90.tar.xz"

# triton_kernels: the whole package as the wheel ships it (bench/peers_adapters.py imports it;
# it needs torch and triton, both on the GPU machine), the licence, and where it came from.
unzip -q "$tmp"/sglang_kernel-*.whl 'triton_kernels/*' -d "$tmp/tk"
unzip -q -p "$tmp"/sglang_kernel-*.whl '*.dist-info/licenses/LICENSE' > "$tmp/tk/triton_kernels/LICENSE"
echo "sglang-kernel==$sgl_version (its triton_kernels/ package, unchanged)" > "$tmp/tk/triton_kernels/PEER_SOURCE"
tar -C "$tmp/tk" -cf - triton_kernels | xz -T0 -6 > "$peers/triton_kernels-$sgl_version.tar.xz"

echo "peers_fetch: wrote"
du -h "$whl"/*.whl "$peers"/*.tar.xz
du -ch "$whl" "$peers" | tail -1
