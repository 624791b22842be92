// flashmix._C, mHC (spec §4): mhc_pre and its stages (mhc_project,
// mhc_activate, mhc_pre_mix), mhc_post, mhc_head, mhc_expand, the
// projection kernel choice. include/flashmix/mhc.h.
//
// Every function takes every argument (no defaults here): the defaults are
// the library's Args initialisers (MhcParams among them), handed to Python by
// mhc_defaults() at the end of this file, where python/flashmix/mhc.py reads
// them.
//
// X is bf16 [B, n, C] or [B, n*C]; phi [N, n*C] float32 or bf16; alpha
// float32 [3]; bias float32 [N]; N = n*n + 2n.
#include <cstdint>
#include <string>
#include <utility>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include "common.h"
#include "flashmix/mhc.h"

namespace flashmix::python {

using namespace nb::literals;

namespace {

// ---------------------------------------------------------------------------
// Enumerations as strings
// ---------------------------------------------------------------------------

const EnumNames<fm::MhcResLayout>& res_layouts() {
  static const EnumNames<fm::MhcResLayout> names = {{"deepseek", fm::MhcResLayout::kDeepSeek},
                                                    {"row_mix", fm::MhcResLayout::kRowMix}};
  return names;
}

// MhcPreKernel by the library's own names (to_string: "auto", "resident", ...).
const EnumNames<fm::MhcPreKernel>& pre_kernels() {
  static const EnumNames<fm::MhcPreKernel> names = [] {
    EnumNames<fm::MhcPreKernel> n;
    for (fm::MhcPreKernel k : {fm::MhcPreKernel::kAuto, fm::MhcPreKernel::kResident, fm::MhcPreKernel::kSplit,
                               fm::MhcPreKernel::kClusterTile, fm::MhcPreKernel::kPortable})
      n.emplace_back(fm::to_string(k), k);
    return n;
  }();
  return names;
}

fm::MhcPreKernel parse_kernel(const std::string& s, const char* op) { return parse_enum(s, pre_kernels(), op, "kernel"); }

// MhcBoundaryPath by the library's names ("auto", "fused", "post_then_pre").
const EnumNames<fm::MhcBoundaryPath>& boundary_paths() {
  static const EnumNames<fm::MhcBoundaryPath> names = [] {
    EnumNames<fm::MhcBoundaryPath> n;
    for (fm::MhcBoundaryPath p :
         {fm::MhcBoundaryPath::kAuto, fm::MhcBoundaryPath::kFused, fm::MhcBoundaryPath::kPostThenPre})
      n.emplace_back(fm::to_string(p), p);
    return n;
  }();
  return names;
}

// ---------------------------------------------------------------------------
// Shapes and weights
// ---------------------------------------------------------------------------

// n from the columns of a per-stream coefficient array [B, n] (H_pre, H_post).
int streams_from_columns(const In& h, const char* op, const char* arg) {
  require_ndim(h, 2, op, arg);
  const int64_t n = dim(h, 1);
  if (n < 1 || n > fm::kMhcMaxStreams)
    fail(op, arg, "[B, n]: n must be in [1, ", fm::kMhcMaxStreams, "] (got shape ", shape_str(h), ")");
  return int(n);
}

// n from N = n*n + 2n, the rows of phi (or the columns of h).
int streams_from_coefficients(int64_t N, const char* op, const char* arg) {
  for (int n = 1; n <= fm::kMhcMaxStreams; ++n)
    if (fm::mhc_num_coefficients(n) == N) return n;
  fail(op, arg, "has ", N, " coefficients, not N = n*n + 2n for an n in [1, ", fm::kMhcMaxStreams, "]");
}

// X: bf16, contiguous, [B, n, C] or [B, n*C]. Returns the shape (n must be known).
// The FP8 residual stream (spec §4.9): e4m3 codes, uint8, the same shapes.
template <typename A>
fm::MhcShape residual_shape(const A& x, int n, const char* op, const char* arg,
                            nb::dlpack::dtype dtype = kBFloat16) {
  require_dtype(x, dtype, op, arg);
  require_contiguous(x, op, arg);
  fm::MhcShape s;
  s.n = n;
  if (x.ndim() == 3) {
    if (dim(x, 1) != n) fail(op, arg, "must have n = ", n, " streams in dimension 1 (got shape ", shape_str(x), ")");
    s.batch = dim(x, 0);
    s.hidden = dim(x, 2);
  } else if (x.ndim() == 2) {
    if (dim(x, 1) % n != 0)
      fail(op, arg, "[B, n*C]: ", dim(x, 1), " columns is not a multiple of n = ", n, " (shape ", shape_str(x), ")");
    s.batch = dim(x, 0);
    s.hidden = dim(x, 1) / n;
  } else {
    fail(op, arg, "must be [B, n, C] or [B, n*C] (got shape ", shape_str(x), ")");
  }
  return s;
}

// phi [N, K] (fp32 or bf16), alpha fp32 [>= n_alpha], bias fp32 [N], all contiguous.
fm::DType check_weights(const In& phi, const In& alpha, const In& bias, int64_t N, int64_t K, int64_t n_alpha,
                        const char* op) {
  fm::DType t = float_dtype(phi, op, "phi");
  if (t == fm::DType::kFloat16) fail(op, "phi", "must be float32 or bfloat16 (got float16)");
  require_shape(phi, {N, K}, op, "phi");
  require_contiguous(phi, op, "phi");
  require_vector(alpha, kFloat32, n_alpha, op, "alpha");
  require_dense(bias, kFloat32, {N}, op, "bias");
  return t;
}

// x, phi, alpha, bias on one device.
void add_projection_inputs(Placement& w, const In& x, const In& phi, const In& alpha, const In& bias) {
  w.add(x, "x", phi, "phi", alpha, "alpha", bias, "bias");
}

// The input pointers of a projection op (checked by the caller).
template <typename Args>
void set_projection_pointers(Args& a, const In& x, const In& phi, const In& alpha, const In& bias) {
  a.x = ptr(x);
  a.phi = ptr(phi);
  a.alpha = static_cast<const float*>(ptr(alpha));
  a.bias = static_cast<const float*>(ptr(bias));
}

// The projection's inputs, shared by mhc_pre and mhc_project (whose Args
// name them alike): n from phi's N rows, the shape from x, the weights
// checked against both; sets shape, phi_dtype and the four pointers and
// returns N.
template <typename Args>
int64_t set_projection_inputs(Args& a, const In& x, const In& phi, const In& alpha, const In& bias, const char* op,
                              nb::dlpack::dtype x_dtype = kBFloat16) {
  require_ndim(phi, 2, op, "phi");
  const int64_t N = dim(phi, 0);
  const int n = streams_from_coefficients(N, op, "phi");
  a.shape = residual_shape(x, n, op, "x", x_dtype);
  a.phi_dtype = check_weights(phi, alpha, bias, N, n * a.shape.hidden, 3, op);
  set_projection_pointers(a, x, phi, alpha, bias);
  return N;
}

// The options mhc_pre, mhc_post_pre, mhc_project and mhc_head take the same way.
template <typename Args>
void set_projection_options(Args& a, bool enable_pdl, const std::string& kernel, const OptOut& workspace,
                            const char* op) {
  a.enable_pdl = enable_pdl;
  a.kernel = parse_kernel(kernel, op);
  set_workspace(a, workspace, op);
}

// The activations' parameters (mhc_pre, mhc_activate); the fields an op does
// not take keep MhcParams' defaults.
void set_activation_params(fm::MhcParams& p, float eps_pre, float post_mult, float eps_sinkhorn,
                           int sinkhorn_iters) {
  p.eps_pre = eps_pre;
  p.post_mult = post_mult;
  p.eps_sinkhorn = eps_sinkhorn;
  p.sinkhorn_iters = sinkhorn_iters;
}

// F_pre's epilogue (spec §4.8), mhc_pre and mhc_post_pre alike: norm_weight
// bf16 or float32 [C] (None: no norm); f_pre_fp8 uint8 [B, C] (float8_e4m3fn
// bytes) with f_pre_scales [B, C/128] float32 or uint8 (ue8m0), both or
// neither. The shape must be set.
template <typename Args>
void set_epilogue(Args& a, const OptIn& norm_weight, float norm_eps, const OptOut& f_pre_fp8,
                  const OptOut& f_pre_scales, const std::string& f_pre_scale_format, const char* op) {
  const int64_t B = a.shape.batch, C = a.shape.hidden;
  if (!fm::parse_scale_format(f_pre_scale_format.c_str(), &a.f_pre_scale_format))
    fail(op, "f_pre_scale_format", "must be \"float32\" or \"ue8m0\" (got \"", f_pre_scale_format, "\")");
  if (norm_weight) {
    const bool f32 = norm_weight->dtype() == kFloat32;
    require_dense(*norm_weight, f32 ? kFloat32 : kBFloat16, {C}, op, "norm_weight");
    a.norm_weight = ptr(*norm_weight);
    a.norm_weight_dtype = f32 ? fm::DType::kFloat32 : fm::DType::kBFloat16;
  }
  a.norm_eps = norm_eps;
  if (bool(f_pre_fp8) != bool(f_pre_scales))
    fail(op, f_pre_fp8 ? "f_pre_scales" : "f_pre_fp8", "f_pre_fp8 and f_pre_scales come together");
  if (f_pre_fp8) {
    if (C % 128 != 0) fail(op, "hidden", "must be a multiple of 128 with f_pre_fp8 (got C = ", C, ")");
    require_dense(*f_pre_fp8, kUInt8, {B, C}, op, "f_pre_fp8");
    require_dense(*f_pre_scales, a.f_pre_scale_format == fm::ScaleFormat::kUE8M0 ? kUInt8 : kFloat32, {B, C / 128},
                  op, "f_pre_scales");
    a.f_pre_fp8 = mut(*f_pre_fp8);
    a.f_pre_scales = mut(*f_pre_scales);
  }
}

// The FP8 residual stream (spec §4.9): the residual from whether scales are
// given, the scale format parsed; returns x's dtype (uint8 codes or bf16).
template <typename Args>
nb::dlpack::dtype set_residual(Args& a, bool fp8, const std::string& x_scale_format, const char* op) {
  if (!fm::parse_scale_format(x_scale_format.c_str(), &a.x_scale_format))
    fail(op, "x_scale_format", "must be \"float32\" or \"ue8m0\" (got \"", x_scale_format, "\")");
  a.residual = fp8 ? fm::MhcResidual::kFp8E4m3 : fm::MhcResidual::kBf16;
  return fp8 ? kUInt8 : kBFloat16;
}

// An FP8 stream scale array: x's shape with the last dimension divided by
// 128 ([B, n, C/128] or [B, n*C/128]), float32 or uint8 (ue8m0) by format;
// C a multiple of 128.
template <typename S, typename X>
void check_x_scales(const S& sc, const X& x, const fm::MhcShape& s, fm::ScaleFormat f, const char* op,
                    const char* name) {
  const int64_t B = s.batch, n = s.n, C = s.hidden;
  if (C % 128 != 0) fail(op, "hidden", "must be a multiple of 128 with the FP8 residual stream (got C = ", C, ")");
  const nb::dlpack::dtype sd = f == fm::ScaleFormat::kUE8M0 ? kUInt8 : kFloat32;
  if (x.ndim() == 3) require_dense(sc, sd, {B, n, C / 128}, op, name);
  else require_dense(sc, sd, {B, n * C / 128}, op, name);
}

// X_next beside X (mhc_post, mhc_post_pre): x's dtype and number of
// elements, contiguous, not over x; on the FP8 stream (residual set) both
// scale arrays (check_x_scales). The shape must be set.
template <typename Args>
void set_x_next(Args& a, const In& x, const Out& x_next, const OptIn& x_scales, const OptOut& x_next_scales,
                nb::dlpack::dtype x_dtype, const char* op) {
  if (a.residual == fm::MhcResidual::kFp8E4m3) {
    check_x_scales(*x_scales, x, a.shape, a.x_scale_format, op, "x_scales");
    check_x_scales(*x_next_scales, x, a.shape, a.x_scale_format, op, "x_next_scales");
    a.x_scales = ptr(*x_scales);
    a.x_next_scales = mut(*x_next_scales);
  }
  require_dtype(x_next, x_dtype, op, "x_next");
  require_contiguous(x_next, op, "x_next");
  if (x_next.size() != x.size()) fail(op, "x_next", "must have x's shape ", shape_str(x), " (got ", shape_str(x_next), ")");
  if (overlaps(ptr(x), x.nbytes(), mut(x_next), x_next.nbytes())) fail(op, "x_next", "must not overlap x");
}

// ---------------------------------------------------------------------------
// mhc_pre and its kernel choice
// ---------------------------------------------------------------------------

struct PreCall {
  fm::MhcPreArgs args;
  Placement where;
};

PreCall make_pre(const In& x, const In& phi, const In& alpha, const In& bias, const OptOut& f_pre, const Out& h_post,
                 const Out& h_res, float eps_norm, float eps_pre, float post_mult, float eps_sinkhorn,
                 int sinkhorn_iters, const std::string& res_layout, bool enable_pdl, bool prefetch_weights,
                 const std::string& kernel, const OptOut& workspace, const OptIn& norm_weight, float norm_eps,
                 const OptOut& f_pre_fp8, const OptOut& f_pre_scales, const std::string& f_pre_scale_format,
                 const OptIn& x_scales, const std::string& x_scale_format, const char* op) {
  PreCall c{{}, Placement(op)};
  Placement& w = c.where;
  add_projection_inputs(w, x, phi, alpha, bias);
  w.add(f_pre, "f_pre", h_post, "h_post", h_res, "h_res", workspace, "workspace");
  w.add(norm_weight, "norm_weight", f_pre_fp8, "f_pre_fp8", f_pre_scales, "f_pre_scales");
  w.add(x_scales, "x_scales");

  fm::MhcPreArgs& a = c.args;
  const nb::dlpack::dtype x_dtype = set_residual(a, bool(x_scales), x_scale_format, op);
  set_projection_inputs(a, x, phi, alpha, bias, op, x_dtype);
  if (x_scales) {
    check_x_scales(*x_scales, x, a.shape, a.x_scale_format, op, "x_scales");
    a.x_scales = ptr(*x_scales);
  }
  const int64_t B = a.shape.batch, C = a.shape.hidden, n = a.shape.n;
  if (f_pre) require_dense(*f_pre, kBFloat16, {B, C}, op, "f_pre");
  require_dense(h_post, kFloat32, {B, n}, op, "h_post");
  require_dense(h_res, kFloat32, {B, n, n}, op, "h_res");
  set_epilogue(a, norm_weight, norm_eps, f_pre_fp8, f_pre_scales, f_pre_scale_format, op);
  a.f_pre = f_pre ? mut(*f_pre) : nullptr;
  a.h_post = static_cast<float*>(mut(h_post));
  a.h_res = static_cast<float*>(mut(h_res));
  a.params.eps_norm = eps_norm;
  set_activation_params(a.params, eps_pre, post_mult, eps_sinkhorn, sinkhorn_iters);
  a.params.res_layout = parse_enum(res_layout, res_layouts(), op, "res_layout");
  a.prefetch_weights = prefetch_weights;
  set_projection_options(a, enable_pdl, kernel, workspace, op);
  return c;
}

void mhc_pre(const In& x, const In& phi, const In& alpha, const In& bias, const OptOut& f_pre, const Out& h_post,
             const Out& h_res, float eps_norm, float eps_pre, float post_mult, float eps_sinkhorn, int sinkhorn_iters,
             const std::string& res_layout, bool enable_pdl, bool prefetch_weights, const std::string& kernel,
             const OptOut& workspace, const OptIn& norm_weight, float norm_eps, const OptOut& f_pre_fp8,
             const OptOut& f_pre_scales, const std::string& f_pre_scale_format, const OptIn& x_scales,
             const std::string& x_scale_format, uintptr_t stream) {
  constexpr const char* op = "mhc_pre";
  const PreCall c = make_pre(x, phi, alpha, bias, f_pre, h_post, h_res, eps_norm, eps_pre, post_mult, eps_sinkhorn,
                             sinkhorn_iters, res_layout, enable_pdl, prefetch_weights, kernel, workspace, norm_weight,
                             norm_eps, f_pre_fp8, f_pre_scales, f_pre_scale_format, x_scales, x_scale_format, op);
  dispatch(
      c.where, op, [&] { return fm::mhc_pre(c.args, as_stream(stream)); }, [&] { return fm::mhc_pre_cpu(c.args); });
}

// (kernel name, reason): the projection kernel mhc_pre would run for these
// arguments on their CUDA device. Launches nothing.
std::pair<std::string, std::string> mhc_pre_kernel_choice(
    const In& x, const In& phi, const In& alpha, const In& bias, const OptOut& f_pre, const Out& h_post,
    const Out& h_res, float eps_norm, float eps_pre, float post_mult, float eps_sinkhorn, int sinkhorn_iters,
    const std::string& res_layout, bool enable_pdl, bool prefetch_weights, const std::string& kernel,
    const OptOut& workspace, const OptIn& norm_weight, float norm_eps, const OptOut& f_pre_fp8,
    const OptOut& f_pre_scales, const std::string& f_pre_scale_format, const OptIn& x_scales,
    const std::string& x_scale_format) {
  constexpr const char* op = "mhc_pre_kernel_choice";
  const PreCall c = make_pre(x, phi, alpha, bias, f_pre, h_post, h_res, eps_norm, eps_pre, post_mult, eps_sinkhorn,
                             sinkhorn_iters, res_layout, enable_pdl, prefetch_weights, kernel, workspace, norm_weight,
                             norm_eps, f_pre_fp8, f_pre_scales, f_pre_scale_format, x_scales, x_scale_format, op);
  if (!c.where.cuda()) fail(op, "x", "the kernel choice is made for a CUDA device: pass CUDA arrays");
  fm::MhcPreKernel chosen = fm::MhcPreKernel::kAuto;
  std::string reason;
  fm::Status s;
  {
    CudaDeviceGuard guard(c.where.device(), op);
    s = fm::mhc_pre_kernel_choice(c.args, &chosen, &reason);
  }
  raise_if_error(s);
  return {fm::to_string(chosen), reason};
}

// ---------------------------------------------------------------------------
// mhc_post
// ---------------------------------------------------------------------------

// The FP8 residual stream (spec §4.9): x and x_next uint8 (e4m3 codes) of
// the same shape, x_scales and x_next_scales both given, x's shape with the
// last dimension divided by 128 ([B, n, C/128] or [B, n*C/128]), float32 or
// uint8 (ue8m0) by x_scale_format.
void mhc_post(const In& x, const In& f_out, const In& h_post, const In& h_res, const Out& x_next,
              const OptIn& x_scales, const OptOut& x_next_scales, const std::string& x_scale_format,
              const std::string& res_layout, bool enable_pdl, uintptr_t stream) {
  constexpr const char* op = "mhc_post";
  Placement w(op);
  w.add(x, "x", f_out, "f_out", h_post, "h_post", h_res, "h_res", x_next, "x_next");
  w.add(x_scales, "x_scales", x_next_scales, "x_next_scales");

  const int64_t n = streams_from_columns(h_post, op, "h_post");
  fm::MhcPostArgs a;
  const bool fp8 = bool(x_scales) || bool(x_next_scales);
  if (fp8 && !(x_scales && x_next_scales))
    fail(op, x_scales ? "x_next_scales" : "x_scales", "x_scales and x_next_scales come together (the FP8 residual stream)");
  const nb::dlpack::dtype x_dtype = set_residual(a, fp8, x_scale_format, op);
  a.shape = residual_shape(x, int(n), op, "x", x_dtype);
  const int64_t B = a.shape.batch, C = a.shape.hidden;
  require_dense(f_out, kBFloat16, {B, C}, op, "f_out");
  require_dense(h_post, kFloat32, {B, n}, op, "h_post");
  require_dense(h_res, kFloat32, {B, n, n}, op, "h_res");
  set_x_next(a, x, x_next, x_scales, x_next_scales, x_dtype, op);
  a.x = ptr(x);
  a.f_out = ptr(f_out);
  a.h_post = static_cast<const float*>(ptr(h_post));
  a.h_res = static_cast<const float*>(ptr(h_res));
  a.x_next = mut(x_next);
  a.res_layout = parse_enum(res_layout, res_layouts(), op, "res_layout");
  a.enable_pdl = enable_pdl;
  dispatch(
      w, op, [&] { return fm::mhc_post(a, as_stream(stream)); }, [&] { return fm::mhc_post_cpu(a); });
}

// ---------------------------------------------------------------------------
// mhc_post_pre: the layer boundary (this post, the next pre) in one op
// ---------------------------------------------------------------------------

// F_pre's epilogue (spec §4.8): set_epilogue; f_pre may be None with f_pre_fp8.
void mhc_post_pre(const In& x, const In& f_out, const In& h_post, const In& h_res, const In& phi, const In& alpha,
                  const In& bias, const Out& x_next, const OptOut& f_pre, const Out& h_post_next,
                  const Out& h_res_next, const std::string& res_layout, float eps_norm, float eps_pre,
                  float post_mult, float eps_sinkhorn, int sinkhorn_iters, bool enable_pdl, bool prefetch_weights,
                  const std::string& kernel, const std::string& path, const OptOut& workspace,
                  const OptIn& norm_weight, float norm_eps, const OptOut& f_pre_fp8, const OptOut& f_pre_scales,
                  const std::string& f_pre_scale_format, const OptIn& x_scales, const OptOut& x_next_scales,
                  const std::string& x_scale_format, uintptr_t stream) {
  constexpr const char* op = "mhc_post_pre";
  Placement w(op);
  w.add(x, "x", f_out, "f_out", h_post, "h_post", h_res, "h_res", workspace, "workspace");
  add_projection_inputs(w, x, phi, alpha, bias);
  w.add(x_next, "x_next", f_pre, "f_pre", h_post_next, "h_post_next", h_res_next, "h_res_next");
  w.add(norm_weight, "norm_weight", f_pre_fp8, "f_pre_fp8", f_pre_scales, "f_pre_scales");
  w.add(x_scales, "x_scales", x_next_scales, "x_next_scales");
  fm::MhcPostPreArgs a;
  const bool fp8 = bool(x_scales) || bool(x_next_scales);
  if (fp8 && !(x_scales && x_next_scales))
    fail(op, x_scales ? "x_next_scales" : "x_scales", "x_scales and x_next_scales come together (the FP8 residual stream)");
  const nb::dlpack::dtype x_dtype = set_residual(a, fp8, x_scale_format, op);
  require_ndim(phi, 2, op, "phi");
  const int64_t N = dim(phi, 0);
  const int n = streams_from_coefficients(N, op, "phi");
  a.shape = residual_shape(x, n, op, "x", x_dtype);
  const int64_t B = a.shape.batch, C = a.shape.hidden;
  a.phi_dtype = check_weights(phi, alpha, bias, N, n * C, 3, op);
  require_dense(f_out, kBFloat16, {B, C}, op, "f_out");
  require_dense(h_post, kFloat32, {B, n}, op, "h_post");
  require_dense(h_res, kFloat32, {B, n, n}, op, "h_res");
  set_x_next(a, x, x_next, x_scales, x_next_scales, x_dtype, op);
  if (f_pre) require_dense(*f_pre, kBFloat16, {B, C}, op, "f_pre");
  require_dense(h_post_next, kFloat32, {B, n}, op, "h_post_next");
  require_dense(h_res_next, kFloat32, {B, n, n}, op, "h_res_next");
  set_epilogue(a, norm_weight, norm_eps, f_pre_fp8, f_pre_scales, f_pre_scale_format, op);
  a.x = ptr(x);
  a.f_out = ptr(f_out);
  a.h_post = static_cast<const float*>(ptr(h_post));
  a.h_res = static_cast<const float*>(ptr(h_res));
  a.phi = ptr(phi);
  a.alpha = static_cast<const float*>(ptr(alpha));
  a.bias = static_cast<const float*>(ptr(bias));
  a.x_next = mut(x_next);
  a.f_pre = f_pre ? mut(*f_pre) : nullptr;
  a.h_post_next = static_cast<float*>(mut(h_post_next));
  a.h_res_next = static_cast<float*>(mut(h_res_next));
  a.res_layout = parse_enum(res_layout, res_layouts(), op, "res_layout");
  a.params.eps_norm = eps_norm;
  set_activation_params(a.params, eps_pre, post_mult, eps_sinkhorn, sinkhorn_iters);
  a.prefetch_weights = prefetch_weights;
  set_projection_options(a, enable_pdl, kernel, workspace, op);
  a.path = parse_enum(path, boundary_paths(), op, "path");
  dispatch(
      w, op, [&] { return fm::mhc_post_pre(a, as_stream(stream)); }, [&] { return fm::mhc_post_pre_cpu(a); });
}

// ---------------------------------------------------------------------------
// mhc_post_head: the last boundary (the last post, the head) in one op
// ---------------------------------------------------------------------------

// x_next None: X_next is not stored. The FP8 residual stream with x_scales;
// there x_next_scales comes with x_next.
void mhc_post_head(const In& x, const In& f_out, const In& h_post, const In& h_res, const In& phi, const In& alpha,
                   const In& bias, const Out& out, const OptOut& x_next, const std::string& res_layout,
                   float eps_norm, float eps_pre, bool enable_pdl, const std::string& kernel,
                   const OptOut& workspace, const OptIn& x_scales, const OptOut& x_next_scales,
                   const std::string& x_scale_format, uintptr_t stream) {
  constexpr const char* op = "mhc_post_head";
  Placement w(op);
  w.add(x, "x", f_out, "f_out", h_post, "h_post", h_res, "h_res", workspace, "workspace");
  add_projection_inputs(w, x, phi, alpha, bias);
  w.add(out, "out", x_next, "x_next");
  w.add(x_scales, "x_scales", x_next_scales, "x_next_scales");
  require_ndim(phi, 2, op, "phi");
  const int64_t n = dim(phi, 0);
  if (n < 1 || n > fm::kMhcMaxStreams)
    fail(op, "phi", "[n, n*C]: n must be in [1, ", fm::kMhcMaxStreams, "] (got shape ", shape_str(phi), ")");
  const bool fp8 = bool(x_scales);
  if (x_next_scales && !fp8) fail(op, "x_scales", "x_next_scales needs x_scales (the FP8 residual stream)");
  if (fp8 && bool(x_next) != bool(x_next_scales))
    fail(op, x_next ? "x_next_scales" : "x_next",
         "on the FP8 residual stream x_next and x_next_scales come together (or neither: X_next not stored)");
  fm::MhcPostHeadArgs a;
  const nb::dlpack::dtype x_dtype = set_residual(a, fp8, x_scale_format, op);
  a.shape = residual_shape(x, int(n), op, "x", x_dtype);
  const int64_t B = a.shape.batch, C = a.shape.hidden;
  a.phi_dtype = check_weights(phi, alpha, bias, n, n * C, 1, op);
  require_dense(f_out, kBFloat16, {B, C}, op, "f_out");
  require_dense(h_post, kFloat32, {B, n}, op, "h_post");
  require_dense(h_res, kFloat32, {B, n, n}, op, "h_res");
  require_dense(out, kBFloat16, {B, C}, op, "out");
  if (x_next) {
    set_x_next(a, x, *x_next, x_scales, x_next_scales, x_dtype, op);
    a.x_next = mut(*x_next);
  } else if (fp8) {
    check_x_scales(*x_scales, x, a.shape, a.x_scale_format, op, "x_scales");
    a.x_scales = ptr(*x_scales);
  }
  set_projection_pointers(a, x, phi, alpha, bias);
  a.f_out = ptr(f_out);
  a.h_post = static_cast<const float*>(ptr(h_post));
  a.h_res = static_cast<const float*>(ptr(h_res));
  a.out = mut(out);
  a.res_layout = parse_enum(res_layout, res_layouts(), op, "res_layout");
  a.eps_norm = eps_norm;
  a.eps_pre = eps_pre;
  set_projection_options(a, enable_pdl, kernel, workspace, op);
  dispatch(
      w, op, [&] { return fm::mhc_post_head(a, as_stream(stream)); }, [&] { return fm::mhc_post_head_cpu(a); });
}

// ---------------------------------------------------------------------------
// The stages of mhc_pre: project, activate, pre mix
// ---------------------------------------------------------------------------

void mhc_project(const In& x, const In& phi, const In& alpha, const In& bias, const Out& h, const Out& r,
                 float eps_norm, bool enable_pdl, bool prefetch_weights, const std::string& kernel,
                 const OptOut& workspace, uintptr_t stream) {
  constexpr const char* op = "mhc_project";
  Placement w(op);
  add_projection_inputs(w, x, phi, alpha, bias);
  w.add(h, "h", r, "r", workspace, "workspace");
  fm::MhcProjectArgs a;
  const int64_t N = set_projection_inputs(a, x, phi, alpha, bias, op);
  const int64_t B = a.shape.batch;
  require_dense(h, kFloat32, {B, N}, op, "h");
  require_dense(r, kFloat32, {B}, op, "r");
  a.h = static_cast<float*>(mut(h));
  a.r = static_cast<float*>(mut(r));
  a.eps_norm = eps_norm;
  a.prefetch_weights = prefetch_weights;
  set_projection_options(a, enable_pdl, kernel, workspace, op);
  dispatch(
      w, op, [&] { return fm::mhc_project(a, as_stream(stream)); }, [&] { return fm::mhc_project_cpu(a); });
}

void mhc_activate(const In& h, const Out& h_pre, const Out& h_post, const Out& h_res, float eps_pre, float post_mult,
                  float eps_sinkhorn, int sinkhorn_iters, bool enable_pdl, uintptr_t stream) {
  constexpr const char* op = "mhc_activate";
  Placement w(op);
  w.add(h, "h", h_pre, "h_pre", h_post, "h_post", h_res, "h_res");
  require_ndim(h, 2, op, "h");
  const int64_t B = dim(h, 0), N = dim(h, 1);
  const int n = streams_from_coefficients(N, op, "h");
  require_dense(h, kFloat32, {B, N}, op, "h");
  require_dense(h_pre, kFloat32, {B, n}, op, "h_pre");
  require_dense(h_post, kFloat32, {B, n}, op, "h_post");
  require_dense(h_res, kFloat32, {B, n, n}, op, "h_res");
  fm::MhcActivateArgs a;
  a.shape.batch = B;
  a.shape.n = n;
  a.h = static_cast<const float*>(ptr(h));
  a.h_pre = static_cast<float*>(mut(h_pre));
  a.h_post = static_cast<float*>(mut(h_post));
  a.h_res = static_cast<float*>(mut(h_res));
  set_activation_params(a.params, eps_pre, post_mult, eps_sinkhorn, sinkhorn_iters);
  a.enable_pdl = enable_pdl;
  dispatch(
      w, op, [&] { return fm::mhc_activate(a, as_stream(stream)); }, [&] { return fm::mhc_activate_cpu(a); });
}

void mhc_pre_mix(const In& x, const In& h_pre, const Out& f_pre, bool enable_pdl, uintptr_t stream) {
  constexpr const char* op = "mhc_pre_mix";
  Placement w(op);
  w.add(x, "x", h_pre, "h_pre", f_pre, "f_pre");
  const int64_t n = streams_from_columns(h_pre, op, "h_pre");
  fm::MhcPreMixArgs a;
  a.shape = residual_shape(x, int(n), op, "x");
  const int64_t B = a.shape.batch, C = a.shape.hidden;
  require_dense(h_pre, kFloat32, {B, n}, op, "h_pre");
  require_dense(f_pre, kBFloat16, {B, C}, op, "f_pre");
  a.x = ptr(x);
  a.h_pre = static_cast<const float*>(ptr(h_pre));
  a.f_pre = mut(f_pre);
  a.enable_pdl = enable_pdl;
  dispatch(
      w, op, [&] { return fm::mhc_pre_mix(a, as_stream(stream)); }, [&] { return fm::mhc_pre_mix_cpu(a); });
}

// ---------------------------------------------------------------------------
// mhc_head, mhc_expand: the ends of an mHC model
// ---------------------------------------------------------------------------

void mhc_head(const In& x, const In& phi, const In& alpha, const In& bias, const Out& out, float eps_norm,
              float eps_pre, bool enable_pdl, const std::string& kernel, const OptOut& workspace,
              const OptIn& x_scales, const std::string& x_scale_format, uintptr_t stream) {
  constexpr const char* op = "mhc_head";
  Placement w(op);
  add_projection_inputs(w, x, phi, alpha, bias);
  w.add(out, "out", workspace, "workspace");
  w.add(x_scales, "x_scales");
  require_ndim(phi, 2, op, "phi");
  const int64_t n = dim(phi, 0);
  if (n < 1 || n > fm::kMhcMaxStreams)
    fail(op, "phi", "[n, n*C]: n must be in [1, ", fm::kMhcMaxStreams, "] (got shape ", shape_str(phi), ")");
  fm::MhcHeadArgs a;
  const nb::dlpack::dtype x_dtype = set_residual(a, bool(x_scales), x_scale_format, op);
  a.shape = residual_shape(x, int(n), op, "x", x_dtype);
  if (x_scales) {
    check_x_scales(*x_scales, x, a.shape, a.x_scale_format, op, "x_scales");
    a.x_scales = ptr(*x_scales);
  }
  const int64_t B = a.shape.batch, C = a.shape.hidden;
  a.phi_dtype = check_weights(phi, alpha, bias, n, n * C, 1, op);
  require_dense(out, kBFloat16, {B, C}, op, "out");
  set_projection_pointers(a, x, phi, alpha, bias);
  a.out = mut(out);
  a.eps_norm = eps_norm;
  a.eps_pre = eps_pre;
  set_projection_options(a, enable_pdl, kernel, workspace, op);
  dispatch(
      w, op, [&] { return fm::mhc_head(a, as_stream(stream)); }, [&] { return fm::mhc_head_cpu(a); });
}

// The FP8 residual stream (spec §4.9) with x_scales: x uint8 (e4m3 codes)
// [B, n, C], x_scales [B, n, C/128] float32 or uint8 (ue8m0) by x_scale_format.
void mhc_expand(const In& embedding, const Out& x, const OptOut& x_scales, const std::string& x_scale_format,
                bool enable_pdl, uintptr_t stream) {
  constexpr const char* op = "mhc_expand";
  Placement w(op);
  w.add(embedding, "embedding", x, "x");
  w.add(x_scales, "x_scales");
  require_ndim(x, 3, op, "x");
  const int64_t n = dim(x, 1);
  if (n < 1 || n > fm::kMhcMaxStreams)
    fail(op, "x", "[B, n, C]: n must be in [1, ", fm::kMhcMaxStreams, "] (got shape ", shape_str(x), ")");
  fm::MhcExpandArgs a;
  const nb::dlpack::dtype x_dtype = set_residual(a, bool(x_scales), x_scale_format, op);
  a.shape = residual_shape(x, int(n), op, "x", x_dtype);
  require_dense(embedding, kBFloat16, {a.shape.batch, a.shape.hidden}, op, "embedding");
  if (x_scales) {
    check_x_scales(*x_scales, x, a.shape, a.x_scale_format, op, "x_scales");
    a.x_scales = mut(*x_scales);
  }
  a.embedding = ptr(embedding);
  a.x = mut(x);
  a.enable_pdl = enable_pdl;
  dispatch(
      w, op, [&] { return fm::mhc_expand(a, as_stream(stream)); }, [&] { return fm::mhc_expand_cpu(a); });
}

// ---------------------------------------------------------------------------
// Defaults: the Args initialisers of include/flashmix/mhc.h, by op and by the
// Python name of each keyword (python/flashmix/mhc.py's signatures use them).
// ---------------------------------------------------------------------------

// MhcParams' fields as keywords; with `only_changes`, those that differ from `base`.
nb::dict params_dict(const fm::MhcParams& p, const fm::MhcParams& base = {}, bool only_changes = false) {
  nb::dict d;
  if (!only_changes || p.eps_norm != base.eps_norm) d["eps_norm"] = py_float(p.eps_norm);
  if (!only_changes || p.eps_pre != base.eps_pre) d["eps_pre"] = py_float(p.eps_pre);
  if (!only_changes || p.post_mult != base.post_mult) d["post_mult"] = py_float(p.post_mult);
  if (!only_changes || p.eps_sinkhorn != base.eps_sinkhorn) d["eps_sinkhorn"] = py_float(p.eps_sinkhorn);
  if (!only_changes || p.sinkhorn_iters != base.sinkhorn_iters) d["sinkhorn_iters"] = p.sinkhorn_iters;
  if (!only_changes || p.res_layout != base.res_layout) d["res_layout"] = enum_name(p.res_layout, res_layouts());
  return d;
}

nb::dict mhc_defaults() {
  const fm::MhcPreArgs pre;
  const fm::MhcPostArgs post;
  const fm::MhcProjectArgs project;
  const fm::MhcActivateArgs activate;
  const fm::MhcPreMixArgs pre_mix;
  const fm::MhcHeadArgs head;
  const fm::MhcExpandArgs expand;
  auto launch = [](nb::dict f, bool enable_pdl) {  // every op
    f["enable_pdl"] = enable_pdl;
    return f;
  };
  auto projection = [&](nb::dict f, const auto& a) {  // mhc_pre, mhc_project, mhc_head
    f["kernel"] = fm::to_string(a.kernel);
    return launch(f, a.enable_pdl);
  };
  nb::dict d, f;
  f = params_dict(pre.params);
  f["prefetch_weights"] = pre.prefetch_weights;
  f["norm_eps"] = py_float(pre.norm_eps);
  f["f_pre_scale_format"] = fm::to_string(pre.f_pre_scale_format);
  f["x_scale_format"] = fm::to_string(pre.x_scale_format);
  d["mhc_pre"] = projection(f, pre);
  f = nb::dict();
  f["res_layout"] = enum_name(post.res_layout, res_layouts());
  f["x_scale_format"] = fm::to_string(post.x_scale_format);
  d["mhc_post"] = launch(f, post.enable_pdl);
  f = nb::dict();
  f["eps_norm"] = py_float(project.eps_norm);
  f["prefetch_weights"] = project.prefetch_weights;
  d["mhc_project"] = projection(f, project);
  f = nb::dict();
  f["eps_pre"] = py_float(activate.params.eps_pre);
  f["post_mult"] = py_float(activate.params.post_mult);
  f["eps_sinkhorn"] = py_float(activate.params.eps_sinkhorn);
  f["sinkhorn_iters"] = activate.params.sinkhorn_iters;
  d["mhc_activate"] = launch(f, activate.enable_pdl);
  d["mhc_pre_mix"] = launch(nb::dict(), pre_mix.enable_pdl);
  f = nb::dict();
  f["eps_norm"] = py_float(head.eps_norm);
  f["eps_pre"] = py_float(head.eps_pre);
  f["x_scale_format"] = fm::to_string(head.x_scale_format);
  d["mhc_head"] = projection(f, head);
  f = nb::dict();
  f["x_scale_format"] = fm::to_string(expand.x_scale_format);
  d["mhc_expand"] = launch(f, expand.enable_pdl);
  const fm::MhcPostPreArgs post_pre;
  f = params_dict(post_pre.params);
  f["res_layout"] = enum_name(post_pre.res_layout, res_layouts());  // the post's (the pre's is not read)
  f["prefetch_weights"] = post_pre.prefetch_weights;
  f["kernel"] = fm::to_string(post_pre.kernel);
  f["path"] = fm::to_string(post_pre.path);
  f["norm_eps"] = py_float(post_pre.norm_eps);
  f["f_pre_scale_format"] = fm::to_string(post_pre.f_pre_scale_format);
  f["x_scale_format"] = fm::to_string(post_pre.x_scale_format);
  d["mhc_post_pre"] = launch(f, post_pre.enable_pdl);
  const fm::MhcPostHeadArgs post_head;
  f = nb::dict();
  f["res_layout"] = enum_name(post_head.res_layout, res_layouts());
  f["eps_norm"] = py_float(post_head.eps_norm);
  f["eps_pre"] = py_float(post_head.eps_pre);
  f["x_scale_format"] = fm::to_string(post_head.x_scale_format);
  d["mhc_post_head"] = projection(f, post_head);
  return d;
}

}  // namespace

void register_mhc(nb::module_& m) {
  m.attr("MHC_MAX_STREAMS") = fm::kMhcMaxStreams;
  m.attr("MHC_PRE_KERNELS") = enum_names_tuple(pre_kernels());
  m.attr("MHC_BOUNDARY_PATHS") = enum_names_tuple(boundary_paths());
  m.def("mhc_defaults", &mhc_defaults,
        "The library's defaults of the mHC ops' keywords, {op: {keyword: value}} (the Args initialisers of "
        "flashmix/mhc.h, MhcParams among them); the flashmix package's signatures read them.");
  m.def("mhc_seed_params", [] { return params_dict(fm::MhcParams::seed(), fm::MhcParams{}, true); },
        "MhcParams::seed() as keywords: the fields where it differs from the defaults.");
  m.def("mhc_num_coefficients", &fm::mhc_num_coefficients, "n"_a, "N = n*n + 2n");
  // The workspace size queries: (batch, n, hidden) -> bytes.
  auto def_bytes = [&m](const char* name, size_t (*query)(const fm::MhcShape&), const char* doc) {
    m.def(
        name, [query](int64_t batch, int n, int64_t hidden) { return query(fm::MhcShape{batch, n, hidden}); },
        "batch"_a, "n"_a, "hidden"_a, doc);
  };
  def_bytes("mhc_workspace_bytes", &fm::mhc_workspace_bytes,
            "Bytes of the optional small-batch workspace of mhc_pre / mhc_post_pre / mhc_project / mhc_head / "
            "mhc_post_head (0: not used for this shape). Zero it once; every launch leaves it ready for the next.");
  def_bytes("mhc_epilogue_workspace_bytes", &fm::mhc_epilogue_workspace_bytes,
            "Bytes of a workspace that also holds F_pre's scratch (mhc_workspace_bytes' part first, then 2 B C): with "
            "it, F_pre's epilogue with f_pre None runs as a pass after the resident or split kernel instead of on "
            "the cluster tiles (spec §4.8).");
  def_bytes("mhc_post_head_workspace_bytes", &fm::mhc_post_head_workspace_bytes,
            "Bytes of a workspace that also holds mhc_post_head's X_next scratch (mhc_workspace_bytes' part first, "
            "then 2 B n C): with it and x_next None the op may run post then the head on the resident kernel "
            "(spec §4.10).");

  m.def("mhc_pre", &mhc_pre, "x"_a, "phi"_a, "alpha"_a, "bias"_a, "f_pre"_a.none(), "h_post"_a, "h_res"_a,
        nb::kw_only(), "eps_norm"_a, "eps_pre"_a, "post_mult"_a, "eps_sinkhorn"_a, "sinkhorn_iters"_a, "res_layout"_a,
        "enable_pdl"_a, "prefetch_weights"_a, "kernel"_a, "workspace"_a.none(), "norm_weight"_a.none(), "norm_eps"_a,
        "f_pre_fp8"_a.none(), "f_pre_scales"_a.none(), "f_pre_scale_format"_a, "x_scales"_a.none(),
        "x_scale_format"_a, "stream"_a,
        "spec §4 mhc_pre; n from phi [N, n*C]. §4.8: F_pre's input RMSNorm and FP8 copy. §4.9: with x_scales, x "
        "is the FP8 residual stream (uint8 e4m3 codes).");
  m.def("mhc_pre_kernel_choice", &mhc_pre_kernel_choice, "x"_a, "phi"_a, "alpha"_a, "bias"_a, "f_pre"_a.none(),
        "h_post"_a, "h_res"_a, nb::kw_only(), "eps_norm"_a, "eps_pre"_a, "post_mult"_a, "eps_sinkhorn"_a,
        "sinkhorn_iters"_a, "res_layout"_a, "enable_pdl"_a, "prefetch_weights"_a, "kernel"_a, "workspace"_a.none(),
        "norm_weight"_a.none(), "norm_eps"_a, "f_pre_fp8"_a.none(), "f_pre_scales"_a.none(), "f_pre_scale_format"_a,
        "x_scales"_a.none(), "x_scale_format"_a,
        "(kernel name, reason): the projection kernel mhc_pre would run with these arguments on their CUDA "
        "device. Launches nothing.");
  m.def("mhc_post", &mhc_post, "x"_a, "f_out"_a, "h_post"_a, "h_res"_a, "x_next"_a, nb::kw_only(),
        "x_scales"_a.none(), "x_next_scales"_a.none(), "x_scale_format"_a, "res_layout"_a, "enable_pdl"_a,
        "stream"_a,
        "spec §4 mhc_post; n from h_post [B, n]. §4.9: the FP8 residual stream (x, x_next uint8 e4m3 codes "
        "with x_scales, x_next_scales).");
  m.def("mhc_project", &mhc_project, "x"_a, "phi"_a, "alpha"_a, "bias"_a, "h"_a, "r"_a, nb::kw_only(), "eps_norm"_a,
        "enable_pdl"_a, "prefetch_weights"_a, "kernel"_a, "workspace"_a.none(), "stream"_a);
  m.def("mhc_activate", &mhc_activate, "h"_a, "h_pre"_a, "h_post"_a, "h_res"_a, nb::kw_only(), "eps_pre"_a,
        "post_mult"_a, "eps_sinkhorn"_a, "sinkhorn_iters"_a, "enable_pdl"_a, "stream"_a);
  m.def("mhc_pre_mix", &mhc_pre_mix, "x"_a, "h_pre"_a, "f_pre"_a, nb::kw_only(), "enable_pdl"_a, "stream"_a);
  m.def("mhc_head", &mhc_head, "x"_a, "phi"_a, "alpha"_a, "bias"_a, "out"_a, nb::kw_only(), "eps_norm"_a,
        "eps_pre"_a, "enable_pdl"_a, "kernel"_a, "workspace"_a.none(), "x_scales"_a.none(), "x_scale_format"_a,
        "stream"_a);
  m.def("mhc_post_pre", &mhc_post_pre, "x"_a, "f_out"_a, "h_post"_a, "h_res"_a, "phi"_a, "alpha"_a, "bias"_a,
        "x_next"_a, "f_pre"_a.none(), "h_post_next"_a, "h_res_next"_a, nb::kw_only(), "res_layout"_a, "eps_norm"_a,
        "eps_pre"_a, "post_mult"_a, "eps_sinkhorn"_a, "sinkhorn_iters"_a, "enable_pdl"_a, "prefetch_weights"_a,
        "kernel"_a, "path"_a, "workspace"_a.none(), "norm_weight"_a.none(), "norm_eps"_a, "f_pre_fp8"_a.none(),
        "f_pre_scales"_a.none(), "f_pre_scale_format"_a, "x_scales"_a.none(), "x_next_scales"_a.none(),
        "x_scale_format"_a, "stream"_a,
        "spec §4.7 mhc_post_pre: this layer's post then the next pre in one op; n from phi [N, n*C]. "
        "§4.8: F_pre's input RMSNorm (norm_weight) and FP8 copy (f_pre_fp8, f_pre_scales). §4.9: with "
        "x_scales and x_next_scales, x and x_next are the FP8 residual stream.");
  m.def("mhc_post_head", &mhc_post_head, "x"_a, "f_out"_a, "h_post"_a, "h_res"_a, "phi"_a, "alpha"_a, "bias"_a,
        "out"_a, "x_next"_a.none(), nb::kw_only(), "res_layout"_a, "eps_norm"_a, "eps_pre"_a, "enable_pdl"_a,
        "kernel"_a, "workspace"_a.none(), "x_scales"_a.none(), "x_next_scales"_a.none(), "x_scale_format"_a,
        "stream"_a,
        "spec §4.10 mhc_post_head: the last layer's post then mhc_head in one op; n from phi [n, n*C]. x_next "
        "None: X_next is not stored. §4.9: with x_scales, x (and x_next with x_next_scales) the FP8 residual "
        "stream.");
  m.def("mhc_expand", &mhc_expand, "embedding"_a, "x"_a, nb::kw_only(), "x_scales"_a.none(), "x_scale_format"_a,
        "enable_pdl"_a, "stream"_a,
        "mhc_expand: the embedding into n streams; with x_scales, onto the FP8 residual stream (spec §4.9).");
}

}  // namespace flashmix::python
