// The device toolkit's reductions: warp and block sums in a fixed order, so
// results are bitwise reproducible from run to run.
#pragma once

#include <cuda_runtime.h>

namespace flashmix::dev {

constexpr unsigned kFullMask = 0xffffffffu;

template <typename T>
__device__ __forceinline__ T warp_sum(T x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}

template <typename T>
__device__ __forceinline__ T warp_max(T x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x = max(x, __shfl_xor_sync(kFullMask, x, offset));
  return x;
}

// Sum over all threads of the block; every thread gets the result.
// `scratch` holds at least blockDim.x / 32 elements; blockDim.x is a multiple of 32.
template <typename T>
__device__ __forceinline__ T block_sum(T x, T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  x = warp_sum(x);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  T total = T(0);
  for (int w = 0; w < warps; ++w) total += scratch[w];  // same order in every thread
  return total;
}

// Max over all threads of the block; every thread gets the result.
// `scratch` holds at least blockDim.x / 32 elements; blockDim.x is a multiple
// of 32; every thread of the block calls it.
template <typename T>
__device__ __forceinline__ T block_max(T x, T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  x = warp_max(x);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  for (int w = 0; w < warps; ++w) x = max(x, scratch[w]);
  return x;
}

}  // namespace flashmix::dev
