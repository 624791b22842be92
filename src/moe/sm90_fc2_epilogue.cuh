// Our FC2 epilogue for CUTLASS's sm90 ptr-array grouped GEMM: the finalize
// (router weight, bias, scatter to token rows, k-way accumulation) applied to
// the wgmma accumulators in registers, so the [P, H] intermediate never
// reaches device memory in the fused modes.
//
// It is an operator-style collective (the interface of CUTLASS's
// DefaultEpilogueArray), wrapped in Sm90TmaWarpSpecializedAdapter; no shared
// memory, no TMA store. Per tile (expert e = the group index, rows m of
// expert e are permuted rows p = off[e] + m) each thread reads its own rows'
// slot s = p2u[p], token t = s % T, j = s / T and weight w = scales[t*k + j]
// once, then walks its accumulator fragment in column pairs: the wgmma
// fragment gives a thread 2 adjacent columns per 8-column group, so every
// global access is a 4-byte bf16x2 (or 8-byte float2) at (row, n..n+1).
#pragma once

#include <cuda_bf16.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/gemm/gemm.h"
#include "moe/moe_fc2_internal.h"

namespace flashmix::sm90 {

__device__ __forceinline__ void red_add_bf16x2(__nv_bfloat16* addr, float a, float b) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  uint32_t bits = *reinterpret_cast<uint32_t*>(&v);
  asm volatile("red.global.add.noftz.bf16x2 [%0], %1;" ::"l"(addr), "r"(bits) : "memory");
}

__device__ __forceinline__ void red_add_f32x2(float* addr, float a, float b) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(addr), "f"(a), "f"(b) : "memory");
}

struct Fc2EpilogueParamsDevice {
  const int64_t* offsets = nullptr;
  const int32_t* p2u = nullptr;
  const float* scales = nullptr;
  const __nv_bfloat16* bias = nullptr;
  void* dst = nullptr;
  int64_t dst_stride = 0;
  int T = 0, k = 0, H = 0;
  int op = 0;  // Fc2EpilogueOp
};

class Fc2ScatterEpilogue {
 public:
  using EpilogueSchedule = cutlass::epilogue::PtrArrayNoSmemWarpSpecialized;
  using DispatchPolicy = EpilogueSchedule;
  // The kernel layer wants these names; C is never read, D is ours.
  using ElementC = cutlass::bfloat16_t;
  using StrideC = cute::Stride<int64_t, cute::Int<1>, cute::Int<0>>*;
  using InternalStrideC = cute::remove_pointer_t<StrideC>;
  using ElementD = cutlass::bfloat16_t;
  using StrideD = StrideC;
  using InternalStrideD = InternalStrideC;
  using ElementAccumulator = float;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  struct ThreadEpilogueOp {};  // GemmUniversalAdapter names it; ours has no thread-level op

  struct SharedStorage {};
  using TensorMapStorage = SharedStorage;
  using Arguments = Fc2EpilogueParamsDevice;
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&, int) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) {
    return true;
  }

  CUTLASS_HOST_DEVICE Fc2ScatterEpilogue(Params const& p) : params(p) {}

  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_MNK,
                                 BlockCoordMNKL blk_coord_mnkl,
                                 cute::Tensor<FrgEngine, FrgLayout> const& accumulators, TiledMma tiled_mma,
                                 ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    const int M = int(get<0>(problem_shape_mnkl));
    const int N = int(get<1>(problem_shape_mnkl));
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord_mnkl;
    const int e = int(l_coord);

    Tensor cD = local_tile(make_identity_tensor(make_shape(M, N)), take<0, 2>(blk_shape_MNK),
                           make_coord(m_coord, n_coord));
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor tCcD = thr_mma.partition_C(cD);  // (VEC, MMA_M, MMA_N) coordinates
    static_assert(is_static<FrgLayout>::value, "accumulator layout must be static");
    // wgmma C fragment: value mode (2 adjacent columns, 2 rows 8 apart, N/8 column groups).
    static_assert(rank<0>(FrgLayout{}) == 3, "unexpected accumulator layout");
    static_assert(size<0, 0>(FrgLayout{}) == 2 && size<0, 1>(FrgLayout{}) == 2, "unexpected accumulator layout");
    constexpr int kV = size<0, 2>(FrgLayout{});
    constexpr int kMmaM = size<1>(FrgLayout{});
    constexpr int kMmaN = size<2>(FrgLayout{});

    const int64_t row0 = params.offsets[e];
    const int op = params.op;
    const int T = params.T, k = params.k;
    const __nv_bfloat16* bias = params.bias ? params.bias + int64_t(e) * N : nullptr;

    CUTLASS_PRAGMA_UNROLL
    for (int mi = 0; mi < kMmaM; ++mi) {
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int m = int(get<0>(tCcD(make_coord(make_coord(0, r, 0), mi, 0))));
        if (m >= M) continue;
        const int64_t p = row0 + m;
        int64_t dst_row;
        float w = 1.0f;
        if (op == int(Fc2EpilogueOp::kRowsBf16) || op == int(Fc2EpilogueOp::kRowsFp32Scaled)) {
          dst_row = p;
        }
        if (op != int(Fc2EpilogueOp::kRowsBf16)) {
          const int s = params.p2u[p];
          const int t = s % T, j = s / T;
          if (params.scales) w = params.scales[int64_t(t) * k + j];
          if (op != int(Fc2EpilogueOp::kRowsFp32Scaled)) dst_row = t;
        }
        const int64_t base = dst_row * params.dst_stride;
        CUTLASS_PRAGMA_UNROLL
        for (int ni = 0; ni < kMmaN; ++ni) {
          CUTLASS_PRAGMA_UNROLL
          for (int v = 0; v < kV; ++v) {
            const auto idx0 = make_coord(make_coord(0, r, v), mi, ni);
            const auto idx1 = make_coord(make_coord(1, r, v), mi, ni);
            const int n = int(get<1>(tCcD(idx0)));
            if (n >= N) continue;  // N is even, so n + 1 < N too
            float a0 = accumulators(idx0), a1 = accumulators(idx1);
            if (op == int(Fc2EpilogueOp::kRowsBf16)) {
              __nv_bfloat162 h = __floats2bfloat162_rn(a0, a1);
              *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(params.dst) + base + n) = h;
              continue;
            }
            if (bias) {
              const __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(bias + n);
              a0 += __low2float(b);
              a1 += __high2float(b);
            }
            a0 *= w;
            a1 *= w;
            if (op == int(Fc2EpilogueOp::kRedBf16)) {
              __nv_bfloat16* addr = static_cast<__nv_bfloat16*>(params.dst) + base + n;
              if (k == 1)
                *reinterpret_cast<__nv_bfloat162*>(addr) = __floats2bfloat162_rn(a0, a1);
              else
                red_add_bf16x2(addr, a0, a1);
            } else if (op == int(Fc2EpilogueOp::kRedFp32)) {
              red_add_f32x2(static_cast<float*>(params.dst) + base + n, a0, a1);
            } else {
              *reinterpret_cast<float2*>(static_cast<float*>(params.dst) + base + n) = make_float2(a0, a1);
            }
          }
        }
      }
    }
  }

 private:
  Params params;
};

}  // namespace flashmix::sm90
