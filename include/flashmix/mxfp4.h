// flashmix: MXFP4 weights (docs/spec.md §13): e2m1 codes, two per byte (the
// even element in the low nibble), one ue8m0 scale per 32 consecutive K
// elements; W[n, k] = e2m1(code) * 2^(S[n, k/32] - 127), NaN where S = 255.
// DeepSeek-V4's routed experts are stored this way.
//
// mxfp4_to_fp8_block: MXFP4 [batch, N, K] -> e4m3 [batch, N, K] with one fp32
//   scale per 128 x 128 block (the FP8 layer's weight format, spec §11.2) or
//   per row per 128 columns (1 x 128: what the W4A8 GEMMs will fold in):
//   the block's sub-block scales fold into the codes, scale 2^(e_max - 6),
//   q = e4m3(e2m1 * 2^(e - e_max + 6)); exact wherever e_max - e <= 14 (§13.2).
// mxfp4_to_bf16: MXFP4 [batch, N, K] -> bf16 [batch, N, K], the dequantised
//   value (exact unless it overflows bf16: scale byte 253 / 254, §13.4).
// stack_deepseek_v4_experts: DeepSeek-V4's per-expert w1 / w3 / w2 tensors
//   (host memory) -> flashmix's stacked W1 [E, 2I, H/2] / W2 [E, H, I/2]
//   with their scales (§13.6).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "flashmix/fp8.h"
#include "flashmix/moe_fc1.h"
#include "flashmix/status.h"

namespace flashmix {

struct Mxfp4ToFp8BlockArgs {
  const void* w = nullptr;         // packed e2m1 [batch, rows, cols / 2] bytes, dense; 16-byte aligned
  const void* w_scales = nullptr;  // ue8m0 [batch, rows, cols / 32] bytes, dense
  void* q = nullptr;               // e4m3 [batch, rows, cols], dense; 16-byte aligned
  float* q_scales = nullptr;       // fp32 [batch, ceil(rows / block rows), cols / 128], dense

  int64_t batch = 1;  // matrices (experts); 0 is valid (nothing launched)
  int64_t rows = 0;   // N per matrix; 0 is valid (nothing launched)
  int64_t cols = 0;   // K: a positive multiple of 128
  // The group that shares a scale (spec §13.2): k128x128 (default) for the
  // FP8 layer's weights; k1x128, one row's four sub-blocks (the W4A8 GEMMs' rule).
  Fp8Block block = Fp8Block::k128x128;

  bool enable_pdl = true;  // programmatic dependent launch with the neighbours on the stream
};

struct Mxfp4ToBf16Args {
  const void* w = nullptr;         // packed e2m1 [batch, rows, cols / 2] bytes, dense; 16-byte aligned
  const void* w_scales = nullptr;  // ue8m0 [batch, rows, cols / 32] bytes, dense
  void* out = nullptr;             // bf16 [batch, rows, cols], dense; 16-byte aligned

  int64_t batch = 1;
  int64_t rows = 0;
  int64_t cols = 0;  // K: a positive multiple of 32

  bool enable_pdl = true;
};

// GPU entry points: asynchronous on `stream`, no host synchronisation, no
// allocation, no workspace, capture-safe; device pointers; sm_80 or newer.
// Bitwise equal to the _cpu references.
Status mxfp4_to_fp8_block(const Mxfp4ToFp8BlockArgs& args, cudaStream_t stream);
Status mxfp4_to_bf16(const Mxfp4ToBf16Args& args, cudaStream_t stream);

// CPU references (written from the spec): host pointers, same validation.
Status mxfp4_to_fp8_block_cpu(const Mxfp4ToFp8BlockArgs& args);
Status mxfp4_to_bf16_cpu(const Mxfp4ToBf16Args& args);

// Host-side validation shared by both backends (no device access).
Status validate_mxfp4_to_fp8_block(const Mxfp4ToFp8BlockArgs& args);
Status validate_mxfp4_to_bf16(const Mxfp4ToBf16Args& args);

// One routed expert as DeepSeek-V4's checkpoint holds it (host memory; the
// bytes of torch.float4_e2m1fn_x2 / torch.float8_e8m0fnu tensors):
struct DeepSeekV4ExpertMxfp4 {
  const void* w1 = nullptr;        // gate: packed [I, H / 2]
  const void* w1_scale = nullptr;  //       ue8m0  [I, H / 32]
  const void* w3 = nullptr;        // up:   packed [I, H / 2]
  const void* w3_scale = nullptr;  //       ue8m0  [I, H / 32]
  const void* w2 = nullptr;        // down: packed [H, I / 2]
  const void* w2_scale = nullptr;  //       ue8m0  [H, I / 32]
};

struct StackDeepSeekV4ExpertsArgs {
  const DeepSeekV4ExpertMxfp4* experts = nullptr;  // [num_experts], the local experts in order
  int num_experts = 0;                             // E_local: 1..1024
  int64_t hidden = 0;                              // H: a positive multiple of 32
  int64_t inter = 0;                               // I: a positive multiple of 32
  Fc1WeightLayout layout = Fc1WeightLayout::kGateUp;  // W1's row order (spec §9.2)

  // Outputs (host memory, dense): spec §13.1's stacks.
  void* w1 = nullptr;         // packed [E, 2I, H / 2]
  void* w1_scales = nullptr;  // ue8m0  [E, 2I, H / 32]
  void* w2 = nullptr;         // packed [E, H, I / 2]
  void* w2_scales = nullptr;  // ue8m0  [E, H, I / 32]
};

// Host only (no CUDA): copies the bytes into the stacks, unchanged.
Status stack_deepseek_v4_experts(const StackDeepSeekV4ExpertsArgs& args);

}  // namespace flashmix
