// build_moe_routing_maps on the GPU against the CPU reference (spec §1):
// random and unbalanced routings, expert-parallel ranges, both launch paths,
// the expansion with every access width, graphs, repeatability and spec §5.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/gpu_testing.h"
#include "common/test_data.h"
#include "common/host_dtype.h"
#include "flashmix/fp8.h"
#include "flashmix/moe.h"

using namespace flashmix;
using namespace flashmix::testing;

namespace {

constexpr int32_t kPoison32 = int32_t(0xDEADBEEF);
constexpr int64_t kPoison64 = int64_t(0x0DEADBEEFDEADBEEFll);
constexpr uint8_t kPoisonByte = 0xA5;

struct Shape {
  int64_t T;
  int k;
  int total;  // experts in the model
  int start;
  int local;
};

std::string describe(const Shape& s, int tuning) {
  return "T=" + std::to_string(s.T) + " k=" + std::to_string(s.k) + " experts " + std::to_string(s.start) + "+" +
         std::to_string(s.local) + "/" + std::to_string(s.total) + " single_block_max_slots=" + std::to_string(tuning);
}

struct Expansion {
  DType dtype = DType::kBFloat16;
  int64_t hidden = 0;  // 0: no expansion
  int64_t in_stride = 0, out_stride = 0;
  int64_t in_offset_bytes = 0, out_offset_bytes = 0;  // to misalign the pointers
};

// Host results of one call (buffers sized for P = k*T, poisoned before).
struct Result {
  std::vector<int64_t> offsets;
  std::vector<int32_t> p2u, u2p;
  std::vector<uint8_t> expanded;
  bool operator==(const Result& o) const {
    return offsets == o.offsets && p2u == o.p2u && u2p == o.u2p && expanded == o.expanded;
  }
};

// Device buffers for one problem, poisoned.
struct Problem {
  int64_t T;
  int k, start, local;
  Expansion ex;
  DeviceBuffer experts, offsets, p2u, u2p, input, expanded, workspace;
  MoeRoutingArgs args;

  Problem(const std::vector<int32_t>& host_experts, int64_t T_, int k_, int start_, int local_, int tuning,
          const Expansion& ex_, const std::vector<uint8_t>* host_input = nullptr)
      : T(T_), k(k_), start(start_), local(local_), ex(ex_),
        experts(std::max<size_t>(4, host_experts.size() * 4)),
        offsets(8 * size_t(local + 1)),
        p2u(std::max<size_t>(4, 4 * size_t(T * k))),
        u2p(std::max<size_t>(4, 4 * size_t(T * k))) {
    experts.upload(host_experts.data(), host_experts.size() * 4);
    args.token_selected_experts = experts.as<int32_t>();
    args.num_tokens = T;
    args.k = k;
    args.start_expert_id = start;
    args.num_experts_per_node = local;
    args.expert_first_token_offset = offsets.as<int64_t>();
    args.permuted_row_to_unpermuted_row = p2u.as<int32_t>();
    args.unpermuted_row_to_permuted_row = u2p.as<int32_t>();
    args.tuning.single_block_max_slots = tuning;
    if (ex.hidden > 0) {
      input = DeviceBuffer(input_bytes());
      expanded = DeviceBuffer(expanded_bytes());
      if (host_input) input.upload(host_input->data(), host_input->size());
      args.input = static_cast<char*>(input.get()) + ex.in_offset_bytes;
      args.permuted_input = static_cast<char*>(expanded.get()) + ex.out_offset_bytes;
      args.input_dtype = ex.dtype;
      args.hidden = ex.hidden;
      args.input_stride = ex.in_stride;
      args.permuted_input_stride = ex.out_stride;
    }
    workspace = DeviceBuffer(build_moe_routing_maps_workspace_size(args));
    poison();
  }
  size_t es() const { return dtype_size(ex.dtype); }
  size_t input_bytes() const {
    return ex.in_offset_bytes + size_t(T) * (ex.in_stride ? ex.in_stride : ex.hidden) * es() + 16;
  }
  size_t expanded_bytes() const {
    return ex.out_offset_bytes + size_t(T * k) * (ex.out_stride ? ex.out_stride : ex.hidden) * es() + 16;
  }
  void poison() {
    std::vector<int64_t> o(size_t(local + 1), kPoison64);
    offsets.upload(o.data(), o.size() * 8);
    std::vector<int32_t> m(p2u.bytes() / 4, kPoison32);
    p2u.upload(m.data(), m.size() * 4);
    u2p.upload(m.data(), m.size() * 4);
    if (ex.hidden > 0) {
      std::vector<uint8_t> b(expanded.bytes(), kPoisonByte);
      expanded.upload(b.data(), b.size());
    }
  }
  Status launch(cudaStream_t stream = nullptr) {
    return build_moe_routing_maps(args, workspace.get(), workspace.bytes(), stream);
  }
  Result fetch() const {
    Result r;
    r.offsets = offsets.to_host<int64_t>();
    r.p2u = p2u.to_host<int32_t>();
    r.u2p = u2p.to_host<int32_t>();
    if (ex.hidden > 0) r.expanded = expanded.to_host<uint8_t>();
    return r;
  }
};

// The CPU reference on the same inputs into identically poisoned host buffers.
Result reference(const std::vector<int32_t>& experts, const Problem& p, const std::vector<uint8_t>* input) {
  Result r;
  r.offsets.assign(size_t(p.local + 1), kPoison64);
  r.p2u.assign(p.p2u.bytes() / 4, kPoison32);
  r.u2p.assign(p.u2p.bytes() / 4, kPoison32);
  MoeRoutingArgs a = p.args;
  a.token_selected_experts = experts.data();
  a.expert_first_token_offset = r.offsets.data();
  a.permuted_row_to_unpermuted_row = r.p2u.data();
  a.unpermuted_row_to_permuted_row = r.u2p.data();
  if (p.ex.hidden > 0) {
    r.expanded.assign(p.expanded.bytes(), kPoisonByte);
    a.input = input->data() + p.ex.in_offset_bytes;
    a.permuted_input = r.expanded.data() + p.ex.out_offset_bytes;
  }
  Status st = build_moe_routing_maps_cpu(a);
  EXPECT_TRUE(st.ok()) << st.message();
  return r;
}

// Runs GPU and CPU on `experts`; compares everything, poison included.
void check_against_reference(const std::vector<int32_t>& experts, const Shape& s, int tuning,
                             const Expansion& ex = {}) {
  SCOPED_TRACE(describe(s, tuning));
  std::vector<uint8_t> input;
  if (ex.hidden > 0) {
    input.resize(ex.in_offset_bytes + size_t(s.T) * (ex.in_stride ? ex.in_stride : ex.hidden) * dtype_size(ex.dtype) + 16);
    Rng rng(test_seed() ^ 0x1234);
    for (auto& b : input) b = uint8_t(rng.integer(0, 255));
  }
  Problem p(experts, s.T, s.k, s.start, s.local, tuning, ex, ex.hidden > 0 ? &input : nullptr);
  Status st = p.launch();
  ASSERT_TRUE(st.ok()) << st.message();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  Result got = p.fetch();
  Result want = reference(experts, p, ex.hidden > 0 ? &input : nullptr);
  EXPECT_EQ(got.offsets, want.offsets);
  EXPECT_EQ(got.u2p, want.u2p);
  EXPECT_EQ(got.p2u, want.p2u);  // includes the untouched tail past P
  if (ex.hidden > 0) EXPECT_TRUE(got.expanded == want.expanded) << "expanded rows differ";
}

std::vector<int32_t> random_experts(Rng& rng, const Shape& s) {
  return random_routing(rng, s.T, s.k, s.total, s.start, s.local).experts;
}

const int kTunings[] = {0, -1, 8192};  // automatic, always multi-launch, single block where it fits

}  // namespace

TEST(MoeRoutingGpu, MatchesReferenceOnRandomRoutings) {
  SKIP_WITHOUT_GPU();
  Rng rng(test_seed());
  const Shape shapes[] = {
      {1, 1, 1, 0, 1},          {1, 16, 32, 0, 32},        {16, 8, 256, 0, 256},   {16, 8, 256, 96, 32},
      {512, 8, 256, 0, 256},    {1000, 6, 64, 10, 17},     {1024, 8, 8, 0, 8},     {8192, 8, 256, 0, 256},
      {8192, 8, 256, 96, 32},   {8192, 8, 128, 0, 128},    {4096, 2, 8, 0, 8},     {20000, 2, 1024, 0, 1024},
      {100000, 8, 256, 128, 64}, {3, 16, 5, 0, 5},         {7777, 3, 300, 7, 200},
  };
  for (const Shape& s : shapes)
    for (int tuning : kTunings) {
      if (tuning == 8192 && s.T * s.k > 8192) continue;
      check_against_reference(random_experts(rng, s), s, tuning);
    }
}

// Where the counts are small enough, each scatter block scans them itself
// (two launches; MoeRoutingPlan::scatter_scans): the shapes above take that
// path. FLASHMIX_ROUTING_SCAN_KERNEL=1 pins the three launches (a one-block
// scan between count and scatter), the same bits.
TEST(MoeRoutingGpu, ThreeLaunchesWithTheScanKernelToo) {
  SKIP_WITHOUT_GPU();
  Rng rng(test_seed());
  const Shape shapes[] = {
      {8192, 8, 256, 0, 256}, {8192, 8, 128, 0, 128}, {4096, 2, 8, 0, 8},
      {7777, 3, 300, 7, 200}, {100000, 8, 256, 128, 64}, {3000, 1, 1024, 0, 1024},
  };
  for (const char* pin : {"1", "0"}) {
    ASSERT_EQ(setenv("FLASHMIX_ROUTING_SCAN_KERNEL", pin, 1), 0);
    for (const Shape& s : shapes) check_against_reference(random_experts(rng, s), s, -1);
  }
  unsetenv("FLASHMIX_ROUTING_SCAN_KERNEL");
}

TEST(MoeRoutingGpu, KFrom1To16) {
  SKIP_WITHOUT_GPU();
  Rng rng(test_seed());
  for (int k = 1; k <= 16; ++k)
    for (int tuning : {0, -1}) {
      Shape s{777, k, 64, 16, 32};
      check_against_reference(random_experts(rng, s), s, tuning);
    }
}

TEST(MoeRoutingGpu, UnbalancedRoutings) {
  SKIP_WITHOUT_GPU();
  Rng rng(test_seed());
  for (int64_t T : {1, 16, 700, 9000})
    for (int tuning : {0, -1}) {
      const int k = 8;
      Shape s{T, k, 256, 96, 32};
      std::vector<int32_t> experts(size_t(T * k));
      // Every slot to one local expert (slot-major repeats, so k = 8 copies per token).
      for (auto& e : experts) e = 100;
      check_against_reference(experts, s, tuning);
      // Only experts 96 and 127 (first and last local) used: 30 empty experts.
      for (auto& e : experts) e = rng.integer(0, 1) ? 96 : 127;
      check_against_reference(experts, s, tuning);
      // Nothing local at all: P = 0.
      for (auto& e : experts) e = int32_t(rng.integer(0, 95));
      check_against_reference(experts, s, tuning);
      // Ids outside the model (trusted device data) are just not local.
      for (auto& e : experts) e = int32_t(rng.integer(0, 3)) == 0 ? -1 - int32_t(rng.integer(0, 5)) : 100000;
      experts[0] = 97;
      check_against_reference(experts, s, tuning);
    }
}

TEST(MoeRoutingGpu, ZeroTokensZeroesTheOffsetsAndWritesNothingElse) {
  SKIP_WITHOUT_GPU();
  Expansion ex;
  ex.hidden = 64;
  Problem p({}, 0, 4, 0, 8, 0, ex);
  Status st = p.launch();
  ASSERT_TRUE(st.ok()) << st.message();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  Result r = p.fetch();
  EXPECT_EQ(r.offsets, std::vector<int64_t>(9, 0));
  EXPECT_EQ(r.u2p, std::vector<int32_t>(1, kPoison32));
  for (uint8_t b : r.expanded) ASSERT_EQ(b, kPoisonByte);
}

TEST(MoeRoutingGpu, ExpansionWithEveryDtypeStrideAndAlignment) {
  SKIP_WITHOUT_GPU();
  Rng rng(test_seed());
  struct ExCase {
    DType dtype;
    int64_t hidden, in_stride, out_stride, in_off, out_off;
  };
  const ExCase cases[] = {
      {DType::kBFloat16, 7168, 0, 0, 0, 0},        // 16-byte words
      {DType::kFloat16, 2048, 2056, 2048, 0, 0},   // 16-byte words, padded input rows
      {DType::kFloat32, 1000, 1001, 1003, 0, 0},   // 4-byte words (odd strides)
      {DType::kBFloat16, 1024, 0, 0, 8, 0},        // 8-byte words (input pointer off by 8)
      {DType::kBFloat16, 1023, 0, 0, 0, 0},        // 2-byte words (odd row length)
      {DType::kBFloat16, 1023, 1024, 1032, 0, 0},  // 16-byte words + a 14-byte tail (padded rows)
      {DType::kFloat16, 7, 8, 8, 0, 0},            // the whole row is the tail
      {DType::kFloat32, 1001, 1004, 1004, 0, 0},   // 16-byte words + a 4-byte tail
      {DType::kFloat16, 64, 64, 64, 0, 2},         // 2-byte words (output pointer off by 2)
      {DType::kFloat32, 1, 0, 0, 0, 0},            // one element per row
  };
  for (const ExCase& c : cases)
    for (int64_t T : {1, 16, 1500})
      for (int tuning : {0, -1}) {
        Expansion ex{c.dtype, c.hidden, c.in_stride, c.out_stride, c.in_off, c.out_off};
        Shape s{T, 8, 64, 16, 32};
        SCOPED_TRACE("hidden " + std::to_string(c.hidden) + " dtype " + to_string(c.dtype));
        check_against_reference(random_experts(rng, s), s, tuning, ex);
      }
}

// The FP8 expansion (spec §1.4): every byte of the e4m3 rows and scales
// (poisoned buffers, rows past P and row padding included) against the CPU
// reference, which quantises through quantize_fp8_cpu; rows with outlier
// channels, zero blocks, a huge value, NaN and infinities; both scale formats,
// both launch paths, EP ranges (tokens with no local slot), padded strides.
TEST(MoeRoutingGpu, Fp8ExpansionMatchesQuantizeReferenceBitwise) {
  SKIP_WITHOUT_GPU();
  Rng rng(test_seed());
  struct Fp8Case {
    Shape s;
    int64_t hidden, in_stride, out_stride;
  };
  const Fp8Case cases[] = {
      {{1, 8, 64, 16, 32}, 7168, 0, 0},      // decode: one token, row split over blocks
      {{1500, 8, 64, 16, 32}, 7168, 0, 0},   // EP rank: a quarter of the experts
      {{700, 2, 8, 0, 8}, 1024, 1032, 1040},  // padded rows in and out
      {{3000, 4, 4, 0, 4}, 256, 0, 264},     // two blocks a row, more slots than one block takes
      {{0, 8, 64, 0, 64}, 512, 0, 0},        // no tokens: nothing but the offsets
  };
  for (const Fp8Case& c : cases)
    for (ScaleFormat f : {ScaleFormat::kFloat32, ScaleFormat::kUE8M0})
      for (int tuning : {0, -1}) {
        const Shape& s = c.s;
        SCOPED_TRACE(describe(s, tuning) + " hidden " + std::to_string(c.hidden) + " " + to_string(f));
        const int64_t in_stride = c.in_stride ? c.in_stride : c.hidden;
        const int64_t out_stride = c.out_stride ? c.out_stride : c.hidden;
        const int64_t slots = s.T * s.k, blocks = c.hidden / 128;
        const size_t sb = f == ScaleFormat::kUE8M0 ? 1 : 4;
        std::vector<int32_t> experts = random_experts(rng, s);
        // bf16 rows: uniform, every 61st channel 100 x; special blocks on some rows.
        std::vector<uint16_t> x(size_t(std::max<int64_t>(1, s.T * in_stride)), 0);
        for (int64_t t = 0; t < s.T; ++t)
          for (int64_t i = 0; i < c.hidden; ++i)
            x[size_t(t * in_stride + i)] =
                host::float_to_bf16(rng.uniform(-2.f, 2.f) * (i % 61 == 7 ? 100.f : 1.f));
        for (int64_t t = 0; t < s.T; t += 7) {
          const int64_t b = rng.integer(0, int(blocks) - 1), col = b * 128 + rng.integer(0, 127);
          switch ((t / 7) % 5) {
            case 0: for (int64_t i = 0; i < 128; ++i) x[size_t(t * in_stride + b * 128 + i)] = (i & 1) ? 0x8000 : 0; break;
            case 1: x[size_t(t * in_stride + col)] = host::float_to_bf16(-3.0e38f); break;
            case 2: x[size_t(t * in_stride + col)] = 0x7fc0; break;  // NaN
            case 3: x[size_t(t * in_stride + col)] = (t & 8) ? 0xff80 : 0x7f80; break;  // -inf / +inf
            default: break;
          }
        }
        DeviceBuffer d_experts(std::max<size_t>(4, experts.size() * 4)), d_off(8 * size_t(s.local + 1)),
            d_p2u(std::max<size_t>(4, 4 * size_t(slots))), d_u2p(std::max<size_t>(4, 4 * size_t(slots))),
            d_x(x.size() * 2), d_q(size_t(std::max<int64_t>(1, slots * out_stride))),
            d_s(size_t(std::max<int64_t>(1, slots * blocks)) * sb);
        d_experts.upload(experts.data(), experts.size() * 4);
        d_x.upload(x.data(), x.size() * 2);
        const std::vector<int32_t> map_poison(d_u2p.bytes() / 4, kPoison32);
        d_u2p.upload(map_poison.data(), d_u2p.bytes());
        d_p2u.upload(map_poison.data(), d_p2u.bytes());
        std::vector<uint8_t> q_poison(d_q.bytes(), kPoisonByte), s_poison(d_s.bytes(), kPoisonByte);
        d_q.upload(q_poison.data(), q_poison.size());
        d_s.upload(s_poison.data(), s_poison.size());
        MoeRoutingArgs a;
        a.token_selected_experts = d_experts.as<int32_t>();
        a.num_tokens = s.T;
        a.k = s.k;
        a.start_expert_id = s.start;
        a.num_experts_per_node = s.local;
        a.expert_first_token_offset = d_off.as<int64_t>();
        a.permuted_row_to_unpermuted_row = d_p2u.as<int32_t>();
        a.unpermuted_row_to_permuted_row = d_u2p.as<int32_t>();
        a.input = d_x.get();
        a.permuted_input = d_q.get();
        a.permuted_input_scales = d_s.get();
        a.permuted_scale_format = f;
        a.hidden = c.hidden;
        a.input_stride = c.in_stride;
        a.permuted_input_stride = c.out_stride;
        a.tuning.single_block_max_slots = tuning;
        DeviceBuffer ws(build_moe_routing_maps_workspace_size(a));
        Status st = build_moe_routing_maps(a, ws.get(), ws.bytes(), nullptr);
        ASSERT_TRUE(st.ok()) << st.message();
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

        std::vector<int64_t> off(size_t(s.local + 1));
        std::vector<int32_t> p2u(d_p2u.bytes() / 4, kPoison32), u2p(d_u2p.bytes() / 4, kPoison32);
        std::vector<uint8_t> q = q_poison, sc = s_poison;
        MoeRoutingArgs h = a;
        h.token_selected_experts = experts.data();
        h.expert_first_token_offset = off.data();
        h.permuted_row_to_unpermuted_row = p2u.data();
        h.unpermuted_row_to_permuted_row = u2p.data();
        h.input = x.data();
        h.permuted_input = q.data();
        h.permuted_input_scales = sc.data();
        st = build_moe_routing_maps_cpu(h);
        ASSERT_TRUE(st.ok()) << st.message();
        EXPECT_EQ(d_off.to_host<int64_t>(), off);
        EXPECT_EQ(d_u2p.to_host<int32_t>(), u2p);
        EXPECT_EQ(d_p2u.to_host<int32_t>(), p2u);  // the tail past P untouched (poison) on both
        const std::vector<uint8_t> got_q = d_q.to_host<uint8_t>(), got_s = d_s.to_host<uint8_t>();
        size_t bad_q = 0, bad_s = 0;
        for (size_t i = 0; i < q.size(); ++i) bad_q += got_q[i] != q[i];
        for (size_t i = 0; i < sc.size(); ++i) bad_s += got_s[i] != sc[i];
        EXPECT_EQ(bad_q, 0u) << "e4m3 bytes differ";
        EXPECT_EQ(bad_s, 0u) << "scale bytes differ";
        if (s.T >= 100) {  // the check sees live rows: some slots are local
          EXPECT_GT(off.back(), 0);
        }
      }
}

TEST(MoeRoutingGpu, BitwiseRepeatableAcrossRunsAndPaths) {
  SKIP_WITHOUT_GPU();
  Rng rng(test_seed());
  Shape s{4000, 2, 16, 0, 16};  // k*T = 8000: both paths apply
  std::vector<int32_t> experts = random_experts(rng, s);
  Expansion ex;
  ex.hidden = 256;
  std::vector<uint8_t> input(size_t(s.T) * 256 * 2 + 16, 0x3c);
  Result first;
  for (int tuning : {0, -1, 8192})
    for (int rep = 0; rep < 3; ++rep) {
      Problem p(experts, s.T, s.k, s.start, s.local, tuning, ex, &input);
      ASSERT_TRUE(p.launch().ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      Result r = p.fetch();
      if (tuning == 0 && rep == 0) first = r;
      else EXPECT_TRUE(r == first) << "tuning " << tuning << " rep " << rep;
    }
}

TEST(MoeRoutingGpu, CapturableInACudaGraphAndReplayedOnNewRoutings) {
  SKIP_WITHOUT_GPU();
  Rng rng(test_seed());
  for (Shape s : {Shape{16, 8, 256, 96, 32}, Shape{8192, 8, 256, 0, 256}}) {
    Expansion ex;
    ex.hidden = 512;
    std::vector<uint8_t> input(size_t(s.T) * 512 * 2 + 16);
    for (auto& b : input) b = uint8_t(rng.integer(0, 255));
    std::vector<int32_t> experts = random_experts(rng, s);
    Problem p(experts, s.T, s.k, s.start, s.local, 0, ex, &input);
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    Status st = p.launch(stream);
    CUDA_OK(cudaStreamEndCapture(stream, &graph));
    ASSERT_TRUE(st.ok()) << st.message();
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < 3; ++replay) {
      // New routing written in place: the graph reads it on the device.
      experts = random_experts(rng, s);
      p.experts.upload(experts.data(), experts.size() * 4);
      p.poison();
      CUDA_OK(cudaGraphLaunch(exec, stream));
      CUDA_OK(cudaStreamSynchronize(stream));
      Result got = p.fetch();
      Result want = reference(experts, p, &input);
      EXPECT_TRUE(got == want) << "replay " << replay << " T=" << s.T;
    }
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));
    CUDA_OK(cudaStreamDestroy(stream));
  }
}

TEST(MoeRoutingGpu, WithoutPdlGivesTheSameResult) {
  SKIP_WITHOUT_GPU();
  Rng rng(test_seed());
  Shape s{3000, 8, 256, 0, 256};
  std::vector<int32_t> experts = random_experts(rng, s);
  Problem a(experts, s.T, s.k, s.start, s.local, 0, {});
  Problem b(experts, s.T, s.k, s.start, s.local, 0, {});
  b.args.enable_pdl = false;
  ASSERT_TRUE(a.launch().ok());
  ASSERT_TRUE(b.launch().ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(a.fetch() == b.fetch());
}

// ---- spec §5 on the GPU entry point: error, nothing launched or written ---

TEST(MoeRoutingGpuErrors, BadInputNamesTheArgumentAndWritesNothing) {
  SKIP_WITHOUT_GPU();
  Rng rng(test_seed());
  Shape s{5000, 8, 256, 0, 256};  // multi-launch path: needs a workspace
  std::vector<int32_t> experts = random_experts(rng, s);
  Expansion ex;
  ex.hidden = 128;
  struct Case {
    const char* name;
    void (*mutate)(Problem&, void*&, size_t&);
    const char* expect;
  };
  const Case cases[] = {
      {"k = 17", [](Problem& p, void*&, size_t&) { p.args.k = 17; }, "k: must be in 1..16"},
      {"null experts", [](Problem& p, void*&, size_t&) { p.args.token_selected_experts = nullptr; },
       "token_selected_experts: must not be null"},
      {"null u2p", [](Problem& p, void*&, size_t&) { p.args.unpermuted_row_to_permuted_row = nullptr; },
       "unpermuted_row_to_permuted_row: must not be null"},
      {"stride < hidden", [](Problem& p, void*&, size_t&) { p.args.input_stride = 100; },
       "input_stride: must be 0 or >= hidden"},
      {"workspace too small", [](Problem&, void*&, size_t& bytes) { bytes -= 1; }, "workspace_bytes: must be >= "},
      {"null workspace", [](Problem&, void*& ws, size_t&) { ws = nullptr; }, "workspace: must not be null"},
  };
  for (const Case& c : cases) {
    Problem p(experts, s.T, s.k, s.start, s.local, 0, ex);
    void* ws = p.workspace.get();
    size_t bytes = p.workspace.bytes();
    ASSERT_GT(bytes, 0u);
    c.mutate(p, ws, bytes);
    Status st = build_moe_routing_maps(p.args, ws, bytes, nullptr);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << c.name;
    EXPECT_NE(st.message().find(std::string("build_moe_routing_maps: ") + c.expect), std::string::npos)
        << c.name << ": got \"" << st.message() << "\"";
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    Result r = p.fetch();
    EXPECT_EQ(r.offsets, std::vector<int64_t>(size_t(s.local + 1), kPoison64)) << c.name;
    for (int32_t v : r.u2p) ASSERT_EQ(v, kPoison32) << c.name;
    for (int32_t v : r.p2u) ASSERT_EQ(v, kPoison32) << c.name;
    for (uint8_t b : r.expanded) ASSERT_EQ(b, kPoisonByte) << c.name;
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}
