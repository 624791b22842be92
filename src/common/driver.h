// The CUDA driver's functions, reached through the runtime's entry-point
// query so the library needs no libcuda link.
#pragma once

#include <cuda_runtime.h>

namespace flashmix::detail {

// The driver function `name` (CUDA 12.0 ABI), or nullptr when the driver
// does not offer it (the runtime's error is cleared).
inline void* driver_entry_point(const char* name) {
  void* f = nullptr;
  cudaDriverEntryPointQueryResult q;
  if (cudaGetDriverEntryPointByVersion(name, &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return f;
}

}  // namespace flashmix::detail
