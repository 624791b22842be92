// The stand-alone probes' TMA host side: the driver's cuTensorMapEncodeTiled,
// reached through the runtime (no -lcuda needed for it).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include "probe_check.h"

using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                            const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                            CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

inline Encode probe_tensor_map_encoder() {
  Encode encode = nullptr;
  cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&encode), 12000,
                                      cudaEnableDefault, &q));
  return encode;
}
