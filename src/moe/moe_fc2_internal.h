// Internal to the FC2 op: the workspace layout (host-computed, shared by the
// size query and the launcher) and the sm_90a GEMM entry points (ours,
// always built, and CUTLASS's, built when its headers are found). Nothing
// here needs CUTLASS.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "flashmix/moe.h"

namespace flashmix {

// validate_moe_fc2_finalize with check_buffers = false checks the sizes only,
// not the buffers (presence, alignment, overlap): the workspace size query
// needs sizes only, and callers may ask before allocating.
Status validate_fc2(const Fc2FinalizeArgs& a, bool check_buffers);

// What the epilogue does with a row p's accumulator (one GEMM instantiation
// serves all modes; the mode is uniform per launch, so the branch is free).
enum class Fc2EpilogueOp : int {
  kRedBf16 = 0,       // red.add bf16x2 of w*(acc+bias) into out[t] (k == 1: st)
  kRedFp32 = 1,       // red.add v2.f32 of w*(acc+bias) into acc32[t]
  kRowsFp32Scaled = 2,  // st fp32 w*(acc+bias) into rows[p]
  kRowsBf16 = 3,      // st bf16 acc into rows[p] (unscaled, no bias: finalize applies them)
};

struct Sm90Fc2GemmParams {
  const void* A;
  const void* W2;
  const int64_t* offsets;
  const int32_t* p2u;
  const float* scales;
  const void* bias;  // nullptr when not applied
  MoeFp8Scaling fp8;      // kNone: A and W2 bf16; else e4m3 with these scales (kRows only)
  const float* a_scales;  // [k*T capacity, I / 128] (kBlock) or [1] (kTensor)
  const float* w2_scales; // [E, ceil(H / 128), I / 128] (kBlock) or [E] (kTensor)
  MoeWeightFormat weights;      // kMxfp4: W2 packed e2m1 [E, H, I / 2] + ue8m0 w2_mx_scales [E, H, I / 32]
  const uint8_t* w2_mx_scales;
  int T, k, H, I, E;
  Fc2EpilogueOp op;
  void* dst;             // out (kRedBf16), acc32 (kRedFp32), rows (kRows*)
  int64_t dst_stride;    // elements
  void* group_ws;        // kFc2GroupBytesPerExpert * E bytes
  void* cutlass_ws;
  size_t cutlass_ws_bytes;
  int sm_count;
  Fc2GemmKernel kernel;  // as chosen by choose_fc2_gemm_kernel (never kAuto)
  bool vec16;   // dst and dst_stride allow 16-byte accesses
  bool add_to_out;  // kRedBf16: out holds the caller's zeros or residual, so k == 1 adds too (no plain stores)
  bool raster_along_n;  // tile order: N fastest (else M fastest: the M tiles of a W2 slice together)
  int swizzle;          // scheduler swizzle 1, 2, 4 or 8
};

// What either GEMM's epilogue needs (the CUTLASS configurations' and ours).
struct Fc2EpilogueParamsDevice {
  const int64_t* offsets = nullptr;
  const int32_t* p2u = nullptr;
  const float* scales = nullptr;
  const __nv_bfloat16* bias = nullptr;
  void* dst = nullptr;
  int64_t dst_stride = 0;
  int T = 0, k = 0, H = 0;
  int op = 0;  // Fc2EpilogueOp
  bool vec16 = false;  // dst and dst_stride allow 16-byte accesses
  bool add_to_out = false;  // kRedBf16 with k == 1 adds (out holds the caller's residual)
};

inline Fc2EpilogueParamsDevice fc2_epilogue_params(const Sm90Fc2GemmParams& p) {
  Fc2EpilogueParamsDevice e;
  e.offsets = p.offsets;
  e.p2u = p.p2u;
  e.scales = p.scales;
  e.bias = static_cast<const __nv_bfloat16*>(p.bias);
  e.dst = p.dst;
  e.dst_stride = p.dst_stride;
  e.T = p.T;
  e.k = p.k;
  e.H = p.H;
  e.op = int(p.op);
  e.vec16 = p.vec16;
  e.add_to_out = p.add_to_out;
  return e;
}

constexpr size_t kFc2GroupBytesPerExpert = 6 * 16;  // shapes, ptr A/B, stride A/B, spare

// The workspace size query sizes for this many SMs, the most any sm_90 GPU
// has (a full GH100), so its answer is valid on every device; the op lays
// the workspace out for the current device's count, which needs no more.
constexpr int kFc2MaxSmCount = 144;

// The most local experts our own kernel takes (its shared-memory tables).
constexpr int kFc2RowsMaxExperts = 1024;

// Our own kernel (sm90_fc2_rows_gemm.cu, Fc2GemmKernel::kRows): needs no
// group arrays nor CUTLASS workspace.
Status sm90_fc2_run_rows(const Sm90Fc2GemmParams& p, cudaStream_t stream);

// CUTLASS's grouped GEMM (sm90_fc2_grouped_gemm.cu; sm90_fc2_stub.cpp in
// builds without CUTLASS, which answer false / 0 / kNotSupported).
bool sm90_fc2_built_with_cutlass();
// Bytes CUTLASS's kernels need (per-SM tensormaps, scheduler); 0 without CUTLASS.
size_t sm90_fc2_cutlass_workspace_bytes(int sm_count, int num_experts);
// Fills the group arrays on the device and launches p.kernel
// (kCutlassCooperative or kCutlassPingpong).
Status sm90_fc2_run_cutlass(const Sm90Fc2GemmParams& p, cudaStream_t stream);

struct Fc2WorkspaceLayout {
  size_t group = 0, cutlass = 0, rows = 0, u2p = 0, experts = 0, acc32 = 0;
  size_t cutlass_bytes = 0;
  size_t total = 0;
};
Fc2WorkspaceLayout fc2_workspace_layout(const Fc2FinalizeArgs& a, int sm_count);

}  // namespace flashmix
