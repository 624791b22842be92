// flashmix._C, MoE: routing maps (spec §1), finalize (spec §2), the FC2
// grouped GEMM with the finalize fused (spec §3). include/flashmix/moe.h.
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
  if (shared_output) {
    require_dtype(*shared_output, to_dlpack(a.out_dtype), op, "shared_output");  // read as out_dtype
    a.shared_stride = row_stride(*shared_output, op, "shared_output");
    if (dim(*shared_output, 0) != T || dim(*shared_output, 1) < H)
      fail(op, "shared_output", "must have shape [T = ", T, ", >= ", H, "] (got ", shape_str(*shared_output), ")");
  }
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
                          int chunks_per_token, uintptr_t stream) {
  FinalizeCall c = make_finalize(rows, u2p, experts, out, num_experts_per_node, start_expert_id, scales, bias,
                                 shared_output, fill, p2u, offsets);
  fm::FinalizeMoeRoutingArgs& a = c.args;
  a.enable_pdl = enable_pdl;
  a.prefetch_indices = prefetch_indices;
  a.tuning.threads_per_block = threads_per_block;
  a.tuning.vectors_per_thread = vectors_per_thread;
  a.tuning.chunks_per_token = chunks_per_token;
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
                            const OptOut& permuted_input, const OptOut& workspace, bool enable_pdl,
                            int single_block_max_slots, uintptr_t stream) {
  constexpr const char* op = "build_moe_routing_maps";
  Placement w(op);
  w.add(experts, "token_selected_experts", offsets, "expert_first_token_offset",
        p2u, "permuted_row_to_unpermuted_row", u2p, "unpermuted_row_to_permuted_row", input, "input",
        permuted_input, "permuted_input", workspace, "workspace");

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
  if (input) {
    a.input_dtype = float_dtype(*input, op, "input");
    a.input_stride = row_stride(*input, op, "input");
    if (dim(*input, 0) != T) fail(op, "input", "must have T = ", T, " rows (got shape ", shape_str(*input), ")");
    a.hidden = dim(*input, 1);
    require_dtype(*permuted_input, input->dtype(), op, "permuted_input");
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

// Fc2GemmKernel by the library's own names (to_string: "auto", "rows", ...).
const EnumNames<fm::Fc2GemmKernel>& fc2_gemm_kernels() {
  static const EnumNames<fm::Fc2GemmKernel> names = [] {
    EnumNames<fm::Fc2GemmKernel> n;
    for (fm::Fc2GemmKernel k : {fm::Fc2GemmKernel::kAuto, fm::Fc2GemmKernel::kRows,
                                fm::Fc2GemmKernel::kCutlassCooperative, fm::Fc2GemmKernel::kCutlassPingpong})
      n.push_back({fm::to_string(k), k});
    return n;
  }();
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

void moe_fc2_finalize(const In& A, const In& W2, const In& offsets, const In& p2u, const Out& out, int k,
                      const OptIn& scales, const OptIn& bias, bool apply_bias, const std::string& mode,
                      bool out_already_zeroed, const OptOut& workspace, const std::string& gemm_kernel, int raster, int swizzle,
                      uintptr_t stream) {
  constexpr const char* op = "moe_fc2_finalize";
  Placement w(op);
  w.add(out, "out", A, "A", W2, "W2", offsets, "expert_first_token_offset", p2u, "permuted_row_to_unpermuted_row",
        scales, "scales", bias, "bias", workspace, "workspace");

  require_dense_rank(W2, kBFloat16, 3, op, "W2");
  const int64_t E = dim(W2, 0), H = dim(W2, 1), I = dim(W2, 2);
  require_dense_rank(A, kBFloat16, 2, op, "A");
  if (dim(A, 1) != I) fail(op, "A", "must have I = ", I, " columns, as W2 [E, H, I] (got shape ", shape_str(A), ")");
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

  a.A = ptr(A);
  a.W2 = ptr(W2);
  a.expert_first_token_offset = static_cast<const int64_t*>(ptr(offsets));
  a.permuted_row_to_unpermuted_row = static_cast<const int32_t*>(ptr(p2u));
  a.scales = static_cast<const float*>(ptr(scales));
  a.bias = ptr(bias);
  a.apply_bias = apply_bias;
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
    f["mode"] = enum_name(a.mode, fc2_modes());
    f["out_already_zeroed"] = a.out_already_zeroed;
    f["gemm_kernel"] = enum_name(a.tuning.gemm_kernel, fc2_gemm_kernels());
    f["raster"] = a.tuning.raster;
    f["swizzle"] = a.tuning.swizzle;
    d["moe_fc2_finalize"] = f;
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
        "workspace"_a.none(), "enable_pdl"_a, "single_block_max_slots"_a, "stream"_a,
        "spec §1 into the three map arrays (and permuted_input).");

  m.def("finalize_moe_routing", &finalize_moe_routing, "expanded_permuted_rows"_a,
        "unpermuted_row_to_permuted_row"_a, "token_selected_experts"_a, "out"_a, nb::kw_only(),
        "num_experts_per_node"_a, "start_expert_id"_a, "scales"_a.none(), "bias"_a.none(), "shared_output"_a.none(),
        "fill"_a, "permuted_row_to_unpermuted_row"_a.none(), "expert_first_token_offset"_a.none(), "enable_pdl"_a,
        "prefetch_indices"_a, "threads_per_block"_a, "vectors_per_thread"_a, "chunks_per_token"_a, "stream"_a,
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
        "apply_bias"_a, "mode"_a, "out_already_zeroed"_a, "workspace"_a.none(), "gemm_kernel"_a, "raster"_a,
        "swizzle"_a, "stream"_a, "spec §3 into `out` [T, H]; E, H, I from W2 [E, H, I].");
}

}  // namespace flashmix::python
