// flashmix-bench-ep: expert parallelism on NCCL (spec §14), one process per
// GPU (tests/common/ep_ranks.h); rank 0 prints and writes the records. The
// ceilings are NCCL's own collectives on the same bytes, in the same run:
//
//  ep_dispatch_combine  dispatch + combine (no experts) against NCCL's
//                       all-to-all (grouped ncclSend/ncclRecv, as
//                       torch.distributed.all_to_all_single issues it) of the
//                       same row slabs, once each way: fraction = t_nccl / t.
//  ep_moe_forward       the whole layer against a plain reference of the same
//                       work: flashmix's single-GPU ops around an
//                       all_to_all_single-style exchange of one row per
//                       (token, expert) slot with host-read splits (routing
//                       maps over all E + the permuted copy, the split counts
//                       exchanged and read on the host, rows + expert ids out,
//                       moe_forward (k = 1) on what arrived, rows back,
//                       finalize_moe_routing over all E): ratio_to_reference;
//                       experts_us / reference_experts_us: each side's
//                       moe_forward alone on what its last call received.
//  ep_reduce            ep_finalize_reduce (reduce_scatter) against the local
//                       no-fill finalize + NCCL's reduce_scatter of the same
//                       bytes, timed apart: fraction = (t_fin + t_rs) / t.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

#include <cuda_bf16.h>

#include "bench_common.h"
#include "common/ep_ranks.h"
#include "common/host_dtype.h"
#include "common/test_data.h"
#include "flashmix/ep.h"
#include "flashmix/moe.h"
#include "flashmix_git_commit.h"

using namespace flashmix;
using namespace flashmix::bench;

namespace {

#define EP_OK(expr)                                                                                  \
  do {                                                                                               \
    const ::flashmix::Status st_ = (expr);                                                           \
    if (!st_.ok()) {                                                                                 \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, st_.message().c_str());     \
      std::exit(3);                                                                                  \
    }                                                                                                \
  } while (0)
#define NC_OK(expr)                                                                                  \
  do {                                                                                               \
    const ncclResult_t r_ = (expr);                                                                  \
    if (r_ != ncclSuccess) {                                                                         \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, ncclGetErrorString(r_));    \
      std::exit(3);                                                                                  \
    }                                                                                                \
  } while (0)

struct Buf {
  void* p = nullptr;
  size_t bytes = 0;
  explicit Buf(size_t n) : bytes(n) { BENCH_CUDA(cudaMalloc(&p, std::max<size_t>(n, 256))); }
  ~Buf() { cudaFree(p); }
  Buf(const Buf&) = delete;
  template <typename T>
  T* as() const { return static_cast<T*>(p); }
};

// k distinct experts of E per token, uniform (test_data.h's random_routing); weights in [0.1, 1).
void random_topk(int64_t T, int k, int E, uint64_t seed, std::vector<int32_t>& ids, std::vector<float>& w) {
  flashmix::testing::Rng rng(seed);
  ids = flashmix::testing::random_routing(rng, T, k, E, 0, E).experts;
  w.resize(ids.size());
  for (float& x : w) x = rng.uniform(0.1f, 1.f);
}

// NCCL's all-to-all of `bytes` per peer (grouped send/recv, self skipped).
void nccl_a2a(const char* send, char* recv, size_t bytes, int rank, int world, ncclComm_t comm, cudaStream_t s) {
  NC_OK(ncclGroupStart());
  for (int p = 0; p < world; ++p) {
    if (p == rank) continue;
    NC_OK(ncclSend(send + size_t(p) * bytes, bytes, ncclUint8, p, comm, s));
    NC_OK(ncclRecv(recv + size_t(p) * bytes, bytes, ncclUint8, p, comm, s));
  }
  NC_OK(ncclGroupEnd());
}

struct Shape {
  int64_t T;
  int k, E;
  int64_t I, H;
};

int iters(const Context& ctx) { return ctx.quick ? 10 : 30; }

// `direct`: the direct transport (ep_peers_create) instead of NCCL's.
// `graph`: both sides timed as CUDA-graph replays (10 calls a graph), as a
// decode step runs them; else as stream launches.
void bench_dispatch_combine(Context& ctx, const Shape& sh, EpSizing sizing, bool fp8_rows, bool direct, bool graph,
                            const std::string& name, int rank, int world, ncclComm_t comm, cudaStream_t stream) {
  EpShape s;
  s.rank = rank;
  s.world = world;
  s.hidden = sh.H;
  s.k = sh.k;
  s.num_experts = sh.E;
  s.max_tokens_per_rank = sh.T;
  s.sizing = sizing;
  s.fp8_rows = fp8_rows;
  std::vector<int32_t> ids;
  std::vector<float> w;
  random_topk(sh.T, sh.k, sh.E, 1000 + rank, ids, w);
  Buf X(size_t(sh.T * sh.H * 2)), dids(ids.size() * 4), dw(w.size() * 4), out(size_t(sh.T * sh.H * 2)),
      ws(ep_workspace_size(s));
  fill_bf16(X.p, sh.T * sh.H, 7 + rank, 1.f, stream);
  BENCH_CUDA(cudaMemcpy(dids.p, ids.data(), dids.bytes, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(dw.p, w.data(), dw.bytes, cudaMemcpyHostToDevice));
  const EpRecvView v = ep_recv_view(s, ws.p);
  BENCH_CUDA(cudaMemsetAsync(v.expert_out, 0, size_t(v.rows * sh.H * 2), stream));
  EpDispatchArgs d;
  d.shape = s;
  d.num_tokens = sh.T;
  d.X = X.p;
  d.topk_ids = dids.as<int32_t>();
  d.topk_weights = dw.as<float>();
  EpCombineArgs c;
  c.shape = s;
  c.num_tokens = sh.T;
  c.out = out.p;
  EpPeers* peers = nullptr;
  if (direct) EP_OK(ep_peers_create(s, ws.p, ws.bytes, comm, stream, &peers));
  d.peers = c.peers = peers;
  auto timed = [&](const std::function<void()>& fn) {
    return graph ? graph_us_per_launch([&](int) { fn(); }, 10, stream, iters(ctx)) : median_us(fn, stream, 3, iters(ctx));
  };
  const double t = timed([&] {
    EP_OK(ep_dispatch(d, comm, ws.p, ws.bytes, stream));
    EP_OK(ep_combine(c, comm, ws.p, ws.bytes, stream));
  });
  // Rows this rank sent to its peers and got back (what crossed the links).
  std::vector<int32_t> counts(static_cast<size_t>(world));
  BENCH_CUDA(cudaMemcpy(counts.data(), v.counts, size_t(world) * 4, cudaMemcpyDeviceToHost));
  const int64_t C = ep_recv_capacity(s);
  int64_t rows_sent = 0;
  for (int p = 0; p < world; ++p)  // the direct transport moves the rows that exist, as kExact does
    if (p != rank) rows_sent += sizing == EpSizing::kCapacity && !direct ? C : counts[size_t(p)];
  EP_OK(ep_peers_destroy(peers, comm, stream));
  // Dispatch rows (bf16, or e4m3 + their scales) and combine rows (bf16): this rank's sends.
  const double in_row = fp8_rows ? double(sh.H) + double(sh.H / 128) * 4 : double(sh.H) * 2;
  const double bytes = double(rows_sent) * (in_row + double(sh.H) * 2);
  // NCCL's all-to-all of C rows per peer at the dispatch's and the combine's row size.
  const size_t slab_in = size_t(double(C) * in_row), slab = size_t(C * sh.H * 2);
  Buf a(slab * world), b(slab * world);
  const double t_nccl = timed([&] {
    nccl_a2a(a.as<char>(), b.as<char>(), slab_in, rank, world, comm, stream);
    nccl_a2a(b.as<char>(), a.as<char>(), slab, rank, world, comm, stream);
  });
  if (rank != 0) return;
  Record r;
  r.op = "ep_dispatch_combine";
  r.case_name = name;
  r.median_us = t;
  r.ceiling = "nccl_a2a";
  r.fraction = t_nccl / t;
  r.bytes = bytes;
  r.check = "not checked here (tests/gpu/test_ep_gpu.cu)";
  r.extra["nccl_a2a_us"] = t_nccl;
  r.extra["busbw_gbps"] = bytes / (t * 1e-6) / 1e9;
  r.extra["nccl_busbw_gbps"] = double(slab_in + slab) * (world - 1) / (t_nccl * 1e-6) / 1e9;
  r.labels["sizing"] = sizing == EpSizing::kCapacity ? "capacity" : "exact";
  r.labels["rows"] = fp8_rows ? "fp8" : "bf16";
  r.labels["transport"] = direct ? "direct (NVLink, ep_peers_create)" : "nccl";
  r.labels["timing"] = graph ? "CUDA-graph replays, both sides" : "stream launches";
  add_record(ctx, std::move(r));
}

// Expert id of each permuted row: ids[t, j] of its slot s = j*T + t.
__global__ void permuted_expert_ids(const int32_t* p2u, const int32_t* ids, int64_t T, int k, int64_t P,
                                    int32_t* out) {
  const int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p >= P) return;
  const int64_t s = p2u[p];
  out[p] = ids[(s % T) * k + s / T];
}

void bench_moe_forward(Context& ctx, const Shape& sh, bool direct, const std::string& name, int rank, int world,
                       ncclComm_t comm, cudaStream_t stream) {
  const int e_local = sh.E / world;
  const int64_t T = sh.T, H = sh.H, I = sh.I, k = sh.k;
  std::vector<int32_t> ids;
  std::vector<float> w;
  random_topk(T, sh.k, sh.E, 2000 + rank, ids, w);
  Buf X(size_t(T * H * 2)), dids(ids.size() * 4), dw(w.size() * 4), out(size_t(T * H * 2)),
      ref(size_t(T * H * 2)), W1(size_t(e_local) * 2 * I * H * 2), W2(size_t(e_local) * H * I * 2);
  fill_bf16(X.p, T * H, 11 + rank, 1.f, stream);
  fill_bf16(W1.p, int64_t(e_local) * 2 * I * H, 21 + rank, 0.02f, stream);
  fill_bf16(W2.p, int64_t(e_local) * H * I, 31 + rank, 0.02f, stream);
  BENCH_CUDA(cudaMemcpy(dids.p, ids.data(), dids.bytes, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(dw.p, w.data(), dw.bytes, cudaMemcpyHostToDevice));
  MoeForwardArgs layer;
  layer.hidden = H;
  layer.inter = I;
  layer.k = sh.k;
  layer.num_experts = sh.E;
  layer.W1 = W1.p;
  layer.W2 = W2.p;

  // flashmix_ep.
  EpMoeForwardArgs f;
  f.shape.rank = rank;
  f.shape.world = world;
  f.shape.hidden = H;
  f.shape.k = sh.k;
  f.shape.num_experts = sh.E;
  f.shape.max_tokens_per_rank = T;
  f.num_tokens = T;
  f.X = X.p;
  f.topk_ids = dids.as<int32_t>();
  f.topk_weights = dw.as<float>();
  f.moe = layer;
  f.out = out.p;
  Buf ws(ep_moe_forward_workspace_size(f));
  EpPeers* peers = nullptr;
  if (direct) EP_OK(ep_peers_create(f.shape, ws.p, ws.bytes, comm, stream, &peers));
  f.peers = peers;
  const double t = median_us([&] { EP_OK(ep_moe_forward(f, comm, ws.p, ws.bytes, stream)); }, stream, 2, iters(ctx));
  // The experts alone: moe_forward over what the last call received (the
  // receive view ep_moe_forward's own workspace starts with), as
  // ep_moe_forward runs it (this rank's expert range, one output row a
  // received row), no communication.
  double t_local = 0;
  {
    const EpRecvView v = ep_recv_view(f.shape, ws.p);
    MoeForwardArgs m = layer;
    m.num_tokens = v.rows;
    m.num_experts_per_node = e_local;
    m.start_expert_id = rank * e_local;
    m.X = v.x;
    m.x_stride = H;
    m.token_selected_experts = v.ids;
    m.token_final_scales = v.weights;
    m.fill = false;
    m.out = v.expert_out;
    m.out_stride = H;
    Buf mws(moe_forward_workspace_size(m));
    t_local = median_us([&] { EP_OK(moe_forward(m, mws.p, mws.bytes, stream)); }, stream, 2, iters(ctx));
  }
  // Decode-sized calls: ours again as CUDA-graph replays, as a decode step
  // runs it (the reference reads its splits on the host: it cannot be captured).
  const double t_graph = T <= 256 ? graph_us_per_launch([&](int) { EP_OK(ep_moe_forward(f, comm, ws.p, ws.bytes, stream)); },
                                                        10, stream, iters(ctx))
                                  : 0.0;
  EP_OK(ep_peers_destroy(peers, comm, stream));

  // The plain reference.
  const int64_t slots = k * T;
  Buf offsets(size_t(sh.E + 1) * 8), p2u(size_t(slots) * 4), u2p(size_t(slots) * 4), xperm(size_t(slots * H * 2)),
      eperm(size_t(slots) * 4), recv_x(size_t(2 * slots * H * 2)), recv_e(size_t(2 * slots) * 4),
      y(size_t(2 * slots * H * 2)), yback(size_t(slots * H * 2)), counts_dev(size_t(2 * world) * 4);
  MoeRoutingArgs maps;
  maps.token_selected_experts = dids.as<int32_t>();
  maps.num_tokens = T;
  maps.k = sh.k;
  maps.start_expert_id = 0;
  maps.num_experts_per_node = sh.E;
  maps.expert_first_token_offset = offsets.as<int64_t>();
  maps.permuted_row_to_unpermuted_row = p2u.as<int32_t>();
  maps.unpermuted_row_to_permuted_row = u2p.as<int32_t>();
  maps.input = X.p;
  maps.permuted_input = xperm.p;
  maps.hidden = H;
  Buf maps_ws(build_moe_routing_maps_workspace_size(maps));
  std::vector<int64_t> off(static_cast<size_t>(sh.E + 1));
  std::vector<int32_t> split(static_cast<size_t>(2 * world));
  MoeForwardArgs expert = layer;
  expert.k = 1;
  expert.start_expert_id = rank * e_local;
  expert.num_experts_per_node = e_local;
  Buf expert_ws(moe_forward_workspace_size([&] {
    MoeForwardArgs e = expert;
    e.num_tokens = 2 * slots;
    return e;
  }()));
  auto reference = [&] {
    EP_OK(build_moe_routing_maps(maps, maps_ws.p, maps_ws.bytes, stream));
    permuted_expert_ids<<<unsigned((slots + 255) / 256), 256, 0, stream>>>(p2u.as<int32_t>(), dids.as<int32_t>(), T,
                                                                           sh.k, slots, eperm.as<int32_t>());
    // The splits: rows for each rank (its experts' range of the permuted order),
    // exchanged, read on the host (all_to_all_single needs them there).
    BENCH_CUDA(cudaMemcpyAsync(off.data(), offsets.p, off.size() * 8, cudaMemcpyDeviceToHost, stream));
    BENCH_CUDA(cudaStreamSynchronize(stream));
    for (int p = 0; p < world; ++p)
      split[size_t(p)] = int32_t(off[size_t((p + 1) * e_local)] - off[size_t(p * e_local)]);
    BENCH_CUDA(cudaMemcpyAsync(counts_dev.p, split.data(), size_t(world) * 4, cudaMemcpyHostToDevice, stream));
    NC_OK(ncclGroupStart());
    for (int p = 0; p < world; ++p) {
      NC_OK(ncclSend(counts_dev.as<int32_t>() + p, 1, ncclInt32, p, comm, stream));
      NC_OK(ncclRecv(counts_dev.as<int32_t>() + world + p, 1, ncclInt32, p, comm, stream));
    }
    NC_OK(ncclGroupEnd());
    BENCH_CUDA(cudaMemcpyAsync(split.data() + world, counts_dev.as<int32_t>() + world, size_t(world) * 4,
                               cudaMemcpyDeviceToHost, stream));
    BENCH_CUDA(cudaStreamSynchronize(stream));
    std::vector<int64_t> send_at(static_cast<size_t>(world)), recv_at(size_t(world) + 1, 0);
    for (int p = 0; p < world; ++p) {
      send_at[size_t(p)] = off[size_t(p * e_local)];
      recv_at[size_t(p) + 1] = recv_at[size_t(p)] + split[size_t(world + p)];
    }
    const int64_t received = recv_at[size_t(world)];
    NC_OK(ncclGroupStart());
    for (int p = 0; p < world; ++p) {
      NC_OK(ncclSend(xperm.as<char>() + send_at[size_t(p)] * H * 2, size_t(split[size_t(p)]) * H * 2, ncclUint8, p,
                     comm, stream));
      NC_OK(ncclRecv(recv_x.as<char>() + recv_at[size_t(p)] * H * 2, size_t(split[size_t(world + p)]) * H * 2,
                     ncclUint8, p, comm, stream));
      NC_OK(ncclSend(eperm.as<int32_t>() + send_at[size_t(p)], size_t(split[size_t(p)]), ncclInt32, p, comm, stream));
      NC_OK(ncclRecv(recv_e.as<int32_t>() + recv_at[size_t(p)], size_t(split[size_t(world + p)]), ncclInt32, p, comm,
                     stream));
    }
    NC_OK(ncclGroupEnd());
    MoeForwardArgs e = expert;
    e.num_tokens = received;
    e.X = recv_x.p;
    e.token_selected_experts = recv_e.as<int32_t>();
    e.out = y.p;
    EP_OK(moe_forward(e, expert_ws.p, expert_ws.bytes, stream));
    NC_OK(ncclGroupStart());
    for (int p = 0; p < world; ++p) {
      NC_OK(ncclSend(y.as<char>() + recv_at[size_t(p)] * H * 2, size_t(split[size_t(world + p)]) * H * 2, ncclUint8, p,
                     comm, stream));
      NC_OK(ncclRecv(yback.as<char>() + send_at[size_t(p)] * H * 2, size_t(split[size_t(p)]) * H * 2, ncclUint8, p,
                     comm, stream));
    }
    NC_OK(ncclGroupEnd());
    FinalizeMoeRoutingArgs fin;
    fin.expanded_permuted_rows = yback.p;
    fin.num_rows = slots;
    fin.unpermuted_row_to_permuted_row = u2p.as<int32_t>();
    fin.token_selected_experts = dids.as<int32_t>();
    fin.scales = dw.as<float>();
    fin.num_tokens = T;
    fin.hidden = H;
    fin.k = sh.k;
    fin.start_expert_id = 0;
    fin.num_experts_per_node = sh.E;
    fin.out = ref.p;
    EP_OK(finalize_moe_routing(fin, stream));
  };
  const double t_ref = median_us(reference, stream, 2, iters(ctx));
  // The reference's experts alone, on what its last call received.
  double t_ref_local = 0;
  {
    MoeForwardArgs e = expert;
    e.num_tokens = 0;
    BENCH_CUDA(cudaStreamSynchronize(stream));
    std::vector<int32_t> got(size_t(2 * world));
    BENCH_CUDA(cudaMemcpy(got.data(), counts_dev.p, got.size() * 4, cudaMemcpyDeviceToHost));
    for (int p = 0; p < world; ++p) e.num_tokens += got[size_t(world + p)];
    e.X = recv_x.p;
    e.token_selected_experts = recv_e.as<int32_t>();
    e.out = y.p;
    t_ref_local = median_us([&] { EP_OK(moe_forward(e, expert_ws.p, expert_ws.bytes, stream)); }, stream, 2,
                            iters(ctx));
  }
  // Both computed the same layer: check ours against the reference (the
  // reference rounds once per token, ours once per rank's partial).
  std::vector<uint16_t> a(static_cast<size_t>(T * H)), b(size_t(T * H));
  BENCH_CUDA(cudaMemcpy(a.data(), out.p, a.size() * 2, cudaMemcpyDeviceToHost));
  BENCH_CUDA(cudaMemcpy(b.data(), ref.p, b.size() * 2, cudaMemcpyDeviceToHost));
  double max_ref = 0, worst = 0;
  for (uint16_t x : b) max_ref = std::max(max_ref, double(std::fabs(host::bf16_to_float(x))));
  int64_t bad = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double g = host::bf16_to_float(a[i]), f = host::bf16_to_float(b[i]);
    const double tol = std::ldexp(std::fabs(f), -7) + std::ldexp(max_ref, -7);
    bad += !(std::fabs(g - f) <= tol);
    worst = std::max(worst, std::fabs(g - f) / (max_ref > 0 ? max_ref : 1));
  }
  if (rank != 0) return;
  Record r;
  r.op = "ep_moe_forward";
  r.case_name = name;
  r.median_us = t;
  r.ceiling = "reference";
  r.fraction = t_ref / t;
  r.flops = 2.0 * 3.0 * double(slots) * double(I) * double(H);
  r.check = bad == 0 ? "passed" : "FAILED: " + std::to_string(bad) + " elements past 2^-7 |ref| + 2^-7 max|ref|";
  r.extra["reference_us"] = t_ref;
  r.extra["ratio_to_reference"] = t / t_ref;
  r.extra["experts_us"] = t_local;
  r.extra["reference_experts_us"] = t_ref_local;
  r.extra["max_abs_diff_over_max_ref"] = worst;
  if (t_graph > 0) r.extra["graph_us"] = t_graph;
  r.labels["transport"] = direct ? "direct (NVLink, ep_peers_create)" : "nccl";
  add_record(ctx, std::move(r));
}

void bench_reduce(Context& ctx, const Shape& sh, DType partial_dtype, const std::string& name, int rank, int world,
                  ncclComm_t comm, cudaStream_t stream) {
  const int e_local = sh.E / world;
  const int64_t T = sh.T, H = sh.H, k = sh.k;
  std::vector<int32_t> ids;
  std::vector<float> w;
  random_topk(T, sh.k, sh.E, 3000, ids, w);  // the same tokens on every rank
  Buf rows(size_t(k * T * H * 2)), dids(ids.size() * 4), dw(w.size() * 4), u2p(size_t(k * T) * 4),
      p2u(size_t(k * T) * 4), offsets(size_t(e_local + 1) * 8), out(size_t(T / world * H * 2));
  fill_bf16(rows.p, k * T * H, 41 + rank, 1.f, stream);
  BENCH_CUDA(cudaMemcpy(dids.p, ids.data(), dids.bytes, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(dw.p, w.data(), dw.bytes, cudaMemcpyHostToDevice));
  MoeRoutingArgs maps;
  maps.token_selected_experts = dids.as<int32_t>();
  maps.num_tokens = T;
  maps.k = sh.k;
  maps.start_expert_id = rank * e_local;
  maps.num_experts_per_node = e_local;
  maps.expert_first_token_offset = offsets.as<int64_t>();
  maps.permuted_row_to_unpermuted_row = p2u.as<int32_t>();
  maps.unpermuted_row_to_permuted_row = u2p.as<int32_t>();
  Buf maps_ws(build_moe_routing_maps_workspace_size(maps));
  EP_OK(build_moe_routing_maps(maps, maps_ws.p, maps_ws.bytes, stream));
  FinalizeMoeRoutingArgs fin;
  fin.expanded_permuted_rows = rows.p;
  fin.num_rows = k * T;
  fin.unpermuted_row_to_permuted_row = u2p.as<int32_t>();
  fin.token_selected_experts = dids.as<int32_t>();
  fin.scales = dw.as<float>();
  fin.num_tokens = T;
  fin.hidden = H;
  fin.k = sh.k;
  fin.start_expert_id = rank * e_local;
  fin.num_experts_per_node = e_local;
  EpFinalizeReduceArgs a;
  a.finalize = fin;
  a.reduce = EpReduce::kReduceScatter;
  a.partial_dtype = partial_dtype;
  a.out = out.p;
  Buf ws(ep_finalize_reduce_workspace_size(a, world));
  const double t = median_us([&] { EP_OK(ep_finalize_reduce(a, comm, ws.p, ws.bytes, stream)); }, stream, 3,
                             iters(ctx));
  // Apart: the local no-fill finalize into a partial of the same dtype, and
  // NCCL's reduce_scatter of that partial.
  const size_t esize = dtype_size(partial_dtype);
  Buf partial(size_t(T * H) * esize), summed(size_t(T / world * H) * esize);
  BENCH_CUDA(cudaMemsetAsync(partial.p, 0, partial.bytes, stream));
  FinalizeMoeRoutingArgs nofill = fin;
  nofill.fill = false;
  nofill.permuted_row_to_unpermuted_row = p2u.as<int32_t>();
  nofill.expert_first_token_offset = offsets.as<int64_t>();
  nofill.out = partial.p;
  nofill.out_dtype = partial_dtype;
  const double t_fin = median_us([&] { EP_OK(finalize_moe_routing(nofill, stream)); }, stream, 3, iters(ctx));
  const ncclDataType_t nt = partial_dtype == DType::kFloat32 ? ncclFloat32 : ncclBfloat16;
  const double t_rs = median_us(
      [&] { NC_OK(ncclReduceScatter(partial.p, summed.p, size_t(T / world * H), nt, ncclSum, comm, stream)); }, stream,
      3, iters(ctx));
  if (rank != 0) return;
  Record r;
  r.op = "ep_reduce";
  r.case_name = name;
  r.median_us = t;
  r.ceiling = "nccl_reduce_scatter+finalize";
  r.fraction = (t_fin + t_rs) / t;
  r.bytes = double(T * H) * double(esize);
  r.check = "not checked here (tests/gpu/test_ep_gpu.cu)";
  r.extra["finalize_us"] = t_fin;
  r.extra["reduce_scatter_us"] = t_rs;
  r.extra["ratio"] = t / (t_fin + t_rs);
  r.labels["partial"] = to_string(partial_dtype);
  add_record(ctx, std::move(r));
}

int rank_main(Context ctx, const std::string& json_path, int rank, int world, ncclComm_t comm) {
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaDeviceProp prop;
  BENCH_CUDA(cudaGetDeviceProperties(&prop, rank));
  ctx.gpu = true;
  ctx.gpu_name = prop.name;
  ctx.num_sms = prop.multiProcessorCount;
  ctx.l2_bytes = prop.l2CacheSize;
  if (rank == 0) {
    ctx.copy_gbps = measure_copy_gbps(stream, 10);
    std::printf("flashmix-bench-ep on %d x %s, commit %s, %s; copy %.1f GB/s\n", world, prop.name,
                ctx.commit.c_str(), ctx.date.c_str(), ctx.copy_gbps);
    print_header();
  }
  const std::string ep = "_ep" + std::to_string(world);
  const Shape deepseek{4096, 8, 256, 2048, 7168};
  auto want = [&](const char* op, const std::string& name) { return ctx.selected(op, name); };
  std::string n = "deepseek_T4096_k8_E256_H7168" + ep;
  // Each case over NCCL, and with the suffix _direct over the direct transport.
  for (bool direct : {false, true}) {
    const std::string via = direct ? "_direct" : "";
    if (want("ep_dispatch_combine", n + via))
      bench_dispatch_combine(ctx, deepseek, EpSizing::kCapacity, false, direct, false, n + via, rank, world, comm,
                             stream);
    if (!direct && want("ep_dispatch_combine", n + "_exact"))
      bench_dispatch_combine(ctx, deepseek, EpSizing::kExact, false, false, false, n + "_exact", rank, world, comm,
                             stream);
    if (want("ep_dispatch_combine", n + "_fp8" + via))
      bench_dispatch_combine(ctx, deepseek, EpSizing::kCapacity, true, direct, false, n + "_fp8" + via, rank, world,
                             comm, stream);
  }
  const Shape decode{16, 8, 256, 2048, 7168};
  n = "deepseek_T16_k8_E256_H7168" + ep;
  for (bool graph : {false, true})
    for (bool direct : {false, true}) {
      const std::string name = n + (graph ? "_graph" : "") + (direct ? "_direct" : "");
      if (want("ep_dispatch_combine", name))
        bench_dispatch_combine(ctx, decode, EpSizing::kCapacity, false, direct, graph, name, rank, world, comm, stream);
    }
  for (const Shape& sh : {deepseek, Shape{16, 8, 256, 2048, 7168}}) {
    n = "deepseek_T" + std::to_string(sh.T) + "_k8_E256_I2048_H7168" + ep;
    for (bool direct : {false, true})
      if (want("ep_moe_forward", n + (direct ? "_direct" : "")))
        bench_moe_forward(ctx, sh, direct, n + (direct ? "_direct" : ""), rank, world, comm, stream);
  }
  n = "T4096_H7168" + ep;
  if (want("ep_reduce", n)) bench_reduce(ctx, deepseek, DType::kFloat32, n, rank, world, comm, stream);
  if (want("ep_reduce", n + "_bf16partial"))
    bench_reduce(ctx, deepseek, DType::kBFloat16, n + "_bf16partial", rank, world, comm, stream);
  BENCH_CUDA(cudaStreamDestroy(stream));
  if (rank != 0) return 0;
  int failed = 0;
  for (const auto& r : ctx.records) failed += r.check.rfind("FAILED", 0) == 0;
  if (!json_path.empty()) {
    if (!write_json(ctx, json_path)) return 2;
    std::printf("wrote %s\n", json_path.c_str());
  }
  std::printf("%zu cases, %d failed checks\n", ctx.records.size(), failed);
  return failed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  Context ctx;
  std::string json_path;
  int world = 2;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json_path = argv[++i];
    else if (!std::strcmp(argv[i], "--filter") && i + 1 < argc) ctx.filter = argv[++i];
    else if (!std::strcmp(argv[i], "--world") && i + 1 < argc) world = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--quick")) ctx.quick = true;
    else {
      std::fprintf(stderr, "usage: %s [--json FILE] [--filter TEXT] [--world N] [--quick]\n", argv[0]);
      return 2;
    }
  }
  std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  ctx.date = date;
  ctx.commit = FLASHMIX_GIT_COMMIT;
  const int gpus = flashmix::testing::gpu_count_in_child();
  if (gpus < world) {
    std::printf("flashmix-bench-ep: needs %d GPUs, found %d: nothing to measure\n", world, gpus);
    return 0;
  }
  const auto r = flashmix::testing::run_ranks(
      world, 1800, [&](int rank, int w, ncclComm_t comm) { return rank_main(ctx, json_path, rank, w, comm); });
  if (!r.ok()) std::fprintf(stderr, "flashmix-bench-ep: %s\n", r.describe().c_str());
  return r.ok() ? 0 : 1;
}
