// Probe: how fast can FC1's gather feed a stage ring with token rows read in
// a permuted order from X [T, H] bf16? The wide bf16 tile's stage is W1's box
// (256 rows x 128 bytes by one 2-D TMA) + 128 gathered rows x 128 bytes (64
// bf16 of K). The rows come by
//   0 cp.async: 128 loader threads, 16 bytes each per instruction, 8 rows a
//     thread (what sm90_fc1_gemm.cu's load_tiles does), counted by
//     cp.async.mbarrier.arrive.noinc;
//   1 one-row TMA boxes, issued by the 128 loader threads (a row each);
//   2 one-row TMA boxes, issued by one warp (4 rows a lane);
//   3 one-row TMA boxes, issued by one thread (128 a stage);
//   4 no rows (W1's box alone: the ring's rate without the gather);
//   8 + i: TMA boxes of 128 >> i consecutive rows (a permuted X: no gather).
// W1 (wmode): 2-D boxes of 256 >> (wmode - 2) rows (2: one box), or, wmode
// 1, FC1's 5-D box (K 64, row 8, gate / up 2, block 16, expert 1).
// The consumers (one warp) wait and release: no MMAs, so the times are the
// feed's own. One persistent CTA per SM, tiles round-robin, 4 stages of 48 KB.
// Timed like flashmix-bench (events around one launch, median of 9, warm-up
// 2), against the same run's cudaMemcpy D2D rate (read + write counted).
// A stand-alone probe (not built by CMake; docs/moe_fc1.md quotes it):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I src -o tma_gather \
//        bench/probes/tma_gather.cu
//   ./tma_gather        (X 512 MiB, W1 224 MiB: from HBM)
//   ./tma_gather l2     (X 16 MiB, W1 8 MiB, re-read: from L2)
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/sm90.cuh"  // the kernels' own mbarrier / TMA / cp.async helpers
#include "probe_check.h"
#include "probe_tma.h"

namespace {
namespace dev = flashmix::dev;
constexpr int kStages = 4, kRows = 128, kWRows = 256, kRowBytes = 128;
constexpr int kWBytes = kWRows * kRowBytes, kXBytes = kRows * kRowBytes, kStageBytes = kWBytes + kXBytes;

struct Maps {
  CUtensorMap w5, x1;
  CUtensorMap wb[5];  // W1 in 2-D boxes of 256 >> i rows
  CUtensorMap xb[5];  // X in 2-D boxes of 128 >> i rows
};
__global__ void __launch_bounds__(160) gather_kernel(const __grid_constant__ Maps maps, const uint8_t* X,
                                                     const int* perm, int tiles, int perm_tiles, int w_tiles,
                                                     int k_blocks, int64_t x_row_bytes, int mode, int wmode) {
  const CUtensorMap& map_x1 = maps.x1;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  const uint32_t full0 = dev::smem_u32(bars), empty0 = full0 + 8 * kStages;
  const int tid = threadIdx.x;
  if (tid == 0) {
    // Full: thread 0's expect_tx, plus the cp.async threads' noinc arrivals (mode 0).
    for (int i = 0; i < kStages; ++i) {
      dev::mbar_init(full0 + 8 * i, mode == 0 ? 1 + 128 : 1);
      dev::mbar_init(empty0 + 8 * i, 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  int s = 0;
  uint32_t ph = 0;
  const int r0 = tid >> 3, q = tid & 7;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int* rows = perm + int64_t(t % perm_tiles) * kRows;
    const int wt = t % w_tiles;
    for (int kb = 0; kb < k_blocks; ++kb) {
      const uint32_t full = full0 + 8 * s, st = dev::smem_u32(smem) + s * kStageBytes;
      if (tid < 128) {
        dev::mbar_wait(empty0 + 8 * s, ph ^ 1);
        if (tid == 0) {
          const uint32_t x_bytes = mode == 4 ? 0 : kXBytes;
          dev::mbar_arrive_expect_tx(full, kWBytes + (mode == 0 ? 0 : x_bytes));
          if (wmode >= 2) {  // W1 in 2-D boxes of 256 >> (wmode - 2) rows
            const int n = 256 >> (wmode - 2);
            for (int r = 0; r < kWRows; r += n)
              dev::tma_load_2d(st + r * kRowBytes, &maps.wb[wmode - 2], full, kb * 64, wt * kWRows + r);
          } else {  // FC1's 5-D box: 16 blocks of 8 gate rows then their 8 up rows
            dev::tma_load_5d(st, &maps.w5, full, kb * 64, 0, 0, (wt % 4) * 16, wt / 4);
          }
        }
        if (mode == 0) {
#pragma unroll
          for (int i = 0; i < kRows / 16; ++i) {
            const int r = r0 + 16 * i;
            const uint8_t* g = X + int64_t(rows[r]) * x_row_bytes + kb * kRowBytes + 16 * q;
            dev::cp_async_16(st + kWBytes + r * kRowBytes + ((q ^ (r & 7)) << 4), g, 16);
          }
          dev::cp_async_mbar_arrive_noinc(full);
        } else if (mode == 1) {
          dev::tma_load_2d(st + kWBytes + tid * kRowBytes, &map_x1, full, kb * 64, rows[tid]);
        } else if (mode == 2) {
          if (tid < 32)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int r = tid + 32 * i;
              dev::tma_load_2d(st + kWBytes + r * kRowBytes, &map_x1, full, kb * 64, rows[r]);
            }
        } else if (mode == 3) {
          if (tid == 0)
            for (int r = 0; r < kRows; ++r)
              dev::tma_load_2d(st + kWBytes + r * kRowBytes, &map_x1, full, kb * 64, rows[r]);
        } else if (mode >= 8) {  // boxes of 128 >> (mode - 8) consecutive rows (a permuted X)
          const int n = 128 >> (mode - 8);
          if (tid == 0)
            for (int r = 0; r < kRows; r += n)
              dev::tma_load_2d(st + kWBytes + r * kRowBytes, &maps.xb[mode - 8], full, kb * 64,
                               (t % perm_tiles) * kRows + r);
        }
      } else if (tid == 128) {
        dev::mbar_wait(full, ph);
        dev::mbar_arrive(empty0 + 8 * s);
      }
      if (++s == kStages) {
        s = 0;
        ph ^= 1;
      }
    }
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}
}  // namespace

int main(int argc, char** argv) {
  // "l2": X of 2048 tokens and W1 of 1024 rows (24 MiB, L2-resident) and the
  // tiles cycling over them, so the SM's intake, not HBM, sets the rate.
  const bool l2 = argc > 1 && std::string(argv[1]) == "l2";
  int sms = 0, clock_khz = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const Encode encode = probe_tensor_map_encoder();
  // X: 65536 tokens x H 4096 bf16 (512 MiB); W1: 28672 rows x 4096 (Mixtral's 2I x H, 224 MiB).
  const int T = l2 ? 2048 : 1 << 16, H = 4096, WR = l2 ? 1024 : 28672;
  const int64_t row_bytes = int64_t(H) * 2;
  uint8_t *X = nullptr, *W = nullptr;
  CK(cudaMalloc(&X, size_t(T) * row_bytes));
  CK(cudaMalloc(&W, size_t(WR) * row_bytes));
  CK(cudaMemset(X, 0x3c, size_t(T) * row_bytes));
  CK(cudaMemset(W, 0x3c, size_t(WR) * row_bytes));
  const int perm_tiles = T / kRows, tiles = l2 ? 2048 : perm_tiles, w_tiles = WR / kWRows, k_blocks = H / 64;
  std::vector<int> perm(T);
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937 rng(7);
  std::shuffle(perm.begin(), perm.end(), rng);
  int* d_perm = nullptr;
  CK(cudaMalloc(&d_perm, sizeof(int) * T));
  CK(cudaMemcpy(d_perm, perm.data(), sizeof(int) * T, cudaMemcpyHostToDevice));

  auto make_map = [&](void* base, int rows, int box_rows) {
    CUtensorMap m;
    const cuuint64_t dims[2] = {cuuint64_t(H), cuuint64_t(rows)};
    const cuuint64_t strides[1] = {cuuint64_t(row_bytes)};
    const cuuint32_t boxd[2] = {64, cuuint32_t(box_rows)};
    const cuuint32_t elem[2] = {1, 1};
    if (encode(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, dims, strides, boxd, elem,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
      std::printf("encode failed (box rows %d)\n", box_rows);
      std::exit(1);
    }
    return m;
  };
  Maps maps;
  maps.x1 = make_map(X, T, 1);
  for (int i = 0; i < 5; ++i) {
    maps.wb[i] = make_map(W, WR, 256 >> i);
    maps.xb[i] = make_map(X, T, 128 >> i);
  }
  {  // W as [E, 2I, H] with I = 512 (gate rows then up rows), FC1's 5-D view
    const cuuint64_t I = 512, E = cuuint64_t(WR) / (2 * I);
    const cuuint64_t dims[5] = {cuuint64_t(H), 8, 2, I / 8, E};
    const cuuint64_t strides[4] = {cuuint64_t(row_bytes), I * row_bytes, 8 * row_bytes, 2 * I * row_bytes};
    const cuuint32_t box[5] = {64, 8, 2, 16, 1};
    const cuuint32_t elem[5] = {1, 1, 1, 1, 1};
    if (encode(&maps.w5, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 5, W, dims, strides, box, elem,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
      std::printf("encode failed (5-D W)\n");
      return 1;
    }
  }

  const float copy_ms =
      probe_median_ms([&] { CK(cudaMemcpyAsync(W, X, size_t(WR) * row_bytes, cudaMemcpyDeviceToDevice)); });
  const double copy_gbps = 2.0 * double(WR) * row_bytes / (copy_ms * 1e-3) / 1e9;  // (l2: an L2-resident copy)
  std::printf("%s, %d SMs, %d MHz; cudaMemcpy D2D %.0f GB/s (read + write)\n", prop.name, sms, clock_khz / 1000,
              copy_gbps);
  const size_t smem = size_t(kStages) * kStageBytes + 16 * kStages + 1024;
  CK(cudaFuncSetAttribute(gather_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const char* names[] = {"cp.async 16 B x 128 threads", "TMA 1-row boxes, 128 issuers", "TMA 1-row boxes, one warp",
                         "TMA 1-row boxes, one thread", "W1 box alone (no rows)"};
  auto run = [&](int mode, int wmode) {
    const float ms = probe_median_ms([&] {
      gather_kernel<<<sms, 160, smem>>>(maps, X, d_perm, tiles, perm_tiles, w_tiles, k_blocks, row_bytes, mode, wmode);
    });
    CK(cudaGetLastError());
    const double stages_per_sm = double(tiles) * k_blocks / sms;
    const double stage_ns = ms * 1e6 / stages_per_sm;
    const double clk = stage_ns * 1e-9 * clock_khz * 1e3;
    const double x_bytes = mode == 4 ? 0 : kXBytes;
    const double total = double(tiles) * k_blocks * (kWBytes + x_bytes);
    const double gbps = total / (ms * 1e-3) / 1e9;
    char wname[32], xname[40];
    if (wmode == 1)
      std::snprintf(wname, sizeof wname, "5-D x1");
    else
      std::snprintf(wname, sizeof wname, "%dx%d", 1 << (wmode - 2), 256 >> (wmode - 2));
    if (mode >= 8)
      std::snprintf(xname, sizeof xname, "TMA %d-row boxes (permuted X)", 128 >> (mode - 8));
    else
      std::snprintf(xname, sizeof xname, "%s", names[mode]);
    std::printf("%-7s %-30s %6.0f %9.0f %9.1f %10.1f %11.0f %8.3f\n", wname, xname, ms * 1e3, stage_ns, x_bytes / clk,
                (kWBytes + x_bytes) / clk, gbps, gbps / copy_gbps);
  };
  std::printf("W1 box  rows                            us  stage_ns rows_B/clk stage_B/clk total_GB/s "
              "fraction_of_copy\n");
  for (int round = 0; round < 2; ++round) {
    for (int wmode : {2, 1, 3, 4, 5, 6}) run(4, wmode);  // W1 alone, by box size (2: one 256-row box)
    for (int mode : {0, 1, 2, 3, 8, 9, 10, 11, 12}) run(mode, 2);  // the rows beside one 256-row W1 box
    for (int wmode : {3, 4, 5})
      for (int mode : {0, 9, 10, 11}) run(mode, wmode);     // both split
  }
  return 0;
}
