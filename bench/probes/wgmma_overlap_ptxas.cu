// Compile-only probe: which shapes of "promote one wgmma partial sum while
// the next one's MMAs run" ptxas accepts without serialising every wgmma of
// the kernel (its C7514 note: "wgmma.mma_async instructions are serialized
// due to non wgmma instructions reading accumulator registers of a wgmma
// between start and end of the pipeline stage"; each QGMMA then waits for
// itself). Block-scaled FP8 K loops need the overlap: a K block's partial
// sum must be waited for before it is promoted (docs/fc2_grouped_gemm.md).
//
//   nvcc -arch=sm_90a -cubin -O3 -std=c++17 -I src -Xptxas -v -DSHAPE=<1|2> \
//        -o /tmp/p.cubin bench/probes/wgmma_overlap_ptxas.cu 2>&1 | grep -E "C75|Used"
//
// SHAPE 1, a double buffer across the loop's back edge (K block kb into
// p[kb % 2], wait_group 1, promote p[(kb - 1) % 2]): C7514, serialised
// (CUDA 13.0, 2026-11-28), though the PTX is legal. SHAPE 2, pairs (K blocks
// kb and kb + 1 into p0 and p1, wait_group 1, promote p0, wait_group 0,
// promote p1, every group retired inside the trip; an odd last K block
// alone): accepted, `WARPGROUP.DEPBAR.LE gsb0, 0x1` in the SASS. A group
// count that differs by path inside the trip (the second group under an if)
// is serialised too.
#include <cstdint>

#include "common/sm90.cuh"
#include "common/sm90_wgmma.cuh"

#ifndef SHAPE
#define SHAPE 2
#endif

using namespace flashmix;
constexpr int N = 96;

__device__ __forceinline__ void k_block(float (&d)[N / 2], uint64_t da, uint64_t db) {
  dev::fence_operands(d);
  dev::wgmma_fence();
#pragma unroll
  for (int j = 0; j < 4; ++j) dev::WgmmaFp8<N>::mma(d, da + 2 * j, db + 2 * j, j > 0 ? 1 : 0);
  dev::wgmma_commit();
}

__device__ __forceinline__ void promote(float (&acc)[N / 2], const float (&d)[N / 2], const float* sc) {
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = fmaf(d[i], sc[i & 7], acc[i]);
}

__global__ void probe(float* out, const float* sc, int k_blocks, uint64_t da, uint64_t db) {
  float acc[N / 2], p0[N / 2], p1[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = p0[i] = p1[i] = 0.f;
#if SHAPE == 1
  for (int kb = 0; kb + 1 < k_blocks; kb += 2) {
    k_block(p0, da + kb, db);
    dev::wgmma_wait<1>();
    dev::fence_operands(p1);
    if (kb > 0) promote(acc, p1, sc + 8 * (kb - 1));
    k_block(p1, da + kb + 1, db);
    dev::wgmma_wait<1>();
    dev::fence_operands(p0);
    promote(acc, p0, sc + 8 * kb);
  }
  dev::wgmma_wait<0>();
  dev::fence_operands(p1);
  promote(acc, p1, sc);
#else
  for (int kb = 0; kb + 1 < k_blocks; kb += 2) {
    k_block(p0, da + kb, db);
    k_block(p1, da + kb + 1, db);
    dev::wgmma_wait<1>();
    dev::fence_operands(p0);
    promote(acc, p0, sc + 8 * kb);
    dev::wgmma_wait<0>();
    dev::fence_operands(p1);
    promote(acc, p1, sc + 8 * (kb + 1));
  }
  if (k_blocks & 1) {
    k_block(p0, da + k_blocks - 1, db);
    dev::wgmma_wait<0>();
    dev::fence_operands(p0);
    promote(acc, p0, sc);
  }
#endif
  for (int i = 0; i < N / 2; ++i) out[threadIdx.x * (N / 2) + i] = acc[i];
}
