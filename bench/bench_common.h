// flashmix-bench: the shared harness. Each op's file registers its cases in
// run_*_cases(); this header gives them timing, ceilings and records.
//
// Ceilings are measured in the same run: device-to-device copy bandwidth
// (bytes read + written by a >= 1 GiB cudaMemcpyAsync) for memory-bound ops,
// and a dense cuBLAS bf16 GEMM for GEMMs (a dense cuBLASLt FP8 GEMM for the
// FP8 ones).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "flashmix/status.h"

namespace flashmix::bench {

struct Record {
  std::string op;
  std::string case_name;
  double median_us = 0;
  double fraction = 0;    // of the ceiling below, measured in the same run
  std::string ceiling;    // "copy", "gemm", "time_bound" or "none" (CPU mode)
  double bytes = 0;       // counted bytes (memory-bound ops)
  double flops = 0;       // counted FLOPs (GEMMs)
  std::string check;      // "passed", "FAILED: ...", or "reference" (CPU mode: nothing to compare)
  std::map<std::string, double> extra;  // further numbers (e.g. bound_us, speedup)
  std::map<std::string, std::string> labels;  // further text (e.g. the kernel an op chose)
};

struct Context {
  bool gpu = false;
  std::string gpu_name = "none";
  int num_sms = 0;
  size_t l2_bytes = 0;
  std::string date;
  std::string commit;
  double copy_gbps = 0;    // ceiling for memory-bound ops
  double gemm_tflops = 0;  // ceiling for GEMMs (dense bf16 8192^3)
  double gemm_fp8_tflops = 0;  // ceiling for FP8 GEMMs (dense e4m3 8192^3, cuBLASLt: cublaslt_fp8_gemm_us)
  bool verify = true;
  bool quick = false;      // fewer repetitions
  bool sweep = false;      // also time the launch-shape tunings of each op
  std::string filter;      // only cases whose "op/case" contains it
  // moe_fc2: the GEMM kernels to time each case on (--fc2-gemm-kernel, a
  // comma-separated list of Fc2GemmKernel names; default "auto").
  std::string fc2_gemm_kernels = "auto";
  std::vector<Record> records;

  bool selected(const std::string& op, const std::string& case_name) const;
};

// Aborts the benchmark (not the library) on a CUDA error: a benchmark that
// cannot trust its numbers must not print them.
void cuda_check(cudaError_t err, const char* what, const char* file, int line);
#define BENCH_CUDA(x) ::flashmix::bench::cuda_check((x), #x, __FILE__, __LINE__)

// Median over `iters` of the time of fn() (one or more launches on `stream`),
// each bracketed by events, after `warmup` untimed calls.
double median_us(const std::function<void()>& fn, cudaStream_t stream, int warmup, int iters);

// fn(i) issues the i-th of `launches` launches on `stream`. They are captured
// in one CUDA graph; the result is the median replay time divided by `launches`.
double graph_us_per_launch(const std::function<void(int)>& fn, int launches, cudaStream_t stream,
                           int replays);

double measure_copy_gbps(cudaStream_t stream, int iters);
// Time of one dense bf16 GEMM m x n x k (cuBLAS, fp32 accumulate), in microseconds.
double cublas_gemm_us(int64_t m, int64_t n, int64_t k, cudaStream_t stream, int iters);
// Time of one dense FP8 GEMM m x n x k through cuBLASLt, in microseconds: the
// `gemm_fp8` ceiling, what torch._scaled_mm runs -- e4m3 x e4m3 -> bf16,
// per-tensor scales (A and B scale pointers, value 1), fast accumulation,
// both operands K-major ("TN"), the heuristic's first algorithm, 32 MiB of
// workspace. Inputs rotated over copies (together at least twice L2), median
// of CUDA-event timings after a warm-up. m, n, k: multiples of 16.
double cublaslt_fp8_gemm_us(int64_t m, int64_t n, int64_t k, cudaStream_t stream, int iters);

// A dense cuBLAS bf16 GEMM C[m,n] = A[m,k] B[n,k]^T on random inputs, to be
// launched many times (run()).
class DenseGemm {
 public:
  DenseGemm(int64_t m, int64_t n, int64_t k, cudaStream_t stream);
  ~DenseGemm();
  DenseGemm(const DenseGemm&) = delete;
  DenseGemm& operator=(const DenseGemm&) = delete;
  void run();

 private:
  int64_t m_, n_, k_;
  void* handle_ = nullptr;
  void *a_ = nullptr, *b_ = nullptr, *c_ = nullptr;
};


// x[i] = scale * u(i) for i < n, u uniform in [-1, 1) from a hash of
// (i + seed): bf16 inputs of any size, filled on `stream` (no host copy).
void fill_bf16(void* x, int64_t n, uint64_t seed, float scale, cudaStream_t stream);
// The e4m3 codes (bytes) of scale * u, u as above (a hash of (i, seed)).
void fill_e4m3(void* x, int64_t n, uint32_t seed, float scale, cudaStream_t stream);

// The time `bytes` take at this run's copy bandwidth.
double copy_bound_us(const Context& ctx, double bytes);
// r as `bytes` moved in r.median_us against this run's copy bandwidth
// (ceiling "copy", bytes, fraction).
void set_copy_ceiling(const Context& ctx, Record& r, double bytes);
// A record of `bytes` moved in `us` against this run's copy bandwidth.
Record copy_record(const Context& ctx, const std::string& op, const std::string& case_name, double us, double bytes,
                   const std::string& check);

// Prints the record as a table row and keeps it.
void add_record(Context& ctx, Record r);
void print_header();
bool write_json(const Context& ctx, const std::string& path);

// Without a GPU: times one call of the CPU reference backend (fn returns its
// Status) and records it with no ceiling; its check is "reference", since
// there is nothing to compare it against.
template <typename Fn>
void record_cpu_run(Context& ctx, const std::string& op, const std::string& case_name, double bytes, Fn fn) {
  const auto t0 = std::chrono::steady_clock::now();
  const Status st = fn();
  const auto t1 = std::chrono::steady_clock::now();
  Record r;
  r.op = op;
  r.case_name = case_name;
  r.median_us = std::chrono::duration<double, std::micro>(t1 - t0).count();
  r.bytes = bytes;
  r.ceiling = "none";
  r.check = st.ok() ? "reference" : "FAILED: " + st.message();
  add_record(ctx, std::move(r));
}

// Runs each case that --filter selects: on the GPU, on a stream of its own;
// without a GPU, shrunk to a small shape (shrink) on the CPU backend.
template <typename Case, typename Gpu, typename Cpu, typename Shrink>
void for_each_case(Context& ctx, const char* op, const std::vector<Case>& cases, Gpu run_gpu, Cpu run_cpu,
                   Shrink shrink) {
  for (const Case& c : cases) {
    if (!ctx.selected(op, c.name)) continue;
    if (ctx.gpu) {
      cudaStream_t stream;
      BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      run_gpu(ctx, c, stream);
      BENCH_CUDA(cudaStreamDestroy(stream));
    } else {
      Case small = shrink(c);
      small.name = c.name + "_small_cpu";
      run_cpu(ctx, small);
    }
  }
}

// The ops' case lists.
void run_moe_finalize_cases(Context& ctx);
void run_moe_routing_cases(Context& ctx);
void run_moe_router_cases(Context& ctx);
void run_mhc_cases(Context& ctx);
void run_moe_fc2_cases(Context& ctx);
void run_moe_fc1_cases(Context& ctx);
void run_moe_forward_cases(Context& ctx);
void run_quantize_fp8_cases(Context& ctx);
void run_mxfp4_cases(Context& ctx);

}  // namespace flashmix::bench
