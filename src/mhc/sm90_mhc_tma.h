// The TMA view of X shared by the sm_90a mHC kernels (host side).
#pragma once

#include <cuda.h>  // CUtensorMap and its enums only: the encoder comes through the runtime (no libcuda link)

#include "mhc/mhc_device.cuh"

namespace flashmix::mhc_detail {

// X as a 3-D tensor (columns, tokens, streams) with boxes of 64 columns x
// box_rows tokens x n streams, 128-byte swizzle; tokens past B read as
// zeros. Host-only work (capture-safe), done per launch because X moves.
// False when the driver's encoder is unavailable or rejects the shape.
bool encode_x_map(const ProjectParams& p, int n, int box_rows, CUtensorMap& map);

}  // namespace flashmix::mhc_detail
