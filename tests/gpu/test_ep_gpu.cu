// flashmix_ep on GPUs (spec §14): one process per GPU (tests/common/ep_ranks.h),
// NCCL between them. The world = 2 cases run where two GPUs are present, the
// one-rank cases on one GPU, the EpGpuWorld cases (world 4 and 8) where that
// many are; each is skipped otherwise.
//
// References, each rank computing them on its own GPU from the same seeded
// problem (every rank can rebuild every rank's tokens and all E experts):
//  - ranked: moe_forward (or finalize) of each rank's expert range over this
//    rank's tokens, the filled bf16 partials summed on the host in fp32 in
//    rank order and rounded once -- what the spec says the EP ops compute, so
//    the deterministic FC2 mode must match it bit for bit (FC2 pinned to the
//    rows kernel on both sides, so both sum in the same order);
//  - full: the single-GPU moe_forward over all E experts. The EP result
//    rounds each rank's partial to bf16 before the sum, so it may differ by
//    a unit of each partial: |ep - full| <= 2^-7 |full| + 2^-7 max|full|.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <string>
#include <vector>

#include "common/ep_ranks.h"
#include "common/gpu_testing.h"
#include "common/host_dtype.h"
#include "common/test_data.h"
#include "flashmix/ep.h"
#include "flashmix/moe.h"

using namespace flashmix;
using namespace flashmix::testing;

namespace {

constexpr int kTimeoutS = 300;

// CUDA_OK for the per-rank bodies, which return their exit code.
#define CK(x)                                                                  \
  do {                                                                         \
    const cudaError_t ck_err_ = (x);                                           \
    if (ck_err_ != cudaSuccess) {                                              \
      ADD_FAILURE() << #x << ": " << cudaGetErrorString(ck_err_);              \
      return 1;                                                                \
    }                                                                          \
  } while (0)

enum class Skew { kUniform, kToRank0, kMostlyRank0 };

struct EpCase {
  int world = 2;
  std::vector<int64_t> T;  // tokens per rank
  int k = 3, E = 8;
  int64_t H = 264, I = 136;
  Skew skew = Skew::kUniform;
  EpSizing sizing = EpSizing::kCapacity;
  int64_t recv_capacity = 0;
  bool shared = true;
  bool graph = false;
  bool fp8 = false;  // FP8 experts (128 x 128 block weights) and FP8 dispatch (EpShape::fp8_rows)
  bool direct_only = false;  // the direct transport's pass on workspaces without the NCCL slabs
};

int64_t max_tokens(const EpCase& c) { return std::max<int64_t>(1, *std::max_element(c.T.begin(), c.T.end())); }

// Rank q's tokens: X, ids, weights, shared.
struct Tokens {
  HostTensor X, shared;
  std::vector<int32_t> ids;
  std::vector<float> w;
};

Tokens make_tokens(const EpCase& c, int q, uint64_t salt) {
  Rng rng(test_seed() ^ (0xe9ull << 32) ^ (uint64_t(q) * 7919) ^ salt);
  Tokens tk;
  const int64_t T = c.T[size_t(q)];
  tk.X = HostTensor(DType::kBFloat16, std::max<int64_t>(1, T) * c.H);
  tk.X.fill_random(rng);
  tk.shared = HostTensor(DType::kBFloat16, std::max<int64_t>(1, T) * c.H);
  tk.shared.fill_random(rng);
  const int e_local = c.E / c.world;
  std::vector<int32_t> pick(static_cast<size_t>(c.E));
  for (int64_t t = 0; t < T; ++t) {
    // k distinct experts; kToRank0 draws from rank 0's range only, kMostlyRank0 there 3 times in 4.
    const bool rank0 = c.skew == Skew::kToRank0 || (c.skew == Skew::kMostlyRank0 && rng.integer(0, 3) != 0);
    const int pool = rank0 && e_local >= c.k ? e_local : c.E;
    for (int e = 0; e < c.E; ++e) pick[size_t(e)] = e;
    for (int j = 0; j < c.k; ++j) std::swap(pick[size_t(j)], pick[size_t(j + rng.integer(0, pool - 1 - j))]);
    for (int j = 0; j < c.k; ++j) tk.ids.push_back(pick[size_t(j)]);
  }
  tk.w.resize(tk.ids.size());
  for (auto& x : tk.w) x = rng.uniform(0.1f, 1.0f);
  return tk;
}

// Every rank's tokens (each rank can rebuild all of them).
std::vector<Tokens> all_tokens(const EpCase& c, uint64_t salt) {
  std::vector<Tokens> all;
  for (int q = 0; q < c.world; ++q) all.push_back(make_tokens(c, q, salt));
  return all;
}

struct Experts {
  HostTensor W1, b1, W2, b2;  // all E experts
  DeviceBuffer dW1, db1, dW2, db2;
  // fp8: W1 / W2 as e4m3 with fp32 scales per 128 x 128 block, expert by expert.
  DeviceBuffer dW1q, dW1s, dW2q, dW2s;
};

// Every expert's rows x cols matrix of `w` quantised with 128 x 128 blocks,
// the experts' codes and scales back to back, uploaded.
void upload_fp8(const HostTensor& w, int E, int64_t rows, int64_t cols, DeviceBuffer& q, DeviceBuffer& sc) {
  std::vector<uint8_t> all_q;
  std::vector<float> all_s;
  for (int e = 0; e < E; ++e) {
    std::vector<float> x(static_cast<size_t>(rows * cols));
    for (int64_t i = 0; i < rows * cols; ++i) x[size_t(i)] = float(w.get(e * rows * cols + i));
    std::vector<uint8_t> qe;
    std::vector<float> se;
    quantize_e4m3(x, rows, cols, 128, qe, se);
    all_q.insert(all_q.end(), qe.begin(), qe.end());
    all_s.insert(all_s.end(), se.begin(), se.end());
  }
  q = DeviceBuffer(all_q);
  sc = DeviceBuffer(all_s);
}

void make_experts(const EpCase& c, Experts& ex) {
  Rng rng(test_seed() ^ 0x5eedea11ull);
  ex.W1 = HostTensor(DType::kBFloat16, int64_t(c.E) * 2 * c.I * c.H);
  ex.W1.fill_random(rng, -0.15f, 0.15f);
  ex.b1 = HostTensor(DType::kBFloat16, int64_t(c.E) * 2 * c.I);
  ex.b1.fill_random(rng, -0.2f, 0.2f);
  ex.W2 = HostTensor(DType::kBFloat16, int64_t(c.E) * c.H * c.I);
  ex.W2.fill_random(rng, -0.15f, 0.15f);
  ex.b2 = HostTensor(DType::kBFloat16, int64_t(c.E) * c.H);
  ex.b2.fill_random(rng, -0.2f, 0.2f);
  ex.dW1 = DeviceBuffer(ex.W1.bytes.size());
  ex.dW1.upload(ex.W1.data(), ex.W1.bytes.size());
  ex.db1 = DeviceBuffer(ex.b1.bytes.size());
  ex.db1.upload(ex.b1.data(), ex.b1.bytes.size());
  ex.dW2 = DeviceBuffer(ex.W2.bytes.size());
  ex.dW2.upload(ex.W2.data(), ex.W2.bytes.size());
  ex.db2 = DeviceBuffer(ex.b2.bytes.size());
  ex.db2.upload(ex.b2.data(), ex.b2.bytes.size());
  if (c.fp8) {
    upload_fp8(ex.W1, c.E, 2 * c.I, c.H, ex.dW1q, ex.dW1s);
    upload_fp8(ex.W2, c.E, c.H, c.I, ex.dW2q, ex.dW2s);
  }
}

// The layer's settings, over experts [start, start + local) of `ex`.
MoeForwardArgs layer_args(const EpCase& c, const Experts& ex, int start, int local) {
  MoeForwardArgs m;
  m.hidden = c.H;
  m.inter = c.I;
  m.k = c.k;
  m.num_experts = c.E;
  m.start_expert_id = start;
  m.num_experts_per_node = local;
  m.W1 = static_cast<const char*>(ex.dW1.get()) + size_t(start) * 2 * c.I * c.H * 2;
  m.b1 = static_cast<const char*>(ex.db1.get()) + size_t(start) * 2 * c.I * 2;
  m.W2 = static_cast<const char*>(ex.dW2.get()) + size_t(start) * c.H * c.I * 2;
  m.b2 = static_cast<const char*>(ex.db2.get()) + size_t(start) * c.H * 2;
  m.fc2_mode = Fc2Mode::kDeterministic;
  m.fc2_tuning.gemm_kernel = Fc2GemmKernel::kRows;
  if (c.fp8) {
    const int64_t s1 = (2 * c.I / 128) * (c.H / 128), s2 = (c.H / 128) * (c.I / 128);
    m.fp8 = MoeFp8Scaling::kBlock;
    m.W1 = static_cast<const char*>(ex.dW1q.get()) + size_t(start) * 2 * c.I * c.H;
    m.W2 = static_cast<const char*>(ex.dW2q.get()) + size_t(start) * c.H * c.I;
    m.w1_scales = ex.dW1s.as<float>() + start * s1;
    m.w2_scales = ex.dW2s.as<float>() + start * s2;
  }
  return m;
}

struct DeviceTokens {
  DeviceBuffer X, ids, w, shared;
  explicit DeviceTokens(const Tokens& tk)
      : X(tk.X.bytes.size()), ids(std::max<size_t>(4, tk.ids.size() * 4)), w(std::max<size_t>(4, tk.w.size() * 4)),
        shared(tk.shared.bytes.size()) {
    X.upload(tk.X.data(), tk.X.bytes.size());
    if (!tk.ids.empty()) ids.upload(tk.ids.data(), tk.ids.size() * 4);
    if (!tk.w.empty()) w.upload(tk.w.data(), tk.w.size() * 4);
    shared.upload(tk.shared.data(), tk.shared.bytes.size());
  }
};

// moe_forward of experts [start, start + local) over T tokens: a filled bf16 partial [T, H].
std::vector<uint16_t> partial(const EpCase& c, const Experts& ex, DeviceTokens& dt, int64_t T, int start, int local,
                              bool with_shared, cudaStream_t stream) {
  std::vector<uint16_t> out(static_cast<size_t>(T * c.H));
  if (T == 0) return out;
  MoeForwardArgs m = layer_args(c, ex, start, local);
  m.num_tokens = T;
  m.X = dt.X.get();
  m.token_selected_experts = dt.ids.as<int32_t>();
  m.token_final_scales = dt.w.as<float>();
  m.shared_output = with_shared ? dt.shared.get() : nullptr;
  DeviceBuffer dout(out.size() * 2), ws(std::max<size_t>(256, moe_forward_workspace_size(m)));
  m.out = dout.get();
  const Status st = moe_forward(m, ws.get(), ws.bytes(), stream);
  EXPECT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  dout.download(out.data(), out.size() * 2);
  return out;
}

// Host sum in fp32, in order, of bf16 rows (+ an optional bf16 term last), rounded once.
uint16_t sum_bf16(const std::vector<float>& terms) {
  float acc = 0.f;
  for (float x : terms) acc += x;
  return host::float_to_bf16(acc);
}

// Compares `got` [T, H] with `want` bitwise and with `full` by the tolerance;
// rows listed in `cut` must be all NaN instead.
void expect_rows(const char* what, int rank, int64_t T, int64_t H, const std::vector<uint16_t>& got,
                 const std::vector<uint16_t>& want, const std::vector<uint16_t>* full, const std::vector<bool>& cut) {
  double max_full = 0;
  if (full)
    for (uint16_t v : *full) max_full = std::max(max_full, double(std::fabs(host::bf16_to_float(v))));
  int bad = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const size_t i = size_t(t * H + h);
      const float g = host::bf16_to_float(got[i]);
      if (!cut.empty() && cut[size_t(t)]) {
        if (!std::isnan(g) && bad++ < 5) ADD_FAILURE() << what << " rank " << rank << " token " << t << " col " << h
                                                       << ": cut by the capacity, wants NaN, got " << g;
        continue;
      }
      if (got[i] != want[i] && bad++ < 5)
        ADD_FAILURE() << what << " rank " << rank << " token " << t << " col " << h << ": got " << g << ", ranked ref "
                      << host::bf16_to_float(want[i]);
      if (full) {
        const double f = host::bf16_to_float((*full)[i]);
        const double tol = std::ldexp(std::fabs(f), -7) + std::ldexp(max_full, -7);
        if (!(std::fabs(g - f) <= tol) && bad++ < 5)
          ADD_FAILURE() << what << " rank " << rank << " token " << t << " col " << h << ": got " << g
                        << ", single-GPU ref " << f << " (tolerance " << tol << ")";
      }
    }
  EXPECT_EQ(bad, 0) << what << " rank " << rank << ": " << bad << " mismatches";
}

// Holds a GPU for `ns` nanoseconds: one rank runs late, so that a rank that
// ran ahead into a buffer still in use would show.
__global__ void spin_kernel(uint64_t ns) {
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

// Standalone dispatch + combine with identity experts (expert_out = the
// received rows): out[t] = the sum, over the ranks t went to in rank order,
// of X[t] in fp32, + shared[t], rounded once (NaN where cut): the expectation
// on the host from the CPU plan.
std::vector<uint16_t> identity_layer_ref(const EpShape& shape, int64_t C, const Tokens& tk, int64_t T, int64_t H,
                                         bool shared) {
  const EpPlanCpu plan = ep_plan_cpu(shape, T, tk.ids.data());
  std::vector<uint16_t> want(size_t(T * H));
  for (int64_t t = 0; t < T; ++t) {
    int n = 0;
    bool cut = false;
    for (int q = 0; q < shape.world; ++q) {
      const int32_t row = plan.row[size_t(q * T + t)];
      n += row >= 0 && row < C;
      cut = cut || row >= C;
    }
    for (int64_t h = 0; h < H; ++h) {
      const float x = host::bf16_to_float(reinterpret_cast<const uint16_t*>(tk.X.data())[t * H + h]);
      float acc = cut ? std::nanf("") : 0.f;
      for (int i = 0; i < n; ++i) acc += x;
      if (shared) acc += float(tk.shared.get(t * H + h));
      want[size_t(t * H + h)] = host::float_to_bf16(acc);
    }
  }
  return want;
}

EpShape shape_of(const EpCase& c, int rank) {
  EpShape s;
  s.rank = rank;
  s.world = c.world;
  s.hidden = c.H;
  s.k = c.k;
  s.num_experts = c.E;
  s.max_tokens_per_rank = max_tokens(c);
  s.recv_capacity = c.recv_capacity;
  s.sizing = c.sizing;
  s.fp8_rows = c.fp8;
  return s;
}

// The direct transport (spec §14.7) for `ws`, or null for NCCL; destroyed
// collectively (every rank done with every workspace before any is freed).
struct Peers {
  EpPeers* p = nullptr;
  ncclComm_t comm;
  cudaStream_t stream;
  Peers(bool on, const EpShape& s, DeviceBuffer& ws, ncclComm_t c, cudaStream_t st) : comm(c), stream(st) {
    if (!on) return;
    const Status status = ep_peers_create(s, ws.get(), ws.bytes(), comm, stream, &p);
    EXPECT_TRUE(status.ok()) << status.message();
  }
  // Before the stream goes (every rank closes its objects in the same order).
  void close() {
    const Status status = ep_peers_destroy(p, comm, stream);
    EXPECT_TRUE(status.ok()) << status.message();
    p = nullptr;
  }
  // Not closed (a rank left early): unmap only, no collective, since the
  // other ranks may be in another NCCL call.
  ~Peers() { (void)ep_peers_destroy(p, nullptr, nullptr); }
  Peers(const Peers&) = delete;
  Peers& operator=(const Peers&) = delete;
};

// The all-to-all way on this rank over one transport (NCCL, or the direct
// one with `peers`): ep_dispatch's receive view against the CPU plan, then
// ep_moe_forward against both references.
int all_to_all_rank(const EpCase& c, int rank, ncclComm_t comm, bool peers) {
  const char* via = peers ? (c.direct_only ? " (direct transport, direct_only workspace)" : " (direct transport)")
                          : " (NCCL)";
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Experts ex;
  make_experts(c, ex);
  const EpShape shape = [&] {
    EpShape sh = shape_of(c, rank);
    sh.direct_only = peers && c.direct_only;
    return sh;
  }();
  const int64_t C = ep_recv_capacity(shape), H = c.H, T = c.T[size_t(rank)];
  const int e_local = c.E / c.world;
  std::vector<Tokens> all = all_tokens(c, 0);
  DeviceTokens dt(all[size_t(rank)]);

  // 1. Dispatch alone: what arrived, from every source.
  DeviceBuffer ws(ep_workspace_size(shape)), dropped(4);
  {
    HostTensor poison(DType::kBFloat16, int64_t(c.world) * C * H / (c.fp8 ? 2 : 1));
    poison.poison();
    const EpRecvView v0 = ep_recv_view(shape, ws.get());
    CK(cudaMemcpy(v0.x, poison.data(), poison.bytes.size(), cudaMemcpyHostToDevice));
    CK(cudaDeviceSynchronize());  // a pageable copy may land after cudaMemcpy returns
  }
  // After the poison: with the direct transport the peers write into this
  // rank's slabs as soon as they dispatch (ep_peers_create's barrier orders
  // every rank's poison before any rank's dispatch).
  Peers dispatch_peers(peers, shape, ws, comm, stream);
  EpDispatchArgs d;
  d.shape = shape;
  d.num_tokens = T;
  d.X = dt.X.get();
  d.topk_ids = dt.ids.as<int32_t>();
  d.topk_weights = dt.w.as<float>();
  d.dropped = dropped.as<int32_t>();
  d.peers = dispatch_peers.p;
  Status st = ep_dispatch(d, comm, ws.get(), ws.bytes(), stream);
  EXPECT_TRUE(st.ok()) << st.message();
  CK(cudaStreamSynchronize(stream));
  const EpRecvView v = ep_recv_view(shape, ws.get());
  // fp8: the rows are e4m3 codes, checked through the layer below.
  std::vector<uint16_t> rx(c.fp8 ? 0 : static_cast<size_t>(v.rows * H));
  std::vector<int32_t> rids(static_cast<size_t>(v.rows * c.k)), rcounts(size_t(c.world));
  std::vector<float> rw(static_cast<size_t>(v.rows * c.k));
  if (!c.fp8) CK(cudaMemcpy(rx.data(), v.x, rx.size() * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(rids.data(), v.ids, rids.size() * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(rw.data(), v.weights, rw.size() * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(rcounts.data(), v.counts, rcounts.size() * 4, cudaMemcpyDeviceToHost));
  int32_t got_dropped = -1;
  dropped.download(&got_dropped, 4);
  int bad = 0;
  for (int s = 0; s < c.world; ++s) {
    const Tokens& src = all[size_t(s)];
    const int64_t Ts = c.T[size_t(s)];
    const EpPlanCpu plan = ep_plan_cpu(shape_of(c, s), Ts, src.ids.data());
    if (s == rank) EXPECT_EQ(got_dropped, plan.dropped) << "rank " << rank << ": dropped";
    EXPECT_EQ(rcounts[size_t(s)], std::min<int64_t>(plan.counts[size_t(rank)], C)) << "rank " << rank << " from " << s;
    std::vector<bool> seen(size_t(C), false);
    for (int64_t t = 0; t < Ts; ++t) {
      const int32_t row = plan.row[size_t(rank) * size_t(Ts) + size_t(t)];
      if (row < 0 || row >= C) continue;
      seen[size_t(row)] = true;
      const int64_t r = s * C + row;
      for (int64_t h = 0; h < (c.fp8 ? 0 : H); ++h)
        if (rx[size_t(r * H + h)] != reinterpret_cast<const uint16_t*>(src.X.data())[t * H + h] && bad++ < 5)
          ADD_FAILURE() << "rank " << rank << ": row " << r << " (token " << t << " of rank " << s << ") col " << h;
      for (int j = 0; j < c.k; ++j)
        if ((rids[size_t(r * c.k + j)] != src.ids[size_t(t * c.k + j)] ||
             rw[size_t(r * c.k + j)] != src.w[size_t(t * c.k + j)]) &&
            bad++ < 5)
          ADD_FAILURE() << "rank " << rank << ": meta of row " << r << " slot " << j;
    }
    for (int64_t row = 0; row < C; ++row)
      if (!seen[size_t(row)])
        for (int j = 0; j < c.k; ++j)
          if (rids[size_t((s * C + row) * c.k + j)] != -1 && bad++ < 5)
            ADD_FAILURE() << "rank " << rank << ": padding row " << s * C + row << " has id "
                          << rids[size_t((s * C + row) * c.k + j)] << ", wants -1";
  }
  EXPECT_EQ(bad, 0) << via;

  // 1b. Combine alone (bf16 rows): identity experts, two rounds back to back
  // (the first round's tokens, then another routing), one rank held back
  // before the second dispatch and another before the first combine.
  if (!c.fp8) {
    const std::vector<Tokens> other = all_tokens(c, 0xc0b1e);
    DeviceTokens dt2(other[size_t(rank)]);
    DeviceBuffer outA(size_t(std::max<int64_t>(1, T) * H * 2)), outB(outA.bytes());
    for (int round = 0; round < 2; ++round) {
      DeviceTokens& tk = round == 0 ? dt : dt2;
      if (round == 1) {
        if (rank == 1 % c.world) spin_kernel<<<1, 1, 0, stream>>>(200000);
        EpDispatchArgs d2 = d;
        d2.X = tk.X.get();
        d2.topk_ids = tk.ids.as<int32_t>();
        d2.topk_weights = tk.w.as<float>();
        st = ep_dispatch(d2, comm, ws.get(), ws.bytes(), stream);
        EXPECT_TRUE(st.ok()) << st.message();
      }
      CK(cudaMemcpyAsync(v.expert_out, v.x, size_t(v.rows * H * 2), cudaMemcpyDeviceToDevice, stream));
      if (rank == 0) spin_kernel<<<1, 1, 0, stream>>>(200000);
      EpCombineArgs cb;
      cb.shape = shape;
      cb.num_tokens = T;
      cb.shared_output = c.shared ? tk.shared.get() : nullptr;
      cb.out = (round == 0 ? outA : outB).get();
      cb.peers = dispatch_peers.p;
      st = ep_combine(cb, comm, ws.get(), ws.bytes(), stream);
      EXPECT_TRUE(st.ok()) << st.message();
    }
    CK(cudaStreamSynchronize(stream));
    for (int round = 0; round < 2; ++round) {
      const Tokens& tk = round == 0 ? all[size_t(rank)] : other[size_t(rank)];
      std::vector<uint16_t> got(size_t(T * H)), want = identity_layer_ref(shape, C, tk, T, H, c.shared);
      if (T > 0) (round == 0 ? outA : outB).download(got.data(), got.size() * 2);
      int wrong = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        const bool both_nan = std::isnan(host::bf16_to_float(got[i])) && std::isnan(host::bf16_to_float(want[i]));
        if (got[i] != want[i] && !both_nan && wrong++ < 5)
          ADD_FAILURE() << "rank " << rank << via << ": combine with identity experts, round " << round
                        << ", element " << i << ": got " << host::bf16_to_float(got[i]) << ", want "
                        << host::bf16_to_float(want[i]);
      }
      EXPECT_EQ(wrong, 0) << via;
    }
  }

  // 2. The whole layer.
  EpMoeForwardArgs f;
  f.shape = shape;
  f.num_tokens = T;
  f.X = dt.X.get();
  f.topk_ids = dt.ids.as<int32_t>();
  f.topk_weights = dt.w.as<float>();
  f.moe = layer_args(c, ex, rank * e_local, e_local);
  f.shared_output = c.shared ? dt.shared.get() : nullptr;
  f.dropped = dropped.as<int32_t>();
  DeviceBuffer out(size_t(std::max<int64_t>(1, T) * H * 2)), fws(ep_moe_forward_workspace_size(f));
  EXPECT_GT(fws.bytes(), 0u);
  Peers forward_peers(peers, shape, fws, comm, stream);
  f.peers = forward_peers.p;
  f.out = out.get();
  auto reference = [&](const Tokens& tk, DeviceTokens& dtk, std::vector<uint16_t>& ranked,
                       std::vector<uint16_t>& full, std::vector<bool>& cut) {
    std::vector<std::vector<uint16_t>> parts;
    for (int q = 0; q < c.world; ++q) parts.push_back(partial(c, ex, dtk, T, q * e_local, e_local, false, stream));
    full = partial(c, ex, dtk, T, 0, c.E, c.shared, stream);
    const EpPlanCpu plan = ep_plan_cpu(shape, T, tk.ids.data());
    ranked.assign(size_t(T * H), 0);
    cut.assign(size_t(T), false);
    for (int64_t t = 0; t < T; ++t) {
      for (int q = 0; q < c.world; ++q) cut[size_t(t)] = cut[size_t(t)] || plan.row[size_t(q * T + t)] >= C;
      for (int64_t h = 0; h < H; ++h) {
        std::vector<float> terms;
        for (int q = 0; q < c.world; ++q)
          if (plan.row[size_t(q * T + t)] >= 0) terms.push_back(host::bf16_to_float(parts[size_t(q)][size_t(t * H + h)]));
        if (c.shared) terms.push_back(float(tk.shared.get(t * H + h)));
        ranked[size_t(t * H + h)] = sum_bf16(terms);
      }
    }
  };
  std::vector<uint16_t> ranked, full, got(size_t(T * H));
  std::vector<bool> cut;
  reference(all[size_t(rank)], dt, ranked, full, cut);
  CK(cudaMemset(out.get(), 0xff, out.bytes()));
  CK(cudaDeviceSynchronize());  // the legacy stream\'s memset, before the non-blocking stream
  if (!c.graph) {
    // Three calls back to back, no sync between them: the others' tokens
    // (another routing) in the middle, so a rank that ran ahead into a
    // buffer still in use would show in the third call's result.
    const std::vector<Tokens> other = all_tokens(c, 0x51de);
    DeviceTokens dt2(other[size_t(rank)]);
    EpMoeForwardArgs f2 = f;
    f2.X = dt2.X.get();
    f2.topk_ids = dt2.ids.as<int32_t>();
    f2.topk_weights = dt2.w.as<float>();
    f2.shared_output = c.shared ? dt2.shared.get() : nullptr;
    DeviceBuffer out2(out.bytes());
    f2.out = out2.get();
    int n_call = 0;
    for (const EpMoeForwardArgs* call : {&f, &f2, &f}) {
      // A different rank held back before each call.
      if (rank == n_call++ % c.world) spin_kernel<<<1, 1, 0, stream>>>(300000);
      st = ep_moe_forward(*call, comm, fws.get(), fws.bytes(), stream);
      EXPECT_TRUE(st.ok()) << st.message();
    }
    CK(cudaStreamSynchronize(stream));
    if (T > 0) out.download(got.data(), got.size() * 2);
    expect_rows(peers ? "ep_moe_forward (direct transport)" : "ep_moe_forward", rank, T, H, got, ranked, &full, cut);
    std::vector<uint16_t> ranked2, full2, got2(size_t(T * H));
    std::vector<bool> cut2;
    reference(other[size_t(rank)], dt2, ranked2, full2, cut2);
    if (T > 0) out2.download(got2.data(), got2.size() * 2);
    expect_rows(peers ? "ep_moe_forward, other tokens (direct transport)" : "ep_moe_forward, other tokens", rank, T, H,
                got2, ranked2, &full2, cut2);
  } else {
    // Captured once, replayed on new token values written into the same buffers.
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    st = ep_moe_forward(f, comm, fws.get(), fws.bytes(), stream);
    EXPECT_TRUE(st.ok()) << st.message();
    CK(cudaStreamEndCapture(stream, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < 2; ++replay) {
      if (replay == 1) {
        all = all_tokens(c, 0xabcdef);
        const Tokens& tk = all[size_t(rank)];
        dt.X.upload(tk.X.data(), tk.X.bytes.size());
        if (!tk.ids.empty()) dt.ids.upload(tk.ids.data(), tk.ids.size() * 4);
        if (!tk.w.empty()) dt.w.upload(tk.w.data(), tk.w.size() * 4);
        dt.shared.upload(tk.shared.data(), tk.shared.bytes.size());
        reference(tk, dt, ranked, full, cut);
        CK(cudaMemset(out.get(), 0xff, out.bytes()));
        CK(cudaDeviceSynchronize());  // the legacy stream\'s memset, before the non-blocking stream
      }
      CK(cudaGraphLaunch(exec, stream));
      CK(cudaStreamSynchronize(stream));
      if (T > 0) out.download(got.data(), got.size() * 2);
      expect_rows(replay ? (peers ? "graph replay on new inputs (direct transport)" : "graph replay on new inputs")
                         : (peers ? "graph replay (direct transport)" : "graph replay"),
                  rank, T, H, got, ranked, &full, cut);
    }
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
  }
  forward_peers.close();
  dispatch_peers.close();
  CK(cudaStreamDestroy(stream));
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  return ::testing::Test::HasFailure() ? 1 : 0;
}

// Way 1: all ranks hold the same tokens; moe_forward of the rank's experts,
// then NCCL's sum (all_reduce or reduce_scatter).
int replicated_rank(const EpCase& c, EpReduce reduce, int rank, ncclComm_t comm) {
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Experts ex;
  make_experts(c, ex);
  const int W = c.world, e_local = c.E / W;
  const int64_t T = c.T[0], H = c.H;
  const Tokens tk = make_tokens(c, 0, 0x77);  // the same on every rank
  DeviceTokens dt(tk);
  EpReplicatedArgs a;
  a.moe = layer_args(c, ex, rank * e_local, e_local);
  a.moe.num_tokens = T;
  a.moe.X = dt.X.get();
  a.moe.token_selected_experts = dt.ids.as<int32_t>();
  a.moe.token_final_scales = dt.w.as<float>();
  a.moe.shared_output = c.shared ? dt.shared.get() : nullptr;
  a.reduce = reduce;
  const int64_t rows = reduce == EpReduce::kAllReduce ? T : T / W, first = reduce == EpReduce::kAllReduce ? 0 : rank * rows;
  DeviceBuffer out(size_t(std::max<int64_t>(1, rows) * H * 2)), ws(std::max<size_t>(256, ep_moe_forward_replicated_workspace_size(a, W)));
  a.out = out.get();
  CK(cudaMemset(out.get(), 0xff, out.bytes()));
  CK(cudaDeviceSynchronize());  // the legacy stream\'s memset, before the non-blocking stream
  const Status st = ep_moe_forward_replicated(a, comm, ws.get(), ws.bytes(), stream);
  EXPECT_TRUE(st.ok()) << st.message();
  CK(cudaStreamSynchronize(stream));
  std::vector<uint16_t> got(static_cast<size_t>(rows * H));
  if (rows > 0) out.download(got.data(), got.size() * 2);
  std::vector<std::vector<uint16_t>> parts;
  for (int q = 0; q < W; ++q) parts.push_back(partial(c, ex, dt, T, q * e_local, e_local, c.shared && q == 0, stream));
  const std::vector<uint16_t> full_all = partial(c, ex, dt, T, 0, c.E, c.shared, stream);
  std::vector<uint16_t> ranked(static_cast<size_t>(rows * H)), full(size_t(rows * H));
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t h = 0; h < H; ++h) {
      // NCCL sums bf16 pairwise with a rounding per add: for two ranks one
      // rounding of the exact sum, as here; more ranks: the tolerance only.
      std::vector<float> terms;
      for (int q = 0; q < W; ++q) terms.push_back(host::bf16_to_float(parts[size_t(q)][size_t((first + t) * H + h)]));
      ranked[size_t(t * H + h)] = sum_bf16(terms);
      full[size_t(t * H + h)] = full_all[size_t((first + t) * H + h)];
    }
  if (W <= 2)
    expect_rows(reduce == EpReduce::kAllReduce ? "replicated all_reduce" : "replicated reduce_scatter", rank, rows, H,
                got, ranked, &full, {});
  else
    expect_rows("replicated", rank, rows, H, got, got, &full, {});
  CK(cudaStreamDestroy(stream));
  return ::testing::Test::HasFailure() ? 1 : 0;
}

// Rank q's expert outputs [k*T, H] (permuted rows) and maps for its range.
struct RankRows {
  HostTensor rows;
  DeviceBuffer drows, u2p, p2u, offsets, maps_ws;
};

// Way 1 with the finalize seed's op: finalize_moe_routing of the rank's
// experts' rows (fp32 or bf16 partial), NCCL's sum, one rounding.
int finalize_reduce_rank(const EpCase& c, EpReduce reduce, DType partial_dtype, int rank, ncclComm_t comm) {
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int W = c.world, e_local = c.E / W;
  const int64_t T = c.T[0], H = c.H, k = c.k;
  const Tokens tk = make_tokens(c, 0, 0x99);
  DeviceTokens dt(tk);
  std::vector<RankRows> rr(static_cast<size_t>(W));
  for (int q = 0; q < W; ++q) {
    Rng rng(test_seed() ^ 0x123400ull ^ uint64_t(q));
    rr[size_t(q)].rows = HostTensor(DType::kBFloat16, std::max<int64_t>(1, k * T) * H);
    rr[size_t(q)].rows.fill_random(rng);
    rr[size_t(q)].drows = DeviceBuffer(rr[size_t(q)].rows.bytes.size());
    rr[size_t(q)].drows.upload(rr[size_t(q)].rows.data(), rr[size_t(q)].rows.bytes.size());
    rr[size_t(q)].u2p = DeviceBuffer(size_t(std::max<int64_t>(1, k * T)) * 4);
    rr[size_t(q)].p2u = DeviceBuffer(size_t(std::max<int64_t>(1, k * T)) * 4);
    rr[size_t(q)].offsets = DeviceBuffer(size_t(e_local + 1) * 8);
    MoeRoutingArgs m;
    m.token_selected_experts = dt.ids.as<int32_t>();
    m.num_tokens = T;
    m.k = c.k;
    m.start_expert_id = q * e_local;
    m.num_experts_per_node = e_local;
    m.expert_first_token_offset = rr[size_t(q)].offsets.as<int64_t>();
    m.permuted_row_to_unpermuted_row = rr[size_t(q)].p2u.as<int32_t>();
    m.unpermuted_row_to_permuted_row = rr[size_t(q)].u2p.as<int32_t>();
    rr[size_t(q)].maps_ws = DeviceBuffer(std::max<size_t>(256, build_moe_routing_maps_workspace_size(m)));
    const Status st = build_moe_routing_maps(m, rr[size_t(q)].maps_ws.get(), rr[size_t(q)].maps_ws.bytes(), stream);
    EXPECT_TRUE(st.ok()) << st.message();
  }
  auto finalize_of = [&](int q, DType out_dtype, void* out_ptr) {
    FinalizeMoeRoutingArgs f;
    f.expanded_permuted_rows = rr[size_t(q)].drows.get();
    f.num_rows = std::max<int64_t>(1, k * T);
    f.unpermuted_row_to_permuted_row = rr[size_t(q)].u2p.as<int32_t>();
    f.token_selected_experts = dt.ids.as<int32_t>();
    f.scales = dt.w.as<float>();
    f.num_tokens = T;
    f.hidden = H;
    f.k = c.k;
    f.start_expert_id = q * e_local;
    f.num_experts_per_node = e_local;
    f.out = out_ptr;
    f.out_dtype = out_dtype;
    return f;
  };
  EpFinalizeReduceArgs a;
  a.finalize = finalize_of(rank, partial_dtype, nullptr);
  a.reduce = reduce;
  a.partial_dtype = partial_dtype;
  a.out_dtype = DType::kBFloat16;
  const int64_t rows = reduce == EpReduce::kAllReduce ? T : T / W, first = reduce == EpReduce::kAllReduce ? 0 : rank * rows;
  DeviceBuffer out(size_t(std::max<int64_t>(1, rows) * H * 2)), ws(std::max<size_t>(256, ep_finalize_reduce_workspace_size(a, W)));
  a.out = out.get();
  CK(cudaMemset(out.get(), 0xff, out.bytes()));
  CK(cudaDeviceSynchronize());  // the legacy stream\'s memset, before the non-blocking stream
  Status st = ep_finalize_reduce(a, comm, ws.get(), ws.bytes(), stream);
  EXPECT_TRUE(st.ok()) << st.message();
  CK(cudaStreamSynchronize(stream));
  std::vector<uint16_t> got(static_cast<size_t>(rows * H)), ranked(size_t(rows * H));
  if (rows > 0) out.download(got.data(), got.size() * 2);
  // The partials of every range on this GPU, summed on the host.
  std::vector<std::vector<float>> parts(size_t(W), std::vector<float>(size_t(T * H)));
  for (int q = 0; q < W; ++q) {
    DeviceBuffer p(size_t(std::max<int64_t>(1, T * H)) * 4);
    st = finalize_moe_routing(finalize_of(q, DType::kFloat32, p.get()), stream);
    EXPECT_TRUE(st.ok()) << st.message();
    CK(cudaStreamSynchronize(stream));
    if (T > 0) p.download(parts[size_t(q)].data(), size_t(T * H) * 4);
    if (partial_dtype == DType::kBFloat16)
      for (float& x : parts[size_t(q)]) x = host::bf16_to_float(host::float_to_bf16(x));
  }
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t h = 0; h < H; ++h) {
      float acc = 0.f;
      for (int q = 0; q < W; ++q) acc += parts[size_t(q)][size_t((first + t) * H + h)];
      if (partial_dtype == DType::kBFloat16) acc = host::bf16_to_float(host::float_to_bf16(acc));
      ranked[size_t(t * H + h)] = host::float_to_bf16(acc);
    }
  // Two ranks: a + b, one rounding, whatever order NCCL adds in: bitwise.
  // More: NCCL's fp32 (or bf16) sum runs in its ring's order, not rank
  // order, so the rank-order sum is the reference within the tolerance.
  if (W <= 2)
    expect_rows("finalize_reduce", rank, rows, H, got, ranked, nullptr, {});
  else
    expect_rows("finalize_reduce", rank, rows, H, got, got, &ranked, {});
  CK(cudaStreamDestroy(stream));
  return ::testing::Test::HasFailure() ? 1 : 0;
}

int world_or_skip(int want) {
  const int n = gpu_count_in_child();
  return n >= want ? want : 0;
}

void run_case(const EpCase& c, const std::function<int(int, int, ncclComm_t)>& body) {
  // Every rank draws the same problem: one seed for all of them.
  setenv("FLASHMIX_TEST_SEED", std::to_string(test_seed()).c_str(), 1);
  const RanksResult r = run_ranks(c.world, kTimeoutS, body);
  EXPECT_TRUE(r.ok()) << r.describe();
}

// The all-to-all way's checks (all_to_all_rank) on every rank of c, over
// NCCL and then over the direct transport.
void run_all_to_all(const EpCase& c) {
  run_case(c, [&](int r, int, ncclComm_t comm) {
    const int nccl = all_to_all_rank(c, r, comm, false);
    return nccl | all_to_all_rank(c, r, comm, true);
  });
}

#define SKIP_WITHOUT_GPUS(n)                                                               \
  do {                                                                                     \
    if (world_or_skip(n) == 0) GTEST_SKIP() << "needs " << n << " GPUs (one process each)"; \
  } while (0)

EpCase base_case() {
  EpCase c;
  c.world = 2;
  c.T = {37, 64};
  return c;
}

}  // namespace

TEST(EpGpu, AllToAllCapacity) {
  SKIP_WITHOUT_GPUS(2);
  EpCase c = base_case();
  run_all_to_all(c);
}

TEST(EpGpu, AllToAllExact) {
  SKIP_WITHOUT_GPUS(2);
  EpCase c = base_case();
  c.sizing = EpSizing::kExact;
  c.skew = Skew::kMostlyRank0;
  run_all_to_all(c);
}

TEST(EpGpu, AllToAllSkewedRankOneReceivesNothing) {
  SKIP_WITHOUT_GPUS(2);
  for (EpSizing sizing : {EpSizing::kCapacity, EpSizing::kExact}) {
    EpCase c = base_case();
    c.skew = Skew::kToRank0;
    c.sizing = sizing;
    c.k = 2;
    run_all_to_all(c);
  }
}

TEST(EpGpu, AllToAllZeroTokensOnOneRank) {
  SKIP_WITHOUT_GPUS(2);
  for (EpSizing sizing : {EpSizing::kCapacity, EpSizing::kExact}) {
    EpCase c = base_case();
    c.T = {0, 45};
    c.sizing = sizing;
    run_all_to_all(c);
  }
}

TEST(EpGpu, AllToAllOneTokenWideExperts) {
  SKIP_WITHOUT_GPUS(2);
  EpCase c = base_case();
  c.T = {1, 1};
  c.k = 8;
  c.E = 16;
  c.H = 512;
  c.I = 256;
  run_all_to_all(c);
}

TEST(EpGpu, AllToAllCapacityOverflowIsReported) {
  SKIP_WITHOUT_GPUS(2);
  for (EpSizing sizing : {EpSizing::kCapacity, EpSizing::kExact}) {
    EpCase c = base_case();
    c.skew = Skew::kMostlyRank0;
    c.recv_capacity = 20;  // rank 0's experts get more than 20 rows from each source
    c.sizing = sizing;
    run_all_to_all(c);
  }
}

// spec §14.7: workspaces without the NCCL slabs (EpShape::direct_only) on
// the direct transport; the NCCL pass runs on the full layout.
TEST(EpGpu, AllToAllDirectOnlyWorkspace) {
  SKIP_WITHOUT_GPUS(2);
  for (bool graph : {false, true}) {
    EpCase c = base_case();
    c.T = {0, 45};
    c.direct_only = true;
    c.graph = graph;
    run_all_to_all(c);
  }
}

TEST(EpGpu, AllToAllGraphCapture) {
  SKIP_WITHOUT_GPUS(2);
  EpCase c = base_case();
  c.graph = true;
  run_all_to_all(c);
}

// spec §14.7: the direct transport's two forms. Calls of up to 128 tokens
// take the fused kernels (every direct pass above with such T does; T = 0
// runs one block); here the kernel-per-step form pinned on the same kinds of
// case, then ranks whose T puts them on different forms in the same calls
// (128: fused, 129: kernel per step), which must meet in the same handshakes.
struct ScopedEnv {
  const char* name;
  ScopedEnv(const char* n, const char* v) : name(n) { setenv(n, v, 1); }
  ~ScopedEnv() { unsetenv(name); }
};

TEST(EpGpu, AllToAllDirectKernelPerStep) {
  SKIP_WITHOUT_GPUS(2);
  ScopedEnv pin("FLASHMIX_EP_DIRECT_KERNELS", "split");
  for (bool graph : {false, true}) {
    EpCase c = base_case();
    c.T = {0, 45};
    c.graph = graph;
    run_all_to_all(c);
  }
  EpCase c = base_case();
  c.skew = Skew::kMostlyRank0;
  c.recv_capacity = 20;
  run_all_to_all(c);
}

TEST(EpGpu, AllToAllDirectFusedAndKernelPerStepRanks) {
  SKIP_WITHOUT_GPUS(2);
  for (bool graph : {false, true}) {
    EpCase c = base_case();
    c.T = {128, 129};
    c.graph = graph;
    run_all_to_all(c);
  }
  EpCase c = base_case();
  c.T = {129, 128};
  c.fp8 = true;
  c.H = 256;
  c.I = 128;
  run_all_to_all(c);
}

// A large problem (rows of 8 KiB, slabs of 8 MiB): direct and captured in a graph.
TEST(EpGpu, AllToAllLargeRows) {
  SKIP_WITHOUT_GPUS(2);
  for (bool graph : {false, true}) {
    EpCase c = base_case();
    c.T = {1024, 901};
    c.H = 4096;
    c.I = 128;
    c.graph = graph;
    run_all_to_all(c);
  }
}

// FP8 dispatch: rows quantised 1 x 128 before they are sent, the FP8 layer on
// what arrived; bitwise equal to the ranked FP8 reference (the layer quantises
// X the same way itself).
TEST(EpGpu, AllToAllFp8Rows) {
  SKIP_WITHOUT_GPUS(2);
  for (EpSizing sizing : {EpSizing::kCapacity, EpSizing::kExact}) {
    EpCase c = base_case();
    c.H = 256;
    c.I = 128;
    c.fp8 = true;
    c.sizing = sizing;
    run_all_to_all(c);
  }
}

TEST(EpGpu, AllToAllOneRankFp8Rows) {
  SKIP_WITHOUT_GPUS(1);
  EpCase c = base_case();
  c.world = 1;
  c.T = {53};
  c.H = 256;
  c.I = 128;
  c.fp8 = true;
  run_all_to_all(c);
}

TEST(EpGpu, AllToAllOneRank) {
  SKIP_WITHOUT_GPUS(1);
  EpCase c = base_case();
  c.world = 1;
  c.T = {53};
  run_all_to_all(c);
}

TEST(EpGpu, ReplicatedAllReduceAndReduceScatter) {
  SKIP_WITHOUT_GPUS(2);
  for (EpReduce reduce : {EpReduce::kAllReduce, EpReduce::kReduceScatter}) {
    EpCase c = base_case();
    c.T = {48};
    run_case(c, [&](int r, int, ncclComm_t comm) { return replicated_rank(c, reduce, r, comm); });
  }
}

TEST(EpGpu, FinalizeReduce) {
  SKIP_WITHOUT_GPUS(2);
  for (DType p : {DType::kFloat32, DType::kBFloat16})
    for (EpReduce reduce : {EpReduce::kAllReduce, EpReduce::kReduceScatter}) {
      EpCase c = base_case();
      c.T = {50};
      c.k = 4;
      run_case(c, [&](int r, int, ncclComm_t comm) { return finalize_reduce_rank(c, reduce, p, r, comm); });
    }
}

TEST(EpGpu, BadArgumentsLaunchNothing) {
  SKIP_WITHOUT_GPUS(1);
  EpCase c = base_case();
  c.world = 1;
  c.T = {8};
  run_case(c, [&](int rank, int, ncclComm_t comm) {
    EpShape s = shape_of(c, rank);
    DeviceBuffer ws(ep_workspace_size(s));
    EpDispatchArgs d;
    d.shape = s;
    d.num_tokens = 9;  // past max_tokens_per_rank
    Status st = ep_dispatch(d, comm, ws.get(), ws.bytes(), nullptr);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("num_tokens"), std::string::npos) << st.message();
    d.num_tokens = 0;
    d.shape.rank = 1;
    d.shape.world = 2;  // the communicator has one rank
    st = ep_dispatch(d, comm, ws.get(), ws.bytes(), nullptr);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("comm"), std::string::npos) << st.message();
    d.shape = s;
    st = ep_dispatch(d, comm, ws.get(), ws.bytes() - 256, nullptr);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("workspace_bytes"), std::string::npos) << st.message();
    // The direct transport is bound to the workspace it mapped.
    EpPeers* peers = nullptr;
    st = ep_peers_create(s, ws.get(), ws.bytes(), comm, nullptr, &peers);
    EXPECT_TRUE(st.ok()) << st.message();
    DeviceBuffer other(ws.bytes());
    d.peers = peers;
    st = ep_dispatch(d, comm, other.get(), other.bytes(), nullptr);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("peers"), std::string::npos) << st.message();
    EpShape s2 = s;
    s2.hidden = 2 * s.hidden;
    EpPeers* none = nullptr;
    st = ep_peers_create(s2, ws.get(), ws.bytes(), comm, nullptr, &none);  // too small for that shape
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("workspace_bytes"), std::string::npos) << st.message();
    EXPECT_EQ(none, nullptr);
    EpDispatchArgs only = d;  // a direct_only workspace needs peers
    only.shape.direct_only = true;
    only.peers = nullptr;
    st = ep_dispatch(only, comm, ws.get(), ws.bytes(), nullptr);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("peers"), std::string::npos) << st.message();
    EXPECT_TRUE(ep_peers_destroy(peers, comm, nullptr).ok());
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    return ::testing::Test::HasFailure() ? 1 : 0;
  });
}

// World 4 and 8: the same checks on more ranks, each rank with its own token
// count (one rank with none, one with a single token), 4 experts a rank.
class EpGpuWorld : public ::testing::TestWithParam<int> {
 protected:
  EpCase world_case() const {
    EpCase c;
    c.world = GetParam();
    c.E = 4 * c.world;
    static const int64_t kT[] = {37, 0, 64, 1, 29, 50, 3, 41};
    c.T.assign(kT, kT + c.world);
    return c;
  }
};

TEST_P(EpGpuWorld, AllToAll) {
  SKIP_WITHOUT_GPUS(GetParam());
  for (EpSizing sizing : {EpSizing::kCapacity, EpSizing::kExact}) {
    EpCase c = world_case();
    c.sizing = sizing;
    run_all_to_all(c);
  }
}

// Every token to rank 0's experts: the other ranks receive nothing.
TEST_P(EpGpuWorld, AllToAllOnlyRankZeroReceives) {
  SKIP_WITHOUT_GPUS(GetParam());
  for (EpSizing sizing : {EpSizing::kCapacity, EpSizing::kExact}) {
    EpCase c = world_case();
    c.skew = Skew::kToRank0;
    c.k = 2;
    c.sizing = sizing;
    run_all_to_all(c);
  }
}

TEST_P(EpGpuWorld, AllToAllCapacityOverflowIsReported) {
  SKIP_WITHOUT_GPUS(GetParam());
  for (EpSizing sizing : {EpSizing::kCapacity, EpSizing::kExact}) {
    EpCase c = world_case();
    c.skew = Skew::kMostlyRank0;
    c.recv_capacity = 20;  // the 64-token rank sends rank 0 ~50-60 rows
    c.sizing = sizing;
    run_all_to_all(c);
  }
}

TEST_P(EpGpuWorld, AllToAllGraphCapture) {
  SKIP_WITHOUT_GPUS(GetParam());
  EpCase c = world_case();
  c.graph = true;
  run_all_to_all(c);
}

TEST_P(EpGpuWorld, AllToAllFp8Rows) {
  SKIP_WITHOUT_GPUS(GetParam());
  for (EpSizing sizing : {EpSizing::kCapacity, EpSizing::kExact}) {
    EpCase c = world_case();
    c.H = 256;
    c.I = 128;
    c.fp8 = true;
    c.sizing = sizing;
    run_all_to_all(c);
  }
}

TEST_P(EpGpuWorld, ReplicatedAllReduceAndReduceScatter) {
  SKIP_WITHOUT_GPUS(GetParam());
  for (EpReduce reduce : {EpReduce::kAllReduce, EpReduce::kReduceScatter}) {
    EpCase c = world_case();
    c.T = {48};
    run_case(c, [&](int r, int, ncclComm_t comm) { return replicated_rank(c, reduce, r, comm); });
  }
}

TEST_P(EpGpuWorld, FinalizeReduce) {
  SKIP_WITHOUT_GPUS(GetParam());
  for (DType p : {DType::kFloat32, DType::kBFloat16})
    for (EpReduce reduce : {EpReduce::kAllReduce, EpReduce::kReduceScatter}) {
      EpCase c = world_case();
      c.T = {56};
      c.k = 4;
      run_case(c, [&](int r, int, ncclComm_t comm) { return finalize_reduce_rank(c, reduce, p, r, comm); });
    }
}

INSTANTIATE_TEST_SUITE_P(Ranks, EpGpuWorld, ::testing::Values(4, 8),
                         [](const ::testing::TestParamInfo<int>& i) { return "world" + std::to_string(i.param); });
