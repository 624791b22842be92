// flashmix._C, MoE: routing maps (spec §1), finalize (spec §2), the FC2
// grouped GEMM with the finalize fused (spec §3), the router (spec §8), FC1
// with the gather and the gated activation fused (spec §9), and the whole
// routed-expert layer in one call (spec §10). include/flashmix/moe.h (with
// moe_router.h and moe_fc1.h).
//
// Every function takes every argument (no defaults here): the defaults are
// the library's Args initialisers, handed to Python by moe_defaults() at the
// end of this file, where python/flashmix/moe.py reads them.
#include <cstdint>
#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include "common.h"
#include "flashmix/moe.h"

namespace flashmix::python {

using namespace nb::literals;

namespace {

// ---------------------------------------------------------------------------
// MoE finalize (spec §2)
// ---------------------------------------------------------------------------

struct FinalizeCall {
  fm::FinalizeMoeRoutingArgs args;
  Placement where{"finalize_moe_routing"};
};

// The arrays and the expert range of a finalize call (shared with the debug
// check); launch options stay at the Args' defaults.
FinalizeCall make_finalize(const In& rows, const In& u2p, const In& experts, const Out& out, int num_experts_per_node,
                           int start_expert_id, const OptIn& scales, const OptIn& bias, const OptIn& shared_output,
                           bool fill, const OptIn& p2u, const OptIn& offsets) {
  constexpr const char* op = "finalize_moe_routing";
  FinalizeCall c;
  Placement& w = c.where;
  w.add(out, "out", rows, "expanded_permuted_rows", u2p, "unpermuted_row_to_permuted_row",
        experts, "token_selected_experts", scales, "scales", bias, "bias", shared_output, "shared_output",
        p2u, "permuted_row_to_unpermuted_row", offsets, "expert_first_token_offset");

  fm::FinalizeMoeRoutingArgs& a = c.args;
  require_dense_rank(experts, kInt32, 2, op, "token_selected_experts");
  const int64_t T = dim(experts, 0), k = dim(experts, 1);

  a.out_dtype = float_dtype(out, op, "out");
  a.out_stride = row_stride(out, op, "out");
  if (dim(out, 0) != T) fail(op, "out", "must have T = ", T, " rows, one per token (got shape ", shape_str(out), ")");
  const int64_t H = dim(out, 1);

  a.rows_dtype = float_dtype(rows, op, "expanded_permuted_rows");
  a.rows_stride = row_stride(rows, op, "expanded_permuted_rows");
  if (dim(rows, 1) < H)
    fail(op, "expanded_permuted_rows", "rows are shorter than out's hidden size ", H, " (got shape ",
         shape_str(rows), ")");
  a.num_rows = dim(rows, 0);

  require_vector(u2p, kInt32, 0, op, "unpermuted_row_to_permuted_row");
  if (int64_t(u2p.size()) != k * T)
    fail(op, "unpermuted_row_to_permuted_row", "must hold k*T = ", k * T, " elements (got shape ", shape_str(u2p),
         ")");
  if (scales) require_dense(*scales, kFloat32, {T, k}, op, "scales");
  if (bias) {
    require_dtype(*bias, to_dlpack(a.rows_dtype), op, "bias");  // the library reads bias as rows_dtype
    a.bias_stride = row_stride(*bias, op, "bias");
    if (dim(*bias, 0) != num_experts_per_node || dim(*bias, 1) < H)
      fail(op, "bias", "must have shape [num_experts_per_node = ", num_experts_per_node, ", >= ", H, "] (got ",
           shape_str(*bias), ")");
  }
  a.shared_stride = shared_output_stride(shared_output, to_dlpack(a.out_dtype), T, H, op);  // read as out_dtype
  // Zero tokens: nothing is read (docs/spec.md), whatever the maps hold.
  if (p2u) require_vector(*p2u, kInt32, fill || T == 0 ? 0 : a.num_rows, op, "permuted_row_to_unpermuted_row");
  if (offsets)
    require_vector(*offsets, kInt64, T == 0 ? 0 : int64_t(num_experts_per_node) + 1, op, "expert_first_token_offset");

  a.expanded_permuted_rows = ptr(rows);
  a.unpermuted_row_to_permuted_row = static_cast<const int32_t*>(ptr(u2p));
  a.token_selected_experts = static_cast<const int32_t*>(ptr(experts));
  a.scales = static_cast<const float*>(ptr(scales));
  a.bias = ptr(bias);
  a.shared_output = ptr(shared_output);
  a.out = mut(out);
  a.num_tokens = T;
  a.hidden = H;
  a.k = int(k);
  a.start_expert_id = start_expert_id;
  a.num_experts_per_node = num_experts_per_node;
  a.fill = fill;
  a.permuted_row_to_unpermuted_row = static_cast<const int32_t*>(ptr(p2u));
  a.expert_first_token_offset = static_cast<const int64_t*>(ptr(offsets));
  return c;
}

void finalize_moe_routing(const In& rows, const In& u2p, const In& experts, const Out& out,
                          int num_experts_per_node, int start_expert_id, const OptIn& scales, const OptIn& bias,
                          const OptIn& shared_output, bool fill, const OptIn& p2u, const OptIn& offsets,
                          bool enable_pdl, bool prefetch_indices, int threads_per_block, int vectors_per_thread,
                          int chunks_per_token, int schedule, uintptr_t stream) {
  FinalizeCall c = make_finalize(rows, u2p, experts, out, num_experts_per_node, start_expert_id, scales, bias,
                                 shared_output, fill, p2u, offsets);
  fm::FinalizeMoeRoutingArgs& a = c.args;
  a.enable_pdl = enable_pdl;
  a.prefetch_indices = prefetch_indices;
  a.tuning.threads_per_block = threads_per_block;
  a.tuning.vectors_per_thread = vectors_per_thread;
  a.tuning.chunks_per_token = chunks_per_token;
  a.tuning.schedule = schedule;
  dispatch(
      c.where, "finalize_moe_routing", [&] { return fm::finalize_moe_routing(a, as_stream(stream)); },
      [&] { return fm::finalize_moe_routing_cpu(a); });
}

void debug_check_finalize_moe_routing_indices(const In& rows, const In& u2p, const In& experts, const Out& out,
                                              int num_experts_per_node, int start_expert_id, const OptIn& scales,
                                              const OptIn& bias, const OptIn& shared_output, bool fill,
                                              const OptIn& p2u, const OptIn& offsets, uintptr_t stream) {
  const FinalizeCall c = make_finalize(rows, u2p, experts, out, num_experts_per_node, start_expert_id, scales, bias,
                                       shared_output, fill, p2u, offsets);
  if (!c.where.cuda())
    fail("debug_check_finalize_moe_routing_indices", "out",
         "the debug check copies device arrays to the host: pass CUDA arrays");
  dispatch(
      c.where, "debug_check_finalize_moe_routing_indices",
      [&] { return fm::debug_check_finalize_moe_routing_indices(c.args, as_stream(stream)); },
      [] { return fm::Status::Ok(); });
}

// ---------------------------------------------------------------------------
// MoE routing maps (spec §1)
// ---------------------------------------------------------------------------

size_t build_moe_routing_maps_workspace_size(int64_t num_tokens, int k, int num_experts_per_node,
                                             int start_expert_id, int single_block_max_slots) {
  // The size query validates the whole Args, pointers included; it never
  // dereferences them, so placeholders stand in for the arrays.
  fm::MoeRoutingArgs a;
  a.token_selected_experts = placeholder<const int32_t>(0);
  a.num_tokens = num_tokens;
  a.k = k;
  a.start_expert_id = start_expert_id;
  a.num_experts_per_node = num_experts_per_node;
  a.expert_first_token_offset = placeholder<int64_t>(1);
  a.permuted_row_to_unpermuted_row = placeholder<int32_t>(2);
  a.unpermuted_row_to_permuted_row = placeholder<int32_t>(3);
  a.tuning.single_block_max_slots = single_block_max_slots;
  raise_if_error(fm::validate_moe_routing_maps(a));
  return fm::build_moe_routing_maps_workspace_size(a);
}

void build_moe_routing_maps(const In& experts, const Out& offsets, const Out& p2u, const Out& u2p,
                            int num_experts_per_node, int start_expert_id, const OptIn& input,
                            const OptOut& permuted_input, const OptOut& permuted_input_scales,
                            const std::string& scale_format, const OptOut& workspace, bool enable_pdl,
                            int single_block_max_slots, uintptr_t stream) {
  constexpr const char* op = "build_moe_routing_maps";
  Placement w(op);
  w.add(experts, "token_selected_experts", offsets, "expert_first_token_offset",
        p2u, "permuted_row_to_unpermuted_row", u2p, "unpermuted_row_to_permuted_row", input, "input",
        permuted_input, "permuted_input", permuted_input_scales, "permuted_input_scales", workspace, "workspace");

  require_dense_rank(experts, kInt32, 2, op, "token_selected_experts");
  const int64_t T = dim(experts, 0), k = dim(experts, 1);
  require_vector(offsets, kInt64, int64_t(num_experts_per_node) + 1, op, "expert_first_token_offset");
  require_vector(p2u, kInt32, k * T, op, "permuted_row_to_unpermuted_row");
  require_vector(u2p, kInt32, k * T, op, "unpermuted_row_to_permuted_row");

  fm::MoeRoutingArgs a;
  a.token_selected_experts = static_cast<const int32_t*>(ptr(experts));
  a.num_tokens = T;
  a.k = int(k);
  a.start_expert_id = start_expert_id;
  a.num_experts_per_node = num_experts_per_node;
  a.expert_first_token_offset = static_cast<int64_t*>(mut(offsets));
  a.permuted_row_to_unpermuted_row = static_cast<int32_t*>(mut(p2u));
  a.unpermuted_row_to_permuted_row = static_cast<int32_t*>(mut(u2p));
  a.enable_pdl = enable_pdl;
  a.tuning.single_block_max_slots = single_block_max_slots;
  if (input.has_value() != permuted_input.has_value())
    fail(op, input ? "permuted_input" : "input", "give both input and permuted_input, or neither");
  if (permuted_input_scales && !input)
    fail(op, "permuted_input_scales", "the FP8 expansion needs input and permuted_input");
  if (input) {
    a.input_dtype = float_dtype(*input, op, "input");
    a.input_stride = row_stride(*input, op, "input");
    if (dim(*input, 0) != T) fail(op, "input", "must have T = ", T, " rows (got shape ", shape_str(*input), ")");
    a.hidden = dim(*input, 1);
    if (permuted_input_scales) {
      // The FP8 expansion (spec §1.4): e4m3 codes as uint8, scales [>= k*T, H / 128] dense.
      if (!fm::parse_scale_format(scale_format.c_str(), &a.permuted_scale_format))
        fail(op, "scale_format", "must be \"float32\" or \"ue8m0\" (got \"", scale_format, "\")");
      require_dtype(*permuted_input, kUInt8, op, "permuted_input");
      if (a.hidden % 128 != 0)
        fail(op, "hidden", "must be a multiple of 128 for the FP8 expansion (got H = ", a.hidden, ")");
      const bool ue8m0 = a.permuted_scale_format == fm::ScaleFormat::kUE8M0;
      require_dense_rank(*permuted_input_scales, ue8m0 ? kUInt8 : kFloat32, 2, op, "permuted_input_scales");
      if (dim(*permuted_input_scales, 0) < k * T || dim(*permuted_input_scales, 1) * 128 != a.hidden)
        fail(op, "permuted_input_scales", "must have shape [>= k*T = ", k * T, ", H / 128 = ", a.hidden / 128,
             "] (got ", shape_str(*permuted_input_scales), ")");
      a.permuted_input_scales = mut(*permuted_input_scales);
    } else {
      require_dtype(*permuted_input, input->dtype(), op, "permuted_input");
    }
    a.permuted_input_stride = row_stride(*permuted_input, op, "permuted_input");
    if (dim(*permuted_input, 0) < k * T || dim(*permuted_input, 1) != a.hidden)
      fail(op, "permuted_input", "must have shape [>= k*T = ", k * T, ", ", a.hidden, "] (got ",
           shape_str(*permuted_input), ")");
    a.input = ptr(input);
    a.permuted_input = mut(*permuted_input);
  }
  const Workspace ws = workspace_of(workspace, op);
  dispatch(
      w, op, [&] { return fm::build_moe_routing_maps(a, ws.ptr, ws.bytes, as_stream(stream)); },
      [&] { return fm::build_moe_routing_maps_cpu(a); });
}

// ---------------------------------------------------------------------------
// MoE FC2 grouped GEMM + finalize (spec §3)
// ---------------------------------------------------------------------------

// Fc2Mode in Python, in the order of FC2_MODES.
const EnumNames<fm::Fc2Mode>& fc2_modes() {
  static const EnumNames<fm::Fc2Mode> names = {{"atomic", fm::Fc2Mode::kAtomic},
                                               {"atomic_fp32", fm::Fc2Mode::kAtomicFp32},
                                               {"deterministic", fm::Fc2Mode::kDeterministic},
                                               {"unfused", fm::Fc2Mode::kUnfused}};
  return names;
}

// An enum's values by the library's own names (its to_string), in this order.
template <typename E>
EnumNames<E> library_names(std::initializer_list<E> values) {
  EnumNames<E> n;
  for (E v : values) n.push_back({fm::to_string(v), v});
  return n;
}

// Fc2GemmKernel by the library's own names (to_string: "auto", "rows", ...).
const EnumNames<fm::Fc2GemmKernel>& fc2_gemm_kernels() {
  static const EnumNames<fm::Fc2GemmKernel> names =
      library_names({fm::Fc2GemmKernel::kAuto, fm::Fc2GemmKernel::kRows, fm::Fc2GemmKernel::kCutlassCooperative,
                     fm::Fc2GemmKernel::kCutlassPingpong});
  return names;
}

size_t moe_fc2_finalize_workspace_size(int64_t num_tokens, int k, int64_t hidden, int64_t inter,
                                       int num_experts_per_node, const std::string& mode, int device) {
  fm::Fc2FinalizeArgs a;  // placeholders: validated, never dereferenced
  a.A = placeholder<const void>(0);
  a.W2 = placeholder<const void>(1);
  a.expert_first_token_offset = placeholder<const int64_t>(2);
  a.permuted_row_to_unpermuted_row = placeholder<const int32_t>(3);
  a.out = placeholder<void>(4);
  a.num_tokens = num_tokens;
  a.k = k;
  a.hidden = hidden;
  a.inter = inter;
  a.num_experts_per_node = num_experts_per_node;
  a.mode = parse_enum(mode, fc2_modes(), "moe_fc2_finalize", "mode");
  raise_if_error(fm::validate_moe_fc2_finalize(a));
  if (device < 0) return fm::moe_fc2_finalize_workspace_size(a);  // the current device
  CudaDeviceGuard guard(device, "moe_fc2_finalize_workspace_size");
  return fm::moe_fc2_finalize_workspace_size(a);
}

const EnumNames<fm::MoeFp8Scaling>& fp8_scalings() {
  static const EnumNames<fm::MoeFp8Scaling> names =
      library_names({fm::MoeFp8Scaling::kNone, fm::MoeFp8Scaling::kBlock, fm::MoeFp8Scaling::kTensor});
  return names;
}

// The element type of X / W1 / A / W2 under an FP8 scaling: bf16, or e4m3 bytes
// (the Python side hands float8_e4m3fn over as uint8).
nb::dlpack::dtype fp8_elem(fm::MoeFp8Scaling f) { return f == fm::MoeFp8Scaling::kNone ? kBFloat16 : kUInt8; }

// The two scale tensors of an FP8 GEMM (spec §11.2): activations `xs` [rows, K/128]
// (kBlock) or [1] (kTensor), weights `ws` [E, ceil(N/128), K/128] or [E]; none with kNone.
void require_fp8_scales(fm::MoeFp8Scaling f, const OptIn& xs, const OptIn& ws, int64_t rows, int64_t E, int64_t N,
                        int64_t K, const char* op, const char* xs_arg, const char* ws_arg) {
  if (f == fm::MoeFp8Scaling::kNone) {
    if (xs || ws) fail(op, xs ? xs_arg : ws_arg, "given with fp8 = \"none\" (bf16 operands have no scales)");
    return;
  }
  if (!xs) fail(op, xs_arg, "required with fp8 = \"", fm::to_string(f), "\"");
  if (!ws) fail(op, ws_arg, "required with fp8 = \"", fm::to_string(f), "\"");
  if (f == fm::MoeFp8Scaling::kBlock) {
    if (K % 128) fail(op, "fp8", "\"block\" needs K a multiple of 128 (got ", K, ")");
    require_dense(*xs, kFloat32, {rows, K / 128}, op, xs_arg);
    require_dense(*ws, kFloat32, {E, (N + 127) / 128, K / 128}, op, ws_arg);
  } else {
    require_dense(*xs, kFloat32, {1}, op, xs_arg);
    require_dense(*ws, kFloat32, {E}, op, ws_arg);
  }
}

// MoeWeightFormat by the library's names: "dense", "mxfp4".
const EnumNames<fm::MoeWeightFormat>& weight_formats() {
  static const EnumNames<fm::MoeWeightFormat> names =
      library_names({fm::MoeWeightFormat::kDense, fm::MoeWeightFormat::kMxfp4});
  return names;
}

// The FP8 scaling of the activations and the weight format of a call: with
// MXFP4 weights fp8 picks the activations, "block" (W4A8) or "none" (W4A16).
fm::MoeWeightFormat parse_weights(const std::string& weights, fm::MoeFp8Scaling f, const char* op) {
  const fm::MoeWeightFormat w = parse_enum(weights, weight_formats(), op, "weights");
  if (w == fm::MoeWeightFormat::kMxfp4 && f == fm::MoeFp8Scaling::kTensor)
    fail(op, "fp8", "weights = \"mxfp4\" takes fp8 = \"block\" (W4A8: e4m3 activations) or \"none\" (W4A16: bf16 "
         "activations), not \"tensor\"");
  return w;
}

// An MXFP4 weight stack (spec §13.1): packed e2m1 bytes [E, N, K / 2] beside
// ue8m0 scale bytes [E, N, K / 32]; K (the GEMM's) a multiple of 128.
struct MxShape {
  int64_t E = 0, N = 0, K = 0;
};

// Packed e2m1 bytes: uint8 (the package views torch.float4_e2m1fn_x2 as
// uint8), 3-D, dense.
void require_packed(const In& w, const char* op, const char* arg) {
  if (!(w.dtype() == kUInt8))
    fail(op, arg, "must be packed e2m1 bytes with weights = \"mxfp4\": uint8 (or torch.float4_e2m1fn_x2, viewed "
         "as uint8) (got ", dtype_name(w.dtype()), ")");
  require_ndim(w, 3, op, arg);
  require_contiguous(w, op, arg);
}

// The packed bytes `w` [E, N, K / 2]: E, N and K = 2 * w.shape[2], named
// `k_name` in the error when K is not a multiple of 128.
MxShape mxfp4_weight(const In& w, const char* op, const char* arg, const char* k_name) {
  require_packed(w, op, arg);
  const MxShape m{dim(w, 0), dim(w, 1), 2 * dim(w, 2)};
  if (m.K % 128)
    fail(op, arg, "weights = \"mxfp4\" needs ", k_name, " = 2 * ", arg, ".shape[2] a multiple of 128 (got shape ",
         shape_str(w), ", ", k_name, " = ", m.K, ")");
  return m;
}

// The packed bytes `w` with the shape [E, N, K / 2] another array implies
// (`what` says which).
void require_mxfp4_shape(const In& w, const MxShape& m, const char* op, const char* arg, const char* what) {
  require_packed(w, op, arg);
  if (dim(w, 0) != m.E || dim(w, 1) != m.N || dim(w, 2) != m.K / 2)
    fail(op, arg, "must be packed MXFP4 [", m.E, ", ", m.N, ", ", m.K / 2, "] (", what, ") (got ", shape_str(w), ")");
}

// The ue8m0 scales `s` of the packed weight `w_arg` [E, N, K / 2]: required,
// uint8 (or float8_e8m0fnu, viewed as uint8) [E, N, K / 32], dense.
void require_mx_scales(const OptIn& s, const MxShape& m, const char* op, const char* arg, const char* w_arg) {
  if (!s) fail(op, arg, "required with weights = \"mxfp4\" (the ue8m0 scales of ", w_arg, ")");
  if (!(s->dtype() == kUInt8))
    fail(op, arg, "must be ue8m0 scale bytes: uint8 (or torch.float8_e8m0fnu, viewed as uint8) (got ",
         dtype_name(s->dtype()), ")");
  if (s->ndim() != 3 || dim(*s, 0) != m.E || dim(*s, 1) != m.N || dim(*s, 2) != m.K / 32)
    fail(op, arg, "must have shape [", m.E, ", ", m.N, ", ", m.K / 32, "], one scale per 32 of K beside ", w_arg,
         " [", m.E, ", ", m.N, ", ", m.K / 2, "] (got ", shape_str(*s), ")");
  require_contiguous(*s, op, arg);
}

// Scales of the other weight format: dense weights take no ue8m0 scales, MXFP4
// weights no fp32 block scales.
void forbid_other_scales(fm::MoeWeightFormat w, const OptIn& dense_scales, const char* dense_arg,
                         const OptIn& mx_scales, const char* mx_arg, const char* op) {
  if (w == fm::MoeWeightFormat::kMxfp4) {
    if (dense_scales)
      fail(op, dense_arg, "given with weights = \"mxfp4\" (MXFP4 weights carry their scales in ", mx_arg, ")");
  } else if (mx_scales) {
    fail(op, mx_arg, "given with weights = \"dense\" (ue8m0 scales belong to MXFP4 weights: pass weights = "
         "\"mxfp4\")");
  }
}

// The activations' scales of an FP8 GEMM alone (MXFP4 weights carry theirs):
// kBlock [rows, K / 128] fp32; none with kNone.
void require_act_scales(fm::MoeFp8Scaling f, const OptIn& xs, int64_t rows, int64_t K, const char* op,
                        const char* arg) {
  if (f == fm::MoeFp8Scaling::kNone) {
    if (xs) fail(op, arg, "given with fp8 = \"none\" (bf16 operands have no scales)");
    return;
  }
  if (!xs) fail(op, arg, "required with fp8 = \"", fm::to_string(f), "\"");
  require_dense(*xs, kFloat32, {rows, K / 128}, op, arg);
}

void moe_fc2_finalize(const In& A, const In& W2, const In& offsets, const In& p2u, const Out& out, int k,
                      const OptIn& scales, const OptIn& bias, bool apply_bias, const OptIn& shared_output, bool fill,
                      const std::string& mode, bool out_already_zeroed, const std::string& fp8,
                      const OptIn& a_scales, const OptIn& w2_scales, const std::string& weights,
                      const OptIn& w2_mx_scales, const OptOut& workspace, const std::string& gemm_kernel, int raster,
                      int swizzle, uintptr_t stream) {
  constexpr const char* op = "moe_fc2_finalize";
  Placement w(op);
  w.add(out, "out", A, "A", W2, "W2", offsets, "expert_first_token_offset", p2u, "permuted_row_to_unpermuted_row",
        scales, "scales", bias, "bias", shared_output, "shared_output", a_scales, "a_scales", w2_scales, "w2_scales",
        w2_mx_scales, "w2_mx_scales", workspace, "workspace");

  const fm::MoeFp8Scaling f = parse_enum(fp8, fp8_scalings(), op, "fp8");
  const fm::MoeWeightFormat wf = parse_weights(weights, f, op);
  const bool mx = wf == fm::MoeWeightFormat::kMxfp4;
  forbid_other_scales(wf, w2_scales, "w2_scales", w2_mx_scales, "w2_mx_scales", op);
  int64_t E = 0, H = 0, I = 0;
  if (mx) {  // W2 packed [E, H, I / 2] + ue8m0 [E, H, I / 32] (spec §13.7)
    const MxShape m = mxfp4_weight(W2, op, "W2", "I");
    require_mx_scales(w2_mx_scales, m, op, "w2_mx_scales", "W2");
    E = m.E, H = m.N, I = m.K;
  } else {
    require_dense_rank(W2, fp8_elem(f), 3, op, "W2");
    E = dim(W2, 0), H = dim(W2, 1), I = dim(W2, 2);
  }
  require_dense_rank(A, fp8_elem(f), 2, op, "A");
  if (dim(A, 1) != I)
    fail(op, "A", "must have I = ", I, " columns, as W2 ", mx ? "[E, H, I / 2] (packed MXFP4)" : "[E, H, I]",
         " (got shape ", shape_str(A), ")");
  require_dtype(out, kBFloat16, op, "out");
  fm::Fc2FinalizeArgs a;
  a.out_stride = row_stride(out, op, "out");
  if (dim(out, 1) != H) fail(op, "out", "must have H = ", H, " columns, as W2 [E, H, I] (got shape ", shape_str(out), ")");
  const int64_t T = dim(out, 0);
  require_vector(offsets, kInt64, E + 1, op, "expert_first_token_offset");
  require_dtype(p2u, kInt32, op, "permuted_row_to_unpermuted_row");
  require_contiguous(p2u, op, "permuted_row_to_unpermuted_row");
  if (scales) require_dense(*scales, kFloat32, {T, k}, op, "scales");
  if (bias) require_dense(*bias, kBFloat16, {E, H}, op, "bias");
  if (mx)
    require_act_scales(f, a_scales, dim(A, 0), I, op, "a_scales");
  else
    require_fp8_scales(f, a_scales, w2_scales, dim(A, 0), E, H, I, op, "a_scales", "w2_scales");
  a.fp8 = f;
  a.a_scales = static_cast<const float*>(ptr(a_scales));
  a.w2_scales = static_cast<const float*>(ptr(w2_scales));
  a.weights = wf;
  a.w2_mx_scales = ptr(w2_mx_scales);
  a.shared_stride = shared_output_stride(shared_output, kBFloat16, T, H, op);

  a.A = ptr(A);
  a.W2 = ptr(W2);
  a.expert_first_token_offset = static_cast<const int64_t*>(ptr(offsets));
  a.permuted_row_to_unpermuted_row = static_cast<const int32_t*>(ptr(p2u));
  a.scales = static_cast<const float*>(ptr(scales));
  a.bias = ptr(bias);
  a.apply_bias = apply_bias;
  a.shared_output = ptr(shared_output);
  a.fill = fill;
  a.num_tokens = T;
  a.k = k;
  a.hidden = H;
  a.inter = I;
  a.num_experts_per_node = int(E);
  a.out = mut(out);
  a.mode = parse_enum(mode, fc2_modes(), op, "mode");
  a.out_already_zeroed = out_already_zeroed;
  a.tuning.gemm_kernel = parse_enum(gemm_kernel, fc2_gemm_kernels(), op, "gemm_kernel");
  a.tuning.raster = raster;
  a.tuning.swizzle = swizzle;
  const Workspace ws = workspace_of(workspace, op);
  dispatch(
      w, op, [&] { return fm::moe_fc2_finalize(a, ws.ptr, ws.bytes, as_stream(stream)); },
      [&] { return fm::moe_fc2_finalize_cpu(a); });
}

// ---------------------------------------------------------------------------
// MoE router (spec §8)
// ---------------------------------------------------------------------------

// MoeRouterScoring by the library's names: "softmax", "sigmoid", "sqrtsoftplus", "softmax_after_topk".
const EnumNames<fm::MoeRouterScoring>& router_scorings() {
  static const EnumNames<fm::MoeRouterScoring> names =
      library_names({fm::MoeRouterScoring::kSoftmax, fm::MoeRouterScoring::kSigmoid,
                     fm::MoeRouterScoring::kSqrtSoftplus, fm::MoeRouterScoring::kSoftmaxAfterTopk});
  return names;
}

// The logits [T, E] (dense rows, fp32 or bf16) into a router's Args.
void set_router_logits(fm::MoeRouterArgs& r, const In& logits, const char* op, const char* arg) {
  r.logits_dtype = float_dtype(logits, op, arg);
  require_ndim(logits, 2, op, arg);
  require_contiguous(logits, op, arg);
  if (dim(logits, 1) > INT32_MAX) fail(op, arg, "has too many experts (got shape ", shape_str(logits), ")");
  r.logits = ptr(logits);
  r.num_experts = int(dim(logits, 1));
}

// The scoring options that moe_router and moe_forward share (MoeRouterArgs'
// fields from `scoring` to `token_ids_int64`); E = r.num_experts, T tokens, k
// experts each.
void set_router_options(fm::MoeRouterArgs& r, const std::string& scoring, bool renormalize,
                        const OptIn& correction_bias, int n_group, int topk_group, float routed_scaling_factor,
                        const OptIn& token_ids, const OptIn& hash_table, int64_t T, int64_t k, const char* op) {
  r.scoring = parse_enum(scoring, router_scorings(), op, "scoring");
  r.renormalize = renormalize;
  if (correction_bias) require_dense(*correction_bias, kFloat32, {r.num_experts}, op, "correction_bias");
  r.correction_bias = static_cast<const float*>(ptr(correction_bias));
  r.n_group = n_group;
  r.topk_group = topk_group;
  r.routed_scaling_factor = routed_scaling_factor;
  // Hash selection (spec §8.7): both or neither.
  if (bool(token_ids) != bool(hash_table))
    fail(op, token_ids ? "hash_table" : "token_ids", "hash selection takes token_ids and hash_table together (got ",
         token_ids ? "token_ids only" : "hash_table only", ")");
  if (hash_table) {
    require_dense_rank(*hash_table, kInt32, 2, op, "hash_table");
    if (dim(*hash_table, 1) != k)
      fail(op, "hash_table", "must have k = ", k, " columns: [vocab_size, k] (got shape ", shape_str(*hash_table),
           ")");
    r.hash_table = static_cast<const int32_t*>(ptr(hash_table));
    r.vocab_size = dim(*hash_table, 0);
    if (!(token_ids->dtype() == kInt32) && !(token_ids->dtype() == kInt64))
      fail(op, "token_ids", "must be int32 or int64 (got ", dtype_name(token_ids->dtype()), ")");
    r.token_ids_int64 = token_ids->dtype() == kInt64;
    require_dense(*token_ids, r.token_ids_int64 ? kInt64 : kInt32, {T}, op, "token_ids");
    r.token_ids = ptr(token_ids);
  }
}

void moe_router(const In& logits, const Out& ids, const Out& scales, const std::string& scoring, bool renormalize,
                const OptIn& correction_bias, int n_group, int topk_group, float routed_scaling_factor,
                const OptIn& token_ids, const OptIn& hash_table, bool enable_pdl, int path, bool generic_layout,
                uintptr_t stream) {
  constexpr const char* op = "moe_router";
  Placement w(op);
  w.add(logits, "logits", ids, "token_selected_experts", scales, "token_final_scales", correction_bias,
        "correction_bias", token_ids, "token_ids", hash_table, "hash_table");
  fm::MoeRouterArgs a;
  set_router_logits(a, logits, op, "logits");
  const int64_t T = dim(logits, 0);
  require_dense_rank(ids, kInt32, 2, op, "token_selected_experts");
  if (dim(ids, 0) != T)
    fail(op, "token_selected_experts", "must have T = ", T, " rows, as logits [T, E] (got shape ", shape_str(ids),
         ")");
  const int64_t k = dim(ids, 1);
  require_dense(scales, kFloat32, {T, k}, op, "token_final_scales");
  set_router_options(a, scoring, renormalize, correction_bias, n_group, topk_group, routed_scaling_factor, token_ids,
                     hash_table, T, k, op);
  a.num_tokens = T;
  a.k = int(k);
  a.token_selected_experts = static_cast<int32_t*>(mut(ids));
  a.token_final_scales = static_cast<float*>(mut(scales));
  a.enable_pdl = enable_pdl;
  a.tuning.path = path;
  a.tuning.generic_layout = generic_layout;
  dispatch(
      w, op, [&] { return fm::moe_router(a, as_stream(stream)); }, [&] { return fm::moe_router_cpu(a); });
}

// ---------------------------------------------------------------------------
// MoE FC1 with the gather and the gated activation fused (spec §9)
// ---------------------------------------------------------------------------

// MoeActivation and Fc1WeightLayout by the library's names.
const EnumNames<fm::MoeActivation>& fc1_activations() {
  static const EnumNames<fm::MoeActivation> names = library_names(
      {fm::MoeActivation::kSwiGLU, fm::MoeActivation::kSwiGLUOai, fm::MoeActivation::kSwiGLUClamped});
  return names;
}

const EnumNames<fm::Fc1WeightLayout>& fc1_weight_layouts() {
  static const EnumNames<fm::Fc1WeightLayout> names =
      library_names({fm::Fc1WeightLayout::kGateUp, fm::Fc1WeightLayout::kInterleaved});
  return names;
}

// W1 bf16 (or e4m3 bytes) [E_local, 2I, H], dense: returns I.
int64_t fc1_inter(const In& W1, nb::dlpack::dtype elem, const char* op, const char* arg) {
  require_dense_rank(W1, elem, 3, op, arg);
  if (dim(W1, 1) % 2)
    fail(op, arg, "must be [E_local, 2I, H]: an even number of rows per expert (got shape ", shape_str(W1), ")");
  return dim(W1, 1) / 2;
}

void moe_fc1(const In& X, const In& W1, const In& offsets, const In& p2u, const Out& out, int k, int64_t num_tokens,
             const OptIn& bias, const std::string& layout, const std::string& activation, float limit, float alpha,
             bool x_permuted, const std::string& fp8, const OptIn& x_scales, const OptIn& w1_scales,
             const std::string& weights, const OptIn& w1_mx_scales, const OptOut& out_scales,
             const std::string& out_scale_format, bool enable_pdl, uintptr_t stream) {
  constexpr const char* op = "moe_fc1";
  Placement w(op);
  w.add(out, "out", X, "X", W1, "W1", offsets, "expert_first_token_offset", p2u, "permuted_row_to_unpermuted_row",
        bias, "bias", x_scales, "x_scales", w1_scales, "w1_scales", w1_mx_scales, "w1_mx_scales", out_scales,
        "out_scales");

  fm::MoeFc1Args a;
  a.fp8 = parse_enum(fp8, fp8_scalings(), op, "fp8");
  a.weights = parse_weights(weights, a.fp8, op);
  const bool mx = a.weights == fm::MoeWeightFormat::kMxfp4;
  forbid_other_scales(a.weights, w1_scales, "w1_scales", w1_mx_scales, "w1_mx_scales", op);
  int64_t E = 0, I = 0, H = 0;
  if (mx) {  // W1 packed [E, 2I, H / 2] + ue8m0 [E, 2I, H / 32] (spec §13.7)
    const MxShape m = mxfp4_weight(W1, op, "W1", "H");
    if (m.N % 2)
      fail(op, "W1", "must be [E_local, 2I, H / 2]: an even number of rows per expert (got shape ", shape_str(W1),
           ")");
    require_mx_scales(w1_mx_scales, m, op, "w1_mx_scales", "W1");
    E = m.E, I = m.N / 2, H = m.K;
  } else {
    I = fc1_inter(W1, fp8_elem(a.fp8), op, "W1");
    E = dim(W1, 0), H = dim(W1, 2);
  }
  require_dtype(X, fp8_elem(a.fp8), op, "X");
  a.x_stride = row_stride(X, op, "X");
  if (dim(X, 1) != H)
    fail(op, "X", "must have H = ", H, " columns, as W1 ", mx ? "[E, 2I, H / 2] (packed MXFP4)" : "[E, 2I, H]",
         " (got shape ", shape_str(X), ")");
  // T: given, or X's rows (token order) / X's rows over k (permuted: k*T rows).
  // The sizes that depend on k are checked only for a valid k: the library names a bad one.
  const bool k_valid = k >= 1 && k <= 16;
  int64_t T = num_tokens;
  if (T < 0 && !x_permuted) T = dim(X, 0);
  if (T < 0) {
    if (k_valid && dim(X, 0) % k != 0)
      fail(op, "num_tokens", "needed with x_permuted when X's rows are not k*T (got shape ", shape_str(X),
           ", k = ", k, ")");
    T = k_valid ? dim(X, 0) / k : 0;
  }
  const int64_t x_rows = x_permuted ? int64_t(k) * T : T;
  if (k_valid && dim(X, 0) < x_rows)
    fail(op, "X", "must have at least ", x_permuted ? "k*T = " : "T = ", x_rows, " rows (got shape ", shape_str(X),
         ")");
  // The FP8 output (spec §9.8): out e4m3 bytes (uint8), out_scales [>= k*T, I / 128].
  require_dense_rank(out, out_scales ? kUInt8 : kBFloat16, 2, op, "out");
  if (dim(out, 1) != I || (k_valid && dim(out, 0) < int64_t(k) * T))
    fail(op, "out", "must have shape [>= k*T = ", int64_t(k) * T, ", I = ", I, "] (got ", shape_str(out), ")");
  if (out_scales) {
    if (!fm::parse_scale_format(out_scale_format.c_str(), &a.out_scale_format))
      fail(op, "out_scale_format", "must be \"float32\" or \"ue8m0\" (got \"", out_scale_format, "\")");
    if (I % 128 != 0) fail(op, "inter", "must be a multiple of 128 with an FP8 output (got I = ", I, ")");
    const bool ue8m0 = a.out_scale_format == fm::ScaleFormat::kUE8M0;
    require_dense_rank(*out_scales, ue8m0 ? kUInt8 : kFloat32, 2, op, "out_scales");
    if (dim(*out_scales, 1) != I / 128 || (k_valid && dim(*out_scales, 0) < int64_t(k) * T))
      fail(op, "out_scales", "must have shape [>= k*T = ", int64_t(k) * T, ", I / 128 = ", I / 128, "] (got ",
           shape_str(*out_scales), ")");
    a.out_scales = mut(*out_scales);
  }
  require_vector(offsets, kInt64, E + 1, op, "expert_first_token_offset");
  require_dtype(p2u, kInt32, op, "permuted_row_to_unpermuted_row");
  require_contiguous(p2u, op, "permuted_row_to_unpermuted_row");
  if (bias) require_dense(*bias, kBFloat16, {E, 2 * I}, op, "bias");
  if (k_valid) {
    if (mx)
      require_act_scales(a.fp8, x_scales, x_rows, H, op, "x_scales");
    else
      require_fp8_scales(a.fp8, x_scales, w1_scales, x_rows, E, 2 * I, H, op, "x_scales", "w1_scales");
  }
  a.x_scales = static_cast<const float*>(ptr(x_scales));
  a.w1_scales = static_cast<const float*>(ptr(w1_scales));
  a.w1_mx_scales = ptr(w1_mx_scales);

  a.X = ptr(X);
  a.x_permuted = x_permuted;
  a.W1 = ptr(W1);
  a.layout = parse_enum(layout, fc1_weight_layouts(), op, "layout");
  a.bias = ptr(bias);
  a.expert_first_token_offset = static_cast<const int64_t*>(ptr(offsets));
  a.permuted_row_to_unpermuted_row = static_cast<const int32_t*>(ptr(p2u));
  a.num_tokens = T;
  a.k = k;
  a.hidden = H;
  a.inter = I;
  a.num_experts_per_node = int(E);
  a.activation = parse_enum(activation, fc1_activations(), op, "activation");
  a.limit = limit;
  a.alpha = alpha;
  a.out = mut(out);
  a.enable_pdl = enable_pdl;
  dispatch(
      w, op, [&] { return fm::moe_fc1(a, as_stream(stream)); }, [&] { return fm::moe_fc1_cpu(a); });
}

// ---------------------------------------------------------------------------
// The routed-expert layer in one call (spec §10)
// ---------------------------------------------------------------------------

// MoeFc1Input by the library's names: "auto", "gather", "permuted_copy".
const EnumNames<fm::MoeFc1Input>& fc1_inputs() {
  static const EnumNames<fm::MoeFc1Input> names =
      library_names({fm::MoeFc1Input::kAuto, fm::MoeFc1Input::kGather, fm::MoeFc1Input::kPermutedCopy});
  return names;
}

size_t moe_forward_workspace_size(int64_t num_tokens, int k, int64_t hidden, int64_t inter, int num_experts,
                                  int num_experts_per_node, int start_expert_id, bool with_router,
                                  const std::string& mode, const std::string& fc1_input, const std::string& fp8,
                                  const std::string& weights) {
  fm::MoeForwardArgs a;  // placeholders: validated, never dereferenced
  a.fp8 = parse_enum(fp8, fp8_scalings(), "moe_forward", "fp8");
  a.weights = parse_weights(weights, a.fp8, "moe_forward");
  if (a.weights == fm::MoeWeightFormat::kMxfp4) {
    a.w1_mx_scales = placeholder<const void>(5);
    a.w2_mx_scales = placeholder<const void>(6);
  } else if (a.fp8 != fm::MoeFp8Scaling::kNone) {
    a.w1_scales = placeholder<const float>(5);
    a.w2_scales = placeholder<const float>(6);
  }
  a.num_tokens = num_tokens;
  a.hidden = hidden;
  a.inter = inter;
  a.k = k;
  a.start_expert_id = start_expert_id;
  a.num_experts_per_node = num_experts_per_node;
  a.X = placeholder<const void>(0);
  a.W1 = placeholder<const void>(1);
  a.W2 = placeholder<const void>(2);
  a.out = placeholder<void>(3);
  if (with_router) {
    a.router_logits = placeholder<const void>(4);
    // The sizes do not depend on E: the smallest that holds this rank's experts.
    a.num_experts = num_experts > 0 ? num_experts : start_expert_id + num_experts_per_node;
  } else {
    a.token_selected_experts = placeholder<const int32_t>(4);
    a.num_experts = num_experts;
  }
  a.fc2_mode = parse_enum(mode, fc2_modes(), "moe_forward", "mode");
  a.fc1_input = parse_enum(fc1_input, fc1_inputs(), "moe_forward", "fc1_input");
  raise_if_error(fm::validate_moe_forward(a));
  return fm::moe_forward_workspace_size(a);
}

// Arrays of the routed-expert layer; E_local, H, I from W2 [E_local, H, I], T
// from X [T, H].
}  // namespace

// The experts' part of MoeForwardArgs (common.h): E_local, H, I from W2
// [E_local, H, I]; W1 [E_local, 2I, H] beside it; biases; FC1's layout and
// activation; FC2's mode; FP8 weights with their scales (spec §10.4); MXFP4
// weights with their ue8m0 scales (spec §13.7: W1 packed [E_local, 2I, H / 2],
// W2 packed [E_local, H, I / 2]; E_local, H, I then from W2 as H = W2.shape[1],
// I = 2 * W2.shape[2]).
void set_layer_experts(fm::MoeForwardArgs& a, const In& W1, const In& W2, const OptIn& b1, const OptIn& b2,
                       bool apply_b2, const std::string& w1_layout, const std::string& activation, float limit,
                       float alpha, const std::string& mode, const std::string& fp8, const OptIn& w1_scales,
                       const OptIn& w2_scales, const std::string& weights, const OptIn& w1_mx_scales,
                       const OptIn& w2_mx_scales, const char* op) {
  a.fp8 = parse_enum(fp8, fp8_scalings(), op, "fp8");
  a.weights = parse_weights(weights, a.fp8, op);
  const bool mx = a.weights == fm::MoeWeightFormat::kMxfp4;
  forbid_other_scales(a.weights, w1_scales, "w1_scales", w1_mx_scales, "w1_mx_scales", op);
  forbid_other_scales(a.weights, w2_scales, "w2_scales", w2_mx_scales, "w2_mx_scales", op);
  int64_t E = 0, H = 0, I = 0;
  if (mx) {
    const MxShape m2 = mxfp4_weight(W2, op, "W2", "I");
    E = m2.E, H = m2.N, I = m2.K;
    if (H % 128)
      fail(op, "W2", "weights = \"mxfp4\" needs H = W2.shape[1] a multiple of 128 (got shape ", shape_str(W2), ")");
    const MxShape m1{E, 2 * I, H};
    require_mxfp4_shape(W1, m1, op, "W1", "[E_local, 2I, H / 2] beside W2 [E_local, H, I / 2]");
    require_mx_scales(w1_mx_scales, m1, op, "w1_mx_scales", "W1");
    require_mx_scales(w2_mx_scales, m2, op, "w2_mx_scales", "W2");
    a.w1_mx_scales = ptr(w1_mx_scales);
    a.w2_mx_scales = ptr(w2_mx_scales);
  } else {
    require_dense_rank(W2, fp8_elem(a.fp8), 3, op, "W2");
    E = dim(W2, 0), H = dim(W2, 1), I = dim(W2, 2);
    require_dense(W1, fp8_elem(a.fp8), {E, 2 * I, H}, op, "W1");  // [E_local, 2I, H] beside W2 [E_local, H, I]
  }
  // The dense weights' scales (spec §10.4): kBlock 128 x 128 blocks; kTensor one
  // per expert. MXFP4 weights have their ue8m0 scales (above); fp8 then picks
  // the activations only.
  if (mx) {
  } else if (a.fp8 == fm::MoeFp8Scaling::kNone) {
    if (w1_scales || w2_scales)
      fail(op, w1_scales ? "w1_scales" : "w2_scales", "given with fp8 = \"none\" (bf16 weights have no scales)");
  } else {
    if (!w1_scales) fail(op, "w1_scales", "required with fp8 = \"", fm::to_string(a.fp8), "\"");
    if (!w2_scales) fail(op, "w2_scales", "required with fp8 = \"", fm::to_string(a.fp8), "\"");
    if (a.fp8 == fm::MoeFp8Scaling::kBlock) {
      require_dense(*w1_scales, kFloat32, {E, (2 * I + 127) / 128, (H + 127) / 128}, op, "w1_scales");
      require_dense(*w2_scales, kFloat32, {E, (H + 127) / 128, (I + 127) / 128}, op, "w2_scales");
    } else {
      require_dense(*w1_scales, kFloat32, {E}, op, "w1_scales");
      require_dense(*w2_scales, kFloat32, {E}, op, "w2_scales");
    }
  }
  if (b1) require_dense(*b1, kBFloat16, {E, 2 * I}, op, "b1");
  if (b2) require_dense(*b2, kBFloat16, {E, H}, op, "b2");
  a.hidden = H;
  a.inter = I;
  a.num_experts_per_node = int(E);
  a.w1_scales = static_cast<const float*>(ptr(w1_scales));
  a.w2_scales = static_cast<const float*>(ptr(w2_scales));
  a.W1 = ptr(W1);
  a.w1_layout = parse_enum(w1_layout, fc1_weight_layouts(), op, "w1_layout");
  a.b1 = ptr(b1);
  a.activation = parse_enum(activation, fc1_activations(), op, "activation");
  a.activation_limit = limit;
  a.activation_alpha = alpha;
  a.W2 = ptr(W2);
  a.b2 = ptr(b2);
  a.apply_b2 = apply_b2;
  a.fc2_mode = parse_enum(mode, fc2_modes(), op, "mode");
}

namespace {

void moe_forward(const In& X, const In& W1, const In& W2, const Out& out, int k, int num_experts,
                 int start_expert_id, const OptIn& router_logits, const std::string& scoring, bool renormalize,
                 const OptIn& correction_bias, int n_group, int topk_group, float routed_scaling_factor,
                 const OptIn& token_ids, const OptIn& hash_table, const OptIn& token_selected_experts, const OptIn& token_final_scales,
                 const OptOut& selected_experts_out, const OptOut& final_scales_out, const OptIn& b1,
                 const OptIn& b2, bool apply_b2, const std::string& w1_layout, const std::string& activation,
                 float limit, float alpha, const std::string& fc1_input, const std::string& mode,
                 const std::string& fp8, const OptIn& w1_scales, const OptIn& w2_scales, const std::string& weights,
                 const OptIn& w1_mx_scales, const OptIn& w2_mx_scales, const OptIn& shared_output, bool fill,
                 const OptOut& workspace, bool enable_pdl, uintptr_t stream) {
  constexpr const char* op = "moe_forward";
  Placement w(op);
  w.add(out, "out", X, "X", W1, "W1", W2, "W2", router_logits, "router_logits", correction_bias, "correction_bias",
        token_ids, "token_ids", hash_table, "hash_table", token_selected_experts, "token_selected_experts", token_final_scales, "token_final_scales",
        selected_experts_out, "selected_experts_out", final_scales_out, "final_scales_out", b1, "b1", b2, "b2",
        w1_scales, "w1_scales", w2_scales, "w2_scales", w1_mx_scales, "w1_mx_scales", w2_mx_scales, "w2_mx_scales",
        shared_output, "shared_output", workspace, "workspace");

  fm::MoeForwardArgs a;
  set_layer_experts(a, W1, W2, b1, b2, apply_b2, w1_layout, activation, limit, alpha, mode, fp8, w1_scales, w2_scales,
                    weights, w1_mx_scales, w2_mx_scales, op);
  const int64_t H = a.hidden;
  require_dtype(X, kBFloat16, op, "X");
  a.x_stride = row_stride(X, op, "X");
  if (dim(X, 1) != H)
    fail(op, "X", "must have H = ", H, " columns, as W2 ",
         a.weights == fm::MoeWeightFormat::kMxfp4 ? "[E, H, I / 2] (packed MXFP4)" : "[E, H, I]", " (got shape ",
         shape_str(X), ")");
  const int64_t T = dim(X, 0);
  require_dtype(out, kBFloat16, op, "out");
  a.out_stride = row_stride(out, op, "out");
  if (dim(out, 0) != T || dim(out, 1) != H)
    fail(op, "out", "must have shape [T = ", T, ", H = ", H, "] (got ", shape_str(out), ")");

  // Routing: the router on the logits, or the caller's choice.
  if (router_logits) {
    set_router_logits(a.router, *router_logits, op, "router_logits");
    if (dim(*router_logits, 0) != T)
      fail(op, "router_logits", "must have T = ", T, " rows, as X (got shape ", shape_str(*router_logits), ")");
    if (num_experts > 0 && num_experts != a.router.num_experts)
      fail(op, "num_experts", "must be router_logits.shape[1] = ", a.router.num_experts, " (got ", num_experts, ")");
    a.num_experts = a.router.num_experts;
  } else {
    if (!token_selected_experts)
      fail(op, "router_logits", "give router_logits or token_selected_experts (got neither)");
    a.num_experts = num_experts > 0 ? num_experts : 0;
    if (correction_bias) fail(op, "correction_bias", "is the router's: only with router_logits");
    if (hash_table) fail(op, "hash_table", "is the router's: only with router_logits");
    if (selected_experts_out) fail(op, "selected_experts_out", "keeps the router's choice: only with router_logits");
    if (final_scales_out) fail(op, "final_scales_out", "keeps the router's weights: only with router_logits");
  }
  set_router_options(a.router, scoring, renormalize, correction_bias, n_group, topk_group, routed_scaling_factor,
                     token_ids, hash_table, T, k, op);
  if (token_selected_experts) require_dense(*token_selected_experts, kInt32, {T, k}, op, "token_selected_experts");
  if (token_final_scales) require_dense(*token_final_scales, kFloat32, {T, k}, op, "token_final_scales");
  if (selected_experts_out) require_dense(*selected_experts_out, kInt32, {T, k}, op, "selected_experts_out");
  if (final_scales_out) require_dense(*final_scales_out, kFloat32, {T, k}, op, "final_scales_out");
  a.shared_stride = shared_output_stride(shared_output, kBFloat16, T, H, op);

  a.num_tokens = T;
  a.k = k;
  a.start_expert_id = start_expert_id;
  a.X = ptr(X);
  a.router_logits = ptr(router_logits);
  a.token_selected_experts = static_cast<const int32_t*>(ptr(token_selected_experts));
  a.token_final_scales = static_cast<const float*>(ptr(token_final_scales));
  a.selected_experts_out = selected_experts_out ? static_cast<int32_t*>(mut(*selected_experts_out)) : nullptr;
  a.final_scales_out = final_scales_out ? static_cast<float*>(mut(*final_scales_out)) : nullptr;
  a.fc1_input = parse_enum(fc1_input, fc1_inputs(), op, "fc1_input");
  a.shared_output = ptr(shared_output);
  a.fill = fill;
  a.out = mut(out);
  a.enable_pdl = enable_pdl;
  const Workspace ws = workspace_of(workspace, op);
  dispatch(
      w, op, [&] { return fm::moe_forward(a, ws.ptr, ws.bytes, as_stream(stream)); },
      [&] { return fm::moe_forward_cpu(a); });
}

// ---------------------------------------------------------------------------
// Defaults: the Args initialisers of include/flashmix/moe.h, by op and by the
// Python name of each keyword (python/flashmix/moe.py's signatures use them).
// ---------------------------------------------------------------------------

nb::dict moe_defaults() {
  nb::dict d;
  {
    const fm::FinalizeMoeRoutingArgs a;
    nb::dict f;
    f["start_expert_id"] = a.start_expert_id;
    f["fill"] = a.fill;
    f["enable_pdl"] = a.enable_pdl;
    f["prefetch_indices"] = a.prefetch_indices;
    f["threads_per_block"] = a.tuning.threads_per_block;
    f["vectors_per_thread"] = a.tuning.vectors_per_thread;
    f["chunks_per_token"] = a.tuning.chunks_per_token;
    f["schedule"] = a.tuning.schedule;
    d["finalize_moe_routing"] = f;
  }
  {
    const fm::MoeRoutingArgs a;
    nb::dict f;
    f["start_expert_id"] = a.start_expert_id;
    f["enable_pdl"] = a.enable_pdl;
    f["single_block_max_slots"] = a.tuning.single_block_max_slots;
    d["build_moe_routing_maps"] = f;
  }
  {
    const fm::Fc2FinalizeArgs a;
    nb::dict f;
    f["apply_bias"] = a.apply_bias;
    f["fill"] = a.fill;
    f["mode"] = enum_name(a.mode, fc2_modes());
    f["out_already_zeroed"] = a.out_already_zeroed;
    f["fp8"] = enum_name(a.fp8, fp8_scalings());
    f["weights"] = enum_name(a.weights, weight_formats());
    f["gemm_kernel"] = enum_name(a.tuning.gemm_kernel, fc2_gemm_kernels());
    f["raster"] = a.tuning.raster;
    f["swizzle"] = a.tuning.swizzle;
    d["moe_fc2_finalize"] = f;
  }
  {
    const fm::MoeRouterArgs a;
    nb::dict f;
    f["scoring"] = enum_name(a.scoring, router_scorings());
    f["renormalize"] = a.renormalize;
    f["n_group"] = a.n_group;
    f["topk_group"] = a.topk_group;
    f["routed_scaling_factor"] = py_float(a.routed_scaling_factor);
    f["enable_pdl"] = a.enable_pdl;
    f["path"] = a.tuning.path;
    f["generic_layout"] = a.tuning.generic_layout;
    d["moe_router"] = f;
  }
  {
    const fm::MoeFc1Args a;
    nb::dict f;
    f["layout"] = enum_name(a.layout, fc1_weight_layouts());
    f["activation"] = enum_name(a.activation, fc1_activations());
    f["fp8"] = enum_name(a.fp8, fp8_scalings());
    f["weights"] = enum_name(a.weights, weight_formats());
    f["limit"] = py_float(a.limit);
    f["alpha"] = py_float(a.alpha);
    f["x_permuted"] = a.x_permuted;
    f["enable_pdl"] = a.enable_pdl;
    d["moe_fc1"] = f;
  }
  {
    const fm::MoeForwardArgs a;  // the router's options: its MoeRouterArgs `router`
    nb::dict f;
    f["start_expert_id"] = a.start_expert_id;
    f["scoring"] = enum_name(a.router.scoring, router_scorings());
    f["renormalize"] = a.router.renormalize;
    f["n_group"] = a.router.n_group;
    f["topk_group"] = a.router.topk_group;
    f["routed_scaling_factor"] = py_float(a.router.routed_scaling_factor);
    f["w1_layout"] = enum_name(a.w1_layout, fc1_weight_layouts());
    f["activation"] = enum_name(a.activation, fc1_activations());
    f["limit"] = py_float(a.activation_limit);
    f["alpha"] = py_float(a.activation_alpha);
    f["fc1_input"] = enum_name(a.fc1_input, fc1_inputs());
    f["apply_b2"] = a.apply_b2;
    f["mode"] = enum_name(a.fc2_mode, fc2_modes());
    f["fp8"] = enum_name(a.fp8, fp8_scalings());
    f["weights"] = enum_name(a.weights, weight_formats());
    f["fill"] = a.fill;
    f["enable_pdl"] = a.enable_pdl;
    d["moe_forward"] = f;
  }
  return d;
}

}  // namespace

void register_moe(nb::module_& m) {
  m.def("moe_defaults", &moe_defaults,
        "The library's defaults of the MoE ops' keywords, {op: {keyword: value}} (the Args initialisers of "
        "flashmix/moe.h); the flashmix package's signatures read them.");

  m.def("build_moe_routing_maps_workspace_size", &build_moe_routing_maps_workspace_size, "num_tokens"_a, "k"_a,
        "num_experts_per_node"_a, "start_expert_id"_a, "single_block_max_slots"_a,
        "Bytes of device workspace build_moe_routing_maps needs (0: none).");
  m.def("build_moe_routing_maps", &build_moe_routing_maps, "token_selected_experts"_a,
        "expert_first_token_offset"_a, "permuted_row_to_unpermuted_row"_a, "unpermuted_row_to_permuted_row"_a,
        nb::kw_only(), "num_experts_per_node"_a, "start_expert_id"_a, "input"_a.none(), "permuted_input"_a.none(),
        "permuted_input_scales"_a.none(), "scale_format"_a, "workspace"_a.none(), "enable_pdl"_a,
        "single_block_max_slots"_a, "stream"_a,
        "spec §1 into the three map arrays (and permuted_input; with permuted_input_scales quantised, §1.4).");

  m.def("finalize_moe_routing", &finalize_moe_routing, "expanded_permuted_rows"_a,
        "unpermuted_row_to_permuted_row"_a, "token_selected_experts"_a, "out"_a, nb::kw_only(),
        "num_experts_per_node"_a, "start_expert_id"_a, "scales"_a.none(), "bias"_a.none(), "shared_output"_a.none(),
        "fill"_a, "permuted_row_to_unpermuted_row"_a.none(), "expert_first_token_offset"_a.none(), "enable_pdl"_a,
        "prefetch_indices"_a, "threads_per_block"_a, "vectors_per_thread"_a, "chunks_per_token"_a, "schedule"_a,
        "stream"_a,
        "spec §2 into `out` [T, H] (H = out.shape[1]); T and k from token_selected_experts [T, k].");
  m.def("debug_check_finalize_moe_routing_indices", &debug_check_finalize_moe_routing_indices,
        "expanded_permuted_rows"_a, "unpermuted_row_to_permuted_row"_a, "token_selected_experts"_a, "out"_a,
        nb::kw_only(), "num_experts_per_node"_a, "start_expert_id"_a, "scales"_a.none(), "bias"_a.none(),
        "shared_output"_a.none(), "fill"_a, "permuted_row_to_unpermuted_row"_a.none(),
        "expert_first_token_offset"_a.none(), "stream"_a,
        "Checks the device-side indices of a finalize call. SYNCHRONISES the stream.");

  // FC2 grouped GEMM + finalize
  m.attr("FC2_MODES") = enum_names_tuple(fc2_modes());
  m.attr("FC2_GEMM_KERNELS") = enum_names_tuple(fc2_gemm_kernels());
  m.def("moe_fc2_finalize_workspace_size", &moe_fc2_finalize_workspace_size, "num_tokens"_a, "k"_a, "hidden"_a,
        "inter"_a, "num_experts_per_node"_a, "mode"_a, "device"_a,
        "Bytes of device workspace moe_fc2_finalize needs on CUDA device `device` (-1: the current one).");
  m.def("moe_fc2_finalize", &moe_fc2_finalize, "A"_a, "W2"_a, "expert_first_token_offset"_a,
        "permuted_row_to_unpermuted_row"_a, "out"_a, nb::kw_only(), "k"_a, "scales"_a.none(), "bias"_a.none(),
        "apply_bias"_a, "shared_output"_a.none(), "fill"_a, "mode"_a, "out_already_zeroed"_a, "fp8"_a,
        "a_scales"_a.none(), "w2_scales"_a.none(), "weights"_a, "w2_mx_scales"_a.none(), "workspace"_a.none(),
        "gemm_kernel"_a, "raster"_a, "swizzle"_a, "stream"_a,
        "spec §3 into `out` [T, H]; E, H, I from W2 [E, H, I]; fp8 (spec §3.5): A and W2 as e4m3 bytes (uint8) "
        "with fp32 scales; weights = \"mxfp4\" (spec §13.7): W2 packed e2m1 bytes [E, H, I/2] with ue8m0 "
        "w2_mx_scales [E, H, I/32] (uint8), fp8 \"block\" (W4A8) or \"none\" (W4A16).");

  // Router
  m.attr("ROUTER_SCORINGS") = enum_names_tuple(router_scorings());
  m.def("moe_router", &moe_router, "logits"_a, "token_selected_experts"_a, "token_final_scales"_a, nb::kw_only(),
        "scoring"_a, "renormalize"_a, "correction_bias"_a.none(), "n_group"_a, "topk_group"_a,
        "routed_scaling_factor"_a, "token_ids"_a.none(), "hash_table"_a.none(), "enable_pdl"_a, "path"_a,
        "generic_layout"_a, "stream"_a,
        "spec §8 into token_selected_experts [T, k] and token_final_scales [T, k]; T, E from logits [T, E], k "
        "from token_selected_experts; token_ids [T] (int32 / int64) with hash_table [vocab_size, k] (int32): "
        "hash selection (spec §8.7).");

  // FC1 + gather + gated activation
  m.attr("FC1_ACTIVATIONS") = enum_names_tuple(fc1_activations());
  m.attr("FC1_WEIGHT_LAYOUTS") = enum_names_tuple(fc1_weight_layouts());
  m.def("moe_fc1", &moe_fc1, "X"_a, "W1"_a, "expert_first_token_offset"_a, "permuted_row_to_unpermuted_row"_a,
        "out"_a, nb::kw_only(), "k"_a, "num_tokens"_a, "bias"_a.none(), "layout"_a, "activation"_a, "limit"_a,
        "alpha"_a, "x_permuted"_a, "fp8"_a, "x_scales"_a.none(), "w1_scales"_a.none(), "weights"_a,
        "w1_mx_scales"_a.none(), "out_scales"_a.none(), "out_scale_format"_a, "enable_pdl"_a, "stream"_a,
        "spec §9 into `out` [>= k*T, I]; E, I, H from W1 [E, 2I, H]; T = num_tokens, or (num_tokens < 0) X's "
        "rows, over k with x_permuted; fp8 (spec §9.7): X and W1 as e4m3 bytes (uint8) with fp32 scales; "
        "weights = \"mxfp4\" (spec §13.7): W1 packed e2m1 bytes [E, 2I, H/2] with ue8m0 w1_mx_scales "
        "[E, 2I, H/32] (uint8), fp8 \"block\" (W4A8) or \"none\" (W4A16).");
  m.attr("MOE_WEIGHT_FORMATS") = enum_names_tuple(weight_formats());
  m.attr("FP8_SCALINGS") = enum_names_tuple(fp8_scalings());

  // The layer
  m.attr("FC1_INPUTS") = enum_names_tuple(fc1_inputs());
  m.def("moe_forward_workspace_size", &moe_forward_workspace_size, "num_tokens"_a, "k"_a, "hidden"_a, "inter"_a,
        "num_experts"_a, "num_experts_per_node"_a, "start_expert_id"_a, "with_router"_a, "mode"_a, "fc1_input"_a,
        "fp8"_a, "weights"_a, "Bytes of device workspace moe_forward needs (with_router: routing by router_logits; num_experts <= 0: "
        "any that holds this rank's experts; fc1_input: the permuted copy of X is held only where it resolves to "
        "permuted_copy).");
  m.def("moe_forward", &moe_forward, "X"_a, "W1"_a, "W2"_a, "out"_a, nb::kw_only(), "k"_a, "num_experts"_a,
        "start_expert_id"_a, "router_logits"_a.none(), "scoring"_a, "renormalize"_a, "correction_bias"_a.none(),
        "n_group"_a, "topk_group"_a, "routed_scaling_factor"_a, "token_ids"_a.none(), "hash_table"_a.none(),
        "token_selected_experts"_a.none(),
        "token_final_scales"_a.none(), "selected_experts_out"_a.none(), "final_scales_out"_a.none(), "b1"_a.none(),
        "b2"_a.none(), "apply_b2"_a, "w1_layout"_a, "activation"_a, "limit"_a, "alpha"_a, "fc1_input"_a, "mode"_a,
        "fp8"_a, "w1_scales"_a.none(), "w2_scales"_a.none(), "weights"_a, "w1_mx_scales"_a.none(),
        "w2_mx_scales"_a.none(), "shared_output"_a.none(), "fill"_a, "workspace"_a.none(), "enable_pdl"_a, "stream"_a,
        "spec §10 into `out` [T, H]: router (router_logits) or the caller's ids, routing maps, FC1, FC2 + finalize; "
        "E_local, H, I from W2 [E_local, H, I] (weights = \"mxfp4\", spec §13.7: W2 packed [E_local, H, I/2], W1 "
        "packed [E_local, 2I, H/2], ue8m0 w1_mx_scales / w2_mx_scales), T from X [T, H]; num_experts <= 0: "
        "router_logits.shape[1].");
}

}  // namespace flashmix::python
