// MoE routing maps: the one host-side validation both backends call (spec §5),
// and the workspace-size query. Never reads device memory.
#include <cstdint>

#include "common/check.h"
#include "flashmix/moe.h"
#include "moe/moe_routing_plan.h"

namespace flashmix {

namespace {
constexpr const char* kOp = "build_moe_routing_maps";

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

// check_buffers = false: the sizes only, not the buffers (presence,
// alignment, overlap): the workspace size query needs sizes only, and callers
// may ask before allocating.
Status validate_routing(const MoeRoutingArgs& a, bool check_buffers) {
  FM_REQUIRE(a.num_tokens >= 0, kOp, "num_tokens", "must be >= 0 (got ", a.num_tokens, ")");
  FM_REQUIRE(a.k >= 1 && a.k <= 16, kOp, "k", "must be in 1..16 (got ", a.k, ")");
  FM_REQUIRE(a.num_tokens <= detail::kInt32Max / a.k, kOp, "num_tokens",
             "k*T must fit int32, the permuted-row index type (T=", a.num_tokens, ", k=", a.k, ")");
  FM_REQUIRE(a.num_experts_per_node >= 1, kOp, "num_experts_per_node", "must be >= 1 (got ",
             a.num_experts_per_node, ")");
  FM_REQUIRE_SUPPORTED(a.num_experts_per_node <= detail::kRoutingMaxExperts, kOp, "num_experts_per_node",
                       "at most ", detail::kRoutingMaxExperts, " local experts are supported (got ",
                       a.num_experts_per_node, ")");
  FM_REQUIRE(a.start_expert_id >= 0, kOp, "start_expert_id", "must be >= 0 (got ", a.start_expert_id, ")");
  FM_REQUIRE(int64_t(a.start_expert_id) + a.num_experts_per_node <= detail::kInt32Max, kOp,
             "start_expert_id", "start_expert_id + num_experts_per_node must fit int32");
  FM_REQUIRE(a.tuning.single_block_max_slots >= -1 &&
                 a.tuning.single_block_max_slots <= detail::kRoutingMaxSegmentSlots,
             kOp, "tuning.single_block_max_slots", "must be -1, 0 or 1..", detail::kRoutingMaxSegmentSlots,
             " (got ", a.tuning.single_block_max_slots, ")");

  // The offsets are written even for T == 0 (all zero), so the grouped GEMM
  // that reads them on the device never sees garbage.
  if (check_buffers) {
    FM_REQUIRE(a.expert_first_token_offset != nullptr, kOp, "expert_first_token_offset", "must not be null");
    FM_REQUIRE(aligned(a.expert_first_token_offset, 8), kOp, "expert_first_token_offset",
               "must be 8-byte aligned (int64)");
  }
  if (check_buffers && a.num_tokens > 0) {
    FM_REQUIRE(a.token_selected_experts != nullptr, kOp, "token_selected_experts", "must not be null");
    FM_REQUIRE(a.permuted_row_to_unpermuted_row != nullptr, kOp, "permuted_row_to_unpermuted_row",
               "must not be null");
    FM_REQUIRE(a.unpermuted_row_to_permuted_row != nullptr, kOp, "unpermuted_row_to_permuted_row",
               "must not be null");
    FM_REQUIRE(aligned(a.token_selected_experts, 4), kOp, "token_selected_experts", "must be 4-byte aligned (int32)");
    FM_REQUIRE(aligned(a.permuted_row_to_unpermuted_row, 4), kOp, "permuted_row_to_unpermuted_row",
               "must be 4-byte aligned (int32)");
    FM_REQUIRE(aligned(a.unpermuted_row_to_permuted_row, 4), kOp, "unpermuted_row_to_permuted_row",
               "must be 4-byte aligned (int32)");
  }

  // Expansion: both pointers or neither.
  if (check_buffers) {
    FM_REQUIRE(a.input != nullptr || a.permuted_input == nullptr, kOp, "input",
               "must not be null when permuted_input is given");
    FM_REQUIRE(a.permuted_input != nullptr || a.input == nullptr, kOp, "permuted_input",
               "must not be null when input is given");
  }
  const int64_t slots = a.num_tokens * a.k;
  int64_t in_bytes = 0, out_bytes = 0;  // the expansion's extents, for the overlap check below
  if (a.input != nullptr) {
    FM_REQUIRE(dtype_is_valid(a.input_dtype), kOp, "input_dtype", "is not a valid DType");
    const int64_t es = int64_t(dtype_size(a.input_dtype));
    FM_REQUIRE(a.hidden >= 1, kOp, "hidden", "must be >= 1 when expanding (got ", a.hidden, ")");
    FM_REQUIRE(a.hidden <= detail::kInt32Max / es, kOp, "hidden",
               "a row must be smaller than 2 GiB (got ", a.hidden, ")");
    const int64_t in_stride = a.input_stride == 0 ? a.hidden : a.input_stride;
    const int64_t out_stride = a.permuted_input_stride == 0 ? a.hidden : a.permuted_input_stride;
    FM_REQUIRE(in_stride >= a.hidden, kOp, "input_stride", "must be 0 or >= hidden (got ", a.input_stride,
               ", hidden ", a.hidden, ")");
    FM_REQUIRE(out_stride >= a.hidden, kOp, "permuted_input_stride", "must be 0 or >= hidden (got ",
               a.permuted_input_stride, ", hidden ", a.hidden, ")");
    // Byte offsets are int64: rows * stride * element size must not overflow.
    const int64_t limit = INT64_MAX / 4;
    FM_REQUIRE(slots == 0 || in_stride <= limit / es / slots, kOp, "input_stride",
               "T * input_stride bytes overflow 64-bit offsets");
    FM_REQUIRE(slots == 0 || out_stride <= limit / es / slots, kOp, "permuted_input_stride",
               "k*T * permuted_input_stride bytes overflow 64-bit offsets");
    in_bytes = detail::rows_extent_bytes(a.num_tokens, in_stride, a.hidden, es);
    out_bytes = detail::rows_extent_bytes(slots, out_stride, a.hidden, es);
  }
  const bool fp8 = a.permuted_input_scales != nullptr;
  int64_t scale_bytes = 0;
  if (fp8) {
    // The FP8 expansion (spec §1.4): bf16 in, e4m3 codes and 1 x 128 scales out.
    if (check_buffers)
      FM_REQUIRE(a.input != nullptr, kOp, "permuted_input_scales", "needs input and permuted_input (the FP8 expansion)");
    FM_REQUIRE(a.input_dtype == DType::kBFloat16, kOp, "input_dtype",
               "must be kBFloat16 for the FP8 expansion (got ", to_string(a.input_dtype), ")");
    FM_REQUIRE(a.permuted_scale_format == ScaleFormat::kFloat32 || a.permuted_scale_format == ScaleFormat::kUE8M0,
               kOp, "permuted_scale_format", "is not a valid ScaleFormat");
    FM_REQUIRE(a.hidden % 128 == 0, kOp, "hidden",
               "must be a multiple of 128 for the FP8 expansion (1 x 128 scale blocks; got ", a.hidden, ")");
    const int64_t in_stride = a.input_stride == 0 ? a.hidden : a.input_stride;
    const int64_t out_stride = a.permuted_input_stride == 0 ? a.hidden : a.permuted_input_stride;
    FM_REQUIRE(in_stride % 8 == 0, kOp, "input_stride",
               "must be a multiple of 8 elements (16-byte rows) for the FP8 expansion (got ", in_stride, ")");
    FM_REQUIRE(out_stride % 8 == 0, kOp, "permuted_input_stride",
               "must be a multiple of 8 bytes for the FP8 expansion (got ", out_stride, ")");
    // permuted_input holds one byte an element.
    out_bytes = detail::rows_extent_bytes(slots, out_stride, a.hidden, 1);
    scale_bytes = slots * (a.hidden / 128) * (a.permuted_scale_format == ScaleFormat::kUE8M0 ? 1 : 4);
  }
  if (!check_buffers) return Status::Ok();
  if (fp8) {
    FM_REQUIRE(aligned(a.input, 16), kOp, "input", "must be 16-byte aligned for the FP8 expansion");
    FM_REQUIRE(aligned(a.permuted_input, 8), kOp, "permuted_input", "must be 8-byte aligned for the FP8 expansion");
    FM_REQUIRE(a.permuted_scale_format == ScaleFormat::kUE8M0 || aligned(a.permuted_input_scales, 4), kOp,
               "permuted_input_scales", "must be 4-byte aligned (float32 scales)");
  }
  // The expansion's narrowest access is one element (2 bytes for bf16/fp16).
  if (a.input != nullptr) {
    const uintptr_t es = dtype_size(a.input_dtype);
    FM_REQUIRE(aligned(a.input, es), kOp, "input", "must be aligned to its element (", es, " bytes)");
    FM_REQUIRE(aligned(a.permuted_input, es), kOp, "permuted_input", "must be aligned to its element (", es,
               " bytes)");
  }
  // No output overlaps an input or another output.
  const detail::Range outs[] = {
      {"expert_first_token_offset", a.expert_first_token_offset, (int64_t(a.num_experts_per_node) + 1) * 8},
      {"permuted_row_to_unpermuted_row", a.permuted_row_to_unpermuted_row, slots * 4},
      {"unpermuted_row_to_permuted_row", a.unpermuted_row_to_permuted_row, slots * 4},
      {"permuted_input", a.permuted_input, out_bytes},
      {"permuted_input_scales", a.permuted_input_scales, scale_bytes}};
  const detail::Range ins[] = {{"token_selected_experts", a.token_selected_experts, slots * 4},
                               {"input", a.input, in_bytes}};
  return detail::check_no_overlap(kOp, outs, ins);
}

Status validate_moe_routing_maps(const MoeRoutingArgs& a) { return validate_routing(a, true); }

size_t build_moe_routing_maps_workspace_size(const MoeRoutingArgs& args) {
  if (!validate_routing(args, false).ok()) return 0;
  return detail::plan_moe_routing(args).workspace_bytes;
}

}  // namespace flashmix
