// mxfp4_to_fp8_block and mxfp4_to_bf16 (spec §13): MXFP4 weights (e2m1
// codes, the even element in a byte's low nibble; one ue8m0 scale per 32
// along K) converted for the FP8 layer or dequantised to bf16.
//   fp8 block:  E = e_max(128 x 128 block, or 1 x 128) - 6;  scale 2^E;  q = e4m3(e2m1 * 2^(e - E))
//   bf16:       out = bf16(e2m1 * 2^e)
// (e = the sub-block's scale exponent; NaN scales give NaN elements and stay
// out of e_max.)
//
// Roofline: memory bound. fp8 block: reads 0.5 + 1/32 bytes an element,
// writes 1 (+ 4 bytes a 128 x 128 block): 1.53 bytes an element, 201 MB for
// 32 experts of V4-Flash's FC1 (2I = 4096, H = 4096): 60 us at 3.35 TB/s.
// bf16: 2.53 bytes an element. Measured: flashmix-bench op mxfp4_to_fp8_block.
//
// Bitwise equal to the CPU reference: e2m1 * 2^d is built exactly as fp32
// bits (d clamped at -30, far below where e4m3 rounds every value to zero)
// and cvt.rn.satfinite.e4m3x2.f32 rounds it once; the bf16 path multiplies
// two exact fp32 values (exact, or +-inf past the range) and rounds once.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>

#include "common/check.h"
#include "common/launch.cuh"
#include "common/reduce.cuh"
#include "flashmix/mxfp4.h"
#include "mxfp4/mxfp4_convert.cuh"
#include "mxfp4/mxfp4_internal.h"

namespace flashmix {
namespace {

constexpr int kThreads = 256;
constexpr uint32_t kE4m3NaNx4 = 0x7f7f7f7fu;

struct Fp8BlockParams {
  const uint8_t* w;  // packed [batch * rows, cols / 2]
  const uint8_t* w_scales;
  uint8_t* q;
  float* q_scales;
  uint32_t rows, row_blocks, col_blocks;
  int64_t cols;
};

// One CTA per 128 x 128 tile g = (b * row_blocks + rb) * col_blocks + cb.
// Thread t owns row t / 2 of the tile and its 64 columns (t % 2): two
// 32-element sub-blocks, 32 packed bytes in (two 16-byte loads), 64 e4m3
// bytes out (four 16-byte stores). The group's largest finite scale byte is
// reduced before anything is converted: over the CTA (128 x 128), or over
// the thread pair that holds the row (kRowGroups: 1 x 128).
template <bool kRowGroups>
__global__ void __launch_bounds__(kThreads) mxfp4_to_fp8_block_kernel(const Fp8BlockParams p) {
  dev::grid_dependency_wait();
  dev::allow_dependents_launch();
  const uint32_t g = blockIdx.x;
  const uint32_t t = g / p.col_blocks, cb = g - t * p.col_blocks;
  const uint32_t b = t / p.row_blocks, rb = t - b * p.row_blocks;
  const uint32_t r_in_block = threadIdx.x / 2, half = threadIdx.x % 2;
  const uint32_t r = rb * 128u + r_in_block;
  const bool live = r < p.rows;
  const int64_t row = int64_t(b) * p.rows + r;
  const int64_t col0 = int64_t(cb) * 128 + half * 64;  // first element of this thread

  uint4 packed[2];
  uint32_t scale[2] = {kUe8m0NaN, kUe8m0NaN};
  unsigned top = 0;  // largest finite scale byte + 1 (0: none)
  if (live) {
    const uint4* src = reinterpret_cast<const uint4*>(p.w + row * (p.cols / 2) + col0 / 2);
    packed[0] = __ldcs(src);
    packed[1] = __ldcs(src + 1);
    const uint8_t* s = p.w_scales + row * (p.cols / kMxfp4GroupCols) + col0 / kMxfp4GroupCols;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      scale[j] = __ldcs(s + j);
      if (scale[j] != kUe8m0NaN) top = max(top, scale[j] + 1);
    }
  }
  if constexpr (kRowGroups) {
    top = max(top, __shfl_xor_sync(0xffffffffu, top, 1));
  } else {
    __shared__ unsigned warp_max[kThreads / 32];
    top = dev::block_max(top, warp_max);
  }

  const int block_exp = top == 0 ? 0 : int(top) - 1 - 127 - kMxfp4Fp8TopShift;  // in [-133, 121]
  if constexpr (kRowGroups) {
    if (live && half == 0) p.q_scales[row * p.col_blocks + cb] = exp2_float(block_exp);  // [batch * rows, K / 128]
  } else if (threadIdx.x == 0) {
    p.q_scales[g] = exp2_float(block_exp);
  }
  if (!live) return;
  uint4* dst = reinterpret_cast<uint4*>(p.q + row * p.cols + col0);
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    uint4 o[2];
    if (scale[j] == kUe8m0NaN) {
      o[0] = o[1] = make_uint4(kE4m3NaNx4, kE4m3NaNx4, kE4m3NaNx4, kE4m3NaNx4);
    } else {
      const int d = max(int(scale[j]) - 127 - block_exp, kMxfp4MinShift);
      e2m1x8_to_e4m3(packed[j].x, d, o[0].x, o[0].y);
      e2m1x8_to_e4m3(packed[j].y, d, o[0].z, o[0].w);
      e2m1x8_to_e4m3(packed[j].z, d, o[1].x, o[1].y);
      e2m1x8_to_e4m3(packed[j].w, d, o[1].z, o[1].w);
    }
    dst[2 * j] = o[0];
    dst[2 * j + 1] = o[1];
  }
}

struct Bf16Params {
  const uint8_t* w;
  const uint8_t* w_scales;
  uint16_t* out;
  int64_t groups;  // 32-element sub-blocks in all: batch * rows * cols / 32
};

// A thread per 32-element sub-block (grid-stride): 16 packed bytes and one
// scale byte in, 64 bytes of bf16 out. Sub-blocks are contiguous in every
// array, so consecutive threads read and write consecutive memory.
__global__ void __launch_bounds__(kThreads) mxfp4_to_bf16_kernel(const Bf16Params p) {
  dev::grid_dependency_wait();
  dev::allow_dependents_launch();
  for (int64_t g = blockIdx.x * int64_t(kThreads) + threadIdx.x; g < p.groups; g += int64_t(gridDim.x) * kThreads) {
    const uint4 packed = __ldcs(reinterpret_cast<const uint4*>(p.w) + g);
    const uint32_t s = __ldcs(p.w_scales + g);
    uint4* dst = reinterpret_cast<uint4*>(p.out) + 4 * g;
    if (s == kUe8m0NaN) {
      const uint4 nan = make_uint4(0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u);
#pragma unroll
      for (int i = 0; i < 4; ++i) dst[i] = nan;
      continue;
    }
    const float scale = exp2_float(int(s) - 127);
    const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t o[4];
      e2m1x8_to_bf16(words[i], scale, o);
      dst[i] = make_uint4(o[0], o[1], o[2], o[3]);
    }
  }
}

}  // namespace

Status mxfp4_to_fp8_block(const Mxfp4ToFp8BlockArgs& a, cudaStream_t stream) {
  constexpr const char* kOp = "mxfp4_to_fp8_block";
  return detail::gpu_entry(kOp, validate_mxfp4_to_fp8_block(a), stream, a.batch == 0 || a.rows == 0, [&]() -> Status {
    Fp8BlockParams p{};
    p.w = static_cast<const uint8_t*>(a.w);
    p.w_scales = static_cast<const uint8_t*>(a.w_scales);
    p.q = static_cast<uint8_t*>(a.q);
    p.q_scales = a.q_scales;
    p.rows = uint32_t(a.rows);
    p.row_blocks = uint32_t((a.rows + kMxfp4Fp8BlockDim - 1) / kMxfp4Fp8BlockDim);
    p.col_blocks = uint32_t(a.cols / kMxfp4Fp8BlockDim);
    p.cols = a.cols;
    const uint32_t tiles = uint32_t(a.batch) * p.row_blocks * p.col_blocks;
    auto* kernel = a.block == Fp8Block::k1x128 ? mxfp4_to_fp8_block_kernel<true> : mxfp4_to_fp8_block_kernel<false>;
    FM_RETURN_IF_ERROR(detail::cuda_status(
        dev::launch(kernel, dim3(tiles), dim3(kThreads), 0, stream, a.enable_pdl, p), kOp, "kernel launch"));
    return detail::check_launch(kOp);
  });
}

Status mxfp4_to_bf16(const Mxfp4ToBf16Args& a, cudaStream_t stream) {
  constexpr const char* kOp = "mxfp4_to_bf16";
  return detail::gpu_entry(kOp, validate_mxfp4_to_bf16(a), stream, a.batch == 0 || a.rows == 0, [&]() -> Status {
    Bf16Params p{};
    p.w = static_cast<const uint8_t*>(a.w);
    p.w_scales = static_cast<const uint8_t*>(a.w_scales);
    p.out = static_cast<uint16_t*>(a.out);
    p.groups = a.batch * a.rows * (a.cols / kMxfp4GroupCols);
    constexpr int64_t kMaxGrid = int64_t(1) << 20;  // grid-stride beyond
    const int64_t grid = std::min((p.groups + kThreads - 1) / kThreads, kMaxGrid);
    FM_RETURN_IF_ERROR(detail::cuda_status(
        dev::launch(mxfp4_to_bf16_kernel, dim3(uint32_t(grid)), dim3(kThreads), 0, stream, a.enable_pdl, p), kOp,
        "kernel launch"));
    return detail::check_launch(kOp);
  });
}

}  // namespace flashmix
