// flashmix_ep's host side without a transport: the shape's rules, the
// workspace layout every rank derives from it (spec §14.3), and the size
// queries.
#include <cstdint>

#include "common/check.h"
#include "ep/ep_internal.h"

namespace flashmix {
namespace ep {

Status check_shape(const char* op, const EpShape& s, ncclComm_t comm) {
  FM_REQUIRE(s.world >= 1, op, "shape.world", "must be >= 1 (got ", s.world, ")");
  FM_REQUIRE(s.rank >= 0 && s.rank < s.world, op, "shape.rank", "must be in [0, world = ", s.world, ") (got ",
             s.rank, ")");
  FM_REQUIRE(s.hidden >= 8 && s.hidden % 8 == 0, op, "shape.hidden",
             "must be a positive multiple of 8 (rows move as 16-byte words; got ", s.hidden, ")");
  FM_REQUIRE(s.k >= 1 && s.k <= 16, op, "shape.k", "must be in [1, 16] (got ", s.k, ")");
  FM_REQUIRE(s.num_experts >= s.world && s.num_experts % s.world == 0, op, "shape.num_experts",
             "must be a positive multiple of world = ", s.world, " (every rank holds E / W experts; got ",
             s.num_experts, ")");
  FM_REQUIRE(s.max_tokens_per_rank >= 1, op, "shape.max_tokens_per_rank", "must be >= 1 (got ",
             s.max_tokens_per_rank, ")");
  FM_REQUIRE(s.recv_capacity >= 0 && s.recv_capacity <= s.max_tokens_per_rank, op, "shape.recv_capacity",
             "must be in [0, max_tokens_per_rank = ", s.max_tokens_per_rank, "] (0 means max_tokens_per_rank; got ",
             s.recv_capacity, ")");
  const int64_t C = ep_recv_capacity(s);
  FM_REQUIRE(int64_t(s.world) * s.max_tokens_per_rank <= detail::kInt32Max &&
                 int64_t(s.world) * C * s.k <= detail::kInt32Max,
             op, "shape", "world * max_tokens_per_rank and world * recv_capacity * k must fit int32 (got W = ",
             s.world, ", T_max = ", s.max_tokens_per_rank, ", C = ", C, ", k = ", s.k, ")");
  if (s.fp8_rows)
    FM_REQUIRE(s.hidden % 128 == 0, op, "shape.hidden",
               "must be a multiple of 128 with fp8_rows (rows are quantised 1 x 128; got ", s.hidden, ")");
  const int sz = int(s.sizing);
  FM_REQUIRE(sz == int(EpSizing::kCapacity) || sz == int(EpSizing::kExact), op, "shape.sizing",
             "unknown EpSizing value ", sz);
  if (comm != nullptr) {
    int n = 0, r = 0;
    FM_REQUIRE(ncclCommCount(comm, &n) == ncclSuccess && ncclCommUserRank(comm, &r) == ncclSuccess, op, "comm",
               "NCCL could not report the communicator's size and rank (not a valid ncclComm_t?)");
    FM_REQUIRE(n == s.world && r == s.rank, op, "comm", "is rank ", r, " of ", n, " but the shape says rank ",
               s.rank, " of ", s.world);
  }
  return Status::Ok();
}

Status check_workspace(const char* op, const void* ws, size_t bytes, size_t needed, const char* size_query) {
  FM_REQUIRE(bytes >= needed, op, "workspace_bytes", "too small: ", bytes, " < ", needed, " (ask ", size_query, ")");
  FM_REQUIRE(ws != nullptr, op, "workspace", "must not be null");
  FM_REQUIRE(reinterpret_cast<uintptr_t>(ws) % 256 == 0, op, "workspace", "must be 256-byte aligned");
  return Status::Ok();
}

Layout layout(const EpShape& s) {
  Layout l;
  const int W = s.world;
  l.C = ep_recv_capacity(s);
  l.T_max = s.max_tokens_per_rank;
  l.meta_stride = align256(kMetaHeaderBytes + size_t(l.C) * meta_row_bytes(s));
  l.in_stride = size_t(l.C) * in_row_bytes(s);         // slabs back to back: [W*C, H] is one matrix
  l.rows_stride = size_t(l.C) * size_t(s.hidden) * 2;  // the same for the experts' bf16 output
  size_t at = 0;
  auto region = [&](size_t bytes) {
    const size_t off = at;
    at = align256(at + bytes);
    return off;
  };
  const size_t scales = size_t(scale_cols(s)) * 4;  // bytes of a row's scales (0 without fp8_rows)
  l.x_q = region(s.fp8_rows ? size_t(l.T_max) * size_t(s.hidden) : 0);
  l.x_q_scales = region(size_t(l.T_max) * scales);
  l.plan_row = region(size_t(W) * size_t(l.T_max) * 4);
  l.plan_counts = region(size_t(W) * 4);
  const size_t nccl_slabs = s.direct_only ? 0 : size_t(W - 1);  // the NCCL transport's send / combine slabs
  l.send_meta = region(nccl_slabs * l.meta_stride);
  l.send_rows = region(nccl_slabs * l.in_stride);
  l.recv_meta = region(size_t(W) * l.meta_stride);
  l.recv_x = region(size_t(W) * l.in_stride);
  l.recv_x_scales = region(size_t(W) * size_t(l.C) * scales);
  l.recv_ids = region(size_t(W) * size_t(l.C) * s.k * 4);
  l.recv_weights = region(size_t(W) * size_t(l.C) * s.k * 4);
  l.recv_counts = region(size_t(W) * 4);
  l.expert_out = region(size_t(W) * l.rows_stride);
  l.comb_rows = region(nccl_slabs * l.rows_stride);
  l.sync = region(sync_bytes(W));
  l.total = at;
  return l;
}

}  // namespace ep

int64_t ep_recv_capacity(const EpShape& s) {
  return s.recv_capacity > 0 ? s.recv_capacity : s.max_tokens_per_rank;
}

size_t ep_workspace_size(const EpShape& s) {
  if (!ep::check_shape("ep_workspace_size", s, nullptr).ok()) return 0;
  return ep::layout(s).total;
}

EpRecvView ep_recv_view(const EpShape& s, void* workspace) {
  EpRecvView v;
  if (workspace == nullptr || !ep::check_shape("ep_recv_view", s, nullptr).ok()) return v;
  const ep::Layout l = ep::layout(s);
  char* ws = static_cast<char*>(workspace);
  v.rows = int64_t(s.world) * l.C;
  v.x = ws + l.recv_x;
  v.x_scales = s.fp8_rows ? reinterpret_cast<float*>(ws + l.recv_x_scales) : nullptr;
  v.ids = reinterpret_cast<int32_t*>(ws + l.recv_ids);
  v.weights = reinterpret_cast<float*>(ws + l.recv_weights);
  v.counts = reinterpret_cast<int32_t*>(ws + l.recv_counts);
  v.expert_out = ws + l.expert_out;
  return v;
}

}  // namespace flashmix
