#include "bench_common.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include <cublas_v2.h>
#include <cuda_bf16.h>

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

void print_header() {
  std::printf("%-22s %-34s %11s %10s %9s %-8s %s\n", "op", "case", "median_us", "GB/s|TF/s",
              "fraction", "ceiling", "check");
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
    << ",\n  \"gemm_tflops\": " << ctx.gemm_tflops << ",\n  \"records\": [\n";
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
