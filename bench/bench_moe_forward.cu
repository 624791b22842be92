// flashmix-bench cases for moe_forward (spec §10): the whole routed-expert
// layer (router on bf16 logits -> routing maps -> FC1 + SwiGLU -> FC2 +
// finalize, kAtomic), against FC1 + FC2 alone on the same routing in the
// same run (FC1 on the input the layer's rule picks: X gathered, or the
// permuted copy) (ceiling "fc1+fc2": fraction = (fc1 + fc2) / forward, so 1/fraction
// is what routing, maps and glue add; the issue's bound: ratio <= 1.10).
// Decode cases replay a CUDA graph of the layer; their fraction is the
// weights of the experts actually used (W1 + W2) streamed at copy bandwidth.
// Each record also times the FC1 input the automatic rule did not pick
// (gather_us or permuted_copy_us). Prefill: the four timings run twice, the
// second round in the reverse order, each the mean of its two medians. Check: the layer's output against the staged FC1 + FC2 output on the same
// routing (those two are checked against double references in their own
// cases), within the FC2 test's bf16 tolerance.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "bench_common.h"
#include "common/host_dtype.h"
#include "flashmix/fp8.h"
#include "flashmix/moe.h"
#include "flashmix/mxfp4.h"

namespace flashmix::bench {
namespace {

struct ForwardCase {
  std::string name;
  int64_t T;
  int k;
  int E;
  int64_t H, I;
  MoeRouterScoring scoring;
  float scaling;
  bool decode;
  double max_ratio;
};

template <typename T>
T* dalloc(size_t count) {
  T* p = nullptr;
  BENCH_CUDA(cudaMalloc(&p, std::max<size_t>(1, count) * sizeof(T)));
  return p;
}

// The case's layer over all its experts, routed by the router on `logits`
// (weights and out left for the caller).
MoeForwardArgs routed_layer(const ForwardCase& c, const void* X, const void* logits) {
  MoeForwardArgs f;
  f.num_tokens = c.T;
  f.hidden = c.H;
  f.inter = c.I;
  f.k = c.k;
  f.num_experts = c.E;
  f.num_experts_per_node = c.E;
  f.X = X;
  f.router_logits = logits;
  f.router.logits_dtype = DType::kBFloat16;
  f.router.scoring = c.scoring;
  f.router.renormalize = true;
  f.router.routed_scaling_factor = c.scaling;
  return f;
}

void run_case(Context& ctx, const ForwardCase& c, cudaStream_t stream) {
  if (!ctx.selected("moe_forward", c.name)) return;
  const int64_t slots = c.T * c.k;
  auto* X = dalloc<__nv_bfloat16>(size_t(c.T * c.H));
  auto* logits = dalloc<__nv_bfloat16>(size_t(c.T * c.E));
  auto* W1 = dalloc<__nv_bfloat16>(size_t(c.E) * 2 * c.I * c.H);
  auto* W2 = dalloc<__nv_bfloat16>(size_t(c.E) * c.H * c.I);
  auto* out = dalloc<__nv_bfloat16>(size_t(c.T * c.H));
  auto* out_staged = dalloc<__nv_bfloat16>(size_t(c.T * c.H));
  auto* act = dalloc<__nv_bfloat16>(size_t(slots * c.I));
  auto* ids = dalloc<int32_t>(size_t(slots));
  auto* scales = dalloc<float>(size_t(slots));
  auto* offsets = dalloc<int64_t>(size_t(c.E + 1));
  auto* p2u = dalloc<int32_t>(size_t(slots));
  auto* u2p = dalloc<int32_t>(size_t(slots));
  fill_bf16(X, c.T * c.H, 21, 1.0f, stream);
  fill_bf16(logits, c.T * c.E, 22, 4.0f, stream);
  fill_bf16(W1, int64_t(c.E) * 2 * c.I * c.H, 23, 0.05f, stream);
  fill_bf16(W2, int64_t(c.E) * c.H * c.I, 24, 0.05f, stream);
  BENCH_CUDA(cudaGetLastError());

  MoeForwardArgs f = routed_layer(c, X, logits);
  f.selected_experts_out = ids;
  f.final_scales_out = scales;
  f.W1 = W1;
  f.W2 = W2;
  f.out = out;
  const size_t ws_bytes = moe_forward_workspace_size(f);
  void* ws = dalloc<char>(ws_bytes);
  Status st = moe_forward(f, ws, ws_bytes, stream);
  if (!st.ok()) {
    std::fprintf(stderr, "flashmix-bench: moe_forward %s: %s\n", c.name.c_str(), st.message().c_str());
    return;
  }
  // The same routing, staged: maps, FC1, FC2 alone.
  MoeRoutingArgs m;
  m.token_selected_experts = ids;
  m.num_tokens = c.T;
  m.k = c.k;
  m.num_experts_per_node = c.E;
  m.expert_first_token_offset = offsets;
  m.permuted_row_to_unpermuted_row = p2u;
  m.unpermuted_row_to_permuted_row = u2p;
  // FC1 alone reads what it reads inside the layer: X (gather) or, where the
  // rule picks the permuted copy, that copy (made here by the maps, untimed).
  const bool auto_copy = moe_forward_fc1_input(f) == MoeFc1Input::kPermutedCopy;
  auto* xp = dalloc<__nv_bfloat16>(auto_copy ? size_t(slots * c.H) : 1);
  if (auto_copy) {
    m.input = X;
    m.permuted_input = xp;
    m.hidden = c.H;
  }
  const size_t mws_bytes = build_moe_routing_maps_workspace_size(m);
  void* mws = dalloc<char>(mws_bytes);
  BENCH_CUDA(cudaStreamSynchronize(stream));
  st = build_moe_routing_maps(m, mws, mws_bytes, stream);
  MoeFc1Args a1;
  a1.X = auto_copy ? xp : X;
  a1.x_permuted = auto_copy;
  a1.W1 = W1;
  a1.expert_first_token_offset = offsets;
  a1.permuted_row_to_unpermuted_row = p2u;
  a1.num_tokens = c.T;
  a1.k = c.k;
  a1.hidden = c.H;
  a1.inter = c.I;
  a1.num_experts_per_node = c.E;
  a1.out = act;
  Fc2FinalizeArgs a2;
  a2.A = act;
  a2.W2 = W2;
  a2.expert_first_token_offset = offsets;
  a2.permuted_row_to_unpermuted_row = p2u;
  a2.scales = scales;
  a2.num_tokens = c.T;
  a2.k = c.k;
  a2.hidden = c.H;
  a2.inter = c.I;
  a2.num_experts_per_node = c.E;
  a2.out = out_staged;
  const size_t ws2_bytes = moe_fc2_finalize_workspace_size(a2);
  void* ws2 = dalloc<char>(ws2_bytes);
  if (st.ok()) st = moe_fc1(a1, stream);
  if (st.ok()) st = moe_fc2_finalize(a2, ws2, ws2_bytes, stream);
  if (!st.ok()) {
    std::fprintf(stderr, "flashmix-bench: moe_forward %s (staged): %s\n", c.name.c_str(), st.message().c_str());
    return;
  }
  BENCH_CUDA(cudaStreamSynchronize(stream));
  std::vector<int64_t> hoff(size_t(c.E + 1));
  BENCH_CUDA(cudaMemcpy(hoff.data(), offsets, hoff.size() * 8, cudaMemcpyDeviceToHost));
  int used = 0;
  for (int e = 0; e < c.E; ++e) used += hoff[size_t(e + 1)] > hoff[size_t(e)];
  std::string check = "not checked (--no-verify)";
  if (ctx.verify) {
    std::vector<uint16_t> a(size_t(c.T * c.H)), b(a.size());
    BENCH_CUDA(cudaMemcpy(a.data(), out, a.size() * 2, cudaMemcpyDeviceToHost));
    BENCH_CUDA(cudaMemcpy(b.data(), out_staged, b.size() * 2, cudaMemcpyDeviceToHost));
    double max_ref = 0;
    for (uint16_t v : b) max_ref = std::max(max_ref, std::fabs(double(host::bf16_to_float(v))));
    const double rtol = std::ldexp(1.0, -7), atol = c.k * std::ldexp(1.0, -8) * max_ref;  // two kAtomic sums
    int64_t bad = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      const double x = host::bf16_to_float(a[i]), y = host::bf16_to_float(b[i]);
      bad += !(std::fabs(x - y) <= rtol * std::fabs(y) + 2 * atol);
    }
    check = bad ? "FAILED: " + std::to_string(bad) + " elements differ from the staged FC1 + FC2"
                : "passed (every element against the staged FC1 + FC2)";
  }
  const int iters = ctx.quick ? 10 : 30;
  // The other FC1 input (evidence for the automatic choice).
  MoeForwardArgs g = f;
  g.fc1_input = auto_copy ? MoeFc1Input::kGather : MoeFc1Input::kPermutedCopy;
  const size_t gws_bytes = moe_forward_workspace_size(g);
  void* gws = dalloc<char>(gws_bytes);
  double fwd_us, fc1_us, fc2_us, other_us;
  if (c.decode) {
    const int replays = ctx.quick ? 5 : 20;
    fwd_us = graph_us_per_launch([&](int) { (void)moe_forward(f, ws, ws_bytes, stream); }, 10, stream, replays);
    fc1_us = graph_us_per_launch([&](int) { (void)moe_fc1(a1, stream); }, 10, stream, replays);
    fc2_us = graph_us_per_launch([&](int) { (void)moe_fc2_finalize(a2, ws2, ws2_bytes, stream); }, 10, stream,
                                 replays);
    other_us = graph_us_per_launch([&](int) { (void)moe_forward(g, gws, gws_bytes, stream); }, 10, stream, replays);
  } else {
    // Two rounds, the second in the reverse order, each time the mean of the
    // two medians: a sustained load lowers the clocks as the case goes on
    // (the first-timed layer read faster than the FC1 and FC2 timed after
    // it), and the reversal cancels a steady drift.
    const std::function<double()> timed[4] = {
        [&] { return median_us([&] { (void)moe_forward(f, ws, ws_bytes, stream); }, stream, 3, iters); },
        [&] { return median_us([&] { (void)moe_fc1(a1, stream); }, stream, 3, iters); },
        [&] { return median_us([&] { (void)moe_fc2_finalize(a2, ws2, ws2_bytes, stream); }, stream, 3, iters); },
        [&] { return median_us([&] { (void)moe_forward(g, gws, gws_bytes, stream); }, stream, 3, iters); },
    };
    double us[4] = {0, 0, 0, 0};
    for (int i = 0; i < 4; ++i) us[i] += timed[i]() / 2;
    for (int i = 3; i >= 0; --i) us[i] += timed[i]() / 2;
    fwd_us = us[0];
    fc1_us = us[1];
    fc2_us = us[2];
    other_us = us[3];
  }
  cudaFree(gws);
  const double wbytes = double(used) * 3.0 * double(c.I) * double(c.H) * 2.0;  // W1 (2I x H) + W2 (H x I)
  Record rec;
  rec.op = "moe_forward";
  rec.case_name = c.name;
  rec.median_us = fwd_us;
  rec.check = check;
  rec.flops = 2.0 * double(hoff.back()) * 3.0 * double(c.I) * double(c.H);
  rec.extra["fc1_us"] = fc1_us;
  rec.extra["fc2_us"] = fc2_us;
  rec.extra["ratio_to_fc1_plus_fc2"] = fwd_us / (fc1_us + fc2_us);
  rec.extra["weight_bytes_fraction_of_copy"] = wbytes / (fwd_us * 1e-6) / (ctx.copy_gbps * 1e9);
  rec.extra["experts_used"] = used;
  rec.labels["router"] = to_string(c.scoring);
  rec.labels["fc1_input"] = auto_copy ? "permuted_copy" : "gather";
  rec.extra[auto_copy ? "gather_us" : "permuted_copy_us"] = other_us;
  if (c.decode) {
    set_copy_ceiling(ctx, rec, wbytes);
    rec.extra["target_fraction"] = 0.70;
  } else {
    rec.ceiling = "fc1+fc2";
    rec.fraction = (fc1_us + fc2_us) / fwd_us;
    rec.extra["target_ratio"] = c.max_ratio;
  }
  add_record(ctx, rec);
  for (void* p : {(void*)X, (void*)logits, (void*)W1, (void*)W2, (void*)out, (void*)out_staged, (void*)act,
                  (void*)ids, (void*)scales, (void*)xp, (void*)offsets, (void*)p2u, (void*)u2p, ws, mws, ws2})
    cudaFree(p);
}

// moe_forward_fp8 (spec §10.4): the layer with e4m3 W1 / W2 and 128 x 128
// fp32 block scales (quantize_fp8 of the bf16 weights), against the bf16
// layer on the same routing, in the same run: ratio_to_bf16_forward = FP8 /
// bf16 time (issue 25's target: <= 0.60). Check: the FP8 output against the
// bf16 layer's on the dequantised weights, relative Frobenius error (recorded
// as rel_error_vs_bf16) <= 2^-3 (quantising X and FC1's output: about 4%
// expected, tests/gpu/test_moe_forward_gpu.cu).
__global__ void dequantise_kernel(__nv_bfloat16* w, const uint8_t* q, const float* sc, int64_t n, int64_t rows,
                                  int64_t cols) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t k = i % cols, r = (i / cols) % rows, e = i / (cols * rows);
  const int64_t rb = (rows + 127) / 128, cb = cols / 128;
  __nv_fp8_e4m3 v;
  v.__x = q[i];
  w[i] = __float2bfloat16(float(v) * sc[(e * rb + r / 128) * cb + k / 128]);
}

void run_fp8_case(Context& ctx, const ForwardCase& c, cudaStream_t stream) {
  if (!ctx.selected("moe_forward_fp8", c.name)) return;
  const int64_t E = c.E;
  auto* X = dalloc<__nv_bfloat16>(size_t(c.T * c.H));
  auto* logits = dalloc<__nv_bfloat16>(size_t(c.T * c.E));
  auto* W1 = dalloc<__nv_bfloat16>(size_t(E) * 2 * c.I * c.H);
  auto* W2 = dalloc<__nv_bfloat16>(size_t(E) * c.H * c.I);
  auto* W1q = dalloc<uint8_t>(size_t(E) * 2 * c.I * c.H);
  auto* W2q = dalloc<uint8_t>(size_t(E) * c.H * c.I);
  auto* W1s = dalloc<float>(size_t(E) * ((2 * c.I + 127) / 128) * (c.H / 128));
  auto* W2s = dalloc<float>(size_t(E) * ((c.H + 127) / 128) * (c.I / 128));
  auto* out8 = dalloc<__nv_bfloat16>(size_t(c.T * c.H));
  auto* out16 = dalloc<__nv_bfloat16>(size_t(c.T * c.H));
  fill_bf16(X, c.T * c.H, 21, 1.0f, stream);
  fill_bf16(logits, c.T * c.E, 22, 4.0f, stream);
  fill_bf16(W1, E * 2 * c.I * c.H, 23, 0.05f, stream);
  fill_bf16(W2, E * c.H * c.I, 24, 0.05f, stream);
  BENCH_CUDA(cudaGetLastError());
  auto quantise = [&](const void* w, void* q, float* sc, int64_t rows, int64_t cols) {
    QuantizeFp8Args qa;
    qa.x = w;
    qa.q = q;
    qa.scales = sc;
    qa.batch = E;
    qa.rows = rows;
    qa.cols = cols;
    qa.block = Fp8Block::k128x128;
    return quantize_fp8(qa, stream);
  };
  Status st = quantise(W1, W1q, W1s, 2 * c.I, c.H);
  if (st.ok()) st = quantise(W2, W2q, W2s, c.H, c.I);
  // The bf16 layer runs on the dequantised weights: bf16(e4m3 * scale).
  auto dequantise = [&](__nv_bfloat16* w, const uint8_t* q, const float* sc, int64_t rows, int64_t cols) {
    const int64_t n = E * rows * cols;
    dequantise_kernel<<<unsigned((n + 255) / 256), 256, 0, stream>>>(w, q, sc, n, rows, cols);
  };
  if (st.ok()) {
    dequantise(W1, W1q, W1s, 2 * c.I, c.H);
    dequantise(W2, W2q, W2s, c.H, c.I);
    BENCH_CUDA(cudaGetLastError());
  }
  MoeForwardArgs f = routed_layer(c, X, logits);
  f.W1 = W1;
  f.W2 = W2;
  f.out = out16;
  MoeForwardArgs f8 = f;
  f8.fp8 = MoeFp8Scaling::kBlock;
  f8.W1 = W1q;
  f8.W2 = W2q;
  f8.w1_scales = W1s;
  f8.w2_scales = W2s;
  f8.out = out8;
  const size_t ws16_bytes = moe_forward_workspace_size(f), ws8_bytes = moe_forward_workspace_size(f8);
  void* ws16 = dalloc<char>(ws16_bytes);
  void* ws8 = dalloc<char>(ws8_bytes);
  if (st.ok()) st = moe_forward(f, ws16, ws16_bytes, stream);
  if (st.ok()) st = moe_forward(f8, ws8, ws8_bytes, stream);
  if (!st.ok()) {
    std::fprintf(stderr, "flashmix-bench: moe_forward_fp8 %s: %s\n", c.name.c_str(), st.message().c_str());
    return;
  }
  BENCH_CUDA(cudaStreamSynchronize(stream));
  std::string check = "not checked (--no-verify)";
  double rel = -1;
  if (ctx.verify) {
    std::vector<uint16_t> a(size_t(c.T * c.H)), b(a.size());
    BENCH_CUDA(cudaMemcpy(a.data(), out8, a.size() * 2, cudaMemcpyDeviceToHost));
    BENCH_CUDA(cudaMemcpy(b.data(), out16, b.size() * 2, cudaMemcpyDeviceToHost));
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      const double x = host::bf16_to_float(a[i]), y = host::bf16_to_float(b[i]);
      num += (x - y) * (x - y);
      den += y * y;
    }
    rel = den > 0 ? std::sqrt(num / den) : (num > 0 ? 1.0 : 0.0);
    check = rel <= std::ldexp(1.0, -3) && std::isfinite(rel)
                ? "passed (relative Frobenius error vs the bf16 layer on the dequantised weights <= 2^-3)"
                : "FAILED: relative Frobenius error vs the bf16 layer " + std::to_string(rel);
  }
  const int iters = ctx.quick ? 10 : 30;
  const double bf16_us = median_us([&] { (void)moe_forward(f, ws16, ws16_bytes, stream); }, stream, 3, iters);
  const double fp8_us = median_us([&] { (void)moe_forward(f8, ws8, ws8_bytes, stream); }, stream, 3, iters);
  Record rec;
  rec.op = "moe_forward_fp8";
  rec.case_name = c.name;
  rec.median_us = fp8_us;
  rec.check = check;
  rec.ceiling = "bf16_forward";
  rec.fraction = bf16_us / fp8_us;
  rec.extra["bf16_forward_us"] = bf16_us;
  rec.extra["ratio_to_bf16_forward"] = fp8_us / bf16_us;
  rec.extra["target_ratio_to_bf16_forward"] = 0.60;
  if (rel >= 0) rec.extra["rel_error_vs_bf16"] = rel;
  rec.labels["scaling"] = "block";
  rec.labels["fc1_input"] = to_string(moe_forward_fc1_input(f8));
  add_record(ctx, rec);
  for (void* p : {(void*)X, (void*)logits, (void*)W1, (void*)W2, (void*)W1q, (void*)W2q, (void*)W1s, (void*)W2s,
                  (void*)out8, (void*)out16, ws16, ws8})
    cudaFree(p);
}

// moe_forward_mxfp4 (issue 28, spec §13.7): the layer with MXFP4 W1 / W2
// (random packed codes, ue8m0 scales 2^-9..2^-5) on the W4A8 path, one rank
// of expert parallelism (E_local of num_experts, the router over all of
// them), beside the FP8 layer on the same weights converted by
// mxfp4_to_fp8_block (128 x 128, exact at these spreads) recorded as
// moe_forward_fp8 with the same case name, and the bf16 layer on
// mxfp4_to_bf16 of them (the dequantised weights, exact). Decode cases replay
// graphs; their fraction is the used experts' packed bytes (+ scales) at copy
// bandwidth (target >= 0.75) and speedup_vs_fp8 = FP8 time / MXFP4 time
// (target >= 1.6); prefill: ratio_to_fp8 = MXFP4 / FP8 time (target <=
// 1.15). Check: relative Frobenius error of the MXFP4 and of the FP8 layer
// against the bf16 layer (both quantise X and FC1's output: ~4 %), <= 2^-3.
__global__ void fill_mx_kernel(uint8_t* x, int64_t n, uint32_t seed, int scale_lo, int scale_span) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  uint32_t h = uint32_t(i) * 0x9e3779b9u ^ seed;
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  x[i] = scale_span > 0 ? uint8_t(scale_lo + int(h % uint32_t(scale_span))) : uint8_t(h);
}

struct Mx4Case {
  std::string name;
  int64_t T;
  int k, E, E_local;
  int64_t H, I;
  bool decode;
};

void run_mxfp4_case(Context& ctx, const Mx4Case& c, cudaStream_t stream) {
  if (!ctx.selected("moe_forward_mxfp4", c.name) && !ctx.selected("moe_forward_fp8", c.name)) return;
  const int64_t El = c.E_local, H = c.H, I = c.I, slots = c.T * c.k;
  const int64_t w1n = El * 2 * I * H, w2n = El * H * I;
  auto* X = dalloc<__nv_bfloat16>(size_t(c.T * H));
  auto* logits = dalloc<__nv_bfloat16>(size_t(c.T * c.E));
  auto* W1p = dalloc<uint8_t>(size_t(w1n / 2));
  auto* W2p = dalloc<uint8_t>(size_t(w2n / 2));
  auto* W1m = dalloc<uint8_t>(size_t(w1n / 32));
  auto* W2m = dalloc<uint8_t>(size_t(w2n / 32));
  auto* W1q = dalloc<uint8_t>(size_t(w1n));
  auto* W2q = dalloc<uint8_t>(size_t(w2n));
  auto* W1s = dalloc<float>(size_t(El * ((2 * I + 127) / 128) * (H / 128)));
  auto* W2s = dalloc<float>(size_t(El * ((H + 127) / 128) * (I / 128)));
  auto* W1b = dalloc<__nv_bfloat16>(size_t(w1n));
  auto* W2b = dalloc<__nv_bfloat16>(size_t(w2n));
  auto* ids = dalloc<int32_t>(size_t(slots));
  __nv_bfloat16* outs[3] = {dalloc<__nv_bfloat16>(size_t(c.T * H)), dalloc<__nv_bfloat16>(size_t(c.T * H)),
                            dalloc<__nv_bfloat16>(size_t(c.T * H))};
  fill_bf16(X, c.T * H, 31, 1.0f, stream);
  fill_bf16(logits, c.T * c.E, 32, 4.0f, stream);
  auto fill = [&](uint8_t* x, int64_t n, uint32_t seed, int lo, int span) {
    fill_mx_kernel<<<unsigned((n + 255) / 256), 256, 0, stream>>>(x, n, seed, lo, span);
  };
  fill(W1p, w1n / 2, 33, 0, 0);
  fill(W2p, w2n / 2, 34, 0, 0);
  fill(W1m, w1n / 32, 35, 118, 5);  // scales 2^-9 .. 2^-5: |W| up to 6 / 32
  fill(W2m, w2n / 32, 36, 118, 5);
  BENCH_CUDA(cudaGetLastError());
  auto to_fp8 = [&](const void* w, const void* m, void* q, float* sc, int64_t rows, int64_t cols) {
    Mxfp4ToFp8BlockArgs a;
    a.w = w;
    a.w_scales = m;
    a.q = q;
    a.q_scales = sc;
    a.batch = El;
    a.rows = rows;
    a.cols = cols;
    return mxfp4_to_fp8_block(a, stream);
  };
  auto to_bf16 = [&](const void* w, const void* m, void* out, int64_t rows, int64_t cols) {
    Mxfp4ToBf16Args a;
    a.w = w;
    a.w_scales = m;
    a.out = out;
    a.batch = El;
    a.rows = rows;
    a.cols = cols;
    return mxfp4_to_bf16(a, stream);
  };
  Status st = to_fp8(W1p, W1m, W1q, W1s, 2 * I, H);
  if (st.ok()) st = to_fp8(W2p, W2m, W2q, W2s, H, I);
  if (st.ok()) st = to_bf16(W1p, W1m, W1b, 2 * I, H);
  if (st.ok()) st = to_bf16(W2p, W2m, W2b, H, I);
  MoeForwardArgs f16;
  f16.num_tokens = c.T;
  f16.hidden = H;
  f16.inter = I;
  f16.k = c.k;
  f16.num_experts = c.E;
  f16.num_experts_per_node = c.E_local;  // rank 0 of E / E_local
  f16.X = X;
  f16.router_logits = logits;
  f16.router.logits_dtype = DType::kBFloat16;
  f16.router.scoring = MoeRouterScoring::kSqrtSoftplus;
  f16.router.renormalize = true;
  f16.router.routed_scaling_factor = 1.5f;
  f16.activation = MoeActivation::kSwiGLUClamped;
  f16.selected_experts_out = ids;
  f16.W1 = W1b;
  f16.W2 = W2b;
  f16.out = outs[0];
  MoeForwardArgs f8 = f16;
  f8.selected_experts_out = nullptr;
  f8.fp8 = MoeFp8Scaling::kBlock;
  f8.W1 = W1q;
  f8.W2 = W2q;
  f8.w1_scales = W1s;
  f8.w2_scales = W2s;
  f8.out = outs[1];
  MoeForwardArgs f4 = f8;
  f4.weights = MoeWeightFormat::kMxfp4;
  f4.W1 = W1p;
  f4.W2 = W2p;
  f4.w1_scales = f4.w2_scales = nullptr;
  f4.w1_mx_scales = W1m;
  f4.w2_mx_scales = W2m;
  f4.out = outs[2];
  const MoeForwardArgs* layers[3] = {&f16, &f8, &f4};
  size_t ws_bytes[3];
  void* ws[3];
  for (int i = 0; i < 3; ++i) {
    ws_bytes[i] = moe_forward_workspace_size(*layers[i]);
    ws[i] = dalloc<char>(ws_bytes[i]);
    if (st.ok()) st = moe_forward(*layers[i], ws[i], ws_bytes[i], stream);
  }
  if (!st.ok()) {
    std::fprintf(stderr, "flashmix-bench: moe_forward_mxfp4 %s: %s\n", c.name.c_str(), st.message().c_str());
    return;
  }
  BENCH_CUDA(cudaStreamSynchronize(stream));
  std::vector<int32_t> hids(static_cast<size_t>(slots));
  BENCH_CUDA(cudaMemcpy(hids.data(), ids, hids.size() * 4, cudaMemcpyDeviceToHost));
  std::vector<char> seen(static_cast<size_t>(c.E_local), 0);
  for (int32_t e : hids)
    if (e >= 0 && e < c.E_local) seen[size_t(e)] = 1;
  int used = 0;
  for (char v : seen) used += v;
  double rel[2] = {-1, -1};
  std::string check = "not checked (--no-verify)";
  if (ctx.verify) {
    std::vector<uint16_t> ref(size_t(c.T * H)), got(ref.size());
    BENCH_CUDA(cudaMemcpy(ref.data(), outs[0], ref.size() * 2, cudaMemcpyDeviceToHost));
    for (int i = 0; i < 2; ++i) {
      BENCH_CUDA(cudaMemcpy(got.data(), outs[1 + i], got.size() * 2, cudaMemcpyDeviceToHost));
      double num = 0, den = 0;
      for (size_t j = 0; j < ref.size(); ++j) {
        const double x = host::bf16_to_float(got[j]), y = host::bf16_to_float(ref[j]);
        num += (x - y) * (x - y);
        den += y * y;
      }
      rel[i] = den > 0 ? std::sqrt(num / den) : (num > 0 ? 1.0 : 0.0);
    }
    const bool ok = std::isfinite(rel[0]) && std::isfinite(rel[1]) && rel[0] <= 0.125 && rel[1] <= 0.125;
    check = ok ? "passed (relative Frobenius error vs the bf16 layer on the dequantised weights <= 2^-3)"
               : "FAILED: relative Frobenius error vs the bf16 layer: fp8 " + std::to_string(rel[0]) + ", mxfp4 " +
                     std::to_string(rel[1]);
  }
  double us[3];
  const int iters = ctx.quick ? 10 : 30;
  for (int i = 0; i < 3; ++i) {
    const MoeForwardArgs& f = *layers[i];
    if (c.decode)
      us[i] = graph_us_per_launch([&](int) { (void)moe_forward(f, ws[i], ws_bytes[i], stream); }, 10, stream,
                                  ctx.quick ? 5 : 20);
    else
      us[i] = median_us([&] { (void)moe_forward(f, ws[i], ws_bytes[i], stream); }, stream, 3, iters);
  }
  // The used experts' weight bytes: MXFP4 (packed + scales) and FP8 (+ block scales).
  const double per_expert = 3.0 * double(I) * double(H);
  const double mx_bytes = used * per_expert * (0.5 + 1.0 / 32), fp8_bytes = used * per_expert;
  for (int i = 1; i < 3; ++i) {
    Record rec;
    rec.op = i == 2 ? "moe_forward_mxfp4" : "moe_forward_fp8";
    rec.case_name = c.name;
    rec.median_us = us[i];
    rec.check = check;
    rec.extra["bf16_forward_us"] = us[0];
    rec.extra["fp8_forward_us"] = us[1];
    rec.extra["experts_used"] = used;
    if (rel[i - 1] >= 0) rec.extra["rel_error_vs_bf16"] = rel[i - 1];
    rec.labels["weights"] = i == 2 ? "mxfp4 (w4a8)" : "fp8 block (mxfp4_to_fp8_block)";
    rec.labels["router"] = to_string(f16.router.scoring);
    rec.labels["ep"] = std::to_string(c.E_local) + " of " + std::to_string(c.E) + " experts";
    const double bytes = i == 2 ? mx_bytes : fp8_bytes;
    if (c.decode) {
      set_copy_ceiling(ctx, rec, bytes);
    } else {
      rec.ceiling = "bf16_forward";
      rec.fraction = us[0] / us[i];
    }
    if (i == 2) {
      rec.extra["speedup_vs_fp8"] = us[1] / us[2];
      rec.extra["ratio_to_fp8"] = us[2] / us[1];
      if (c.decode) {
        rec.extra["target_fraction"] = 0.75;
        rec.extra["target_speedup_vs_fp8"] = 1.6;
      } else {
        rec.extra["target_ratio_to_fp8"] = 1.15;
      }
    }
    add_record(ctx, rec);
  }
  for (void* p : {(void*)X, (void*)logits, (void*)W1p, (void*)W2p, (void*)W1m, (void*)W2m, (void*)W1q, (void*)W2q,
                  (void*)W1s, (void*)W2s, (void*)W1b, (void*)W2b, (void*)ids, (void*)outs[0], (void*)outs[1],
                  (void*)outs[2], ws[0], ws[1], ws[2]})
    cudaFree(p);
}

}  // namespace

void run_moe_forward_cases(Context& ctx) {
  if (!ctx.gpu) return;
  const std::vector<ForwardCase> cases = {
      {"mixtral_T4096_k2_E8_I14336_H4096", 4096, 2, 8, 4096, 14336, MoeRouterScoring::kSoftmax, 1.f, false, 1.10},
      {"deepseek_ep_T1024_k8_E32_I2048_H7168", 1024, 8, 32, 7168, 2048, MoeRouterScoring::kSigmoid, 2.5f, false,
       1.10},
      {"qwen3moe_T4096_k8_E128_I768_H2048", 4096, 8, 128, 2048, 768, MoeRouterScoring::kSoftmax, 1.f, false, 1.10},
      {"deepseek_ep_T16_k8_E32_I2048_H7168", 16, 8, 32, 7168, 2048, MoeRouterScoring::kSigmoid, 2.5f, true, 0},
      {"deepseek_ep_T64_k8_E32_I2048_H7168", 64, 8, 32, 7168, 2048, MoeRouterScoring::kSigmoid, 2.5f, true, 0},
  };
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (const auto& c : cases) run_case(ctx, c, stream);
  for (const auto& c : cases)
    if (c.name == "deepseek_ep_T1024_k8_E32_I2048_H7168") run_fp8_case(ctx, c, stream);
  // DeepSeek-V4-Flash's experts (H 4096, I 2048, 256 experts, top 6) on rank 0 of EP 8 (issue 28).
  const std::vector<Mx4Case> mx_cases = {
      {"v4flash_ep8_T16", 16, 6, 256, 32, 4096, 2048, true},
      {"v4flash_ep8_T64", 64, 6, 256, 32, 4096, 2048, true},
      {"v4flash_ep8_T4096", 4096, 6, 256, 32, 4096, 2048, false},
  };
  for (const auto& c : mx_cases) run_mxfp4_case(ctx, c, stream);
  BENCH_CUDA(cudaStreamDestroy(stream));
}

}  // namespace flashmix::bench
