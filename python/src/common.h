// flashmix._C: what every area of the binding shares (moe.cpp, mhc.cpp, fp8.cpp).
//
// Arrays arrive as DLPack tensors (nb::ndarray), so torch tensors and numpy
// arrays both work and nothing here depends on torch. The arrays decide the
// backend: all on the CPU -> the *_cpu reference functions; all on one CUDA
// device -> the GPU entry points, on the stream passed in as an integer
// (a cudaStream_t), with that device made current for the call. Only array
// metadata (shape, strides, dtype, device) is read on the host, never device
// memory, so every call stays legal inside a CUDA graph capture.
//
// The library validates its Args (sizes, strides, alignment, ...); the
// binding adds what only it can see: that each array is as large as the
// sizes it implies, has the dtype and layout the Args field expects, and
// lives where the other arrays live. Errors name the argument, as the
// library's do: "<op>: <argument>: <rule broken>" -> ValueError; a non-OK
// Status -> ValueError (kInvalidArgument), NotImplementedError
// (kNotSupported, a subclass of RuntimeError) or RuntimeError.
//
// Defaults: the binding's functions take every argument explicitly (no
// nb::arg defaults). The library's defaults (the Args structs' initialisers)
// reach Python through each area's `<area>_defaults()` (moe.cpp, mhc.cpp),
// which the package's function signatures read: a default is stated once,
// in include/flashmix/*.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include "flashmix/dtype.h"
#include "flashmix/status.h"

namespace flashmix {
struct MoeForwardArgs;
}

namespace flashmix::python {

namespace nb = nanobind;
namespace fm = flashmix;

using In = nb::ndarray<nb::ro>;  // read by the op (read-only arrays accepted)
using Out = nb::ndarray<>;       // written by the op (must be writable)
using OptIn = std::optional<In>;
using OptOut = std::optional<Out>;

// The areas' registration functions (module.cpp calls them).
void register_common(nb::module_& m);
void register_moe(nb::module_& m);
void register_mhc(nb::module_& m);
void register_fp8(nb::module_& m);
void register_ep(nb::module_& m);  // ep.cpp: built with flashmix_ep (NCCL); else ep_available() is False

// The experts' part of a moe_forward call (moe.cpp): weights, biases, FC1's
// layout and activation, FC2's mode, FP8 weights and scales, MXFP4 weights
// (`weights` "dense" or "mxfp4") and their ue8m0 scales, with E_local, H and I
// taken from W2 [E_local, H, I] (packed MXFP4: [E_local, H, I / 2]); also what
// ep.cpp's layers use.
void set_layer_experts(fm::MoeForwardArgs& a, const In& W1, const In& W2, const OptIn& b1, const OptIn& b2,
                       bool apply_b2, const std::string& w1_layout, const std::string& activation, float limit,
                       float alpha, const std::string& mode, const std::string& fp8, const OptIn& w1_scales,
                       const OptIn& w2_scales, const std::string& weights, const OptIn& w1_mx_scales,
                       const OptIn& w2_mx_scales, const char* op);

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}

[[noreturn]] void throw_value_error(const std::string& message);

// "<op>: <arg>: <rule>" as a ValueError, like the library's argument errors.
template <typename... Parts>
[[noreturn]] void fail(const char* op, const char* arg, const Parts&... rule) {
  throw_value_error(concat(op, ": ", arg, ": ", rule...));
}

// OK: nothing; kInvalidArgument: ValueError; kNotSupported:
// NotImplementedError; anything else: RuntimeError.
void raise_if_error(const fm::Status& s);

// ---------------------------------------------------------------------------
// Enumerations as strings
// ---------------------------------------------------------------------------

// The Python spelling of each value of an enum, in the order the error
// message lists them.
template <typename E>
using EnumNames = std::vector<std::pair<std::string, E>>;

// The value named `s`; anything else is a ValueError listing the names.
template <typename E>
E parse_enum(const std::string& s, const EnumNames<E>& names, const char* op, const char* arg) {
  for (const auto& [name, value] : names)
    if (s == name) return value;
  std::string want;
  for (size_t i = 0; i < names.size(); ++i)
    want += concat(i == 0 ? "" : i + 1 == names.size() ? " or " : ", ", '"', names[i].first, '"');
  fail(op, arg, "must be ", want, " (got \"", s, "\")");
}

template <typename E>
const std::string& enum_name(E value, const EnumNames<E>& names) {
  for (const auto& entry : names)
    if (entry.second == value) return entry.first;
  throw std::logic_error("flashmix._C: an enum value without a Python name");
}

template <typename E>
nb::tuple enum_names_tuple(const EnumNames<E>& names) {
  nb::list l;
  for (const auto& entry : names) l.append(entry.first);
  return nb::tuple(l);
}

// ---------------------------------------------------------------------------
// Defaults as Python values
// ---------------------------------------------------------------------------

// A float default (e.g. 1e-6f) as the shortest decimal that rounds back to
// it (1e-06, not 9.99999997e-07): what a signature shows, and passing it back
// gives the same float.
nb::float_ py_float(float v);

// ---------------------------------------------------------------------------
// DLPack dtypes
// ---------------------------------------------------------------------------

using nb::dlpack::dtype_code;

inline bool dtype_is(nb::dlpack::dtype d, dtype_code code, int bits) {
  return d.code == uint8_t(code) && d.bits == bits && d.lanes == 1;
}

std::string dtype_name(nb::dlpack::dtype d);

constexpr nb::dlpack::dtype kInt32{uint8_t(dtype_code::Int), 32, 1};
constexpr nb::dlpack::dtype kInt64{uint8_t(dtype_code::Int), 64, 1};
constexpr nb::dlpack::dtype kUInt8{uint8_t(dtype_code::UInt), 8, 1};
constexpr nb::dlpack::dtype kUInt16{uint8_t(dtype_code::UInt), 16, 1};
constexpr nb::dlpack::dtype kFloat16{uint8_t(dtype_code::Float), 16, 1};
constexpr nb::dlpack::dtype kFloat32{uint8_t(dtype_code::Float), 32, 1};
constexpr nb::dlpack::dtype kBFloat16{uint8_t(dtype_code::Bfloat), 16, 1};

nb::dlpack::dtype to_dlpack(fm::DType t);

// float32 / float16 / bfloat16 -> flashmix::DType; anything else is an error naming `arg`.
template <typename A>
fm::DType float_dtype(const A& a, const char* op, const char* arg) {
  const nb::dlpack::dtype d = a.dtype();
  if (d == kFloat32) return fm::DType::kFloat32;
  if (d == kFloat16) return fm::DType::kFloat16;
  if (d == kBFloat16) return fm::DType::kBFloat16;
  fail(op, arg, "must be float32, float16 or bfloat16 (got ", dtype_name(d), ")");
}

template <typename A>
void require_dtype(const A& a, nb::dlpack::dtype want, const char* op, const char* arg) {
  if (!(a.dtype() == want)) fail(op, arg, "must be ", dtype_name(want), " (got ", dtype_name(a.dtype()), ")");
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
    if (dim(a, i) != 1 && a.stride(i) != expected) {
      std::string strides = "[";
      for (size_t j = 0; j < a.ndim(); ++j) strides += concat(j ? ", " : "", a.stride(j));
      fail(op, arg, "must be contiguous (row-major, dense; got shape ", shape_str(a), " with strides ", strides,
           "] in elements)");
    }
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
  if (cols > 1 && a.stride(1) != 1) fail(op, arg, "columns must be contiguous (stride 1; got ", a.stride(1), ")");
  if (rows == 1) return cols;  // the row stride is never used
  if (a.stride(0) < cols) fail(op, arg, "row stride must be >= the row length (got ", a.stride(0), " < ", cols, ")");
  return a.stride(0);
}

// An optional shared output [T, >= H] of dtype `dt` (rows may be strided):
// its row stride, or 0 when there is none.
template <typename A>
int64_t shared_output_stride(const std::optional<A>& shared, nb::dlpack::dtype dt, int64_t T, int64_t H,
                             const char* op) {
  if (!shared) return 0;
  require_dtype(*shared, dt, op, "shared_output");
  const int64_t stride = row_stride(*shared, op, "shared_output");
  if (dim(*shared, 0) != T || dim(*shared, 1) < H)
    fail(op, "shared_output", "must have shape [T = ", T, ", >= H = ", H, "] (got ", shape_str(*shared), ")");
  return stride;
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
inline void* mut(const Out& a) { return a.data(); }

// [p, p + bytes) and [q, q + bytes2) share memory.
inline bool overlaps(const void* p, size_t bytes, const void* q, size_t bytes2) {
  const auto a = reinterpret_cast<uintptr_t>(p), b = reinterpret_cast<uintptr_t>(q);
  return bytes && bytes2 && a < b + bytes2 && b < a + bytes;
}

// ---------------------------------------------------------------------------
// Workspaces
// ---------------------------------------------------------------------------

// An optional caller-owned workspace: a uint8 array, or none.
struct Workspace {
  void* ptr = nullptr;
  size_t bytes = 0;
};
Workspace workspace_of(const OptOut& workspace, const char* op);

// The same into an Args struct with `workspace` / `workspace_bytes` fields (the mHC ops).
template <typename Args>
void set_workspace(Args& a, const OptOut& workspace, const char* op) {
  const Workspace ws = workspace_of(workspace, op);
  a.workspace = ws.ptr;
  a.workspace_bytes = ws.bytes;
}

// A non-null, maximally aligned address for size queries that validate
// pointers they never dereference. Each argument gets its own slot, 1 TiB
// apart, so the host checks that buffers do not overlap pass too.
template <typename T>
T* placeholder(int slot) {
  return reinterpret_cast<T*>(uintptr_t(slot + 1) << 40);
}

// ---------------------------------------------------------------------------
// Devices and streams
// ---------------------------------------------------------------------------

constexpr int kCpu = nb::device::cpu::value;
constexpr int kCuda = nb::device::cuda::value;

std::string device_str(int type, int id);

// Where an op runs: every array on the CPU, or every array on one CUDA device.
class Placement {
 public:
  explicit Placement(const char* op) : op_(op) {}

  template <typename A>
  void add(const A& a, const char* arg) {
    add_device(a.device_type(), a.device_id(), arg);
  }
  template <typename A>
  void add(const std::optional<A>& a, const char* arg) {
    if (a) add(*a, arg);
  }
  // Several at once: add(a, "a", b, "b", ...).
  template <typename A, typename B, typename... Rest>
  void add(const A& a, const char* arg, const B& b, const char* b_arg, const Rest&... rest) {
    add(a, arg);
    add(b, b_arg, rest...);
  }

  bool cuda() const { return type_ == kCuda; }
  int device() const { return id_; }

 private:
  void add_device(int type, int id, const char* arg);

  const char* op_;
  const char* first_ = nullptr;
  int type_ = kCpu;
  int id_ = 0;
};

// Makes `device` current for the call and restores the previous one.
class CudaDeviceGuard {
 public:
  CudaDeviceGuard(int device, const char* op);
  ~CudaDeviceGuard();
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

inline cudaStream_t as_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

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

}  // namespace flashmix::python
