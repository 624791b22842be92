// flashmix-bench cases for quantize_fp8 (spec §12): activations (1 x 128
// blocks) and expert weights (128 x 128 blocks), each with fp32 and ue8m0
// scales. Records are named <case>/<scale format>.
//
// Bytes counted (the minimum any implementation moves): the bf16 input read
// once, the e4m3 output and the scales written once. Fraction = (bytes /
// time) / device-to-device copy bandwidth of the same run. The inputs are
// larger than L2 (176 MB and 2.8 GB a pass). Verification: the CPU
// reference on the first and last 512 rows (activations) or the first and
// last 256 rows of the first and last expert (weights), whole blocks, bit
// for bit (the full reference would take a minute for the weights).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_bf16.h>

#include "bench_common.h"
#include "flashmix/fp8.h"

namespace flashmix::bench {
namespace {

struct QuantizeCase {
  std::string name;
  int64_t batch, rows, cols;
  Fp8Block block;
  ScaleFormat format;
};

std::vector<QuantizeCase> quantize_cases() {
  std::vector<QuantizeCase> cases;
  for (ScaleFormat f : {ScaleFormat::kFloat32, ScaleFormat::kUE8M0}) {
    // DeepSeek-V3's hidden size; a prefill chunk of 8192 tokens.
    cases.push_back({std::string("act_T8192_H7168/") + to_string(f), 1, 8192, 7168, Fp8Block::k1x128, f});
    // 32 experts of a DeepSeek-style FC1 (2I = 4096 rows of K = 7168).
    cases.push_back({std::string("weight_E32_N4096_K7168/") + to_string(f), 32, 4096, 7168, Fp8Block::k128x128, f});
  }
  return cases;
}

int64_t scale_count(const QuantizeCase& c) {
  const int64_t br = fp8_block_rows(c.block);
  return c.batch * ((c.rows + br - 1) / br) * (c.cols / 128);
}

int64_t scale_size(const QuantizeCase& c) { return c.format == ScaleFormat::kUE8M0 ? 1 : 4; }

double counted_bytes(const QuantizeCase& c) {
  return double(c.batch) * c.rows * c.cols * 3.0 + double(scale_count(c) * scale_size(c));
}

// Outlier channels: every 53rd column of every row 100 x larger.
__global__ void scale_outlier_columns(__nv_bfloat16* x, int64_t n, int64_t cols) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    if ((i % cols) % 53 == 0) x[i] = __float2bfloat16(100.0f * __bfloat162float(x[i]));
}

// The reference on rows [r0, r0 + n) of matrix b (whole blocks), against
// the GPU's bytes: "" when equal, else what differs.
std::string verify_rows(const QuantizeCase& c, const void* d_x, const void* d_q, const void* d_s, int64_t b,
                        int64_t r0, int64_t n) {
  const int64_t br = fp8_block_rows(c.block), cb = c.cols / 128, sb = scale_size(c);
  const int64_t elems = n * c.cols, first = (b * c.rows + r0) * c.cols;
  const int64_t scales = (n / br) * cb, first_scale = (b * ((c.rows + br - 1) / br) + r0 / br) * cb;
  std::vector<uint16_t> x(static_cast<size_t>(elems));
  std::vector<uint8_t> q(static_cast<size_t>(elems)), s(static_cast<size_t>(scales * sb)), q_ref(q.size()), s_ref(s.size());
  BENCH_CUDA(cudaMemcpy(x.data(), static_cast<const uint16_t*>(d_x) + first, elems * 2, cudaMemcpyDeviceToHost));
  BENCH_CUDA(cudaMemcpy(q.data(), static_cast<const uint8_t*>(d_q) + first, elems, cudaMemcpyDeviceToHost));
  BENCH_CUDA(cudaMemcpy(s.data(), static_cast<const uint8_t*>(d_s) + first_scale * sb, scales * sb,
                        cudaMemcpyDeviceToHost));
  QuantizeFp8Args h;
  h.x = x.data();
  h.q = q_ref.data();
  h.scales = s_ref.data();
  h.rows = n;
  h.cols = c.cols;
  h.block = c.block;
  h.scale_format = c.format;
  const Status st = quantize_fp8_cpu(h);
  if (!st.ok()) return "reference: " + st.message();
  int64_t bad_q = 0, bad_s = 0;
  for (size_t i = 0; i < q.size(); ++i) bad_q += q[i] != q_ref[i];
  for (size_t i = 0; i < s.size(); ++i) bad_s += s[i] != s_ref[i];
  if (bad_q || bad_s)
    return std::to_string(bad_q) + " q bytes and " + std::to_string(bad_s) + " scale bytes differ (matrix " +
           std::to_string(b) + ", rows " + std::to_string(r0) + "+" + std::to_string(n) + ")";
  return "";
}

void run_gpu_case(Context& ctx, const QuantizeCase& c, cudaStream_t stream) {
  const int64_t n = c.batch * c.rows * c.cols;
  void *d_x = nullptr, *d_q = nullptr, *d_s = nullptr;
  BENCH_CUDA(cudaMalloc(&d_x, size_t(n) * 2));
  BENCH_CUDA(cudaMalloc(&d_q, size_t(n)));
  BENCH_CUDA(cudaMalloc(&d_s, size_t(scale_count(c) * scale_size(c))));
  fill_bf16(d_x, n, 0x5eedull + std::hash<std::string>()(c.name), 1.0f, stream);
  scale_outlier_columns<<<1024, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(d_x), n, c.cols);
  BENCH_CUDA(cudaGetLastError());
  BENCH_CUDA(cudaMemsetAsync(d_q, 0xa5, size_t(n), stream));
  BENCH_CUDA(cudaMemsetAsync(d_s, 0xa5, size_t(scale_count(c) * scale_size(c)), stream));

  QuantizeFp8Args a;
  a.x = d_x;
  a.q = d_q;
  a.scales = d_s;
  a.batch = c.batch;
  a.rows = c.rows;
  a.cols = c.cols;
  a.block = c.block;
  a.scale_format = c.format;
  auto launch = [&] {
    const Status st = quantize_fp8(a, stream);
    if (!st.ok()) {
      std::fprintf(stderr, "flashmix-bench: %s: %s\n", c.name.c_str(), st.message().c_str());
      std::exit(2);
    }
  };

  std::string check = "not checked (--no-verify)";
  if (ctx.verify) {
    launch();
    BENCH_CUDA(cudaStreamSynchronize(stream));
    const int64_t span = c.block == Fp8Block::k128x128 ? 256 : 512;  // whole blocks
    std::string why;
    for (int64_t b : {int64_t(0), c.batch - 1})
      for (int64_t r0 : {int64_t(0), std::max<int64_t>(0, c.rows - span)})
        if (why.empty()) why = verify_rows(c, d_x, d_q, d_s, b, r0, std::min(span, c.rows));
    check = why.empty() ? "passed (bitwise; first and last " + std::to_string(span) + " rows" +
                              (c.batch > 1 ? " of the first and last matrix)" : ")")
                        : "FAILED: " + why;
  }

  const double us = median_us(launch, stream, 5, ctx.quick ? 10 : 50);
  const double bytes = counted_bytes(c);
  Record r = copy_record(ctx, "quantize_fp8", c.name, us, bytes, check);
  r.extra["bound_us"] = copy_bound_us(ctx, bytes);
  r.labels["block"] = to_string(c.block);
  r.labels["scale_format"] = to_string(c.format);
  add_record(ctx, r);
  cudaFree(d_x);
  cudaFree(d_q);
  cudaFree(d_s);
}

void run_cpu_case(Context& ctx, const QuantizeCase& c) {
  const int64_t n = c.batch * c.rows * c.cols;
  std::vector<uint16_t> x(static_cast<size_t>(n));
  uint64_t h = 0x9e3779b97f4a7c15ull;
  for (auto& v : x) {
    h ^= h << 13; h ^= h >> 7; h ^= h << 17;
    v = uint16_t(0x3c00u + (h >> 56)) | uint16_t((h >> 40) & 0x8000u);  // finite, nonzero, sign random
  }
  std::vector<uint8_t> q(static_cast<size_t>(n)), s(static_cast<size_t>(scale_count(c) * scale_size(c)));
  QuantizeFp8Args a;
  a.x = x.data();
  a.q = q.data();
  a.scales = s.data();
  a.batch = c.batch;
  a.rows = c.rows;
  a.cols = c.cols;
  a.block = c.block;
  a.scale_format = c.format;
  record_cpu_run(ctx, "quantize_fp8", c.name, counted_bytes(c), [&] { return quantize_fp8_cpu(a); });
}

}  // namespace

void run_quantize_fp8_cases(Context& ctx) {
  for_each_case(ctx, "quantize_fp8", quantize_cases(), run_gpu_case, run_cpu_case, [](QuantizeCase c) {
    c.batch = std::min<int64_t>(c.batch, 2);
    c.rows = std::min<int64_t>(c.rows, 130);
    c.cols = 512;
    return c;
  });
}

}  // namespace flashmix::bench
