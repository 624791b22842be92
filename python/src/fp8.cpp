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
#include "flashmix/mxfp4.h"

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

// MXFP4 (spec §13): packed e2m1 w [batch, rows, cols / 2] (uint8) with ue8m0
// scales [batch, rows, cols / 32] (uint8), dense; a 2-D array is one matrix.
struct Mxfp4Shape {
  int64_t batch = 1, rows = 0, cols = 0;
};

template <typename A>
Mxfp4Shape mxfp4_shape(const char* op, const A& w, const A& w_scales) {
  require_dtype(w, kUInt8, op, "w");
  require_dtype(w_scales, kUInt8, op, "w_scales");
  if (w.ndim() != 2 && w.ndim() != 3)
    fail(op, "w", "must be [rows, cols / 2] or [batch, rows, cols / 2] (got shape ", shape_str(w), ")");
  Mxfp4Shape m;
  m.batch = w.ndim() == 3 ? dim(w, 0) : 1;
  m.rows = dim(w, w.ndim() - 2);
  m.cols = 2 * dim(w, w.ndim() - 1);
  require_dense_rank(w, kUInt8, w.ndim(), op, "w");
  if (m.cols % 32 != 0)
    fail(op, "w", "cols = 2 * w.shape[-1] must be a multiple of 32 (one ue8m0 scale per 32; got ", m.cols, ")");
  if (w.ndim() == 3) require_dense(w_scales, kUInt8, {m.batch, m.rows, m.cols / 32}, op, "w_scales");
  else require_dense(w_scales, kUInt8, {m.rows, m.cols / 32}, op, "w_scales");
  return m;
}

void mxfp4_to_fp8_block(const In& w, const In& w_scales, const Out& q, const Out& q_scales,
                        const std::string& block, bool enable_pdl, uintptr_t stream) {
  constexpr const char* op = "mxfp4_to_fp8_block";
  Placement where(op);
  where.add(w, "w", w_scales, "w_scales", q, "out", q_scales, "scales");
  const Mxfp4Shape m = mxfp4_shape(op, w, w_scales);
  fm::Mxfp4ToFp8BlockArgs a;
  a.block = parse_enum(block, fp8_blocks(), op, "block");
  const int64_t br = fm::fp8_block_rows(a.block), row_blocks = (m.rows + br - 1) / br;
  if (w.ndim() == 3) {
    require_dense(q, kUInt8, {m.batch, m.rows, m.cols}, op, "out");
    require_dense(q_scales, kFloat32, {m.batch, row_blocks, m.cols / 128}, op, "scales");
  } else {
    require_dense(q, kUInt8, {m.rows, m.cols}, op, "out");
    require_dense(q_scales, kFloat32, {row_blocks, m.cols / 128}, op, "scales");
  }
  a.w = ptr(w);
  a.w_scales = ptr(w_scales);
  a.q = mut(q);
  a.q_scales = static_cast<float*>(mut(q_scales));
  a.batch = m.batch;
  a.rows = m.rows;
  a.cols = m.cols;
  a.enable_pdl = enable_pdl;
  dispatch(
      where, op, [&] { return fm::mxfp4_to_fp8_block(a, as_stream(stream)); },
      [&] { return fm::mxfp4_to_fp8_block_cpu(a); });
}

void mxfp4_to_bf16(const In& w, const In& w_scales, const Out& out, bool enable_pdl, uintptr_t stream) {
  constexpr const char* op = "mxfp4_to_bf16";
  Placement where(op);
  where.add(w, "w", w_scales, "w_scales", out, "out");
  const Mxfp4Shape m = mxfp4_shape(op, w, w_scales);
  if (w.ndim() == 3) require_dense(out, kBFloat16, {m.batch, m.rows, m.cols}, op, "out");
  else require_dense(out, kBFloat16, {m.rows, m.cols}, op, "out");
  fm::Mxfp4ToBf16Args a;
  a.w = ptr(w);
  a.w_scales = ptr(w_scales);
  a.out = mut(out);
  a.batch = m.batch;
  a.rows = m.rows;
  a.cols = m.cols;
  a.enable_pdl = enable_pdl;
  dispatch(
      where, op, [&] { return fm::mxfp4_to_bf16(a, as_stream(stream)); }, [&] { return fm::mxfp4_to_bf16_cpu(a); });
}

nb::dict fp8_defaults() {
  nb::dict d;
  const fm::QuantizeFp8Args a;
  nb::dict f;
  f["block"] = enum_name(a.block, fp8_blocks());
  f["scale_format"] = enum_name(a.scale_format, scale_formats());
  f["enable_pdl"] = a.enable_pdl;
  d["quantize_fp8"] = f;
  {
    const fm::Mxfp4ToFp8BlockArgs m;
    nb::dict g;
    g["block"] = enum_name(m.block, fp8_blocks());
    g["enable_pdl"] = m.enable_pdl;
    d["mxfp4_to_fp8_block"] = g;
  }
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
  m.def("mxfp4_to_fp8_block", &mxfp4_to_fp8_block, "w"_a, "w_scales"_a, "out"_a, "scales"_a, nb::kw_only(),
        "block"_a, "enable_pdl"_a, "stream"_a,
        "spec §13.3: MXFP4 w (packed e2m1, uint8 [(batch,) rows, cols / 2]) with ue8m0 w_scales (uint8 "
        "[(batch,) rows, cols / 32]) into e4m3 `out` (uint8 [(batch,) rows, cols]) and float32 `scales` "
        "[(batch,) ceil(rows / block rows), cols / 128].");
  m.def("mxfp4_to_bf16", &mxfp4_to_bf16, "w"_a, "w_scales"_a, "out"_a, nb::kw_only(), "enable_pdl"_a, "stream"_a,
        "spec §13.4: MXFP4 w with its ue8m0 scales into bf16 `out` [(batch,) rows, cols].");
}

}  // namespace flashmix::python
