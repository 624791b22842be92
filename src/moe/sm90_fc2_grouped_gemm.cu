// FC2 grouped GEMM on sm_90a: CUTLASS's ptr-array grouped GEMM (TMA loads,
// wgmma, warp-specialised persistent cooperative kernel, one launch for all
// experts) with our scatter epilogue (sm90_fc2_epilogue.cuh).
//
// Rows per expert are only known on the device (expert_first_token_offset),
// so a one-block prepare kernel writes the per-group problem shapes, operand
// pointers and strides into the workspace, and the grouped tile scheduler
// (host_problem_shapes = nullptr: sm_count persistent CTAs) walks them on the
// device: no host sync, capturable. Empty experts give no tiles.
//
// Roofline: 2*P*H*I FLOPs (DeepSeek EP rank: 240 GFLOP, ~300 us at the
// ~800 TFLOP/s dense cuBLAS reaches); measured ratios in docs/fc2_grouped_gemm.md.
#include <cuda_runtime.h>

#include "common/check.h"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "moe/moe_fc2_internal.h"
#include "moe/sm90_fc2_epilogue.cuh"

namespace flashmix {

namespace {

using namespace cute;
constexpr const char* kOp = "moe_fc2_finalize";

using ElementA = cutlass::bfloat16_t;
using ElementB = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;     // A_e [M_e, I], K contiguous
using LayoutB = cutlass::layout::ColumnMajor;  // W2[e] as [N=H, K=I], K contiguous
constexpr int kAlign = 8;                      // 16 bytes of bf16
using kTileShape = Shape<_128, _256, _64>;
using kClusterShape = Shape<_1, _1, _1>;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;

using CollectiveEpilogue =
    cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<sm90::Fc2ScatterEpilogue>;
using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA*, kAlign, ElementB, LayoutB*, kAlign,
    float, kTileShape, kClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename CollectiveEpilogue::SharedStorage))>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

using StrideA = typename Gemm::GemmKernel::InternalStrideA;
using StrideB = typename Gemm::GemmKernel::InternalStrideB;
using UnderlyingShape = ProblemShape::UnderlyingProblemShape;

static_assert(sizeof(UnderlyingShape) <= 16 && sizeof(StrideA) <= 16 && sizeof(StrideB) <= 16,
              "group arrays are laid out 16 bytes per entry");

struct GroupArrays {
  UnderlyingShape* shapes;
  const ElementA** ptr_A;
  const ElementB** ptr_B;
  StrideA* stride_A;
  StrideB* stride_B;
};

GroupArrays group_arrays(void* ws, int E) {
  char* b = static_cast<char*>(ws);
  GroupArrays g;
  g.shapes = reinterpret_cast<UnderlyingShape*>(b);
  g.ptr_A = reinterpret_cast<const ElementA**>(b + 16 * size_t(E));
  g.ptr_B = reinterpret_cast<const ElementB**>(b + 32 * size_t(E));
  g.stride_A = reinterpret_cast<StrideA*>(b + 48 * size_t(E));
  g.stride_B = reinterpret_cast<StrideB*>(b + 64 * size_t(E));
  return g;
}

// One thread per expert: shapes, pointers and strides of its GEMM from the
// device-side row offsets.
__global__ void fc2_prepare_groups(GroupArrays g, const ElementA* A, const ElementB* W2, const int64_t* offsets,
                                   int E, int H, int I) {
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < E; e += gridDim.x * blockDim.x) {
    const int64_t first = offsets[e];
    const int M = int(offsets[e + 1] - first);
    g.shapes[e] = UnderlyingShape(M, H, I);
    g.ptr_A[e] = A + first * I;
    g.ptr_B[e] = W2 + int64_t(e) * H * I;
    StrideA sa{};
    get<0>(sa) = I;  // row-major [M_e, I]: (I, 1, 0)
    StrideB sb{};
    get<0>(sb) = I;  // W2[e] as [H, I], K contiguous: (I, 1, 0)
    g.stride_A[e] = sa;
    g.stride_B[e] = sb;
  }
}

typename Gemm::Arguments make_arguments(const Sm90Fc2GemmParams& p) {
  GroupArrays g = group_arrays(p.group_ws, p.E);
  cutlass::KernelHardwareInfo hw;
  hw.device_id = 0;
  hw.sm_count = p.sm_count;
  sm90::Fc2EpilogueParamsDevice epi;
  epi.offsets = p.offsets;
  epi.p2u = p.p2u;
  epi.scales = p.scales;
  epi.bias = static_cast<const __nv_bfloat16*>(p.bias);
  epi.dst = p.dst;
  epi.dst_stride = p.dst_stride;
  epi.T = p.T;
  epi.k = p.k;
  epi.H = p.H;
  epi.op = int(p.op);
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                {p.E, g.shapes, nullptr},
                                {g.ptr_A, g.stride_A, g.ptr_B, g.stride_B},
                                epi,
                                hw};
  return args;
}

}  // namespace

bool sm90_fc2_built_with_cutlass() { return true; }

size_t sm90_fc2_cutlass_workspace_bytes(int sm_count, int num_experts) {
  Sm90Fc2GemmParams p{};
  p.E = num_experts;
  p.sm_count = sm_count;
  static char dummy[16 * 1024 * 6] alignas(256);
  p.group_ws = dummy;  // addresses only; nothing is dereferenced on the host
  return Gemm::get_workspace_size(make_arguments(p));
}

Status sm90_fc2_grouped_gemm(const Sm90Fc2GemmParams& p, cudaStream_t stream) {
  GroupArrays g = group_arrays(p.group_ws, p.E);
  fc2_prepare_groups<<<(p.E + 127) / 128, 128, 0, stream>>>(g, static_cast<const ElementA*>(p.A),
                                                            static_cast<const ElementB*>(p.W2), p.offsets, p.E,
                                                            p.H, p.I);
  FM_RETURN_IF_ERROR(detail::check_launch(kOp));
  typename Gemm::Arguments args = make_arguments(p);
  Gemm gemm;
  cutlass::Status cs = gemm.can_implement(args);
  FM_REQUIRE_SUPPORTED(cs == cutlass::Status::kSuccess, kOp, "shape", "CUTLASS cannot implement it (",
                       cutlassGetStatusString(cs), ")");
  cs = gemm.initialize(args, p.cutlass_ws, stream);
  if (cs != cutlass::Status::kSuccess)
    return Status(StatusCode::kCudaError,
                  detail::concat(kOp, ": grouped GEMM initialize: ", cutlassGetStatusString(cs)));
  cs = gemm.run(stream);
  if (cs != cutlass::Status::kSuccess)
    return Status(StatusCode::kCudaError, detail::concat(kOp, ": grouped GEMM launch: ", cutlassGetStatusString(cs)));
  return detail::check_launch(kOp);
}

}  // namespace flashmix
