// MXFP4 expert GEMMs for decode (spec §13.7): FC1 and FC2 when experts hold
// a few rows each, the weights converted in registers (sm90_mx_decode.cu):
// W4A8 on wgmma with the tokens staged in shared memory, W4A16 on mma.sync.
// The TMA + wgmma kernels (sm90_fc1_gemm.cu, sm90_fc2_rows_gemm.cu) take
// every other shape.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "flashmix/status.h"
#include "moe/moe_fc2_internal.h"
#include "moe/sm90_fc1_gemm.h"

namespace flashmix {

// Decode-sized expert GEMMs: every slot over the local experts averages at
// most kDecodeRowsPerExpert rows an expert (under expert parallelism most
// slots are not local, so the local experts hold fewer). The MXFP4 decode
// kernels below and the block-FP8 decode tiles (FC1 64 rows, FC2 32 rows)
// take such calls.
constexpr int64_t kDecodeRowsPerExpert = 16;
inline bool decode_sized(int64_t T, int k, int E) { return T * k <= kDecodeRowsPerExpert * E; }

// Whether the decode kernels take an MXFP4 GEMM of T tokens, top k, over
// E_local experts: decode_sized. FLASHMIX_MX_DECODE=0 / 1 overrides the rule
// (the A/B, and the tests running both kernels on one problem); read at
// each call. Never for an expert matrix of 2^31 packed bytes or more
// (`rows` x K / 2: the kernel's row offsets are 32-bit).
// FLASHMIX_MX_DECODE_WG=0 pins W4A8 to the mma.sync kernel (the A/B, and
// the tests of the kernel that takes K too large for the wgmma one).
bool mx_decode_applies(int64_t T, int k, int E, int64_t rows, int64_t K);

// Launch on `stream`; shapes as validated by moe_fc1 / moe_fc2_finalize
// (MXFP4, K a multiple of 128). No host sync, capturable.
Status sm90_fc1_run_mx_decode(const Sm90Fc1Params& p, cudaStream_t stream);
Status sm90_fc2_run_mx_decode(const Sm90Fc2GemmParams& p, cudaStream_t stream);

}  // namespace flashmix
