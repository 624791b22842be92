// moe_router: the one host-side validation both backends call (SPEC §8.6).
// Never reads device memory.
#include <cmath>
#include <cstdint>
#include <limits>

#include "common/check.h"
#include "flashmix/moe.h"
#include "moe/moe_router_internal.h"

namespace flashmix {

namespace {
constexpr const char* kOp = "moe_router";

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

bool known_scoring(MoeRouterScoring s) {
  switch (s) {
    case MoeRouterScoring::kSoftmax:
    case MoeRouterScoring::kSigmoid:
    case MoeRouterScoring::kSqrtSoftplus:
    case MoeRouterScoring::kSoftmaxAfterTopk: return true;
  }
  return false;
}
}  // namespace

const char* to_string(MoeRouterScoring s) {
  switch (s) {
    case MoeRouterScoring::kSoftmax: return "softmax";
    case MoeRouterScoring::kSigmoid: return "sigmoid";
    case MoeRouterScoring::kSqrtSoftplus: return "sqrtsoftplus";
    case MoeRouterScoring::kSoftmaxAfterTopk: return "softmax_after_topk";
  }
  return "invalid scoring";
}

Status validate_moe_router(const MoeRouterArgs& a) {
  const int E = a.num_experts;
  FM_REQUIRE(a.num_tokens >= 0, kOp, "num_tokens", "must be >= 0 (got ", a.num_tokens, ")");
  FM_REQUIRE(E >= 1, kOp, "num_experts", "must be >= 1 (got ", E, ")");
  FM_REQUIRE_SUPPORTED(E <= detail::kRouterMaxExperts, kOp, "num_experts", "at most ", detail::kRouterMaxExperts,
                       " experts are supported (got ", E, ")");
  FM_REQUIRE(a.k >= 1 && a.k <= detail::kRouterMaxK, kOp, "k", "must be in 1..", detail::kRouterMaxK, " (got ",
             a.k, ")");
  FM_REQUIRE(a.k <= E, kOp, "k", "must be <= num_experts (k=", a.k, ", num_experts=", E, ")");
  FM_REQUIRE(a.num_tokens <= detail::kInt32Max / a.k, kOp, "num_tokens",
             "k*T must fit int32, the index type of the slots downstream (T=", a.num_tokens, ", k=", a.k, ")");
  FM_REQUIRE(dtype_is_valid(a.logits_dtype), kOp, "logits_dtype", "is not a valid DType");
  FM_REQUIRE_SUPPORTED(a.logits_dtype != DType::kFloat16, kOp, "logits_dtype",
                       "fp16 logits are not supported (fp32 or bf16)");
  FM_REQUIRE(known_scoring(a.scoring), kOp, "scoring", "is not a known MoeRouterScoring (got ", int(a.scoring),
             ")");
  FM_REQUIRE(a.n_group >= 1, kOp, "n_group", "must be >= 1 (got ", a.n_group, ")");
  FM_REQUIRE(E % a.n_group == 0, kOp, "n_group", "must divide num_experts (n_group=", a.n_group,
             ", num_experts=", E, ")");
  FM_REQUIRE(a.topk_group >= 1 && a.topk_group <= a.n_group, kOp, "topk_group", "must be in 1..n_group (got ",
             a.topk_group, ", n_group=", a.n_group, ")");
  FM_REQUIRE(int64_t(a.topk_group) * (E / a.n_group) >= a.k, kOp, "topk_group",
             "topk_group * (num_experts / n_group) must be >= k: the chosen groups must hold k experts (",
             a.topk_group, " * ", E / a.n_group, " < ", a.k, ")");
  FM_REQUIRE(std::isfinite(a.routed_scaling_factor), kOp, "routed_scaling_factor", "must be finite (got ",
             a.routed_scaling_factor, ")");
  FM_REQUIRE(a.tuning.path >= 0 && a.tuning.path <= 2, kOp, "tuning.path", "must be 0, 1 or 2 (got ",
             a.tuning.path, ")");
  const bool hash = a.hash_table != nullptr;
  FM_REQUIRE(hash || a.token_ids == nullptr, kOp, "token_ids",
             "selects through hash_table: give both or neither (hash_table is null)");
  if (hash) {
    FM_REQUIRE(a.vocab_size >= 1, kOp, "vocab_size", "must be >= 1 with hash_table (got ", a.vocab_size, ")");
    FM_REQUIRE(a.vocab_size <= std::numeric_limits<int64_t>::max() / a.k / 4, kOp, "vocab_size",
               "vocab_size * k * 4 bytes must fit int64 (got ", a.vocab_size, ")");
    FM_REQUIRE(a.correction_bias == nullptr, kOp, "correction_bias",
               "must be null with hash_table: the bias only steers a top-k choice, and a hash choice has none");
    FM_REQUIRE(a.topk_group == a.n_group, kOp, "topk_group",
               "must equal n_group with hash_table: groups limit a top-k choice, and a hash choice has none "
               "(topk_group=", a.topk_group, ", n_group=", a.n_group, ")");
  }
  if (a.num_tokens == 0) return Status::Ok();

  const int64_t es = int64_t(dtype_size(a.logits_dtype));
  FM_REQUIRE(a.logits != nullptr, kOp, "logits", "must not be null");
  FM_REQUIRE(a.token_selected_experts != nullptr, kOp, "token_selected_experts", "must not be null");
  FM_REQUIRE(a.token_final_scales != nullptr, kOp, "token_final_scales", "must not be null");
  FM_REQUIRE(aligned(a.logits, uintptr_t(es)), kOp, "logits", "must be aligned to its element (", es, " bytes)");
  FM_REQUIRE(a.correction_bias == nullptr || aligned(a.correction_bias, 4), kOp, "correction_bias",
             "must be 4-byte aligned (fp32)");
  FM_REQUIRE(aligned(a.token_selected_experts, 4), kOp, "token_selected_experts", "must be 4-byte aligned (int32)");
  FM_REQUIRE(aligned(a.token_final_scales, 4), kOp, "token_final_scales", "must be 4-byte aligned (fp32)");
  const int64_t id_bytes = a.token_ids_int64 ? 8 : 4;
  if (hash) {
    FM_REQUIRE(a.token_ids != nullptr, kOp, "token_ids", "must not be null with hash_table");
    FM_REQUIRE(aligned(a.token_ids, uintptr_t(id_bytes)), kOp, "token_ids", "must be ", id_bytes,
               "-byte aligned (", a.token_ids_int64 ? "int64" : "int32", ")");
    FM_REQUIRE(aligned(a.hash_table, 4), kOp, "hash_table", "must be 4-byte aligned (int32)");
  }

  const int64_t slots = a.num_tokens * a.k;
  const detail::Range outs[] = {{"token_selected_experts", a.token_selected_experts, slots * 4},
                                {"token_final_scales", a.token_final_scales, slots * 4}};
  const detail::Range ins[] = {{"logits", a.logits, a.num_tokens * E * es},
                               {"correction_bias", a.correction_bias, int64_t(E) * 4},
                               {"token_ids", a.token_ids, a.num_tokens * id_bytes},
                               {"hash_table", a.hash_table, hash ? a.vocab_size * a.k * 4 : 0}};
  return detail::check_no_overlap(kOp, outs, ins);
}

}  // namespace flashmix
