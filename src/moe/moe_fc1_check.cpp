// Host-side validation of moe_fc1 (spec §9.5), shared by the GPU and CPU
// backends. Never reads device memory.
#include <cmath>
#include <cstdint>

#include "common/check.h"
#include "moe/expert_gemm_check.h"
#include "flashmix/moe.h"
#include "moe/moe_fc1_internal.h"
#include "moe/sm90_fc1_gemm.h"

namespace flashmix {

namespace {
constexpr const char* kOp = "moe_fc1";
constexpr int64_t kTwo60 = int64_t(1) << 60;

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

bool known_activation(MoeActivation a) {
  switch (a) {
    case MoeActivation::kSwiGLU:
    case MoeActivation::kSwiGLUOai:
    case MoeActivation::kSwiGLUClamped: return true;
  }
  return false;
}

bool known_fp8(MoeFp8Scaling f) {
  switch (f) {
    case MoeFp8Scaling::kNone:
    case MoeFp8Scaling::kBlock:
    case MoeFp8Scaling::kTensor: return true;
  }
  return false;
}

bool known_layout(Fc1WeightLayout l) {
  switch (l) {
    case Fc1WeightLayout::kGateUp:
    case Fc1WeightLayout::kInterleaved: return true;
  }
  return false;
}
}  // namespace

const char* to_string(MoeActivation activation) {
  switch (activation) {
    case MoeActivation::kSwiGLU: return "swiglu";
    case MoeActivation::kSwiGLUOai: return "swiglu_oai";
    case MoeActivation::kSwiGLUClamped: return "swiglu_clamped";
  }
  return "unknown";
}

const char* to_string(Fc1WeightLayout layout) {
  switch (layout) {
    case Fc1WeightLayout::kGateUp: return "gate_up";
    case Fc1WeightLayout::kInterleaved: return "interleaved";
  }
  return "unknown";
}

const char* to_string(MoeWeightFormat format) {
  switch (format) {
    case MoeWeightFormat::kDense: return "dense";
    case MoeWeightFormat::kMxfp4: return "mxfp4";
  }
  return "unknown";
}

const char* to_string(MoeFp8Scaling scaling) {
  switch (scaling) {
    case MoeFp8Scaling::kNone: return "none";
    case MoeFp8Scaling::kBlock: return "block";
    case MoeFp8Scaling::kTensor: return "tensor";
  }
  return "unknown";
}

Status validate_moe_fc1(const MoeFc1Args& a) { return validate_fc1(a, true); }

Status validate_fc1(const MoeFc1Args& a, bool check_buffers) {
  FM_RETURN_IF_ERROR(detail::validate_expert_gemm_sizes(kOp, a.num_tokens, a.k, a.hidden, a.inter,
                                                        a.num_experts_per_node));
  FM_REQUIRE(known_activation(a.activation), kOp, "activation", "unknown MoeActivation value ", int(a.activation));
  FM_REQUIRE(known_layout(a.layout), kOp, "layout", "unknown Fc1WeightLayout value ", int(a.layout));
  // Checked for every activation, also kSwiGLU (which ignores them).
  FM_REQUIRE(std::isfinite(a.limit) && a.limit >= 0.f, kOp, "limit",
             "must be finite and >= 0 (0 = the activation's default; got ", a.limit, ")");
  FM_REQUIRE(std::isfinite(a.alpha) && a.alpha >= 0.f, kOp, "alpha",
             "must be finite and >= 0 (0 = 1.702; got ", a.alpha, ")");
  FM_REQUIRE(known_fp8(a.fp8), kOp, "fp8", "unknown MoeFp8Scaling value ", int(a.fp8));
  bool mx = false;
  FM_RETURN_IF_ERROR(detail::validate_expert_weight_format(kOp, a.weights, a.fp8, a.hidden, "hidden", &mx));
  const bool fp8 = a.fp8 != MoeFp8Scaling::kNone;
  const int64_t esize = fp8 ? 1 : 2;  // bytes an element of X (and of a dense W1)
  if (a.fp8 == MoeFp8Scaling::kBlock)
    FM_REQUIRE(a.hidden % 128 == 0, kOp, "hidden", "must be a multiple of 128 with block scales (one scale per 128 of K; got ",
               a.hidden, ")");
  FM_REQUIRE_SUPPORTED(a.fp8 != MoeFp8Scaling::kBlock || mx || a.hidden <= kFc1BlockMaxHidden, kOp, "hidden",
                       "block-scaled FP8 with dense W1 takes hidden <= ", kFc1BlockMaxHidden,
                       " (the tile's W1 scales sit in shared memory; got ", a.hidden, ")");
  FM_REQUIRE(a.x_stride >= 0, kOp, "x_stride", "must be >= 0 (0 means hidden; got ", a.x_stride, ")");
  const int64_t x_stride = a.x_stride ? a.x_stride : a.hidden;
  FM_REQUIRE(x_stride >= a.hidden, kOp, "x_stride", "smaller than a row: ", x_stride, " < hidden ", a.hidden);
  FM_REQUIRE(x_stride * esize % 16 == 0, kOp, "x_stride", "must be a multiple of ", 16 / esize,
             " (16-byte rows for TMA; got ", x_stride, ")");
  const int64_t slots = a.num_tokens * a.k;  // fits: checked above
  const int64_t x_rows = a.x_permuted ? slots : a.num_tokens;
  FM_REQUIRE(x_stride <= kTwo60 / (x_rows + 1), kOp, "x_stride", "X's rows * x_stride overflows (rows=", x_rows,
             ", x_stride=", x_stride, ")");
  // E_local * 2I * H < 2^60, without overflowing on the way: E_local * 2I < 2^42.
  const int64_t E = a.num_experts_per_node;
  FM_REQUIRE(E * 2 * a.inter <= (kTwo60 - 1) / a.hidden, kOp, "W1", "E_local * 2I * H overflows (E_local=", E,
             ", I=", a.inter, ", H=", a.hidden, ")");
  FM_REQUIRE(slots <= (kTwo60 - 1) / a.inter, kOp, "out", "k * T * I overflows (k*T=", slots, ", I=", a.inter,
             ")");
  const bool q_out = a.out_scales != nullptr;  // FP8 output (spec §9.8)
  if (q_out) {
    FM_REQUIRE_SUPPORTED(a.fp8 == MoeFp8Scaling::kBlock &&
                             (!mx || sm90_fc1_mx_wide_tiles(a.fp8, a.weights, a.x_permuted,
                                                            a.layout == Fc1WeightLayout::kInterleaved, a.inter,
                                                            a.num_tokens, a.k, a.num_experts_per_node)),
                         kOp, "out_scales",
                         "an FP8 output needs fp8 = block with dense e4m3 weights, or MXFP4 weights on the wide "
                         "W4A8 tiles (a permuted X, gate rows then up rows, inter % 128 == 0, T k > 32 E_local; "
                         "got fp8 = ",
                         to_string(a.fp8), ", weights = ", to_string(a.weights), ")");
    FM_REQUIRE(a.inter % 128 == 0, kOp, "inter",
               "must be a multiple of 128 with an FP8 output (1 x 128 scale blocks; got ", a.inter, ")");
    FM_REQUIRE(a.out_scale_format == ScaleFormat::kFloat32 || a.out_scale_format == ScaleFormat::kUE8M0, kOp,
               "out_scale_format", "is not a valid ScaleFormat");
  }
  if (a.num_tokens == 0 || !check_buffers) return Status::Ok();
  FM_REQUIRE(a.X != nullptr, kOp, "X", "must not be null");
  FM_REQUIRE(a.W1 != nullptr, kOp, "W1", "must not be null");
  FM_REQUIRE(a.expert_first_token_offset != nullptr, kOp, "expert_first_token_offset", "must not be null");
  FM_REQUIRE(a.permuted_row_to_unpermuted_row != nullptr, kOp, "permuted_row_to_unpermuted_row",
             "must not be null");
  FM_REQUIRE(a.out != nullptr, kOp, "out", "must not be null");
  if (fp8) {
    FM_REQUIRE(a.x_scales != nullptr, kOp, "x_scales", "must not be null with fp8 = ", to_string(a.fp8));
    FM_REQUIRE(aligned(a.x_scales, 4), kOp, "x_scales", "must be 4-byte aligned (float)");
  }
  if (fp8 && !mx) {
    FM_REQUIRE(a.w1_scales != nullptr, kOp, "w1_scales", "must not be null with fp8 = ", to_string(a.fp8));
    FM_REQUIRE(aligned(a.w1_scales, 4), kOp, "w1_scales", "must be 4-byte aligned (float)");
  }
  if (mx) {
    FM_REQUIRE(a.w1_mx_scales != nullptr, kOp, "w1_mx_scales", "must not be null with weights = mxfp4");
    FM_REQUIRE(aligned(a.w1_mx_scales, 4), kOp, "w1_mx_scales",
               "must be 4-byte aligned (a row's four scales of a K block are read as one word)");
  }
  FM_REQUIRE(aligned(a.X, 16), kOp, "X", "must be 16-byte aligned (TMA)");
  FM_REQUIRE(aligned(a.W1, 16), kOp, "W1", "must be 16-byte aligned (TMA)");
  FM_REQUIRE(aligned(a.out, 16), kOp, "out", "must be 16-byte aligned (16-byte stores)");
  if (q_out && a.out_scale_format == ScaleFormat::kFloat32)
    FM_REQUIRE(aligned(a.out_scales, 4), kOp, "out_scales", "must be 4-byte aligned (float32 scales)");
  if (a.bias) FM_REQUIRE(aligned(a.bias, 16), kOp, "bias", "must be 16-byte aligned (16-byte loads)");
  FM_REQUIRE(aligned(a.expert_first_token_offset, 8), kOp, "expert_first_token_offset",
             "must be 8-byte aligned (int64)");
  FM_REQUIRE(aligned(a.permuted_row_to_unpermuted_row, 4), kOp, "permuted_row_to_unpermuted_row",
             "must be 4-byte aligned (int32)");
  // `out` overlaps no input. X's extent: the rows the op may read (k*T rows
  // when permuted, else T), each x_stride apart, the last one H long.
  const int64_t scale_bytes = a.out_scale_format == ScaleFormat::kUE8M0 ? 1 : 4;
  const detail::Range outs[] = {{"out", a.out, slots * a.inter * (q_out ? 1 : 2)},
                                {"out_scales", a.out_scales, slots * (a.inter / 128) * scale_bytes}};
  const bool block = a.fp8 == MoeFp8Scaling::kBlock;
  const int64_t kbs = a.hidden / 128, w_row_blocks = (2 * a.inter + 127) / 128;
  const int64_t w_elems = E * 2 * a.inter * a.hidden;
  const detail::Range ins[] = {{"X", a.X, detail::rows_extent_bytes(x_rows, x_stride, a.hidden, esize)},
                               {"W1", a.W1, mx ? w_elems / 2 : w_elems * esize},
                               {"x_scales", fp8 ? a.x_scales : nullptr, block ? x_rows * kbs * 4 : 4},
                               {"w1_scales", fp8 && !mx ? a.w1_scales : nullptr,
                                block ? E * w_row_blocks * kbs * 4 : E * 4},
                               {"w1_mx_scales", mx ? a.w1_mx_scales : nullptr, w_elems / 32},
                               {"bias", a.bias, E * 2 * a.inter * 2},
                               {"expert_first_token_offset", a.expert_first_token_offset, (E + 1) * 8},
                               {"permuted_row_to_unpermuted_row", a.permuted_row_to_unpermuted_row, slots * 4}};
  return detail::check_no_overlap(kOp, outs, ins);
}

}  // namespace flashmix
