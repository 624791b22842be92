// Internal to the FC1 op: the sm_90a kernel's entry point (sm90_fc1_gemm.cu).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "flashmix/moe.h"

namespace flashmix {

struct Sm90Fc1Params {
  const void* X;
  int64_t x_stride;  // elements (bf16 or e4m3)
  bool x_permuted;
  const void* W1;
  Fc1WeightLayout layout;
  const void* bias;  // bf16 [E, 2I] or nullptr
  MoeFp8Scaling fp8;       // kNone: X and W1 bf16; else e4m3 with these scales
  const float* x_scales;   // [X rows, H / 128] (kBlock) or [1] (kTensor)
  const float* w1_scales;  // [E, ceil(2I / 128), H / 128] (kBlock) or [E] (kTensor)
  MoeWeightFormat weights;       // kMxfp4: W1 packed e2m1 [E, 2I, H / 2] + ue8m0 w1_mx_scales [E, 2I, H / 32]
  const uint8_t* w1_mx_scales;
  const int64_t* offsets;
  const int32_t* p2u;
  int T, k, H, I, E;
  MoeActivation activation;
  float limit, alpha;  // resolved (the defaults filled in)
  void* out;          // bf16 rows, or e4m3 codes with out_scales
  void* out_scales;   // FP8 output (spec §9.8): [k*T, I / 128] float or ue8m0; null: bf16 out
  bool out_ue8m0;
  int sm_count;
  bool pdl;
};

// The most local experts the kernel's shared-memory tables hold.
constexpr int kFc1MaxExperts = 1024;

// Block-scaled FP8 with dense W1: the largest H (a tile's W1 scales, three
// a slice and K block for up to two slices, sit in shared memory).
constexpr int kFc1BlockMaxHidden = 54528;

// Whether the launcher takes wide tiles (256 W1 rows a stage, token rows as
// wgmma's M) for these operands: block-scaled FP8 with dense W1 once
// T k >= 256 E_local, bf16 with dense W1 whenever it gathers;
// FLASHMIX_FC1_WIDE=0|1 pins it (read on every call). moe_forward asks, to
// take FC1's FP8 output where the wide tile writes it (spec §10.4).
bool sm90_fc1_wide_tiles(MoeFp8Scaling fp8, MoeWeightFormat weights, bool x_permuted, int64_t T, int k, int E);

// Whether MXFP4 W1 with e4m3 X (W4A8) takes the wide tiles that fold the
// scales per 128 x 128 block (spec §13.7, docs/mxfp4.md §4.13): gate rows
// then up rows, I % 128 == 0, a permuted X, T k > 32 E_local;
// FLASHMIX_FC1_MX_WIDE=0 pins the other W4A8 tiles. Only these write the
// FP8 output with MXFP4 weights (validate_moe_fc1, moe_forward ask).
bool sm90_fc1_mx_wide_tiles(MoeFp8Scaling fp8, MoeWeightFormat weights, bool x_permuted, bool interleaved,
                            int64_t I, int64_t T, int k, int E);

// Launches the grouped GEMM on `stream`. Shapes as validated by
// validate_moe_fc1; kNotSupported when the TMA descriptors cannot be encoded
// or the device lacks the shared memory.
Status sm90_fc1_run(const Sm90Fc1Params& p, cudaStream_t stream);

}  // namespace flashmix
