#include "bench_common.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

namespace flashmix::bench {

bool Context::selected(const std::string& op, const std::string& case_name) const {
  return filter.empty() || (op + "/" + case_name).find(filter) != std::string::npos;
}

void cuda_check(cudaError_t err, const char* what, const char* file, int line) {
  if (err != cudaSuccess) {
    std::fprintf(stderr, "flashmix-bench: %s failed at %s:%d: %s\n", what, file, line,
                 cudaGetErrorString(err));
    std::exit(2);
  }
}

namespace {
__global__ void fill_bf16_hashed(__nv_bfloat16* x, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint64_t h = (uint64_t(i) + seed) * 0x9e3779b97f4a7c15ull;
    h ^= h >> 31;
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 29;
    x[i] = __float2bfloat16(scale * (float(h >> 40) / float(1 << 24) * 2.0f - 1.0f));
  }
}
}  // namespace

void fill_bf16(void* x, int64_t n, uint64_t seed, float scale, cudaStream_t stream) {
  fill_bf16_hashed<<<1024, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(x), n, seed, scale);
  BENCH_CUDA(cudaGetLastError());
}

// e4m3 codes of scale * u, u uniform in [-1, 1) from a hash of (seed, i).
__global__ void fill_e4m3_hashed(uint8_t* x, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 0x9e3779b1u ^ seed * 0x85ebca6bu ^ uint32_t(i >> 32) * 0xc2b2ae35u;
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    const float u = float(h >> 8) * (2.0f / 16777216.0f) - 1.0f;
    x[i] = __nv_cvt_float_to_fp8(scale * u, __NV_SATFINITE, __NV_E4M3);
  }
}

void fill_e4m3(void* x, int64_t n, uint32_t seed, float scale, cudaStream_t stream) {
  fill_e4m3_hashed<<<1024, 256, 0, stream>>>(static_cast<uint8_t*>(x), n, seed, scale);
  BENCH_CUDA(cudaGetLastError());
}

static double median_of(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (double(v[n / 2 - 1]) + v[n / 2]);
}

double median_us(const std::function<void()>& fn, cudaStream_t stream, int warmup, int iters) {
  for (int i = 0; i < warmup; ++i) fn();
  BENCH_CUDA(cudaGetLastError());
  std::vector<cudaEvent_t> ev(2 * iters);
  for (auto& e : ev) BENCH_CUDA(cudaEventCreate(&e));
  for (int i = 0; i < iters; ++i) {
    BENCH_CUDA(cudaEventRecord(ev[2 * i], stream));
    fn();
    BENCH_CUDA(cudaEventRecord(ev[2 * i + 1], stream));
  }
  BENCH_CUDA(cudaStreamSynchronize(stream));
  BENCH_CUDA(cudaGetLastError());
  std::vector<float> ms(iters);
  for (int i = 0; i < iters; ++i) BENCH_CUDA(cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]));
  for (auto& e : ev) BENCH_CUDA(cudaEventDestroy(e));
  return median_of(ms) * 1e3;
}

double graph_us_per_launch(const std::function<void(int)>& fn, int launches, cudaStream_t stream,
                           int replays) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  BENCH_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < launches; ++i) fn(i);
  BENCH_CUDA(cudaStreamEndCapture(stream, &graph));
  BENCH_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  double us = median_us([&] { BENCH_CUDA(cudaGraphLaunch(exec, stream)); }, stream, 3, replays);
  BENCH_CUDA(cudaGraphExecDestroy(exec));
  BENCH_CUDA(cudaGraphDestroy(graph));
  return us / launches;
}

double measure_copy_gbps(cudaStream_t stream, int iters) {
  const size_t bytes = size_t(2) << 30;  // 2 GiB each way
  void *a = nullptr, *b = nullptr;
  BENCH_CUDA(cudaMalloc(&a, bytes));
  BENCH_CUDA(cudaMalloc(&b, bytes));
  BENCH_CUDA(cudaMemsetAsync(a, 0x5a, bytes, stream));
  double us = median_us([&] { BENCH_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream)); },
                        stream, 3, iters);
  BENCH_CUDA(cudaFree(a));
  BENCH_CUDA(cudaFree(b));
  return 2.0 * double(bytes) / (us * 1e-6) / 1e9;
}

__global__ void fill_bf16_random(__nv_bfloat16* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t x = uint32_t(i) * 2654435761u ^ seed;
    x ^= x >> 13; x *= 0x5bd1e995u; x ^= x >> 15;
    p[i] = __float2bfloat16(float(x & 0xffff) / 65536.0f - 0.5f);
  }
}

DenseGemm::DenseGemm(int64_t m, int64_t n, int64_t k, cudaStream_t stream) : m_(m), n_(n), k_(k) {
  cublasHandle_t handle;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "flashmix-bench: cublasCreate failed\n");
    std::exit(2);
  }
  cublasSetStream(handle, stream);
  handle_ = handle;
  BENCH_CUDA(cudaMalloc(&a_, sizeof(__nv_bfloat16) * m * k));
  BENCH_CUDA(cudaMalloc(&b_, sizeof(__nv_bfloat16) * n * k));
  BENCH_CUDA(cudaMalloc(&c_, sizeof(__nv_bfloat16) * m * n));
  fill_bf16_random<<<1024, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(a_), m * k, 1u);
  fill_bf16_random<<<1024, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(b_), n * k, 2u);
  BENCH_CUDA(cudaGetLastError());
}

DenseGemm::~DenseGemm() {
  cudaFree(a_);
  cudaFree(b_);
  cudaFree(c_);
  cublasDestroy(static_cast<cublasHandle_t>(handle_));
}

void DenseGemm::run() {
  const float alpha = 1.0f, beta = 0.0f;
  // Row-major C[m,n] = A[m,k] * B[n,k]^T, written as column-major C^T = B * A^T.
  cublasStatus_t st = cublasGemmEx(static_cast<cublasHandle_t>(handle_), CUBLAS_OP_T, CUBLAS_OP_N, int(n_), int(m_),
                                   int(k_), &alpha, b_, CUDA_R_16BF, int(k_), a_, CUDA_R_16BF, int(k_), &beta, c_,
                                   CUDA_R_16BF, int(n_), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (st != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "flashmix-bench: cublasGemmEx failed (%d)\n", int(st));
    std::exit(2);
  }
}

double cublas_gemm_us(int64_t m, int64_t n, int64_t k, cudaStream_t stream, int iters) {
  DenseGemm gemm(m, n, k, stream);
  return median_us([&] { gemm.run(); }, stream, 5, iters);
}

namespace {

void lt_check(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "flashmix-bench: cuBLASLt %s failed (%d)\n", what, int(st));
    std::exit(2);
  }
}

}  // namespace

double cublaslt_fp8_gemm_us(int64_t m, int64_t n, int64_t k, cudaStream_t stream, int iters) {
  if (m <= 0 || n <= 0 || k <= 0 || m % 16 || n % 16 || k % 16) {
    std::fprintf(stderr, "flashmix-bench: cublaslt_fp8_gemm_us: m, n, k must be positive multiples of 16 (%lld, %lld, %lld)\n",
                 (long long)m, (long long)n, (long long)k);
    std::exit(2);
  }
  // Enough copies of A, B and D that a rotation through them does not live
  // in L2 (at least twice its size), at most 64.
  int dev = 0, l2 = 0;
  BENCH_CUDA(cudaGetDevice(&dev));
  BENCH_CUDA(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
  const size_t a_bytes = size_t(m * k), b_bytes = size_t(n * k), d_bytes = size_t(m * n) * 2;
  const size_t set_bytes = a_bytes + b_bytes + d_bytes;
  const int copies = int(std::min<size_t>(64, std::max<size_t>(1, (2 * size_t(l2) + set_bytes - 1) / set_bytes)));
  std::vector<void*> a(copies), b(copies), d(copies);
  for (int i = 0; i < copies; ++i) {
    BENCH_CUDA(cudaMalloc(&a[i], a_bytes));
    BENCH_CUDA(cudaMalloc(&b[i], b_bytes));
    BENCH_CUDA(cudaMalloc(&d[i], d_bytes));
    fill_e4m3(a[i], m * k, 1u + 2u * i, 1.f, stream);  // [-1, 1): finite e4m3
    fill_e4m3(b[i], n * k, 2u + 2u * i, 1.f, stream);
    BENCH_CUDA(cudaGetLastError());
  }
  float* scale = nullptr;  // per-tensor scales of A and B, both 1
  const float one = 1.0f;
  BENCH_CUDA(cudaMalloc(&scale, sizeof(float)));
  BENCH_CUDA(cudaMemcpy(scale, &one, sizeof(float), cudaMemcpyHostToDevice));
  const size_t ws_bytes = size_t(32) << 20;
  void* ws = nullptr;
  BENCH_CUDA(cudaMalloc(&ws, ws_bytes));
  BENCH_CUDA(cudaDeviceSynchronize());

  // Row-major D[m, n] = A[m, k] B[n, k]^T with both operands K-major (the
  // layout torch._scaled_mm takes) is, in cuBLAS's column-major terms,
  // D^T [n x m] = op(B) A with B seen as [k x n] (ld k) transposed and A as
  // [k x m] (ld k) not: "TN", the layout Hopper's FP8 GEMMs run.
  cublasLtHandle_t lt;
  lt_check(cublasLtCreate(&lt), "create");
  cublasLtMatmulDesc_t op;
  lt_check(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc");
  const cublasOperation_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
  const int8_t fast_accum = 1;
  lt_check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof(transa)), "transa");
  lt_check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof(transb)), "transb");
  lt_check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale, sizeof(scale)), "a scale");
  lt_check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale, sizeof(scale)), "b scale");
  lt_check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast_accum, sizeof(fast_accum)),
           "fast accum");
  cublasLtMatrixLayout_t la, lb, lc;
  lt_check(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, uint64_t(k), uint64_t(n), int64_t(k)), "layout A");
  lt_check(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, uint64_t(k), uint64_t(m), int64_t(k)), "layout B");
  lt_check(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, uint64_t(n), uint64_t(m), int64_t(n)), "layout C/D");
  cublasLtMatmulPreference_t pref;
  lt_check(cublasLtMatmulPreferenceCreate(&pref), "preference");
  const uint64_t ws_limit = ws_bytes;
  lt_check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_limit,
                                                sizeof(ws_limit)),
           "workspace preference");
  cublasLtMatmulHeuristicResult_t heuristic = {};
  int found = 0;
  lt_check(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 1, &heuristic, &found), "heuristic");
  if (found < 1) {
    std::fprintf(stderr, "flashmix-bench: cuBLASLt has no FP8 GEMM algorithm for %lld x %lld x %lld\n", (long long)m,
                 (long long)n, (long long)k);
    std::exit(2);
  }
  const float alpha = 1.0f, beta = 0.0f;
  int next = 0;
  auto run = [&] {
    const int i = next++ % copies;
    lt_check(cublasLtMatmul(lt, op, &alpha, b[i], la, a[i], lb, &beta, d[i], lc, d[i], lc, &heuristic.algo, ws,
                            ws_bytes, stream),
             "matmul");
  };
  const double us = median_us(run, stream, std::max(5, copies), iters);

  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatmulDescDestroy(op);
  cublasLtDestroy(lt);
  for (int i = 0; i < copies; ++i) {
    cudaFree(a[i]);
    cudaFree(b[i]);
    cudaFree(d[i]);
  }
  cudaFree(scale);
  cudaFree(ws);
  return us;
}

void print_header() {
  std::printf("%-22s %-34s %11s %10s %9s %-8s %s\n", "op", "case", "median_us", "GB/s|TF/s",
              "fraction", "ceiling", "check");
}

double copy_bound_us(const Context& ctx, double bytes) { return bytes / (ctx.copy_gbps * 1e9) * 1e6; }

void set_copy_ceiling(const Context& ctx, Record& r, double bytes) {
  r.ceiling = "copy";
  r.bytes = bytes;
  r.fraction = copy_bound_us(ctx, bytes) / r.median_us;
}

Record copy_record(const Context& ctx, const std::string& op, const std::string& case_name, double us, double bytes,
                   const std::string& check) {
  Record r;
  r.op = op;
  r.case_name = case_name;
  r.median_us = us;
  r.check = check;
  set_copy_ceiling(ctx, r, bytes);
  return r;
}

void add_record(Context& ctx, Record r) {
  double rate = r.ceiling == "gemm" ? r.flops / (r.median_us * 1e-6) / 1e12
                                    : r.bytes / (r.median_us * 1e-6) / 1e9;
  std::printf("%-22s %-34s %11.2f %10.1f %9.3f %-8s %s\n", r.op.c_str(), r.case_name.c_str(), r.median_us,
              rate, r.fraction, r.ceiling.c_str(), r.check.c_str());
  for (const auto& [key, value] : r.extra) std::printf("%-22s %-34s   %s = %.4g\n", "", "", key.c_str(), value);
  for (const auto& [key, value] : r.labels)
    std::printf("%-22s %-34s   %s: %s\n", "", "", key.c_str(), value.c_str());
  std::fflush(stdout);
  ctx.records.push_back(std::move(r));
}

static std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    out += c;
  }
  return out;
}

bool write_json(const Context& ctx, const std::string& path) {
  std::ofstream f(path);
  if (!f) return false;
  f.precision(6);
  f << "{\n  \"gpu\": \"" << json_escape(ctx.gpu_name) << "\",\n  \"date\": \"" << ctx.date
    << "\",\n  \"commit\": \"" << ctx.commit << "\",\n  \"copy_gbps\": " << ctx.copy_gbps
    << ",\n  \"gemm_tflops\": " << ctx.gemm_tflops << ",\n  \"gemm_fp8_tflops\": " << ctx.gemm_fp8_tflops
    << ",\n  \"records\": [\n";
  for (size_t i = 0; i < ctx.records.size(); ++i) {
    const Record& r = ctx.records[i];
    f << "    {\"op\": \"" << r.op << "\", \"case\": \"" << json_escape(r.case_name)
      << "\", \"median_us\": " << r.median_us << ", \"fraction\": " << r.fraction << ", \"ceiling\": \""
      << r.ceiling << "\", \"bytes\": " << r.bytes << ", \"flops\": " << r.flops << ", \"check\": \""
      << json_escape(r.check) << "\", \"gpu\": \"" << json_escape(ctx.gpu_name) << "\", \"date\": \""
      << ctx.date << "\", \"commit\": \"" << ctx.commit << "\"";
    for (const auto& [key, value] : r.extra) f << ", \"" << key << "\": " << value;
    for (const auto& [key, value] : r.labels) f << ", \"" << key << "\": \"" << json_escape(value) << "\"";
    f << "}" << (i + 1 < ctx.records.size() ? "," : "") << "\n";
  }
  f << "  ]\n}\n";
  return bool(f);
}

}  // namespace flashmix::bench
