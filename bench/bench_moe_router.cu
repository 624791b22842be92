// flashmix-bench cases for moe_router (SPEC §8).
//
// Bytes counted: the logits, read once (T*E*element size); the outputs
// (8*k*T bytes) are reported beside them but not counted. Fraction = the
// time to read the logits at the copy bandwidth of the same run / the time.
// The bound of the target is that read time plus one launch: an empty kernel
// with the router's grid and block, launched the same way (PDL attribute,
// CUDA-graph replays), measured in the same run (empty_launch_us).
//
// Hash selection (SPEC §8.7, `*_hash_*` cases): the kernel reads each token's
// id, its table row and its k chosen logits, not the row: the bytes counted
// are 8 (an int64 id) + 4k (the row) + 32k (a 32-byte sector per chosen logit)
// a token.
//
// Timing: CUDA-graph replays of many launches, each on its own copy of the
// logits (copies together over twice the L2), so every launch reads them from
// memory; `_l2_warm` beside it replays on one copy, which stays in L2, as in
// a model where the router GEMM has just written the logits.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "bench_common.h"
#include "common/router_testing.h"
#include "common/test_data.h"
#include "flashmix/moe.h"
#include "moe/moe_router_internal.h"

namespace flashmix::bench {
namespace {

using flashmix::testing::RouterCase;
using flashmix::testing::RouterHostData;

struct BenchCase {
  std::string name;
  RouterCase c;
  double max_ratio = 0;  // target: time / (read at copy bandwidth + one launch); 0: none
  int64_t hash_vocab = 0;  // > 0: hash selection from a table of this many rows (int64 token ids)
};

// The hash case's table (distinct experts a row) and token ids, fixed by the seed.
struct HashData {
  std::vector<int32_t> table;
  std::vector<int64_t> ids;
};

HashData hash_data(const BenchCase& b) {
  HashData h;
  if (b.hash_vocab <= 0) return h;
  flashmix::testing::Rng rng(4321);
  const int E = b.c.E, k = b.c.k;
  h.table.resize(size_t(b.hash_vocab * k));
  for (int64_t v = 0; v < b.hash_vocab; ++v)
    for (int j = 0; j < k; ++j) {
      int32_t e;
      bool fresh;
      do {  // k distinct experts (k << E)
        e = int32_t(rng.integer(0, E - 1));
        fresh = true;
        for (int q = 0; q < j; ++q) fresh &= h.table[size_t(v * k + q)] != e;
      } while (!fresh);
      h.table[size_t(v * k + j)] = e;
    }
  h.ids.resize(size_t(b.c.T));
  for (auto& id : h.ids) id = rng.integer(0, b.hash_vocab - 1);
  return h;
}

__global__ void empty_kernel() {}

double empty_launch_us(const Context& ctx, unsigned blocks, cudaStream_t stream) {
  auto launch = [&](int) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(128);
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    BENCH_CUDA(cudaLaunchKernelEx(&cfg, empty_kernel));
  };
  return graph_us_per_launch(launch, 100, stream, ctx.quick ? 5 : 20);
}

MoeRouterArgs host_args(const BenchCase& b, const RouterHostData& d, const HashData& h, std::vector<int32_t>& ids,
                        std::vector<float>& w) {
  ids.assign(size_t(b.c.T * b.c.k), 0);
  w.assign(size_t(b.c.T * b.c.k), 0.0f);
  MoeRouterArgs a = flashmix::testing::router_args(b.c, d);
  if (b.hash_vocab > 0) {
    a.hash_table = h.table.data();
    a.vocab_size = b.hash_vocab;
    a.token_ids = h.ids.data();
    a.token_ids_int64 = true;
  }
  a.token_selected_experts = ids.data();
  a.token_final_scales = w.data();
  return a;
}

void run_gpu_case(Context& ctx, const BenchCase& b, cudaStream_t stream) {
  const RouterCase& c = b.c;
  flashmix::testing::Rng rng(1234);
  const RouterHostData d = flashmix::testing::random_router_data(rng, c);
  const HashData h = hash_data(b);
  const size_t logit_bytes = d.logits.bytes.size(), slots = size_t(c.T * c.k);
  const int copies = int(std::max<size_t>(1, 2 * ctx.l2_bytes / logit_bytes + 1));
  char* d_logits = nullptr;
  float *d_bias = nullptr, *d_w = nullptr;
  int32_t* d_ids = nullptr;
  BENCH_CUDA(cudaMalloc(&d_logits, logit_bytes * copies));
  for (int i = 0; i < copies; ++i)
    BENCH_CUDA(cudaMemcpy(d_logits + logit_bytes * i, d.logits.data(), logit_bytes, cudaMemcpyHostToDevice));
  if (c.bias) {
    BENCH_CUDA(cudaMalloc(&d_bias, d.bias.size() * 4));
    BENCH_CUDA(cudaMemcpy(d_bias, d.bias.data(), d.bias.size() * 4, cudaMemcpyHostToDevice));
  }
  BENCH_CUDA(cudaMalloc(&d_ids, slots * 4));
  BENCH_CUDA(cudaMalloc(&d_w, slots * 4));
  int32_t* d_table = nullptr;
  int64_t* d_tok = nullptr;
  if (b.hash_vocab > 0) {
    BENCH_CUDA(cudaMalloc(&d_table, h.table.size() * 4));
    BENCH_CUDA(cudaMalloc(&d_tok, h.ids.size() * 8));
    BENCH_CUDA(cudaMemcpy(d_table, h.table.data(), h.table.size() * 4, cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaMemcpy(d_tok, h.ids.data(), h.ids.size() * 8, cudaMemcpyHostToDevice));
  }
  BENCH_CUDA(cudaDeviceSynchronize());  // pageable copies may land after the call returns

  MoeRouterArgs a = flashmix::testing::router_args(c, d);
  if (b.hash_vocab > 0) {
    a.hash_table = d_table;
    a.vocab_size = b.hash_vocab;
    a.token_ids = d_tok;
    a.token_ids_int64 = true;
  }
  a.correction_bias = d_bias;
  a.token_selected_experts = d_ids;
  a.token_final_scales = d_w;
  auto launch = [&](int i, int path) {
    MoeRouterArgs x = a;
    x.logits = d_logits + logit_bytes * size_t(i % copies);
    x.tuning.path = path;
    const Status st = moe_router(x, stream);
    if (!st.ok()) {
      std::fprintf(stderr, "flashmix-bench: %s: %s\n", b.name.c_str(), st.message().c_str());
      std::exit(2);
    }
  };

  std::string check = "not checked (--no-verify)";
  double undecided = 0;
  if (ctx.verify) {
    launch(0, 0);
    BENCH_CUDA(cudaStreamSynchronize(stream));
    std::vector<int32_t> ids(slots), ref_ids;
    std::vector<float> w(slots), ref_w;
    BENCH_CUDA(cudaMemcpy(ids.data(), d_ids, slots * 4, cudaMemcpyDeviceToHost));
    BENCH_CUDA(cudaMemcpy(w.data(), d_w, slots * 4, cudaMemcpyDeviceToHost));
    const Status st = moe_router_cpu(host_args(b, d, h, ref_ids, ref_w));
    if (!st.ok()) {
      check = "FAILED: reference: " + st.message();
    } else {
      // A hash choice hinges on no rounding: every token is compared.
      const std::vector<char> decided =
          b.hash_vocab > 0 ? std::vector<char>(size_t(c.T), 1) : flashmix::testing::decided_tokens(c, d);
      const auto cmp =
          flashmix::testing::compare_router(c, decided, ids.data(), w.data(), ref_ids.data(), ref_w.data());
      undecided = double(cmp.undecided);
      check = cmp.ok() ? "passed" : "FAILED: " + cmp.first_failure;
    }
  }

  auto time_with = [&](int path, bool rotate) {
    const int launches = std::max(copies, 100);
    return graph_us_per_launch([&](int i) { launch(rotate ? i : 0, path); }, launches, stream, ctx.quick ? 5 : 20);
  };
  const double us = time_with(0, true);
  const double read_bytes = b.hash_vocab > 0 ? double(c.T) * (8 + 36 * c.k) : double(logit_bytes);
  const double read_us = copy_bound_us(ctx, read_bytes);
  MoeRouterArgs timed = a;  // the layout the timed launches take
  timed.logits = d_logits;
  const int per_block = detail::router_tokens_per_block(timed);
  const unsigned blocks = unsigned((c.T + per_block - 1) / per_block);
  const double empty_us = empty_launch_us(ctx, blocks, stream);
  const double bound_us = read_us + empty_us;

  Record r = copy_record(ctx, "moe_router", b.name, us, read_bytes, check);
  r.extra["read_us"] = read_us;
  r.extra["empty_launch_us"] = empty_us;
  r.extra["bound_us"] = bound_us;
  r.extra["time_over_bound"] = us / bound_us;
  // The issue's wording also reads as 2 x the read plus one launch (a tighter
  // bound): recorded beside it.
  r.extra["time_over_2read_plus_launch"] = us / (2 * read_us + empty_us);
  if (b.max_ratio > 0) r.extra["target_max_time_over_bound"] = b.max_ratio;
  r.extra["output_bytes"] = double(slots) * 8;
  r.extra["rotated_copies"] = copies;
  r.extra["stream_launch_us"] = median_us([&] { launch(0, 0); }, stream, 5, ctx.quick ? 10 : 50);
  if (ctx.verify) r.extra["undecided_tokens"] = undecided;
  add_record(ctx, r);

  Record warm = r;
  warm.case_name = b.name + "_l2_warm";
  warm.median_us = time_with(0, false);
  warm.fraction = read_us / warm.median_us;
  warm.extra.clear();
  warm.extra["read_us"] = read_us;
  warm.extra["empty_launch_us"] = empty_us;
  warm.extra["time_over_bound"] = warm.median_us / bound_us;
  add_record(ctx, warm);

  if (ctx.sweep)
    for (int path : {1, 2})
      std::printf("  sweep %-34s path %d (%s): %9.2f us\n", b.name.c_str(), path,
                  path == 1 ? "rounds" : "candidates", time_with(path, true));

  cudaFree(d_logits);
  if (d_bias) cudaFree(d_bias);
  cudaFree(d_ids);
  cudaFree(d_w);
  if (d_table) cudaFree(d_table);
  if (d_tok) cudaFree(d_tok);
}

void run_cpu_case(Context& ctx, const BenchCase& b) {
  flashmix::testing::Rng rng(1234);
  const RouterHostData d = flashmix::testing::random_router_data(rng, b.c);
  const HashData h = hash_data(b);
  std::vector<int32_t> ids;
  std::vector<float> w;
  const MoeRouterArgs a = host_args(b, d, h, ids, w);
  record_cpu_run(ctx, "moe_router_cpu", b.name, double(d.logits.bytes.size()), [&] { return moe_router_cpu(a); });
}

RouterCase make(MoeRouterScoring s, int E, int k, bool renormalize, bool bias, float scale, int n_group = 1,
                int topk_group = 1, int64_t T = 8192, DType dtype = DType::kBFloat16) {
  RouterCase c;
  c.scoring = s;
  c.dtype = dtype;
  c.T = T;
  c.E = E;
  c.k = k;
  c.renormalize = renormalize;
  c.bias = bias;
  c.n_group = n_group;
  c.topk_group = topk_group;
  c.scale = scale;
  return c;
}

}  // namespace

void run_moe_router_cases(Context& ctx) {
  using S = MoeRouterScoring;
  const std::vector<BenchCase> cases = {
      // DeepSeek-V3 noaux_tc: sigmoid, e_score_correction_bias, 8 groups of 32, 4 kept, scale 2.5.
      {"deepseek_v3_T8192_E256_k8", make(S::kSigmoid, 256, 8, true, true, 2.5f, 8, 4), 2.0},
      {"deepseek_v3_T8192_E256_k8_fp32", make(S::kSigmoid, 256, 8, true, true, 2.5f, 8, 4, 8192, DType::kFloat32)},
      {"deepseek_v3_T16_E256_k8", make(S::kSigmoid, 256, 8, true, true, 2.5f, 8, 4, 16)},
      {"mixtral_T8192_E8_k2", make(S::kSoftmax, 8, 2, true, false, 1.0f)},
      {"qwen3_T8192_E128_k8", make(S::kSoftmax, 128, 8, true, false, 1.0f)},
      {"gptoss_T8192_E128_k4", make(S::kSoftmaxAfterTopk, 128, 4, false, false, 1.0f)},
      {"v4_T8192_E256_k6", make(S::kSqrtSoftplus, 256, 6, true, true, 1.5f)},
      // 16 experts a lane: V4-Pro's and Kimi-K2's 384, Qwen3-Next's 512.
      {"v4pro_T8192_E384_k6", make(S::kSqrtSoftplus, 384, 6, true, true, 1.5f)},
      {"qwen3next_T8192_E512_k10", make(S::kSoftmax, 512, 10, true, false, 1.0f)},
      // DeepSeek-V4's hash layers (V4-Flash: 256 experts, 6 a token, a vocabulary of 129,280 token ids).
      {"v4_hash_T8192_E256_k6", make(S::kSqrtSoftplus, 256, 6, true, false, 1.5f), 0, 129280},
      {"v4_hash_T16_E256_k6", make(S::kSqrtSoftplus, 256, 6, true, false, 1.5f, 1, 1, 16), 0, 129280},
  };
  for_each_case(ctx, "moe_router", cases, run_gpu_case, run_cpu_case, [](BenchCase b) {
    b.c.T = std::min<int64_t>(b.c.T, 256);
    return b;
  });
}

}  // namespace flashmix::bench
