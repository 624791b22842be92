// FC2 grouped GEMM configuration coop_128x256_c2 (see sm90_fc2_gemm_impl.cuh).
#include "moe/sm90_fc2_gemm_impl.cuh"

FLASHMIX_FC2_DEFINE_CONFIG(coop_128x256_c2, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative, cute::Shape<cute::_128, cute::_256, cute::_64>, cute::Shape<cute::_2, cute::_1, cute::_1>)
