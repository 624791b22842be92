// finalize_moe_routing on the GPU against the CPU reference: every element,
// fresh random inputs, poisoned outputs, odd shapes, every dtype pair.
//
// Tolerance: both sides round once from an accurate sum (fp32 on the GPU,
// double in the reference), so they may differ by one unit in the last place
// of the output type plus the fp32 accumulation error:
//   |gpu - ref| <= ulp(out dtype) * |ref| + 1e-6 * (sum of |terms|)
// with ulp = 2^-7 (bf16), 2^-10 (fp16), 2^-23 (fp32).
#include <cmath>
#include <cstring>
#include <string>

#include "common/gpu_testing.h"
#include "common/test_data.h"
#include "flashmix/moe.h"

using namespace flashmix;
using namespace flashmix::testing;

namespace {

double ulp_of(DType t) {
  return t == DType::kBFloat16 ? std::ldexp(1.0, -7) : t == DType::kFloat16 ? std::ldexp(1.0, -10) : std::ldexp(1.0, -23);
}

struct Case {
  int64_t T = 33;
  int k = 4;
  int64_t H = 1000;
  int64_t rows_pad = 0;  // extra columns in rows and bias
  int64_t out_pad = 0;   // extra columns in out and shared_output
  int total_experts = 16, start = 0, local = 16;
  DType in = DType::kBFloat16, out = DType::kBFloat16;
  bool scales = true, bias = false, shared = false, fill = true;
  int extra_rows = 3;  // rows in the buffer no slot points at (filled with NaN)
  int lead = 0;        // NaN elements before the first row and the first bias row (pointers off the 16-byte grid)
  FinalizeTuning tuning;
};

// Host and device state of one case, and the reference result.
struct Problem {
  Case c;
  Routing routing;
  HostTensor rows, bias, shared, out_init, ref;
  std::vector<float> scales;
  std::vector<double> magnitude;  // per output element: sum of |terms|
  DeviceBuffer d_rows, d_bias, d_shared, d_out, d_u2p, d_experts, d_scales, d_p2u, d_offsets;
  FinalizeMoeRoutingArgs args;

  int64_t rows_stride() const { return c.H + c.rows_pad; }
  int64_t out_stride() const { return c.H + c.out_pad; }

  explicit Problem(const Case& cs, uint64_t salt = 0) : c(cs) {
    Rng rng(test_seed() ^ (salt * 0x9e3779b97f4a7c15ull));
    routing = random_routing(rng, c.T, c.k, c.total_experts, c.start, c.local);
    const int64_t num_rows = routing.P() + c.extra_rows;
    rows = HostTensor(c.in, num_rows * rows_stride());
    rows.fill_random(rng);
    // Rows no local slot points at hold NaN: they must never be read.
    for (int64_t r = routing.P(); r < num_rows; ++r)
      for (int64_t h = 0; h < rows_stride(); ++h) rows.set(r * rows_stride() + h, std::nan(""));
    // Non-local slots point at the first such row, or past the buffer when
    // there is none: garbage that must never be followed (memcheck sees it).
    for (auto& p : routing.u2p)
      if (p < 0) p = int32_t(routing.P());
    scales.resize(size_t(c.T * c.k));
    for (auto& s : scales) s = rng.uniform(0.05f, 1.0f);
    if (c.bias) { bias = HostTensor(c.in, int64_t(c.local) * rows_stride()); bias.fill_random(rng); }
    if (c.shared) { shared = HostTensor(c.out, c.T * out_stride()); shared.fill_random(rng); }
    out_init = HostTensor(c.out, c.T * out_stride());
    out_init.poison();

    args.expanded_permuted_rows = nullptr;
    args.rows_dtype = c.in;
    args.num_rows = num_rows;
    args.rows_stride = rows_stride();
    args.bias_stride = rows_stride();
    args.shared_stride = out_stride();
    args.out_dtype = c.out;
    args.out_stride = out_stride();
    args.num_tokens = c.T;
    args.hidden = c.H;
    args.k = c.k;
    args.start_expert_id = c.start;
    args.num_experts_per_node = c.local;
    args.fill = c.fill;
    args.tuning = c.tuning;

    // Reference on the host.
    ref = out_init;
    FinalizeMoeRoutingArgs h = args;
    h.expanded_permuted_rows = rows.data();
    h.unpermuted_row_to_permuted_row = routing.u2p.data();
    h.token_selected_experts = routing.experts.data();
    h.scales = c.scales ? scales.data() : nullptr;
    h.bias = c.bias ? bias.data() : nullptr;
    h.shared_output = c.shared ? shared.data() : nullptr;
    h.permuted_row_to_unpermuted_row = routing.p2u.data();
    h.expert_first_token_offset = routing.offsets.data();
    h.out = ref.data();
    Status st = finalize_moe_routing_cpu(h);
    EXPECT_TRUE(st.ok()) << st.message();
    magnitude.assign(size_t(c.T * c.H), 0.0);
    for (int64_t t = 0; t < c.T; ++t)
      for (int j = 0; j < c.k; ++j) {
        const int e = routing.experts[t * c.k + j];
        if (e < c.start || e >= c.start + c.local) continue;
        const int64_t r = routing.u2p[j * c.T + t];
        const double w = c.scales ? scales[t * c.k + j] : 1.0;
        for (int64_t x = 0; x < c.H; ++x) {
          double v = rows.get(r * rows_stride() + x) + (c.bias ? bias.get((e - c.start) * rows_stride() + x) : 0.0);
          magnitude[t * c.H + x] += std::fabs(w * v);
        }
      }

    // Device copies.
    d_rows = DeviceBuffer(with_lead(rows));
    d_u2p = DeviceBuffer(routing.u2p);
    d_experts = DeviceBuffer(routing.experts);
    d_scales = DeviceBuffer(scales);
    d_p2u = DeviceBuffer(routing.p2u.empty() ? std::vector<int32_t>{0} : routing.p2u);
    d_offsets = DeviceBuffer(routing.offsets);
    if (c.bias) d_bias = DeviceBuffer(with_lead(bias));
    if (c.shared) d_shared = DeviceBuffer(shared.bytes);
    d_out = DeviceBuffer(out_init.bytes);
    const size_t lead_bytes = size_t(c.lead) * dtype_size(c.in);
    args.expanded_permuted_rows = static_cast<char*>(d_rows.get()) + lead_bytes;
    args.unpermuted_row_to_permuted_row = d_u2p.as<int32_t>();
    args.token_selected_experts = d_experts.as<int32_t>();
    args.scales = c.scales ? d_scales.as<float>() : nullptr;
    args.bias = c.bias ? static_cast<char*>(d_bias.get()) + lead_bytes : nullptr;
    args.shared_output = c.shared ? d_shared.get() : nullptr;
    args.out = d_out.get();
    if (!c.fill) {
      args.permuted_row_to_unpermuted_row = d_p2u.as<int32_t>();
      args.expert_first_token_offset = d_offsets.as<int64_t>();
    }
    reset_output();
  }

  // The tensor's bytes after c.lead NaN elements; the buffer ends where the
  // tensor does, so memcheck sees any read past its last element.
  std::vector<uint8_t> with_lead(const HostTensor& t) const {
    HostTensor lead(t.dtype, c.lead);
    for (int64_t i = 0; i < c.lead; ++i) lead.set(i, std::nan(""));
    std::vector<uint8_t> b = lead.bytes;
    b.insert(b.end(), t.bytes.begin(), t.bytes.end());
    return b;
  }

  void reset_output() { d_out.upload(out_init.data(), out_init.bytes.size()); }

  HostTensor run(cudaStream_t stream = nullptr) {
    reset_output();
    Status st = finalize_moe_routing(args, stream);
    EXPECT_TRUE(st.ok()) << st.message();
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    HostTensor got(c.out, out_init.count());
    d_out.download(got.data(), got.bytes.size());
    return got;
  }

  // Every element: computed columns within tolerance, everything else as poisoned.
  void expect_matches(const HostTensor& got) const {
    int64_t bad = 0;
    for (int64_t t = 0; t < c.T; ++t)
      for (int64_t x = 0; x < out_stride(); ++x) {
        const int64_t i = t * out_stride() + x;
        const double g = got.get(i), r = ref.get(i);
        bool ok;
        if (x >= c.H || std::isnan(r)) {
          ok = std::memcmp(got.bytes.data() + i * dtype_size(c.out), ref.bytes.data() + i * dtype_size(c.out),
                           dtype_size(c.out)) == 0;
        } else {
          const double tol = ulp_of(c.out) * std::fabs(r) + 1e-6 * (magnitude[t * c.H + x] + 1.0);
          ok = std::isfinite(g) && std::fabs(g - r) <= tol;
        }
        if (!ok && ++bad <= 5)
          ADD_FAILURE() << "token " << t << " column " << x << ": gpu " << g << " ref " << r;
      }
    EXPECT_EQ(bad, 0) << "elements out of tolerance (T=" << c.T << " k=" << c.k << " H=" << c.H << ")";
  }
};

std::string describe(const Case& c) {
  return "T=" + std::to_string(c.T) + " k=" + std::to_string(c.k) + " H=" + std::to_string(c.H) + " in=" +
         to_string(c.in) + " out=" + to_string(c.out);
}

void check_case(const Case& c) {
  SCOPED_TRACE(describe(c));
  Problem p(c);
  p.expect_matches(p.run());
}

}  // namespace

TEST(FinalizeGpu, MatchesReferenceForEveryDtypePair) {
  SKIP_WITHOUT_GPU();
  for (DType in : {DType::kFloat32, DType::kFloat16, DType::kBFloat16})
    for (DType out : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
      Case c;
      c.in = in;
      c.out = out;
      c.bias = true;
      c.shared = true;
      check_case(c);
    }
}

TEST(FinalizeGpu, AnyHiddenSizeTheTailIsComputed) {
  SKIP_WITHOUT_GPU();
  for (int64_t H : {1, 3, 7, 8, 9, 13, 255, 1001, 4099, 7168})
    for (DType in : {DType::kBFloat16, DType::kFloat32}) {
      Case c;
      c.H = H;
      c.in = in;
      c.bias = H % 2;
      check_case(c);
    }
}

TEST(FinalizeGpu, PaddedRowsAndOutputStrideLeavePaddingUntouched) {
  SKIP_WITHOUT_GPU();
  for (int64_t H : {1000, 1003}) {
    Case c;
    c.H = H;
    c.rows_pad = 24;
    c.out_pad = 40;
    c.bias = true;
    c.shared = true;
    check_case(c);
  }
}

TEST(FinalizeGpu, KFrom1To16) {
  SKIP_WITHOUT_GPU();
  for (int k = 1; k <= 16; ++k) {
    Case c;
    c.k = k;
    c.total_experts = 32;
    c.local = 32;
    c.H = 520;
    c.bias = k % 3 == 0;
    check_case(c);
  }
}

TEST(FinalizeGpu, NoScaleWeighsEverySlotOne) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.scales = false;
  c.bias = true;
  check_case(c);
}

TEST(FinalizeGpu, ExpertParallelRangesFillTokensWithoutLocalSlots) {
  SKIP_WITHOUT_GPU();
  for (int start : {0, 8, 24}) {
    Case c;
    c.total_experts = 32;
    c.start = start;
    c.local = 8;
    c.k = 3;
    c.T = 200;
    c.shared = start == 8;
    c.bias = true;
    check_case(c);
  }
}

namespace {
// Rank [start, start + 32) of 256 experts, k = 8: many tokens without a local
// slot; shared_output at start 96, bias at 224.
Case ep_case(int start, bool fill) {
  Case c;
  c.total_experts = 256;
  c.start = start;
  c.local = 32;
  c.k = 8;
  c.T = 300;
  c.H = 1544;
  c.fill = fill;
  c.shared = start == 96;
  c.bias = start == 224;
  return c;
}
}  // namespace

TEST(FinalizeGpu, NoFillingLeavesTokensWithoutLocalSlotsUntouched) {
  SKIP_WITHOUT_GPU();
  // Untouched tokens keep the poison, checked bytewise.
  for (int start : {0, 96, 224}) check_case(ep_case(start, false));
}

namespace {
// T tokens with k = 8 of 64 experts, all local: the decode-sized grids.
Case decode_case(int64_t T, int64_t H) {
  Case c;
  c.T = T;
  c.k = 8;
  c.total_experts = 64;
  c.local = 64;
  c.H = H;
  return c;
}
}  // namespace

TEST(FinalizeGpu, OneTokenAndDecodeSizes) {
  SKIP_WITHOUT_GPU();
  for (int64_t T : {1, 2, 16, 64}) check_case(decode_case(T, 7168));
}

TEST(FinalizeGpu, ManyTokens) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.T = 4099;
  c.k = 2;
  c.H = 4096;
  c.total_experts = 8;
  c.local = 8;
  c.bias = true;
  check_case(c);
}

TEST(FinalizeGpu, ZeroTokensLaunchesNothing) {
  SKIP_WITHOUT_GPU();
  FinalizeMoeRoutingArgs a;
  a.num_tokens = 0;
  a.hidden = 4096;
  a.k = 8;
  a.num_experts_per_node = 32;
  EXPECT_TRUE(finalize_moe_routing(a, nullptr).ok());
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

TEST(FinalizeGpu, StridesOffThe16ByteGridAreHandled) {
  SKIP_WITHOUT_GPU();
  for (DType in : {DType::kBFloat16, DType::kFloat32}) {
    Case c;
    c.in = in;
    c.H = 999;  // odd stride: rows no longer 16-byte aligned
    c.bias = true;
    check_case(c);
    Case d = c;
    d.H = 1002;  // even stride, 4-byte but not 16-byte aligned rows (bf16)
    check_case(d);
  }
}

// Rows off the 16-byte grid (odd strides, pointers a few elements past a
// boundary) take 16-byte loads realigned across lanes: every kernel variant
// that reads rows (filling, no-filling, decode-sized, bias or not), and the
// last row ending where its buffer ends (memcheck: no read past it).
TEST(FinalizeGpu, RowsOffThe16ByteGridAreRealigned) {
  SKIP_WITHOUT_GPU();
  std::vector<Case> cases;
  for (DType in : {DType::kBFloat16, DType::kFloat16, DType::kFloat32})
    for (int lead : {0, 1, 3}) {
      Case c;
      c.in = in;
      c.H = 2003;
      c.lead = lead;
      c.extra_rows = 0;
      c.bias = lead != 1;
      cases.push_back(c);
    }
  for (int64_t T : {1, 16, 64}) {
    Case c = decode_case(T, 7003);
    c.lead = 5;
    c.bias = T == 16;
    cases.push_back(c);
  }
  {
    Case c;  // expert parallel, no filling, with the out rows aligned (padded)
    c.total_experts = 256;
    c.start = 96;
    c.local = 32;
    c.k = 8;
    c.T = 300;
    c.H = 1545;
    c.out_pad = 7;
    c.fill = false;
    c.extra_rows = 0;
    cases.push_back(c);
  }
  for (int64_t H : {8, 15, 16, 17, 31, 33, 63, 65, 250, 500})  // rows shorter than, or just past, one warp pass
    for (int lead : {1, 6}) {
      Case c;
      c.H = H;
      c.rows_pad = 1;
      c.lead = lead;
      c.bias = lead == 6;
      c.shared = true;
      cases.push_back(c);
    }
  for (const Case& c : cases) {
    SCOPED_TRACE("lead " + std::to_string(c.lead));
    check_case(c);
  }
}

// shared_output == out with the same stride (an in-place residual add) gives
// the same bytes as a separate shared_output buffer, on every path.
TEST(FinalizeGpu, SharedOutputMayBeOutInPlace) {
  SKIP_WITHOUT_GPU();
  for (int64_t H : {1000, 1003, 7168})
    for (DType out : {DType::kBFloat16, DType::kFloat32}) {
      Case c;
      c.H = H;
      c.out = out;
      c.k = 8;
      c.total_experts = 32;
      c.local = 32;
      c.shared = true;
      c.bias = H == 1000;
      c.out_pad = 8;
      SCOPED_TRACE(describe(c));
      Problem p(c);
      const HostTensor separate = p.run();
      p.expect_matches(separate);
      p.d_out.upload(p.shared.data(), p.shared.bytes.size());  // out starts as the residual
      FinalizeMoeRoutingArgs a = p.args;
      a.shared_output = p.d_out.get();
      Status st = finalize_moe_routing(a, nullptr);
      ASSERT_TRUE(st.ok()) << st.message();
      CUDA_OK(cudaDeviceSynchronize());
      HostTensor in_place(c.out, p.out_init.count());
      p.d_out.download(in_place.data(), in_place.bytes.size());
      // Columns past H keep the residual's padding; the H columns match bitwise.
      for (int64_t t = 0; t < c.T; ++t)
        ASSERT_EQ(std::memcmp(in_place.bytes.data() + t * p.out_stride() * dtype_size(c.out),
                              separate.bytes.data() + t * p.out_stride() * dtype_size(c.out), c.H * dtype_size(c.out)),
                  0)
            << "token " << t;
    }
}

// Token blocks (tuning.schedule 2) on every kind of case: within the
// tolerance of the reference and bitwise equal to the persistent warps
// (schedule 1), for each block size.
TEST(FinalizeGpu, TokenBlocksMatchTheReferenceAndThePersistentWarps) {
  SKIP_WITHOUT_GPU();
  std::vector<Case> cases;
  for (DType in : {DType::kFloat32, DType::kFloat16, DType::kBFloat16})
    for (DType out : {DType::kFloat32, DType::kBFloat16}) {
      Case c;
      c.in = in;
      c.out = out;
      c.bias = true;
      c.shared = true;
      cases.push_back(c);
    }
  for (int64_t H : {1, 7, 9, 255, 1001, 4099, 7168}) {
    Case c;
    c.H = H;
    c.bias = H % 2;
    c.out_pad = H == 1001 ? 8 : 0;
    c.rows_pad = H == 4099 ? 2 : 0;  // odd stride: rows off the grid take the realigned path
    cases.push_back(c);
  }
  for (int k : {1, 2, 5, 8, 16}) {
    Case c;
    c.k = k;
    c.total_experts = 32;
    c.local = 32;
    c.T = 65;
    c.H = 2056;
    c.scales = k != 5;
    cases.push_back(c);
  }
  for (bool fill : {true, false})
    for (int start : {0, 96, 224}) cases.push_back(ep_case(start, fill));
  cases.push_back(decode_case(1, 7168));
  const FinalizeTuning blocks[] = {{0, 0, 0, 2}, {32, 0, 0, 2}, {96, 0, 0, 2}, {256, 0, 0, 2}, {512, 0, 0, 2}};
  for (const Case& base : cases) {
    SCOPED_TRACE(describe(base));
    Case c = base;
    c.tuning.schedule = 1;
    Problem p(c);
    const HostTensor persistent = p.run();
    p.expect_matches(persistent);
    for (const FinalizeTuning& t : blocks) {
      SCOPED_TRACE("token blocks of " + std::to_string(t.threads_per_block) + " threads");
      p.args.tuning = t;
      const HostTensor got = p.run();
      p.expect_matches(got);
      EXPECT_EQ(got.bytes, persistent.bytes);
    }
  }
}

TEST(FinalizeGpu, NanInNonLocalSlotsNeverReachesTheOutput) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.total_experts = 64;
  c.start = 16;
  c.local = 16;
  c.k = 6;
  c.extra_rows = 8;  // all NaN; every non-local u2p entry points at one
  Problem p(c);
  HostTensor got = p.run();
  p.expect_matches(got);
  for (int64_t i = 0; i < got.count(); ++i) ASSERT_FALSE(std::isnan(got.get(i))) << "element " << i;
}

TEST(FinalizeGpu, BitwiseReproducibleAcrossRunsAndTunings) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.T = 257;
  c.k = 8;
  c.H = 2056;
  c.bias = true;
  c.shared = true;
  Problem p(c);
  const HostTensor first = p.run();
  p.expect_matches(first);
  const FinalizeTuning tunings[] = {{32, 1, 1}, {64, 2, 0}, {256, 2, 3},    {256, 1, 1},
                                   {64, 2, 5}, {128, 2, 9}, {128, 0, 0, 2}, {512, 0, 0, 2}};
  for (int rep = 0; rep < 3; ++rep) EXPECT_EQ(p.run().bytes, first.bytes) << "repeat " << rep;
  for (const FinalizeTuning& t : tunings) {
    p.args.tuning = t;
    EXPECT_EQ(p.run().bytes, first.bytes) << "threads " << t.threads_per_block << " vectors "
                                          << t.vectors_per_thread << " chunks " << t.chunks_per_token;
  }
  p.args.tuning = {};
  p.args.enable_pdl = false;
  EXPECT_EQ(p.run().bytes, first.bytes) << "without PDL";
}

TEST(FinalizeGpu, CapturableInACudaGraph) {
  SKIP_WITHOUT_GPU();
  for (bool fill : {true, false}) {
    Case c;
    c.fill = fill;
    c.total_experts = 64;
    c.start = 32;
    c.local = 16;
    c.k = 8;
    Problem p(c);
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    p.reset_output();
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < 3; ++i) {
      Status st = finalize_moe_routing(p.args, stream);
      EXPECT_TRUE(st.ok()) << st.message();
    }
    CUDA_OK(cudaStreamEndCapture(stream, &graph));
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    HostTensor got(c.out, p.out_init.count());
    p.d_out.download(got.data(), got.bytes.size());
    p.expect_matches(got);
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));
    CUDA_OK(cudaStreamDestroy(stream));
  }
}

// A stand-in for the FC2 GEMM ahead of the finalize: it lets its dependents
// launch at once, then takes `delay_ns` before it writes the rows and the
// shared_output (copies of src / src2). A finalize that read either before
// its grid dependency resolved would see the poison.
__global__ void slow_rows_writer(const uint8_t* src, uint8_t* dst, long long n, const uint8_t* src2, uint8_t* dst2,
                                 long long n2, long long delay_ns) {
  launch_dependents_then_wait_ns(delay_ns);
  auto copy = [](const uint8_t* a, uint8_t* b, long long bytes) {
    const long long vecs = bytes / 16;  // both buffers come from cudaMalloc: 16-byte aligned
    for (long long v = threadIdx.x; v < vecs; v += blockDim.x)
      reinterpret_cast<uint4*>(b)[v] = reinterpret_cast<const uint4*>(a)[v];
    for (long long i = vecs * 16 + threadIdx.x; i < bytes; i += blockDim.x) b[i] = a[i];
  };
  copy(src, dst, n);
  if (src2) copy(src2, dst2, n2);
}

// prefetch_indices: the routing indices are read before the grid dependency
// resolves, the rows and shared_output only after. Behind a kernel that
// writes those late (a PDL chain, direct and in a CUDA graph), the output is
// bitwise that of a launch without prefetching: decode sizes (the decode and
// the ring kernels), bias + shared_output, no-filling EP (its row count and
// map read early too), rows off the 16-byte grid.
TEST(FinalizeGpu, PrefetchIndicesReadsRowsAfterTheDependency) {
  SKIP_WITHOUT_GPU();
  std::vector<Case> cases;
  for (int64_t T : {1, 16, 64}) {
    Case c = decode_case(T, 7168);
    c.total_experts = c.local = 256;
    cases.push_back(c);
  }
  {
    Case c;
    c.T = 257;
    c.k = 8;
    c.H = 2056;
    c.bias = c.shared = true;
    cases.push_back(c);
  }
  {
    Case c;
    c.T = 300;
    c.k = 8;
    c.H = 1000;
    c.total_experts = 64;
    c.start = 32;
    c.local = 16;
    c.fill = false;
    c.shared = true;
    cases.push_back(c);
  }
  {
    Case c;
    c.T = 40;
    c.H = 1003;
    c.lead = 3;
    c.bias = true;
    cases.push_back(c);
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(describe(c) + (c.fill ? "" : " no-filling"));
    Problem p(c, 77);
    const HostTensor ref = p.run();
    p.expect_matches(ref);
    // What the writer puts in place: the rows buffer and shared_output as the problem holds them.
    const size_t rows_bytes = p.d_rows.bytes(), shared_bytes = c.shared ? p.d_shared.bytes() : 0;
    DeviceBuffer rows_src(rows_bytes), shared_src(shared_bytes ? shared_bytes : 16);
    CUDA_OK(cudaMemcpy(rows_src.get(), p.d_rows.get(), rows_bytes, cudaMemcpyDeviceToDevice));
    if (shared_bytes) CUDA_OK(cudaMemcpy(shared_src.get(), p.d_shared.get(), shared_bytes, cudaMemcpyDeviceToDevice));
    for (bool graph : {false, true})
      for (bool prefetch : {false, true}) {
        SCOPED_TRACE(std::string(graph ? "graph" : "direct") + (prefetch ? ", prefetch_indices" : ""));
        cudaStream_t stream;
        CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        p.reset_output();
        FinalizeMoeRoutingArgs a = p.args;
        a.prefetch_indices = prefetch;
        auto issue = [&] {
          // 0x7f bytes: a huge finite value in every dtype, so a row read early shows in the output.
          EXPECT_EQ(cudaMemsetAsync(p.d_rows.get(), 0x7f, rows_bytes, stream), cudaSuccess);
          if (shared_bytes) EXPECT_EQ(cudaMemsetAsync(p.d_shared.get(), 0x7f, shared_bytes, stream), cudaSuccess);
          // One block: the finalize's blocks find free SMs to start early.
          slow_rows_writer<<<1, 1024, 0, stream>>>(rows_src.as<uint8_t>(), p.d_rows.as<uint8_t>(), (long long)rows_bytes,
                                                   shared_bytes ? shared_src.as<uint8_t>() : nullptr,
                                                   p.d_shared.as<uint8_t>(), (long long)shared_bytes, 50000);
          EXPECT_EQ(cudaGetLastError(), cudaSuccess);
          Status st = finalize_moe_routing(a, stream);
          EXPECT_TRUE(st.ok()) << st.message();
        };
        run_direct_or_graph(stream, graph, issue, [&] { p.reset_output(); });
        CUDA_OK(cudaGetLastError());
        CUDA_OK(cudaStreamDestroy(stream));
        HostTensor got(c.out, p.out_init.count());
        p.d_out.download(got.data(), got.bytes.size());
        EXPECT_EQ(got.bytes, ref.bytes);
      }
  }
}

// spec §5 on the GPU entry point: the error names the argument, and the
// (poisoned) output is left exactly as it was: nothing was launched.
TEST(FinalizeGpuErrors, BadInputNamesTheArgumentAndWritesNothing) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.bias = true;
  Problem p(c);
  struct Bad {
    const char* argument;
    void (*mutate)(FinalizeMoeRoutingArgs&);
  };
  const Bad bad[] = {
      {"expanded_permuted_rows", [](FinalizeMoeRoutingArgs& a) { a.expanded_permuted_rows = nullptr; }},
      {"unpermuted_row_to_permuted_row", [](FinalizeMoeRoutingArgs& a) { a.unpermuted_row_to_permuted_row = nullptr; }},
      {"token_selected_experts", [](FinalizeMoeRoutingArgs& a) { a.token_selected_experts = nullptr; }},
      {"out", [](FinalizeMoeRoutingArgs& a) { a.out = nullptr; }},
      {"num_tokens", [](FinalizeMoeRoutingArgs& a) { a.num_tokens = -5; }},
      {"hidden", [](FinalizeMoeRoutingArgs& a) { a.hidden = 0; }},
      {"k", [](FinalizeMoeRoutingArgs& a) { a.k = 17; }},
      {"num_tokens", [](FinalizeMoeRoutingArgs& a) { a.num_tokens = int64_t(1) << 31; }},
      {"rows_stride", [](FinalizeMoeRoutingArgs& a) { a.rows_stride = a.hidden - 1; }},
      {"out_stride", [](FinalizeMoeRoutingArgs& a) { a.out_stride = 3; }},
      {"bias_stride", [](FinalizeMoeRoutingArgs& a) { a.bias_stride = 3; }},
      {"rows_dtype", [](FinalizeMoeRoutingArgs& a) { a.rows_dtype = static_cast<DType>(9); }},
      {"permuted_row_to_unpermuted_row", [](FinalizeMoeRoutingArgs& a) { a.fill = false; }},
  };
  for (const Bad& b : bad) {
    FinalizeMoeRoutingArgs a = p.args;
    b.mutate(a);
    p.reset_output();
    Status st = finalize_moe_routing(a, nullptr);
    EXPECT_FALSE(st.ok()) << b.argument;
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << b.argument;
    EXPECT_NE(st.message().find(b.argument), std::string::npos) << st.message();
    CUDA_OK(cudaDeviceSynchronize());
    HostTensor got(c.out, p.out_init.count());
    p.d_out.download(got.data(), got.bytes.size());
    EXPECT_EQ(got.bytes, p.out_init.bytes) << "output written after a rejected call (" << b.argument << ")";
  }
}

TEST(FinalizeGpuErrors, DebugIndexCheckFindsBadPermutationEntries) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.fill = false;
  Problem p(c);
  EXPECT_TRUE(debug_check_finalize_moe_routing_indices(p.args, nullptr).ok());
  // Point one local slot past the buffer.
  std::vector<int32_t> u2p = p.routing.u2p;
  for (int64_t i = 0; i < int64_t(u2p.size()); ++i) {
    const int64_t t = i % c.T, j = i / c.T;
    const int e = p.routing.experts[t * c.k + j];
    if (e >= c.start && e < c.start + c.local) {
      u2p[i] = int32_t(p.args.num_rows + 7);
      break;
    }
  }
  p.d_u2p.upload(u2p.data(), u2p.size() * sizeof(int32_t));
  Status st = debug_check_finalize_moe_routing_indices(p.args, nullptr);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("unpermuted_row_to_permuted_row"), std::string::npos) << st.message();
}

// spec §5 "a stream that is not usable": a stream whose graph capture an
// earlier illegal call invalidated gets an error naming the stream, and the
// output is left as it was.
TEST(FinalizeGpuErrors, AStreamWithAnInvalidatedCaptureIsRejected) {
  SKIP_WITHOUT_GPU();
  Case c;
  Problem p(c);
  p.reset_output();
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  EXPECT_NE(cudaStreamSynchronize(stream), cudaSuccess);  // illegal while capturing: invalidates the capture
  (void)cudaGetLastError();
  Status st = finalize_moe_routing(p.args, stream);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("stream"), std::string::npos) << st.message();
  cudaGraph_t graph = nullptr;
  EXPECT_NE(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  if (graph) cudaGraphDestroy(graph);
  (void)cudaGetLastError();
  CUDA_OK(cudaDeviceSynchronize());
  HostTensor got(c.out, p.out_init.count());
  p.d_out.download(got.data(), got.bytes.size());
  EXPECT_EQ(got.bytes, p.out_init.bytes) << "output written through an unusable stream";
  CUDA_OK(cudaStreamDestroy(stream));
}
