// FC2 grouped GEMM on sm_90a on CUTLASS (Fc2GemmKernel::kCutlassCooperative
// and kCutlassPingpong): CUTLASS's ptr-array grouped GEMM (TMA loads, wgmma,
// warp-specialised persistent kernel, one launch for all experts) with our
// scatter epilogue (sm90_fc2_epilogue.cuh). This TU holds the prepare kernel
// and the launch of the pinned configuration; each configuration is its own
// TU. Built only when CUTLASS's headers are found (else sm90_fc2_stub.cpp).
// Which kernel runs is decided in moe_fc2_dispatch.cpp.
//
// Rows per expert are only known on the device (expert_first_token_offset),
// so a one-block prepare kernel writes the per-group problem shapes, operand
// pointers and strides into the workspace, and the grouped tile scheduler
// (host_problem_shapes = nullptr: sm_count persistent CTAs) walks them on the
// device: no host sync, capturable. Empty experts give no tiles; an expert's
// last tile runs its MMAs on padding rows (its row count is fixed at compile
// time), which is what our own kernel (sm90_fc2_rows_gemm.cu) avoids.
//
// Roofline: 2*P*H*I FLOPs (DeepSeek EP rank: 240 GFLOP, ~300 us at the ~800
// TFLOP/s dense cuBLAS reaches on an H200). Serves atomic_fp32 in the
// automatic choice: current figure (H200) DeepSeek EP atomic_fp32 ~1.68-1.71x
// a dense cuBLAS GEMM of equal FLOPs (bench records of 2026-11-24); design
// and measurements in docs/fc2_grouped_gemm.md.
#include <cuda_runtime.h>

#include <algorithm>

#include "moe/sm90_fc2_gemm_impl.cuh"

namespace flashmix {

// Configurations (kernel, name): schedule, CTA tile M x N (K tile 64), cluster.
//   kCutlassCooperative coop_128x256_c1: two consumer warpgroups on one
//                       128-row tile, 1x1 cluster
//   kCutlassPingpong    pp_64x256_c1: each consumer warpgroup its own 64-row
//                       tile, one's epilogue overlapping the other's
//                       mainloop, 1x1 cluster
// Other tiles and clusters were measured and dropped (docs/fc2_grouped_gemm.md).
#define FLASHMIX_FC2_CONFIGS(X)                       \
  X(Fc2GemmKernel::kCutlassCooperative, coop_128x256_c1) \
  X(Fc2GemmKernel::kCutlassPingpong, pp_64x256_c1)

#define FLASHMIX_FC2_DECLARE(ID, NAME)                           \
  size_t sm90_fc2_workspace_##NAME(int sm_count, int E);         \
  Status sm90_fc2_run_##NAME(const Sm90Fc2GemmParams& p, cudaStream_t stream);
FLASHMIX_FC2_CONFIGS(FLASHMIX_FC2_DECLARE)
#undef FLASHMIX_FC2_DECLARE

namespace {

constexpr const char* kOp = "moe_fc2_finalize";
using namespace sm90;

// One thread per expert: shapes, pointers and strides of its GEMM from the
// device-side row offsets.
__global__ void fc2_prepare_groups(Fc2GroupArrays g, const Fc2ElementA* A, const Fc2ElementB* W2,
                                   const int64_t* offsets, int E, int H, int I) {
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < E; e += gridDim.x * blockDim.x) {
    const int64_t first = offsets[e];
    const int M = int(offsets[e + 1] - first);
    g.shapes[e] = Fc2UnderlyingShape(M, H, I);
    g.ptr_A[e] = A + first * I;
    g.ptr_B[e] = W2 + int64_t(e) * H * I;
    Fc2StrideA sa{};
    cute::get<0>(sa) = I;
    Fc2StrideB sb{};
    cute::get<0>(sb) = I;
    g.stride_A[e] = sa;
    g.stride_B[e] = sb;
  }
}

}  // namespace

bool sm90_fc2_built_with_cutlass() { return true; }

size_t sm90_fc2_cutlass_workspace_bytes(int sm_count, int num_experts) {
  size_t bytes = 0;
#define FLASHMIX_FC2_WS(ID, NAME) bytes = std::max(bytes, sm90_fc2_workspace_##NAME(sm_count, num_experts));
  FLASHMIX_FC2_CONFIGS(FLASHMIX_FC2_WS)
#undef FLASHMIX_FC2_WS
  return bytes;
}

Status sm90_fc2_run_cutlass(const Sm90Fc2GemmParams& p, cudaStream_t stream) {
  Status (*run)(const Sm90Fc2GemmParams&, cudaStream_t) = nullptr;
  switch (p.kernel) {
#define FLASHMIX_FC2_CASE(KERNEL, NAME) \
  case KERNEL:                          \
    run = sm90_fc2_run_##NAME;          \
    break;
    FLASHMIX_FC2_CONFIGS(FLASHMIX_FC2_CASE)
#undef FLASHMIX_FC2_CASE
    default:
      return Status(StatusCode::kInvalidArgument,
                    detail::concat(kOp, ": tuning.gemm_kernel: ", to_string(p.kernel), " is not a CUTLASS kernel"));
  }
  Fc2GroupArrays g = fc2_group_arrays(p.group_ws, p.E);
  fc2_prepare_groups<<<(p.E + 127) / 128, 128, 0, stream>>>(g, static_cast<const Fc2ElementA*>(p.A),
                                                            static_cast<const Fc2ElementB*>(p.W2), p.offsets,
                                                            p.E, p.H, p.I);
  FM_RETURN_IF_ERROR(detail::check_launch(kOp));
  return run(p, stream);
}

}  // namespace flashmix
