// flashmix: element types accepted at the API boundary.
//
// Dispatch on DType happens once, in each op's launcher, into templates;
// kernels never branch on a run-time dtype.
#pragma once

#include <cstddef>

namespace flashmix {

enum class DType {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
};

// Size in bytes of one element; 0 for a value outside the enum.
inline constexpr std::size_t dtype_size(DType t) {
  return t == DType::kFloat32 ? 4 : (t == DType::kFloat16 || t == DType::kBFloat16) ? 2 : 0;
}

inline constexpr bool dtype_is_valid(DType t) { return dtype_size(t) != 0; }

const char* to_string(DType t);

}  // namespace flashmix
