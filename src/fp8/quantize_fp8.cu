// quantize_fp8 (spec §12): bf16 -> e4m3 with one scale per 1 x 128 or
// 128 x 128 block (spec §11.3):
//   amax = max |x|;  s = amax / 448 (kFloat32) | 2^ceil(log2(amax / 448)) (kUE8M0);  s = 1 if amax = 0
//   q = e4m3_satfinite(x / s), fp32 division, round to nearest even
//
// Roofline: memory bound. It must read the bf16 input once (2 bytes an
// element) and write the e4m3 output once (1 byte) plus a scale per 128
// (1x128: 4 / 128 bytes an element with fp32 scales): 3.03 bytes an
// element. At T=8192, H=7168 that is 178 MB: 53 us at 3.35 TB/s. Measured
// numbers and the design: docs/quantize_fp8.md.
//
// Work decomposition. A thread's unit is a chunk of 8 consecutive columns
// (one 16-byte load of bf16, one 8-byte store of e4m3). The block's amax is
// taken on the bf16 bits: with the sign bit cleared, magnitudes order as
// integers and every NaN lies above +inf, so an integer max finds both
// (redux.sync across the 4 or 32 lanes, shared memory across the warps of a
// 128 x 128 block).
//  - 1 x 128: four lanes per block, each with four of its 8-column chunks
//    (chunk 4 i + lane: every load and store instruction covers 64 / 32
//    contiguous bytes of a block), eight blocks a warp: the block's index
//    arithmetic, scale and divisor are computed once per 32 values a thread
//    instead of per 8 (docs/quantize_fp8.md).
//  - 128 x 128: a CTA of 256 threads per block, 16 lanes a row's 128
//    columns; thread t covers rows t/16 + 16 i (i < 8), all eight loads in
//    flight before the reduction.
// Rows or pointers off the 16-byte grid take narrower accesses (the same
// code with 8, 4 or 2 bytes of bf16 per access), never an error.
//
// Bitwise equal to quantize_fp8_cpu: the scale and x / s are IEEE fp32
// divisions (__fdiv_rn) and cvt.rn.satfinite.e4m3x2.f32 rounds once from
// fp32 (CUDA's software conversion does the same below sm_89). NaN blocks
// and NaN quotients (inf / inf) are written as the NaN byte 0x7f explicitly,
// so no NaN's sign depends on the hardware.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "common/check.h"
#include "common/launch.cuh"
#include "flashmix/fp8.h"
#include "fp8/quantize_fp8_device.cuh"
#include "fp8/quantize_fp8_internal.h"

namespace flashmix {
namespace {

using namespace fp8_dev;

constexpr const char* kOp = "quantize_fp8";
constexpr int kThreads = 256;
constexpr int kColsPerThread = 8;
constexpr int kLanesPerBlock = int(kFp8BlockCols) / kColsPerThread;  // 16
constexpr int kLanesPer1x128 = 4;                                                      // a 1 x 128 block's lanes
constexpr int kChunksPerLane = int(kFp8BlockCols) / kColsPerThread / kLanesPer1x128;  // 4
constexpr int k1x128PerCta = kThreads / kLanesPer1x128;                                // 64
constexpr int kTileRowsPerPass = kThreads / kLanesPerBlock;          // 16
constexpr int kTilePasses = 128 / kTileRowsPerPass;                  // 8

struct QuantizeParams {
  const uint16_t* x;  // bf16 bits
  uint8_t* q;
  void* scales;
  int64_t x_stride, x_batch_stride, q_stride, q_batch_stride;
  uint32_t rows;        // per matrix
  uint32_t row_blocks;  // per matrix (128x128)
  uint32_t col_blocks;
  uint32_t num_blocks;  // scales written: batch * (rows | row_blocks) * col_blocks
  // 1 x 128, batch 1: when not null, only the first min(*device_rows, rows) rows (read on the device).
  const int64_t* device_rows;
  bool batched;  // batch > 1
};

// Chunk (fp8_dev): eight consecutive bf16, loaded and stored with accesses of
// W elements (8: 16 bytes of bf16 and 8 of e4m3).
template <int W>
__device__ __forceinline__ Chunk load_chunk(const uint16_t* p) {
  Chunk c;
  if constexpr (W == 8) {
    const uint4 v = __ldcs(reinterpret_cast<const uint4*>(p));
    c.w[0] = v.x; c.w[1] = v.y; c.w[2] = v.z; c.w[3] = v.w;
  } else if constexpr (W == 4) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint2 v = __ldcs(reinterpret_cast<const uint2*>(p) + i);
      c.w[2 * i] = v.x; c.w[2 * i + 1] = v.y;
    }
  } else if constexpr (W == 2) {
#pragma unroll
    for (int i = 0; i < 4; ++i) c.w[i] = __ldcs(reinterpret_cast<const uint32_t*>(p) + i);
  } else {
    static_assert(W == 1, "W is 8, 4, 2 or 1");
#pragma unroll
    for (int i = 0; i < 4; ++i) c.w[i] = uint32_t(__ldcs(p + 2 * i)) | (uint32_t(__ldcs(p + 2 * i + 1)) << 16);
  }
  return c;
}

// Eight e4m3 bytes (two words, first element in the low byte).
template <int W>
__device__ __forceinline__ void store_q(uint8_t* p, uint32_t lo, uint32_t hi) {
  if constexpr (W == 8) {
    *reinterpret_cast<uint2*>(p) = make_uint2(lo, hi);
  } else if constexpr (W == 4) {
    reinterpret_cast<uint32_t*>(p)[0] = lo;
    reinterpret_cast<uint32_t*>(p)[1] = hi;
  } else if constexpr (W == 2) {
    uint16_t* d = reinterpret_cast<uint16_t*>(p);
    d[0] = uint16_t(lo); d[1] = uint16_t(lo >> 16); d[2] = uint16_t(hi); d[3] = uint16_t(hi >> 16);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      p[i] = uint8_t(lo >> (8 * i));
      p[4 + i] = uint8_t(hi >> (8 * i));
    }
  }
}

// 1 x 128: block g is (row g / col_blocks, column block g % col_blocks) over
// the batch's rows; its scale index is g. Lanes 4 j .. 4 j + 3 of a warp
// take one block, lane l its chunks 4 i + l (i < 4).
template <int W, ScaleFormat F>
__global__ void __launch_bounds__(kThreads) quantize_fp8_1x128_kernel(const QuantizeParams p) {
  dev::grid_dependency_wait();
  dev::allow_dependents_launch();
  const uint32_t lane = threadIdx.x % kLanesPer1x128;
  const unsigned team = 0xfu << (threadIdx.x & 28u);
  uint32_t num_blocks = p.num_blocks;
  if (p.device_rows != nullptr) {  // read after the wait: the kernel that wrote it has finished
    const int64_t live = *p.device_rows;
    const uint32_t rows = live <= 0 ? 0u : live >= int64_t(p.rows) ? p.rows : uint32_t(live);
    num_blocks = rows * p.col_blocks;
  }
  const uint64_t g = uint64_t(blockIdx.x) * k1x128PerCta + threadIdx.x / kLanesPer1x128;
  if (g >= num_blocks) return;  // the whole team (g is the same for its four lanes)
  const uint32_t row = uint32_t(g) / p.col_blocks, cb = uint32_t(g) - row * p.col_blocks;
  uint32_t b = 0, r = row;
  if (p.batched) {
    b = row / p.rows;
    r = row - b * p.rows;
  }
  const int64_t col = int64_t(cb) * kFp8BlockCols + lane * kColsPerThread;
  const uint16_t* x = p.x + b * p.x_batch_stride + r * p.x_stride + col;
  Chunk c[kChunksPerLane];
#pragma unroll
  for (int i = 0; i < kChunksPerLane; ++i) c[i] = load_chunk<W>(x + i * kLanesPer1x128 * kColsPerThread);
  uint2 codes[kChunksPerLane];
  const Scale s = quantize_team_block<F>(c, team, codes);
  if (lane == 0) store_scale(p.scales, uint32_t(g), s.stored, F == ScaleFormat::kUE8M0);
  uint8_t* q = p.q + b * p.q_batch_stride + r * p.q_stride + col;
#pragma unroll
  for (int i = 0; i < kChunksPerLane; ++i) store_q<W>(q + i * kLanesPer1x128 * kColsPerThread, codes[i].x, codes[i].y);
}

// 128 x 128: CTA g is block (matrix b, row block rb, column block cb) with
// g = (b * row_blocks + rb) * col_blocks + cb, its scale index.
template <int W, ScaleFormat F>
__global__ void __launch_bounds__(kThreads) quantize_fp8_128x128_kernel(const QuantizeParams p) {
  __shared__ uint32_t warp_amax[kThreads / 32];
  dev::grid_dependency_wait();
  dev::allow_dependents_launch();
  const uint32_t g = blockIdx.x;
  const uint32_t t = g / p.col_blocks, cb = g - t * p.col_blocks;
  const uint32_t b = t / p.row_blocks, rb = t - b * p.row_blocks;
  const uint32_t r0 = rb * 128u, rows_here = min(128u, p.rows - r0);
  const uint32_t lane = threadIdx.x % kLanesPerBlock, r_first = threadIdx.x / kLanesPerBlock;
  const int64_t col = int64_t(cb) * kFp8BlockCols + lane * kColsPerThread;
  const uint16_t* x = p.x + b * p.x_batch_stride + int64_t(r0) * p.x_stride + col;

  Chunk c[kTilePasses];
  uint32_t amax = 0;
#pragma unroll
  for (int i = 0; i < kTilePasses; ++i) {
    const uint32_t r = r_first + i * kTileRowsPerPass;
    if (r < rows_here) c[i] = load_chunk<W>(x + int64_t(r) * p.x_stride);
  }
#pragma unroll
  for (int i = 0; i < kTilePasses; ++i)
    if (r_first + i * kTileRowsPerPass < rows_here) amax = max(amax, chunk_amax_bits(c[i]));
  amax = __reduce_max_sync(0xffffffffu, amax);
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) amax = max(amax, warp_amax[w]);

  const bool nan_block = amax > kBf16Inf;
  const Scale s = nan_block ? Scale{0.0f, F == ScaleFormat::kUE8M0 ? 255u : 0x7fc00000u} : block_scale<F>(amax);
  if (threadIdx.x == 0) store_scale(p.scales, g, s.stored, F == ScaleFormat::kUE8M0);
  uint8_t* q = p.q + b * p.q_batch_stride + int64_t(r0) * p.q_stride + col;
#pragma unroll
  for (int i = 0; i < kTilePasses; ++i) {
    const uint32_t r = r_first + i * kTileRowsPerPass;
    if (r >= rows_here) continue;
    uint32_t lo, hi;
    quantize_chunk<F>(c[i], s.s, nan_block, lo, hi);
    store_q<W>(q + int64_t(r) * p.q_stride, lo, hi);
  }
}

template <int W, ScaleFormat F>
Status launch(const QuantizeParams& p, const QuantizeFp8Args& a, cudaStream_t stream) {
  cudaError_t err;
  if (a.block == Fp8Block::k128x128) {
    err = dev::launch(quantize_fp8_128x128_kernel<W, F>, dim3(p.num_blocks), dim3(kThreads), 0, stream,
                      a.enable_pdl, p);
  } else {
    const uint32_t grid = (p.num_blocks + k1x128PerCta - 1) / k1x128PerCta;
    err = dev::launch(quantize_fp8_1x128_kernel<W, F>, dim3(grid), dim3(kThreads), 0, stream, a.enable_pdl, p);
  }
  FM_RETURN_IF_ERROR(detail::cuda_status(err, kOp, "kernel launch"));
  return detail::check_launch(kOp);
}

template <int W>
Status dispatch_format(const QuantizeParams& p, const QuantizeFp8Args& a, cudaStream_t stream) {
  if (a.scale_format == ScaleFormat::kUE8M0) return launch<W, ScaleFormat::kUE8M0>(p, a, stream);
  return launch<W, ScaleFormat::kFloat32>(p, a, stream);
}

Status run_quantize(const QuantizeFp8Args& a, const int64_t* device_rows, cudaStream_t stream) {
  const QuantizeFp8Layout l = quantize_fp8_layout(a);
  QuantizeParams p{};
  p.x = static_cast<const uint16_t*>(a.x);
  p.q = static_cast<uint8_t*>(a.q);
  p.scales = a.scales;
  p.x_stride = l.x_stride;
  p.q_stride = l.q_stride;
  // A single matrix never steps by its batch stride.
  p.x_batch_stride = a.batch > 1 ? l.x_batch_stride : 0;
  p.q_batch_stride = a.batch > 1 ? l.q_batch_stride : 0;
  p.rows = uint32_t(a.rows);
  p.row_blocks = uint32_t(l.row_blocks);
  p.col_blocks = uint32_t(l.col_blocks);
  p.num_blocks = uint32_t(a.batch * (a.block == Fp8Block::k128x128 ? l.row_blocks : a.rows) * l.col_blocks);
  p.device_rows = device_rows;
  p.batched = a.batch > 1;
  // The widest access (elements) that every row start allows: columns
  // start at multiples of 8 elements, so only the pointers and strides matter.
  auto fits = [&](int64_t w) {
    return reinterpret_cast<uintptr_t>(p.x) % uintptr_t(2 * w) == 0 && p.x_stride % w == 0 &&
           p.x_batch_stride % w == 0 && reinterpret_cast<uintptr_t>(p.q) % uintptr_t(w) == 0 &&
           p.q_stride % w == 0 && p.q_batch_stride % w == 0;
  };
  if (fits(8)) return dispatch_format<8>(p, a, stream);
  if (fits(4)) return dispatch_format<4>(p, a, stream);
  if (fits(2)) return dispatch_format<2>(p, a, stream);
  return dispatch_format<1>(p, a, stream);
}

}  // namespace

Status quantize_fp8(const QuantizeFp8Args& a, cudaStream_t stream) {
  return detail::gpu_entry(kOp, validate_quantize_fp8(a), stream, a.batch == 0 || a.rows == 0,
                           [&] { return run_quantize(a, nullptr, stream); });
}

Status quantize_fp8_device_rows(const QuantizeFp8Args& a, const int64_t* device_rows, cudaStream_t stream) {
  FM_REQUIRE(a.block == Fp8Block::k1x128 && a.batch <= 1, kOp, "block",
             "a device row count needs 1 x 128 blocks and batch <= 1");
  FM_REQUIRE(device_rows != nullptr, kOp, "device_rows", "must not be null");
  return detail::gpu_entry(kOp, validate_quantize_fp8(a), stream, a.batch == 0 || a.rows == 0,
                           [&] { return run_quantize(a, device_rows, stream); });
}

}  // namespace flashmix
