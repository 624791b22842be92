// moe_router on the GPU against the CPU reference (SPEC §8): every scoring,
// both dtypes, the exact and general layouts, both selection paths, groups,
// deliberate ties, -inf / NaN / +inf, graphs, PDL, repeatability, and the
// SPEC §8.6 rejections (nothing launched, nothing written).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "common/gpu_testing.h"
#include "common/router_testing.h"
#include "common/test_data.h"
#include "flashmix/moe.h"

using namespace flashmix;
using namespace flashmix::testing;

namespace {

constexpr int32_t kPoisonId = int32_t(0xDEADBEEF);
constexpr uint32_t kPoisonW = 0xFFFFFFFFu;  // a NaN
constexpr int64_t kTail = 64;               // poisoned slots past [T, k] that must stay untouched

const MoeRouterScoring kScorings[] = {MoeRouterScoring::kSoftmax, MoeRouterScoring::kSigmoid,
                                      MoeRouterScoring::kSqrtSoftplus, MoeRouterScoring::kSoftmaxAfterTopk};

struct Outputs {
  std::vector<int32_t> ids;
  std::vector<float> w;
  bool operator==(const Outputs& o) const {
    return ids == o.ids && w.size() == o.w.size() && std::memcmp(w.data(), o.w.data(), w.size() * 4) == 0;
  }
};

// Device copies of one problem; the outputs have kTail poisoned slots past [T, k].
struct DeviceRouter {
  RouterCase c;
  DeviceBuffer logits, bias, ids, w;
  MoeRouterArgs args;
  int64_t slots;

  // logits_offset: elements between the allocation's start and the logits (misalignment).
  DeviceRouter(const RouterCase& c_, const RouterHostData& d, int64_t logits_offset = 0)
      : c(c_),
        logits(std::max<size_t>(16, d.logits.bytes.size() + size_t(logits_offset) * dtype_size(c_.dtype))),
        bias(std::max<size_t>(16, d.bias.size() * 4)),
        ids(size_t(c_.T * c_.k + kTail) * 4),
        w(size_t(c_.T * c_.k + kTail) * 4),
        slots(c_.T * c_.k) {
    char* base = static_cast<char*>(logits.get()) + logits_offset * int64_t(dtype_size(c.dtype));
    if (!d.logits.bytes.empty())
      EXPECT_EQ(cudaMemcpy(base, d.logits.data(), d.logits.bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
    if (!d.bias.empty()) bias.upload(d.bias.data(), d.bias.size() * 4);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    args = router_args(c, d);
    args.logits = base;
    args.correction_bias = d.bias.empty() ? nullptr : bias.as<float>();
    args.token_selected_experts = ids.as<int32_t>();
    args.token_final_scales = w.as<float>();
    poison();
  }
  void upload_logits(const RouterHostData& d) {
    EXPECT_EQ(cudaMemcpy(const_cast<void*>(args.logits), d.logits.data(), d.logits.bytes.size(),
                         cudaMemcpyHostToDevice),
              cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  void poison() {
    std::vector<int32_t> pi(size_t(slots + kTail), kPoisonId);
    std::vector<uint32_t> pw(size_t(slots + kTail), kPoisonW);
    ids.upload(pi.data(), pi.size() * 4);
    w.upload(pw.data(), pw.size() * 4);
  }
  Status launch(cudaStream_t stream = nullptr) { return moe_router(args, stream); }
  Outputs fetch() const {
    Outputs o;
    o.ids = ids.to_host<int32_t>();
    o.w = w.to_host<float>();
    return o;
  }
};

// Hash selection's inputs (SPEC §8.7): the table [V, k] and int64 token ids.
struct HashInputs {
  int64_t V = 0;
  std::vector<int32_t> table;
  std::vector<int64_t> ids;
};

// The reference outputs into host buffers of the same shape (with h: hash selection).
Outputs reference(const RouterCase& c, const RouterHostData& d, const HashInputs* h = nullptr) {
  Outputs o;
  o.ids.assign(size_t(c.T * c.k), kPoisonId);
  o.w.assign(size_t(c.T * c.k), 0.0f);
  MoeRouterArgs a = router_args(c, d);
  if (h != nullptr) {
    a.hash_table = h->table.data();
    a.vocab_size = h->V;
    a.token_ids = h->ids.data();
    a.token_ids_int64 = true;
  }
  a.token_selected_experts = o.ids.data();
  a.token_final_scales = o.w.data();
  Status st = moe_router_cpu(a);
  EXPECT_TRUE(st.ok()) << st.message();
  return o;
}

// Every id and weight still the poison.
bool all_poison(const Outputs& got) {
  for (size_t i = 0; i < got.ids.size(); ++i) {
    uint32_t bits;
    std::memcpy(&bits, &got.w[i], 4);
    if (got.ids[i] != kPoisonId || bits != kPoisonW) return false;
  }
  return true;
}

bool tail_untouched(const Outputs& got, int64_t slots) {
  for (int64_t i = slots; i < slots + kTail; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &got.w[size_t(i)], 4);
    if (got.ids[size_t(i)] != kPoisonId || bits != kPoisonW) return false;
  }
  return true;
}

// GPU outputs against the reference's on the `decided` tokens, and nothing
// written past [T, k]; returns the comparison.
RouterComparison expect_matches(const RouterCase& c, const std::vector<char>& decided, const Outputs& got,
                                const Outputs& want, const std::string& what) {
  RouterComparison cmp = compare_router(c, decided, got.ids.data(), got.w.data(), want.ids.data(), want.w.data());
  EXPECT_TRUE(cmp.ok()) << what << " " << c.describe() << ": " << cmp.id_mismatches << " tokens with other ids, "
                        << cmp.weight_mismatches << " weights off; first: " << cmp.first_failure;
  EXPECT_TRUE(tail_untouched(got, c.T * c.k)) << what << " " << c.describe() << ": wrote past [T, k]";
  return cmp;
}

// Checks GPU outputs against the reference; returns the comparison.
RouterComparison check_outputs(const RouterCase& c, const RouterHostData& d, const Outputs& got,
                               const std::string& what) {
  const RouterComparison cmp = expect_matches(c, decided_tokens(c, d), got, reference(c, d), what);
  // Exact keys (no bias, no groups) are never undecided; otherwise near-ties
  // (within 1e-5, a few times the GPU's fp32 error) and equal sums of other
  // terms (frequent with bf16 logits: equal in double, not in fp32) must stay
  // a minority, or the comparison would say little. (H100: up to 86 of 770
  // tokens in GroupLayouts once equal sums of other terms counted.)
  if (!c.bias && !c.grouped()) EXPECT_EQ(cmp.undecided, 0) << c.describe();
  else EXPECT_LE(cmp.undecided, c.T / 6 + 1) << c.describe();
  return cmp;
}

RouterComparison run_and_check(const RouterCase& c, const RouterHostData& d, const MoeRouterTuning& tuning = {},
                               int64_t logits_offset = 0) {
  DeviceRouter dev(c, d, logits_offset);
  dev.args.tuning = tuning;
  Status st = dev.launch();
  EXPECT_TRUE(st.ok()) << c.describe() << ": " << st.message();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return check_outputs(c, d, dev.fetch(),
                       "path " + std::to_string(tuning.path) + (tuning.generic_layout ? " generic layout" : ""));
}

// One launch captured into a CUDA graph on a fresh non-blocking stream, for
// replays on new inputs.
struct CapturedLaunch {
  cudaStream_t stream = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  Status captured;
  explicit CapturedLaunch(DeviceRouter& dev) {
    EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    EXPECT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
    captured = dev.launch(stream);
    EXPECT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    EXPECT_TRUE(captured.ok()) << captured.message();
    EXPECT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  }
  void replay() {
    EXPECT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  }
  ~CapturedLaunch() {
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    if (stream) cudaStreamDestroy(stream);
  }
};

}  // namespace

// Every scoring x dtype x E x k; T, the bias, renormalisation, groups and the
// scale vary with the case's index so that each appears with every scoring.
TEST(MoeRouterGpu, MatchesTheReferenceOnRandomLogits) {
  SKIP_WITHOUT_GPU();
  Rng rng(test_seed());
  const int64_t kTs[] = {1, 7, 1000, 8192};
  int index = 0;
  for (MoeRouterScoring s : kScorings)
    for (DType dt : {DType::kBFloat16, DType::kFloat32})
      for (int E : {8, 64, 128, 256, 384, 512})
        for (int k : {1, 2, 4, 6, 8, 16}) {
          if (k > E) continue;
          RouterCase c;
          c.scoring = s;
          c.dtype = dt;
          c.E = E;
          c.k = k;
          c.T = kTs[index % 4];
          c.bias = index % 2 == 1;
          c.renormalize = (index / 2) % 2 == 1;
          c.scale = index % 3 == 0 ? 2.5f : 1.0f;
          if (index % 3 == 1 && E % 8 == 0 && 4 * (E / 8) >= k) {
            c.n_group = 8;
            c.topk_group = 4;
          }
          ++index;
          run_and_check(c, random_router_data(rng, c));
        }
}

TEST(MoeRouterGpu, ModelShapes) {
  SKIP_WITHOUT_GPU();
  Rng rng(test_seed());
  struct Shape {
    const char* name;
    MoeRouterScoring s;
    int E, k;
    bool renormalize, bias;
    int n_group, topk_group;
    float scale;
  };
  const Shape shapes[] = {
      {"deepseek_v3", MoeRouterScoring::kSigmoid, 256, 8, true, true, 8, 4, 2.5f},
      {"deepseek_v4", MoeRouterScoring::kSqrtSoftplus, 256, 6, true, true, 1, 1, 1.5f},
      {"deepseek_v4_384", MoeRouterScoring::kSqrtSoftplus, 384, 6, true, true, 1, 1, 1.5f},
      {"kimi_k2", MoeRouterScoring::kSigmoid, 384, 8, true, true, 1, 1, 2.827f},
      {"mixtral", MoeRouterScoring::kSoftmax, 8, 2, true, false, 1, 1, 1.0f},
      {"qwen3", MoeRouterScoring::kSoftmax, 128, 8, true, false, 1, 1, 1.0f},
      {"qwen3_next", MoeRouterScoring::kSoftmax, 512, 10, true, false, 1, 1, 1.0f},
      {"gpt_oss_120b", MoeRouterScoring::kSoftmaxAfterTopk, 128, 4, false, false, 1, 1, 1.0f},
      {"gpt_oss_20b", MoeRouterScoring::kSoftmaxAfterTopk, 32, 4, false, false, 1, 1, 1.0f},
      {"deepseek_v2_lite", MoeRouterScoring::kSoftmax, 64, 6, false, false, 1, 1, 1.0f},
      {"glm45", MoeRouterScoring::kSigmoid, 160, 8, true, true, 1, 1, 2.5f},
      {"deepseek_v2_groups", MoeRouterScoring::kSoftmax, 160, 6, false, false, 8, 3, 16.0f},
  };
  for (const Shape& sh : shapes)
    for (DType dt : {DType::kBFloat16, DType::kFloat32})
      for (int64_t T : {3, 8192}) {
        RouterCase c;
        c.scoring = sh.s;
        c.dtype = dt;
        c.T = T;
        c.E = sh.E;
        c.k = sh.k;
        c.renormalize = sh.renormalize;
        c.bias = sh.bias;
        c.n_group = sh.n_group;
        c.topk_group = sh.topk_group;
        c.scale = sh.scale;
        SCOPED_TRACE(sh.name);
        const RouterHostData d = random_router_data(rng, c);
        run_and_check(c, d);
        run_and_check(c, d, MoeRouterTuning{1, false});  // rounds only
      }
}

// Group layouts: whole lanes per group (registers), several groups per lane
// and groups that straddle lanes (shared memory), in the exact and general layouts.
TEST(MoeRouterGpu, GroupLayouts) {
  SKIP_WITHOUT_GPU();
  Rng rng(test_seed());
  struct G {
    int E, n_group, topk_group, k;
  };
  const G groups[] = {{256, 8, 4, 8}, {256, 16, 3, 8}, {256, 32, 4, 8}, {256, 64, 8, 8}, {256, 2, 1, 16},
                      {384, 8, 2, 8}, {384, 3, 1, 16}, {384, 12, 5, 6}, {512, 8, 4, 10}, {512, 32, 2, 16},
                      {128, 8, 4, 8}, {128, 4, 1, 4},  {64, 4, 2, 6},   {64, 16, 2, 4},  {64, 64, 8, 8},
                      {8, 4, 2, 2},   {8, 8, 3, 3},    {100, 5, 2, 6},  {96, 12, 4, 8},  {30, 10, 3, 3}};
  for (const G& g : groups)
    for (MoeRouterScoring s : kScorings)
      for (bool bias : {false, true}) {
        RouterCase c;
        c.scoring = s;
        c.dtype = DType::kBFloat16;
        c.T = 777;
        c.E = g.E;
        c.k = g.k;
        c.bias = bias;
        c.renormalize = true;
        c.n_group = g.n_group;
        c.topk_group = g.topk_group;
        const RouterHostData d = random_router_data(rng, c);
        run_and_check(c, d);
        run_and_check(c, d, MoeRouterTuning{1, true});  // general layout, rounds
      }
}

// Any E in 1..512 (the general layout), T not a multiple of a block's tokens.
TEST(MoeRouterGpu, AnyNumberOfExperts) {
  SKIP_WITHOUT_GPU();
  Rng rng(test_seed());
  for (int E : {1, 2, 3, 7, 31, 32, 33, 60, 100, 160, 255, 257, 500, 511})
    for (MoeRouterScoring s : kScorings) {
      RouterCase c;
      c.scoring = s;
      c.dtype = E % 2 ? DType::kFloat32 : DType::kBFloat16;
      c.T = 333;
      c.E = E;
      c.k = std::min(E, int(rng.integer(1, 16)));
      c.bias = E % 3 == 0;
      c.renormalize = E % 5 != 0;
      run_and_check(c, random_router_data(rng, c));
    }
}

// The paths (rounds, candidates) give the same bits; the general layout and
// a misaligned logits pointer give the reference's answer too. With groups
// and a bias (k <= 2 topk_group) the candidates' threshold is the kept
// groups' guess.
TEST(MoeRouterGpu, PathsAgreeBitwiseAndLayoutsMatchTheReference) {
  SKIP_WITHOUT_GPU();
  Rng rng(test_seed());
  for (int E : {8, 64, 128, 256, 384, 512, 100})
    for (MoeRouterScoring s : kScorings)
      for (bool groups : {false, true}) {
        RouterCase c;
        c.scoring = s;
        c.dtype = DType::kBFloat16;
        c.T = 2000;
        c.E = E;
        c.k = std::min(E, 8);
        c.bias = true;
        c.renormalize = true;
        if (groups) {
          if (E % 8 != 0 || E < 64) continue;
          c.n_group = 8;
          c.topk_group = 4;
        }
        const RouterHostData d = random_router_data(rng, c);
        Outputs first;
        for (int path : {0, 1, 2}) {
          DeviceRouter dev(c, d);
          dev.args.tuning.path = path;
          ASSERT_TRUE(dev.launch().ok());
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          const Outputs o = dev.fetch();
          if (path == 0) first = o;
          else EXPECT_TRUE(o == first) << c.describe() << ": path " << path << " differs from the automatic one";
        }
        check_outputs(c, d, first, "automatic");
        run_and_check(c, d, MoeRouterTuning{0, true});
        run_and_check(c, d, MoeRouterTuning{2, true});
        run_and_check(c, d, {}, 1);  // logits one element past a 16-byte boundary
      }
}

// Deliberate exact ties (logits and biases on a coarse grid, whole rows
// equal): ids must equal the reference's, lowest id first among equals. The
// candidate path overflows (more than 32 candidates) and falls back. The
// grid also makes sums equal only in exact arithmetic (groups {a + 0.25, b}
// and {a, b + 0.25}): near-ties, not ties (SPEC §8.5), which decided_tokens
// skips wherever the choice hinges on one, also past an exact tie at the
// boundary (E = 8, groups 2 of 4: 1 to 2% of the tokens on average, at
// most 38 of 500 over 10 seeds on the CPU; next to none elsewhere).
TEST(MoeRouterGpu, ExactTiesBreakByTheLowestId) {
  SKIP_WITHOUT_GPU();
  Rng rng(test_seed());
  for (int E : {8, 64, 256, 384, 512, 100})
    for (MoeRouterScoring s : kScorings)
      for (int k : {1, 8, 16}) {
        if (k > E) continue;
        for (int variant = 0; variant < 3; ++variant) {
          RouterCase c;
          c.scoring = s;
          c.dtype = variant == 1 ? DType::kFloat32 : DType::kBFloat16;
          c.T = 500;
          c.E = E;
          c.k = k;
          c.bias = variant != 0;
          c.renormalize = true;
          if (variant == 2 && E % 4 == 0 && 2 * (E / 4) >= k) {
            c.n_group = 4;
            c.topk_group = 2;
          }
          RouterHostData d = random_router_data(rng, c);
          // The 0.1 offset keeps x and -x off the grid together (sigmoid(x) +
          // sigmoid(-x) = 1 would tie group scores exactly only in exact arithmetic).
          for (int64_t i = 0; i < c.T * E; ++i) d.logits.set(i, double(rng.integer(-2, 2)) + 0.1);
          for (auto& b : d.bias) b = float(rng.integer(0, 1)) * 0.25f;
          for (int64_t t = 0; t < c.T; t += 7)  // whole rows equal
            for (int e = 0; e < E; ++e) d.logits.set(t * E + e, 1.0);
          for (int path : {1, 2}) run_and_check(c, d, MoeRouterTuning{path, false});
        }
      }
}

// SPEC §8.2: NaN as -inf, +inf as FLT_MAX, rows of nothing but -inf or NaN.
TEST(MoeRouterGpu, InfinitiesAndNaNs) {
  SKIP_WITHOUT_GPU();
  Rng rng(test_seed());
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  for (int E : {8, 64, 256, 100})
    for (MoeRouterScoring s : kScorings)
      for (DType dt : {DType::kBFloat16, DType::kFloat32})
        for (bool renormalize : {false, true}) {
          RouterCase c;
          c.scoring = s;
          c.dtype = dt;
          c.T = 400;
          c.E = E;
          c.k = std::min(E, 6);
          c.renormalize = renormalize;
          c.bias = renormalize;
          RouterHostData d = random_router_data(rng, c);
          for (int64_t t = 0; t < c.T; ++t) {
            const int kind = int(t % 8);
            for (int e = 0; e < E; ++e) {
              const int64_t i = t * E + e;
              if (kind == 0) d.logits.set(i, -inf);                             // all -inf
              else if (kind == 1) d.logits.set(i, nan);                         // all NaN
              else if (kind == 2 && rng.integer(0, 3) == 0) d.logits.set(i, -inf);
              else if (kind == 3 && rng.integer(0, 3) == 0) d.logits.set(i, nan);
              else if (kind == 4 && e == 3 % E) d.logits.set(i, inf);           // one +inf
              else if (kind == 5 && rng.integer(0, 1) == 0) d.logits.set(i, e % 2 ? -inf : nan);
            }
          }
          run_and_check(c, d);
          run_and_check(c, d, MoeRouterTuning{1, false});
        }
}

TEST(MoeRouterGpu, ZeroTokensLaunchesNothing) {
  SKIP_WITHOUT_GPU();
  RouterCase c;
  c.E = 256;
  c.k = 8;
  c.T = 0;
  RouterHostData d;
  d.logits = HostTensor(c.dtype, 0);
  DeviceRouter dev(c, d);
  ASSERT_TRUE(dev.launch().ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(all_poison(dev.fetch()));
  MoeRouterArgs a = dev.args;  // no buffers at all
  a.logits = nullptr;
  a.token_selected_experts = nullptr;
  a.token_final_scales = nullptr;
  EXPECT_TRUE(moe_router(a, nullptr).ok());
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(MoeRouterGpu, RepeatableAndTheSameWithoutPdl) {
  SKIP_WITHOUT_GPU();
  Rng rng(test_seed());
  for (MoeRouterScoring s : kScorings) {
    RouterCase c;
    c.scoring = s;
    c.T = 3000;
    c.E = 256;
    c.k = 8;
    c.bias = true;
    c.renormalize = true;
    c.n_group = 8;
    c.topk_group = 4;
    const RouterHostData d = random_router_data(rng, c);
    DeviceRouter dev(c, d);
    ASSERT_TRUE(dev.launch().ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const Outputs first = dev.fetch();
    for (int rep = 0; rep < 3; ++rep) {
      dev.poison();
      dev.args.enable_pdl = rep % 2 == 0;
      ASSERT_TRUE(dev.launch().ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_TRUE(dev.fetch() == first) << c.describe() << " rep " << rep;
    }
  }
}

TEST(MoeRouterGpu, CapturableInACudaGraphAndReplayedOnNewLogits) {
  SKIP_WITHOUT_GPU();
  Rng rng(test_seed());
  for (int E : {8, 256, 100}) {
    RouterCase c;
    c.scoring = MoeRouterScoring::kSigmoid;
    c.T = 1000;
    c.E = E;
    c.k = std::min(E, 8);
    c.bias = true;
    c.renormalize = true;
    c.scale = 2.5f;
    RouterHostData d = random_router_data(rng, c);
    DeviceRouter dev(c, d);
    CapturedLaunch g(dev);
    ASSERT_TRUE(g.captured.ok());
    for (int replay = 0; replay < 3; ++replay) {
      d = random_router_data(rng, c);
      d.bias.clear();  // the bias on the device stays the first one
      RouterHostData full = d;
      full.bias.resize(static_cast<size_t>(E));
      CUDA_OK(cudaMemcpy(full.bias.data(), dev.args.correction_bias, size_t(E) * 4, cudaMemcpyDeviceToHost));
      dev.upload_logits(d);
      dev.poison();
      g.replay();
      check_outputs(c, full, dev.fetch(), "graph replay " + std::to_string(replay));
    }
  }
}

// ---- hash selection (SPEC §8.7) ---------------------------------------------

namespace {

// A V4-style table [V, k] of distinct experts a row, with every 13th row
// holding an entry past E and every 17th a -1 (absent slots), every 11th a
// repeated expert; token ids uniform in [0, V) with every 29th outside it.
HashInputs random_hash_inputs(Rng& rng, int64_t T, int E, int k, int64_t V) {
  HashInputs h;
  h.V = V;
  h.table.resize(size_t(V * k));
  std::vector<int32_t> perm(static_cast<size_t>(E));
  for (int64_t v = 0; v < V; ++v) {
    std::iota(perm.begin(), perm.end(), 0);
    for (int j = 0; j < k; ++j) std::swap(perm[size_t(j)], perm[size_t(rng.integer(j, E - 1))]);
    for (int j = 0; j < k; ++j) h.table[size_t(v * k + j)] = perm[size_t(j)];
    if (v % 13 == 5) h.table[size_t(v * k + rng.integer(0, k - 1))] = E + int32_t(rng.integer(0, 3));
    if (v % 17 == 3) h.table[size_t(v * k + rng.integer(0, k - 1))] = -1;
    if (v % 11 == 7 && k > 1) h.table[size_t(v * k + k - 1)] = h.table[size_t(v * k)];
  }
  h.ids.resize(size_t(T));
  for (int64_t t = 0; t < T; ++t)
    h.ids[size_t(t)] = t % 29 == 4 ? (t % 2 ? V + rng.integer(0, 5) : -1 - rng.integer(0, 5)) : rng.integer(0, V - 1);
  return h;
}

struct DeviceHash {
  DeviceBuffer table, ids;
  int64_t V;
  bool int64_ids;
  DeviceHash(const HashInputs& h, bool int64_ids_) : table(h.table), V(h.V), int64_ids(int64_ids_) {
    if (int64_ids) {
      ids = DeviceBuffer(std::max<size_t>(8, h.ids.size() * 8));
      ids.upload(h.ids.data(), h.ids.size() * 8);
    } else {
      std::vector<int32_t> v32(h.ids.begin(), h.ids.end());
      ids = DeviceBuffer(std::max<size_t>(4, v32.size() * 4));
      ids.upload(v32.data(), v32.size() * 4);
    }
  }
  // The router's hash selection from these buffers.
  void attach(MoeRouterArgs& a) const {
    a.hash_table = table.as<int32_t>();
    a.vocab_size = V;
    a.token_ids = ids.get();
    a.token_ids_int64 = int64_ids;
  }
};

void check_hash(const RouterCase& c, const RouterHostData& d, const HashInputs& h, const Outputs& got,
                const std::string& what) {
  const std::vector<char> decided(size_t(c.T), 1);  // no choice to hinge on rounding: every token compared
  expect_matches(c, decided, got, reference(c, d, &h), what + " hash");
}

}  // namespace

// Every scoring x dtype x id width over model-like and odd shapes, with
// absent slots (entries outside [0, E), token ids outside [0, V)) and
// repeated experts; then bitwise repeatability with and without PDL, and a
// graph replayed on new logits and ids.
TEST(MoeRouterGpu, HashSelectionMatchesTheReference) {
  SKIP_WITHOUT_GPU();
  Rng rng(test_seed());
  struct Shape {
    int64_t T;
    int E, k;
    int64_t V;
  };
  const Shape shapes[] = {{1, 8, 2, 5}, {37, 256, 6, 1000}, {1000, 384, 6, 129280}, {4096, 100, 16, 77},
                          {333, 512, 1, 3}};
  int index = 0;
  for (MoeRouterScoring s : kScorings)
    for (DType dt : {DType::kBFloat16, DType::kFloat32})
      for (const Shape& sh : shapes) {
        RouterCase c;
        c.scoring = s;
        c.dtype = dt;
        c.T = sh.T;
        c.E = sh.E;
        c.k = sh.k;
        c.renormalize = index % 2 == 0;
        c.scale = index % 3 == 0 ? 1.5f : 1.0f;
        const bool int64_ids = index % 2 == 1;
        ++index;
        const RouterHostData d = random_router_data(rng, c, -8.0f, 8.0f);
        const HashInputs h = random_hash_inputs(rng, c.T, c.E, c.k, sh.V);
        DeviceRouter dev(c, d);
        DeviceHash dh(h, int64_ids);
        dh.attach(dev.args);
        Status st = dev.launch();
        ASSERT_TRUE(st.ok()) << c.describe() << ": " << st.message();
        CUDA_OK(cudaDeviceSynchronize());
        const Outputs first = dev.fetch();
        check_hash(c, d, h, first, int64_ids ? "int64 ids" : "int32 ids");
        dev.poison();
        dev.args.enable_pdl = !dev.args.enable_pdl;
        st = dev.launch();
        ASSERT_TRUE(st.ok()) << st.message();
        CUDA_OK(cudaDeviceSynchronize());
        EXPECT_TRUE(dev.fetch() == first) << c.describe() << ": not bitwise repeatable (PDL toggled)";
      }
}

TEST(MoeRouterGpu, HashSelectionCapturableAndReplayedOnNewIds) {
  SKIP_WITHOUT_GPU();
  Rng rng(test_seed());
  RouterCase c;
  c.scoring = MoeRouterScoring::kSqrtSoftplus;
  c.T = 500;
  c.E = 256;
  c.k = 6;
  c.renormalize = true;
  c.scale = 1.5f;
  RouterHostData d = random_router_data(rng, c);
  HashInputs h = random_hash_inputs(rng, c.T, c.E, c.k, 4096);
  DeviceRouter dev(c, d);
  DeviceHash dh(h, true);
  dh.attach(dev.args);
  CapturedLaunch g(dev);
  ASSERT_TRUE(g.captured.ok());
  for (int replay = 0; replay < 3; ++replay) {
    d = random_router_data(rng, c);
    const HashInputs fresh = random_hash_inputs(rng, c.T, c.E, c.k, h.V);
    h.ids = fresh.ids;  // the table on the device stays the first one
    dev.upload_logits(d);
    dh.ids.upload(h.ids.data(), h.ids.size() * 8);
    dev.poison();
    g.replay();
    check_hash(c, d, h, dev.fetch(), "graph replay " + std::to_string(replay));
  }
}

// ---- SPEC §8.6 on the GPU entry point: error, nothing launched or written ----

TEST(MoeRouterGpuErrors, BadInputNamesTheArgumentAndWritesNothing) {
  SKIP_WITHOUT_GPU();
  Rng rng(test_seed());
  RouterCase c;
  c.scoring = MoeRouterScoring::kSigmoid;
  c.T = 100;
  c.E = 256;
  c.k = 8;
  c.bias = true;
  const RouterHostData d = random_router_data(rng, c);
  struct Case {
    const char* name;
    void (*mutate)(MoeRouterArgs&);
    StatusCode code;
    const char* expect;
  };
  const StatusCode kBad = StatusCode::kInvalidArgument;
  const Case cases[] = {
      {"k > E", [](MoeRouterArgs& a) { a.num_experts = 4; }, kBad, "k: must be <= num_experts"},
      {"k = 17", [](MoeRouterArgs& a) { a.k = 17; }, kBad, "k: must be in 1..16"},
      {"n_group does not divide E", [](MoeRouterArgs& a) { a.n_group = 6; }, kBad, "n_group: must divide num_experts"},
      {"topk_group > n_group", [](MoeRouterArgs& a) { a.n_group = 8; a.topk_group = 9; }, kBad,
       "topk_group: must be in 1..n_group"},
      {"kept groups too small", [](MoeRouterArgs& a) { a.n_group = 64; a.topk_group = 1; }, kBad,
       "topk_group: topk_group * (num_experts / n_group) must be >= k"},
      {"bad dtype", [](MoeRouterArgs& a) { a.logits_dtype = static_cast<DType>(5); }, kBad,
       "logits_dtype: is not a valid DType"},
      {"fp16", [](MoeRouterArgs& a) { a.logits_dtype = DType::kFloat16; }, StatusCode::kNotSupported,
       "logits_dtype: fp16 logits are not supported"},
      {"E = 513", [](MoeRouterArgs& a) { a.num_experts = 513; }, StatusCode::kNotSupported, "num_experts"},
      {"bad scoring", [](MoeRouterArgs& a) { a.scoring = static_cast<MoeRouterScoring>(-1); }, kBad, "scoring"},
      {"null logits", [](MoeRouterArgs& a) { a.logits = nullptr; }, kBad, "logits: must not be null"},
      {"null ids", [](MoeRouterArgs& a) { a.token_selected_experts = nullptr; }, kBad,
       "token_selected_experts: must not be null"},
      {"null weights", [](MoeRouterArgs& a) { a.token_final_scales = nullptr; }, kBad,
       "token_final_scales: must not be null"},
      {"misaligned logits", [](MoeRouterArgs& a) { a.logits = static_cast<const char*>(a.logits) + 1; }, kBad,
       "logits: must be aligned to its element"},
      {"weights over the ids",
       [](MoeRouterArgs& a) { a.token_final_scales = reinterpret_cast<float*>(a.token_selected_experts) + 3; }, kBad,
       "token_final_scales: must not overlap token_selected_experts"},
      {"ids over the logits",
       [](MoeRouterArgs& a) { a.token_selected_experts = reinterpret_cast<int32_t*>(const_cast<void*>(a.logits)); },
       kBad, "token_selected_experts: must not overlap logits"},
      {"scale inf", [](MoeRouterArgs& a) { a.routed_scaling_factor = INFINITY; }, kBad,
       "routed_scaling_factor: must be finite"},
  };
  DeviceRouter dev(c, d);
  const std::vector<uint8_t> logits_before = [&] {
    std::vector<uint8_t> b(d.logits.bytes.size());
    dev.logits.download(b.data(), b.size());
    return b;
  }();
  for (const Case& x : cases) {
    MoeRouterArgs a = dev.args;
    x.mutate(a);
    dev.poison();
    const Status st = moe_router(a, nullptr);
    EXPECT_EQ(st.code(), x.code) << x.name << ": " << st.message();
    EXPECT_NE(st.message().find(std::string("moe_router: ") + x.expect), std::string::npos)
        << x.name << ": got \"" << st.message() << "\"";
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const Outputs o = dev.fetch();
    EXPECT_TRUE(all_poison(o)) << x.name << ": output written";
    std::vector<uint8_t> logits_after(logits_before.size());
    dev.logits.download(logits_after.data(), logits_after.size());
    EXPECT_EQ(logits_after, logits_before) << x.name << ": logits written";
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(MoeRouterGpuErrors, AStreamWithAnInvalidatedCaptureIsRejected) {
  SKIP_WITHOUT_GPU();
  Rng rng(test_seed());
  RouterCase c;
  c.T = 64;
  c.E = 64;
  c.k = 4;
  DeviceRouter dev(c, random_router_data(rng, c));
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  EXPECT_NE(cudaStreamSynchronize(stream), cudaSuccess);  // illegal while capturing: invalidates the capture
  (void)cudaGetLastError();
  const Status st = dev.launch(stream);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("moe_router: stream"), std::string::npos) << st.message();
  cudaGraph_t graph = nullptr;
  EXPECT_NE(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  if (graph) cudaGraphDestroy(graph);
  (void)cudaGetLastError();
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(all_poison(dev.fetch())) << "output written through an unusable stream";
  CUDA_OK(cudaStreamDestroy(stream));
}
