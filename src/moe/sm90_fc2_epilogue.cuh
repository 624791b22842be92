// Our FC2 epilogue for CUTLASS's sm90 ptr-array grouped GEMM: the finalize
// (router weight, bias, scatter to token rows, k-way accumulation) applied to
// the wgmma accumulators in registers, so the [P, H] intermediate never
// reaches device memory in the fused modes.
//
// It is an operator-style collective (the interface of CUTLASS's
// DefaultEpilogueArray), wrapped in Sm90TmaWarpSpecializedAdapter; no TMA
// store. Per tile (expert e = the group index, rows m of expert e are
// permuted rows p = off[e] + m) each thread first issues every global load
// the tile needs: its rows' slots s = p2u[p] (token t = s % T, j = s / T),
// one bias column pair per warpgroup thread into shared memory (the bias is
// the same for all rows), then the weights w = scales[t*k + j]. Then it walks
// its accumulator fragment: the wgmma fragment gives a thread 2 adjacent
// columns per 8-column group; a transpose across the quad makes every global
// access 16 bytes (4-byte bf16x2 / 8-byte float2 when out's alignment does
// not allow it). One unrolled body per mode (template), chosen per launch.
#pragma once

#include <cuda_bf16.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/gemm/gemm.h"
#include "common/red.cuh"
#include "common/sm90.cuh"
#include "moe/moe_fc2_internal.h"

namespace flashmix::sm90 {

using dev::red_add_bf16x2;
using dev::red_add_bf16x8;
using dev::red_add_f32x2;
using dev::red_add_f32x4;
using dev::st_global_v4;

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

  // The bias of the tile's columns, staged once per tile by each consumer
  // warpgroup (bf16x2 per column pair; two buffers, alternate tiles).
  static constexpr int kMaxTileN = 256;
  struct SharedStorage {
    alignas(16) uint32_t bias[2][2][kMaxTileN / 2];  // [consumer warpgroup][buffer][column pair]
  };
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
                                 ResidueMNK, int thread_idx, char* smem) {
    using namespace cute;
#ifdef FLASHMIX_EXP_FC2_DISCARD
    // Diagnostic builds only (never shipped; results are wrong): the
    // epilogue stores nothing, so a bench run times the mainloop alone. The
    // accumulators are folded into one value stored under a condition that
    // never holds: with them unused, ptxas dropped 6 of the mainloop's 8
    // HGMMA (docs/fc2_grouped_gemm.md).
    {
      float fold = 0.f;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < int(cute::size(accumulators)); ++i) fold += accumulators(i);
      if (params.T < 0) static_cast<float*>(params.dst)[thread_idx] = fold;
      return;
    }
#endif
    const int M = int(get<0>(problem_shape_mnkl));
    const int N = int(get<1>(problem_shape_mnkl));
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord_mnkl;
    const int e = int(l_coord);
    Tensor cD = local_tile(make_identity_tensor(make_shape(M, N)), take<0, 2>(blk_shape_MNK),
                           make_coord(m_coord, n_coord));
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor tCcD = thr_mma.partition_C(cD);  // (VEC, MMA_M, MMA_N) coordinates
    const int n0 = int(n_coord) * int(size<1>(blk_shape_MNK));  // first column of the tile
    // One unrolled body per mode (the mode is uniform per launch): runtime
    // branches inside the unrolled loops had cost selects on every element.
    switch (params.op * 2 + (params.vec16 ? 1 : 0)) {
#define FLASHMIX_FC2_EPI_CASE(OP)                                                                 \
  case int(OP) * 2: return store_tile<OP, false>(accumulators, tCcD, M, N, e, n0, thread_idx, smem); \
  case int(OP) * 2 + 1: return store_tile<OP, true>(accumulators, tCcD, M, N, e, n0, thread_idx, smem);
      FLASHMIX_FC2_EPI_CASE(Fc2EpilogueOp::kRedBf16)
      FLASHMIX_FC2_EPI_CASE(Fc2EpilogueOp::kRedFp32)
      FLASHMIX_FC2_EPI_CASE(Fc2EpilogueOp::kRowsFp32Scaled)
      FLASHMIX_FC2_EPI_CASE(Fc2EpilogueOp::kRowsBf16)
#undef FLASHMIX_FC2_EPI_CASE
      default: return;
    }
  }

 private:
  template <Fc2EpilogueOp kOp, bool kVec16, class FrgEngine, class FrgLayout, class CoordTensor>
  CUTLASS_DEVICE void store_tile(cute::Tensor<FrgEngine, FrgLayout> const& accumulators, CoordTensor const& tCcD,
                                 int M, int N, int e, int n0, int thread_idx, char* smem_raw) {
    using namespace cute;
    static_assert(is_static<FrgLayout>::value, "accumulator layout must be static");
    // wgmma C fragment: value mode (2 adjacent columns, 2 rows 8 apart, N/8 column groups).
    static_assert(rank<0>(FrgLayout{}) == 3, "unexpected accumulator layout");
    static_assert(size<0, 0>(FrgLayout{}) == 2 && size<0, 1>(FrgLayout{}) == 2, "unexpected accumulator layout");
    constexpr int kV = size<0, 2>(FrgLayout{});
    static_assert(kV % 4 == 0, "N tile must be a multiple of 32");
    constexpr int kMmaM = size<1>(FrgLayout{});
    constexpr int kMmaN = size<2>(FrgLayout{});
    constexpr int kRows = kMmaM * 2;  // rows of the tile this thread holds
    constexpr bool kBf16Out = kOp == Fc2EpilogueOp::kRedBf16 || kOp == Fc2EpilogueOp::kRowsBf16;
    constexpr bool kScaled = kOp != Fc2EpilogueOp::kRowsBf16;  // weight and bias applied here

    const int64_t row0 = params.offsets[e];
    const int T = params.T, k = params.k;
    const bool plain_store = kOp == Fc2EpilogueOp::kRowsBf16 || kOp == Fc2EpilogueOp::kRowsFp32Scaled ||
                             (k == 1 && !params.add_to_out);

    // Every global load this tile needs is issued before the first store or
    // reduction: the row slots, the bias of the tile's columns, then the
    // weights. The bias (the same for all rows) goes through shared memory:
    // one 4-byte load per thread instead of 2 per 8-column group, which had
    // each waited out its round trip behind the previous group's reductions
    // (in registers it would not fit beside the 128 accumulators).
    int mrow[kRows], slot[kRows];
    bool valid[kRows];
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) {
      mrow[i] = int(get<0>(tCcD(make_coord(make_coord(0, i % 2, 0), i / 2, 0))));
      valid[i] = mrow[i] < M;  // uniform over the quad (one row)
      slot[i] = 0;
      if constexpr (kScaled) slot[i] = valid[i] ? __ldg(params.p2u + row0 + mrow[i]) : 0;
    }
    constexpr int kTileN = kMmaN * kV * 8;
    static_assert(kTileN <= kMaxTileN && kTileN / 2 <= 128, "bias staging: one column pair per warpgroup thread");
    const uint32_t* bias_s = nullptr;
    if constexpr (kScaled) {
      if (params.bias) {
        // Consumer warpgroups are warpgroups 1 and 2 of the CTA (0 is the producer).
        const int wg = int(threadIdx.x) / 128 - 1;
        const int wt = int(threadIdx.x) % 128;
        SharedStorage& ss = *reinterpret_cast<SharedStorage*>(smem_raw);
        uint32_t* buf = ss.bias[wg][tile_parity_];
        tile_parity_ ^= 1;
        if (wt < kTileN / 2) {
          const int n = n0 + 2 * wt;
          buf[wt] = n < N ? __ldg(reinterpret_cast<const unsigned int*>(params.bias + int64_t(e) * N + n)) : 0u;
        }
        // The warpgroup's threads have all finished reading this buffer two
        // tiles ago (they passed the previous tile's barrier after that).
        dev::named_bar_sync(kBiasBarrierBase + wg, 128);
        bias_s = buf;
      }
    }
    float weight[kRows];
    int64_t base[kRows];
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) {
      weight[i] = 1.0f;
      int64_t dst_row = row0 + mrow[i];  // the permuted row (kRows*), or the token (kRed*)
      if constexpr (kScaled) {
        const int t = slot[i] % T, j = slot[i] / T;
        if (params.scales && valid[i]) weight[i] = __ldg(params.scales + int64_t(t) * k + j);
        if constexpr (kOp != Fc2EpilogueOp::kRowsFp32Scaled) dst_row = t;
      }
      base[i] = dst_row * params.dst_stride;
    }

    // The 4 lanes of a quad hold the same row, 2 columns each of every
    // 8-column group: a 4x4 transpose across the quad gives each lane one
    // whole group (16 bytes of bf16); a 2x2 exchange gives 4 fp32 (16 bytes).
    const int lane = thread_idx & 31;
    const int q = lane & 3;
    const unsigned quad_mask = 0xFu << (lane & 28);

    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const int mi = i / 2, r = i % 2;
      if (!valid[i]) continue;
      CUTLASS_PRAGMA_UNROLL
      for (int ni = 0; ni < kMmaN; ++ni) {
        CUTLASS_PRAGMA_UNROLL
        for (int vb = 0; vb < kV; vb += 4) {
          float a[4][2];
          int n[4];
          CUTLASS_PRAGMA_UNROLL
          for (int u = 0; u < 4; ++u) {
            const auto idx0 = make_coord(make_coord(0, r, vb + u), mi, ni);
            const auto idx1 = make_coord(make_coord(1, r, vb + u), mi, ni);
            n[u] = int(get<1>(tCcD(idx0)));
            a[u][0] = accumulators(idx0);
            a[u][1] = accumulators(idx1);
            if constexpr (kScaled) {
              if (bias_s) {
                const uint32_t bits = bias_s[(n[u] - n0) / 2];
                const __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(&bits);
                a[u][0] += __low2float(b);
                a[u][1] += __high2float(b);
              }
              a[u][0] *= weight[i];
              a[u][1] *= weight[i];
            }
          }
          if constexpr (!kVec16) {  // 4/8-byte accesses straight from the fragment
            CUTLASS_PRAGMA_UNROLL
            for (int u = 0; u < 4; ++u) {
              if (n[u] >= N) continue;  // N is even, so n + 1 < N too
              if constexpr (kBf16Out) {
                __nv_bfloat16* addr = static_cast<__nv_bfloat16*>(params.dst) + base[i] + n[u];
                if (plain_store)
                  *reinterpret_cast<__nv_bfloat162*>(addr) = __floats2bfloat162_rn(a[u][0], a[u][1]);
                else
                  red_add_bf16x2(addr, a[u][0], a[u][1]);
              } else if constexpr (kOp == Fc2EpilogueOp::kRedFp32) {
                red_add_f32x2(static_cast<float*>(params.dst) + base[i] + n[u], a[u][0], a[u][1]);
              } else {
                *reinterpret_cast<float2*>(static_cast<float*>(params.dst) + base[i] + n[u]) =
                    make_float2(a[u][0], a[u][1]);
              }
            }
          } else if constexpr (kBf16Out) {
            uint32_t x[4];
            CUTLASS_PRAGMA_UNROLL
            for (int u = 0; u < 4; ++u) {
              __nv_bfloat162 h = __floats2bfloat162_rn(a[u][0], a[u][1]);
              x[u] = *reinterpret_cast<uint32_t*>(&h);
            }
            quad_transpose(x, q, quad_mask);
            // Lane q now holds columns 0..7 of group vb + q.
            const int nq = (q == 0 ? n[0] : q == 1 ? n[1] : q == 2 ? n[2] : n[3]) - 2 * q;
            if (nq < N) {
              __nv_bfloat16* addr = static_cast<__nv_bfloat16*>(params.dst) + base[i] + nq;
              if (plain_store)
                st_global_v4(addr, x[0], x[1], x[2], x[3]);
              else
                red_add_bf16x8(addr, x);
            }
          } else {
            const bool hi = q & 1;
            CUTLASS_PRAGMA_UNROLL
            for (int u = 0; u < 4; u += 2) {
              const float s0 = hi ? a[u][0] : a[u + 1][0], s1 = hi ? a[u][1] : a[u + 1][1];
              const float g0 = __shfl_xor_sync(quad_mask, s0, 1), g1 = __shfl_xor_sync(quad_mask, s1, 1);
              // lo lane: group vb+u, its own pair then the partner's; hi lane: group vb+u+1, partner's first.
              const float4 v = hi ? make_float4(g0, g1, a[u + 1][0], a[u + 1][1])
                                  : make_float4(a[u][0], a[u][1], g0, g1);
              const int nv = hi ? n[u + 1] - 2 : n[u];
              if (nv < N) {
                float* addr = static_cast<float*>(params.dst) + base[i] + nv;
                if constexpr (kOp == Fc2EpilogueOp::kRedFp32)
                  red_add_f32x4(addr, v);
                else
                  st_global_v4(addr, __float_as_uint(v.x), __float_as_uint(v.y), __float_as_uint(v.z),
                               __float_as_uint(v.w));
              }
            }
          }
        }
      }
    }
  }

  // Named barriers 8 and 9 (CUTLASS reserves 0-7); the kernels in use take none.
  static constexpr int kBiasBarrierBase = 8;
  Params params;
  int tile_parity_ = 0;
};

}  // namespace flashmix::sm90
