// FC2 grouped GEMM configuration pp_64x256_c1 (see sm90_fc2_gemm_impl.cuh).
#include "moe/sm90_fc2_gemm_impl.cuh"

FLASHMIX_FC2_DEFINE_CONFIG(pp_64x256_c1, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong, cute::Shape<cute::_64, cute::_256, cute::_64>, cute::Shape<cute::_1, cute::_1, cute::_1>)
