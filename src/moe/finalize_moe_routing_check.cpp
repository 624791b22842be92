// Host-side validation of finalize_moe_routing (spec §5), shared by the GPU
// and CPU backends, and the debug check of the device-side index arrays.
#include <cstring>
#include <vector>

#include "common/check.h"
#include "flashmix/moe.h"
#include "moe/finalize_moe_routing_internal.h"

namespace flashmix {

namespace {
constexpr const char* kOp = "finalize_moe_routing";
}

ResolvedFinalizeStrides resolve_finalize_strides(const FinalizeMoeRoutingArgs& a) {
  ResolvedFinalizeStrides s;
  s.rows = a.rows_stride ? a.rows_stride : a.hidden;
  s.bias = a.bias_stride ? a.bias_stride : s.rows;
  s.shared = a.shared_stride ? a.shared_stride : a.hidden;
  s.out = a.out_stride ? a.out_stride : a.hidden;
  return s;
}

Status validate_finalize_moe_routing(const FinalizeMoeRoutingArgs& a) {
  using detail::kInt32Max;
  FM_REQUIRE(a.num_tokens >= 0, kOp, "num_tokens", "must be >= 0 (got ", a.num_tokens, ")");
  FM_REQUIRE(a.hidden >= 1, kOp, "hidden", "must be >= 1 (got ", a.hidden, ")");
  FM_REQUIRE(a.hidden <= kInt32Max, kOp, "hidden", "must fit in 32 bits (got ", a.hidden, ")");
  FM_REQUIRE(a.k >= 1 && a.k <= kMaxFinalizeK, kOp, "k", "must be in [1, ", kMaxFinalizeK, "] (got ", a.k, ")");
  FM_REQUIRE(a.num_experts_per_node >= 1, kOp, "num_experts_per_node", "must be >= 1 (got ",
             a.num_experts_per_node, ")");
  FM_REQUIRE(a.start_expert_id >= 0, kOp, "start_expert_id", "must be >= 0 (got ", a.start_expert_id, ")");
  FM_REQUIRE(int64_t(a.start_expert_id) + a.num_experts_per_node <= kInt32Max, kOp, "num_experts_per_node",
             "start_expert_id + num_experts_per_node overflows int32");
  FM_REQUIRE(a.num_rows >= 0, kOp, "num_rows", "must be >= 0 (got ", a.num_rows, ")");
  FM_REQUIRE(a.num_rows <= kInt32Max, kOp, "num_rows", "must fit in int32: permuted row indices are int32 (got ",
             a.num_rows, ")");
  FM_REQUIRE(a.num_tokens * a.k <= kInt32Max, kOp, "num_tokens",
             "num_tokens * k overflows int32: unpermuted row indices j*T + t are int32 (T=", a.num_tokens,
             ", k=", a.k, ")");
  FM_REQUIRE(dtype_is_valid(a.rows_dtype), kOp, "rows_dtype", "unsupported dtype value ", int(a.rows_dtype));
  FM_REQUIRE(dtype_is_valid(a.out_dtype), kOp, "out_dtype", "unsupported dtype value ", int(a.out_dtype));
  FM_REQUIRE(a.rows_stride >= 0 && a.bias_stride >= 0 && a.shared_stride >= 0 && a.out_stride >= 0, kOp,
             a.rows_stride < 0 ? "rows_stride" : a.bias_stride < 0 ? "bias_stride"
                                 : a.shared_stride < 0 ? "shared_stride" : "out_stride",
             "must be >= 0 (0 means dense)");
  const ResolvedFinalizeStrides s = resolve_finalize_strides(a);
  FM_REQUIRE(s.rows >= a.hidden, kOp, "rows_stride", "smaller than a row: ", s.rows, " < hidden ", a.hidden);
  FM_REQUIRE(s.out >= a.hidden, kOp, "out_stride", "smaller than a row: ", s.out, " < hidden ", a.hidden);
  if (a.bias)
    FM_REQUIRE(s.bias >= a.hidden, kOp, "bias_stride", "smaller than a row: ", s.bias, " < hidden ", a.hidden);
  if (a.shared_output)
    FM_REQUIRE(s.shared >= a.hidden, kOp, "shared_stride", "smaller than a row: ", s.shared, " < hidden ",
               a.hidden);
  // Element offsets are 64-bit in the kernels; the extents must still fit.
  constexpr int64_t kMaxElems = int64_t(1) << 60;
  FM_REQUIRE(s.rows <= kMaxElems / (a.num_rows + 1), kOp, "rows_stride", "num_rows * rows_stride overflows");
  FM_REQUIRE(s.out <= kMaxElems / (a.num_tokens + 1), kOp, "out_stride", "num_tokens * out_stride overflows");
  FM_REQUIRE(s.bias <= kMaxElems / (int64_t(a.num_experts_per_node) + 1), kOp, "bias_stride",
             "num_experts_per_node * bias_stride overflows");
  FM_REQUIRE(s.shared <= kMaxElems / (a.num_tokens + 1), kOp, "shared_stride",
             "num_tokens * shared_stride overflows");

  if (a.num_tokens == 0) return Status::Ok();  // valid: nothing to read or write

  FM_REQUIRE(a.out != nullptr, kOp, "out", "is null");
  FM_REQUIRE(a.token_selected_experts != nullptr, kOp, "token_selected_experts", "is null");
  FM_REQUIRE(a.unpermuted_row_to_permuted_row != nullptr, kOp, "unpermuted_row_to_permuted_row", "is null");
  FM_REQUIRE(a.num_rows == 0 || a.expanded_permuted_rows != nullptr, kOp, "expanded_permuted_rows",
             "is null while num_rows = ", a.num_rows);
  if (!a.fill) {
    FM_REQUIRE(a.permuted_row_to_unpermuted_row != nullptr || a.num_rows == 0, kOp,
               "permuted_row_to_unpermuted_row", "is null (required when fill = false)");
    FM_REQUIRE(a.expert_first_token_offset != nullptr, kOp, "expert_first_token_offset",
               "is null (required when fill = false)");
  }
  // Every pointer is aligned to its element: the narrowest path the kernels
  // have (realigned 16-byte loads, element stores) needs no more than that.
  {
    const uintptr_t isz = dtype_size(a.rows_dtype), osz = dtype_size(a.out_dtype);
    const struct {
      const char* name;
      const void* ptr;
      uintptr_t align;
    } ptrs[] = {{"expanded_permuted_rows", a.expanded_permuted_rows, isz},
                {"bias", a.bias, isz},
                {"out", a.out, osz},
                {"shared_output", a.shared_output, osz},
                {"token_selected_experts", a.token_selected_experts, 4},
                {"unpermuted_row_to_permuted_row", a.unpermuted_row_to_permuted_row, 4},
                {"scales", a.scales, 4},
                {"permuted_row_to_unpermuted_row", a.fill ? nullptr : a.permuted_row_to_unpermuted_row, 4},
                {"expert_first_token_offset", a.fill ? nullptr : a.expert_first_token_offset, 8}};
    for (const auto& q : ptrs)
      FM_REQUIRE(reinterpret_cast<uintptr_t>(q.ptr) % q.align == 0, kOp, q.name, "must be aligned to its element (",
                 q.align, " bytes)");
  }
  // `out` shares no byte with an input. shared_output may be `out` itself
  // with the same stride (an in-place residual add: each element is read by
  // the thread that then writes it), but must not otherwise overlap it.
  {
    const int64_t osz = int64_t(dtype_size(a.out_dtype)), isz = int64_t(dtype_size(a.rows_dtype));
    const int64_t slots = a.num_tokens * a.k;
    const int64_t out_bytes = detail::rows_extent_bytes(a.num_tokens, s.out, a.hidden, osz);
    const detail::Range outs[] = {{"out", a.out, out_bytes}};
    const detail::Range ins[] = {
        {"expanded_permuted_rows", a.expanded_permuted_rows, detail::rows_extent_bytes(a.num_rows, s.rows, a.hidden, isz)},
        {"bias", a.bias, detail::rows_extent_bytes(a.num_experts_per_node, s.bias, a.hidden, isz)},
        {"unpermuted_row_to_permuted_row", a.unpermuted_row_to_permuted_row, slots * 4},
        {"token_selected_experts", a.token_selected_experts, slots * 4},
        {"scales", a.scales, slots * 4},
        {"permuted_row_to_unpermuted_row", a.fill ? nullptr : a.permuted_row_to_unpermuted_row, a.num_rows * 4},
        {"expert_first_token_offset", a.fill ? nullptr : a.expert_first_token_offset,
         (int64_t(a.num_experts_per_node) + 1) * 8}};
    FM_RETURN_IF_ERROR(detail::check_no_overlap(kOp, outs, ins));
    if (a.shared_output != a.out || s.shared != s.out)
      FM_REQUIRE(!detail::ranges_overlap(a.out, out_bytes, a.shared_output,
                                         detail::rows_extent_bytes(a.num_tokens, s.shared, a.hidden, osz)),
                 kOp, "shared_output", "must be out itself (same stride) or not overlap it");
  }
  const FinalizeTuning& t = a.tuning;
  const int max_threads = t.schedule == 2 ? kMaxTokenBlockThreads : kMaxFinalizeThreads;
  FM_REQUIRE(t.threads_per_block == 0 ||
                 (t.threads_per_block >= 32 && t.threads_per_block <= max_threads && t.threads_per_block % 32 == 0),
             kOp, "tuning.threads_per_block", "must be 0 (auto) or a multiple of 32 in [32, ", max_threads,
             "] (got ", t.threads_per_block, ")");
  FM_REQUIRE(t.vectors_per_thread == 0 || t.vectors_per_thread == 1 || t.vectors_per_thread == 2, kOp,
             "tuning.vectors_per_thread", "must be 0 (auto), 1 or 2 (got ", t.vectors_per_thread, ")");
  FM_REQUIRE(t.chunks_per_token >= 0, kOp, "tuning.chunks_per_token", "must be >= 0 (got ",
             t.chunks_per_token, ")");
  FM_REQUIRE(t.schedule >= 0 && t.schedule <= 2, kOp, "tuning.schedule",
             "must be 0 (auto), 1 (persistent warps) or 2 (token blocks) (got ", t.schedule, ")");
  return Status::Ok();
}

namespace {

Status check_indices(const FinalizeMoeRoutingArgs& a, cudaStream_t stream) {
  const int64_t T = a.num_tokens, k = a.k;
  FM_RETURN_IF_ERROR(detail::cuda_status(cudaStreamSynchronize(stream), kOp, "stream synchronize"));
  std::vector<int32_t> experts(T * k), u2p(T * k);
  FM_RETURN_IF_ERROR(detail::cuda_status(
      cudaMemcpy(experts.data(), a.token_selected_experts, sizeof(int32_t) * T * k, cudaMemcpyDeviceToHost), kOp,
      "copy token_selected_experts"));
  FM_RETURN_IF_ERROR(detail::cuda_status(cudaMemcpy(u2p.data(), a.unpermuted_row_to_permuted_row,
                                                    sizeof(int32_t) * T * k, cudaMemcpyDeviceToHost),
                                         kOp, "copy unpermuted_row_to_permuted_row"));
  const int64_t lo = a.start_expert_id, hi = lo + a.num_experts_per_node;
  std::vector<int64_t> owner(a.num_rows, -1);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = experts[t * k + j];
      if (e < lo || e >= hi) continue;
      const int64_t p = u2p[j * T + t];
      FM_REQUIRE(p >= 0 && p < a.num_rows, kOp, "unpermuted_row_to_permuted_row",
                 "entry ", j * T + t, " (token ", t, ", slot ", j, ", local expert ", e, ") is ", p,
                 ", outside [0, num_rows = ", a.num_rows, ")");
      FM_REQUIRE(owner[p] < 0, kOp, "unpermuted_row_to_permuted_row", "permuted row ", p,
                 " is used by two slots (", owner[p], " and ", j * T + t, ")");
      owner[p] = j * T + t;
    }
  if (!a.fill) {
    std::vector<int64_t> offsets(a.num_experts_per_node + 1);
    FM_RETURN_IF_ERROR(detail::cuda_status(cudaMemcpy(offsets.data(), a.expert_first_token_offset,
                                                      sizeof(int64_t) * offsets.size(), cudaMemcpyDeviceToHost),
                                           kOp, "copy expert_first_token_offset"));
    const int64_t P = offsets.back();
    FM_REQUIRE(P >= 0 && P <= a.num_rows, kOp, "expert_first_token_offset", "last entry ", P,
               " outside [0, num_rows = ", a.num_rows, "]");
    std::vector<int32_t> p2u(P);
    if (P > 0)
      FM_RETURN_IF_ERROR(detail::cuda_status(cudaMemcpy(p2u.data(), a.permuted_row_to_unpermuted_row,
                                                        sizeof(int32_t) * P, cudaMemcpyDeviceToHost),
                                             kOp, "copy permuted_row_to_unpermuted_row"));
    for (int64_t p = 0; p < P; ++p)
      FM_REQUIRE(p2u[p] >= 0 && p2u[p] < T * k && owner[p] == p2u[p], kOp, "permuted_row_to_unpermuted_row",
                 "entry ", p, " is ", p2u[p], " but the slot that maps to row ", p, " is ", owner[p]);
  }
  return Status::Ok();
}

}  // namespace

Status debug_check_finalize_moe_routing_indices(const FinalizeMoeRoutingArgs& a, cudaStream_t stream) {
  return detail::gpu_entry(kOp, validate_finalize_moe_routing(a), stream, a.num_tokens == 0,
                           [&] { return check_indices(a, stream); });
}

}  // namespace flashmix
