// flashmix._C: the shared part of the binding (common.h), and what belongs
// to no area: the version and bfloat16_view.
#include "common.h"

#include <charconv>
#include <cstdlib>
#include <stdexcept>

namespace flashmix::python {

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

void throw_value_error(const std::string& message) { throw nb::value_error(message.c_str()); }

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
// Defaults as Python values
// ---------------------------------------------------------------------------

nb::float_ py_float(float v) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof(buf) - 1, v);  // shortest round trip
  *r.ptr = '\0';
  return nb::float_(std::strtod(buf, nullptr));
}

// ---------------------------------------------------------------------------
// DLPack dtypes
// ---------------------------------------------------------------------------

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

nb::dlpack::dtype to_dlpack(fm::DType t) {
  switch (t) {
    case fm::DType::kFloat32: return kFloat32;
    case fm::DType::kFloat16: return kFloat16;
    case fm::DType::kBFloat16: return kBFloat16;
  }
  return {};
}

// ---------------------------------------------------------------------------
// Workspaces
// ---------------------------------------------------------------------------

Workspace workspace_of(const OptOut& workspace, const char* op) {
  if (!workspace) return {};
  require_vector(*workspace, kUInt8, 0, op, "workspace");
  return {mut(*workspace), workspace->size()};
}

// ---------------------------------------------------------------------------
// Devices and streams
// ---------------------------------------------------------------------------

std::string device_str(int type, int id) {
  if (type == kCpu) return "cpu";
  if (type == kCuda) return concat("cuda:", id);
  return concat("DLPack device type ", type, ":", id);
}

void Placement::add_device(int type, int raw_id, const char* arg) {
  const int id = type == kCuda ? raw_id : 0;
  if (type != kCpu && type != kCuda)
    fail(op_, arg, "must be a CPU or CUDA array (got ", device_str(type, raw_id), ")");
  if (!first_) {
    type_ = type;
    id_ = id;
    first_ = arg;
  } else if (type != type_ || id != id_) {
    fail(op_, arg, "is on ", device_str(type, id), " but ", first_, " is on ", device_str(type_, id_),
         " (all arrays of one call must be on the same device)");
  }
}

CudaDeviceGuard::CudaDeviceGuard(int device, const char* op) {
  cudaError_t err = cudaGetDevice(&previous_);
  if (err == cudaSuccess && previous_ != device) {
    err = cudaSetDevice(device);
    switched_ = err == cudaSuccess;
  }
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // leave no sticky error behind
    throw std::runtime_error(concat(op, ": device: cannot make cuda:", device, " current (", cudaGetErrorName(err),
                                    ": ", cudaGetErrorString(err), ")"));
  }
}

CudaDeviceGuard::~CudaDeviceGuard() {
  if (switched_) (void)cudaSetDevice(previous_);
}

// ---------------------------------------------------------------------------
// numpy has no bfloat16 that DLPack can carry: a uint16 CPU array viewed as
// bfloat16 (same memory, shape and strides; keeps the source alive).
// ---------------------------------------------------------------------------

namespace {

nb::ndarray<nb::array_api> bfloat16_view(nb::object source) {
  constexpr const char* op = "bfloat16_view";
  Out bits;
  if (!nb::try_cast(source, bits)) fail(op, "bits", "must be a writable array (numpy or any DLPack producer)");
  if (bits.device_type() != kCpu) fail(op, "bits", "must be a CPU array");
  require_dtype(bits, kUInt16, op, "bits");
  std::vector<size_t> shape(bits.ndim());
  for (size_t i = 0; i < bits.ndim(); ++i) shape[i] = bits.shape(i);
  return nb::ndarray<nb::array_api>(bits.data(), bits.ndim(), shape.data(), source, bits.stride_ptr(), kBFloat16,
                                    kCpu, 0);
}

}  // namespace

void register_common(nb::module_& m) {
  using namespace nb::literals;
  m.attr("__version__") = FLASHMIX_VERSION;
  m.def("bfloat16_view", &bfloat16_view, "bits"_a,
        "A bfloat16 view (DLPack) of the uint16 CPU array `bits`: same memory, shape and strides; keeps `bits` alive.");
}

}  // namespace flashmix::python
