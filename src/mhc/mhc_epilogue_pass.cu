// F_pre's epilogue (spec §4.8) as a pass of its own: the next sublayer's
// input RMSNorm and the FP8 copy of F_pre, for the projection kernels that
// do not run it in-kernel (resident, split). The projection kernel writes
// the plain bf16 F_pre (to f_pre, or to the workspace's scratch when f_pre is
// null); this kernel reads it back once per token and writes the normed
// bf16 row (to f_pre, in place) and / or its e4m3 codes with 1 x 128 scales.
//
// The arithmetic is the cluster tiles' (sm90_mhc_fused.cu, f_pre_epilogue):
// 1/rms = 1 / sqrtf(sum / C + eps) with the sum of squares in fp32, each
// normed value bf16((v * inv) * w), and the FP8 copy bitwise quantize_fp8's
// of those bf16 values (fp8/quantize_fp8_device.cuh). Only the order of the
// fp32 sum of squares differs from the cluster tiles' (a fixed order here
// too: bitwise reproducible), which the spec's tolerance for a kernel change
// covers; the projection kernels' F_pre differ at that level anyway.
//
// One CTA of 256 threads a token row; a thread takes the row's 8-column
// chunks tid, tid + 256, ..., the first kCachedChunks kept in registers
// between the sum and the output (C <= 8192 is read from memory once), the
// rest read again (from L1 / L2). A 1 x 128 block is 16 chunks of 16
// consecutive threads: the half-warp reduces its amax with one redux.
// (Measured on an H100, mhc_post_pre B8192 norm_fp8: 256 threads x 4 cached
// chunks 658 us, 128 x 4 658, 256 x 2 664, 128 x 8 677 (87 registers: 5
// CTAs an SM), 512 x 2 681; decode B16 15.7 / 16.1 / 17.5 us for 256 x 4 /
// 256 x 2 / 128 x 8.)
#include <cuda_bf16.h>

#include <algorithm>

#include "common/launch.cuh"
#include "common/reduce.cuh"
#include "fp8/quantize_fp8_device.cuh"
#include "mhc/mhc_device.cuh"

namespace flashmix::mhc_detail {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kPassThreads = 256;
constexpr int kCachedChunks = 4;

struct PassParams {
  PreEpilogue epi;
  const bf16* f = nullptr;  // the plain F_pre [B, C]
  bf16* f_normed = nullptr; // the normed F_pre [B, C] (may be f); null: not stored
  long long batch = 0;
  int hidden = 0;
};

__device__ __forceinline__ uint4 load_chunk(const bf16* row, int g) {
  return *reinterpret_cast<const uint4*>(row + 8 * g);
}

// Chunk g of token b: normed (kNorm) and stored, then its FP8 bytes and,
// by the block's first lane, the block's scale (kFp8).
template <bool kNorm, bool kWeightF32, bool kFp8, ScaleFormat kScales>
__device__ __forceinline__ void emit_chunk(const PassParams& p, long long b, int g, uint4 raw, float inv) {
  using namespace fp8_dev;
  if constexpr (kNorm) {
    float w[8];
    load_weight8<kWeightF32>(p.epi, 8 * g, w);
    const uint4 o = normed_chunk(raw, inv, w);
    if (p.f_normed != nullptr) *reinterpret_cast<uint4*>(p.f_normed + b * p.hidden + 8 * g) = o;
    raw = o;
  }
  if constexpr (kFp8) {
    Chunk c;
    c.w[0] = raw.x; c.w[1] = raw.y; c.w[2] = raw.z; c.w[3] = raw.w;
    const unsigned half = 0xffffu << (threadIdx.x & 16);
    const uint32_t m = __reduce_max_sync(half, chunk_amax_bits(c));
    const Scale s = block_scale_or_nan<kScales>(m);
    uint32_t lo, hi;
    quantize_chunk<kScales>(c, s.s, m > kBf16Inf, lo, hi);
    *reinterpret_cast<uint2*>(p.epi.q + b * p.hidden + 8 * g) = make_uint2(lo, hi);
    if ((threadIdx.x & 15) == 0)
      store_scale(p.epi.scales, uint32_t(b * (p.hidden / 128) + g / 16), s.stored, kScales == ScaleFormat::kUE8M0);
  }
}

template <bool kNorm, bool kWeightF32, bool kFp8, ScaleFormat kScales>
__global__ void __launch_bounds__(kPassThreads) f_pre_epilogue_pass_kernel(const PassParams p) {
  dev::grid_dependency_wait();  // F_pre comes from the projection kernel ahead
  __shared__ float part[kPassThreads / 32];
  const int tid = threadIdx.x, groups = p.hidden / 8;
  for (long long b = blockIdx.x; b < p.batch; b += gridDim.x) {
    const bf16* row = p.f + b * p.hidden;
    uint4 cache[kCachedChunks];
    float inv = 1.0f;
    if constexpr (kNorm) {
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < kCachedChunks; ++i) {
        const int g = tid + i * kPassThreads;
        if (g < groups) {
          cache[i] = load_chunk(row, g);
          sum = chunk_sum_sq(cache[i], sum);
        }
      }
      for (int g = tid + kCachedChunks * kPassThreads; g < groups; g += kPassThreads)
        sum = chunk_sum_sq(load_chunk(row, g), sum);
      sum = dev::warp_sum(sum);
      if ((tid & 31) == 0) part[tid >> 5] = sum;
      __syncthreads();
      float total = 0.f;
#pragma unroll
      for (int w = 0; w < kPassThreads / 32; ++w) total += part[w];
      inv = 1.0f / sqrtf(total / float(p.hidden) + p.epi.norm_eps);
      __syncthreads();  // part is read by every thread before the next row writes it
    } else {
#pragma unroll
      for (int i = 0; i < kCachedChunks; ++i) {
        const int g = tid + i * kPassThreads;
        if (g < groups) cache[i] = load_chunk(row, g);
      }
    }
    // (With the FP8 copy C % 128 == 0: a half-warp's 16 chunks are all in
    // the row or all past it, so each redux has its whole half-warp.)
#pragma unroll
    for (int i = 0; i < kCachedChunks; ++i) {
      const int g = tid + i * kPassThreads;
      if (g < groups) emit_chunk<kNorm, kWeightF32, kFp8, kScales>(p, b, g, cache[i], inv);
    }
    for (int g = tid + kCachedChunks * kPassThreads; g < groups; g += kPassThreads)
      emit_chunk<kNorm, kWeightF32, kFp8, kScales>(p, b, g, load_chunk(row, g), inv);
  }
}

template <bool kNorm, bool kWeightF32, bool kFp8, ScaleFormat kScales>
cudaError_t launch_pass(const PassParams& p, cudaStream_t stream, bool pdl) {
  const unsigned grid = unsigned(std::min<long long>(p.batch, 1LL << 30));
  return dev::launch(f_pre_epilogue_pass_kernel<kNorm, kWeightF32, kFp8, kScales>, dim3(grid), dim3(kPassThreads),
                     0, stream, pdl, p);
}

template <bool kNorm, bool kWeightF32>
cudaError_t launch_pass_fp8(const PassParams& p, cudaStream_t stream, bool pdl) {
  if (p.epi.q == nullptr) return launch_pass<kNorm, kWeightF32, false, ScaleFormat::kFloat32>(p, stream, pdl);
  return p.epi.ue8m0 ? launch_pass<kNorm, kWeightF32, true, ScaleFormat::kUE8M0>(p, stream, pdl)
                     : launch_pass<kNorm, kWeightF32, true, ScaleFormat::kFloat32>(p, stream, pdl);
}

}  // namespace

cudaError_t launch_f_pre_epilogue_pass(const PreEpilogue& e, const bf16* f, bf16* f_normed, long long batch,
                                       int hidden, cudaStream_t stream, bool pdl) {
  PassParams p;
  p.epi = e;
  p.f = f;
  p.f_normed = e.norm_weight != nullptr ? f_normed : nullptr;
  p.batch = batch;
  p.hidden = hidden;
  if (batch == 0 || !e.any()) return cudaSuccess;
  if (e.norm_weight == nullptr) return launch_pass_fp8<false, false>(p, stream, pdl);
  return e.norm_f32 ? launch_pass_fp8<true, true>(p, stream, pdl) : launch_pass_fp8<true, false>(p, stream, pdl);
}

}  // namespace flashmix::mhc_detail
