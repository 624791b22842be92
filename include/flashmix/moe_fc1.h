// flashmix: MoE FC1 grouped GEMM with the gather and the gated activation
// fused (spec §9). For every local permuted row p of expert e (slot
// s = permuted_row_to_unpermuted_row[p], token t = s % T):
//   g = X[t] . W1[e, gate row i] + bias[e, gate row i]
//   u = X[t] . W1[e, up row i]   + bias[e, up row i]
//   out[p, i] = bf16(act(g, u))          for i in [0, I)
// in fp32, rounded once. `out` is exactly the A that moe_fc2_finalize takes.
// Included from flashmix/moe.h.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "flashmix/dtype.h"
#include "flashmix/fp8.h"
#include "flashmix/status.h"

namespace flashmix {

// The gated activation act(g, u), in fp32 (L = the limit, a = alpha):
enum class MoeActivation : int {
  // silu(g) * u = g / (1 + exp(-g)) * u  (Mixtral, Qwen3-MoE, DeepSeek-V3).
  kSwiGLU = 0,
  // gpt-oss: g' = min(g, L), u' = clamp(u, -L, L), g' * sigmoid(a * g') * (u' + 1);
  // L = 7, a = 1.702 by default.
  kSwiGLUOai = 1,
  // DeepSeek-V4's clamped SwiGLU: silu(min(g, L)) * clamp(u, -L, L); L = 10 by default.
  kSwiGLUClamped = 2,
};
// Clamps keep NaN (as torch.clamp does): a NaN g or u gives a NaN output.

// How each expert's 2I rows of W1 hold the gate and the up projections.
enum class Fc1WeightLayout : int {
  kGateUp = 0,       // rows [0, I) gate, rows [I, 2I) up (DeepSeek, Mixtral, Qwen: w1 then w3)
  kInterleaved = 1,  // row 2i gate i, row 2i + 1 up i (gpt-oss's gate_up_proj)
};

// FP8 inputs (spec §9.7; the formats: §11). X and W1 are both bf16 or both
// e4m3 (OCP E4M3, torch.float8_e4m3fn), with float32 scales:
enum class MoeFp8Scaling : int {
  kNone = 0,    // bf16 X and W1; no scales
  kBlock = 1,   // a scale per row of X per 128 channels, per 128 x 128 block of each W1[e]
  kTensor = 2,  // one scale for X, one per expert for W1 (the K sum stays in the FP8 MMA's accumulator)
};

// How the expert weights (W1 here, W2 in Fc2FinalizeArgs) are stored.
enum class MoeWeightFormat : int {
  kDense = 0,  // bf16, or e4m3 with `fp8`'s scales
  // MXFP4 (spec §13.1): packed e2m1 codes [E_local, N, K / 2] bytes (two a
  // byte, the even element in the low nibble) + ue8m0 scales [E_local, N, K
  // / 32] bytes (`w1_mx_scales`, `w2_mx_scales`); needs K % 128 == 0. The
  // activations choose the tensor cores (spec §13.7): fp8 = kBlock is W4A8
  // (X e4m3 with 1 x 128 scales; the weights converted to e4m3 in the kernel,
  // a row's four scales of each K block of 128 folded into one), fp8 = kNone
  // is W4A16 (X bf16; the weights converted to bf16). kTensor is invalid.
  kMxfp4 = 1,
};

const char* to_string(MoeActivation activation);     // "swiglu", "swiglu_oai", "swiglu_clamped"
const char* to_string(MoeWeightFormat format);       // "dense", "mxfp4"
const char* to_string(Fc1WeightLayout layout);       // "gate_up", "interleaved"
const char* to_string(MoeFp8Scaling scaling);        // "none", "block", "tensor"

struct MoeFc1Args {
  // The input, in token order: bf16 [T, x_stride]; row p of the GEMM reads
  // X[p2u[p] % T] (the gather is fused: no permuted copy is made). With
  // x_permuted, X is instead the caller's permuted copy [k*T capacity,
  // x_stride] and row p reads X[p].
  const void* X = nullptr;
  int64_t x_stride = 0;  // elements between rows; 0 means hidden; 16 bytes a multiple (8 bf16, 16 e4m3)
  bool x_permuted = false;

  const void* W1 = nullptr;  // bf16 (or e4m3) [E_local, 2I, H], K (= H) contiguous
  Fc1WeightLayout layout = Fc1WeightLayout::kGateUp;
  const void* bias = nullptr;  // bf16 [E_local, 2I] in W1's row order, or nullptr

  // FP8 (kBlock, kTensor): X and W1 hold e4m3 values; an element's value is
  // its e4m3 value times its scale (dequantised). kBlock needs H % 128 == 0.
  MoeFp8Scaling fp8 = MoeFp8Scaling::kNone;
  // kBlock: [rows of X, H / 128], dense (X's rows: T, or k*T with x_permuted);
  // kTensor: [1]. Ignored with kNone.
  const float* x_scales = nullptr;
  // kBlock: [E_local, ceil(2I / 128), H / 128], block (r / 128, h / 128) of
  // W1[e]'s rows r (in W1's own row order); kTensor: [E_local].
  const float* w1_scales = nullptr;

  // kMxfp4: W1 is packed e2m1 [E_local, 2I, H / 2] bytes (16-byte aligned)
  // and w1_mx_scales its ue8m0 scales [E_local, 2I, H / 32] (4-byte aligned),
  // rows in W1's own order; w1_scales is ignored. Needs H % 128 == 0.
  MoeWeightFormat weights = MoeWeightFormat::kDense;
  const void* w1_mx_scales = nullptr;

  const int64_t* expert_first_token_offset = nullptr;       // [E_local + 1] (device)
  const int32_t* permuted_row_to_unpermuted_row = nullptr;  // [k*T capacity], first P read, value j*T + t (device)

  int64_t num_tokens = 0;  // T (0 is valid: nothing is launched)
  int k = 0;               // 1..16
  int64_t hidden = 0;      // H, a multiple of 8
  int64_t inter = 0;       // I, a multiple of 8
  int num_experts_per_node = 0;  // E_local, 1..1024

  MoeActivation activation = MoeActivation::kSwiGLU;
  float limit = 0.f;  // kSwiGLUOai / kSwiGLUClamped clamp limit L; 0 = the model's (7 / 10); > 0 otherwise
  float alpha = 0.f;  // kSwiGLUOai's a; 0 = 1.702

  // Output: bf16 [k*T capacity, I], dense rows; rows [0, P) written, the rest
  // untouched (P = expert_first_token_offset[E_local], known on the device).
  void* out = nullptr;
  // Optional FP8 output (spec §9.8): with out_scales given, `out` receives
  // e4m3 codes [k*T capacity, I] (one byte an element) and out_scales one
  // scale per row per 128 columns [k*T capacity, I / 128] in out_scale_format:
  // the bf16 rows above quantised as quantize_fp8's 1 x 128 blocks, bitwise
  // (the bf16 rows are not written). FC2's FP8 input, with no pass between.
  // Needs fp8 = kBlock with dense (e4m3) weights and I % 128 == 0.
  void* out_scales = nullptr;
  ScaleFormat out_scale_format = ScaleFormat::kFloat32;

  bool enable_pdl = true;  // programmatic dependent launch with the neighbours on the stream
};

// GPU entry point: asynchronous on `stream`, no host synchronisation, no
// allocation, no workspace, safe to capture in a CUDA graph. sm_90a only
// (TMA + wgmma); other GPUs get kNotSupported. Device pointers.
Status moe_fc1(const MoeFc1Args& args, cudaStream_t stream);

// CPU reference (double accumulation, the activation in double, one rounding
// to bf16). Host pointers; same validation.
Status moe_fc1_cpu(const MoeFc1Args& args);

// Host-side validation shared by both backends (no device access).
Status validate_moe_fc1(const MoeFc1Args& args);

}  // namespace flashmix
