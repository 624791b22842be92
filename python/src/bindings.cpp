// flashmix._C: the Python binding of the C++ API (nanobind).
//
// Arrays arrive as DLPack tensors (nb::ndarray), so torch tensors and numpy
// arrays both work and nothing here depends on torch. The arrays decide the
// backend: all on the CPU -> the *_cpu reference functions; all on one CUDA
// device -> the GPU entry points, on the stream passed in as an integer
// (a cudaStream_t), with that device made current for the call. Only array
// metadata (shape, strides, dtype, device) is read on the host, never device
// memory, so every call stays legal inside a CUDA graph capture.
//
// The library validates its Args (sizes, strides, alignment, ...); this file
// adds what only it can see: that each array is as large as the sizes it
// implies, has the dtype and layout the Args field expects, and lives where
// the other arrays live. Errors name the argument, as the library's do:
// "<op>: <argument>: <rule broken>" -> ValueError; a non-OK Status ->
// ValueError (kInvalidArgument), NotImplementedError (kNotSupported, a
// subclass of RuntimeError) or RuntimeError.
#include <cstdint>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include "flashmix/mhc.h"
#include "flashmix/moe.h"

namespace nb = nanobind;
namespace fm = flashmix;
using namespace nb::literals;

namespace {

using In = nb::ndarray<nb::ro>;  // read by the op (read-only arrays accepted)
using Out = nb::ndarray<>;       // written by the op (must be writable)
using OptIn = std::optional<In>;
using OptOut = std::optional<Out>;

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}

// "<op>: <arg>: <rule>" as a ValueError, like the library's argument errors.
template <typename... Parts>
[[noreturn]] void fail(const char* op, const char* arg, const Parts&... rule) {
  throw nb::value_error(concat(op, ": ", arg, ": ", rule...).c_str());
}

void raise_if_error(const fm::Status& s) {
  switch (s.code()) {
    case fm::StatusCode::kOk:
      return;
    case fm::StatusCode::kInvalidArgument:
      throw nb::value_error(s.message().c_str());
    case fm::StatusCode::kNotSupported:
      PyErr_SetString(PyExc_NotImplementedError, s.message().c_str());
      throw nb::python_error();
    default:
      throw std::runtime_error(s.message());
  }
}

// ---------------------------------------------------------------------------
// DLPack dtypes
// ---------------------------------------------------------------------------

using nb::dlpack::dtype_code;

bool dtype_is(nb::dlpack::dtype d, dtype_code code, int bits) {
  return d.code == uint8_t(code) && d.bits == bits && d.lanes == 1;
}

std::string dtype_name(nb::dlpack::dtype d) {
  const char* kind = "dtype_code_";
  switch (dtype_code(d.code)) {
    case dtype_code::Int: kind = "int"; break;
    case dtype_code::UInt: kind = "uint"; break;
    case dtype_code::Float: kind = "float"; break;
    case dtype_code::Bfloat: kind = "bfloat"; break;
    case dtype_code::Complex: kind = "complex"; break;
    case dtype_code::Bool: kind = "bool"; break;
    default: return concat("dlpack(code=", int(d.code), ", bits=", int(d.bits), ", lanes=", d.lanes, ")");
  }
  return d.code == uint8_t(dtype_code::Bool) ? std::string(kind)
                                              : concat(kind, int(d.bits), d.lanes == 1 ? "" : "xN");
}

// float32 / float16 / bfloat16 -> flashmix::DType; anything else is an error naming `arg`.
template <typename A>
fm::DType float_dtype(const A& a, const char* op, const char* arg) {
  const nb::dlpack::dtype d = a.dtype();
  if (dtype_is(d, dtype_code::Float, 32)) return fm::DType::kFloat32;
  if (dtype_is(d, dtype_code::Float, 16)) return fm::DType::kFloat16;
  if (dtype_is(d, dtype_code::Bfloat, 16)) return fm::DType::kBFloat16;
  fail(op, arg, "must be float32, float16 or bfloat16 (got ", dtype_name(d), ")");
}

constexpr nb::dlpack::dtype kInt32{uint8_t(dtype_code::Int), 32, 1};
constexpr nb::dlpack::dtype kInt64{uint8_t(dtype_code::Int), 64, 1};
constexpr nb::dlpack::dtype kUInt8{uint8_t(dtype_code::UInt), 8, 1};
constexpr nb::dlpack::dtype kFloat32{uint8_t(dtype_code::Float), 32, 1};
constexpr nb::dlpack::dtype kBFloat16{uint8_t(dtype_code::Bfloat), 16, 1};

template <typename A>
void require_dtype(const A& a, nb::dlpack::dtype want, const char* op, const char* arg) {
  if (!(a.dtype() == want))
    fail(op, arg, "must be ", dtype_name(want), " (got ", dtype_name(a.dtype()), ")");
}

nb::dlpack::dtype to_dlpack(fm::DType t) {
  switch (t) {
    case fm::DType::kFloat32: return kFloat32;
    case fm::DType::kFloat16: return {uint8_t(dtype_code::Float), 16, 1};
    case fm::DType::kBFloat16: return kBFloat16;
  }
  return {};
}

// ---------------------------------------------------------------------------
// Shapes and layouts (metadata only)
// ---------------------------------------------------------------------------

template <typename A>
std::string shape_str(const A& a) {
  std::string s = "[";
  for (size_t i = 0; i < a.ndim(); ++i) s += concat(i ? ", " : "", a.shape(i));
  return s + "]";
}

template <typename A>
int64_t dim(const A& a, size_t i) {
  return int64_t(a.shape(i));
}

template <typename A>
void require_ndim(const A& a, size_t ndim, const char* op, const char* arg) {
  if (a.ndim() != ndim) fail(op, arg, "must have ", ndim, " dimensions (got shape ", shape_str(a), ")");
}

// Dense row-major storage (dimensions of extent 1 may carry any stride).
template <typename A>
void require_contiguous(const A& a, const char* op, const char* arg) {
  if (a.size() <= 1) return;
  int64_t expected = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (dim(a, i) != 1 && a.stride(i) != expected)
      fail(op, arg, "must be contiguous (row-major, dense; got shape ", shape_str(a), " with strides ",
           [&] {
             std::string s = "[";
             for (size_t j = 0; j < a.ndim(); ++j) s += concat(j ? ", " : "", a.stride(j));
             return s + "]";
           }(),
           " in elements)");
    expected *= dim(a, i);
  }
}

// A matrix [rows, cols] whose rows may be padded: unit column stride, row
// stride >= cols. Returns the row stride in elements.
template <typename A>
int64_t row_stride(const A& a, const char* op, const char* arg) {
  require_ndim(a, 2, op, arg);
  const int64_t rows = dim(a, 0), cols = dim(a, 1);
  if (rows == 0 || cols == 0) return cols;  // nothing is accessed
  if (cols > 1 && a.stride(1) != 1)
    fail(op, arg, "columns must be contiguous (stride 1; got ", a.stride(1), ")");
  if (rows == 1) return cols;  // the row stride is never used
  if (a.stride(0) < cols)
    fail(op, arg, "row stride must be >= the row length (got ", a.stride(0), " < ", cols, ")");
  return a.stride(0);
}

template <typename A>
void require_shape(const A& a, std::initializer_list<int64_t> shape, const char* op, const char* arg) {
  bool ok = a.ndim() == shape.size();
  size_t i = 0;
  for (int64_t s : shape) ok = ok && dim(a, i++) == s;
  if (!ok) {
    std::string want = "[";
    i = 0;
    for (int64_t s : shape) want += concat(i++ ? ", " : "", s);
    fail(op, arg, "must have shape ", want, "] (got ", shape_str(a), ")");
  }
}

// Contiguous with exactly this shape and dtype.
template <typename A>
void require_dense(const A& a, nb::dlpack::dtype dt, std::initializer_list<int64_t> shape, const char* op,
                   const char* arg) {
  require_dtype(a, dt, op, arg);
  require_shape(a, shape, op, arg);
  require_contiguous(a, op, arg);
}

// Contiguous, with this dtype and number of dimensions (extents free).
template <typename A>
void require_dense_rank(const A& a, nb::dlpack::dtype dt, size_t ndim, const char* op, const char* arg) {
  require_dtype(a, dt, op, arg);
  require_ndim(a, ndim, op, arg);
  require_contiguous(a, op, arg);
}

// A contiguous vector of at least `min_size` elements (any number of dimensions).
template <typename A>
void require_vector(const A& a, nb::dlpack::dtype dt, int64_t min_size, const char* op, const char* arg) {
  require_dtype(a, dt, op, arg);
  require_contiguous(a, op, arg);
  if (int64_t(a.size()) < min_size)
    fail(op, arg, "must hold at least ", min_size, " elements (got ", a.size(), ", shape ", shape_str(a), ")");
}

template <typename A>
const void* ptr(const A& a) {
  return static_cast<const void*>(a.data());
}
template <typename A>
const void* ptr(const std::optional<A>& a) {
  return a ? static_cast<const void*>(a->data()) : nullptr;
}
void* mut(const Out& a) { return a.data(); }

// An optional caller-owned workspace: a uint8 array, or none.
struct Workspace {
  void* ptr = nullptr;
  size_t bytes = 0;
};
Workspace workspace_of(const OptOut& workspace, const char* op) {
  if (!workspace) return {};
  require_vector(*workspace, kUInt8, 0, op, "workspace");
  return {mut(*workspace), workspace->size()};
}
// The same into an Args struct with `workspace` / `workspace_bytes` fields (the mHC ops).
template <typename Args>
void set_workspace(Args& a, const OptOut& workspace, const char* op) {
  const Workspace ws = workspace_of(workspace, op);
  a.workspace = ws.ptr;
  a.workspace_bytes = ws.bytes;
}

// ---------------------------------------------------------------------------
// Devices and streams
// ---------------------------------------------------------------------------

constexpr int kCpu = nb::device::cpu::value;
constexpr int kCuda = nb::device::cuda::value;

std::string device_str(int type, int id) {
  if (type == kCpu) return "cpu";
  if (type == kCuda) return concat("cuda:", id);
  return concat("DLPack device type ", type, ":", id);
}

// Where an op runs: every array on the CPU, or every array on one CUDA device.
class Placement {
 public:
  explicit Placement(const char* op) : op_(op) {}

  template <typename A>
  void add(const A& a, const char* arg) {
    const int type = a.device_type(), id = type == kCuda ? a.device_id() : 0;
    if (type != kCpu && type != kCuda)
      fail(op_, arg, "must be a CPU or CUDA array (got ", device_str(type, a.device_id()), ")");
    if (!first_) {
      type_ = type;
      id_ = id;
      first_ = arg;
    } else if (type != type_ || id != id_) {
      fail(op_, arg, "is on ", device_str(type, id), " but ", first_, " is on ", device_str(type_, id_),
           " (all arrays of one call must be on the same device)");
    }
  }
  template <typename A>
  void add(const std::optional<A>& a, const char* arg) {
    if (a) add(*a, arg);
  }

  bool cuda() const { return type_ == kCuda; }
  int device() const { return id_; }

 private:
  const char* op_;
  const char* first_ = nullptr;
  int type_ = kCpu;
  int id_ = 0;
};

// Makes `device` current for the call and restores the previous one.
class CudaDeviceGuard {
 public:
  CudaDeviceGuard(int device, const char* op) {
    cudaError_t err = cudaGetDevice(&previous_);
    if (err == cudaSuccess && previous_ != device) {
      err = cudaSetDevice(device);
      switched_ = err == cudaSuccess;
    }
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // leave no sticky error behind
      throw std::runtime_error(concat(op, ": device: cannot make cuda:", device, " current (",
                                      cudaGetErrorName(err), ": ", cudaGetErrorString(err), ")"));
    }
  }
  ~CudaDeviceGuard() {
    if (switched_) (void)cudaSetDevice(previous_);
  }
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

cudaStream_t as_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

// Runs the GPU entry point (device made current) or the CPU reference, with
// the GIL released, and raises on a non-OK Status.
template <typename Gpu, typename Cpu>
void dispatch(const Placement& where, const char* op, Gpu&& gpu, Cpu&& cpu) {
  fm::Status s;
  if (where.cuda()) {
    CudaDeviceGuard guard(where.device(), op);
    nb::gil_scoped_release release;
    s = gpu();
  } else {
    nb::gil_scoped_release release;
    s = cpu();
  }
  raise_if_error(s);
}

// A non-null, maximally aligned address for size queries that validate
// pointers they never dereference. Each argument gets its own slot, 1 TiB
// apart, so the host checks that buffers do not overlap pass too.
template <typename T>
T* placeholder(int slot) {
  return reinterpret_cast<T*>(uintptr_t(slot + 1) << 40);
}

// ---------------------------------------------------------------------------
// Enumerations as strings
// ---------------------------------------------------------------------------

fm::MhcResLayout parse_res_layout(const std::string& s, const char* op, const char* arg) {
  if (s == "deepseek") return fm::MhcResLayout::kDeepSeek;
  if (s == "row_mix") return fm::MhcResLayout::kRowMix;
  fail(op, arg, "must be \"deepseek\" or \"row_mix\" (got \"", s, "\")");
}

fm::Fc2Mode parse_fc2_mode(const std::string& s) {
  if (s == "atomic") return fm::Fc2Mode::kAtomic;
  if (s == "atomic_fp32") return fm::Fc2Mode::kAtomicFp32;
  if (s == "deterministic") return fm::Fc2Mode::kDeterministic;
  if (s == "unfused") return fm::Fc2Mode::kUnfused;
  fail("moe_fc2_finalize", "mode", "must be \"atomic\", \"atomic_fp32\", \"deterministic\" or \"unfused\" (got \"",
       s, "\")");
}

fm::Fc2GemmKernel parse_fc2_gemm_kernel(const std::string& s) {
  for (fm::Fc2GemmKernel k : {fm::Fc2GemmKernel::kAuto, fm::Fc2GemmKernel::kRows,
                              fm::Fc2GemmKernel::kCutlassCooperative, fm::Fc2GemmKernel::kCutlassPingpong})
    if (s == fm::to_string(k)) return k;
  fail("moe_fc2_finalize", "gemm_kernel",
       "must be \"auto\", \"rows\", \"cutlass_cooperative\" or \"cutlass_pingpong\" (got \"", s, "\")");
}

// ---------------------------------------------------------------------------
// MoE finalize (SPEC §2)
// ---------------------------------------------------------------------------

struct FinalizeCall {
  fm::FinalizeMoeRoutingArgs args;
  Placement where{"finalize_moe_routing"};
};

FinalizeCall make_finalize(const In& rows, const In& u2p, const In& experts, const Out& out, int num_experts_per_node,
                           int start_expert_id, const OptIn& scales, const OptIn& bias, const OptIn& shared_output,
                           bool fill, const OptIn& p2u, const OptIn& offsets, bool enable_pdl, int threads_per_block,
                           int vectors_per_thread, int chunks_per_token) {
  constexpr const char* op = "finalize_moe_routing";
  FinalizeCall c;
  Placement& w = c.where;
  w.add(out, "out");
  w.add(rows, "expanded_permuted_rows");
  w.add(u2p, "unpermuted_row_to_permuted_row");
  w.add(experts, "token_selected_experts");
  w.add(scales, "scales");
  w.add(bias, "bias");
  w.add(shared_output, "shared_output");
  w.add(p2u, "permuted_row_to_unpermuted_row");
  w.add(offsets, "expert_first_token_offset");

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
  a.enable_pdl = enable_pdl;
  a.tuning.threads_per_block = threads_per_block;
  a.tuning.vectors_per_thread = vectors_per_thread;
  a.tuning.chunks_per_token = chunks_per_token;
  return c;
}

void finalize_moe_routing(const In& rows, const In& u2p, const In& experts, const Out& out,
                          int num_experts_per_node, int start_expert_id, const OptIn& scales, const OptIn& bias,
                          const OptIn& shared_output, bool fill, const OptIn& p2u, const OptIn& offsets,
                          bool enable_pdl, bool prefetch_indices, int threads_per_block, int vectors_per_thread,
                          int chunks_per_token, uintptr_t stream) {
  FinalizeCall c = make_finalize(rows, u2p, experts, out, num_experts_per_node, start_expert_id, scales, bias,
                                 shared_output, fill, p2u, offsets, enable_pdl, threads_per_block, vectors_per_thread,
                                 chunks_per_token);
  c.args.prefetch_indices = prefetch_indices;
  dispatch(
      c.where, "finalize_moe_routing", [&] { return fm::finalize_moe_routing(c.args, as_stream(stream)); },
      [&] { return fm::finalize_moe_routing_cpu(c.args); });
}

void debug_check_finalize_moe_routing_indices(const In& rows, const In& u2p, const In& experts, const Out& out,
                                              int num_experts_per_node, int start_expert_id, const OptIn& scales,
                                              const OptIn& bias, const OptIn& shared_output, bool fill,
                                              const OptIn& p2u, const OptIn& offsets, uintptr_t stream) {
  const FinalizeCall c = make_finalize(rows, u2p, experts, out, num_experts_per_node, start_expert_id, scales, bias,
                                       shared_output, fill, p2u, offsets, true, 0, 0, 0);
  if (!c.where.cuda())
    fail("debug_check_finalize_moe_routing_indices", "out",
         "the debug check copies device arrays to the host: pass CUDA arrays");
  dispatch(
      c.where, "debug_check_finalize_moe_routing_indices",
      [&] { return fm::debug_check_finalize_moe_routing_indices(c.args, as_stream(stream)); },
      [] { return fm::Status::Ok(); });
}

// ---------------------------------------------------------------------------
// MoE routing maps (SPEC §1)
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
  w.add(experts, "token_selected_experts");
  w.add(offsets, "expert_first_token_offset");
  w.add(p2u, "permuted_row_to_unpermuted_row");
  w.add(u2p, "unpermuted_row_to_permuted_row");
  w.add(input, "input");
  w.add(permuted_input, "permuted_input");
  w.add(workspace, "workspace");

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
// MoE FC2 grouped GEMM + finalize (SPEC §3)
// ---------------------------------------------------------------------------

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
  a.mode = parse_fc2_mode(mode);
  raise_if_error(fm::validate_moe_fc2_finalize(a));
  if (device < 0) return fm::moe_fc2_finalize_workspace_size(a);  // the current device
  CudaDeviceGuard guard(device, "moe_fc2_finalize_workspace_size");
  return fm::moe_fc2_finalize_workspace_size(a);
}

void moe_fc2_finalize(const In& A, const In& W2, const In& offsets, const In& p2u, const Out& out, int k,
                      const OptIn& scales, const OptIn& bias, bool apply_bias, const std::string& mode,
                      bool out_already_zeroed, const OptOut& workspace, const std::string& gemm_kernel, int raster,
                      int swizzle, uintptr_t stream) {
  constexpr const char* op = "moe_fc2_finalize";
  Placement w(op);
  w.add(out, "out");
  w.add(A, "A");
  w.add(W2, "W2");
  w.add(offsets, "expert_first_token_offset");
  w.add(p2u, "permuted_row_to_unpermuted_row");
  w.add(scales, "scales");
  w.add(bias, "bias");
  w.add(workspace, "workspace");

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
  a.mode = parse_fc2_mode(mode);
  a.out_already_zeroed = out_already_zeroed;
  a.tuning.gemm_kernel = parse_fc2_gemm_kernel(gemm_kernel);
  a.tuning.raster = raster;
  a.tuning.swizzle = swizzle;
  const Workspace ws = workspace_of(workspace, op);
  dispatch(
      w, op, [&] { return fm::moe_fc2_finalize(a, ws.ptr, ws.bytes, as_stream(stream)); },
      [&] { return fm::moe_fc2_finalize_cpu(a); });
}

// ---------------------------------------------------------------------------
// mHC (SPEC §4)
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
template <typename A>
fm::MhcShape residual_shape(const A& x, int n, const char* op, const char* arg) {
  require_dtype(x, kBFloat16, op, arg);
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

fm::MhcParams make_params(float eps_norm, float eps_pre, float post_mult, float eps_sinkhorn, int sinkhorn_iters,
                          const std::string& res_layout, const char* op) {
  fm::MhcParams p;
  p.eps_norm = eps_norm;
  p.eps_pre = eps_pre;
  p.post_mult = post_mult;
  p.eps_sinkhorn = eps_sinkhorn;
  p.sinkhorn_iters = sinkhorn_iters;
  p.res_layout = parse_res_layout(res_layout, op, "res_layout");
  return p;
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

// The projection's inputs, shared by mhc_pre and mhc_project (whose Args
// name them alike): n from phi's N rows, the shape from x, the weights
// checked against both; sets shape, phi_dtype and the four pointers and
// returns N.
template <typename Args>
int64_t set_projection_inputs(Args& a, const In& x, const In& phi, const In& alpha, const In& bias, const char* op) {
  require_ndim(phi, 2, op, "phi");
  const int64_t N = dim(phi, 0);
  const int n = streams_from_coefficients(N, op, "phi");
  a.shape = residual_shape(x, n, op, "x");
  a.phi_dtype = check_weights(phi, alpha, bias, N, n * a.shape.hidden, 3, op);
  a.x = ptr(x);
  a.phi = ptr(phi);
  a.alpha = static_cast<const float*>(ptr(alpha));
  a.bias = static_cast<const float*>(ptr(bias));
  return N;
}

void mhc_pre(const In& x, const In& phi, const In& alpha, const In& bias, const Out& f_pre, const Out& h_post,
             const Out& h_res, float eps_norm, float eps_pre, float post_mult, float eps_sinkhorn, int sinkhorn_iters,
             const std::string& res_layout, bool enable_pdl, bool prefetch_weights, const OptOut& workspace,
             uintptr_t stream) {
  constexpr const char* op = "mhc_pre";
  Placement w(op);
  for (auto [a, name] : {std::pair<const In*, const char*>{&x, "x"}, {&phi, "phi"}, {&alpha, "alpha"}, {&bias, "bias"}})
    w.add(*a, name);
  w.add(f_pre, "f_pre");
  w.add(h_post, "h_post");
  w.add(h_res, "h_res");
  w.add(workspace, "workspace");

  fm::MhcPreArgs a;
  set_projection_inputs(a, x, phi, alpha, bias, op);
  const int64_t B = a.shape.batch, C = a.shape.hidden, n = a.shape.n;
  require_dense(f_pre, kBFloat16, {B, C}, op, "f_pre");
  require_dense(h_post, kFloat32, {B, n}, op, "h_post");
  require_dense(h_res, kFloat32, {B, n, n}, op, "h_res");
  a.f_pre = mut(f_pre);
  a.h_post = static_cast<float*>(mut(h_post));
  a.h_res = static_cast<float*>(mut(h_res));
  a.params = make_params(eps_norm, eps_pre, post_mult, eps_sinkhorn, sinkhorn_iters, res_layout, op);
  a.enable_pdl = enable_pdl;
  a.prefetch_weights = prefetch_weights;
  set_workspace(a, workspace, op);
  dispatch(
      w, op, [&] { return fm::mhc_pre(a, as_stream(stream)); }, [&] { return fm::mhc_pre_cpu(a); });
}

// [lo, lo + bytes) and [lo2, lo2 + bytes2) share memory.
bool overlaps(const void* p, size_t bytes, const void* q, size_t bytes2) {
  const auto a = reinterpret_cast<uintptr_t>(p), b = reinterpret_cast<uintptr_t>(q);
  return bytes && bytes2 && a < b + bytes2 && b < a + bytes;
}

void mhc_post(const In& x, const In& f_out, const In& h_post, const In& h_res, const Out& x_next,
              const std::string& res_layout, bool enable_pdl, uintptr_t stream) {
  constexpr const char* op = "mhc_post";
  Placement w(op);
  w.add(x, "x");
  w.add(f_out, "f_out");
  w.add(h_post, "h_post");
  w.add(h_res, "h_res");
  w.add(x_next, "x_next");

  const int64_t n = streams_from_columns(h_post, op, "h_post");
  fm::MhcPostArgs a;
  a.shape = residual_shape(x, int(n), op, "x");
  const int64_t B = a.shape.batch, C = a.shape.hidden;
  require_dense(f_out, kBFloat16, {B, C}, op, "f_out");
  require_dense(h_post, kFloat32, {B, n}, op, "h_post");
  require_dense(h_res, kFloat32, {B, n, n}, op, "h_res");
  require_dtype(x_next, kBFloat16, op, "x_next");
  require_contiguous(x_next, op, "x_next");
  if (x_next.size() != x.size()) fail(op, "x_next", "must have x's shape ", shape_str(x), " (got ", shape_str(x_next), ")");
  if (overlaps(ptr(x), x.nbytes(), mut(x_next), x_next.nbytes())) fail(op, "x_next", "must not overlap x");
  a.x = ptr(x);
  a.f_out = ptr(f_out);
  a.h_post = static_cast<const float*>(ptr(h_post));
  a.h_res = static_cast<const float*>(ptr(h_res));
  a.x_next = mut(x_next);
  a.res_layout = parse_res_layout(res_layout, op, "res_layout");
  a.enable_pdl = enable_pdl;
  dispatch(
      w, op, [&] { return fm::mhc_post(a, as_stream(stream)); }, [&] { return fm::mhc_post_cpu(a); });
}

void mhc_project(const In& x, const In& phi, const In& alpha, const In& bias, const Out& h, const Out& r,
                 float eps_norm, bool enable_pdl, bool prefetch_weights, const OptOut& workspace, uintptr_t stream) {
  constexpr const char* op = "mhc_project";
  Placement w(op);
  for (auto [a, name] : {std::pair<const In*, const char*>{&x, "x"}, {&phi, "phi"}, {&alpha, "alpha"}, {&bias, "bias"}})
    w.add(*a, name);
  w.add(h, "h");
  w.add(r, "r");
  w.add(workspace, "workspace");
  fm::MhcProjectArgs a;
  const int64_t N = set_projection_inputs(a, x, phi, alpha, bias, op);
  const int64_t B = a.shape.batch;
  require_dense(h, kFloat32, {B, N}, op, "h");
  require_dense(r, kFloat32, {B}, op, "r");
  a.h = static_cast<float*>(mut(h));
  a.r = static_cast<float*>(mut(r));
  a.eps_norm = eps_norm;
  a.enable_pdl = enable_pdl;
  a.prefetch_weights = prefetch_weights;
  set_workspace(a, workspace, op);
  dispatch(
      w, op, [&] { return fm::mhc_project(a, as_stream(stream)); }, [&] { return fm::mhc_project_cpu(a); });
}

void mhc_activate(const In& h, const Out& h_pre, const Out& h_post, const Out& h_res, float eps_pre, float post_mult,
                  float eps_sinkhorn, int sinkhorn_iters, bool enable_pdl, uintptr_t stream) {
  constexpr const char* op = "mhc_activate";
  Placement w(op);
  w.add(h, "h");
  w.add(h_pre, "h_pre");
  w.add(h_post, "h_post");
  w.add(h_res, "h_res");
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
  a.params = make_params(0.0f, eps_pre, post_mult, eps_sinkhorn, sinkhorn_iters, "deepseek", op);
  a.enable_pdl = enable_pdl;
  dispatch(
      w, op, [&] { return fm::mhc_activate(a, as_stream(stream)); }, [&] { return fm::mhc_activate_cpu(a); });
}

void mhc_pre_mix(const In& x, const In& h_pre, const Out& f_pre, bool enable_pdl, uintptr_t stream) {
  constexpr const char* op = "mhc_pre_mix";
  Placement w(op);
  w.add(x, "x");
  w.add(h_pre, "h_pre");
  w.add(f_pre, "f_pre");
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

void mhc_head(const In& x, const In& phi, const In& alpha, const In& bias, const Out& out, float eps_norm,
              float eps_pre, bool enable_pdl, const OptOut& workspace, uintptr_t stream) {
  constexpr const char* op = "mhc_head";
  Placement w(op);
  for (auto [a, name] : {std::pair<const In*, const char*>{&x, "x"}, {&phi, "phi"}, {&alpha, "alpha"}, {&bias, "bias"}})
    w.add(*a, name);
  w.add(out, "out");
  w.add(workspace, "workspace");
  require_ndim(phi, 2, op, "phi");
  const int64_t n = dim(phi, 0);
  if (n < 1 || n > fm::kMhcMaxStreams)
    fail(op, "phi", "[n, n*C]: n must be in [1, ", fm::kMhcMaxStreams, "] (got shape ", shape_str(phi), ")");
  fm::MhcHeadArgs a;
  a.shape = residual_shape(x, int(n), op, "x");
  const int64_t B = a.shape.batch, C = a.shape.hidden;
  a.phi_dtype = check_weights(phi, alpha, bias, n, n * C, 1, op);
  require_dense(out, kBFloat16, {B, C}, op, "out");
  a.x = ptr(x);
  a.phi = ptr(phi);
  a.alpha = static_cast<const float*>(ptr(alpha));
  a.bias = static_cast<const float*>(ptr(bias));
  a.out = mut(out);
  a.eps_norm = eps_norm;
  a.eps_pre = eps_pre;
  a.enable_pdl = enable_pdl;
  set_workspace(a, workspace, op);
  dispatch(
      w, op, [&] { return fm::mhc_head(a, as_stream(stream)); }, [&] { return fm::mhc_head_cpu(a); });
}

void mhc_expand(const In& embedding, const Out& x, bool enable_pdl, uintptr_t stream) {
  constexpr const char* op = "mhc_expand";
  Placement w(op);
  w.add(embedding, "embedding");
  w.add(x, "x");
  require_ndim(x, 3, op, "x");
  const int64_t n = dim(x, 1);
  if (n < 1 || n > fm::kMhcMaxStreams)
    fail(op, "x", "[B, n, C]: n must be in [1, ", fm::kMhcMaxStreams, "] (got shape ", shape_str(x), ")");
  fm::MhcExpandArgs a;
  a.shape = residual_shape(x, int(n), op, "x");
  require_dense(embedding, kBFloat16, {a.shape.batch, a.shape.hidden}, op, "embedding");
  a.embedding = ptr(embedding);
  a.x = mut(x);
  a.enable_pdl = enable_pdl;
  dispatch(
      w, op, [&] { return fm::mhc_expand(a, as_stream(stream)); }, [&] { return fm::mhc_expand_cpu(a); });
}

// ---------------------------------------------------------------------------
// numpy has no bfloat16 that DLPack can carry: a uint16 CPU array viewed as
// bfloat16 (same memory, shape and strides; keeps the source alive).
// ---------------------------------------------------------------------------

nb::ndarray<nb::array_api> bfloat16_view(nb::object source) {
  constexpr const char* op = "bfloat16_view";
  Out bits;
  if (!nb::try_cast(source, bits)) fail(op, "bits", "must be a writable array (numpy or any DLPack producer)");
  if (bits.device_type() != kCpu) fail(op, "bits", "must be a CPU array");
  require_dtype(bits, {uint8_t(dtype_code::UInt), 16, 1}, op, "bits");
  std::vector<size_t> shape(bits.ndim());
  for (size_t i = 0; i < bits.ndim(); ++i) shape[i] = bits.shape(i);
  return nb::ndarray<nb::array_api>(bits.data(), bits.ndim(), shape.data(), source, bits.stride_ptr(), kBFloat16,
                                    kCpu, 0);
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "flashmix._C: the nanobind binding of the flashmix C++ API (use the flashmix package's functions)";
  m.attr("__version__") = FLASHMIX_VERSION;
  m.attr("MHC_MAX_STREAMS") = fm::kMhcMaxStreams;
  m.attr("FC2_MODES") = nb::make_tuple("atomic", "atomic_fp32", "deterministic", "unfused");
  m.def("mhc_num_coefficients", &fm::mhc_num_coefficients, "n"_a, "N = n*n + 2n");

  m.def("finalize_moe_routing", &finalize_moe_routing, "expanded_permuted_rows"_a,
        "unpermuted_row_to_permuted_row"_a, "token_selected_experts"_a, "out"_a, nb::kw_only(),
        "num_experts_per_node"_a, "start_expert_id"_a = 0, "scales"_a = nb::none(), "bias"_a = nb::none(),
        "shared_output"_a = nb::none(), "fill"_a = true, "permuted_row_to_unpermuted_row"_a = nb::none(),
        "expert_first_token_offset"_a = nb::none(), "enable_pdl"_a = true, "prefetch_indices"_a = false,
        "threads_per_block"_a = 0, "vectors_per_thread"_a = 0, "chunks_per_token"_a = 0, "stream"_a = 0,
        "SPEC §2 into `out` [T, H] (H = out.shape[1]); T and k from token_selected_experts [T, k].");
  m.def("debug_check_finalize_moe_routing_indices", &debug_check_finalize_moe_routing_indices,
        "expanded_permuted_rows"_a, "unpermuted_row_to_permuted_row"_a, "token_selected_experts"_a, "out"_a,
        nb::kw_only(), "num_experts_per_node"_a, "start_expert_id"_a = 0, "scales"_a = nb::none(),
        "bias"_a = nb::none(), "shared_output"_a = nb::none(), "fill"_a = true,
        "permuted_row_to_unpermuted_row"_a = nb::none(), "expert_first_token_offset"_a = nb::none(),
        "stream"_a = 0, "Checks the device-side indices of a finalize call. SYNCHRONISES the stream.");

  m.def("build_moe_routing_maps_workspace_size", &build_moe_routing_maps_workspace_size, "num_tokens"_a, "k"_a,
        "num_experts_per_node"_a, "start_expert_id"_a = 0, "single_block_max_slots"_a = 0,
        "Bytes of device workspace build_moe_routing_maps needs (0: none).");
  m.def("build_moe_routing_maps", &build_moe_routing_maps, "token_selected_experts"_a,
        "expert_first_token_offset"_a, "permuted_row_to_unpermuted_row"_a, "unpermuted_row_to_permuted_row"_a,
        nb::kw_only(), "num_experts_per_node"_a, "start_expert_id"_a = 0, "input"_a = nb::none(),
        "permuted_input"_a = nb::none(), "workspace"_a = nb::none(), "enable_pdl"_a = true,
        "single_block_max_slots"_a = 0, "stream"_a = 0, "SPEC §1 into the three map arrays (and permuted_input).");

  m.def("moe_fc2_finalize_workspace_size", &moe_fc2_finalize_workspace_size, "num_tokens"_a, "k"_a, "hidden"_a,
        "inter"_a, "num_experts_per_node"_a, "mode"_a = "atomic", "device"_a = -1,
        "Bytes of device workspace moe_fc2_finalize needs on CUDA device `device` (-1: the current one).");
  m.def("moe_fc2_finalize", &moe_fc2_finalize, "A"_a, "W2"_a, "expert_first_token_offset"_a,
        "permuted_row_to_unpermuted_row"_a, "out"_a, nb::kw_only(), "k"_a, "scales"_a = nb::none(),
        "bias"_a = nb::none(), "apply_bias"_a = true, "mode"_a = "atomic", "out_already_zeroed"_a = false,
        "workspace"_a = nb::none(), "gemm_kernel"_a = "auto", "raster"_a = 0, "swizzle"_a = 0, "stream"_a = 0,
        "SPEC §3 into `out` [T, H]; E, H, I from W2 [E, H, I].");

  const fm::MhcParams d;  // SPEC §4 defaults
  m.def("mhc_pre", &mhc_pre, "x"_a, "phi"_a, "alpha"_a, "bias"_a, "f_pre"_a, "h_post"_a, "h_res"_a, nb::kw_only(),
        "eps_norm"_a = d.eps_norm, "eps_pre"_a = d.eps_pre, "post_mult"_a = d.post_mult,
        "eps_sinkhorn"_a = d.eps_sinkhorn, "sinkhorn_iters"_a = d.sinkhorn_iters, "res_layout"_a = "deepseek",
        "enable_pdl"_a = true, "prefetch_weights"_a = false, "workspace"_a = nb::none(), "stream"_a = 0,
        "SPEC §4 mhc_pre; n from phi [N, n*C].");
  m.def("mhc_post", &mhc_post, "x"_a, "f_out"_a, "h_post"_a, "h_res"_a, "x_next"_a, nb::kw_only(),
        "res_layout"_a = "deepseek", "enable_pdl"_a = true, "stream"_a = 0, "SPEC §4 mhc_post; n from h_post [B, n].");
  m.def("mhc_project", &mhc_project, "x"_a, "phi"_a, "alpha"_a, "bias"_a, "h"_a, "r"_a, nb::kw_only(),
        "eps_norm"_a = d.eps_norm, "enable_pdl"_a = true, "prefetch_weights"_a = false, "workspace"_a = nb::none(),
        "stream"_a = 0);
  m.def("mhc_activate", &mhc_activate, "h"_a, "h_pre"_a, "h_post"_a, "h_res"_a, nb::kw_only(),
        "eps_pre"_a = d.eps_pre, "post_mult"_a = d.post_mult, "eps_sinkhorn"_a = d.eps_sinkhorn,
        "sinkhorn_iters"_a = d.sinkhorn_iters, "enable_pdl"_a = true, "stream"_a = 0);
  m.def("mhc_pre_mix", &mhc_pre_mix, "x"_a, "h_pre"_a, "f_pre"_a, nb::kw_only(), "enable_pdl"_a = true,
        "stream"_a = 0);
  m.def("mhc_head", &mhc_head, "x"_a, "phi"_a, "alpha"_a, "bias"_a, "out"_a, nb::kw_only(),
        "eps_norm"_a = d.eps_norm, "eps_pre"_a = d.eps_pre, "enable_pdl"_a = true, "workspace"_a = nb::none(),
        "stream"_a = 0);
  m.def("mhc_workspace_bytes", [](int64_t batch, int n, int64_t hidden) {
          return fm::mhc_workspace_bytes(fm::MhcShape{batch, n, hidden});
        }, "batch"_a, "n"_a, "hidden"_a,
        "Bytes of the optional small-batch workspace of mhc_pre / mhc_project / mhc_head (0: not used for this "
        "shape). Zero it once; every launch leaves it zeroed.");
  m.def("mhc_expand", &mhc_expand, "embedding"_a, "x"_a, nb::kw_only(), "enable_pdl"_a = true, "stream"_a = 0);

  m.def("bfloat16_view", &bfloat16_view, "bits"_a,
        "A bfloat16 view (DLPack) of the uint16 CPU array `bits`: same memory, shape and strides; keeps `bits` alive.");
}
