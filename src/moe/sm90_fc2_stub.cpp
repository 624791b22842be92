// Built instead of sm90_fc2_grouped_gemm.cu when CUTLASS is not found:
// moe_fc2_finalize then reports kNotSupported ("built without CUTLASS").
#include "common/check.h"
#include "moe/moe_fc2_internal.h"

namespace flashmix {

bool sm90_fc2_built_with_cutlass() { return false; }
size_t sm90_fc2_cutlass_workspace_bytes(int, int) { return 0; }
int sm90_fc2_num_configs() { return 0; }
Status sm90_fc2_grouped_gemm(const Sm90Fc2GemmParams&, cudaStream_t) {
  return Status(StatusCode::kNotSupported, "moe_fc2_finalize: build: built without CUTLASS");
}

}  // namespace flashmix
