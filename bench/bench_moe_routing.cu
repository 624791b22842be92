// flashmix-bench cases for build_moe_routing_maps (spec §1).
//
// Bytes counted (the minimum any implementation moves): the expert ids read
// once (k*T*4), both maps written once (k*T*4 + P*4), the offsets; with the
// expansion also each input row read once and each permuted row written once
// ((T + P) * H * element size). Fraction = (bytes / time) / copy bandwidth of
// the same run. The maps alone are a few hundred ns of traffic, so they are
// latency-bound and their fraction is small by nature; the expansion is
// bandwidth-bound and should approach the copy bandwidth.
// Every case is timed as CUDA-graph replays of many launches (GPU time, no
// host launch overhead); `stream_launch_us` beside it is the time of one call
// on a stream, host overhead included. Decode cases with the expansion rotate
// input/output copies larger than L2 together.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <string>
#include <vector>

#include "bench_common.h"
#include "common/test_data.h"
#include "flashmix/moe.h"

namespace flashmix::bench {
namespace {

using flashmix::testing::Rng;
using flashmix::testing::Routing;

struct RoutingCase {
  std::string name;
  int64_t T;
  int k;
  int total_experts, start, local;
  int64_t H = 0;  // 0: maps only; else expand bf16 rows of H
  bool decode = false;
  bool fp8 = false;  // the FP8 expansion (spec §1.4): e4m3 rows + 1 x 128 fp32 scales out
};

// Bytes a permuted row's expansion writes: bf16 copies, or e4m3 codes + fp32 scales.
int64_t out_row_bytes(const RoutingCase& c) { return c.fp8 ? c.H + c.H / 128 * 4 : c.H * 2; }

// Tokens with at least one local slot: the only input rows the expansion must read.
int64_t tokens_with_local_slot(const Routing& r) {
  int64_t n = 0;
  for (int64_t t = 0; t < r.T; ++t) {
    bool any = false;
    for (int j = 0; j < r.k; ++j) any |= r.u2p[j * r.T + t] >= 0;
    n += any;
  }
  return n;
}

double counted_bytes(const RoutingCase& c, const Routing& r) {
  const int64_t P = r.P();
  double b = double(c.T) * c.k * 4 * 2 + double(P) * 4 + double(c.local + 1) * 8;
  if (c.H) b += double(tokens_with_local_slot(r)) * double(c.H) * 2 + double(P) * double(out_row_bytes(c));
  return b;
}

void run_gpu_case(Context& ctx, const RoutingCase& c, cudaStream_t stream) {
  Rng rng(1234);
  Routing ref = flashmix::testing::random_routing(rng, c.T, c.k, c.total_experts, c.start, c.local);
  const int64_t slots = c.T * c.k, P = ref.P();
  int32_t *d_experts, *d_p2u, *d_u2p;
  int64_t* d_offsets;
  BENCH_CUDA(cudaMalloc(&d_experts, 4 * slots));
  BENCH_CUDA(cudaMalloc(&d_p2u, 4 * slots));
  BENCH_CUDA(cudaMalloc(&d_u2p, 4 * slots));
  BENCH_CUDA(cudaMalloc(&d_offsets, 8 * (c.local + 1)));
  BENCH_CUDA(cudaMemcpy(d_experts, ref.experts.data(), 4 * slots, cudaMemcpyHostToDevice));

  // Expansion buffers, rotated for decode so replays do not hit in L2.
  const size_t in_bytes = size_t(c.T) * c.H * 2, out_bytes = size_t(slots) * c.H * (c.fp8 ? 1 : 2);
  const size_t sc_bytes = c.fp8 ? size_t(slots) * (c.H / 128) * 4 : 0;
  int copies = 1;
  if (c.H && c.decode) copies = int(std::max<size_t>(1, 2 * ctx.l2_bytes / (in_bytes + out_bytes) + 1));
  char *d_in = nullptr, *d_out = nullptr, *d_sc = nullptr;
  std::vector<uint16_t> h_in;
  if (c.H) {
    BENCH_CUDA(cudaMalloc(&d_in, in_bytes * copies));
    BENCH_CUDA(cudaMalloc(&d_out, out_bytes * copies));
    if (c.fp8) BENCH_CUDA(cudaMalloc(&d_sc, sc_bytes * copies));
    h_in.resize(size_t(c.T) * c.H);
    uint32_t x = 12345;
    for (auto& v : h_in) {
      x = x * 1664525u + 1013904223u;
      // Random bit patterns for the copy; finite values in (-2, 2) to quantise.
      v = c.fp8 ? uint16_t(0x3000u + ((x >> 16) & 0x0fffu) + ((x >> 4) & 0x8000u)) : uint16_t(x >> 16);
    }
    for (int i = 0; i < copies; ++i)
      BENCH_CUDA(cudaMemcpy(d_in + in_bytes * i, h_in.data(), in_bytes, cudaMemcpyHostToDevice));
  }
  // A pageable cudaMemcpy may return before its DMA lands, and the
  // non-blocking stream below does not wait for it: one full-bench run had
  // the maps case's first launch read the experts before they had landed.
  BENCH_CUDA(cudaDeviceSynchronize());

  MoeRoutingArgs a;
  a.token_selected_experts = d_experts;
  a.num_tokens = c.T;
  a.k = c.k;
  a.start_expert_id = c.start;
  a.num_experts_per_node = c.local;
  a.expert_first_token_offset = d_offsets;
  a.permuted_row_to_unpermuted_row = d_p2u;
  a.unpermuted_row_to_permuted_row = d_u2p;
  a.hidden = c.H;
  a.input_dtype = DType::kBFloat16;
  // Workspace for the largest plan any tuning below may pick.
  MoeRoutingArgs multi = a;
  multi.tuning.single_block_max_slots = -1;
  const size_t ws_bytes = std::max(build_moe_routing_maps_workspace_size(a), build_moe_routing_maps_workspace_size(multi));
  void* d_ws = nullptr;
  if (ws_bytes) BENCH_CUDA(cudaMalloc(&d_ws, ws_bytes));

  auto launch = [&](int i, int tuning) {
    MoeRoutingArgs x = a;
    x.tuning.single_block_max_slots = tuning;
    if (c.H) {
      x.input = d_in + in_bytes * (i % copies);
      x.permuted_input = d_out + out_bytes * (i % copies);
      if (c.fp8) x.permuted_input_scales = d_sc + sc_bytes * (i % copies);
    }
    Status st = build_moe_routing_maps(x, d_ws, ws_bytes, stream);
    if (!st.ok()) {
      std::fprintf(stderr, "flashmix-bench: %s: %s\n", c.name.c_str(), st.message().c_str());
      std::exit(2);
    }
  };

  std::string check = "not checked (--no-verify)";
  if (ctx.verify) {
    launch(0, 0);
    BENCH_CUDA(cudaStreamSynchronize(stream));
    std::vector<int64_t> offsets(c.local + 1);
    std::vector<int32_t> p2u(slots), u2p(slots);
    BENCH_CUDA(cudaMemcpy(offsets.data(), d_offsets, 8 * (c.local + 1), cudaMemcpyDeviceToHost));
    BENCH_CUDA(cudaMemcpy(p2u.data(), d_p2u, 4 * slots, cudaMemcpyDeviceToHost));
    BENCH_CUDA(cudaMemcpy(u2p.data(), d_u2p, 4 * slots, cudaMemcpyDeviceToHost));
    check = "passed";
    if (offsets != ref.offsets) check = "FAILED: expert_first_token_offset";
    else if (u2p != ref.u2p) check = "FAILED: unpermuted_row_to_permuted_row";
    else if (!std::equal(ref.p2u.begin(), ref.p2u.end(), p2u.begin())) check = "FAILED: permuted_row_to_unpermuted_row";
    if (c.H && c.fp8 && check == "passed") {
      // The CPU reference's FP8 expansion (quantize_fp8_cpu), first P rows bitwise.
      std::vector<int64_t> h_off(c.local + 1);
      std::vector<int32_t> h_p2u(slots), h_u2p(slots);
      std::vector<uint8_t> want(out_bytes), got(size_t(P) * c.H);
      std::vector<float> want_sc(sc_bytes / 4), got_sc(size_t(P) * (c.H / 128));
      MoeRoutingArgs h = a;
      h.token_selected_experts = ref.experts.data();
      h.expert_first_token_offset = h_off.data();
      h.permuted_row_to_unpermuted_row = h_p2u.data();
      h.unpermuted_row_to_permuted_row = h_u2p.data();
      h.input = h_in.data();
      h.permuted_input = want.data();
      h.permuted_input_scales = want_sc.data();
      const Status st = build_moe_routing_maps_cpu(h);
      BENCH_CUDA(cudaMemcpy(got.data(), d_out, got.size(), cudaMemcpyDeviceToHost));
      BENCH_CUDA(cudaMemcpy(got_sc.data(), d_sc, got_sc.size() * 4, cudaMemcpyDeviceToHost));
      if (!st.ok()) check = "FAILED: CPU reference: " + st.message();
      else if (!std::equal(got.begin(), got.end(), want.begin())) check = "FAILED: e4m3 rows";
      else if (std::memcmp(got_sc.data(), want_sc.data(), got_sc.size() * 4) != 0) check = "FAILED: scales";
      else check = "passed (e4m3 rows and scales bitwise vs CPU reference)";
    } else if (c.H && check == "passed") {
      std::vector<uint16_t> out(size_t(P) * c.H);
      BENCH_CUDA(cudaMemcpy(out.data(), d_out, out.size() * 2, cudaMemcpyDeviceToHost));
      for (int64_t p = 0; p < P && check == "passed"; ++p) {
        const int64_t t = ref.p2u[p] % c.T;
        if (!std::equal(out.begin() + p * c.H, out.begin() + (p + 1) * c.H, h_in.begin() + t * c.H))
          check = "FAILED: permuted_input row " + std::to_string(p);
      }
    }
  }

  // GPU time: CUDA-graph replays (many launches per graph), so host launch
  // overhead is not counted; stream launches (what an un-graphed caller
  // sees, host overhead included) are reported beside it.
  auto time_with = [&](int tuning) {
    const int launches = c.decode ? std::max(copies, 100) : (c.H ? 10 : 100);
    return graph_us_per_launch([&](int i) { launch(i, tuning); }, launches, stream, ctx.quick ? 5 : 20);
  };
  const double bytes = counted_bytes(c, ref);
  const double us = time_with(0);
  const double stream_us = median_us([&] { launch(0, 0); }, stream, 5, ctx.quick ? 10 : 50);
  Record r = copy_record(ctx, "moe_routing", c.name, us, bytes, check);
  r.extra["bound_us"] = copy_bound_us(ctx, bytes);
  r.extra["local_rows_P"] = double(P);
  r.extra["stream_launch_us"] = stream_us;
  if (c.decode && c.H) r.extra["rotated_copies"] = copies;
  add_record(ctx, r);

  // Both launch paths where both apply (the automatic threshold is chosen from these).
  if (ctx.sweep && slots <= 8192) {
    for (int tuning : {8192, -1}) {
      const double t = time_with(tuning);
      std::printf("  sweep %-34s %-13s: %9.2f us\n", c.name.c_str(), tuning == -1 ? "multi-launch" : "single-block", t);
    }
  }
  cudaFree(d_experts); cudaFree(d_p2u); cudaFree(d_u2p); cudaFree(d_offsets);
  if (d_ws) cudaFree(d_ws);
  if (d_in) cudaFree(d_in);
  if (d_out) cudaFree(d_out);
  if (d_sc) cudaFree(d_sc);
}

void run_cpu_case(Context& ctx, const RoutingCase& c) {
  Rng rng(1234);
  Routing ref = flashmix::testing::random_routing(rng, c.T, c.k, c.total_experts, c.start, c.local);
  const int64_t slots = c.T * c.k;
  std::vector<int64_t> offsets(c.local + 1);
  std::vector<int32_t> p2u(slots), u2p(slots);
  std::vector<uint16_t> in(size_t(c.T) * c.H), out(size_t(slots) * c.H);
  std::vector<float> sc(c.fp8 ? size_t(slots) * (c.H / 128) : 0);
  MoeRoutingArgs a;
  a.token_selected_experts = ref.experts.data();
  a.num_tokens = c.T;
  a.k = c.k;
  a.start_expert_id = c.start;
  a.num_experts_per_node = c.local;
  a.expert_first_token_offset = offsets.data();
  a.permuted_row_to_unpermuted_row = p2u.data();
  a.unpermuted_row_to_permuted_row = u2p.data();
  if (c.H) {
    a.input = in.data();
    a.permuted_input = out.data();
    a.hidden = c.H;
    if (c.fp8) a.permuted_input_scales = sc.data();
  }
  record_cpu_run(ctx, "moe_routing_cpu", c.name, counted_bytes(c, ref), [&] { return build_moe_routing_maps_cpu(a); });
}

}  // namespace

void run_moe_routing_cases(Context& ctx) {
  const std::vector<RoutingCase> cases = {
      {"T8192_k8_E256_maps", 8192, 8, 256, 0, 256},
      {"T8192_k8_E256_expand_H7168", 8192, 8, 256, 0, 256, 7168},
      {"ep_rank3_T8192_k8_E32of256_maps", 8192, 8, 256, 96, 32},
      {"ep_rank3_T8192_k8_E32of256_expand_H7168", 8192, 8, 256, 96, 32, 7168},
      {"T8192_k8_E256_expand_fp8_H7168", 8192, 8, 256, 0, 256, 7168, false, true},
      {"ep_rank3_T8192_k8_E32of256_expand_fp8_H7168", 8192, 8, 256, 96, 32, 7168, false, true},
      {"T1024_k8_E32_expand_fp8_H7168", 1024, 8, 32, 0, 32, 7168, false, true},
      {"T4096_k2_E8_maps", 4096, 2, 8, 0, 8},
      {"T512_k8_E256_maps", 512, 8, 256, 0, 256},
      {"T1024_k8_E256_maps", 1024, 8, 256, 0, 256},
      {"decode_T16_k8_E256_maps", 16, 8, 256, 0, 256, 0, true},
      {"decode_T16_k8_E256_expand_H7168", 16, 8, 256, 0, 256, 7168, true},
      {"decode_T64_k8_E256_expand_H7168", 64, 8, 256, 0, 256, 7168, true},
      {"decode_T16_k8_E256_expand_fp8_H7168", 16, 8, 256, 0, 256, 7168, true, true},
  };
  for_each_case(ctx, "moe_routing", cases, run_gpu_case, run_cpu_case, [](RoutingCase c) {
    c.T = std::min<int64_t>(c.T, 256);
    c.H = std::min<int64_t>(c.H, 1024);
    return c;
  });
}

}  // namespace flashmix::bench
