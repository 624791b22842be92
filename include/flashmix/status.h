// flashmix: error reporting shared by every public entry point.
//
// Every entry point validates its arguments on the host (never reading device
// memory) before launching anything, and returns a Status. A failed check
// names the argument and the rule it broke; nothing was launched and no output
// was written. The library never aborts the process.
#pragma once

#include <string>
#include <utility>

namespace flashmix {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  // a null pointer, a bad size, a stride too small, ...
  kNotSupported,     // a valid request this build cannot serve (dtype, n, k)
  kCudaError,        // the CUDA runtime reported an error (launch, stream)
  kCommError,        // the communication library (NCCL, flashmix_ep) reported an error
};

class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  // "argument: rule broken" for argument errors; empty when ok().
  const std::string& message() const { return message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

const char* to_string(StatusCode code);

}  // namespace flashmix
