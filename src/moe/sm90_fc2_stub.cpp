// Built instead of sm90_fc2_grouped_gemm.cu when CUTLASS is not found: the
// CUTLASS kernels (Fc2GemmKernel::kCutlassCooperative, kCutlassPingpong)
// report kNotSupported; our own kernel (kRows) is built either way and the
// automatic choice takes it for every mode.
#include "common/check.h"
#include "moe/moe_fc2_internal.h"

namespace flashmix {

bool sm90_fc2_built_with_cutlass() { return false; }
size_t sm90_fc2_cutlass_workspace_bytes(int, int) { return 0; }
Status sm90_fc2_run_cutlass(const Sm90Fc2GemmParams&, cudaStream_t) {
  return Status(StatusCode::kNotSupported, "moe_fc2_finalize: tuning.gemm_kernel: built without CUTLASS");
}

}  // namespace flashmix
