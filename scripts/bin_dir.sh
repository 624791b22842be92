# Sourced by the GPU-machine scripts. bin_dir ARG prints the directory that
# holds flashmix-bench (and flashmix_gpu_tests): ARG itself, or, when ARG is
# the .tar.xz that scripts/stage_gpu_binaries.sh packs, where it unpacked.
bin_dir() {
  if [[ "$1" == *.tar.xz ]]; then
    local d
    d=$(mktemp -d)
    tar xJf "$1" -C "$d" || return 1
    find "$d" -name flashmix-bench -printf '%h\n' | head -n 1
  else
    echo "$1"
  fi
}
