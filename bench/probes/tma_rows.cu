// Probe: how fast a TMA ring streams a weight matrix into shared memory when
// its rows are `row_bytes` wide, at a given number of stages (bytes in
// flight), with consumers that do no work. The question it answers
// (docs/mxfp4.md §4.7): does the MXFP4 GEMMs' ring of 64-byte rows (half a
// K block of packed e2m1) stream slower per byte in flight than the dense
// rings' 128-byte rows? Layout as FC1's: tiles of 128 rows x the whole row
// (K), each tile read in boxes of row_bytes x 128 rows, tiles round-robin
// over one persistent CTA per SM, a ring of `stages` boxes per CTA, one
// producer thread, one consumer warp that waits and releases.
// Timed like flashmix-bench (events around one launch, median of 9, warm-up
// 2), against the same run's cudaMemcpy D2D rate (read + write counted).
// A stand-alone probe (not built by CMake):
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o tma_rows bench/probes/tma_rows.cu && ./tma_rows
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "probe_check.h"
#include "probe_tma.h"

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void tma_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(
          dst),
      "l"(map), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}

// blockDim 64: thread 0 produces, warp 1 consumes.
__global__ void __launch_bounds__(64) ring_kernel(const __grid_constant__ CUtensorMap map, int tiles, int k_boxes,
                                                  int row_bytes, int stages) {
  extern __shared__ __align__(1024) uint8_t smem[];
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + stages * 128 * row_bytes);
  const uint32_t full0 = smem_u32(bars), empty0 = full0 + 8 * stages;
  if (threadIdx.x == 0) {
    for (int i = 0; i < stages; ++i) {
      mbar_init(full0 + 8 * i, 1);
      mbar_init(empty0 + 8 * i, 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  int s = 0;
  uint32_t ph = 0;
  const uint32_t box = 128u * uint32_t(row_bytes);
  for (int t = blockIdx.x; t < tiles; t += gridDim.x)
    for (int kb = 0; kb < k_boxes; ++kb) {
      if (threadIdx.x == 0) {
        mbar_wait(empty0 + 8 * s, ph ^ 1);
        mbar_expect(full0 + 8 * s, box);
        tma_2d(smem_u32(smem) + s * box, &map, full0 + 8 * s, kb * row_bytes, t * 128);
      } else if (threadIdx.x == 32) {
        mbar_wait(full0 + 8 * s, ph);
        mbar_arrive(empty0 + 8 * s);
      }
      if (++s == stages) {
        s = 0;
        ph ^= 1;
      }
    }
}

int main() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const Encode encode = probe_tensor_map_encoder();
  // 10 "experts" of V4-Flash's packed W1: 4096 rows x 2048 bytes each (84 MB, larger than L2).
  const int64_t rows = 10 * 4096, K = 2048;
  uint8_t* w = nullptr;
  CK(cudaMalloc(&w, size_t(rows * K)));
  CK(cudaMemset(w, 0x5a, size_t(rows * K)));
  uint8_t* dst = nullptr;
  CK(cudaMalloc(&dst, size_t(rows * K)));
  const float copy_ms =
      probe_median_ms([&] { CK(cudaMemcpyAsync(dst, w, size_t(rows * K), cudaMemcpyDeviceToDevice)); });
  const double copy_gbps = 2.0 * double(rows * K) / (copy_ms * 1e-3) / 1e9;
  std::printf("%s, %d SMs; cudaMemcpy D2D %.0f GB/s (read + write)\n", prop.name, sms, copy_gbps);
  std::printf("row_bytes stages in_flight_KB  GB/s  fraction_of_copy\n");
  for (int row_bytes : {64, 128, 256})
    for (int stages : {2, 4, 7, 8, 14, 16, 24}) {
      const size_t smem = size_t(stages) * 128 * row_bytes + 16 * stages;
      if (smem > 227 * 1024) continue;
      CUtensorMap map;
      const cuuint64_t dims[2] = {cuuint64_t(K), cuuint64_t(rows)};
      const cuuint64_t strides[1] = {cuuint64_t(K)};
      const cuuint32_t boxd[2] = {cuuint32_t(row_bytes), 128};
      const cuuint32_t elem[2] = {1, 1};
      if (encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, w, dims, strides, boxd, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                 CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                 CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
        std::printf("encode failed for row_bytes %d\n", row_bytes);
        return 1;
      }
      CK(cudaFuncSetAttribute(ring_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      const int tiles = int(rows / 128), k_boxes = int(K / row_bytes);
      const float ms = probe_median_ms([&] { ring_kernel<<<sms, 64, smem>>>(map, tiles, k_boxes, row_bytes, stages); });
      CK(cudaGetLastError());
      const double gbps = double(rows * K) / (ms * 1e-3) / 1e9;
      std::printf("%9d %6d %12.0f %5.0f  %.3f\n", row_bytes, stages, stages * 128.0 * row_bytes / 1024, gbps,
                  gbps / copy_gbps);
    }
  return 0;
}
