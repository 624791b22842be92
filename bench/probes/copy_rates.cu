// Probe: SM-kernel copy bandwidth vs cudaMemcpy's D2D rate (the benchmark's
// copy ceiling): read-only and write-only rates, row-gather copies, and which
// copy method (store flavour, loads in flight, tiles, TMA bulk copies) comes
// closest. Timed like flashmix-bench (events around one launch, median of
// 30, warm-up 5). `copy_rates methods` runs the copy-method comparison;
// `copy_rates l2mix` the L2 read rate and the HBM + L2 mix of the bias case;
// `copy_rates reds` the rate of the FC2 epilogue's scatter reductions.
// A stand-alone probe (not built by CMake; docs/moe_finalize.md quotes it):
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o copy_rates bench/probes/copy_rates.cu && ./copy_rates
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#include "probe_check.h"

__global__ void copy_kernel(const uint4* __restrict__ a, uint4* __restrict__ b, size_t n) {
  size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x, s = size_t(gridDim.x) * blockDim.x;
  for (; i + 3 * s < n; i += 4 * s) {
    uint4 x0 = __ldcs(a + i), x1 = __ldcs(a + i + s), x2 = __ldcs(a + i + 2 * s), x3 = __ldcs(a + i + 3 * s);
    b[i] = x0; b[i + s] = x1; b[i + 2 * s] = x2; b[i + 3 * s] = x3;
  }
  for (; i < n; i += s) b[i] = a[i];
}
__global__ void read_kernel(const uint4* __restrict__ a, size_t n, unsigned* sink) {
  size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x, s = size_t(gridDim.x) * blockDim.x;
  unsigned acc = 0;
  for (; i + 3 * s < n; i += 4 * s) {
    uint4 x0 = __ldcs(a + i), x1 = __ldcs(a + i + s), x2 = __ldcs(a + i + 2 * s), x3 = __ldcs(a + i + 3 * s);
    acc ^= x0.x ^ x1.y ^ x2.z ^ x3.w;
  }
  if (acc == 0x12345678u) *sink = acc;
}
__global__ void write_kernel(uint4* __restrict__ b, size_t n) {
  size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x, s = size_t(gridDim.x) * blockDim.x;
  for (; i < n; i += s) b[i] = make_uint4(i, 1, 2, 3);
}
// out row r = in row perm[r] (rows of `vecs` 16-byte vectors), a block per row group
__global__ void gather_rows(const uint4* __restrict__ a, uint4* __restrict__ b, const int* perm, int rows, int vecs) {
  for (int r = blockIdx.x; r < rows; r += gridDim.x) {
    const uint4* src = a + size_t(perm[r]) * vecs;
    uint4* dst = b + size_t(r) * vecs;
    for (int v = threadIdx.x; v < vecs; v += blockDim.x) dst[v] = __ldcs(src + v);
  }
}
// out row r = sum of in rows 2r, 2r+1 (bf16 pairs as raw adds: bandwidth only)
__global__ void sum2_kernel(const uint4* __restrict__ a, uint4* __restrict__ b, int rows, int vecs) {
  for (int r = blockIdx.x; r < rows; r += gridDim.x) {
    const uint4* s0 = a + size_t(2 * r) * vecs; const uint4* s1 = s0 + vecs;
    for (int v = threadIdx.x; v < vecs; v += blockDim.x) {
      uint4 x = __ldcs(s0 + v), y = __ldcs(s1 + v);
      b[size_t(r) * vecs + v] = make_uint4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
    }
  }
}

template <int L, int kStore>  // kStore: 0 plain, 1 st.global.cs, 2 st.global.L1::no_allocate
__global__ void copy_gs(const uint4* __restrict__ a, uint4* __restrict__ b, size_t n) {
  size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x, s = size_t(gridDim.x) * blockDim.x;
  for (; i + (L - 1) * s < n; i += L * s) {
    uint4 x[L];
#pragma unroll
    for (int j = 0; j < L; ++j) x[j] = __ldcs(a + i + j * s);
#pragma unroll
    for (int j = 0; j < L; ++j) {
      if (kStore == 0) b[i + j * s] = x[j];
      else if (kStore == 1) __stcs(b + i + j * s, x[j]);
      else asm volatile("st.global.L1::no_allocate.v4.u32 [%0], {%1,%2,%3,%4};" :: "l"(b + i + j * s), "r"(x[j].x), "r"(x[j].y), "r"(x[j].z), "r"(x[j].w) : "memory");
    }
  }
  for (; i < n; i += s) b[i] = a[i];
}
// Each block copies contiguous 16 KB tiles: tile t = blockIdx + k*grid.
template <int L>
__global__ void copy_tiles(const uint4* __restrict__ a, uint4* __restrict__ b, size_t n) {
  const size_t tile = 1024;  // vectors (16 KB)
  const size_t tiles = n / tile;
  for (size_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const uint4* src = a + t * tile; uint4* dst = b + t * tile;
    uint4 x[L];
#pragma unroll
    for (int j = 0; j < L; ++j) x[j] = __ldcs(src + threadIdx.x + j * blockDim.x);
#pragma unroll
    for (int j = 0; j < L; ++j) dst[threadIdx.x + j * blockDim.x] = x[j];
  }
}
// TMA: bulk G2S of a chunk into smem, then bulk S2G, kStages chunks in flight per block.
template <int kChunk, int kStages>
__global__ void copy_bulk(const char* __restrict__ a, char* __restrict__ b, size_t bytes) {
  extern __shared__ __align__(128) char sm[];
  __shared__ __align__(8) uint64_t full[kStages];
  const size_t chunks = bytes / kChunk;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"((unsigned)__cvta_generic_to_shared(&full[s])));
    asm volatile("fence.mbarrier_init.release.cluster;\n fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  auto load = [&](size_t c, int s) {
    unsigned bar = (unsigned)__cvta_generic_to_shared(&full[s]);
    unsigned dst = (unsigned)__cvta_generic_to_shared(sm + s * kChunk);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(kChunk) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" :: "r"(dst), "l"(a + c * kChunk), "r"(kChunk), "r"(bar) : "memory");
  };
  int k = 0;
  size_t c0 = blockIdx.x;
  for (int s = 0; s < kStages; ++s) if (c0 + s * gridDim.x < chunks) load(c0 + s * gridDim.x, s);
  for (size_t c = c0; c < chunks; c += gridDim.x, ++k) {
    const int s = k % kStages; const unsigned par = (k / kStages) & 1;
    unsigned bar = (unsigned)__cvta_generic_to_shared(&full[s]);
    unsigned done = 0;
    while (!done) asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0,1,0,p; }" : "=r"(done) : "r"(bar), "r"(par) : "memory");
    unsigned src = (unsigned)__cvta_generic_to_shared(sm + s * kChunk);
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" :: "l"(b + c * kChunk), "r"(src), "r"(kChunk) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");  // smem stage free again
    const size_t nc = c + size_t(kStages) * gridDim.x;
    if (nc < chunks) load(nc, s);
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// L2 read rate: the grid walks a small (L2-resident) table over and over,
// 16-byte vectors, a warp's 32 contiguous (as a warp reads a bias row slice).
// With `hbm` set, the same number of vectors is also streamed
// from HBM (the finalize-with-bias mix: each row vector read once from HBM,
// one bias vector from L2 per row vector).
__global__ void l2_mix_kernel(const uint4* __restrict__ table, size_t table_vecs, const uint4* __restrict__ hbm,
                              size_t n, unsigned* sink) {
  size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x, s = size_t(gridDim.x) * blockDim.x;
  unsigned acc = 0;
  for (; i + 3 * s < n; i += 4 * s) {
    const size_t m = table_vecs - 1;  // a power of two: a mask, not a 64-bit division
    uint4 t0 = __ldg(table + (i & m)), t1 = __ldg(table + ((i + s) & m));
    uint4 t2 = __ldg(table + ((i + 2 * s) & m)), t3 = __ldg(table + ((i + 3 * s) & m));
    acc ^= t0.x ^ t1.y ^ t2.z ^ t3.w;
    if (hbm) {
      uint4 x0 = __ldcs(hbm + i), x1 = __ldcs(hbm + i + s), x2 = __ldcs(hbm + i + 2 * s), x3 = __ldcs(hbm + i + 3 * s);
      acc ^= x0.x ^ x1.y ^ x2.z ^ x3.w;
    }
  }
  if (acc == 0x12345678u) *sink = acc;
}

template <typename F> float med(F f) {
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  for (int i = 0; i < 5; ++i) f();
  std::vector<float> v;
  for (int i = 0; i < 30; ++i) { CK(cudaEventRecord(e0)); f(); CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1)); float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); v.push_back(ms); }
  std::sort(v.begin(), v.end()); CK(cudaGetLastError()); return v[15] * 1e3f;
}

// Which copy method comes closest to cudaMemcpy (2 GiB and 100 MB).
void methods() {
  const size_t big = size_t(2) << 30;
  char *a, *b;
  CK(cudaMalloc(&a, big)); CK(cudaMalloc(&b, big));
  CK(cudaMemset(a, 1, big)); CK(cudaMemset(b, 2, big));
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  float t = med([&] { CK(cudaMemcpyAsync(b, a, big, cudaMemcpyDeviceToDevice)); });
  const double ceil = 2.0 * big / (t * 1e-6) / 1e9;
  printf("cudaMemcpy 2 GiB: %.1f us, %.1f GB/s (ceiling)\n", t, ceil);
  auto report = [&](const char* what, size_t bytes, float us) { printf("%-44s %6zu MB %9.2f us %.3f of ceiling\n", what, bytes >> 20, us, 2.0 * bytes / (us * 1e-6) / 1e9 / ceil); };
  auto set_smem = [](auto k, int bytes) { CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes)); };
  set_smem(copy_bulk<16384, 12>, 12 * 16384);
  set_smem(copy_bulk<32768, 6>, 6 * 32768);
  set_smem(copy_bulk<8192, 12>, 12 * 8192);
  set_smem(copy_bulk<4096, 16>, 16 * 4096);
  for (size_t bytes : {big, size_t(100) << 20}) {
    const size_t n = bytes / 16;
    report("cudaMemcpy", bytes, med([&] { CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); }));
    report("grid-stride L4 plain 8/SM", bytes, med([&] { copy_gs<4, 0><<<sms * 8, 256>>>((const uint4*)a, (uint4*)b, n); }));
    report("grid-stride L4 .cs 8/SM", bytes, med([&] { copy_gs<4, 1><<<sms * 8, 256>>>((const uint4*)a, (uint4*)b, n); }));
    report("grid-stride L4 no_allocate 8/SM", bytes, med([&] { copy_gs<4, 2><<<sms * 8, 256>>>((const uint4*)a, (uint4*)b, n); }));
    report("grid-stride L8 plain 4/SM", bytes, med([&] { copy_gs<8, 0><<<sms * 4, 256>>>((const uint4*)a, (uint4*)b, n); }));
    report("grid-stride L2 plain 16/SM", bytes, med([&] { copy_gs<2, 0><<<sms * 8, 256>>>((const uint4*)a, (uint4*)b, n); }));
    report("16 KB tiles L4 x256 8/SM", bytes, med([&] { copy_tiles<4><<<sms * 8, 256>>>((const uint4*)a, (uint4*)b, n); }));
    report("16 KB tiles L8 x128 8/SM", bytes, med([&] { copy_tiles<8><<<sms * 8, 128>>>((const uint4*)a, (uint4*)b, n); }));
    report("bulk 16 KB x 12 stages 1/SM", bytes, med([&] { copy_bulk<16384, 12><<<sms, 32, 12 * 16384>>>(a, b, bytes); }));
    report("bulk 32 KB x 6 stages 1/SM", bytes, med([&] { copy_bulk<32768, 6><<<sms, 32, 6 * 32768>>>(a, b, bytes); }));
    report("bulk 8 KB x 12 stages 2/SM", bytes, med([&] { copy_bulk<8192, 12><<<sms * 2, 32, 12 * 8192>>>(a, b, bytes); }));
    report("bulk 4 KB x 16 stages 3/SM", bytes, med([&] { copy_bulk<4096, 16><<<sms * 3, 32, 16 * 4096>>>(a, b, bytes); }));
  }
  }

// Is the finalize's bias case (0.91 of copy; every row vector read from HBM
// and one bias vector from L2 beside it) bound by the rate L2 feeds the SMs?
// The L2 read rate alone, from a table of about the bias's size (256
// experts x 7168 bf16 = 3.5 MiB; 4 MiB here), and the mix of 940 MB from HBM + 940 MB from L2.
// Prediction: if the L2 rate alone is near 1.88 GB / 272 us = 6.9 TB/s, the
// bias case is L2-bound and 0.93 of copy is out of reach for any kernel that
// reads the bias rows per slot.
void l2_mix() {
  // 4 MiB: the bias's 3.5 MiB rounded up to a power of two (the kernel masks).
  const size_t big = size_t(2) << 30, table_bytes = size_t(4) << 20, hbm_bytes = size_t(940) << 20;
  char *a, *b, *table; unsigned* sink;
  CK(cudaMalloc(&a, big)); CK(cudaMalloc(&b, big)); CK(cudaMalloc(&table, table_bytes)); CK(cudaMalloc(&sink, 4));
  CK(cudaMemset(a, 1, big)); CK(cudaMemset(b, 2, big)); CK(cudaMemset(table, 3, table_bytes));
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  float t = med([&] { CK(cudaMemcpyAsync(b, a, big, cudaMemcpyDeviceToDevice)); });
  const double ceil = 2.0 * big / (t * 1e-6) / 1e9;
  printf("cudaMemcpy 2 GiB: %.1f us, %.1f GB/s (ceiling)\n", t, ceil);
  const size_t n = hbm_bytes / 16, tv = table_bytes / 16;
  for (int per_sm : {4, 8, 16}) {
    float us = med([&] { l2_mix_kernel<<<sms * per_sm, 256>>>((const uint4*)table, tv, nullptr, n, sink); });
    printf("L2 reads only (4 MiB table), %zu MB, %2d/SM: %8.2f us %8.1f GB/s\n", hbm_bytes >> 20, per_sm, us,
           hbm_bytes / (us * 1e-6) / 1e9);
    us = med([&] { read_kernel<<<sms * per_sm, 256>>>((const uint4*)a, n, sink); });
    printf("HBM reads only, %zu MB, %2d/SM:                 %8.2f us %8.1f GB/s %.3f of ceiling\n", hbm_bytes >> 20,
           per_sm, us, hbm_bytes / (us * 1e-6) / 1e9, hbm_bytes / (us * 1e-6) / 1e9 / ceil);
    us = med([&] { l2_mix_kernel<<<sms * per_sm, 256>>>((const uint4*)table, tv, (const uint4*)a, n, sink); });
    printf("HBM + as many L2 reads, %zu MB each, %2d/SM:   %8.2f us %8.1f GB/s from HBM %.3f of ceiling, "
           "%.1f GB/s into the SMs\n", hbm_bytes >> 20, per_sm, us, hbm_bytes / (us * 1e-6) / 1e9,
           hbm_bytes / (us * 1e-6) / 1e9 / ceil, 2.0 * hbm_bytes / (us * 1e-6) / 1e9);
  }
}

// The FC2 `atomic` epilogue's traffic without the GEMM: P = T*k rows of H
// values, row p added into out row tok[p] (each token k times, rows in a
// random token order, as an expert-sorted tile sees them), the values from
// registers. How fast can L2 take 16-byte bf16x2 reductions, and how does
// that compare with fp32 reductions and plain stores of the same bytes?
template <int kOp>  // 0 red.v4.bf16x2, 1 red.bf16x2 (4 B), 2 red.v4.f32, 3 st.v4 to out row tok[p], 4 st.v4 to row p
__global__ void scatter_rows(char* out, const int* tok, int rows, int H) {
  const int vecs = kOp == 2 ? H / 4 : H / 8;  // 16-byte words per row
  for (int r = blockIdx.x; r < rows; r += gridDim.x) {
    const int t = kOp == 4 ? r : tok[r];
    for (int v = threadIdx.x; v < vecs; v += blockDim.x) {
      const uint32_t w = 0x3c003c00u ^ (uint32_t(v) << 1);  // small bf16 pairs
      if (kOp == 0) {
        char* a = out + (size_t(t) * H + size_t(v) * 8) * 2;
        asm volatile("red.global.add.noftz.v4.bf16x2 [%0], {%1, %2, %3, %4};" ::"l"(a), "r"(w), "r"(w), "r"(w), "r"(w) : "memory");
      } else if (kOp == 1) {
        char* a = out + (size_t(t) * H + size_t(v) * 8) * 2;
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("red.global.add.noftz.bf16x2 [%0], %1;" ::"l"(a + 4 * e), "r"(w) : "memory");
      } else if (kOp == 2) {
        char* a = out + (size_t(t) * H + size_t(v) * 4) * 4;
        const float f = 1e-3f * float(v & 7);
        asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(a), "f"(f), "f"(f), "f"(f), "f"(f) : "memory");
      } else {
        *reinterpret_cast<uint4*>(out + (size_t(t) * H + size_t(v) * 8) * 2) = make_uint4(w, w, w, w);
      }
    }
  }
}

void reds() {
  const size_t big = size_t(2) << 30;
  char *a, *b; int* tok;
  CK(cudaMalloc(&a, big)); CK(cudaMalloc(&b, big));
  CK(cudaMemset(a, 1, big)); CK(cudaMemset(b, 2, big));
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  float t = med([&] { CK(cudaMemcpyAsync(b, a, big, cudaMemcpyDeviceToDevice)); });
  printf("cudaMemcpy 2 GiB: %.1f us, %.1f GB/s (ceiling)\n", t, 2.0 * big / (t * 1e-6) / 1e9);
  struct Shape { const char* name; int T, k, H; };
  for (const Shape sh : {Shape{"DeepSeek EP (T 1024, k 8, H 7168)", 1024, 8, 7168},
                         Shape{"Qwen3-MoE (T 4096, k 8, H 2048)", 4096, 8, 2048},
                         Shape{"Mixtral (T 4096, k 2, H 4096)", 4096, 2, 4096}}) {
    const int rows = sh.T * sh.k;
    std::vector<int> h(rows);
    for (int p = 0; p < rows; ++p) h[p] = p % sh.T;
    unsigned s = 777; for (int i = rows - 1; i > 0; --i) { s = s * 1664525u + 1013904223u; std::swap(h[i], h[s % (i + 1)]); }
    CK(cudaMalloc(&tok, rows * 4)); CK(cudaMemcpy(tok, h.data(), rows * 4, cudaMemcpyHostToDevice));
    const double bf16_bytes = 2.0 * rows * sh.H;
    printf("%s: %d rows, %.0f MB of bf16 values into a %.1f MB output\n", sh.name, rows, bf16_bytes / 1e6,
           2.0 * sh.T * sh.H / 1e6);
    auto run = [&](const char* what, double bytes, auto launch) {
      for (int per_sm : {4, 16}) {
        const float us = med([&] { launch(sms * per_sm); });
        printf("  %-44s %2d/SM %9.2f us %8.1f GB/s of values\n", what, per_sm, us, bytes / (us * 1e-6) / 1e9);
      }
    };
    run("red.v4.bf16x2 (16 B), out bf16", bf16_bytes, [&](int g) { scatter_rows<0><<<g, 256>>>(b, tok, rows, sh.H); });
    run("red.bf16x2 (4 B) x 4, out bf16", bf16_bytes, [&](int g) { scatter_rows<1><<<g, 256>>>(b, tok, rows, sh.H); });
    run("red.v4.f32 (16 B), out fp32", 2 * bf16_bytes, [&](int g) { scatter_rows<2><<<g, 256>>>(b, tok, rows, sh.H); });
    run("st.v4 to the token's row (same lines)", bf16_bytes, [&](int g) { scatter_rows<3><<<g, 256>>>(b, tok, rows, sh.H); });
    run("st.v4 to row p (the unfused rows, HBM)", bf16_bytes, [&](int g) { scatter_rows<4><<<g, 256>>>(b, tok, rows, sh.H); });
    CK(cudaFree(tok));
  }
}

int main(int argc, char** argv) {
  if (argc > 1 && !std::strcmp(argv[1], "methods")) {
    methods();
    return 0;
  }
  if (argc > 1 && !std::strcmp(argv[1], "l2mix")) {
    l2_mix();
    return 0;
  }
  if (argc > 1 && !std::strcmp(argv[1], "reds")) {
    reds();
    return 0;
  }
  const size_t big = size_t(2) << 30;
  char *a, *b; unsigned* sink;
  CK(cudaMalloc(&a, big)); CK(cudaMalloc(&b, big)); CK(cudaMalloc(&sink, 4));
  CK(cudaMemset(a, 1, big)); CK(cudaMemset(b, 2, big));
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  float t = med([&] { CK(cudaMemcpyAsync(b, a, big, cudaMemcpyDeviceToDevice)); });
  const double ceil = 2.0 * big / (t * 1e-6) / 1e9;
  printf("cudaMemcpy 2 GiB: %.1f us, %.1f GB/s (ceiling)\n", t, ceil);
  auto report = [&](const char* what, double bytes, float us) { printf("%-52s %9.2f us %8.1f GB/s %.3f of ceiling\n", what, us, bytes / (us * 1e-6) / 1e9, bytes / (us * 1e-6) / 1e9 / ceil); };
  for (size_t bytes : {size_t(2) << 30, size_t(100) << 20, size_t(67108864)}) {
    size_t n = bytes / 16;
    char name[96];
    for (int per_sm : {4, 8, 16}) {
      snprintf(name, sizeof name, "SM copy %zu MB grid %d/SM", bytes >> 20, per_sm);
      report(name, 2.0 * bytes, med([&] { copy_kernel<<<sms * per_sm, 256>>>((const uint4*)a, (uint4*)b, n); }));
    }
    snprintf(name, sizeof name, "cudaMemcpy %zu MB", bytes >> 20);
    report(name, 2.0 * bytes, med([&] { CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); }));
    snprintf(name, sizeof name, "SM read-only %zu MB", bytes >> 20);
    report(name, bytes, med([&] { read_kernel<<<sms * 8, 256>>>((const uint4*)a, n, sink); }));
    snprintf(name, sizeof name, "SM write-only %zu MB", bytes >> 20);
    report(name, bytes, med([&] { write_kernel<<<sms * 8, 256>>>((uint4*)b, n); }));
    snprintf(name, sizeof name, "cudaMemset %zu MB", bytes >> 20);
    report(name, bytes, med([&] { CK(cudaMemsetAsync(b, 0, bytes)); }));
  }
  // k=2-like: 16384 rows of 8 KB in, 8192 rows out (201 MB moved)
  {
    int rows = 8192, vecs = 4096 * 2 / 16;
    for (int per_sm : {4, 8, 16})
      for (int thr : {256, 512}) {
        char name[96]; snprintf(name, sizeof name, "sum of 2 contiguous rows, H4096, %d/SM x %d", per_sm, thr);
        report(name, 3.0 * rows * vecs * 16, med([&] { sum2_kernel<<<sms * per_sm, thr>>>((const uint4*)a, (uint4*)b, rows, vecs); }));
      }
  }
  // EP-like: copy 8192 random rows of 14 KB (random source permutation)
  {
    int rows = 8192, vecs = 7168 * 2 / 16;
    std::vector<int> perm(rows); for (int i = 0; i < rows; ++i) perm[i] = i;
    unsigned s = 12345; for (int i = rows - 1; i > 0; --i) { s = s * 1664525u + 1013904223u; std::swap(perm[i], perm[s % (i + 1)]); }
    int* dp; CK(cudaMalloc(&dp, rows * 4)); CK(cudaMemcpy(dp, perm.data(), rows * 4, cudaMemcpyHostToDevice));
    for (int per_sm : {4, 8, 16}) {
      char name[96]; snprintf(name, sizeof name, "gather copy 8192 x 14 KB rows, %d/SM", per_sm);
      report(name, 2.0 * rows * vecs * 16, med([&] { gather_rows<<<sms * per_sm, 256>>>((const uint4*)a, (uint4*)b, dp, rows, vecs); }));
    }
    char name[96]; snprintf(name, sizeof name, "contiguous copy 8192 x 14 KB (117 MB) SM 8/SM");
    report(name, 2.0 * rows * vecs * 16, med([&] { copy_kernel<<<sms * 8, 256>>>((const uint4*)a, (uint4*)b, size_t(rows) * vecs); }));
  }
  return 0;
}
