// Host-side validation of moe_fc2_finalize (spec §5), shared by the GPU and
// CPU backends, and the workspace layout.
#include "common/check.h"
#include "moe/expert_gemm_check.h"
#include "flashmix/moe.h"
#include "moe/moe_fc2_internal.h"

namespace flashmix {

namespace {
constexpr const char* kOp = "moe_fc2_finalize";
size_t align256(size_t x) { return (x + 255) & ~size_t(255); }
}  // namespace

Status validate_moe_fc2_finalize(const Fc2FinalizeArgs& a) { return validate_fc2(a, true); }

Status validate_fc2(const Fc2FinalizeArgs& a, bool check_buffers) {
  FM_RETURN_IF_ERROR(detail::validate_expert_gemm_sizes(kOp, a.num_tokens, a.k, a.hidden, a.inter,
                                                        a.num_experts_per_node));
  const int m = int(a.mode);
  FM_REQUIRE(m >= 0 && m <= 3, kOp, "mode", "unknown mode value ", m);
  const int f = int(a.fp8);
  FM_REQUIRE(f >= int(MoeFp8Scaling::kNone) && f <= int(MoeFp8Scaling::kTensor), kOp, "fp8",
             "unknown MoeFp8Scaling value ", f);
  const bool fp8 = a.fp8 != MoeFp8Scaling::kNone, block = a.fp8 == MoeFp8Scaling::kBlock;
  bool mx = false;
  FM_RETURN_IF_ERROR(detail::validate_expert_weight_format(kOp, a.weights, a.fp8, a.inter, "inter", &mx));
  if (block)
    FM_REQUIRE(a.inter % 128 == 0, kOp, "inter",
               "must be a multiple of 128 with block scales (one scale per 128 of K; got ", a.inter, ")");
  else if (fp8)
    FM_REQUIRE(a.inter % 16 == 0, kOp, "inter",
               "must be a multiple of 16 with e4m3 A and W2 (16-byte rows for TMA; got ", a.inter, ")");
  const int gk = int(a.tuning.gemm_kernel);
  FM_REQUIRE(gk >= int(Fc2GemmKernel::kAuto) && gk <= int(Fc2GemmKernel::kCutlassPingpong), kOp,
             "tuning.gemm_kernel", "unknown Fc2GemmKernel value ", gk);
  FM_REQUIRE(a.tuning.raster >= 0 && a.tuning.raster <= 2, kOp, "tuning.raster",
             "must be 0 (automatic), 1 (M fastest) or 2 (N fastest) (got ", a.tuning.raster, ")");
  FM_REQUIRE(a.tuning.swizzle == 0 || a.tuning.swizzle == 1 || a.tuning.swizzle == 2 || a.tuning.swizzle == 4 ||
                 a.tuning.swizzle == 8,
             kOp, "tuning.swizzle", "must be 0 (automatic), 1, 2, 4 or 8 (got ", a.tuning.swizzle, ")");
  FM_REQUIRE(a.out_stride >= 0, kOp, "out_stride", "must be >= 0 (0 means hidden; got ", a.out_stride, ")");
  const int64_t out_stride = a.out_stride ? a.out_stride : a.hidden;
  FM_REQUIRE(out_stride >= a.hidden, kOp, "out_stride", "smaller than a row: ", out_stride, " < hidden ",
             a.hidden);
  FM_REQUIRE(out_stride % 2 == 0, kOp, "out_stride", "must be even (bf16x2 reduction adds; got ", out_stride, ")");
  FM_REQUIRE(out_stride <= (int64_t(1) << 60) / (a.num_tokens + 1), kOp, "out_stride",
             "num_tokens * out_stride overflows");
  FM_REQUIRE(a.hidden * a.inter < ((int64_t(1) << 60) / a.num_experts_per_node), kOp, "W2",
             "E_local * H * I overflows");  // H * I < 2^62: no overflow in the product
  FM_REQUIRE(a.shared_stride >= 0, kOp, "shared_stride", "must be >= 0 (0 means hidden; got ", a.shared_stride, ")");
  const int64_t shared_stride = a.shared_stride ? a.shared_stride : a.hidden;
  FM_REQUIRE(shared_stride >= a.hidden, kOp, "shared_stride", "smaller than a row: ", shared_stride, " < hidden ",
             a.hidden);
  FM_REQUIRE(shared_stride % 8 == 0, kOp, "shared_stride", "must be a multiple of 8 (16-byte rows; got ",
             shared_stride, ")");
  FM_REQUIRE(shared_stride <= (int64_t(1) << 60) / (a.num_tokens + 1), kOp, "shared_stride",
             "num_tokens * shared_stride overflows");
  FM_REQUIRE(!(a.out_already_zeroed && a.mode == Fc2Mode::kAtomic && a.shared_output != nullptr), kOp,
             "out_already_zeroed", "cannot be combined with shared_output (give the residual one way)");
  FM_REQUIRE(!(a.out_already_zeroed && a.mode == Fc2Mode::kAtomic && !a.fill), kOp, "out_already_zeroed",
             "cannot be combined with fill = false (the op then zeroes only the tokens it writes)");
  if (a.num_tokens == 0 || !check_buffers) return Status::Ok();
  FM_REQUIRE(a.A != nullptr, kOp, "A", "must not be null");
  FM_REQUIRE(a.W2 != nullptr, kOp, "W2", "must not be null");
  FM_REQUIRE(a.expert_first_token_offset != nullptr, kOp, "expert_first_token_offset", "must not be null");
  FM_REQUIRE(a.permuted_row_to_unpermuted_row != nullptr, kOp, "permuted_row_to_unpermuted_row",
             "must not be null");
  FM_REQUIRE(a.out != nullptr, kOp, "out", "must not be null");
  if (fp8) {
    FM_REQUIRE(a.a_scales != nullptr, kOp, "a_scales", "must not be null with fp8 = ", to_string(a.fp8));
    FM_REQUIRE(reinterpret_cast<uintptr_t>(a.a_scales) % 4 == 0, kOp, "a_scales", "must be 4-byte aligned (float)");
  }
  if (fp8 && !mx) {
    FM_REQUIRE(a.w2_scales != nullptr, kOp, "w2_scales", "must not be null with fp8 = ", to_string(a.fp8));
    FM_REQUIRE(reinterpret_cast<uintptr_t>(a.w2_scales) % 4 == 0, kOp, "w2_scales",
               "must be 4-byte aligned (float)");
  }
  if (mx) {
    FM_REQUIRE(a.w2_mx_scales != nullptr, kOp, "w2_mx_scales", "must not be null with weights = mxfp4");
    FM_REQUIRE(reinterpret_cast<uintptr_t>(a.w2_mx_scales) % 4 == 0, kOp, "w2_mx_scales",
               "must be 4-byte aligned (a row's four scales of a K block are read as one word)");
  }
  FM_REQUIRE(reinterpret_cast<uintptr_t>(a.A) % 16 == 0, kOp, "A", "must be 16-byte aligned (TMA)");
  FM_REQUIRE(reinterpret_cast<uintptr_t>(a.W2) % 16 == 0, kOp, "W2", "must be 16-byte aligned (TMA)");
  FM_REQUIRE(reinterpret_cast<uintptr_t>(a.out) % 4 == 0, kOp, "out",
             "must be 4-byte aligned (bf16x2 reduction adds)");
  if (a.bias && a.apply_bias)
    FM_REQUIRE(reinterpret_cast<uintptr_t>(a.bias) % 4 == 0, kOp, "bias", "must be 4-byte aligned");
  FM_REQUIRE(reinterpret_cast<uintptr_t>(a.expert_first_token_offset) % 8 == 0, kOp, "expert_first_token_offset",
             "must be 8-byte aligned (int64)");
  FM_REQUIRE(reinterpret_cast<uintptr_t>(a.permuted_row_to_unpermuted_row) % 4 == 0, kOp,
             "permuted_row_to_unpermuted_row", "must be 4-byte aligned (int32)");
  FM_REQUIRE(reinterpret_cast<uintptr_t>(a.scales) % 4 == 0, kOp, "scales", "must be 4-byte aligned (fp32)");
  FM_REQUIRE(reinterpret_cast<uintptr_t>(a.shared_output) % 16 == 0, kOp, "shared_output",
             "must be 16-byte aligned (16-byte rows)");
  // `out` (reduced into by the epilogue) overlaps no input.
  const int64_t slots = a.num_tokens * a.k, E = a.num_experts_per_node;
  const detail::Range outs[] = {{"out", a.out, detail::rows_extent_bytes(a.num_tokens, out_stride, a.hidden, 2)}};
  const int64_t esize = fp8 ? 1 : 2;  // bytes an element of A and W2
  const int64_t kbs = a.inter / 128, h_blocks = (a.hidden + 127) / 128;
  const int64_t w_elems = E * a.hidden * a.inter;
  const detail::Range ins[] = {{"A", a.A, slots * a.inter * esize},
                               {"W2", a.W2, mx ? w_elems / 2 : w_elems * esize},
                               {"a_scales", fp8 ? a.a_scales : nullptr, block ? slots * kbs * 4 : 4},
                               {"w2_scales", fp8 && !mx ? a.w2_scales : nullptr,
                                block ? E * h_blocks * kbs * 4 : E * 4},
                               {"w2_mx_scales", mx ? a.w2_mx_scales : nullptr, w_elems / 32},
                               {"expert_first_token_offset", a.expert_first_token_offset, (E + 1) * 8},
                               {"permuted_row_to_unpermuted_row", a.permuted_row_to_unpermuted_row, slots * 4},
                               {"scales", a.scales, slots * 4},
                               {"bias", a.apply_bias ? a.bias : nullptr, E * a.hidden * 2},
                               {"shared_output", a.shared_output,
                                detail::rows_extent_bytes(a.num_tokens, shared_stride, a.hidden, 2)}};
  return detail::check_no_overlap(kOp, outs, ins);
}

Fc2WorkspaceLayout fc2_workspace_layout(const Fc2FinalizeArgs& a, int sm_count) {
  Fc2WorkspaceLayout l;
  size_t off = 0;
  l.group = off;
  off = align256(off + kFc2GroupBytesPerExpert * size_t(a.num_experts_per_node));
  l.cutlass = off;
  l.cutlass_bytes = sm90_fc2_cutlass_workspace_bytes(sm_count, a.num_experts_per_node);
  off = align256(off + l.cutlass_bytes);
  const size_t slots = size_t(a.num_tokens) * size_t(a.k);
  const size_t H = size_t(a.hidden);
  if (a.mode == Fc2Mode::kAtomicFp32) {
    l.acc32 = off;
    off = align256(off + size_t(a.num_tokens) * H * 4);
  } else if (a.mode == Fc2Mode::kDeterministic || a.mode == Fc2Mode::kUnfused) {
    l.rows = off;
    off = align256(off + slots * H * (a.mode == Fc2Mode::kDeterministic ? 4 : 2));
    l.u2p = off;
    off = align256(off + slots * 4);
    l.experts = off;
    off = align256(off + slots * 4);
  }
  l.total = off;
  return l;
}

}  // namespace flashmix
