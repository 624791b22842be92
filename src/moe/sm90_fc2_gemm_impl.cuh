// One configuration of the FC2 grouped GEMM (schedule, tile, cluster): the
// CUTLASS types and the launch. Each configuration is instantiated in its own
// TU (sm90_fc2_gemm_<config>.cu: ~40 s of nvcc each) so builds overlap them.
#pragma once

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

namespace flashmix::sm90 {

using Fc2ElementA = cutlass::bfloat16_t;
using Fc2ElementB = cutlass::bfloat16_t;
using Fc2StrideA = cute::Stride<int64_t, cute::Int<1>, cute::Int<0>>;  // A_e [M_e, I] row-major
using Fc2StrideB = cute::Stride<int64_t, cute::Int<1>, cute::Int<0>>;  // W2[e] [H, I], K contiguous
using Fc2ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
using Fc2UnderlyingShape = Fc2ProblemShape::UnderlyingProblemShape;

// The per-expert arrays the prepare kernel fills (16 bytes per entry each).
struct Fc2GroupArrays {
  Fc2UnderlyingShape* shapes;
  const Fc2ElementA** ptr_A;
  const Fc2ElementB** ptr_B;
  Fc2StrideA* stride_A;
  Fc2StrideB* stride_B;
};

inline Fc2GroupArrays fc2_group_arrays(void* ws, int E) {
  char* b = static_cast<char*>(ws);
  Fc2GroupArrays g;
  g.shapes = reinterpret_cast<Fc2UnderlyingShape*>(b);
  g.ptr_A = reinterpret_cast<const Fc2ElementA**>(b + 16 * size_t(E));
  g.ptr_B = reinterpret_cast<const Fc2ElementB**>(b + 32 * size_t(E));
  g.stride_A = reinterpret_cast<Fc2StrideA*>(b + 48 * size_t(E));
  g.stride_B = reinterpret_cast<Fc2StrideB*>(b + 64 * size_t(E));
  return g;
}

template <class KernelSchedule, class TileShape, class ClusterShape>
struct Fc2GemmConfig {
  using CollectiveEpilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<Fc2ScatterEpilogue>;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Fc2ElementA, cutlass::layout::RowMajor*, 8, Fc2ElementB,
      cutlass::layout::ColumnMajor*, 8, float, TileShape, ClusterShape,
      // The adapter takes our SharedStorage both as its tensor storage and as
      // its tensormap storage: the kernel holds it twice.
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::TensorStorage) + sizeof(typename CollectiveEpilogue::TensorMapStorage))>,
      KernelSchedule>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<Fc2ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  static_assert(std::is_same_v<typename GemmKernel::InternalStrideA, Fc2StrideA> &&
                    std::is_same_v<typename GemmKernel::InternalStrideB, Fc2StrideB>,
                "stride types of the group arrays");

  static typename Gemm::Arguments arguments(const Sm90Fc2GemmParams& p) {
    Fc2GroupArrays g = fc2_group_arrays(p.group_ws, p.E);
    cutlass::KernelHardwareInfo hw;
    hw.device_id = 0;
    hw.sm_count = p.sm_count;
    const Fc2EpilogueParamsDevice epi = fc2_epilogue_params(p);
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                  {p.E, g.shapes, nullptr},
                                  {g.ptr_A, g.stride_A, g.ptr_B, g.stride_B},
                                  epi,
                                  hw};
    using RasterOrder = decltype(args.scheduler.raster_order);
    args.scheduler.raster_order = p.raster_along_n ? RasterOrder::AlongN : RasterOrder::AlongM;
    args.scheduler.max_swizzle_size = p.swizzle > 0 ? p.swizzle : 1;
    return args;
  }

  static size_t workspace_bytes(int sm_count, int E) {
    Sm90Fc2GemmParams p{};
    p.E = E;
    p.sm_count = sm_count;
    alignas(256) static char dummy[256];
    p.group_ws = dummy;  // addresses only; nothing is dereferenced on the host
    return Gemm::get_workspace_size(arguments(p));
  }

  static Status run(const Sm90Fc2GemmParams& p, cudaStream_t stream) {
    constexpr const char* kOp = "moe_fc2_finalize";
    typename Gemm::Arguments args = arguments(p);
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
      return Status(StatusCode::kCudaError,
                    detail::concat(kOp, ": grouped GEMM launch: ", cutlassGetStatusString(cs)));
    return detail::check_launch(kOp);
  }
};

}  // namespace flashmix::sm90

// A config TU defines these two for its configuration NAME.
#define FLASHMIX_FC2_DEFINE_CONFIG(NAME, ...)                                                        \
  namespace flashmix {                                                                               \
  using Fc2Config_##NAME = sm90::Fc2GemmConfig<__VA_ARGS__>;                                          \
  size_t sm90_fc2_workspace_##NAME(int sm_count, int E) {                                            \
    return Fc2Config_##NAME::workspace_bytes(sm_count, E);                                            \
  }                                                                                                  \
  Status sm90_fc2_run_##NAME(const Sm90Fc2GemmParams& p, cudaStream_t stream) {                      \
    return Fc2Config_##NAME::run(p, stream);                                                          \
  }                                                                                                  \
  }
