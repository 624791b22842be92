// flashmix._C, FP8: quantize_fp8 (spec §12; the formats: spec §11).
// include/flashmix/fp8.h.
//
// e4m3 and ue8m0 arrays cross as uint8 (DLPack has no FP8 types that every
// producer speaks): python/flashmix/fp8.py views torch.float8_e4m3fn /
// float8_e8m0fnu tensors as uint8 before the call. As in moe.cpp, every
// argument is explicit; the defaults reach Python through fp8_defaults().
#include <cstdint>
#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include "common.h"
#include "flashmix/fp8.h"

namespace flashmix::python {

using namespace nb::literals;

namespace {

constexpr const char* kQuantize = "quantize_fp8";

// The enums by the library's own names (to_string), in this order.
const EnumNames<fm::ScaleFormat>& scale_formats() {
  static const EnumNames<fm::ScaleFormat> names = {{fm::to_string(fm::ScaleFormat::kFloat32), fm::ScaleFormat::kFloat32},
                                                   {fm::to_string(fm::ScaleFormat::kUE8M0), fm::ScaleFormat::kUE8M0}};
  return names;
}

const EnumNames<fm::Fp8Block>& fp8_blocks() {
  static const EnumNames<fm::Fp8Block> names = {{fm::to_string(fm::Fp8Block::k1x128), fm::Fp8Block::k1x128},
                                                {fm::to_string(fm::Fp8Block::k128x128), fm::Fp8Block::k128x128}};
  return names;
}

// A stack of matrices: [rows, cols] (one) or [batch, rows, cols], columns
// contiguous. Strides in elements, as DLPack gives them; the library checks
// them against the sizes (naming x_stride, q_batch_stride, ...).
struct Matrices {
  int64_t batch = 1, rows = 0, cols = 0, stride = 0, batch_stride = 0;
};

template <typename A>
Matrices matrices(const A& a, const char* arg) {
  if (a.ndim() != 2 && a.ndim() != 3)
    fail(kQuantize, arg, "must be [rows, cols] or [batch, rows, cols] (got shape ", shape_str(a), ")");
  const size_t r = a.ndim() - 2, c = a.ndim() - 1;
  Matrices m;
  m.batch = a.ndim() == 3 ? dim(a, 0) : 1;
  m.rows = dim(a, r);
  m.cols = dim(a, c);
  if (a.size() == 0) return m;  // nothing is accessed
  if (m.cols > 1 && a.stride(c) != 1)
    fail(kQuantize, arg, "columns must be contiguous (stride 1; got ", a.stride(c), ")");
  m.stride = m.rows > 1 ? a.stride(r) : m.cols;  // one row: its stride is never used
  m.batch_stride = a.ndim() == 3 && m.batch > 1 ? a.stride(0) : 0;  // 0: rows * stride
  return m;
}

void quantize_fp8(const In& x, const Out& q, const Out& scales, const std::string& block,
                  const std::string& scale_format, bool enable_pdl, uintptr_t stream) {
  constexpr const char* op = kQuantize;
  Placement w(op);
  w.add(x, "x", q, "out", scales, "scales");
  fm::QuantizeFp8Args a;
  a.block = parse_enum(block, fp8_blocks(), op, "block");
  a.scale_format = parse_enum(scale_format, scale_formats(), op, "scale_format");
  require_dtype(x, kBFloat16, op, "x");
  require_dtype(q, kUInt8, op, "out");  // float8_e4m3fn bytes
  require_dtype(scales, a.scale_format == fm::ScaleFormat::kUE8M0 ? kUInt8 : kFloat32, op, "scales");
  const Matrices mx = matrices(x, "x");
  if (mx.cols % 128 != 0 || mx.cols == 0)
    fail(op, "x", "the last dimension (cols) must be a positive multiple of 128 (got shape ", shape_str(x), ")");
  if (q.ndim() != x.ndim()) fail(op, "out", "must have x's shape ", shape_str(x), " (got ", shape_str(q), ")");
  for (size_t i = 0; i < x.ndim(); ++i)
    if (q.shape(i) != x.shape(i)) fail(op, "out", "must have x's shape ", shape_str(x), " (got ", shape_str(q), ")");
  const Matrices mq = matrices(q, "out");
  const int64_t br = fm::fp8_block_rows(a.block), row_blocks = (mx.rows + br - 1) / br;
  if (x.ndim() == 3) require_dense(scales, scales.dtype(), {mx.batch, row_blocks, mx.cols / 128}, op, "scales");
  else require_dense(scales, scales.dtype(), {row_blocks, mx.cols / 128}, op, "scales");

  a.x = ptr(x);
  a.x_stride = mx.stride;
  a.x_batch_stride = mx.batch_stride;
  a.q = mut(q);
  a.q_stride = mq.stride;
  a.q_batch_stride = mq.batch_stride;
  a.scales = mut(scales);
  a.batch = mx.batch;
  a.rows = mx.rows;
  a.cols = mx.cols;
  a.enable_pdl = enable_pdl;
  dispatch(
      w, op, [&] { return fm::quantize_fp8(a, as_stream(stream)); }, [&] { return fm::quantize_fp8_cpu(a); });
}

nb::dict fp8_defaults() {
  nb::dict d;
  const fm::QuantizeFp8Args a;
  nb::dict f;
  f["block"] = enum_name(a.block, fp8_blocks());
  f["scale_format"] = enum_name(a.scale_format, scale_formats());
  f["enable_pdl"] = a.enable_pdl;
  d["quantize_fp8"] = f;
  return d;
}

}  // namespace

void register_fp8(nb::module_& m) {
  m.def("fp8_defaults", &fp8_defaults,
        "The library's defaults of the FP8 ops' keywords, {op: {keyword: value}} (the Args initialisers of "
        "flashmix/fp8.h); the flashmix package's signatures read them.");
  m.attr("FP8_SCALE_FORMATS") = enum_names_tuple(scale_formats());
  m.attr("FP8_BLOCKS") = enum_names_tuple(fp8_blocks());
  m.def("quantize_fp8", &quantize_fp8, "x"_a, "out"_a, "scales"_a, nb::kw_only(), "block"_a, "scale_format"_a,
        "enable_pdl"_a, "stream"_a,
        "spec §12: bf16 x [rows, cols] or [batch, rows, cols] into e4m3 `out` (uint8, x's shape) and `scales` "
        "[(batch,) ceil(rows / block rows), cols / 128] (float32, or uint8 for ue8m0).");
}

}  // namespace flashmix::python
