// FC2 grouped GEMM on sm_90a: CUTLASS's ptr-array grouped GEMM (TMA loads,
// wgmma, warp-specialised persistent kernel, one launch for all experts) with
// our scatter epilogue (sm90_fc2_epilogue.cuh). This TU holds the prepare
// kernel and the choice of configuration; each configuration is its own TU.
//
// Rows per expert are only known on the device (expert_first_token_offset),
// so a one-block prepare kernel writes the per-group problem shapes, operand
// pointers and strides into the workspace, and the grouped tile scheduler
// (host_problem_shapes = nullptr: sm_count persistent CTAs) walks them on the
// device: no host sync, capturable. Empty experts give no tiles.
//
// Roofline: 2*P*H*I FLOPs (DeepSeek EP rank: 240 GFLOP, ~300 us at the
// ~800 TFLOP/s dense cuBLAS reaches on an H200); measured ratios in
// docs/fc2_grouped_gemm.md.
#include <cuda_runtime.h>

#include <algorithm>

#include "moe/sm90_fc2_gemm_impl.cuh"

namespace flashmix {

// Configurations (id, name): schedule, CTA tile M x N (K tile 64), cluster.
//   1 coop_128x256_c1: cooperative (two consumer warpgroups on one 128-row tile), 1x1
//   2 pp_64x256_c1:    pingpong (each consumer warpgroup its own 64-row tile; one's
//                      epilogue overlaps the other's mainloop), 1x1
//   3 rows_128xN:      our own kernel (sm90_fc2_rows_gemm.cu, no CUTLASS): 128 H
//                      columns x all rows of an expert (N picked per tile)
// Measured and dropped (H200, docs/fc2_grouped_gemm.md): cooperative 128x256
// with 1x2 and with 2x1 clusters, cooperative 256x128 1x2, pingpong 128x128
// with 1x1 and with 2x1 clusters, pingpong 64x256 with 1x2 and with 2x1
// clusters.
#define FLASHMIX_FC2_CONFIGS(X) \
  X(1, coop_128x256_c1)         \
  X(2, pp_64x256_c1)

#define FLASHMIX_FC2_DECLARE(ID, NAME)                           \
  size_t sm90_fc2_workspace_##NAME(int sm_count, int E);         \
  Status sm90_fc2_run_##NAME(const Sm90Fc2GemmParams& p, cudaStream_t stream);
FLASHMIX_FC2_CONFIGS(FLASHMIX_FC2_DECLARE)
Status sm90_fc2_run_rows_128xN(const Sm90Fc2GemmParams& p, cudaStream_t stream);

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

int sm90_fc2_num_configs() { return 3; }

size_t sm90_fc2_cutlass_workspace_bytes(int sm_count, int num_experts) {
  size_t bytes = 0;
#define FLASHMIX_FC2_WS(ID, NAME) bytes = std::max(bytes, sm90_fc2_workspace_##NAME(sm_count, num_experts));
  FLASHMIX_FC2_CONFIGS(FLASHMIX_FC2_WS)
#undef FLASHMIX_FC2_WS
  return bytes;
}

Status sm90_fc2_grouped_gemm(const Sm90Fc2GemmParams& p, cudaStream_t stream) {
  if (p.config == 3) return sm90_fc2_run_rows_128xN(p, stream);  // needs no group arrays
  Fc2GroupArrays g = fc2_group_arrays(p.group_ws, p.E);
  fc2_prepare_groups<<<(p.E + 127) / 128, 128, 0, stream>>>(g, static_cast<const Fc2ElementA*>(p.A),
                                                            static_cast<const Fc2ElementB*>(p.W2), p.offsets,
                                                            p.E, p.H, p.I);
  FM_RETURN_IF_ERROR(detail::check_launch(kOp));
  int config = p.config;
  if (config == 0) config = 1;  // automatic choice: see docs/fc2_grouped_gemm.md
  switch (config) {
#define FLASHMIX_FC2_CASE(ID, NAME) \
  case ID: return sm90_fc2_run_##NAME(p, stream);
    FLASHMIX_FC2_CONFIGS(FLASHMIX_FC2_CASE)
#undef FLASHMIX_FC2_CASE
  }
  return Status(StatusCode::kInvalidArgument, detail::concat(kOp, ": tuning.gemm_config: unknown configuration ", config));
}

}  // namespace flashmix
