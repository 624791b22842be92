// An environment variable set for a scope and unset after it: the tests' pins
// of the library's kernel choices (FLASHMIX_FC1_WIDE, FLASHMIX_MX_DECODE, ...),
// which it reads at each call.
#pragma once

#include <cstdlib>

namespace flashmix::testing {

struct ScopedEnv {
  ScopedEnv(const char* name, const char* value) : name_(name) { setenv(name, value, 1); }
  ~ScopedEnv() { unsetenv(name_); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
};

}  // namespace flashmix::testing
