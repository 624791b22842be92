// Device pieces of the FP8 residual stream (spec §4.9), for every mHC kernel
// that reads or writes it: an X element is fp32(e4m3(code) * scale), one
// scale per (token, stream, 128 channels) in [B, n, C/128]; X_next blocks are
// quantised from fp32 values with quantize_fp8's arithmetic
// (fp8/quantize_fp8_device.cuh), bit for bit.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "flashmix/fp8.h"
#include "fp8/quantize_fp8_device.cuh"

namespace flashmix::mhc_detail {

// A ue8m0 scale byte's value: 2^(b - 127), byte 255 NaN, byte 0 the subnormal 2^-127.
__device__ __forceinline__ float ue8m0_value(uint32_t b) {
  return b == 255u ? __uint_as_float(0x7fc00000u) : __uint_as_float(b ? b << 23 : 0x00400000u);
}

// The value of a stored scale (the float's bits, or the ue8m0 byte).
__device__ __forceinline__ float stored_scale_value(uint32_t stored, bool ue8m0) {
  return ue8m0 ? ue8m0_value(stored) : __uint_as_float(stored);
}

// The scale at `index` of a scale array (float or ue8m0). Streaming load: read once.
template <ScaleFormat F>
__device__ __forceinline__ float load_x_scale(const void* scales, long long index) {
  if constexpr (F == ScaleFormat::kFloat32) {
    return __ldcs(static_cast<const float*>(scales) + index);
  } else {
    return ue8m0_value(__ldcs(static_cast<const uint8_t*>(scales) + index));
  }
}

// The same by a run-time format, through the read-only path (kernels that
// read a token's scales more than once).
__device__ __forceinline__ float load_x_scale_ro(const void* scales, long long index, bool ue8m0) {
  return ue8m0 ? ue8m0_value(__ldg(static_cast<const uint8_t*>(scales) + index))
               : __ldg(static_cast<const float*>(scales) + index);
}

// Eight e4m3 codes (the first in the low byte of c.x) as floats, exact:
// e4m3 -> half is exact (NaN stays NaN), half -> float too.
__device__ __forceinline__ void e4m3x8_to_float(const uint2& c, float (&v)[8]) {
  const uint32_t w[2] = {c.x, c.y};
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(w[h] >> (16 * p)), __NV_E4M3);
      const float2 f = __half22float2(__half2(r));
      v[h * 4 + p * 2] = f.x;
      v[h * 4 + p * 2 + 1] = f.y;
    }
}

// Eight e4m3 codes times their block's scale, each product rounded once to
// fp32 (the element's value, §4.9).
__device__ __forceinline__ void dequant8(const uint2& c, float s, float* f) {
  float v[8];
  e4m3x8_to_float(c, v);
#pragma unroll
  for (int e = 0; e < 8; ++e) f[e] = __fmul_rn(v[e], s);
}

// Eight e4m3 codes as four bf16 pairs, out[k] = codes 2k (low half) and
// 2k + 1, and the sum of the codes' squares: the tensor-core fragments of
// the projection kernels, whose k order puts a thread's 8 consecutive codes
// in one shared load. Exact: an e4m3 value has at most 4 significant bits,
// so the top half of its f32 is its bf16 (NaN stays NaN).
__device__ __forceinline__ float e4m3x8_to_bf16_frags(uint2 c, uint32_t (&out)[4]) {
  float v[8];
  e4m3x8_to_float(c, v);
  float sq = 0.f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    out[k] = __byte_perm(__float_as_uint(v[2 * k]), __float_as_uint(v[2 * k + 1]), 0x7632);
    sq = fmaf(v[2 * k], v[2 * k], fmaf(v[2 * k + 1], v[2 * k + 1], sq));
  }
  return sq;
}

// X_next's eight fp32 values of one stream i on the FP8 stream, in spec
// §4.9's fixed order: acc = H_post_i * F_out, then acc = fma(R_ij, X_j, acc)
// for j = 0..n-1 (r[j] = R_ij). Every kernel that makes X_next on this stream
// (mhc_post, the boundary's fused post) makes it here, so they agree bit for bit.
template <int kN>
__device__ __forceinline__ void post_fp8_values(const float (&x)[kN][8], const float* f, const float* r, float post,
                                                float* acc) {
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] = __fmul_rn(post, f[e]);
#pragma unroll
  for (int j = 0; j < kN; ++j)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = __fmaf_rn(r[j], x[j][e], acc[e]);
}

// The max of `v` over the 16 lanes of this lane's half-warp (xor shuffles
// stay inside a half); `mask` names that half (both halves: 0xffffffff).
__device__ __forceinline__ uint32_t half_warp_max(uint32_t v, unsigned mask) {
#pragma unroll
  for (int off = 8; off >= 1; off >>= 1) v = max(v, __shfl_xor_sync(mask, v, off));
  return v;
}

// A lane's eight fp32 values of a 128-channel block whose 16 lanes are this
// half-warp (`mask`): the block's amax over the half, its scale (NaN for a
// NaN block) and the lane's eight e4m3 codes in q, by quantize_fp8's rule.
template <ScaleFormat F>
__device__ __forceinline__ fp8_dev::Scale quantize_block_lane(const float* v, unsigned mask, uint2& q) {
  const uint32_t amax = half_warp_max(fp8_dev::amax_bits_f32(v), mask);
  const fp8_dev::Scale sc = fp8_dev::block_scale_or_nan_f32<F>(amax);
  fp8_dev::quantize8_f32<F>(v, sc.s, amax > fp8_dev::kF32Inf, q.x, q.y);
  return sc;
}

}  // namespace flashmix::mhc_detail
