// Host-side argument checks: every public entry point validates with these
// before launching anything. A failed check returns a Status whose message
// reads "<op>: <argument>: <rule broken>".
#pragma once

#include <cstdint>
#include <limits>
#include <sstream>
#include <string>

#include <cuda_runtime_api.h>

#include "flashmix/dtype.h"
#include "flashmix/status.h"

namespace flashmix::detail {

template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}

// Returns early from the enclosing function with kInvalidArgument when `cond` is false.
#define FM_REQUIRE(cond, op, arg, ...)                                                   \
  do {                                                                                   \
    if (!(cond))                                                                         \
      return ::flashmix::Status(::flashmix::StatusCode::kInvalidArgument,                \
                                ::flashmix::detail::concat(op, ": ", arg, ": ", __VA_ARGS__)); \
  } while (0)

#define FM_REQUIRE_SUPPORTED(cond, op, arg, ...)                                         \
  do {                                                                                   \
    if (!(cond))                                                                         \
      return ::flashmix::Status(::flashmix::StatusCode::kNotSupported,                   \
                                ::flashmix::detail::concat(op, ": ", arg, ": ", __VA_ARGS__)); \
  } while (0)

// Propagates a non-ok Status.
#define FM_RETURN_IF_ERROR(expr)              \
  do {                                        \
    ::flashmix::Status fm_status_ = (expr);   \
    if (!fm_status_.ok()) return fm_status_;  \
  } while (0)

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

// True when the byte ranges [a, a + a_bytes) and [b, b + b_bytes) share a
// byte (null pointers and empty ranges share none).
inline bool ranges_overlap(const void* a, int64_t a_bytes, const void* b, int64_t b_bytes) {
  if (a == nullptr || b == nullptr || a_bytes <= 0 || b_bytes <= 0) return false;
  const uintptr_t x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return x < y + uintptr_t(b_bytes) && y < x + uintptr_t(a_bytes);
}

// Bytes spanned by `rows` rows of `cols` elements of `elem_bytes`, `stride`
// elements apart: from the first row's start to the last row's end (0 for no
// rows). What an overlap check covers for a strided matrix.
inline int64_t rows_extent_bytes(int64_t rows, int64_t stride, int64_t cols, int64_t elem_bytes) {
  return rows > 0 ? ((rows - 1) * stride + cols) * elem_bytes : 0;
}

// An argument's name, address and size in bytes, for the overlap checks.
struct Range {
  const char* name;
  const void* ptr;
  int64_t bytes;
};

// Every output must share no byte with any input or with another output: a
// kernel may write one item's outputs while other blocks still read their
// inputs, so overlapping buffers would give schedule-dependent results.
template <size_t kOuts, size_t kIns>
Status check_no_overlap(const char* op, const Range (&outs)[kOuts], const Range (&ins)[kIns]) {
  for (size_t o = 0; o < kOuts; ++o) {
    for (size_t i = 0; i < kIns; ++i)
      FM_REQUIRE(!ranges_overlap(outs[o].ptr, outs[o].bytes, ins[i].ptr, ins[i].bytes), op, outs[o].name,
                 "must not overlap ", ins[i].name);
    for (size_t q = 0; q < o; ++q)
      FM_REQUIRE(!ranges_overlap(outs[o].ptr, outs[o].bytes, outs[q].ptr, outs[q].bytes), op, outs[o].name,
                 "must not overlap ", outs[q].name);
  }
  return Status::Ok();
}

inline Status cuda_status(cudaError_t err, const char* op, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  return Status(StatusCode::kCudaError,
                concat(op, ": ", what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

// A stream is usable when the runtime recognises it. cudaStreamGetCaptureInfo
// is one of the few stream queries that is legal while the stream (or another
// one, in global capture mode) is being captured, and it does not synchronise;
// cudaStreamGetFlags / cudaStreamQuery would invalidate a capture.
inline Status check_stream(cudaStream_t stream, const char* op) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaError_t err = cudaStreamGetCaptureInfo(stream, &capture);
  if (err == cudaSuccess && capture == cudaStreamCaptureStatusInvalidated)
    return Status(StatusCode::kInvalidArgument,
                  concat(op, ": stream: its graph capture was already invalidated by an earlier error"));
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // do not leave a sticky error behind for the caller
    return Status(StatusCode::kInvalidArgument,
                  concat(op, ": stream: not a usable CUDA stream (", cudaGetErrorName(err), ")"));
  }
  return Status::Ok();
}

// After a launch: report a launch error instead of leaving it for the caller to find.
inline Status check_launch(const char* op) {
  return cuda_status(cudaGetLastError(), op, "kernel launch");
}

// Runs the body of a GPU entry point so that the call leaves no CUDA error
// set: an error already pending when the call starts is the caller's; it is
// reported (kCudaError) and left where it is, and nothing is launched. An
// error the body causes (a failed launch, say) becomes the call's Status and
// is cleared. The runtime's last error is per host thread, so other threads'
// calls do not interfere.
template <typename Body>
Status without_cuda_error_left(const char* op, Body&& body) {
  const cudaError_t pending = cudaPeekAtLastError();
  if (pending != cudaSuccess)
    return Status(StatusCode::kCudaError,
                  concat(op, ": a CUDA error was pending before this call (", cudaGetErrorName(pending), ": ",
                         cudaGetErrorString(pending), "); nothing was launched"));
  Status s = body();
  const cudaError_t left = cudaGetLastError();
  if (left != cudaSuccess && s.ok()) return cuda_status(left, op, "CUDA error");
  return s;
}

// The frame of a GPU entry point: `validated` is the op's host validation;
// then, leaving no CUDA error set, the stream is checked and `body` runs
// unless `no_work` (zero tokens: valid, nothing to launch).
template <typename Body>
Status gpu_entry(const char* op, const Status& validated, cudaStream_t stream, bool no_work, Body&& body) {
  FM_RETURN_IF_ERROR(validated);
  return without_cuda_error_left(op, [&]() -> Status {
    FM_RETURN_IF_ERROR(check_stream(stream, op));
    if (no_work) return Status::Ok();
    return body();
  });
}

}  // namespace flashmix::detail
