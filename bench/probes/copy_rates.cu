// Probe: SM-kernel copy bandwidth vs cudaMemcpy, read-only and write-only
// rates, and row-gather copies, timed like flashmix-bench (events around one
// launch, median of 30, warm-up 5).
// A stand-alone probe (not built by CMake; docs/moe_finalize.md quotes it):
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o copy_rates bench/probes/copy_rates.cu && ./copy_rates
#include <cstdio>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

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

template <typename F> float med(F f) {
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  for (int i = 0; i < 5; ++i) f();
  std::vector<float> v;
  for (int i = 0; i < 30; ++i) { CK(cudaEventRecord(e0)); f(); CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1)); float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); v.push_back(ms); }
  std::sort(v.begin(), v.end()); CK(cudaGetLastError()); return v[15] * 1e3f;
}

int main() {
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
