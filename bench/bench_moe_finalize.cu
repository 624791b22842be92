// flashmix-bench cases for finalize_moe_routing (spec §2).
//
// Bytes counted (the minimum any implementation moves): every local row read
// once, every written output row written once, plus the index, expert and
// scale reads and the bias rows (once). Fraction = (bytes / time) / copy
// bandwidth of the same run. Decode cases are timed as CUDA-graph replays of
// many launches over rotated inputs (larger than L2 together), and again
// without rotation (`_l2_warm`: the rows in L2, as right after FC2).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <cuda_bf16.h>

#include "bench_common.h"
#include "common/launch.cuh"
#include "common/test_data.h"
#include "flashmix/moe.h"

namespace flashmix::bench {
namespace {

using flashmix::testing::HostTensor;
using flashmix::testing::Rng;
using flashmix::testing::Routing;

struct FinalizeCase {
  std::string name;
  int64_t T;
  int k;
  int64_t H;
  int total_experts, start, local;
  bool bias = false, shared = false, fill = true;
  DType in = DType::kBFloat16, out = DType::kBFloat16;
  bool decode = false;  // time as graph replays of many launches
  double target = 0;    // fraction of copy bandwidth the issue asks for (0: none)
  double max_us = 0;    // latency bound for decode cases (0: none)
  double max_ratio = 0; // time / (bytes / copy) bound (EP case)
  bool prefetch = false; // FinalizeMoeRoutingArgs::prefetch_indices
};

// Uniform values in [-1, 1) written straight into the tensor; fast enough for
// the 1 GB inputs (the tests use the slower, general generator).
void fast_fill(HostTensor& t, uint64_t seed) {
  uint64_t x = seed | 1;
  for (int64_t i = 0; i < t.count(); ++i) {
    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    t.set(i, double(int64_t(x >> 40) - (int64_t(1) << 23)) / double(int64_t(1) << 23));
  }
}

struct HostProblem {
  Routing routing;
  HostTensor rows, bias, shared;
  std::vector<float> scales;
  int64_t written_tokens = 0;  // tokens the op writes (all when filling)
};

HostProblem make_host_problem(const FinalizeCase& c, uint64_t seed) {
  HostProblem hp;
  Rng rng(seed);
  hp.routing = flashmix::testing::random_routing(rng, c.T, c.k, c.total_experts, c.start, c.local);
  hp.rows = HostTensor(c.in, std::max<int64_t>(1, hp.routing.P()) * c.H);
  fast_fill(hp.rows, seed + 1);
  hp.scales.resize(size_t(c.T * c.k));
  for (auto& s : hp.scales) s = rng.uniform(0.05f, 1.0f);
  if (c.bias) { hp.bias = HostTensor(c.in, int64_t(c.local) * c.H); fast_fill(hp.bias, seed + 2); }
  if (c.shared) { hp.shared = HostTensor(c.out, c.T * c.H); fast_fill(hp.shared, seed + 3); }
  for (int64_t t = 0; t < c.T; ++t) {
    bool any = c.fill;
    for (int j = 0; j < c.k && !any; ++j) {
      const int e = hp.routing.experts[t * c.k + j];
      any = e >= c.start && e < c.start + c.local;
    }
    hp.written_tokens += any;
  }
  return hp;
}

double counted_bytes(const FinalizeCase& c, const HostProblem& hp) {
  const double in = double(dtype_size(c.in)), out = double(dtype_size(c.out));
  double b = double(hp.routing.P()) * c.H * in + double(hp.written_tokens) * c.H * out;
  b += double(c.T) * c.k * (4 + 4 + 4);  // experts, u2p, scales
  if (c.bias) b += double(c.local) * c.H * in;
  if (c.shared) b += double(hp.written_tokens) * c.H * out;
  return b;
}

FinalizeMoeRoutingArgs make_args(const FinalizeCase& c, int64_t num_rows) {
  FinalizeMoeRoutingArgs a;
  a.rows_dtype = c.in;
  a.out_dtype = c.out;
  a.num_rows = num_rows;
  a.num_tokens = c.T;
  a.hidden = c.H;
  a.k = c.k;
  a.start_expert_id = c.start;
  a.num_experts_per_node = c.local;
  a.fill = c.fill;
  a.prefetch_indices = c.prefetch;
  return a;
}

// The case's arguments over the host copies (for the CPU reference backend).
FinalizeMoeRoutingArgs host_args(const FinalizeCase& c, HostProblem& hp, void* out) {
  FinalizeMoeRoutingArgs h = make_args(c, std::max<int64_t>(1, hp.routing.P()));
  h.expanded_permuted_rows = hp.rows.data();
  h.unpermuted_row_to_permuted_row = hp.routing.u2p.data();
  h.token_selected_experts = hp.routing.experts.data();
  h.scales = hp.scales.data();
  h.bias = c.bias ? hp.bias.data() : nullptr;
  h.shared_output = c.shared ? hp.shared.data() : nullptr;
  h.permuted_row_to_unpermuted_row = hp.routing.p2u.data();
  h.expert_first_token_offset = hp.routing.offsets.data();
  h.out = out;
  return h;
}

std::string compare(const FinalizeCase& c, const HostTensor& got, const HostTensor& ref) {
  const double ulp = c.out == DType::kBFloat16 ? std::ldexp(1.0, -7) : c.out == DType::kFloat16 ? std::ldexp(1.0, -10)
                                                                                               : std::ldexp(1.0, -23);
  int64_t bad = 0;
  double worst = 0;
  for (int64_t i = 0; i < ref.count(); ++i) {
    const double r = ref.get(i), g = got.get(i);
    if (std::isnan(r)) {  // untouched by no-filling: must still hold the poison
      bad += std::memcmp(got.bytes.data() + i * dtype_size(c.out), ref.bytes.data() + i * dtype_size(c.out),
                         dtype_size(c.out)) != 0;
      continue;
    }
    const double err = std::fabs(g - r);
    worst = std::max(worst, err);
    bad += !(err <= ulp * std::fabs(r) + 1e-5 * c.k * 4);
  }
  if (bad) return "FAILED: " + std::to_string(bad) + " elements (max abs err " + std::to_string(worst) + ")";
  return "passed";
}

// Sweep-only reference: sgl-kernel's apply_shuffle_mul_sum loop shape (a block
// per token, a vector per thread, slots summed one at a time, no locality
// check) over this case's bf16 rows and indices.
__global__ void sgl_like_kernel(const __nv_bfloat16* __restrict__ rows, __nv_bfloat16* __restrict__ out,
                                const int32_t* __restrict__ u2p, const float* __restrict__ scales, int64_t T, int k,
                                int H) {
  const int64_t t = blockIdx.x;
  for (int v = threadIdx.x; v < H / 8; v += blockDim.x) {
    float acc[8] = {};
    for (int j = 0; j < k; ++j) {
      const int r = u2p[j * T + t];
      const float w = scales[t * k + j];
      const uint4 x = __ldg(reinterpret_cast<const uint4*>(rows + int64_t(r) * H) + v);
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&x);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 f = __bfloat1622float2(h[e]);
        acc[2 * e] += w * f.x;
        acc[2 * e + 1] += w * f.y;
      }
    }
    uint4 o;
    __nv_bfloat162* oh = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
    for (int e = 0; e < 4; ++e) oh[e] = __floats2bfloat162_rn(acc[2 * e], acc[2 * e + 1]);
    reinterpret_cast<uint4*>(out + t * H)[v] = o;
  }
}

void run_gpu_case(Context& ctx, const FinalizeCase& c, cudaStream_t stream) {
  const uint64_t seed = 0x5eed0000ull + std::hash<std::string>()(c.name);
  HostProblem hp = make_host_problem(c, seed);
  const int64_t P = std::max<int64_t>(1, hp.routing.P());
  const size_t rows_bytes = size_t(P * c.H) * dtype_size(c.in);
  const size_t out_bytes = size_t(c.T * c.H) * dtype_size(c.out);
  // Rotate over enough copies that a pass does not live in L2.
  const int copies = c.decode ? int(std::min<int64_t>(2000, std::max<int64_t>(1, (4 * ctx.l2_bytes) / (rows_bytes + out_bytes) + 1))) : 1;
  char *d_rows, *d_out;
  void *d_bias = nullptr, *d_shared = nullptr;
  int32_t *d_u2p, *d_experts, *d_p2u;
  float* d_scales;
  int64_t* d_offsets;
  BENCH_CUDA(cudaMalloc(&d_rows, rows_bytes * copies));
  BENCH_CUDA(cudaMalloc(&d_out, out_bytes * copies));
  BENCH_CUDA(cudaMalloc(&d_u2p, hp.routing.u2p.size() * 4));
  BENCH_CUDA(cudaMalloc(&d_experts, hp.routing.experts.size() * 4));
  BENCH_CUDA(cudaMalloc(&d_scales, hp.scales.size() * 4));
  BENCH_CUDA(cudaMalloc(&d_p2u, std::max<size_t>(1, hp.routing.p2u.size()) * 4));
  BENCH_CUDA(cudaMalloc(&d_offsets, hp.routing.offsets.size() * 8));
  for (int i = 0; i < copies; ++i)
    BENCH_CUDA(cudaMemcpy(d_rows + rows_bytes * i, hp.rows.data(), rows_bytes, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(d_u2p, hp.routing.u2p.data(), hp.routing.u2p.size() * 4, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(d_experts, hp.routing.experts.data(), hp.routing.experts.size() * 4, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(d_scales, hp.scales.data(), hp.scales.size() * 4, cudaMemcpyHostToDevice));
  if (!hp.routing.p2u.empty())
    BENCH_CUDA(cudaMemcpy(d_p2u, hp.routing.p2u.data(), hp.routing.p2u.size() * 4, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(d_offsets, hp.routing.offsets.data(), hp.routing.offsets.size() * 8, cudaMemcpyHostToDevice));
  if (c.bias) {
    BENCH_CUDA(cudaMalloc(&d_bias, hp.bias.bytes.size()));
    BENCH_CUDA(cudaMemcpy(d_bias, hp.bias.data(), hp.bias.bytes.size(), cudaMemcpyHostToDevice));
  }
  if (c.shared) {
    BENCH_CUDA(cudaMalloc(&d_shared, hp.shared.bytes.size()));
    BENCH_CUDA(cudaMemcpy(d_shared, hp.shared.data(), hp.shared.bytes.size(), cudaMemcpyHostToDevice));
  }
  HostTensor poison(c.out, c.T * c.H);
  poison.poison();
  BENCH_CUDA(cudaMemcpy(d_out, poison.data(), out_bytes, cudaMemcpyHostToDevice));
  // A pageable cudaMemcpy may return before its DMA lands, and the
  // non-blocking stream below does not wait for it.
  BENCH_CUDA(cudaDeviceSynchronize());

  FinalizeMoeRoutingArgs a = make_args(c, P);
  a.unpermuted_row_to_permuted_row = d_u2p;
  a.token_selected_experts = d_experts;
  a.scales = d_scales;
  a.bias = d_bias;
  a.shared_output = d_shared;
  a.permuted_row_to_unpermuted_row = d_p2u;
  a.expert_first_token_offset = d_offsets;
  auto args_for = [&](int i) {
    FinalizeMoeRoutingArgs x = a;
    x.expanded_permuted_rows = d_rows + rows_bytes * (i % copies);
    x.out = d_out + out_bytes * (i % copies);
    return x;
  };
  auto launch = [&](int i, const FinalizeTuning& tuning) {
    FinalizeMoeRoutingArgs x = args_for(i);
    x.tuning = tuning;
    Status st = finalize_moe_routing(x, stream);
    if (!st.ok()) {
      std::fprintf(stderr, "flashmix-bench: %s: %s\n", c.name.c_str(), st.message().c_str());
      std::exit(2);
    }
  };

  // Check the first copy's output against the CPU reference.
  std::string check = "not checked (--no-verify)";
  if (ctx.verify) {
    launch(0, {});
    BENCH_CUDA(cudaStreamSynchronize(stream));
    HostTensor got(c.out, c.T * c.H), ref = poison;
    BENCH_CUDA(cudaMemcpy(got.data(), d_out, out_bytes, cudaMemcpyDeviceToHost));
    Status st = finalize_moe_routing_cpu(host_args(c, hp, ref.data()));
    check = st.ok() ? compare(c, got, ref) : "FAILED: reference: " + st.message();
  }

  const double bytes = counted_bytes(c, hp);
  // rotate = false (decode): every launch reads copy 0, which stays in L2.
  auto time_with = [&](const FinalizeTuning& tuning, bool rotate = true) {
    if (c.decode) {
      const int launches = std::max(copies, 200);
      return graph_us_per_launch([&](int i) { launch(rotate ? i : 0, tuning); }, launches, stream,
                                 ctx.quick ? 5 : 20);
    }
    return median_us([&] { launch(0, tuning); }, stream, 5, ctx.quick ? 10 : 50);
  };
  const double us = time_with({});
  Record r = copy_record(ctx, "moe_finalize", c.name, us, bytes, check);
  const double bound_us = bytes / (ctx.copy_gbps * 1e9) * 1e6;
  r.extra["bound_us"] = bound_us;
  if (c.target) r.extra["target_fraction"] = c.target;
  if (c.max_us) r.extra["target_max_us"] = c.max_us;
  if (c.max_ratio) {
    r.extra["time_over_bound"] = us / bound_us;
    r.extra["target_max_time_over_bound"] = c.max_ratio;
  }
  if (c.decode) {
    r.extra["rotated_copies"] = copies;
    // Without a graph: back-to-back launches from the host, per launch. At
    // decode sizes the host side of a launch is as long as the kernel.
    const int launches = 200;
    r.extra["eager_us_per_launch"] =
        median_us([&] { for (int i = 0; i < launches; ++i) launch(i, {}); }, stream, 2, ctx.quick ? 5 : 15) / launches;
  }
  add_record(ctx, r);
  if (c.decode) {
    // The same graph replays without rotation: the rows stay in L2, as in a
    // model where the FC2 GEMM has just written them. Reported beside the
    // cold number above (which carries the target), not instead of it.
    Record w = copy_record(ctx, "moe_finalize", c.name + "_l2_warm", time_with({}, false), bytes, check);
    w.extra["rotated_copies"] = 1;
    add_record(ctx, w);
  }

  if (ctx.sweep) {
    for (int threads : {64, 128, 256})
      for (int vectors : {1, 2})
        for (int blocks : {0, 1, 2}) {
          if (blocks && c.decode) continue;
          const double t = time_with({threads, vectors, blocks, 1});
          std::printf("  sweep %-34s threads %4d vectors %d chunks/token %d: %9.2f us  %.3f of copy\n",
                      c.name.c_str(), threads, vectors, blocks, t, bytes / (t * 1e-6) / 1e9 / ctx.copy_gbps);
        }
    // Token blocks (schedule 2).
    for (int threads : {128, 256, 512}) {
      const double t = time_with({threads, 0, 0, 2});
      std::printf("  sweep %-34s token blocks, threads %4d: %9.2f us  %.3f of copy\n", c.name.c_str(), threads, t,
                  bytes / (t * 1e-6) / 1e9 / ctx.copy_gbps);
    }
    if (c.in == DType::kBFloat16 && c.out == DType::kBFloat16 && c.fill && !c.bias && !c.shared && c.H % 8 == 0 &&
        !c.decode && c.start == 0 && c.local == c.total_experts) {
      for (int threads : {128, 256, 512}) {
        const int th = std::min(threads, int(c.H / 8));
        const double t = median_us([&] {
          sgl_like_kernel<<<unsigned(c.T), th, 0, stream>>>(reinterpret_cast<const __nv_bfloat16*>(d_rows),
                                                             reinterpret_cast<__nv_bfloat16*>(d_out), d_u2p, d_scales,
                                                             c.T, c.k, int(c.H));
        }, stream, 5, 50);
        std::printf("  sweep %-34s sgl-like loop, threads %4d: %9.2f us  %.3f of copy\n", c.name.c_str(), th, t,
                    bytes / (t * 1e-6) / 1e9 / ctx.copy_gbps);
      }
    }
  }
  cudaFree(d_rows); cudaFree(d_out); cudaFree(d_u2p); cudaFree(d_experts); cudaFree(d_scales);
  cudaFree(d_p2u); cudaFree(d_offsets);
  if (d_bias) cudaFree(d_bias);
  if (d_shared) cudaFree(d_shared);
}

// Decode floors: reference records beside the decode cases (not ops), timed
// the same way (graph replays of many PDL launches over rotated buffers).
//  - `_floor_empty`: a launch on the finalize's grid for the case that does
//    nothing but the grid-dependency wait and trigger: the fixed cost of one
//    dependent launch in the graph.
//  - `_floor_no_index_sum`: out vector v = sum over j < k of rows vector
//    (j, v): the case's row and output bytes, 16-byte accesses, all k loads of
//    a thread in flight at once, and no index round trip (rows at fixed
//    places). What a finalize of these bytes costs if its indices were free;
//    again without rotation (`_l2_warm`).
__global__ void floor_empty_kernel() {
  flashmix::dev::grid_dependency_wait();
  flashmix::dev::allow_dependents_launch();
}

constexpr int kFloorMaxK = 8;

__global__ void floor_sum_kernel(const uint4* __restrict__ rows, uint4* __restrict__ out, int64_t vecs, int k) {
  flashmix::dev::grid_dependency_wait();
  flashmix::dev::allow_dependents_launch();
  const int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (v >= vecs) return;
  uint4 x[kFloorMaxK];
#pragma unroll
  for (int j = 0; j < kFloorMaxK; ++j)
    if (j < k) x[j] = __ldcs(rows + j * vecs + v);
  float acc[8] = {};
#pragma unroll
  for (int j = 0; j < kFloorMaxK; ++j) {
    if (j >= k) break;
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&x[j]);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 f = __bfloat1622float2(h[e]);
      acc[2 * e] += f.x;
      acc[2 * e + 1] += f.y;
    }
  }
  uint4 o;
  __nv_bfloat162* oh = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
  for (int e = 0; e < 4; ++e) oh[e] = __floats2bfloat162_rn(acc[2 * e], acc[2 * e + 1]);
  out[v] = o;
}

void run_decode_floors(Context& ctx, const FinalizeCase& c) {
  const std::string empty_name = c.name + "_floor_empty", sum_name = c.name + "_floor_no_index_sum";
  const bool want_empty = ctx.selected("moe_finalize", empty_name), want_sum = ctx.selected("moe_finalize", sum_name);
  if (!ctx.gpu || !(want_empty || want_sum) || c.k > kFloorMaxK || c.H % 8) return;
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int64_t vecs = c.T * c.H / 8;  // 16-byte output vectors
  const size_t rows_bytes = size_t(vecs) * c.k * 16, out_bytes = size_t(vecs) * 16;
  const int copies = int(std::min<int64_t>(2000, (4 * ctx.l2_bytes) / (rows_bytes + out_bytes) + 1));
  const int threads = 128;
  const dim3 grid(unsigned((vecs + threads - 1) / threads));
  // Rows of small integers: every sum is exact in fp32 and in bf16, so the
  // check below is bitwise.
  std::vector<__nv_bfloat16> h_rows(size_t(vecs) * c.k * 8);
  for (size_t i = 0; i < h_rows.size(); ++i) h_rows[i] = __float2bfloat16(float(int((i * 2654435761u) % 15) - 7));
  uint4 *d_rows = nullptr, *d_out = nullptr;
  BENCH_CUDA(cudaMalloc(&d_rows, rows_bytes * copies));
  BENCH_CUDA(cudaMalloc(&d_out, out_bytes * copies));
  for (int i = 0; i < copies; ++i)
    BENCH_CUDA(cudaMemcpy(reinterpret_cast<char*>(d_rows) + rows_bytes * i, h_rows.data(), rows_bytes,
                          cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemset(d_out, 0xff, out_bytes * copies));
  BENCH_CUDA(cudaDeviceSynchronize());
  auto sum_launch = [&](int i) {
    BENCH_CUDA(flashmix::dev::launch(floor_sum_kernel, grid, dim3(threads), 0, stream, true,
                                     d_rows + (rows_bytes / 16) * (i % copies), d_out + vecs * (i % copies), vecs,
                                     c.k));
  };
  const int launches = std::max(copies, 200), replays = ctx.quick ? 5 : 20;
  const double bytes = double(rows_bytes + out_bytes);
  auto record = [&](const std::string& name, double us, const std::string& check, int rotated) {
    Record r = copy_record(ctx, "moe_finalize", name, us, bytes, check);
    r.extra["rotated_copies"] = rotated;
    add_record(ctx, r);
  };
  if (want_empty)
    record(empty_name,
           graph_us_per_launch([&](int) {
             BENCH_CUDA(flashmix::dev::launch(floor_empty_kernel, grid, dim3(threads), 0, stream, true));
           }, launches, stream, replays),
           "none: nothing computed", copies);
  if (want_sum) {
    sum_launch(0);
    BENCH_CUDA(cudaStreamSynchronize(stream));
    BENCH_CUDA(cudaGetLastError());
    std::vector<__nv_bfloat16> got(size_t(vecs) * 8);
    BENCH_CUDA(cudaMemcpy(got.data(), d_out, out_bytes, cudaMemcpyDeviceToHost));
    int64_t bad = 0;
    for (int64_t i = 0; i < vecs * 8; ++i) {
      float ref = 0;
      for (int j = 0; j < c.k; ++j) ref += __bfloat162float(h_rows[size_t(j) * vecs * 8 + i]);
      bad += __bfloat162float(got[i]) != ref;
    }
    const std::string check = bad ? "FAILED: " + std::to_string(bad) + " sums differ" : "passed";
    record(sum_name, graph_us_per_launch(sum_launch, launches, stream, replays), check, copies);
    // Without rotation (every launch reads copy 0, which stays in L2): the
    // floor of the `_l2_warm` replays.
    record(sum_name + "_l2_warm", graph_us_per_launch([&](int) { sum_launch(0); }, launches, stream, replays), check,
           1);
  }
  cudaFree(d_rows);
  cudaFree(d_out);
  BENCH_CUDA(cudaStreamDestroy(stream));
}

void run_cpu_case(Context& ctx, const FinalizeCase& c) {
  HostProblem hp = make_host_problem(c, 42);
  HostTensor out(c.out, c.T * c.H);
  const FinalizeMoeRoutingArgs h = host_args(c, hp, out.data());
  record_cpu_run(ctx, "moe_finalize_cpu", c.name, counted_bytes(c, hp), [&] { return finalize_moe_routing_cpu(h); });
}

}  // namespace

void run_moe_finalize_cases(Context& ctx) {
  std::vector<FinalizeCase> cases = {
      {"T8192_k8_H7168_bf16", 8192, 8, 7168, 256, 0, 256, false, false, true, DType::kBFloat16, DType::kBFloat16,
       false, 0.97},
      {"T8192_k8_H7168_bf16_bias", 8192, 8, 7168, 256, 0, 256, true, false, true, DType::kBFloat16,
       DType::kBFloat16, false, 0.95},
      {"T8192_k2_H4096_bf16", 8192, 2, 4096, 8, 0, 8, false, false, true, DType::kBFloat16, DType::kBFloat16,
       false, 0.95},
      {"T8192_k8_H7168_bf16_in_fp32_out", 8192, 8, 7168, 256, 0, 256, false, false, true, DType::kBFloat16,
       DType::kFloat32},
      // Mid-size T, just above the token blocks' automatic threshold (7
      // tokens per SM: 924 on an H100): the sweep compares both schedules.
      {"T1024_k8_H7168_bf16", 1024, 8, 7168, 256, 0, 256, false, false, true, DType::kBFloat16, DType::kBFloat16},
      {"T4096_k8_H7000_bf16_tail_shared", 4096, 8, 7000 + 3, 256, 0, 256, true, true, true, DType::kBFloat16,
       DType::kBFloat16},
      {"decode_T1_k8_H7168", 1, 8, 7168, 256, 0, 256, false, false, true, DType::kBFloat16, DType::kBFloat16, true,
       0, 3.0},
      {"decode_T16_k8_H7168", 16, 8, 7168, 256, 0, 256, false, false, true, DType::kBFloat16, DType::kBFloat16,
       true, 0, 3.0},
      {"decode_T64_k8_H7168", 64, 8, 7168, 256, 0, 256, false, false, true, DType::kBFloat16, DType::kBFloat16,
       true, 0, 3.0},
      {"ep8_rank3_T8192_k8_H7168_nofill", 8192, 8, 7168, 256, 96, 32, false, false, false, DType::kBFloat16,
       DType::kBFloat16, false, 0, 0, 1.15},
      {"ep8_rank3_T8192_k8_H7168_fill", 8192, 8, 7168, 256, 96, 32, false, false, true, DType::kBFloat16,
       DType::kBFloat16},
  };
  // Each decode case again with prefetch_indices (the indices read behind
  // the previous launch's tail; in a model, behind the FC2 GEMM's), listed
  // right after the decode cases. Reported, no target.
  {
    std::vector<FinalizeCase> prefetch;
    for (FinalizeCase c : cases)
      if (c.decode) {
        c.name += "_prefetch_indices";
        c.prefetch = true;
        c.target = c.max_us = c.max_ratio = 0;
        prefetch.push_back(c);
      }
    const auto last_decode = std::find_if(cases.rbegin(), cases.rend(), [](const FinalizeCase& c) { return c.decode; });
    cases.insert(last_decode.base(), prefetch.begin(), prefetch.end());
  }
  for_each_case(ctx, "moe_finalize", cases, run_gpu_case, run_cpu_case, [](FinalizeCase c) {
    c.T = std::min<int64_t>(c.T, 64);
    c.H = std::min<int64_t>(c.H, 1027);
    return c;
  });
  for (const FinalizeCase& c : cases)
    if (c.decode && !c.prefetch) run_decode_floors(ctx, c);
}

}  // namespace flashmix::bench
