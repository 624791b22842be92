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

__device__ __forceinline__ void red_add_bf16x8(__nv_bfloat16* addr, const uint32_t (&x)[4]) {
  asm volatile("red.global.v4.bf16x2.add.noftz [%0], {%1, %2, %3, %4};" ::"l"(addr), "r"(x[0]), "r"(x[1]),
               "r"(x[2]), "r"(x[3])
               : "memory");
}

__device__ __forceinline__ void red_add_f32x4(float* addr, float4 v) {
  asm volatile("red.global.v4.f32.add [%0], {%1, %2, %3, %4};" ::"l"(addr), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
               : "memory");
}

// x[i] of lane q (of a quad) is element (q, i); afterwards it is element (i, q).
// Two butterfly stages; at stage m, an element whose lane bit m differs from
// its slot bit m moves to lane ^ m, slot ^ m. Register indices stay static.
__device__ __forceinline__ void quad_transpose(uint32_t (&x)[4], int q, unsigned mask) {
  CUTLASS_PRAGMA_UNROLL
  for (int m = 2; m >= 1; m >>= 1) {
    const bool hi = q & m;
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < 4; ++v) {
      if (v & m) continue;
      const uint32_t send = hi ? x[v] : x[v | m];
      const uint32_t got = __shfl_xor_sync(mask, send, m);
      if (hi) x[v] = got; else x[v | m] = got;
    }
  }
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
  bool vec16 = false;  // dst and dst_stride allow 16-byte accesses
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
    static_assert(kV % 4 == 0, "N tile must be a multiple of 32");
    constexpr int kMmaM = size<1>(FrgLayout{});
    constexpr int kMmaN = size<2>(FrgLayout{});

    const int64_t row0 = params.offsets[e];
    const int op = params.op;
    const int T = params.T, k = params.k;
    const bool vec16 = params.vec16;
    const __nv_bfloat16* bias = params.bias ? params.bias + int64_t(e) * N : nullptr;
    // The 4 lanes of a quad hold the same row, 2 columns each of every
    // 8-column group: a 4x4 transpose across the quad gives each lane one
    // whole group (16 bytes of bf16); a 2x2 exchange gives 4 fp32 (16 bytes).
    const int lane = thread_idx & 31;
    const int q = lane & 3;
    const unsigned quad_mask = 0xFu << (lane & 28);
    const bool bf16_out = op == int(Fc2EpilogueOp::kRedBf16) || op == int(Fc2EpilogueOp::kRowsBf16);

    CUTLASS_PRAGMA_UNROLL
    for (int mi = 0; mi < kMmaM; ++mi) {
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int m = int(get<0>(tCcD(make_coord(make_coord(0, r, 0), mi, 0))));
        if (m >= M) continue;  // uniform over the quad (one row)
        const int64_t p = row0 + m;
        int64_t dst_row = p;
        float w = 1.0f;
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
          for (int vb = 0; vb < kV; vb += 4) {
            float a[4][2];
            int n[4];
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < 4; ++i) {
              const auto idx0 = make_coord(make_coord(0, r, vb + i), mi, ni);
              const auto idx1 = make_coord(make_coord(1, r, vb + i), mi, ni);
              n[i] = int(get<1>(tCcD(idx0)));
              a[i][0] = accumulators(idx0);
              a[i][1] = accumulators(idx1);
              if (op == int(Fc2EpilogueOp::kRowsBf16)) continue;
              if (bias && n[i] < N) {
                const __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(bias + n[i]);
                a[i][0] += __low2float(b);
                a[i][1] += __high2float(b);
              }
              a[i][0] *= w;
              a[i][1] *= w;
            }
            if (!vec16) {  // 4/8-byte accesses straight from the fragment
              CUTLASS_PRAGMA_UNROLL
              for (int i = 0; i < 4; ++i) {
                if (n[i] >= N) continue;  // N is even, so n + 1 < N too
                if (op == int(Fc2EpilogueOp::kRedBf16) || op == int(Fc2EpilogueOp::kRowsBf16)) {
                  __nv_bfloat16* addr = static_cast<__nv_bfloat16*>(params.dst) + base + n[i];
                  if (op == int(Fc2EpilogueOp::kRowsBf16) || k == 1)
                    *reinterpret_cast<__nv_bfloat162*>(addr) = __floats2bfloat162_rn(a[i][0], a[i][1]);
                  else
                    red_add_bf16x2(addr, a[i][0], a[i][1]);
                } else if (op == int(Fc2EpilogueOp::kRedFp32)) {
                  red_add_f32x2(static_cast<float*>(params.dst) + base + n[i], a[i][0], a[i][1]);
                } else {
                  *reinterpret_cast<float2*>(static_cast<float*>(params.dst) + base + n[i]) =
                      make_float2(a[i][0], a[i][1]);
                }
              }
            } else if (bf16_out) {
              uint32_t x[4];
              CUTLASS_PRAGMA_UNROLL
              for (int i = 0; i < 4; ++i) {
                __nv_bfloat162 h = __floats2bfloat162_rn(a[i][0], a[i][1]);
                x[i] = *reinterpret_cast<uint32_t*>(&h);
              }
              quad_transpose(x, q, quad_mask);
              // Lane q now holds columns 0..7 of group vb + q.
              const int nq = (q == 0 ? n[0] : q == 1 ? n[1] : q == 2 ? n[2] : n[3]) - 2 * q;
              if (nq < N) {
                __nv_bfloat16* addr = static_cast<__nv_bfloat16*>(params.dst) + base + nq;
                if (op == int(Fc2EpilogueOp::kRowsBf16) || k == 1)
                  *reinterpret_cast<uint4*>(addr) = make_uint4(x[0], x[1], x[2], x[3]);
                else
                  red_add_bf16x8(addr, x);
              }
            } else {
              const bool hi = q & 1;
              CUTLASS_PRAGMA_UNROLL
              for (int i = 0; i < 4; i += 2) {
                const float s0 = hi ? a[i][0] : a[i + 1][0], s1 = hi ? a[i][1] : a[i + 1][1];
                const float g0 = __shfl_xor_sync(quad_mask, s0, 1), g1 = __shfl_xor_sync(quad_mask, s1, 1);
                // lo lane: group vb+i, its own pair then the partner's; hi lane: group vb+i+1, partner's first.
                const float4 v = hi ? make_float4(g0, g1, a[i + 1][0], a[i + 1][1])
                                    : make_float4(a[i][0], a[i][1], g0, g1);
                const int nv = hi ? n[i + 1] - 2 : n[i];
                if (nv < N) {
                  float* addr = static_cast<float*>(params.dst) + base + nv;
                  if (op == int(Fc2EpilogueOp::kRedFp32))
                    red_add_f32x4(addr, v);
                  else
                    *reinterpret_cast<float4*>(addr) = v;
                }
              }
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
