// Host-side validation of the mHC ops (spec §4, §5), shared by the GPU and
// CPU backends. Nothing here touches device memory: alpha and bias are model
// weights on the device and are trusted like any other device value.
#include <algorithm>
#include <cmath>

#include "common/check.h"
#include "fp8/quantize_fp8_internal.h"
#include "flashmix/mhc.h"
#include "mhc/mhc_split_layout.h"

namespace flashmix {

namespace {

using detail::check_no_overlap;
using detail::kInt32Max;
using detail::Range;

Status check_shape(const MhcShape& s, const char* op, bool needs_hidden) {
  FM_REQUIRE(s.batch >= 0, op, "batch", "must be >= 0 (got ", s.batch, ")");
  FM_REQUIRE(s.n >= 1 && s.n <= kMhcMaxStreams, op, "n", "must be in [1, ", kMhcMaxStreams, "] (got ", s.n, ")");
  if (!needs_hidden) {
    FM_REQUIRE(s.batch <= kInt32Max / mhc_num_coefficients(s.n), op, "batch",
               "batch * N overflows 32-bit indexing (got ", s.batch, ")");
    return Status::Ok();
  }
  FM_REQUIRE(s.hidden >= 8, op, "hidden", "must be >= 8 (got ", s.hidden, ")");
  FM_REQUIRE(s.hidden % 8 == 0, op, "hidden", "must be a multiple of 8 (got ", s.hidden, ")");
  const int64_t k = s.hidden * s.n;
  FM_REQUIRE(k <= kInt32Max / mhc_num_coefficients(s.n), op, "hidden",
             "N * n * C overflows 32-bit indexing (got C=", s.hidden, ", n=", s.n, ")");
  FM_REQUIRE(s.batch <= kInt32Max / k, op, "batch", "batch * n * C overflows 32-bit indexing (got B=", s.batch,
             ", n*C=", k, ")");
  return Status::Ok();
}

Status check_params(const MhcParams& p, const char* op) {
  FM_REQUIRE(std::isfinite(p.eps_norm) && p.eps_norm >= 0, op, "params.eps_norm", "must be finite and >= 0");
  FM_REQUIRE(std::isfinite(p.eps_pre) && p.eps_pre >= 0, op, "params.eps_pre", "must be finite and >= 0");
  FM_REQUIRE(std::isfinite(p.eps_sinkhorn) && p.eps_sinkhorn >= 0, op, "params.eps_sinkhorn",
             "must be finite and >= 0");
  FM_REQUIRE(std::isfinite(p.post_mult), op, "params.post_mult", "must be finite");
  FM_REQUIRE(p.sinkhorn_iters >= 1 && p.sinkhorn_iters <= 10000, op, "params.sinkhorn_iters",
             "must be in [1, 10000] (got ", p.sinkhorn_iters, ")");
  FM_REQUIRE(p.res_layout == MhcResLayout::kDeepSeek || p.res_layout == MhcResLayout::kRowMix, op,
             "params.res_layout", "unknown layout value ", int(p.res_layout));
  return Status::Ok();
}

// 16-byte vectors need 16-byte aligned rows; every row offset (n*C, C
// elements of 2 bytes, C a multiple of 8) keeps that alignment.
Status check_ptr(const void* p, const char* op, const char* name, int align) {
  FM_REQUIRE(p != nullptr, op, name, "null pointer");
  FM_REQUIRE(reinterpret_cast<uintptr_t>(p) % uintptr_t(align) == 0, op, name, "must be ", align,
             "-byte aligned");
  return Status::Ok();
}

Status check_phi_dtype(DType t, const char* op) {
  FM_REQUIRE(dtype_is_valid(t), op, "phi_dtype", "unsupported dtype value ", int(t));
  FM_REQUIRE_SUPPORTED(t == DType::kFloat32 || t == DType::kBFloat16, op, "phi_dtype",
                       "must be float32 or bfloat16");
  return Status::Ok();
}

// The residual stream's value rules at any B (spec §4.9): a known residual
// and scale format; the FP8 one needs C % 128 == 0.
Status check_residual(MhcResidual r, ScaleFormat f, int64_t hidden, const char* op) {
  FM_REQUIRE(r == MhcResidual::kBf16 || r == MhcResidual::kFp8E4m3, op, "residual", "unknown MhcResidual value ",
             int(r));
  FM_REQUIRE(f == ScaleFormat::kFloat32 || f == ScaleFormat::kUE8M0, op, "x_scale_format",
             "unknown ScaleFormat value ", int(f));
  if (r == MhcResidual::kFp8E4m3)
    FM_REQUIRE(hidden % 128 == 0, op, "hidden",
               "must be a multiple of 128 with residual fp8_e4m3 (1 x 128 scale blocks; got ", hidden, ")");
  return Status::Ok();
}

// With kBf16 a scale pointer of the FP8 stream must be null (any B).
Status check_no_scales(MhcResidual r, const void* scales, const char* name, const char* op) {
  if (r == MhcResidual::kBf16)
    FM_REQUIRE(scales == nullptr, op, name, "set with residual bf16 (scales belong to fp8_e4m3)");
  return Status::Ok();
}

// X's bytes: codes of one byte (kFp8E4m3) or bf16.
int64_t x_bytes(const MhcShape& s, MhcResidual r) { return s.batch * s.n * s.hidden * (r == MhcResidual::kBf16 ? 2 : 1); }

// The extent of a scale array of the FP8 stream (0 for kBf16).
Range x_scales_range(const char* name, const void* p, const MhcShape& s, MhcResidual r, ScaleFormat f) {
  return {name, p, r == MhcResidual::kBf16 ? 0 : mhc_x_scale_count(s) * int64_t(scale_bytes(f))};
}

// The post's residual rules (mhc_post, mhc_post_pre, mhc_post_head): the
// FP8 stream's format and C rules, no scales on the bf16 stream.
template <typename Args>
Status check_post_residual(const Args& a, const char* op) {
  FM_RETURN_IF_ERROR(check_residual(a.residual, a.x_scale_format, a.shape.hidden, op));
  FM_RETURN_IF_ERROR(check_no_scales(a.residual, a.x_scales, "x_scales", op));
  return check_no_scales(a.residual, a.x_next_scales, "x_next_scales", op);
}

// The post's input pointers (B > 0): X (and its scales on the FP8 stream),
// F_out, H_post, H_res.
template <typename Args>
Status check_post_input_pointers(const Args& a, const char* op) {
  FM_RETURN_IF_ERROR(check_ptr(a.x, op, "x", 16));
  if (a.residual == MhcResidual::kFp8E4m3)
    FM_RETURN_IF_ERROR(check_ptr(a.x_scales, op, "x_scales", int(scale_bytes(a.x_scale_format))));
  FM_RETURN_IF_ERROR(check_ptr(a.f_out, op, "f_out", 16));
  FM_RETURN_IF_ERROR(check_ptr(a.h_post, op, "h_post", 4));
  return check_ptr(a.h_res, op, "h_res", 4);
}

Status check_kernel(MhcPreKernel k, const char* op) {
  FM_REQUIRE(k == MhcPreKernel::kAuto || k == MhcPreKernel::kResident || k == MhcPreKernel::kSplit ||
                 k == MhcPreKernel::kClusterTile || k == MhcPreKernel::kPortable,
             op, "kernel", "unknown MhcPreKernel value ", int(k));
  return Status::Ok();
}

// The optional small-batch workspace: null (and no size), or 16-byte aligned
// and at least mhc_workspace_bytes(shape) where that is not 0.
Status check_workspace(const MhcShape& s, const void* ws, size_t bytes, const char* op) {
  if (ws == nullptr) {
    FM_REQUIRE(bytes == 0, op, "workspace", "null pointer with workspace_bytes = ", bytes);
    return Status::Ok();
  }
  FM_RETURN_IF_ERROR(check_ptr(ws, op, "workspace", 16));
  const size_t need = mhc_workspace_bytes(s);
  FM_REQUIRE(bytes >= need, op, "workspace_bytes", "must be >= mhc_workspace_bytes(shape) = ", need, " (got ",
             bytes, ")");
  return Status::Ok();
}

// F_pre's epilogue (spec §4.8): the norm's weight and eps, the FP8 copy's
// buffers and format, and f_pre (null only with the FP8 copy). Value rules
// at any B, pointer rules only with work.
template <typename Args>
Status check_epilogue(const Args& a, const char* op) {
  if (a.norm_weight != nullptr) {
    FM_REQUIRE(dtype_is_valid(a.norm_weight_dtype), op, "norm_weight_dtype", "unsupported dtype value ",
               int(a.norm_weight_dtype));
    FM_REQUIRE_SUPPORTED(a.norm_weight_dtype == DType::kFloat32 || a.norm_weight_dtype == DType::kBFloat16, op,
                         "norm_weight_dtype", "must be float32 or bfloat16");
  }
  FM_REQUIRE(std::isfinite(a.norm_eps) && a.norm_eps >= 0, op, "norm_eps", "must be finite and >= 0");
  FM_REQUIRE(a.f_pre_scale_format == ScaleFormat::kFloat32 || a.f_pre_scale_format == ScaleFormat::kUE8M0, op,
             "f_pre_scale_format", "unknown ScaleFormat value ", int(a.f_pre_scale_format));
  const bool fp8 = a.f_pre_fp8 != nullptr || a.f_pre_scales != nullptr;
  if (fp8)
    FM_REQUIRE(a.shape.hidden % 128 == 0, op, "hidden", "must be a multiple of 128 with f_pre_fp8 (1 x 128 blocks; got ",
               a.shape.hidden, ")");
  return Status::Ok();
}

// Its pointers (with work): in the place of f_pre's check among the outputs.
template <typename Args>
Status check_epilogue_pointers(const Args& a, const char* op) {
  const bool fp8 = a.f_pre_fp8 != nullptr || a.f_pre_scales != nullptr;
  if (a.norm_weight != nullptr) FM_RETURN_IF_ERROR(check_ptr(a.norm_weight, op, "norm_weight", 16));
  if (fp8) {
    FM_REQUIRE(a.f_pre_fp8 != nullptr, op, "f_pre_fp8", "null pointer (f_pre_scales is set)");
    FM_REQUIRE(a.f_pre_scales != nullptr, op, "f_pre_scales", "null pointer (f_pre_fp8 is set)");
    FM_RETURN_IF_ERROR(check_ptr(a.f_pre_fp8, op, "f_pre_fp8", 16));
    FM_RETURN_IF_ERROR(check_ptr(a.f_pre_scales, op, "f_pre_scales", int(scale_bytes(a.f_pre_scale_format))));
  } else {
    FM_REQUIRE(a.f_pre != nullptr, op, "f_pre", "null pointer (it may be null only with f_pre_fp8)");
  }
  if (a.f_pre != nullptr) FM_RETURN_IF_ERROR(check_ptr(a.f_pre, op, "f_pre", 16));
  return Status::Ok();
}

// The epilogue's buffers as overlap ranges (empty when absent): outputs f_pre
// (bf16), f_pre_fp8, f_pre_scales; input norm_weight.
template <typename Args>
Range f_pre_range(const Args& a) {
  return {"f_pre", a.f_pre, a.f_pre ? a.shape.batch * a.shape.hidden * 2 : 0};
}
template <typename Args>
Range fp8_range(const Args& a) {
  return {"f_pre_fp8", a.f_pre_fp8, a.f_pre_fp8 ? a.shape.batch * a.shape.hidden : 0};
}
template <typename Args>
Range scales_range(const Args& a) {
  return {"f_pre_scales", a.f_pre_scales,
          a.f_pre_scales ? a.shape.batch * (a.shape.hidden / 128) * scale_bytes(a.f_pre_scale_format) : 0};
}
template <typename Args>
Range norm_weight_range(const Args& a) {
  return {"norm_weight", a.norm_weight,
          a.norm_weight ? a.shape.hidden * int64_t(dtype_size(a.norm_weight_dtype)) : 0};
}

// The workspace as an output range for the overlap check (empty when absent).
Range workspace_range(const void* ws, size_t bytes) { return {"workspace", ws, ws ? int64_t(bytes) : 0}; }

}  // namespace

const char* to_string(MhcPreKernel k) {
  switch (k) {
    case MhcPreKernel::kAuto: return "auto";
    case MhcPreKernel::kResident: return "resident";
    case MhcPreKernel::kSplit: return "split";
    case MhcPreKernel::kClusterTile: return "cluster_tile";
    case MhcPreKernel::kPortable: return "portable";
  }
  return "unknown";
}

const char* to_string(MhcBoundaryPath p) {
  switch (p) {
    case MhcBoundaryPath::kAuto: return "auto";
    case MhcBoundaryPath::kFused: return "fused";
    case MhcBoundaryPath::kPostThenPre: return "post_then_pre";
  }
  return "unknown";
}

const char* to_string(MhcResidual r) {
  switch (r) {
    case MhcResidual::kBf16: return "bf16";
    case MhcResidual::kFp8E4m3: return "fp8_e4m3";
  }
  return "unknown";
}

size_t mhc_workspace_bytes(const MhcShape& s) {
  if (s.batch < 1 || s.batch > kMhcSplitMaxBatch || s.n < 1 || s.n > kMhcMaxStreams || s.hidden < 8 ||
      s.hidden % 8 != 0)
    return 0;
  const int64_t ctas = std::min<int64_t>(mhc_detail::kSplitMaxCtas, s.hidden / 8);
  return mhc_detail::split_workspace_layout(ctas, s.batch, mhc_num_coefficients(s.n)).bytes;
}

size_t mhc_epilogue_workspace_bytes(const MhcShape& s) {  // the plain bf16 F_pre
  return mhc_detail::workspace_bytes_with_scratch(s, size_t(s.batch) * size_t(s.hidden) * 2);
}

size_t mhc_post_head_workspace_bytes(const MhcShape& s) {  // the bf16 X_next
  return mhc_detail::workspace_bytes_with_scratch(s, size_t(s.batch) * size_t(s.n) * size_t(s.hidden) * 2);
}

Status validate_mhc_pre(const MhcPreArgs& a) {
  constexpr const char* kOp = "mhc_pre";
  FM_RETURN_IF_ERROR(check_shape(a.shape, kOp, true));
  FM_RETURN_IF_ERROR(check_params(a.params, kOp));
  FM_RETURN_IF_ERROR(check_phi_dtype(a.phi_dtype, kOp));
  FM_RETURN_IF_ERROR(check_kernel(a.kernel, kOp));
  FM_RETURN_IF_ERROR(check_epilogue(a, kOp));
  FM_RETURN_IF_ERROR(check_residual(a.residual, a.x_scale_format, a.shape.hidden, kOp));
  FM_RETURN_IF_ERROR(check_no_scales(a.residual, a.x_scales, "x_scales", kOp));
  if (a.shape.batch == 0) return Status::Ok();  // nothing is read or written
  const bool fp8 = a.residual == MhcResidual::kFp8E4m3;
  FM_RETURN_IF_ERROR(check_ptr(a.x, kOp, "x", 16));
  if (fp8) FM_RETURN_IF_ERROR(check_ptr(a.x_scales, kOp, "x_scales", int(scale_bytes(a.x_scale_format))));
  FM_RETURN_IF_ERROR(check_ptr(a.phi, kOp, "phi", 16));
  FM_RETURN_IF_ERROR(check_ptr(a.alpha, kOp, "alpha", 4));
  FM_RETURN_IF_ERROR(check_ptr(a.bias, kOp, "bias", 4));
  FM_RETURN_IF_ERROR(check_epilogue_pointers(a, kOp));
  FM_RETURN_IF_ERROR(check_ptr(a.h_post, kOp, "h_post", 4));
  FM_RETURN_IF_ERROR(check_ptr(a.h_res, kOp, "h_res", 4));
  FM_RETURN_IF_ERROR(check_workspace(a.shape, a.workspace, a.workspace_bytes, kOp));
  const MhcShape& s = a.shape;
  const int64_t N = mhc_num_coefficients(s.n), K = int64_t(s.n) * s.hidden;
  const Range outs[] = {f_pre_range(a),
                        {"h_post", a.h_post, s.batch * s.n * 4},
                        {"h_res", a.h_res, s.batch * s.n * s.n * 4},
                        workspace_range(a.workspace, a.workspace_bytes),
                        fp8_range(a),
                        scales_range(a)};
  const Range ins[] = {{"x", a.x, x_bytes(s, a.residual)},
                       x_scales_range("x_scales", a.x_scales, s, a.residual, a.x_scale_format),
                       {"phi", a.phi, N * K * int64_t(dtype_size(a.phi_dtype))},
                       {"alpha", a.alpha, 3 * 4},
                       {"bias", a.bias, N * 4},
                       norm_weight_range(a)};
  return check_no_overlap(kOp, outs, ins);
}

Status validate_mhc_post(const MhcPostArgs& a) {
  constexpr const char* kOp = "mhc_post";
  FM_RETURN_IF_ERROR(check_shape(a.shape, kOp, true));
  FM_REQUIRE(a.res_layout == MhcResLayout::kDeepSeek || a.res_layout == MhcResLayout::kRowMix, kOp,
             "res_layout", "unknown layout value ", int(a.res_layout));
  FM_RETURN_IF_ERROR(check_post_residual(a, kOp));
  const bool fp8 = a.residual == MhcResidual::kFp8E4m3;
  if (a.shape.batch == 0) return Status::Ok();
  FM_RETURN_IF_ERROR(check_post_input_pointers(a, kOp));
  FM_RETURN_IF_ERROR(check_ptr(a.x_next, kOp, "x_next", 16));
  if (fp8)
    FM_RETURN_IF_ERROR(check_ptr(a.x_next_scales, kOp, "x_next_scales", int(scale_bytes(a.x_scale_format))));
  const MhcShape& s = a.shape;
  const Range outs[] = {{"x_next", a.x_next, x_bytes(s, a.residual)},
                        x_scales_range("x_next_scales", a.x_next_scales, s, a.residual, a.x_scale_format)};
  const Range ins[] = {{"x", a.x, x_bytes(s, a.residual)},
                       x_scales_range("x_scales", a.x_scales, s, a.residual, a.x_scale_format),
                       {"f_out", a.f_out, s.batch * s.hidden * 2},
                       {"h_post", a.h_post, s.batch * s.n * 4},
                       {"h_res", a.h_res, s.batch * s.n * s.n * 4}};
  return check_no_overlap(kOp, outs, ins);
}

Status validate_mhc_project(const MhcProjectArgs& a) {
  constexpr const char* kOp = "mhc_project";
  FM_RETURN_IF_ERROR(check_shape(a.shape, kOp, true));
  FM_REQUIRE(std::isfinite(a.eps_norm) && a.eps_norm >= 0, kOp, "eps_norm", "must be finite and >= 0");
  FM_RETURN_IF_ERROR(check_phi_dtype(a.phi_dtype, kOp));
  FM_RETURN_IF_ERROR(check_kernel(a.kernel, kOp));
  if (a.shape.batch == 0) return Status::Ok();
  FM_RETURN_IF_ERROR(check_ptr(a.x, kOp, "x", 16));
  FM_RETURN_IF_ERROR(check_ptr(a.phi, kOp, "phi", 16));
  FM_RETURN_IF_ERROR(check_ptr(a.alpha, kOp, "alpha", 4));
  FM_RETURN_IF_ERROR(check_ptr(a.bias, kOp, "bias", 4));
  FM_RETURN_IF_ERROR(check_ptr(a.h, kOp, "h", 4));
  FM_RETURN_IF_ERROR(check_ptr(a.r, kOp, "r", 4));
  FM_RETURN_IF_ERROR(check_workspace(a.shape, a.workspace, a.workspace_bytes, kOp));
  const MhcShape& s = a.shape;
  const int64_t N = mhc_num_coefficients(s.n), K = int64_t(s.n) * s.hidden;
  const Range outs[] = {{"h", a.h, s.batch * N * 4}, {"r", a.r, s.batch * 4},
                        workspace_range(a.workspace, a.workspace_bytes)};
  const Range ins[] = {{"x", a.x, s.batch * K * 2},
                       {"phi", a.phi, N * K * int64_t(dtype_size(a.phi_dtype))},
                       {"alpha", a.alpha, 3 * 4},
                       {"bias", a.bias, N * 4}};
  return check_no_overlap(kOp, outs, ins);
}

Status validate_mhc_activate(const MhcActivateArgs& a) {
  constexpr const char* kOp = "mhc_activate";
  FM_RETURN_IF_ERROR(check_shape(a.shape, kOp, false));
  FM_RETURN_IF_ERROR(check_params(a.params, kOp));
  if (a.shape.batch == 0) return Status::Ok();
  FM_RETURN_IF_ERROR(check_ptr(a.h, kOp, "h", 4));
  FM_RETURN_IF_ERROR(check_ptr(a.h_pre, kOp, "h_pre", 4));
  FM_RETURN_IF_ERROR(check_ptr(a.h_post, kOp, "h_post", 4));
  FM_RETURN_IF_ERROR(check_ptr(a.h_res, kOp, "h_res", 4));
  const MhcShape& s = a.shape;
  const Range outs[] = {{"h_pre", a.h_pre, s.batch * s.n * 4},
                        {"h_post", a.h_post, s.batch * s.n * 4},
                        {"h_res", a.h_res, s.batch * s.n * s.n * 4}};
  const Range ins[] = {{"h", a.h, s.batch * mhc_num_coefficients(s.n) * 4}};
  return check_no_overlap(kOp, outs, ins);
}

Status validate_mhc_pre_mix(const MhcPreMixArgs& a) {
  constexpr const char* kOp = "mhc_pre_mix";
  FM_RETURN_IF_ERROR(check_shape(a.shape, kOp, true));
  if (a.shape.batch == 0) return Status::Ok();
  FM_RETURN_IF_ERROR(check_ptr(a.x, kOp, "x", 16));
  FM_RETURN_IF_ERROR(check_ptr(a.h_pre, kOp, "h_pre", 4));
  FM_RETURN_IF_ERROR(check_ptr(a.f_pre, kOp, "f_pre", 16));
  const MhcShape& s = a.shape;
  const Range outs[] = {{"f_pre", a.f_pre, s.batch * s.hidden * 2}};
  const Range ins[] = {{"x", a.x, s.batch * s.n * s.hidden * 2}, {"h_pre", a.h_pre, s.batch * s.n * 4}};
  return check_no_overlap(kOp, outs, ins);
}

Status validate_mhc_head(const MhcHeadArgs& a) {
  constexpr const char* kOp = "mhc_head";
  FM_RETURN_IF_ERROR(check_shape(a.shape, kOp, true));
  FM_REQUIRE(std::isfinite(a.eps_norm) && a.eps_norm >= 0, kOp, "eps_norm", "must be finite and >= 0");
  FM_REQUIRE(std::isfinite(a.eps_pre) && a.eps_pre >= 0, kOp, "eps_pre", "must be finite and >= 0");
  FM_RETURN_IF_ERROR(check_phi_dtype(a.phi_dtype, kOp));
  FM_RETURN_IF_ERROR(check_kernel(a.kernel, kOp));
  FM_RETURN_IF_ERROR(check_residual(a.residual, a.x_scale_format, a.shape.hidden, kOp));
  FM_RETURN_IF_ERROR(check_no_scales(a.residual, a.x_scales, "x_scales", kOp));
  if (a.shape.batch == 0) return Status::Ok();
  FM_RETURN_IF_ERROR(check_ptr(a.x, kOp, "x", 16));
  if (a.residual == MhcResidual::kFp8E4m3)
    FM_RETURN_IF_ERROR(check_ptr(a.x_scales, kOp, "x_scales", int(scale_bytes(a.x_scale_format))));
  FM_RETURN_IF_ERROR(check_ptr(a.phi, kOp, "phi", 16));
  FM_RETURN_IF_ERROR(check_ptr(a.alpha, kOp, "alpha", 4));
  FM_RETURN_IF_ERROR(check_ptr(a.bias, kOp, "bias", 4));
  FM_RETURN_IF_ERROR(check_ptr(a.out, kOp, "out", 16));
  FM_RETURN_IF_ERROR(check_workspace(a.shape, a.workspace, a.workspace_bytes, kOp));
  const MhcShape& s = a.shape;
  const int64_t K = int64_t(s.n) * s.hidden;
  const Range outs[] = {{"out", a.out, s.batch * s.hidden * 2}, workspace_range(a.workspace, a.workspace_bytes)};
  const Range ins[] = {{"x", a.x, x_bytes(s, a.residual)},
                       x_scales_range("x_scales", a.x_scales, s, a.residual, a.x_scale_format),
                       {"phi", a.phi, s.n * K * int64_t(dtype_size(a.phi_dtype))},
                       {"alpha", a.alpha, 4},
                       {"bias", a.bias, s.n * 4}};
  return check_no_overlap(kOp, outs, ins);
}

Status validate_mhc_expand(const MhcExpandArgs& a) {
  constexpr const char* kOp = "mhc_expand";
  FM_RETURN_IF_ERROR(check_shape(a.shape, kOp, true));
  FM_RETURN_IF_ERROR(check_residual(a.residual, a.x_scale_format, a.shape.hidden, kOp));
  FM_RETURN_IF_ERROR(check_no_scales(a.residual, a.x_scales, "x_scales", kOp));
  const bool fp8 = a.residual == MhcResidual::kFp8E4m3;
  if (a.shape.batch == 0) return Status::Ok();
  FM_RETURN_IF_ERROR(check_ptr(a.embedding, kOp, "embedding", 16));
  FM_RETURN_IF_ERROR(check_ptr(a.x, kOp, "x", 16));
  if (fp8) FM_RETURN_IF_ERROR(check_ptr(a.x_scales, kOp, "x_scales", int(scale_bytes(a.x_scale_format))));
  const MhcShape& s = a.shape;
  const Range outs[] = {{"x", a.x, x_bytes(s, a.residual)},
                        x_scales_range("x_scales", a.x_scales, s, a.residual, a.x_scale_format)};
  const Range ins[] = {{"embedding", a.embedding, s.batch * s.hidden * 2}};
  return check_no_overlap(kOp, outs, ins);
}

Status validate_mhc_post_pre(const MhcPostPreArgs& a) {
  constexpr const char* kOp = "mhc_post_pre";
  FM_RETURN_IF_ERROR(check_shape(a.shape, kOp, true));
  FM_REQUIRE(a.res_layout == MhcResLayout::kDeepSeek || a.res_layout == MhcResLayout::kRowMix, kOp,
             "res_layout", "unknown layout value ", int(a.res_layout));
  FM_RETURN_IF_ERROR(check_params(a.params, kOp));
  FM_RETURN_IF_ERROR(check_phi_dtype(a.phi_dtype, kOp));
  FM_RETURN_IF_ERROR(check_kernel(a.kernel, kOp));
  FM_REQUIRE(a.path == MhcBoundaryPath::kAuto || a.path == MhcBoundaryPath::kFused ||
                 a.path == MhcBoundaryPath::kPostThenPre,
             kOp, "path", "unknown MhcBoundaryPath value ", int(a.path));
  FM_RETURN_IF_ERROR(check_epilogue(a, kOp));
  FM_RETURN_IF_ERROR(check_post_residual(a, kOp));
  if (a.shape.batch == 0) return Status::Ok();  // nothing is read or written
  const bool fp8 = a.residual == MhcResidual::kFp8E4m3;
  const int scale_align = int(scale_bytes(a.x_scale_format));
  FM_RETURN_IF_ERROR(check_post_input_pointers(a, kOp));
  FM_RETURN_IF_ERROR(check_ptr(a.phi, kOp, "phi", 16));
  FM_RETURN_IF_ERROR(check_ptr(a.alpha, kOp, "alpha", 4));
  FM_RETURN_IF_ERROR(check_ptr(a.bias, kOp, "bias", 4));
  FM_RETURN_IF_ERROR(check_ptr(a.x_next, kOp, "x_next", 16));
  if (fp8) FM_RETURN_IF_ERROR(check_ptr(a.x_next_scales, kOp, "x_next_scales", scale_align));
  FM_RETURN_IF_ERROR(check_epilogue_pointers(a, kOp));
  FM_RETURN_IF_ERROR(check_ptr(a.h_post_next, kOp, "h_post_next", 4));
  FM_RETURN_IF_ERROR(check_ptr(a.h_res_next, kOp, "h_res_next", 4));
  FM_RETURN_IF_ERROR(check_workspace(a.shape, a.workspace, a.workspace_bytes, kOp));
  const MhcShape& s = a.shape;
  const int64_t N = mhc_num_coefficients(s.n), K = int64_t(s.n) * s.hidden;
  const Range outs[] = {{"x_next", a.x_next, x_bytes(s, a.residual)},
                        workspace_range(a.workspace, a.workspace_bytes),
                        x_scales_range("x_next_scales", a.x_next_scales, s, a.residual, a.x_scale_format),
                        f_pre_range(a),
                        {"h_post_next", a.h_post_next, s.batch * s.n * 4},
                        {"h_res_next", a.h_res_next, s.batch * s.n * s.n * 4},
                        fp8_range(a),
                        scales_range(a)};
  const Range ins[] = {{"x", a.x, x_bytes(s, a.residual)},
                       x_scales_range("x_scales", a.x_scales, s, a.residual, a.x_scale_format),
                       {"f_out", a.f_out, s.batch * s.hidden * 2},
                       {"h_post", a.h_post, s.batch * s.n * 4},
                       {"h_res", a.h_res, s.batch * s.n * s.n * 4},
                       {"phi", a.phi, N * K * int64_t(dtype_size(a.phi_dtype))},
                       {"alpha", a.alpha, 3 * 4},
                       {"bias", a.bias, N * 4},
                       norm_weight_range(a)};
  return check_no_overlap(kOp, outs, ins);
}

Status validate_mhc_post_head(const MhcPostHeadArgs& a) {
  constexpr const char* kOp = "mhc_post_head";
  FM_RETURN_IF_ERROR(check_shape(a.shape, kOp, true));
  FM_REQUIRE(a.res_layout == MhcResLayout::kDeepSeek || a.res_layout == MhcResLayout::kRowMix, kOp,
             "res_layout", "unknown layout value ", int(a.res_layout));
  FM_REQUIRE(std::isfinite(a.eps_norm) && a.eps_norm >= 0, kOp, "eps_norm", "must be finite and >= 0");
  FM_REQUIRE(std::isfinite(a.eps_pre) && a.eps_pre >= 0, kOp, "eps_pre", "must be finite and >= 0");
  FM_RETURN_IF_ERROR(check_phi_dtype(a.phi_dtype, kOp));
  FM_RETURN_IF_ERROR(check_kernel(a.kernel, kOp));
  FM_REQUIRE(a.path == MhcBoundaryPath::kAuto || a.path == MhcBoundaryPath::kFused ||
                 a.path == MhcBoundaryPath::kPostThenPre,
             kOp, "path", "unknown MhcBoundaryPath value ", int(a.path));
  FM_REQUIRE(a.path != MhcBoundaryPath::kPostThenPre || a.x_next != nullptr || a.shape.batch == 0 ||
                 (a.residual == MhcResidual::kBf16 &&
                  mhc_detail::workspace_scratch(a.workspace, a.workspace_bytes, mhc_post_head_workspace_bytes(a.shape),
                                                a.shape) != nullptr),
             kOp, "x_next",
             "null pointer with path kPostThenPre and no workspace of mhc_post_head_workspace_bytes (the head reads "
             "X_next back)");
  FM_RETURN_IF_ERROR(check_post_residual(a, kOp));
  const bool fp8 = a.residual == MhcResidual::kFp8E4m3;
  FM_REQUIRE(!fp8 || (a.x_next == nullptr) == (a.x_next_scales == nullptr), kOp, "x_next_scales",
             "must be given exactly when x_next is (the FP8 stream's X_next is its codes and scales)");
  if (a.shape.batch == 0) return Status::Ok();  // nothing is read or written
  const int scale_align = int(scale_bytes(a.x_scale_format));
  FM_RETURN_IF_ERROR(check_post_input_pointers(a, kOp));
  FM_RETURN_IF_ERROR(check_ptr(a.phi, kOp, "phi", 16));
  FM_RETURN_IF_ERROR(check_ptr(a.alpha, kOp, "alpha", 4));
  FM_RETURN_IF_ERROR(check_ptr(a.bias, kOp, "bias", 4));
  FM_RETURN_IF_ERROR(check_ptr(a.out, kOp, "out", 16));
  if (a.x_next != nullptr) {
    FM_RETURN_IF_ERROR(check_ptr(a.x_next, kOp, "x_next", 16));
    if (fp8) FM_RETURN_IF_ERROR(check_ptr(a.x_next_scales, kOp, "x_next_scales", scale_align));
  }
  FM_RETURN_IF_ERROR(check_workspace(a.shape, a.workspace, a.workspace_bytes, kOp));
  const MhcShape& s = a.shape;
  const int64_t K = int64_t(s.n) * s.hidden;
  const Range outs[] = {{"out", a.out, s.batch * s.hidden * 2},
                        {"x_next", a.x_next, a.x_next != nullptr ? x_bytes(s, a.residual) : 0},
                        x_scales_range("x_next_scales", a.x_next_scales, s, a.residual, a.x_scale_format),
                        workspace_range(a.workspace, a.workspace_bytes)};
  const Range ins[] = {{"x", a.x, x_bytes(s, a.residual)},
                       x_scales_range("x_scales", a.x_scales, s, a.residual, a.x_scale_format),
                       {"f_out", a.f_out, s.batch * s.hidden * 2},
                       {"h_post", a.h_post, s.batch * s.n * 4},
                       {"h_res", a.h_res, s.batch * s.n * s.n * 4},
                       {"phi", a.phi, s.n * K * int64_t(dtype_size(a.phi_dtype))},
                       {"alpha", a.alpha, 4},
                       {"bias", a.bias, s.n * 4}};
  return check_no_overlap(kOp, outs, ins);
}

}  // namespace flashmix
