// Host side of TMA: the driver's cuTensorMapEncodeTiled, reached through the
// runtime's entry-point query so the library needs no libcuda link.
// Encoding is host-only work (no device access): capture-safe, done per
// launch where the tensor's address can change between launches.
#pragma once

#include <cuda.h>  // CUtensorMap and its enums only
#include <cuda_runtime.h>

#include "common/driver.h"

namespace flashmix::detail {

using TensorMapEncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                          const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                          CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// nullptr when the driver does not offer it.
inline TensorMapEncodeTiled tensor_map_encoder() {
  static const TensorMapEncodeTiled fn =
      reinterpret_cast<TensorMapEncodeTiled>(driver_entry_point("cuTensorMapEncodeTiled"));
  return fn;
}

}  // namespace flashmix::detail
