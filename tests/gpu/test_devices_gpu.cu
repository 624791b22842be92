// Every GPU op on two devices in one process and from two host threads at
// once, and the CUDA error state every call leaves behind (docs/spec.md,
// "General contract": per-device state, no CUDA error left set).
//
// Per-device facts (function attributes, occupancy) are kept per device; a
// cache of them that ignored the device once made mhc_pre fail on the
// second GPU of a process. These tests run every op on each device, each
// device's first call of a kernel after the other device's, and compare the
// outputs across devices bitwise (the devices of one machine are one model;
// the modes compared are bitwise reproducible). Their correctness against
// the reference is the single-GPU suites' job.
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "common/gpu_testing.h"
#include "common/test_data.h"
#include "flashmix/mhc.h"
#include "flashmix/moe.h"

namespace flashmix {
namespace {

using testing::DeviceBuffer;
using testing::HostTensor;
using testing::Rng;

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

#define SKIP_WITHOUT_TWO_GPUS()                                                              \
  do {                                                                                       \
    if (device_count() < 2) GTEST_SKIP() << "needs two CUDA GPUs (found " << device_count() << ")"; \
  } while (0)

// The outputs of one round of every op, by name, as bytes.
using Outputs = std::map<std::string, std::vector<uint8_t>>;

// Host inputs for one round; `variant` picks shapes and dtypes so that two
// rounds of different variants use different kernel instantiations (each
// one's first launch on a device is then a fresh "first call").
struct Inputs {
  // MoE: T tokens, top k of 64 experts, 32 local from expert 16.
  int64_t T = 0, H = 0, I = 0;
  int k = 8, start = 16, local = 32;
  testing::Routing routing;
  HostTensor x, rows, scales, bias, A, W2;
  // mHC: the cluster-tile shape (n, B, C) that once failed on the second
  // GPU, the resident kernel's shape, a split (workspace) shape.
  int n_tiles = 6;
  int64_t b_tiles = 300, c_tiles = 1024;
  int64_t b_res = 40, c_res = 4096;
  int n_split = 4;
  int64_t b_split = 16, c_split = 2048;
  DType phi_dtype = DType::kFloat32;
  uint64_t mhc_seed = 0;

  explicit Inputs(int variant) {
    Rng rng(testing::test_seed() + 7919 * variant);
    mhc_seed = testing::test_seed() + 31 * variant + 1;
    struct Shape { int64_t T, H, I; int k, n_tiles, n_split; DType phi; };
    constexpr Shape kShapes[3] = {{300, 1024, 256, 8, 6, 4, DType::kFloat32},
                                  {97, 512, 136, 6, 3, 8, DType::kBFloat16},
                                  {150, 768, 200, 4, 5, 6, DType::kFloat32}};
    const Shape& sh = kShapes[variant];
    T = sh.T; H = sh.H; I = sh.I; k = sh.k;
    n_tiles = sh.n_tiles; n_split = sh.n_split; phi_dtype = sh.phi;
    routing = testing::random_routing(rng, T, k, 64, start, local);
    x = HostTensor(DType::kBFloat16, T * H);
    x.fill_random(rng);
    rows = HostTensor(DType::kBFloat16, int64_t(k) * T * H);
    rows.fill_random(rng);
    scales = HostTensor(DType::kFloat32, T * k);
    scales.fill_random(rng, 0.0f, 1.0f);
    bias = HostTensor(DType::kBFloat16, int64_t(local) * H);
    bias.fill_random(rng);
    A = HostTensor(DType::kBFloat16, int64_t(k) * T * I);
    A.fill_random(rng);
    W2 = HostTensor(DType::kBFloat16, int64_t(local) * H * I);
    W2.fill_random(rng, -0.1f, 0.1f);
  }
};

template <typename T>
std::vector<uint8_t> bytes_of(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  if (!v.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

DeviceBuffer upload(const HostTensor& t) {
  DeviceBuffer b(t.bytes.size());
  b.upload(t.data(), t.bytes.size());
  return b;
}

DeviceBuffer poisoned(size_t bytes) { return testing::poisoned_buffer(bytes, 0xff); }  // NaN in every float type

// Records the status and checks that the call left no CUDA error set.
#define EXPECT_OP_OK(expr)                                                             \
  do {                                                                                 \
    const ::flashmix::Status st_ = (expr);                                             \
    EXPECT_TRUE(st_.ok()) << #expr << ": " << st_.message();                           \
    EXPECT_EQ(cudaGetLastError(), cudaSuccess) << #expr << " left a CUDA error set";   \
  } while (0)

// One round of every GPU op on the current device, on a stream of its own.
Outputs run_every_op(const Inputs& in) {
  Outputs out;
  cudaStream_t stream = nullptr;
  EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const testing::Routing& r = in.routing;
  const int64_t slots = in.T * in.k, P = r.P();
  DeviceBuffer experts(r.experts), u2p(r.u2p), p2u(r.p2u), offsets(r.offsets);
  DeviceBuffer x = upload(in.x), rows = upload(in.rows), scales = upload(in.scales), bias = upload(in.bias);

  // build_moe_routing_maps, with the permuted input, on its one-block and its multi-block path.
  for (int single_block_max : {0, 1}) {
    MoeRoutingArgs a;
    a.token_selected_experts = experts.as<int32_t>();
    a.num_tokens = in.T;
    a.k = in.k;
    a.start_expert_id = in.start;
    a.num_experts_per_node = in.local;
    DeviceBuffer off = poisoned((in.local + 1) * 8), pu = poisoned(slots * 4), up = poisoned(slots * 4),
                 px = poisoned(slots * in.H * 2);
    a.expert_first_token_offset = off.as<int64_t>();
    a.permuted_row_to_unpermuted_row = pu.as<int32_t>();
    a.unpermuted_row_to_permuted_row = up.as<int32_t>();
    a.input = x.get();
    a.permuted_input = px.get();
    a.hidden = in.H;
    a.tuning.single_block_max_slots = single_block_max;
    DeviceBuffer ws(std::max<size_t>(build_moe_routing_maps_workspace_size(a), 1));
    EXPECT_OP_OK(build_moe_routing_maps(a, ws.get(), ws.bytes(), stream));
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const std::string tag = "routing" + std::to_string(single_block_max);
    out[tag + ".offsets"] = bytes_of(off.to_host<int64_t>());
    std::vector<int32_t> pu_h = pu.to_host<int32_t>();
    pu_h.resize(size_t(P));
    out[tag + ".p2u"] = bytes_of(pu_h);
    out[tag + ".u2p"] = bytes_of(up.to_host<int32_t>());
    std::vector<uint16_t> px_h = px.to_host<uint16_t>();
    px_h.resize(size_t(P * in.H));
    out[tag + ".permuted_input"] = bytes_of(px_h);
  }

  // finalize_moe_routing: filling with bias into bf16, no-filling into fp32.
  for (bool fill : {true, false}) {
    FinalizeMoeRoutingArgs a;
    a.expanded_permuted_rows = rows.get();
    a.num_rows = slots;
    a.unpermuted_row_to_permuted_row = u2p.as<int32_t>();
    a.token_selected_experts = experts.as<int32_t>();
    a.scales = scales.as<float>();
    a.bias = fill ? bias.get() : nullptr;
    a.out_dtype = fill ? DType::kBFloat16 : DType::kFloat32;
    DeviceBuffer o = poisoned(in.T * in.H * dtype_size(a.out_dtype));
    a.out = o.get();
    a.num_tokens = in.T; a.hidden = in.H; a.k = in.k;
    a.start_expert_id = in.start; a.num_experts_per_node = in.local;
    a.fill = fill;
    a.permuted_row_to_unpermuted_row = p2u.as<int32_t>();
    a.expert_first_token_offset = offsets.as<int64_t>();
    EXPECT_OP_OK(finalize_moe_routing(a, stream));
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    out[fill ? "finalize.fill" : "finalize.nofill"] = bytes_of(o.to_host<uint8_t>());
  }

  // moe_fc2_finalize in its bitwise-reproducible modes, and atomic / atomic_fp32
  // (run and checked against deterministic with a tolerance below).
  {
    DeviceBuffer A = upload(in.A), W2 = upload(in.W2);
    for (Fc2Mode mode : {Fc2Mode::kDeterministic, Fc2Mode::kUnfused, Fc2Mode::kAtomic, Fc2Mode::kAtomicFp32}) {
      Fc2FinalizeArgs a;
      a.A = A.get();
      a.W2 = W2.get();
      a.expert_first_token_offset = offsets.as<int64_t>();
      a.permuted_row_to_unpermuted_row = p2u.as<int32_t>();
      a.scales = scales.as<float>();
      a.bias = bias.get();
      a.num_tokens = in.T; a.k = in.k; a.hidden = in.H; a.inter = in.I; a.num_experts_per_node = in.local;
      DeviceBuffer o = poisoned(in.T * in.H * 2);
      a.out = o.get();
      a.mode = mode;
      DeviceBuffer ws(std::max<size_t>(moe_fc2_finalize_workspace_size(a), 256));
      EXPECT_OP_OK(moe_fc2_finalize(a, ws.get(), ws.bytes(), stream));
      EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      out[std::string("fc2.") + testing::fc2_mode_name(mode)] = bytes_of(o.to_host<uint8_t>());
    }
  }

  // mHC: mhc_pre on each projection kernel, then every other op.
  Rng rng(in.mhc_seed);
  auto pre = [&](const char* name, int n, int64_t B, int64_t C, MhcPreKernel kernel, bool workspace) {
    const int N = mhc_num_coefficients(n);
    HostTensor xh(DType::kBFloat16, B * n * C), phi(in.phi_dtype, int64_t(N) * n * C), alpha(DType::kFloat32, 3),
        b(DType::kFloat32, N);
    xh.fill_random(rng);
    phi.fill_random(rng, -0.05f, 0.05f);
    alpha.fill_random(rng, 0.5f, 1.5f);
    b.fill_random(rng, -0.5f, 0.5f);
    DeviceBuffer dx = upload(xh), dphi = upload(phi), dalpha = upload(alpha), dbias = upload(b);
    DeviceBuffer f = poisoned(B * C * 2), hp = poisoned(B * n * 4), hr = poisoned(B * n * n * 4);
    MhcPreArgs a;
    a.shape = {B, n, C};
    a.x = dx.get();
    a.phi = dphi.get();
    a.phi_dtype = in.phi_dtype;
    a.alpha = dalpha.as<float>();
    a.bias = dbias.as<float>();
    a.f_pre = f.get();
    a.h_post = hp.as<float>();
    a.h_res = hr.as<float>();
    a.kernel = kernel;
    DeviceBuffer ws;
    if (workspace) {
      ws = DeviceBuffer(mhc_workspace_bytes(a.shape));
      EXPECT_EQ(cudaMemset(ws.get(), 0, ws.bytes()), cudaSuccess);
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the legacy stream's memset, before `stream`
      a.workspace = ws.get();
      a.workspace_bytes = ws.bytes();
    }
    EXPECT_OP_OK(mhc_pre(a, stream));
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    out[std::string(name) + ".f_pre"] = bytes_of(f.to_host<uint8_t>());
    out[std::string(name) + ".h_post"] = bytes_of(hp.to_host<uint8_t>());
    out[std::string(name) + ".h_res"] = bytes_of(hr.to_host<uint8_t>());

    // The other ops on the same inputs (the resident shape's run only: once per round).
    if (kernel != MhcPreKernel::kResident) return;
    MhcProjectArgs pa;
    pa.shape = a.shape;
    pa.x = a.x; pa.phi = a.phi; pa.phi_dtype = a.phi_dtype; pa.alpha = a.alpha; pa.bias = a.bias;
    DeviceBuffer h = poisoned(B * N * 4), rr = poisoned(B * 4);
    pa.h = h.as<float>();
    pa.r = rr.as<float>();
    EXPECT_OP_OK(mhc_project(pa, stream));
    MhcActivateArgs aa;
    aa.shape = a.shape;
    DeviceBuffer hpre = poisoned(B * n * 4), hpost = poisoned(B * n * 4), hres = poisoned(B * n * n * 4);
    aa.h = h.as<float>(); aa.h_pre = hpre.as<float>(); aa.h_post = hpost.as<float>(); aa.h_res = hres.as<float>();
    EXPECT_OP_OK(mhc_activate(aa, stream));
    MhcPreMixArgs ma;
    ma.shape = a.shape;
    DeviceBuffer fm = poisoned(B * C * 2);
    ma.x = a.x; ma.h_pre = hpre.as<float>(); ma.f_pre = fm.get();
    EXPECT_OP_OK(mhc_pre_mix(ma, stream));
    MhcPostArgs po;
    po.shape = a.shape;
    DeviceBuffer xn = poisoned(B * n * C * 2);
    po.x = a.x; po.f_out = f.get(); po.h_post = hp.as<float>(); po.h_res = hr.as<float>(); po.x_next = xn.get();
    EXPECT_OP_OK(mhc_post(po, stream));
    MhcHeadArgs ha;
    ha.shape = a.shape;
    DeviceBuffer ho = poisoned(B * C * 2);
    ha.x = a.x; ha.phi = a.phi; ha.phi_dtype = a.phi_dtype; ha.alpha = a.alpha; ha.bias = a.bias; ha.out = ho.get();
    EXPECT_OP_OK(mhc_head(ha, stream));
    MhcExpandArgs ea;
    ea.shape = a.shape;
    DeviceBuffer ex = poisoned(B * n * C * 2);
    ea.embedding = f.get();
    ea.x = ex.get();
    EXPECT_OP_OK(mhc_expand(ea, stream));
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    out["mhc_project.h"] = bytes_of(h.to_host<uint8_t>());
    out["mhc_project.r"] = bytes_of(rr.to_host<uint8_t>());
    out["mhc_activate.h_res"] = bytes_of(hres.to_host<uint8_t>());
    out["mhc_pre_mix"] = bytes_of(fm.to_host<uint8_t>());
    out["mhc_post"] = bytes_of(xn.to_host<uint8_t>());
    out["mhc_head"] = bytes_of(ho.to_host<uint8_t>());
    out["mhc_expand"] = bytes_of(ex.to_host<uint8_t>());
  };
  pre("mhc_pre.cluster_tile", in.n_tiles, in.b_tiles, in.c_tiles, MhcPreKernel::kAuto, false);
  pre("mhc_pre.resident", 4, in.b_res, in.c_res, MhcPreKernel::kResident, false);
  pre("mhc_pre.split", in.n_split, in.b_split, in.c_split, MhcPreKernel::kSplit, true);
  pre("mhc_pre.portable", in.n_tiles, 9, in.c_tiles, MhcPreKernel::kPortable, false);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  return out;
}


float bf16_at(const std::vector<uint8_t>& b, size_t i) {
  return float(host::load_as_double(b.data(), DType::kBFloat16, int64_t(i)));
}

// `got` (bf16) within a tolerance of `ref` (bf16): the atomic modes sum the
// k slots in a schedule-dependent order, one bf16 rounding per add (atomic)
// or one at the end (atomic_fp32); 2^-6 of the row's largest magnitude
// covers k = 8 roundings.
void expect_close_bf16(const std::vector<uint8_t>& got, const std::vector<uint8_t>& ref, int64_t rows,
                       int64_t cols, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  for (int64_t t = 0; t < rows; ++t) {
    float scale = 0;
    for (int64_t c = 0; c < cols; ++c) scale = std::max(scale, std::fabs(bf16_at(ref, t * cols + c)));
    for (int64_t c = 0; c < cols; ++c) {
      const float g = bf16_at(got, t * cols + c), r = bf16_at(ref, t * cols + c);
      ASSERT_TRUE(std::isfinite(g) && std::fabs(g - r) <= std::ldexp(scale, -6) + 1e-6f)
          << what << " [" << t << ", " << c << "]: " << g << " vs " << r;
    }
  }
}

bool is_atomic(const std::string& name) { return name == "fc2.atomic" || name == "fc2.atomic_fp32"; }

// Within one round: the atomic modes agree with deterministic.
void expect_round_consistent(const Outputs& o, const Inputs& in) {
  for (const char* m : {"fc2.atomic", "fc2.atomic_fp32"})
    expect_close_bf16(o.at(m), o.at("fc2.deterministic"), in.T, in.H, m);
}

// Two rounds of the same inputs on two devices (or threads): the same ops ran,
// the reproducible outputs are bitwise equal, the atomic ones close.
void expect_same_outputs(const Outputs& a, const Outputs& b, const Inputs& in, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [name, bytes] : a) {
    SCOPED_TRACE(what + ": " + name);
    ASSERT_TRUE(b.count(name));
    if (is_atomic(name)) {
      expect_close_bf16(b.at(name), bytes, in.T, in.H, name);
    } else {
      EXPECT_TRUE(bytes == b.at(name)) << "differs between the two runs";
    }
  }
}

bool same_model(int d0, int d1) {
  cudaDeviceProp p0, p1;
  if (cudaGetDeviceProperties(&p0, d0) != cudaSuccess || cudaGetDeviceProperties(&p1, d1) != cudaSuccess) return false;
  return std::strcmp(p0.name, p1.name) == 0;
}

// Every op on device 0 then device 1 (each kernel's first call on device 1
// comes after device 0 set it up), then the other way round on other shapes
// (other instantiations: device 0's first call after device 1's).
TEST(TwoDevices, EveryOpOnEachDeviceInOneProcess) {
  SKIP_WITHOUT_TWO_GPUS();
  for (int variant : {0, 1}) {
    SCOPED_TRACE("variant " + std::to_string(variant));
    const Inputs in(variant);
    const int first = variant == 0 ? 0 : 1, second = 1 - first;
    Outputs out[2];
    for (int d : {first, second}) {
      CUDA_OK(cudaSetDevice(d));
      out[d] = run_every_op(in);
      expect_round_consistent(out[d], in);
    }
    CUDA_OK(cudaSetDevice(0));
    if (same_model(0, 1)) expect_same_outputs(out[0], out[1], in, "device 0 vs device 1");
  }
}

// Two host threads at once, one device each, three rounds apiece, on shapes
// no other test of this binary ran before (their first calls race), then
// against a run on one thread.
TEST(TwoDevices, TwoThreadsOneDeviceEach) {
  SKIP_WITHOUT_TWO_GPUS();
  const Inputs in(2);
  Outputs out[2][3];
  auto worker = [&](int d) {
    if (cudaSetDevice(d) != cudaSuccess) {
      ADD_FAILURE() << "cudaSetDevice(" << d << ")";
      return;
    }
    for (int round = 0; round < 3; ++round) out[d][round] = run_every_op(in);
  };
  std::thread t0(worker, 0), t1(worker, 1);
  t0.join();
  t1.join();
  for (int d : {0, 1})
    for (int round = 0; round < 3; ++round) {
      SCOPED_TRACE("device " + std::to_string(d) + " round " + std::to_string(round));
      ASSERT_FALSE(out[d][round].empty());
      expect_round_consistent(out[d][round], in);
      expect_same_outputs(out[d][0], out[d][round], in, "round 0 vs this round");
    }
  if (same_model(0, 1)) expect_same_outputs(out[0][0], out[1][0], in, "thread on device 0 vs thread on device 1");
  CUDA_OK(cudaSetDevice(0));
  expect_same_outputs(out[0][0], run_every_op(in), in, "thread vs main thread");
}

// Every op's GPU entry point, called with arguments it must reject: it says
// so and leaves no CUDA error set.
TEST(CudaErrorState, RejectedCallsLeaveNoErrorSet) {
  SKIP_WITHOUT_GPU();
  CUDA_OK(cudaGetLastError());
  auto rejected = [](const Status& s, const char* what) {
    EXPECT_FALSE(s.ok()) << what;
    EXPECT_EQ(cudaGetLastError(), cudaSuccess) << what << " left a CUDA error set";
  };
  const MhcShape shape{4, 4, 1024};
  auto null_pointers = [&](auto args) {  // the shape and nothing else
    args.shape = shape;
    return args;
  };
  rejected(mhc_pre(null_pointers(MhcPreArgs{}), nullptr), "mhc_pre");
  rejected(mhc_post(null_pointers(MhcPostArgs{}), nullptr), "mhc_post");
  rejected(mhc_project(null_pointers(MhcProjectArgs{}), nullptr), "mhc_project");
  rejected(mhc_activate(null_pointers(MhcActivateArgs{}), nullptr), "mhc_activate");
  rejected(mhc_pre_mix(null_pointers(MhcPreMixArgs{}), nullptr), "mhc_pre_mix");
  rejected(mhc_head(null_pointers(MhcHeadArgs{}), nullptr), "mhc_head");
  rejected(mhc_expand(null_pointers(MhcExpandArgs{}), nullptr), "mhc_expand");
  FinalizeMoeRoutingArgs fin;
  fin.num_tokens = 4; fin.hidden = 8; fin.k = 2; fin.num_experts_per_node = 2;  // null pointers
  rejected(finalize_moe_routing(fin, nullptr), "finalize_moe_routing");
  rejected(debug_check_finalize_moe_routing_indices(fin, nullptr), "debug_check_finalize_moe_routing_indices");
  MoeRoutingArgs routing;
  routing.num_tokens = 4; routing.k = 2; routing.num_experts_per_node = 2;
  rejected(build_moe_routing_maps(routing, nullptr, 0, nullptr), "build_moe_routing_maps");
  Fc2FinalizeArgs fc2;
  fc2.num_tokens = 4; fc2.k = 2; fc2.hidden = 8; fc2.inter = 8; fc2.num_experts_per_node = 2;
  rejected(moe_fc2_finalize(fc2, nullptr, 0, nullptr), "moe_fc2_finalize");
  // A shape the pinned kernel cannot take: kNotSupported with the reason.
  DeviceBuffer x(4 * 8 * 1000 * 2), phi(80 * 8 * 1000 * 4), alpha(16), bias(80 * 4), f(4 * 1000 * 2), hp(4 * 8 * 4),
      hr(4 * 64 * 4);
  MhcPreArgs pre;
  pre.shape = {4, 8, 1000};
  pre.x = x.get(); pre.phi = phi.get(); pre.alpha = alpha.as<float>(); pre.bias = bias.as<float>();
  pre.f_pre = f.get(); pre.h_post = hp.as<float>(); pre.h_res = hr.as<float>();
  pre.kernel = MhcPreKernel::kResident;
  const Status s = mhc_pre(pre, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kNotSupported) << s.message();
  EXPECT_NE(s.message().find("n must be 4"), std::string::npos) << s.message();
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

__global__ void noop_kernel() {}

// A CUDA error already pending when a call starts is the caller's: the call
// reports it, launches nothing, and leaves it set for its owner.
TEST(CudaErrorState, PendingErrorIsReportedNotSwallowed) {
  SKIP_WITHOUT_GPU();
  CUDA_OK(cudaGetLastError());
  MhcShape shape{2, 4, 1024};
  DeviceBuffer emb(2 * 1024 * 2), x = poisoned(2 * 4 * 1024 * 2);
  MhcExpandArgs expand;
  expand.shape = shape;
  expand.embedding = emb.get();
  expand.x = x.get();
  noop_kernel<<<1, 4096>>>();  // too many threads per block: a launch error, pending (not sticky)
  const cudaError_t pending = cudaPeekAtLastError();
  ASSERT_NE(pending, cudaSuccess);
  const Status s = mhc_expand(expand, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kCudaError);
  EXPECT_NE(s.message().find("pending before this call"), std::string::npos) << s.message();
  EXPECT_EQ(cudaGetLastError(), pending) << "the caller's error was swallowed";
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint8_t> untouched = x.to_host<uint8_t>();
  for (uint8_t b : untouched) ASSERT_EQ(b, 0xff) << "a call with a pending error wrote its output";
  // The same call with no error pending succeeds.
  EXPECT_OP_OK(mhc_expand(expand, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
}

// A call that fails inside the CUDA runtime: the legacy stream while a
// blocking stream captures in global mode (the legacy stream would join the
// capture implicitly: the runtime refuses it and invalidates the capture).
// The failure is the call's Status, and no error is left set.
TEST(CudaErrorState, FailedCallLeavesNoErrorSet) {
  SKIP_WITHOUT_GPU();
  CUDA_OK(cudaGetLastError());
  MhcShape shape{2, 4, 1024};
  DeviceBuffer emb(2 * 1024 * 2), x(2 * 4 * 1024 * 2);
  MhcExpandArgs expand;
  expand.shape = shape;
  expand.embedding = emb.get();
  expand.x = x.get();
  cudaStream_t capturing = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&capturing, cudaStreamDefault));  // blocking: synchronises with the legacy stream
  CUDA_OK(cudaStreamBeginCapture(capturing, cudaStreamCaptureModeGlobal));
  const Status s = mhc_expand(expand, nullptr);  // the legacy stream
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "status: " << s.message();
  cudaGraph_t g = nullptr;
  (void)cudaStreamEndCapture(capturing, &g);  // invalidated: an error of this test's own
  if (g != nullptr) (void)cudaGraphDestroy(g);
  (void)cudaGetLastError();
  CUDA_OK(cudaStreamDestroy(capturing));
  // The device is still usable.
  EXPECT_OP_OK(mhc_expand(expand, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace flashmix
