// Single-pass mhc_pre on Hopper (sm_90a): X -> (F_pre, H_post, H_res) reading
// X from device memory once.
//
//   h[b,m] = alpha_of(m) * (X[b] . phi[m]) / r[b] + bias[m],  r[b] = sqrt(|X[b]|^2 / K + eps)
//   F_pre[b,c] = sum_i H_pre[b,i] X[b,i,c]     (H_pre from h; Sinkhorn for H_res)
//
// Why one pass works: the pre mix needs the whole row's projection before it
// can use any of the row. A cluster of 8 CTAs splits the columns C into 8
// slices; CTA j keeps columns [j*S, j*S + S) of all n streams of a tile of
// `rows` tokens in shared memory (rows*n*S*2 bytes: 172 KB for 24 tokens,
// n = 4, C = 7168). Each CTA computes the partial projection and sum of
// squares of its slice on tensor cores, the 8 partials are summed through
// distributed shared memory (each CTA sums the 8 in rank order, so every CTA
// holds bitwise the same h), every CTA runs the activations and Sinkhorn for
// the tile's tokens (a few hundred FLOPs each) and then mixes its own slice
// out of shared memory. X crosses the memory bus once; F_pre once.
//
// Roofline (B = 8192, n = 4, C = 7168): bytes = 2*B*n*C + 2*B*C = 587 MB, the
// floor; FLOPs = 2*B*K*N*2 (phi split into bf16 hi + lo) = 22.5 GFLOP on the
// tensor cores (mma.sync, ~40 us at half of the dense bf16 rate), hidden
// under the loads. phi is re-read from L2 once per tile per cluster:
// N*K*4/rows bytes per token, 2x the X bytes at 24 rows — the L2 side of the
// roofline, the reason the tile is as tall as shared memory allows.
//
// phi fp32 is split on the fly into hi = bf16(phi) and lo = bf16(phi - hi);
// X is exact in bf16, so X*hi + X*lo carries ~16 significant bits of phi
// (TF32 has 11) with fp32 accumulation.
//
// The FP8 residual stream (spec §4.9, kFp8 below): the tile holds X's e4m3
// codes and their per-block scales; the codes are exact in bf16, so the
// tensor cores take them as they are and each k step's partial sums are
// scaled by its 128-column block's scale.
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <type_traits>

#include "common/kernel_fit.h"
#include "common/launch.cuh"
#include "common/sm90.cuh"
#include "common/reduce.cuh"
#include "common/vec.cuh"
#include "fp8/quantize_fp8_device.cuh"
#include "mhc/mhc_device.cuh"
#include "mhc/mhc_fp8x_device.cuh"

namespace flashmix::mhc_detail {

namespace {

namespace cg = cooperative_groups;
using bf16 = __nv_bfloat16;
using dev::cluster_arrive;
using dev::cluster_wait;
using dev::mbar_wait;
using dev::smem_u32;

constexpr int kClusterSize = 8;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxRowTiles = 3;  // tokens per tile: 8, 16 or 24
constexpr int kChunks = 4;       // X slice arrives in 4 chunks, each on its own mbarrier; compute starts on the first

struct FusedLayout {
  int slice = 0;        // columns per CTA (multiple of 8)
  int rows = 0;         // tokens per tile (8 * row_tiles)
  int row_tiles = 0;
  int pitch = 0;        // shared-memory row pitch in elements: (pitch * 2 / 16) odd, so ldmatrix is conflict-free
  int steps = 0;        // 32-wide k steps in the (padded) slice
  int chunk_steps = 0;  // steps per cp.async group, a multiple of kWarps
  int off_scratch = 0, off_xchg = 0, off_total = 0, off_hpre = 0, off_gtab = 0, off_h = 0;  // byte offsets
  // F_pre's epilogue (spec §4.8; 0 when off): [rows] partial sums of
  // squares, [rows] 1/rms, [rows][epi_blocks] partial amax bits.
  int off_epi = 0;
  int epi_blocks = 0;  // 1 x 128 blocks a slice can touch: slice / 128 + 2
  // The FP8 residual stream (spec §4.9; 0 otherwise): the slice is whole
  // 128-column blocks, xs holds the e4m3 codes (pitch in bytes), off_sc the
  // tile's scales as floats [n * slice/128][rows], and with F_pre's
  // epilogue off_fpre a bf16 F_pre slice [rows][fpitch] (on the bf16 stream
  // F_pre goes back into xs).
  int off_sc = 0, off_fpre = 0, fpitch = 0;
};

template <int kN>
constexpr int coef_tiles() { return (kN * kN + 2 * kN + 15) / 16; }

__device__ __forceinline__ uint32_t pack_bf162(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }

// Raw phi for one 32-wide k step of one warp: for each 16-row coefficient tile
// and each 16-wide half, the 4 pairs of the mma A fragment.
template <int kN, bool kF32>
struct PhiFrag {
  using Raw = std::conditional_t<kF32, float2, uint32_t>;
  Raw v[coef_tiles<kN>()][2][4];
};

// Row pointers of the phi rows this thread reads (rows g and g + 8 of each
// 16-row tile; nullptr past num_coef), set once per kernel.
template <int kN, bool kF32>
struct PhiRows {
  using T = std::conditional_t<kF32, float, bf16>;
  const T* row[coef_tiles<kN>()][2];
};

template <int kN, bool kF32>
__device__ __forceinline__ void load_phi_step(PhiFrag<kN, kF32>& f, const PhiRows<kN, kF32>& pr, const int* gtab,
                                              int step, int lane) {
  const int t = lane & 3;
  // Global column (within a token's row) of each 8-wide group of the step, -1 past the slice.
  const int4 gq = *reinterpret_cast<const int4*>(gtab + step * 4);
  const int gcol[4] = {gq.x, gq.y, gq.z, gq.w};
#pragma unroll
  for (int mt = 0; mt < coef_tiles<kN>(); ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const auto* row = pr.row[mt][e & 1];
        const int col = gcol[2 * h + (e >> 1)];
        const bool ok = row != nullptr && col >= 0;
        if constexpr (kF32) {
          f.v[mt][h][e] = ok ? __ldg(reinterpret_cast<const float2*>(row + col + t * 2)) : make_float2(0.f, 0.f);
        } else {
          f.v[mt][h][e] = ok ? __ldg(reinterpret_cast<const unsigned int*>(row + col + t * 2)) : 0u;
        }
      }
    }
  }
}

// The FP8 stream's k order. A step's 32 columns are permuted alike in phi
// (A) and X (B) so that thread t of a quad holds 8 consecutive columns of
// one token, 8t..8t+7 (one 8-byte shared load of codes): for k16 half h the
// mma's k index 2t + j maps to column 8t + 4h + j and 2t + 8 + j to
// 8t + 4h + 2 + j (j = 0, 1). A sum over k is order-free, so the
// projection is the same sum; only its fp32 rounding order differs from the
// bf16 stream's. Here: phi's A fragments in that order, thread t reading
// the 8 columns of the step's group t.
template <int kN, bool kF32>
__device__ __forceinline__ void load_phi_step_fp8(PhiFrag<kN, kF32>& f, const PhiRows<kN, kF32>& pr, const int* gtab,
                                                  int step, int lane) {
  const int t = lane & 3;
  const int col = gtab[step * 4 + t];
#pragma unroll
  for (int mt = 0; mt < coef_tiles<kN>(); ++mt) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {  // rows g and g + 8
      const auto* row = pr.row[mt][rr];
      const bool ok = row != nullptr && col >= 0;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if constexpr (kF32) {
          const float4 v = ok ? __ldg(reinterpret_cast<const float4*>(row + col + 4 * h)) : make_float4(0, 0, 0, 0);
          f.v[mt][h][rr] = make_float2(v.x, v.y);
          f.v[mt][h][rr + 2] = make_float2(v.z, v.w);
        } else {
          const uint2 v = ok ? __ldg(reinterpret_cast<const uint2*>(row + col + 4 * h)) : make_uint2(0, 0);
          f.v[mt][h][rr] = v.x;
          f.v[mt][h][rr + 2] = v.y;
        }
      }
    }
  }
}

// F_pre's epilogue (spec §4.8) for the tile, by every thread of every CTA of
// the cluster. On entry the pre mix has left this CTA's bf16 F_pre in xs
// (token r, column c0 + col at xs[r * pitch + col], col < cw: X's buffer
// over stream 0's columns, or on the FP8 stream a buffer of its own), and
// each CTA has one cluster arrive pending (step 4's); on exit
// one is pending again (the kernel's last cluster_wait completes it).
//
// Norm: each CTA sums the squares of its columns per token (a warp per
// token, a fixed shuffle tree), the 8 partials are exchanged through
// distributed shared memory and summed in rank order, so every CTA holds
// bitwise the same 1/rms; each element is then v * (1/rms) * w rounded once
// to bf16, back in place, and stored to f_pre.
//
// FP8: a 1 x 128 block may straddle two or more CTAs' slices (C / 8 need not
// be a multiple of 128). Each CTA takes the amax of the part of every block
// it touches (bf16 magnitude bits, a half-warp per block as quantize_fp8
// does); only its first and last touched blocks can cross into a peer, so
// those two partials are what the peers read back (a max: exact, in any
// order), and the block's amax is bitwise the one quantize_fp8 takes over
// the same bf16 values. Scale and e4m3 conversion are quantize_fp8's
// (fp8_dev); the CTA holding a block's first column stores its scale.
//
// The weight's dtype and the scale format are template parameters (the
// caller dispatches once); the plain kernel never enters this function.
template <bool kWeightF32, ScaleFormat kScales>
__device__ __noinline__ void f_pre_epilogue(const ProjectParams& p, const FusedLayout& L, bf16* xs, int pitch,
                                            float* ep, int rank, long long row0, int c0, int cw) {
  cg::cluster_group cluster = cg::this_cluster();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int rows = L.rows, groups = cw / 8, hidden = p.hidden;
  const PreEpilogue& e = p.epi;
  float* ss_part = ep;                                            // [rows]
  float* inv = ep + rows;                                         // [rows]
  uint32_t* amax = reinterpret_cast<uint32_t*>(ep + 2 * rows);    // [rows][epi_blocks]
  if (e.norm_weight != nullptr) {
    for (int r = warp; r < rows; r += kWarps) {
      float sum = 0.f;
      if (row0 + r < p.batch)
        for (int g = lane; g < groups; g += 32)
          sum = chunk_sum_sq(*reinterpret_cast<const uint4*>(xs + r * pitch + g * 8), sum);
      sum = dev::warp_sum(sum);
      if (lane == 0) ss_part[r] = sum;
    }
    cluster_wait();     // the pending phase (every CTA has read the projection partials)
    cluster_arrive();   // this CTA's sums are written ...
    cluster_wait();     // ... and every peer's
    if (tid < rows) {
      float sum = 0.f;
#pragma unroll
      for (int rk = 0; rk < kClusterSize; ++rk) sum += cluster.map_shared_rank(ss_part, rk)[tid];
      inv[tid] = 1.0f / sqrtf(sum / float(hidden) + e.norm_eps);
    }
    cluster_arrive();   // done reading the peers' sums
    __syncthreads();
    for (int it = tid; it < rows * groups; it += kThreads) {
      const int r = it / groups, col = (it - r * groups) * 8;
      if (row0 + r >= p.batch) continue;
      uint4* px = reinterpret_cast<uint4*>(xs + r * pitch + col);
      float w[8];
      load_weight8<kWeightF32>(e, c0 + col, w);
      const uint4 o = normed_chunk(*px, inv[r], w);
      *px = o;  // only this thread reads or writes these columns of the row
      if (p.f_out != nullptr) *reinterpret_cast<uint4*>(p.f_out + (row0 + r) * hidden + c0 + col) = o;
    }
    __syncthreads();
  }
  if (e.q == nullptr) return;
  using namespace fp8_dev;
  const int fb = c0 / 128;                                   // first block this CTA touches
  const int nb = cw > 0 ? (c0 + cw - 1) / 128 - fb + 1 : 0;  // blocks it touches
  const int hw = tid / 16, hl = tid % 16;                    // a half-warp per (token, block)
  const unsigned half = 0xffffu << (tid & 16);
  auto load = [&](int r, int col) {
    const uint4 raw = *reinterpret_cast<const uint4*>(xs + r * pitch + col);
    Chunk c;
    c.w[0] = raw.x; c.w[1] = raw.y; c.w[2] = raw.z; c.w[3] = raw.w;
    return c;
  };
  for (int it = hw; it < rows * nb; it += kThreads / 16) {  // uniform over the half-warp
    const int r = it / nb, j = it - r * nb;
    const int col = (fb + j) * 128 + hl * 8 - c0;  // this lane's 8 columns, from c0
    uint32_t m = 0;
    if (row0 + r < p.batch && col >= 0 && col < cw) m = chunk_amax_bits(load(r, col));
    m = __reduce_max_sync(half, m);
    if (hl == 0) amax[r * L.epi_blocks + j] = m;
  }
  cluster_wait();     // the pending phase
  cluster_arrive();   // this CTA's partial amaxes are written ...
  cluster_wait();     // ... and every peer's
  for (int it = hw; it < rows * nb; it += kThreads / 16) {
    const int r = it / nb, j = it - r * nb;
    const long long b = row0 + r;
    if (b >= p.batch) continue;
    const int gb = fb + j;
    uint32_t m = amax[r * L.epi_blocks + j];
    if (j == 0 || j == nb - 1) {  // may cross into a peer's slice: its first or last block
#pragma unroll 1
      for (int rk = 0; rk < kClusterSize; ++rk) {
        const int pc0 = rk * L.slice, pcw = max(0, min(hidden - pc0, L.slice));
        if (rk == rank || pcw == 0) continue;
        const int pfb = pc0 / 128, plb = (pc0 + pcw - 1) / 128;
        if (pfb != gb && plb != gb) continue;
        const uint32_t* pa = cluster.map_shared_rank(amax, rk) + r * L.epi_blocks;
        if (pfb == gb) m = max(m, pa[0]);
        if (plb == gb) m = max(m, pa[plb - pfb]);
      }
    }
    const bool nan_block = m > kBf16Inf;
    const Scale s = block_scale_or_nan<kScales>(m);
    const int col = gb * 128 + hl * 8 - c0;
    if (col >= 0 && col < cw) {
      uint32_t lo, hi;
      quantize_chunk<kScales>(load(r, col), s.s, nan_block, lo, hi);
      *reinterpret_cast<uint2*>(e.q + b * hidden + c0 + col) = make_uint2(lo, hi);
    }
    if (hl == 0 && gb * 128 >= c0) {  // this CTA holds the block's first column
      const long long si = b * (hidden / 128) + gb;
      if constexpr (kScales == ScaleFormat::kUE8M0) static_cast<uint8_t*>(e.scales)[si] = uint8_t(s.stored);
      else static_cast<uint32_t*>(e.scales)[si] = s.stored;
    }
  }
  cluster_arrive();   // done reading the peers' partials
}

// kPost (mhc_post_pre, mhc_post_head): the tile's slice is not copied from X
// but made from X_L and F_out by the post (its arithmetic, post_mix_pair),
// stored to shared memory and once to x_next (where given); all n streams
// of a column are in this CTA's slice, so the post needs nothing from the
// peers.
//
// kFp8 (the FP8 residual stream, spec §4.9): xs holds the tile's e4m3 codes
// and sc their scales. The projection takes the codes (exact in bf16) on the
// tensor cores in load_phi_step_fp8's k order and scales each step's
// partial sums (a step lies in one 128-column block) before adding them
// up; the pre mix reads each element's value fp32(code * scale). With kPost
// each (token, stream, block) of X_next is made and quantised with
// mhc_post_fp8_kernel's arithmetic (here a half-warp a block), so its codes
// and scales are mhc_post's, and the pre reads them back from shared memory.
template <int kN, bool kF32, bool kPost, bool kFp8>
__global__ void __launch_bounds__(kThreads, 1) sm90_mhc_fused_kernel(ProjectParams p, FusedLayout L) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kMt = coef_tiles<kN>();
  constexpr int kMpad = kMt * 16;
  constexpr int kCoef = kN * kN + 2 * kN;
  constexpr int kElem = kFp8 ? 1 : 2;             // bytes of an X element in xs
  constexpr int kGroupsPerPiece = kFp8 ? 2 : 1;   // 8-column groups per 16-byte copy
  constexpr int kPiecesPerStep = 4 / kGroupsPerPiece;  // 16-byte pieces per row per 32-wide step
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* xs = reinterpret_cast<bf16*>(smem);
  uint8_t* xq = smem;                                                // kFp8: the codes, pitch L.pitch bytes
  float* sc = reinterpret_cast<float*>(smem + L.off_sc);            // kFp8: [n * slice/128][rows] scales
  float* scratch = reinterpret_cast<float*>(smem + L.off_scratch);  // [warp][kMpad + 1][rows]
  float* xchg = reinterpret_cast<float*>(smem + L.off_xchg);        // [num_coef + 1][rows], this CTA's partials
  float* total = reinterpret_cast<float*>(smem + L.off_total);      // [num_coef + 1][rows], the cluster's sums
  float* hpre = reinterpret_cast<float*>(smem + L.off_hpre);        // [rows][kN]

  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const long long tile = blockIdx.x / kClusterSize;
  const long long row0 = tile * L.rows;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int hidden = p.hidden;
  const int c0 = rank * L.slice;
  const int cw = max(0, min(hidden - c0, L.slice));
  const int kv = kN * cw;  // valid flattened k of this slice: k = i*cw + col
  const int num_coef = p.num_coef;

  dev::grid_dependency_wait();
  dev::allow_dependents_launch();

  // 1. The column table: for each 8-wide group of this CTA's (padded) slice,
  // its column within a token's row of X and phi (k = i*cw + col maps to
  // i*C + c0 + col), or -1 past the slice. Then the whole slice is issued as
  // kChunks groups of cp.async, all in flight at once; chunk q's completion is
  // tracked by mbarrier xbar[q] (every thread arrives once per chunk, when its
  // own copies have landed), so each warp starts on a chunk as soon as it is
  // there. Padding is zeroed with plain stores meanwhile.
  __shared__ __align__(8) uint64_t xbar[kChunks];
  int* gtab = reinterpret_cast<int*>(smem + L.off_gtab);
  if (tid < kChunks)
    dev::mbar_init(smem_u32(&xbar[tid]), kThreads);
  for (int q = tid; q < L.steps * 4; q += kThreads) {
    const int kk = q * 8;
    int gc = -1;
    if (kk < kv) {
      const int i = kk / cw;
      gc = i * hidden + c0 + (kk - i * cw);
    }
    gtab[q] = gc;
  }
  // kFp8: the scale table. Entries past the slice's blocks or the batch are
  // 0 (their codes are 0 too, and a 0 scale keeps the partial sums finite);
  // with kPost the post writes the others.
  const int cb = cw / 128;  // kFp8: blocks of a stream in this slice
  auto fill_scales = [&] {
    const int blocks = hidden / 128;
    const int table = kN * (L.slice / 128) * L.rows;
    for (int e = tid; e < table; e += kThreads) {
      const int kb = e / L.rows, r = e - kb * L.rows;
      const bool live = row0 + r < p.batch && kb < kN * cb;
      if (kPost && live) continue;
      float v = 0.f;
      if (live) {
        const int i = kb / cb;
        v = load_x_scale_ro(p.x_scales, ((row0 + r) * kN + i) * blocks + c0 / 128 + (kb - i * cb), p.x_ue8m0);
      }
      sc[e] = v;
    }
  };
  // Zeroes the pieces of xs past the slice or the batch.
  auto zero_padding = [&] {
    const int np_all = L.steps * kPiecesPerStep;
    for (int r = 0; r < L.rows; ++r) {
      const bool row_ok = row0 + r < p.batch;
      for (int pc = tid; pc < np_all; pc += kThreads)
        if (!row_ok || gtab[pc * kGroupsPerPiece] < 0)
          *reinterpret_cast<uint4*>(smem + (size_t(r) * L.pitch + pc * (16 / kElem)) * kElem) = make_uint4(0, 0, 0, 0);
    }
  };
  __syncthreads();  // barrier inits and the table visible to all
  if constexpr (kPost && kFp8) {
    // X_next on the FP8 stream: mhc_post_fp8_kernel's arithmetic (the fp32
    // chain, the block amax, quantize_fp8's rule) on a lane 8 columns of a
    // (token, stream), a half-warp a 128-column block (groups is a multiple
    // of 16, so the 16 lanes share a row and a block).
    fill_scales();
    const int groups = cw / 8;
    const PostInput& po = p.post;
    const unsigned half = 0xffffu << (tid & 16);
    const bool leader = (tid & 15) == 0;
    const uint8_t* xg = reinterpret_cast<const uint8_t*>(p.x);
    uint8_t* xn = reinterpret_cast<uint8_t*>(po.x_next);
    for (int it = tid; it < L.rows * groups; it += kThreads) {
      const int r = it / groups, col = (it - r * groups) * 8;
      const long long b = row0 + r;
      if (b >= p.batch) break;  // rows ascend, uniform over a half-warp; the padding below zeroes the rest
      float xf[kN][8];
#pragma unroll
      for (int j = 0; j < kN; ++j) {
        const long long e = b * p.k_len + (long long)j * hidden + c0 + col;
        dequant8(__ldcs(reinterpret_cast<const uint2*>(xg + e)), load_x_scale_ro(p.x_scales, e / 128, p.x_ue8m0),
                 xf[j]);
      }
      float ff[8];
      unpack8(dev::load_stream<bf16, 8>(po.f_out + b * hidden + c0 + col), ff);
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        float rr[kN], acc[8];
#pragma unroll
        for (int j = 0; j < kN; ++j)
          rr[j] = __ldg(po.h_res + b * kN * kN + (po.transpose ? j * kN + i : i * kN + j));
        post_fp8_values<kN>(xf, ff, rr, __ldg(po.h_post + b * kN + i), acc);
        uint2 q;
        const fp8_dev::Scale s = p.x_ue8m0 ? quantize_block_lane<ScaleFormat::kUE8M0>(acc, half, q)
                                           : quantize_block_lane<ScaleFormat::kFloat32>(acc, half, q);
        *reinterpret_cast<uint2*>(xq + size_t(r) * L.pitch + i * cw + col) = q;
        const long long e = b * p.k_len + (long long)i * hidden + c0 + col;
        if (xn != nullptr) __stcs(reinterpret_cast<uint2*>(xn + e), q);
        if (leader) {
          if (xn != nullptr) fp8_dev::store_scale(po.x_next_scales, uint32_t(e / 128), s.stored, p.x_ue8m0);
          sc[((i * cw + col) / 128) * L.rows + r] = stored_scale_value(s.stored, p.x_ue8m0);
        }
      }
    }
    zero_padding();
#pragma unroll
    for (int q = 0; q < kChunks; ++q) dev::mbar_arrive(smem_u32(&xbar[q]));
    __syncthreads();
  } else if constexpr (kPost) {
    const int groups = cw / 8;
    const PostInput& po = p.post;
    for (int it = tid; it < L.rows * groups; it += kThreads) {
      const int r = it / groups, col = (it - r * groups) * 8;
      const long long b = row0 + r;
      if (b >= p.batch) break;  // rows ascend; the padding below zeroes the rest
      uint4 xv[kN];
#pragma unroll
      for (int j = 0; j < kN; ++j)
        xv[j] = __ldg(reinterpret_cast<const uint4*>(p.x + b * p.k_len + (long long)j * hidden + c0 + col));
      const uint4 fv = __ldg(reinterpret_cast<const uint4*>(po.f_out + b * hidden + c0 + col));
      const uint32_t fw[4] = {fv.x, fv.y, fv.z, fv.w};
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        float rr[kN];
#pragma unroll
        for (int j = 0; j < kN; ++j)
          rr[j] = __ldg(po.h_res + b * kN * kN + (po.transpose ? j * kN + i : i * kN + j));
        const float post = __ldg(po.h_post + b * kN + i);
        uint32_t o[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          uint32_t xw[kN];
#pragma unroll
          for (int j = 0; j < kN; ++j) xw[j] = (&xv[j].x)[e];
          o[e] = post_mix_pair<kN>(xw, fw[e], rr, post);
        }
        const uint4 ov = make_uint4(o[0], o[1], o[2], o[3]);
        *reinterpret_cast<uint4*>(xs + r * L.pitch + i * cw + col) = ov;
        if (po.x_next != nullptr)
          __stcs(reinterpret_cast<uint4*>(po.x_next + (b * kN + i) * (long long)hidden + c0 + col), ov);
      }
    }
    zero_padding();
    // Every chunk is complete for this thread (the chunk barriers count each thread once).
#pragma unroll
    for (int q = 0; q < kChunks; ++q) dev::mbar_arrive(smem_u32(&xbar[q]));
    __syncthreads();
  } else {
#pragma unroll 1
    for (int q = 0; q < kChunks; ++q) {
      const int s0 = min(q * L.chunk_steps, L.steps), s1 = min(s0 + L.chunk_steps, L.steps);
      const int np = (s1 - s0) * kPiecesPerStep;
      for (int r = 0; r < L.rows; ++r) {
        if (row0 + r >= p.batch) break;
        const unsigned char* src = reinterpret_cast<const unsigned char*>(p.x) + (row0 + r) * p.k_len * kElem;
        unsigned char* dst = smem + (size_t(r) * L.pitch + s0 * 32) * kElem;
        for (int pc = tid; pc < np; pc += kThreads) {
          const int gc = gtab[(s0 * kPiecesPerStep + pc) * kGroupsPerPiece];
          if (gc >= 0) dev::cp_async16(dst + pc * 16, src + (long long)gc * kElem);
        }
      }
      asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(&xbar[q])) : "memory");
    }
    if constexpr (kFp8) fill_scales();  // behind the copies in flight
    zero_padding();
    __syncthreads();  // padding (and kFp8's scales) visible to all before any shared load of X
  }
  PhiRows<kN, kF32> prow;
  {
    using T = typename PhiRows<kN, kF32>::T;
    const int g = lane >> 2;
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int m = mt * 16 + g + hh * 8;
        prow.row[mt][hh] = m < num_coef ? static_cast<const T*>(p.phi) + (long long)m * p.k_len : nullptr;
      }
  }

  // 2. Partial projection (tensor cores) and sum of squares, chunk by chunk.
  float acc[kMt][kMaxRowTiles][4];
  float sq[kMaxRowTiles];
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
    for (int rt = 0; rt < kMaxRowTiles; ++rt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][rt][e] = 0.f;
#pragma unroll
  for (int rt = 0; rt < kMaxRowTiles; ++rt) sq[rt] = 0.f;

  // Each warp owns steps warp, warp + 8, ...; it loads phi for kBatch of them
  // at once (phi does not depend on X, so these loads overlap the X copies),
  // then waits for the X chunk of each step and runs its mma.
  constexpr int kBatch = kMt <= 2 ? 4 : (kMt <= 3 ? 2 : 1);
  const int my_steps = L.steps > warp ? (L.steps - warp + kWarps - 1) / kWarps : 0;
#pragma unroll 1
  for (int j0 = 0; j0 < my_steps; j0 += kBatch) {
    PhiFrag<kN, kF32> frag[kBatch];
#pragma unroll
    for (int bb = 0; bb < kBatch; ++bb)
      if (j0 + bb < my_steps) {
        if constexpr (kFp8) load_phi_step_fp8<kN, kF32>(frag[bb], prow, gtab, warp + (j0 + bb) * kWarps, lane);
        else load_phi_step<kN, kF32>(frag[bb], prow, gtab, warp + (j0 + bb) * kWarps, lane);
      }
#pragma unroll
    for (int bb = 0; bb < kBatch; ++bb) {
      if (j0 + bb >= my_steps) break;
      const int s = warp + (j0 + bb) * kWarps;
      {
        const uint32_t bar = smem_u32(&xbar[s / L.chunk_steps]);
        mbar_wait(bar, 0);
      }
      const PhiFrag<kN, kF32>& cur = frag[bb];
      uint32_t bfrag[kMaxRowTiles][4];
      // kFp8: the step's block scales of the C fragment's tokens (2t, 2t + 1).
      float s_even[kMaxRowTiles], s_odd[kMaxRowTiles];
#pragma unroll
      for (int rt = 0; rt < kMaxRowTiles; ++rt) {
        if (rt < L.row_tiles) {
          if constexpr (kFp8) {
            const int g = lane >> 2, t = lane & 3;
            const float* scb = sc + (s >> 2) * L.rows + rt * 8;  // 4 steps a block
            const uint2 codes =
                *reinterpret_cast<const uint2*>(xq + size_t(rt * 8 + g) * L.pitch + s * 32 + t * 8);
            const float sg = scb[g];
            sq[rt] = fmaf(sg * sg, e4m3x8_to_bf16_frags(codes, bfrag[rt]), sq[rt]);
            const float2 sp = *reinterpret_cast<const float2*>(scb + 2 * t);
            s_even[rt] = sp.x;
            s_odd[rt] = sp.y;
          } else {
            dev::ldmatrix_x4(bfrag[rt], smem_u32(xs + (rt * 8 + (lane & 7)) * L.pitch + s * 32 + (lane >> 3) * 8));
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bfrag[rt][e]));
              sq[rt] = fmaf(v.x, v.x, fmaf(v.y, v.y, sq[rt]));
            }
          }
        }
      }
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) {
        // kFp8: this step's sums of codes x phi, scaled once into acc.
        float part[kMaxRowTiles][4];
        if constexpr (kFp8) {
#pragma unroll
          for (int rt = 0; rt < kMaxRowTiles; ++rt)
#pragma unroll
            for (int e = 0; e < 4; ++e) part[rt][e] = 0.f;
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          uint32_t a_hi[4], a_lo[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if constexpr (kF32) {
              const float2 v = cur.v[mt][h][e];
              const __nv_bfloat162 hi = __floats2bfloat162_rn(v.x, v.y);
              const float2 hf = __bfloat1622float2(hi);
              a_hi[e] = pack_bf162(hi);
              a_lo[e] = pack_bf162(__floats2bfloat162_rn(v.x - hf.x, v.y - hf.y));
            } else {
              a_hi[e] = cur.v[mt][h][e];
            }
          }
#pragma unroll
          for (int rt = 0; rt < kMaxRowTiles; ++rt) {
            if (rt < L.row_tiles) {
              float(&d)[4] = kFp8 ? part[rt] : acc[mt][rt];
              dev::mma_bf16_16816(d, a_hi, bfrag[rt][2 * h], bfrag[rt][2 * h + 1]);
              if constexpr (kF32) dev::mma_bf16_16816(d, a_lo, bfrag[rt][2 * h], bfrag[rt][2 * h + 1]);
            }
          }
        }
        if constexpr (kFp8) {
#pragma unroll
          for (int rt = 0; rt < kMaxRowTiles; ++rt) {
            if (rt < L.row_tiles) {  // C fragment: columns 2t (e = 0, 2) and 2t + 1 (e = 1, 3)
              acc[mt][rt][0] = fmaf(part[rt][0], s_even[rt], acc[mt][rt][0]);
              acc[mt][rt][1] = fmaf(part[rt][1], s_odd[rt], acc[mt][rt][1]);
              acc[mt][rt][2] = fmaf(part[rt][2], s_even[rt], acc[mt][rt][2]);
              acc[mt][rt][3] = fmaf(part[rt][3], s_odd[rt], acc[mt][rt][3]);
            }
          }
        }
      }
    }
  }
  // Every thread's chunks have landed (its own copies are complete once all
  // barriers have flipped; warps with no steps wait here too) before the
  // shared memory is read by the pre mix.
#pragma unroll
  for (int q = 0; q < kChunks; ++q) {
    const uint32_t bar = smem_u32(&xbar[q]);
    mbar_wait(bar, 0);
  }

  // 3. Reduce over the warps (fixed order) into this CTA's partials.
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int rt = 0; rt < kMaxRowTiles; ++rt) {
    sq[rt] += __shfl_xor_sync(0xffffffffu, sq[rt], 1);
    sq[rt] += __shfl_xor_sync(0xffffffffu, sq[rt], 2);
  }
  const int rows = L.rows;
  float* my = scratch + warp * (kMpad + 1) * rows;
#pragma unroll
  for (int rt = 0; rt < kMaxRowTiles; ++rt) {
    if (rt < L.row_tiles) {
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) {
        const int m = mt * 16 + g, row = rt * 8 + t * 2;
        my[m * rows + row] = acc[mt][rt][0];
        my[m * rows + row + 1] = acc[mt][rt][1];
        my[(m + 8) * rows + row] = acc[mt][rt][2];
        my[(m + 8) * rows + row + 1] = acc[mt][rt][3];
      }
      if (t == 0) my[kMpad * rows + rt * 8 + g] = sq[rt];
    }
  }
  __syncthreads();
  // Every chunk has landed and been waited on by every thread: retire the
  // mbarriers before their shared memory could be reused.
  if (tid < kChunks) asm volatile("mbarrier.inval.shared::cta.b64 [%0];\n" ::"r"(smem_u32(&xbar[tid])) : "memory");
  const int num_vals = (num_coef + 1) * rows;
  for (int e = tid; e < num_vals; e += kThreads) {
    const int m = e / rows, row = e - m * rows;
    const int src_m = m == num_coef ? kMpad : m;
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += scratch[(w * (kMpad + 1) + src_m) * rows + row];
    xchg[e] = s;
  }

  // 4. Sum the 8 CTAs' partials through distributed shared memory, in rank order.
  cluster.sync();
  for (int e = tid; e < num_vals; e += kThreads) {
    float s = 0.f;
#pragma unroll
    for (int rk = 0; rk < kClusterSize; ++rk) s += cluster.map_shared_rank(xchg, rk)[e];
    total[e] = s;
  }
  cluster_arrive();  // done reading the peers' partials; each CTA waits for this before it exits
  __syncthreads();

  // 5. h, r and H_pre, one thread per token (identical in every CTA). Only
  // rank 0 needs H_post / H_res: its last warp runs Sinkhorn while the other
  // warps (and every warp of the other CTAs) do the pre mix.
  float* hbuf = reinterpret_cast<float*>(smem + L.off_h);  // [rows][kCoef]
  if (tid < rows) {
    const int row = tid;
    const long long b = row0 + row;
    const float r = sqrtf(total[num_coef * rows + row] / float(p.k_len) + p.eps_norm);
    float h[kCoef];
#pragma unroll
    for (int m = 0; m < kCoef; ++m) {
      const int ai = p.mode == ProjectMode::kHead ? 0 : alpha_index(m, kN);
      h[m] = m < num_coef ? __ldg(p.alpha + ai) * total[m * rows + row] / r + __ldg(p.bias + m) : 0.f;
    }
    if (p.mode == ProjectMode::kProject) {
      if (rank == 0 && b < p.batch) {
#pragma unroll
        for (int m = 0; m < kCoef; ++m)
          if (m < num_coef) p.h[b * num_coef + m] = h[m];
        p.r[b] = r;
      }
    } else {
#pragma unroll
      for (int i = 0; i < kN; ++i) hpre[row * kN + i] = sigmoidf_(h[i]) + p.act.eps_pre;
      if (p.mode == ProjectMode::kPre && rank == 0) {
#pragma unroll
        for (int m = 0; m < kCoef; ++m) hbuf[row * kCoef + m] = h[m];
      }
    }
  }
  __syncthreads();
  const bool sinkhorn_warp = p.mode == ProjectMode::kPre && rank == 0 && warp == kWarps - 1;
  if (sinkhorn_warp) {
    const long long b = row0 + lane;
    if (lane < rows && b < p.batch) {
      float h[kCoef], pre[kN], post[kN], res[kN * kN];
#pragma unroll
      for (int m = 0; m < kCoef; ++m) h[m] = hbuf[lane * kCoef + m];
      activate_token<kN>(h, p.act, pre, post, res);
#pragma unroll
      for (int i = 0; i < kN; ++i) p.h_post[b * kN + i] = post[i];
#pragma unroll
      for (int e = 0; e < kN * kN; ++e) p.h_res[b * kN * kN + e] = res[e];
    }
  }

  // 6. Pre mix of this CTA's slice, out of shared memory. With F_pre's
  // epilogue the bf16 F_pre also goes back into xs over stream 0's columns
  // (only the thread that mixes those 8 columns of the row reads them), and
  // to f_pre here only when no norm follows.
  const bool epi = p.mode == ProjectMode::kPre && p.has_epilogue();  // uniform
  // Where the epilogue finds the bf16 F_pre: over stream 0's columns of xs
  // (bf16 stream), or its own buffer (the FP8 stream's xs holds codes the
  // other threads are still mixing).
  bf16* fs = kFp8 ? reinterpret_cast<bf16*>(smem + L.off_fpre) : xs;
  const int fpitch = kFp8 ? L.fpitch : L.pitch;
  const bool store_mix = !epi || (p.epi.norm_weight == nullptr && p.f_out != nullptr);
  if (p.mode != ProjectMode::kProject && !sinkhorn_warp) {
    const int groups = cw / 8;
    const int mix_threads = p.mode == ProjectMode::kPre && rank == 0 ? kThreads - 32 : kThreads;
    for (int it = tid; it < rows * groups; it += mix_threads) {
      const int row = it / groups, col = (it - row * groups) * 8;
      if (row0 + row >= p.batch) continue;
      float out[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        float f[8];
        if constexpr (kFp8) {
          const int k = i * cw + col;
          dequant8(*reinterpret_cast<const uint2*>(xq + size_t(row) * L.pitch + k), sc[(k / 128) * rows + row], f);
        } else {
          const uint4 raw = *reinterpret_cast<const uint4*>(xs + row * L.pitch + i * cw + col);
          const __nv_bfloat162* v = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float2 x2 = __bfloat1622float2(v[e]);
            f[2 * e] = x2.x;
            f[2 * e + 1] = x2.y;
          }
        }
        const float w = hpre[row * kN + i];
#pragma unroll
        for (int e = 0; e < 8; ++e) out[e] = fmaf(w, f[e], out[e]);
      }
      uint4 o;
      __nv_bfloat162* ov = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
      for (int e = 0; e < 4; ++e) ov[e] = __floats2bfloat162_rn(out[2 * e], out[2 * e + 1]);
      if (epi) *reinterpret_cast<uint4*>(fs + row * fpitch + col) = o;
      if (store_mix) *reinterpret_cast<uint4*>(p.f_out + (row0 + row) * hidden + c0 + col) = o;
    }
  }
  // 7. F_pre's epilogue: the norm and the FP8 copy (cluster exchanges).
  if (epi) {
    __syncthreads();  // the tile's F_pre is in fs (the Sinkhorn warp joins here too)
    float* ep = reinterpret_cast<float*>(smem + L.off_epi);
    if (p.epi.norm_f32) {
      if (p.epi.ue8m0) f_pre_epilogue<true, ScaleFormat::kUE8M0>(p, L, fs, fpitch, ep, rank, row0, c0, cw);
      else f_pre_epilogue<true, ScaleFormat::kFloat32>(p, L, fs, fpitch, ep, rank, row0, c0, cw);
    } else {
      if (p.epi.ue8m0) f_pre_epilogue<false, ScaleFormat::kUE8M0>(p, L, fs, fpitch, ep, rank, row0, c0, cw);
      else f_pre_epilogue<false, ScaleFormat::kFloat32>(p, L, fs, fpitch, ep, rank, row0, c0, cw);
    }
  }
  cluster_wait();  // no CTA leaves while a peer may still read its partials
#endif
}

struct Choice {
  FusedLayout layout;
  size_t smem = 0;
};

// fp8: the FP8 residual stream's layout (FusedLayout's kFp8 fields).
template <int kN>
bool choose_layout(long long batch, int hidden, int num_coef, bool epilogue, bool fp8, int smem_optin, Choice& out) {
  constexpr int kMpad = coef_tiles<kN>() * 16;
  FusedLayout L;
  int kpad, row_bytes;
  if (fp8) {
    // Whole 128-column blocks per CTA (hidden % 128 == 0), so a step and a
    // (token, stream) block of X_next never straddle two CTAs; a CTA past C's
    // blocks holds nothing.
    const int blocks = hidden / 128;
    L.slice = ((blocks + kClusterSize - 1) / kClusterSize) * 128;
    kpad = kN * L.slice;
    // Bytes: kpad is a multiple of 128, so a row starts 32 banks-bytes on from
    // the last; a warp's 8-byte code loads of 8 rows x 32 bytes run in two
    // conflict-free wavefronts.
    L.pitch = kpad + 32;
    row_bytes = L.pitch;
  } else {
    const int groups = hidden / 8;
    L.slice = ((groups + kClusterSize - 1) / kClusterSize) * 8;
    kpad = ((kN * L.slice + 31) / 32) * 32;
    L.pitch = kpad + 8;  // kpad*2 bytes is a multiple of 64; + 16 bytes makes the pitch an odd number of 16-byte units
    row_bytes = L.pitch * 2;
  }
  L.steps = kpad / 32;
  const int per_chunk = (L.steps + kChunks - 1) / kChunks;
  L.chunk_steps = ((per_chunk + kWarps - 1) / kWarps) * kWarps;
  // Tall tiles amortise the phi reads; small batches use short tiles so more clusters run.
  const long long target_clusters = 16;
  int want = int(std::min<long long>(kMaxRowTiles, std::max<long long>(1, (batch + 8 * target_clusters - 1) /
                                                                                 (8 * target_clusters))));
  for (int rt = want; rt >= 1; --rt) {
    const int rows = rt * 8;
    size_t off = size_t(rows) * row_bytes;
    off = (off + 15) / 16 * 16;
    L.off_scratch = int(off);
    off += size_t(kWarps) * (kMpad + 1) * rows * 4;
    L.off_xchg = int(off);
    off += size_t(num_coef + 1) * rows * 4;
    L.off_total = int(off);
    off += size_t(num_coef + 1) * rows * 4;
    L.off_hpre = int(off);
    off += size_t(rows) * kN * 4;
    off = (off + 15) / 16 * 16;
    L.off_gtab = int(off);
    off += size_t(L.steps) * 4 * 4;
    L.off_h = int(off);
    off += size_t(rows) * (kN * kN + 2 * kN) * 4;
    if (epilogue) {  // the tile's rows do not change any token's arithmetic: results stay bitwise the same
      L.epi_blocks = L.slice / 128 + 2;
      L.off_epi = int(off);
      off += size_t(rows) * (2 + L.epi_blocks) * 4;
    }
    if (fp8) {
      off = (off + 15) / 16 * 16;
      L.off_sc = int(off);
      off += size_t(kN) * (L.slice / 128) * rows * 4;
      if (epilogue) {
        L.fpitch = L.slice + 8;
        L.off_fpre = int(off);
        off += size_t(rows) * L.fpitch * 2;
      }
    }
    if (off <= size_t(smem_optin)) {
      L.rows = rows;
      L.row_tiles = rt;
      out.layout = L;
      out.smem = off;
      return true;
    }
  }
  return false;
}

template <int kN, bool kF32, bool kPost, bool kFp8>
cudaError_t launch_fused(const ProjectParams& p, cudaStream_t stream, bool pdl, bool dry_run, const char** why_not) {
  auto kernel = sm90_mhc_fused_kernel<kN, kF32, kPost, kFp8>;
  int dynamic_max = 0;
  if (detail::prepare_kernel(detail::kernel_key(kernel), false, &dynamic_max) != cudaSuccess)
    return not_supported(why_not, "cluster tile: the kernel's attributes could not be set on this device");
  Choice c;
  if (!choose_layout<kN>(p.batch, p.hidden, p.num_coef, p.mode == ProjectMode::kPre && p.has_epilogue(), kFp8,
                         dynamic_max, c))
    return not_supported(why_not, "cluster tile: no tile of 8-24 tokens fits in shared memory at this C");
  const long long tiles = (p.batch + c.layout.rows - 1) / c.layout.rows;
  if (tiles * kClusterSize > 0x7fffffffLL) return not_supported(why_not, "cluster tile: too many tiles for one grid");
  // A cluster of 8 CTAs of this size must fit on the device.
  int clusters = 0;
  if (detail::active_clusters(detail::kernel_key(kernel), kThreads, c.smem, kClusterSize, &clusters) != cudaSuccess ||
      clusters < 1)
    return not_supported(why_not, "cluster tile: a cluster of 8 such CTAs does not fit on this device");
  if (dry_run) return cudaSuccess;
  cudaLaunchAttribute attr[2];
  cudaLaunchConfig_t config = dev::cluster_launch_config(attr, dim3(unsigned(tiles * kClusterSize)), dim3(kThreads),
                                                         c.smem, stream, kClusterSize, pdl);
  return cudaLaunchKernelEx(&config, kernel, p, c.layout);
}

}  // namespace

cudaError_t sm90_mhc_project_fused(const ProjectParams& p, int n, bool phi_is_f32, cudaStream_t stream, bool pdl,
                                   bool dry_run, const char** why_not) {
  detail::DeviceProps dev;
  if (detail::current_device_props(&dev) != cudaSuccess) return not_supported(why_not, "no usable CUDA device");
  // The kernel is built for sm_90a only.
  if (dev.cc_major != 9 || dev.cc_minor != 0) return not_supported(why_not, "cluster tile: needs an sm_90 GPU");
  cudaError_t err = cudaErrorNotSupported;
  // Every (phi dtype, fused post, residual stream) combination, by run-time value.
  auto launch = [&](auto kn, auto f32, auto post, auto fp8) {
    return launch_fused<decltype(kn)::value, decltype(f32)::value, decltype(post)::value, decltype(fp8)::value>(
        p, stream, pdl, dry_run, why_not);
  };
  using T = std::true_type;
  using F = std::false_type;
  dispatch_n(n, [&](auto kn) {
    if (p.fp8x) {
      if (p.has_post()) err = phi_is_f32 ? launch(kn, T{}, T{}, T{}) : launch(kn, F{}, T{}, T{});
      else err = phi_is_f32 ? launch(kn, T{}, F{}, T{}) : launch(kn, F{}, F{}, T{});
    } else {
      if (p.has_post()) err = phi_is_f32 ? launch(kn, T{}, T{}, F{}) : launch(kn, F{}, T{}, F{});
      else err = phi_is_f32 ? launch(kn, T{}, F{}, F{}) : launch(kn, F{}, F{}, F{});
    }
  });
  return err;
}

}  // namespace flashmix::mhc_detail
