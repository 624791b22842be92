// flashmix_ep's entry points (spec §14): host checks, the NCCL transport, and
// the ops chained on the caller's stream.
//
// Every rank must make the same NCCL calls in the same order, so everything
// that can refuse a call (argument checks, the size of the workspace, the
// experts' own validation) is checked before the first launch or NCCL call:
// a bad argument returns on every rank that sees it without entering NCCL
// (the caller sees the error; ranks that passed their checks would wait in
// NCCL for it, which no library can prevent).
#include <cstdint>
#include <vector>

#include "common/check.h"
#include "common/kernel_fit.h"
#include "ep/ep_internal.h"
#include "flashmix/ep.h"
#include "flashmix/fp8.h"

namespace flashmix {
namespace ep {
namespace {

Status nccl_status(ncclResult_t r, const char* op, const char* what) {
  if (r == ncclSuccess) return Status::Ok();
  return Status(StatusCode::kCommError, detail::concat(op, ": ", what, ": ", ncclGetErrorString(r)));
}

#define EP_NCCL(expr, op, what) FM_RETURN_IF_ERROR(nccl_status((expr), op, what))
#define EP_CUDA(expr, op, what) FM_RETURN_IF_ERROR(detail::cuda_status((expr), op, what))

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Rows of the caller's [T, stride] bf16 matrix: 16-byte aligned, stride a
// multiple of 8 and >= H.
Status check_rows(const char* op, const char* name, const void* p, int64_t stride, int64_t H, bool required) {
  if (p == nullptr) {
    FM_REQUIRE(!required, op, name, "must not be null");
    return Status::Ok();
  }
  FM_REQUIRE(aligned16(p), op, name, "must be 16-byte aligned");
  FM_REQUIRE(stride >= H && stride % 8 == 0, op, name, "stride must be >= hidden (", H,
             ") and a multiple of 8 (got ", stride, ")");
  return Status::Ok();
}

int64_t or_hidden(int64_t stride, int64_t H) { return stride == 0 ? H : stride; }

// fp8_rows: this rank's X -> e4m3 [T, H] + fp32 scales [T, H / 128] in the
// workspace (quantize_fp8, 1 x 128; spec §11), what the pack sends.
QuantizeFp8Args quantise_rows(const EpDispatchArgs& a, const Layout& l, char* ws) {
  QuantizeFp8Args q;
  q.x = a.X;
  q.x_stride = a.x_stride;
  q.q = ws ? ws + l.x_q : nullptr;
  q.scales = ws ? ws + l.x_q_scales : nullptr;
  q.rows = a.num_tokens;
  q.cols = a.shape.hidden;
  q.block = Fp8Block::k1x128;
  q.scale_format = ScaleFormat::kFloat32;
  return q;
}

// The shape, and this rank's T within its bound.
Status check_shape_and_tokens(const char* op, const EpShape& shape, int64_t T, ncclComm_t comm) {
  FM_RETURN_IF_ERROR(check_shape(op, shape, comm));
  FM_REQUIRE(T >= 0 && T <= shape.max_tokens_per_rank, op, "num_tokens", "must be in [0, shape.max_tokens_per_rank = ",
             shape.max_tokens_per_rank, "] (got ", T, ")");
  return Status::Ok();
}

Status check_dispatch(const EpDispatchArgs& a, ncclComm_t comm) {
  constexpr const char* op = kDispatchOp;
  FM_RETURN_IF_ERROR(check_shape_and_tokens(op, a.shape, a.num_tokens, comm));
  if (a.num_tokens == 0) return Status::Ok();
  FM_RETURN_IF_ERROR(check_rows(op, "X", a.X, or_hidden(a.x_stride, a.shape.hidden), a.shape.hidden, true));
  FM_REQUIRE(a.topk_ids != nullptr, op, "topk_ids", "must not be null");
  FM_REQUIRE(a.topk_weights != nullptr, op, "topk_weights", "must not be null");
  if (a.shape.fp8_rows) {
    // The quantiser's own rules on X, at a placeholder workspace (2^62: no caller buffer is there).
    char* const placeholder = reinterpret_cast<char*>(uintptr_t(1) << 62);
    const Status st = validate_quantize_fp8(quantise_rows(a, layout(a.shape), placeholder));
    if (!st.ok()) return Status(st.code(), detail::concat(op, ": ", st.message()));
  }
  return Status::Ok();
}

// The workspace (which dispatch writes) and `dropped` share no byte with the
// caller's inputs or with each other.
Status check_dispatch_inputs_apart(const EpDispatchArgs& a, const void* ws, size_t ws_bytes) {
  const int64_t T = a.num_tokens, H = a.shape.hidden, k = a.shape.k;
  const detail::Range outs[] = {{"workspace", ws, int64_t(ws_bytes)}, {"dropped", a.dropped, a.dropped ? 4 : 0}};
  const detail::Range ins[] = {{"X", a.X, detail::rows_extent_bytes(T, or_hidden(a.x_stride, H), H, 2)},
                               {"topk_ids", a.topk_ids, T * k * 4},
                               {"topk_weights", a.topk_weights, T * k * 4}};
  return detail::check_no_overlap(kDispatchOp, outs, ins);
}

Status check_combine(const EpCombineArgs& a, ncclComm_t comm) {
  constexpr const char* op = kCombineOp;
  FM_RETURN_IF_ERROR(check_shape_and_tokens(op, a.shape, a.num_tokens, comm));
  if (a.num_tokens == 0) return Status::Ok();
  const int64_t H = a.shape.hidden;
  FM_RETURN_IF_ERROR(check_rows(op, "out", a.out, or_hidden(a.out_stride, H), H, true));
  FM_RETURN_IF_ERROR(check_rows(op, "shared_output", a.shared_output, or_hidden(a.shared_stride, H), H, false));
  const int64_t out_bytes = detail::rows_extent_bytes(a.num_tokens, or_hidden(a.out_stride, H), H, 2);
  const detail::Range outs[] = {{"out", a.out, out_bytes}};
  const detail::Range ins[] = {
      {"shared_output", a.shared_output,
       detail::rows_extent_bytes(a.num_tokens, or_hidden(a.shared_stride, H), H, 2)}};
  return detail::check_no_overlap(op, outs, ins);
}

// Counts on the host for kExact: what this rank sends to each rank and what
// it receives from each (both cut at C). One stream sync.
struct HostCounts {
  std::vector<int32_t> sent, received;
};

Status read_counts(const EpShape& s, const Layout& l, const char* ws, HostCounts* h, cudaStream_t stream,
                   const char* op) {
  const int W = s.world;
  std::vector<int32_t> headers(size_t(W), 0);
  h->sent.assign(size_t(W), 0);
  EP_CUDA(cudaMemcpyAsync(h->sent.data(), ws + l.plan_counts, size_t(W) * 4, cudaMemcpyDeviceToHost, stream), op,
          "copying the counts");
  for (int d = 0; d < W; ++d)
    EP_CUDA(cudaMemcpyAsync(&headers[size_t(d)], ws + l.recv_meta + size_t(d) * l.meta_stride, 4,
                            cudaMemcpyDeviceToHost, stream),
            op, "copying the counts");
  EP_CUDA(cudaStreamSynchronize(stream), op, "synchronising for the counts (kExact)");
  h->received.resize(size_t(W));
  for (int d = 0; d < W; ++d) {
    h->sent[size_t(d)] = int32_t(std::min<int64_t>(h->sent[size_t(d)], l.C));
    h->received[size_t(d)] = int32_t(std::min<int64_t>(headers[size_t(d)], l.C));
  }
  return Status::Ok();
}

// The headers of the meta slabs only (kExact's count exchange).
Status exchange_headers(const EpShape& s, const Layout& l, char* ws, ncclComm_t comm, cudaStream_t stream,
                        const char* op) {
  EP_NCCL(ncclGroupStart(), op, "ncclGroupStart");
  for (int p = 0; p < s.world; ++p) {
    if (p == s.rank) continue;
    EP_NCCL(ncclSend(ws + l.send_meta + size_t(peer_slot(p, s.rank)) * l.meta_stride, kMetaHeaderBytes, ncclUint8,
                     p, comm, stream),
            op, "ncclSend");
    EP_NCCL(ncclRecv(ws + l.recv_meta + size_t(p) * l.meta_stride, kMetaHeaderBytes, ncclUint8, p, comm, stream),
            op, "ncclRecv");
  }
  return nccl_status(ncclGroupEnd(), op, "ncclGroupEnd");
}

// Rows [lo, hi) of a slab.
struct Span {
  size_t lo = 0, hi = 0;
};

// What one exchange moves with each peer p: rows send[p] of the slab for p,
// rows recv[p] of the slab from p.
struct Spans {
  std::vector<Span> send, recv;
};

// kCapacity: rows [lo, hi) of every slab, both ways.
Spans fixed_spans(const EpShape& s, size_t lo, size_t hi) {
  Spans x;
  x.send.assign(size_t(s.world), Span{lo, hi});
  x.recv = x.send;
  return x;
}

// kExact: the rows that exist. Dispatch sends what this rank has for p and
// receives what p has for it; combine the reverse.
Spans exact_spans(const HostCounts& c, bool combine) {
  Spans x;
  for (size_t p = 0; p < c.sent.size(); ++p) {
    const Span to{0, size_t(c.sent[p])}, from{0, size_t(c.received[p])};
    x.send.push_back(combine ? from : to);
    x.recv.push_back(combine ? to : from);
  }
  return x;
}

// Dispatch's transport: the meta rows and the rows of each span, and the
// meta slab's header with spans that start at row 0 when `header`.
Status exchange_dispatch(const EpShape& s, const Layout& l, char* ws, const Spans& x, bool header, ncclComm_t comm,
                         cudaStream_t stream, const char* op) {
  const size_t row_bytes = in_row_bytes(s), meta_row = meta_row_bytes(s);
  auto meta_begin = [&](const Span& r) { return kMetaHeaderBytes + r.lo * meta_row - (header && r.lo == 0 ? kMetaHeaderBytes : 0); };
  auto meta_end = [&](const Span& r) { return kMetaHeaderBytes + r.hi * meta_row; };
  EP_NCCL(ncclGroupStart(), op, "ncclGroupStart");
  for (int p = 0; p < s.world; ++p) {
    if (p == s.rank) continue;
    const Span& out = x.send[size_t(p)];
    const Span& in = x.recv[size_t(p)];
    char* send_meta = ws + l.send_meta + size_t(peer_slot(p, s.rank)) * l.meta_stride;
    char* recv_meta = ws + l.recv_meta + size_t(p) * l.meta_stride;
    char* send_rows = ws + l.send_rows + size_t(peer_slot(p, s.rank)) * l.in_stride;
    char* recv_rows = ws + l.recv_x + size_t(p) * l.in_stride;
    EP_NCCL(ncclSend(send_meta + meta_begin(out), meta_end(out) - meta_begin(out), ncclUint8, p, comm, stream), op,
            "ncclSend");
    EP_NCCL(ncclRecv(recv_meta + meta_begin(in), meta_end(in) - meta_begin(in), ncclUint8, p, comm, stream), op,
            "ncclRecv");
    EP_NCCL(ncclSend(send_rows + out.lo * row_bytes, (out.hi - out.lo) * row_bytes, ncclUint8, p, comm, stream), op,
            "ncclSend");
    EP_NCCL(ncclRecv(recv_rows + in.lo * row_bytes, (in.hi - in.lo) * row_bytes, ncclUint8, p, comm, stream), op,
            "ncclRecv");
  }
  return nccl_status(ncclGroupEnd(), op, "ncclGroupEnd");
}

// Combine's transport: rows of expert_out's slab p back to rank p; the rows
// this rank's tokens got on p into comb slab p.
Status exchange_combine(const EpShape& s, const Layout& l, char* ws, const Spans& x, ncclComm_t comm,
                        cudaStream_t stream, const char* op) {
  const size_t row_bytes = size_t(s.hidden) * 2;
  EP_NCCL(ncclGroupStart(), op, "ncclGroupStart");
  for (int p = 0; p < s.world; ++p) {
    if (p == s.rank) continue;
    const Span& out = x.send[size_t(p)];
    const Span& in = x.recv[size_t(p)];
    EP_NCCL(ncclSend(ws + l.expert_out + size_t(p) * l.rows_stride + out.lo * row_bytes,
                     (out.hi - out.lo) * row_bytes, ncclUint8, p, comm, stream),
            op, "ncclSend");
    EP_NCCL(ncclRecv(ws + l.comb_rows + size_t(peer_slot(p, s.rank)) * l.rows_stride + in.lo * row_bytes,
                     (in.hi - in.lo) * row_bytes, ncclUint8, p, comm, stream),
            op, "ncclRecv");
  }
  return nccl_status(ncclGroupEnd(), op, "ncclGroupEnd");
}

// With the direct transport (a.peers) plan and pack write into the peers'
// receive slabs and the handshake replaces NCCL: no host sync in any sizing.
Status dispatch_body(const EpDispatchArgs& a, ncclComm_t comm, char* ws, const Layout& l, cudaStream_t stream) {
  constexpr const char* op = kDispatchOp;
  const EpShape& s = a.shape;
  const PeerBases peers = peer_bases(a.peers);
  // The rows that travel: X as it is, or with fp8_rows its 1 x 128 e4m3
  // codes and scales, quantised into the workspace first.
  const void* rows = a.X;
  int64_t rows_stride_bytes = or_hidden(a.x_stride, s.hidden) * 2;
  const float* row_scales = nullptr;
  if (s.fp8_rows) {
    if (a.num_tokens > 0) {
      const Status st = quantize_fp8(quantise_rows(a, l, ws), stream);
      if (!st.ok()) return Status(st.code(), detail::concat(op, ": ", st.message()));
    }
    rows = ws + l.x_q;
    rows_stride_bytes = s.hidden;
    row_scales = reinterpret_cast<const float*>(ws + l.x_q_scales);
  }
  // Decode-sized calls on the direct transport: one kernel does plan, pack,
  // handshake and unpack.
  if (a.peers != nullptr && use_fused_direct(s, a.num_tokens)) {
    EP_CUDA(launch_dispatch_fused(s, l, ws, peers, a.num_tokens, rows, rows_stride_bytes, row_scales, a.topk_ids,
                                  a.topk_weights, a.dropped, stream),
            op, "fused dispatch kernel launch");
    return Status::Ok();
  }
  if (a.dropped != nullptr) EP_CUDA(cudaMemsetAsync(a.dropped, 0, sizeof(int32_t), stream), op, "zeroing dropped");
  EP_CUDA(launch_plan(s, l, ws, peers, a.num_tokens, a.topk_ids, a.dropped, stream), op, "plan kernel launch");
  EP_CUDA(launch_pack(s, l, ws, peers, a.num_tokens, rows, rows_stride_bytes, row_scales, a.topk_ids, a.topk_weights,
                      stream),
          op, "pack kernel launch");
  if (a.peers != nullptr) {
    EP_CUDA(launch_handshake(s, l, ws, peers, kSyncDispatch, stream), op, "handshake kernel launch");
  } else if (s.sizing == EpSizing::kExact) {
    FM_RETURN_IF_ERROR(exchange_headers(s, l, ws, comm, stream, op));
    HostCounts counts;
    FM_RETURN_IF_ERROR(read_counts(s, l, ws, &counts, stream, op));
    FM_RETURN_IF_ERROR(exchange_dispatch(s, l, ws, exact_spans(counts, false), false, comm, stream, op));
  } else {
    FM_RETURN_IF_ERROR(exchange_dispatch(s, l, ws, fixed_spans(s, 0, size_t(l.C)), true, comm, stream, op));
  }
  EP_CUDA(launch_unpack(s, l, ws, stream), op, "unpack kernel launch");
  return Status::Ok();
}

Status combine_body(const EpCombineArgs& a, ncclComm_t comm, char* ws, const Layout& l, cudaStream_t stream) {
  constexpr const char* op = kCombineOp;
  const EpShape& s = a.shape;
  const PeerBases peers = peer_bases(a.peers);
  const int64_t H = s.hidden;
  if (a.peers != nullptr && use_fused_direct(s, a.num_tokens)) {
    EP_CUDA(launch_combine_fused(s, l, ws, peers, a.num_tokens, a.shared_output, or_hidden(a.shared_stride, H), a.out,
                                 or_hidden(a.out_stride, H), stream),
            op, "fused combine kernel launch");
    return Status::Ok();
  }
  if (a.peers != nullptr) {
    // Every rank's expert_out is complete; the reduce reads the peers' slabs.
    EP_CUDA(launch_handshake(s, l, ws, peers, kSyncCombine, stream), op, "handshake kernel launch");
  } else if (s.sizing == EpSizing::kExact) {
    HostCounts counts;
    FM_RETURN_IF_ERROR(read_counts(s, l, ws, &counts, stream, op));
    FM_RETURN_IF_ERROR(exchange_combine(s, l, ws, exact_spans(counts, true), comm, stream, op));
  } else {
    FM_RETURN_IF_ERROR(exchange_combine(s, l, ws, fixed_spans(s, 0, size_t(l.C)), comm, stream, op));
  }
  EP_CUDA(launch_combine_reduce(s, l, ws, peers, a.num_tokens, a.shared_output, or_hidden(a.shared_stride, H), a.out,
                                or_hidden(a.out_stride, H), stream),
          op, "combine kernel launch");
  return Status::Ok();
}

// moe_forward over the received rows: this rank's experts, one output row per
// received row (its local slots summed), rows past the counts skipped.
MoeForwardArgs local_experts(const EpMoeForwardArgs& a, const EpRecvView& v) {
  const EpShape& s = a.shape;
  MoeForwardArgs m = a.moe;
  m.num_tokens = v.rows;
  m.hidden = s.hidden;
  m.k = s.k;
  m.num_experts = s.num_experts;
  m.num_experts_per_node = s.num_experts / s.world;
  m.start_expert_id = s.rank * m.num_experts_per_node;
  m.X = v.x;
  m.x_stride = s.hidden;
  m.x_scales = v.x_scales;  // fp8_rows: X arrived quantised (null otherwise)
  m.router_logits = nullptr;
  m.token_selected_experts = v.ids;
  m.token_final_scales = v.weights;
  m.selected_experts_out = nullptr;
  m.final_scales_out = nullptr;
  m.shared_output = nullptr;
  m.shared_stride = 0;
  m.fill = false;  // every real row has a local slot; the padding rows are never read back
  m.out = v.expert_out;
  m.out_stride = s.hidden;
  return m;
}

}  // namespace
}  // namespace ep

Status ep_dispatch(const EpDispatchArgs& a, ncclComm_t comm, void* workspace, size_t workspace_bytes,
                   cudaStream_t stream) {
  using namespace ep;
  FM_REQUIRE(comm != nullptr, kDispatchOp, "comm", "must not be null");
  FM_RETURN_IF_ERROR(check_dispatch(a, comm));
  const Layout l = layout(a.shape);
  FM_RETURN_IF_ERROR(check_workspace(kDispatchOp, workspace, workspace_bytes, l.total, "ep_workspace_size"));
  FM_RETURN_IF_ERROR(check_dispatch_inputs_apart(a, workspace, l.total));
  FM_RETURN_IF_ERROR(check_peers(kDispatchOp, a.peers, a.shape, workspace));
  return detail::without_cuda_error_left(kDispatchOp, [&]() -> Status {
    FM_RETURN_IF_ERROR(detail::check_stream(stream, kDispatchOp));
    return dispatch_body(a, comm, static_cast<char*>(workspace), l, stream);
  });
}

Status ep_combine(const EpCombineArgs& a, ncclComm_t comm, void* workspace, size_t workspace_bytes,
                  cudaStream_t stream) {
  using namespace ep;
  FM_REQUIRE(comm != nullptr, kCombineOp, "comm", "must not be null");
  FM_RETURN_IF_ERROR(check_combine(a, comm));
  const Layout l = layout(a.shape);
  FM_RETURN_IF_ERROR(check_workspace(kCombineOp, workspace, workspace_bytes, l.total, "ep_workspace_size"));
  const detail::Range outs[] = {{"out", a.out,
                                 detail::rows_extent_bytes(a.num_tokens, or_hidden(a.out_stride, a.shape.hidden),
                                                           a.shape.hidden, 2)}};
  const detail::Range ins[] = {{"workspace", workspace, int64_t(l.total)}};
  FM_RETURN_IF_ERROR(detail::check_no_overlap(kCombineOp, outs, ins));
  FM_RETURN_IF_ERROR(check_peers(kCombineOp, a.peers, a.shape, workspace));
  return detail::without_cuda_error_left(kCombineOp, [&]() -> Status {
    FM_RETURN_IF_ERROR(detail::check_stream(stream, kCombineOp));
    return combine_body(a, comm, static_cast<char*>(workspace), l, stream);
  });
}

size_t ep_moe_forward_workspace_size(const EpMoeForwardArgs& a) {
  using namespace ep;
  if (!check_shape(kForwardOp, a.shape, nullptr).ok()) return 0;
  const Layout l = layout(a.shape);
  // The experts' workspace follows ours; its size does not depend on where it is.
  char* const placeholder = reinterpret_cast<char*>(uintptr_t(1) << 62);
  const size_t moe = moe_forward_workspace_size(local_experts(a, ep_recv_view(a.shape, placeholder)));
  if (moe == 0) return 0;
  return l.total + moe;
}

Status ep_moe_forward(const EpMoeForwardArgs& a, ncclComm_t comm, void* workspace, size_t workspace_bytes,
                      cudaStream_t stream) {
  using namespace ep;
  constexpr const char* op = kForwardOp;
  FM_REQUIRE(comm != nullptr, op, "comm", "must not be null");
  EpDispatchArgs d;
  d.shape = a.shape;
  d.num_tokens = a.num_tokens;
  d.X = a.X;
  d.x_stride = a.x_stride;
  d.topk_ids = a.topk_ids;
  d.topk_weights = a.topk_weights;
  d.dropped = a.dropped;
  d.peers = a.peers;
  EpCombineArgs c;
  c.shape = a.shape;
  c.num_tokens = a.num_tokens;
  c.shared_output = a.shared_output;
  c.shared_stride = a.shared_stride;
  c.out = a.out;
  c.out_stride = a.out_stride;
  c.peers = a.peers;
  FM_RETURN_IF_ERROR(check_dispatch(d, comm));
  FM_RETURN_IF_ERROR(check_combine(c, comm));
  const Layout l = layout(a.shape);
  // 0 when the local experts' arguments are bad: validate_moe_forward below names the argument.
  const size_t needed = ep_moe_forward_workspace_size(a);
  FM_RETURN_IF_ERROR(check_workspace(op, workspace, workspace_bytes, needed, "ep_moe_forward_workspace_size"));
  FM_REQUIRE(!a.shape.fp8_rows || a.moe.fp8 == MoeFp8Scaling::kBlock, op, "shape.fp8_rows",
             "FP8 rows go to the FP8 layer: needs moe.fp8 = block");
  const EpRecvView v = ep_recv_view(a.shape, workspace);
  const MoeForwardArgs m = local_experts(a, v);
  {
    const Status st = validate_moe_forward(m);
    if (!st.ok()) return Status(st.code(), detail::concat(op, ": the local experts: ", st.message()));
  }
  const size_t moe_bytes = needed - l.total;
  {
    const Status st = check_dispatch_inputs_apart(d, workspace, l.total + moe_bytes);
    if (!st.ok()) return Status(st.code(), detail::concat(op, ": ", st.message()));
  }
  const detail::Range outs[] = {{"out", a.out, detail::rows_extent_bytes(a.num_tokens, or_hidden(a.out_stride,
                                a.shape.hidden), a.shape.hidden, 2)}};
  const detail::Range ins[] = {{"workspace", workspace, int64_t(l.total + moe_bytes)},
                               {"X", a.X, detail::rows_extent_bytes(a.num_tokens, or_hidden(a.x_stride, a.shape.hidden),
                                                                     a.shape.hidden, 2)}};
  FM_RETURN_IF_ERROR(detail::check_no_overlap(op, outs, ins));
  FM_RETURN_IF_ERROR(check_peers(op, a.peers, a.shape, workspace));
  detail::DeviceProps dev;
  FM_RETURN_IF_ERROR(detail::cuda_status(detail::current_device_props(&dev), op, "device properties"));
  FM_REQUIRE_SUPPORTED(dev.cc_major == 9, op, "device", "needs an sm_90 (Hopper) GPU (compute capability ",
                       dev.cc_major, ".x)");
  char* ws = static_cast<char*>(workspace);
  return detail::without_cuda_error_left(op, [&]() -> Status {
    FM_RETURN_IF_ERROR(detail::check_stream(stream, op));
    FM_RETURN_IF_ERROR(dispatch_body(d, comm, ws, l, stream));
    {
      const Status st = moe_forward(m, ws + l.total, moe_bytes, stream);
      if (!st.ok()) return Status(st.code(), detail::concat(op, ": the local experts: ", st.message()));
    }
    return combine_body(c, comm, ws, l, stream);
  });
}

}  // namespace flashmix
