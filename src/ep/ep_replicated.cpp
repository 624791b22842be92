// Expert parallelism's first way (spec §14.2): every rank has all T tokens,
// computes the filled partial of its own experts, and NCCL sums the partials
// (all_reduce: every rank gets [T, H]; reduce_scatter: rank r gets rows
// [r*T/W, (r+1)*T/W)). The shared output is added on rank 0 only, so it is
// in the sum once.
#include <cstdint>

#include "common/check.h"
#include "common/host_dtype.h"
#include "ep/ep_internal.h"
#include "flashmix/ep.h"

namespace flashmix {
namespace {

constexpr const char* kReplicatedOp = "ep_moe_forward_replicated";
constexpr const char* kFinalizeOp = "ep_finalize_reduce";

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::kFloat32: return ncclFloat32;
    case DType::kFloat16: return ncclFloat16;
    case DType::kBFloat16: return ncclBfloat16;
  }
  return ncclFloat32;
}

Status comm_place(const char* op, ncclComm_t comm, int* rank, int* world) {
  FM_REQUIRE(comm != nullptr, op, "comm", "must not be null");
  if (ncclCommCount(comm, world) != ncclSuccess || ncclCommUserRank(comm, rank) != ncclSuccess)
    return Status(StatusCode::kInvalidArgument,
                  detail::concat(op, ": comm: NCCL could not report its size and rank (not a valid ncclComm_t?)"));
  return Status::Ok();
}

// out == nullptr is allowed for the size queries (check_out false).
Status check_reduce(const char* op, EpReduce reduce, int64_t T, int world, const void* out, bool check_out = true) {
  const int r = int(reduce);
  FM_REQUIRE(r == int(EpReduce::kAllReduce) || r == int(EpReduce::kReduceScatter), op, "reduce",
             "unknown EpReduce value ", r);
  if (reduce == EpReduce::kReduceScatter)
    FM_REQUIRE(T % world == 0, op, "num_tokens", "must be a multiple of world = ", world,
               " for reduce_scatter (rank r keeps rows [r*T/W, (r+1)*T/W); got ", T, ")");
  if (T > 0 && check_out) FM_REQUIRE(out != nullptr, op, "out", "must not be null");
  return Status::Ok();
}

// The sum across ranks of `count_total` elements at `partial` into `out`
// (in place when they are the same buffer, all_reduce only).
Status reduce_across(const char* op, EpReduce reduce, const void* partial, void* out, int64_t count_total,
                     int world, DType t, ncclComm_t comm, cudaStream_t stream) {
  ncclResult_t r;
  if (reduce == EpReduce::kAllReduce)
    r = ncclAllReduce(partial, out, size_t(count_total), nccl_type(t), ncclSum, comm, stream);
  else
    r = ncclReduceScatter(partial, out, size_t(count_total / world), nccl_type(t), ncclSum, comm, stream);
  if (r != ncclSuccess)
    return Status(StatusCode::kCommError, detail::concat(op, ": ", reduce == EpReduce::kAllReduce ? "ncclAllReduce"
                                                                                                  : "ncclReduceScatter",
                                                         ": ", ncclGetErrorString(r)));
  return Status::Ok();
}

// The rank's moe_forward: a filled bf16 partial at `partial`.
MoeForwardArgs rank_layer(const EpReplicatedArgs& a, int rank, void* partial) {
  MoeForwardArgs m = a.moe;
  m.fill = true;
  if (rank != 0) m.shared_output = nullptr;
  m.out = partial;
  m.out_stride = m.hidden;
  return m;
}

size_t replicated_partial_bytes(const EpReplicatedArgs& a) {
  return a.reduce == EpReduce::kReduceScatter ? ep::align256(size_t(a.moe.num_tokens) * size_t(a.moe.hidden) * 2) : 0;
}

}  // namespace

size_t ep_moe_forward_replicated_workspace_size(const EpReplicatedArgs& a, int world) {
  if (world < 1 || !check_reduce(kReplicatedOp, a.reduce, a.moe.num_tokens, world, a.out, false).ok()) return 0;
  const size_t moe = moe_forward_workspace_size(rank_layer(a, 0, a.out));
  return replicated_partial_bytes(a) + moe;
}

Status ep_moe_forward_replicated(const EpReplicatedArgs& a, ncclComm_t comm, void* workspace, size_t workspace_bytes,
                                 cudaStream_t stream) {
  constexpr const char* op = kReplicatedOp;
  int rank = 0, world = 0;
  FM_RETURN_IF_ERROR(comm_place(op, comm, &rank, &world));
  const int64_t T = a.moe.num_tokens, H = a.moe.hidden;
  FM_RETURN_IF_ERROR(check_reduce(op, a.reduce, T, world, a.out));
  const int64_t e_local = world > 0 ? a.moe.num_experts / world : 0;
  FM_REQUIRE(a.moe.num_experts % world == 0 && a.moe.num_experts_per_node == e_local &&
                 a.moe.start_expert_id == rank * e_local,
             op, "moe", "rank ", rank, " of ", world, " holds experts [", rank * e_local, ", ", (rank + 1) * e_local,
             "): num_experts must be a multiple of world, num_experts_per_node = E / W and start_expert_id = rank * E / W "
             "(got E = ", a.moe.num_experts, ", E_local = ", a.moe.num_experts_per_node, ", start = ",
             a.moe.start_expert_id, ")");
  if (T == 0) return Status::Ok();  // T is the same on every rank: no rank calls NCCL
  const size_t partial_bytes = replicated_partial_bytes(a);
  // 0 when the layer's arguments are bad: validate_moe_forward below names the argument.
  FM_RETURN_IF_ERROR(ep::check_workspace(op, workspace, workspace_bytes,
                                         ep_moe_forward_replicated_workspace_size(a, world),
                                         "ep_moe_forward_replicated_workspace_size"));
  char* ws = static_cast<char*>(workspace);
  void* partial = a.reduce == EpReduce::kAllReduce ? a.out : static_cast<void*>(ws);
  const MoeForwardArgs m = rank_layer(a, rank, partial);
  {
    const Status st = validate_moe_forward(m);
    if (!st.ok()) return Status(st.code(), detail::concat(op, ": ", st.message()));
  }
  const size_t moe_bytes = moe_forward_workspace_size(m);
  if (a.reduce == EpReduce::kReduceScatter) {
    const detail::Range outs[] = {{"out", a.out, (T / world) * H * 2}};
    const detail::Range ins[] = {{"workspace", workspace, int64_t(workspace_bytes)}};
    FM_RETURN_IF_ERROR(detail::check_no_overlap(op, outs, ins));
  }
  return detail::without_cuda_error_left(op, [&]() -> Status {
    FM_RETURN_IF_ERROR(detail::check_stream(stream, op));
    {
      const Status st = moe_forward(m, ws + partial_bytes, moe_bytes, stream);
      if (!st.ok()) return Status(st.code(), detail::concat(op, ": ", st.message()));
    }
    return reduce_across(op, a.reduce, partial, a.out, T * H, world, DType::kBFloat16, comm, stream);
  });
}

namespace {

// The rank's finalize: a filled partial of partial_dtype at `partial`.
FinalizeMoeRoutingArgs rank_finalize(const EpFinalizeReduceArgs& a, int rank, void* partial) {
  FinalizeMoeRoutingArgs f = a.finalize;
  f.fill = true;
  if (rank != 0) f.shared_output = nullptr;
  f.out = partial;
  f.out_dtype = a.partial_dtype;
  f.out_stride = f.hidden;
  return f;
}

// Workspace: the partial [T, H] of partial_dtype, then (reduce_scatter with a
// conversion) the summed rows [T/W, H] in fp32.
struct FinalizeReduceLayout {
  size_t partial = 0, summed = 0, total = 0;
  bool convert = false;
};

FinalizeReduceLayout finalize_layout(const EpFinalizeReduceArgs& a, int world) {
  FinalizeReduceLayout l;
  const size_t T = size_t(a.finalize.num_tokens), H = size_t(a.finalize.hidden);
  l.convert = a.partial_dtype != a.out_dtype;
  l.partial = 0;
  l.summed = ep::align256(T * H * dtype_size(a.partial_dtype));
  const size_t rows = a.reduce == EpReduce::kAllReduce ? T : T / size_t(world);
  l.total = l.summed + (l.convert ? ep::align256(rows * H * 4) : 0);
  return l;
}

Status check_finalize_reduce(const char* op, const EpFinalizeReduceArgs& a, int world, bool check_out) {
  FM_RETURN_IF_ERROR(check_reduce(op, a.reduce, a.finalize.num_tokens, world, a.out, check_out));
  FM_REQUIRE(a.partial_dtype == DType::kFloat32 || a.partial_dtype == DType::kBFloat16, op, "partial_dtype",
             "must be float32 or bfloat16 (got ", to_string(a.partial_dtype), ")");
  FM_REQUIRE(a.partial_dtype == DType::kFloat32 || a.out_dtype == DType::kBFloat16, op, "out_dtype",
             "must be bfloat16 with a bfloat16 partial (got ", to_string(a.out_dtype), ")");
  FM_REQUIRE(a.finalize.hidden % 8 == 0, op, "finalize.hidden", "must be a multiple of 8 (got ", a.finalize.hidden,
             ")");
  return Status::Ok();
}

}  // namespace

size_t ep_finalize_reduce_workspace_size(const EpFinalizeReduceArgs& a, int world) {
  if (world < 1 || !check_finalize_reduce(kFinalizeOp, a, world, false).ok()) return 0;
  return finalize_layout(a, world).total;
}

Status ep_finalize_reduce(const EpFinalizeReduceArgs& a, ncclComm_t comm, void* workspace, size_t workspace_bytes,
                          cudaStream_t stream) {
  constexpr const char* op = kFinalizeOp;
  int rank = 0, world = 0;
  FM_RETURN_IF_ERROR(comm_place(op, comm, &rank, &world));
  FM_RETURN_IF_ERROR(check_finalize_reduce(op, a, world, true));
  const int64_t T = a.finalize.num_tokens, H = a.finalize.hidden;
  if (T == 0) return Status::Ok();
  const FinalizeReduceLayout l = finalize_layout(a, world);
  FM_RETURN_IF_ERROR(
      ep::check_workspace(op, workspace, workspace_bytes, l.total, "ep_finalize_reduce_workspace_size"));
  char* ws = static_cast<char*>(workspace);
  const FinalizeMoeRoutingArgs f = rank_finalize(a, rank, ws + l.partial);
  {
    const Status st = validate_finalize_moe_routing(f);
    if (!st.ok()) return Status(st.code(), detail::concat(op, ": ", st.message()));
  }
  const int64_t out_rows = a.reduce == EpReduce::kAllReduce ? T : T / world;
  const detail::Range outs[] = {{"out", a.out, out_rows * H * int64_t(dtype_size(a.out_dtype))}};
  const detail::Range ins[] = {{"workspace", workspace, int64_t(l.total)}};
  FM_RETURN_IF_ERROR(detail::check_no_overlap(op, outs, ins));
  return detail::without_cuda_error_left(op, [&]() -> Status {
    FM_RETURN_IF_ERROR(detail::check_stream(stream, op));
    {
      const Status st = finalize_moe_routing(f, stream);
      if (!st.ok()) return Status(st.code(), detail::concat(op, ": ", st.message()));
    }
    void* summed = l.convert ? static_cast<void*>(ws + l.summed) : a.out;
    FM_RETURN_IF_ERROR(reduce_across(op, a.reduce, ws + l.partial, summed, T * H, world, a.partial_dtype, comm, stream));
    if (l.convert)
      FM_RETURN_IF_ERROR(detail::cuda_status(
          ep::launch_convert_from_f32(static_cast<const float*>(summed), a.out, a.out_dtype, out_rows * H, stream), op,
          "convert kernel launch"));
    return Status::Ok();
  });
}

}  // namespace flashmix
