// MoE FC1 with the gather and the gated activation fused (spec §9): the
// launcher. One kernel (sm90_fc1_gemm.cu); nothing else runs: no workspace,
// no memset (rows past P are left untouched).
#include <cuda_runtime.h>

#include "common/check.h"
#include "common/kernel_fit.h"
#include "flashmix/moe.h"
#include "moe/sm90_fc1_gemm.h"

namespace flashmix {

namespace {

constexpr const char* kOp = "moe_fc1";

Status run_fc1(const MoeFc1Args& a, cudaStream_t stream) {
  detail::DeviceProps dev;
  FM_RETURN_IF_ERROR(detail::cuda_status(detail::current_device_props(&dev), kOp, "device properties"));
  FM_REQUIRE_SUPPORTED(dev.cc_major == 9, kOp, "device", "needs an sm_90 (Hopper) GPU (compute capability ",
                       dev.cc_major, ".x)");
  Sm90Fc1Params p{};
  p.X = a.X;
  p.x_stride = a.x_stride ? a.x_stride : a.hidden;
  p.x_permuted = a.x_permuted;
  p.W1 = a.W1;
  p.layout = a.layout;
  p.bias = a.bias;
  p.fp8 = a.fp8;
  p.x_scales = a.x_scales;
  p.w1_scales = a.w1_scales;
  p.weights = a.weights;
  p.w1_mx_scales = static_cast<const uint8_t*>(a.w1_mx_scales);
  p.offsets = a.expert_first_token_offset;
  p.p2u = a.permuted_row_to_unpermuted_row;
  p.T = int(a.num_tokens);
  p.k = a.k;
  p.H = int(a.hidden);
  p.I = int(a.inter);
  p.E = a.num_experts_per_node;
  p.activation = a.activation;
  p.limit = a.limit > 0.f ? a.limit : (a.activation == MoeActivation::kSwiGLUOai ? 7.f : 10.f);
  p.alpha = a.alpha > 0.f ? a.alpha : 1.702f;
  p.out = a.out;
  p.out_scales = a.out_scales;
  p.out_ue8m0 = a.out_scale_format == ScaleFormat::kUE8M0;
  p.sm_count = dev.sms;
  p.pdl = a.enable_pdl;
  return sm90_fc1_run(p, stream);
}

}  // namespace

Status moe_fc1(const MoeFc1Args& a, cudaStream_t stream) {
  // Zero tokens: valid on any device, nothing to launch.
  return detail::gpu_entry(kOp, validate_moe_fc1(a), stream, a.num_tokens == 0, [&] { return run_fc1(a, stream); });
}

}  // namespace flashmix
