// MoE FC2 grouped GEMM with fused finalize (spec §3): the launcher and mode
// dispatch. The GEMM kernel is chosen in moe_fc2_dispatch.cpp (our own,
// sm90_fc2_rows_gemm.cu, or CUTLASS's, sm90_fc2_grouped_gemm.cu), each with
// our scatter epilogue; this file holds what every mode adds around it:
//   atomic         memset(out) -> GEMM red.add bf16x2 into out
//   atomic_fp32    memset(acc32) -> GEMM red.add f32 into acc32 -> cast pass (one rounding)
//   deterministic  GEMM stores w*(acc+bias) fp32 rows -> fixed-order k-way sum (finalize_moe_routing)
//   unfused        GEMM stores bf16 rows -> finalize_moe_routing (weights, bias, scatter, sum)
// For the two finalize-based modes the slot maps finalize needs (u2p and a
// local expert per slot) are rebuilt on the device from p2u and the offsets.
#include <algorithm>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/check.h"
#include "common/kernel_fit.h"
#include "flashmix/moe.h"
#include "moe/moe_fc2_dispatch.h"
#include "moe/moe_fc2_internal.h"

namespace flashmix {

namespace {

constexpr const char* kOp = "moe_fc2_finalize";

int current_sm_count(int* major) {
  detail::DeviceProps dev;
  if (detail::current_device_props(&dev) != cudaSuccess) return 0;
  if (major) *major = dev.cc_major;
  return dev.sms;
}

// For p < P: u2p[p2u[p]] = p, experts[t*k + j] = local expert of p. Both arrays
// were set to -1 first, so non-local slots read as "not local" in finalize.
__global__ void fc2_slot_maps(const int32_t* __restrict__ p2u, const int64_t* __restrict__ offsets, int E,
                              int T, int k, int32_t* __restrict__ u2p, int32_t* __restrict__ experts) {
  const int64_t P = offsets[E];
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < P; p += int64_t(gridDim.x) * blockDim.x) {
    int lo = 0, hi = E - 1;  // the expert e with offsets[e] <= p < offsets[e+1]
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (offsets[mid] <= p) lo = mid; else hi = mid - 1;
    }
    const int s = p2u[p];
    const int t = s % T, j = s / T;
    u2p[s] = int32_t(p);
    experts[int64_t(t) * k + j] = lo;
  }
}

// Which tokens a pass over rows visits: all T (fill), or the token of each
// local row p < P (no fill: a token with several local rows is visited once
// per row, each visit writing the same values).
struct TokenRows {
  const int32_t* p2u = nullptr;  // null: every token
  const int64_t* offsets = nullptr;
  int E = 0;
  int64_t T = 0;
  __device__ int64_t count() const { return p2u ? offsets[E] : T; }
  __device__ int64_t token(int64_t i) const { return p2u ? p2u[i] % T : i; }
};

// 8 bf16 (16 bytes) at dst: one 16-byte store where dst allows, else four
// 4-byte ones (out is 4-byte aligned and out_stride even: validate_fc2).
__device__ __forceinline__ void store_bf16x8(__nv_bfloat16* dst, const uint4& v) {
  if ((reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
    *reinterpret_cast<uint4*>(dst) = v;
  } else {
    uint32_t* d = reinterpret_cast<uint32_t*>(dst);
    d[0] = v.x, d[1] = v.y, d[2] = v.z, d[3] = v.w;
  }
}

// out[t, n] = bf16(acc32[t, n] (+ shared[t, n])), 8 columns per thread (H % 8 == 0).
__global__ void fc2_cast_rows(const float* __restrict__ acc32, TokenRows rows, int64_t H, __nv_bfloat16* out,
                              int64_t out_stride, const __nv_bfloat16* __restrict__ shared, int64_t shared_stride) {
  const int64_t vecs_per_row = H / 8;
  const int64_t total = rows.count() * vecs_per_row;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = rows.token(i / vecs_per_row), c = (i % vecs_per_row) * 8;
    float4 a = *reinterpret_cast<const float4*>(acc32 + t * H + c);
    float4 b = *reinterpret_cast<const float4*>(acc32 + t * H + c + 4);
    if (shared) {
      const uint4 sv = *reinterpret_cast<const uint4*>(shared + t * shared_stride + c);
      const __nv_bfloat162* s2 = reinterpret_cast<const __nv_bfloat162*>(&sv);
      const float2 s0 = __bfloat1622float2(s2[0]), s1 = __bfloat1622float2(s2[1]), s2f = __bfloat1622float2(s2[2]),
                   s3 = __bfloat1622float2(s2[3]);
      a.x += s0.x, a.y += s0.y, a.z += s1.x, a.w += s1.y;
      b.x += s2f.x, b.y += s2f.y, b.z += s3.x, b.w += s3.y;
    }
    alignas(16) __nv_bfloat162 h[4] = {__floats2bfloat162_rn(a.x, a.y), __floats2bfloat162_rn(a.z, a.w),
                                       __floats2bfloat162_rn(b.x, b.y), __floats2bfloat162_rn(b.z, b.w)};
    store_bf16x8(out + t * out_stride + c, *reinterpret_cast<const uint4*>(h));
  }
}

// kAtomic without fill: out[t] = shared[t] (or 0) for the token of each local
// row, before the GEMM's adds (tokens without a local row stay untouched).
// 8 columns a thread (H % 8 == 0), stored by store_bf16x8.
// (It wrote one bf16 a thread with a 64-bit division by H each until
// 2026-11-29: ~0.4-0.6 ms of an EP rank's 6.5 ms layer at DeepSeek T4096
// ep2, 32768 local rows of 7168 columns; docs/ep.md.)
__global__ void fc2_seed_local_rows(TokenRows rows, int64_t H, __nv_bfloat16* out, int64_t out_stride,
                                    const __nv_bfloat16* __restrict__ shared, int64_t shared_stride) {
  const int64_t vecs_per_row = H / 8;
  const int64_t total = rows.count() * vecs_per_row;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / vecs_per_row, c = (i - r * vecs_per_row) * 8;
    const int64_t t = rows.token(r);
    // shared_output's rows are 16-byte aligned (validate_fc2), as fc2_cast_rows reads them.
    store_bf16x8(out + t * out_stride + c,
                 shared ? *reinterpret_cast<const uint4*>(shared + t * shared_stride + c) : make_uint4(0, 0, 0, 0));
  }
}

// The chosen kernel (g.kernel) with its epilogue.
Status run_gemm(const Sm90Fc2GemmParams& g, cudaStream_t stream) {
  return g.kernel == Fc2GemmKernel::kRows ? sm90_fc2_run_rows(g, stream) : sm90_fc2_run_cutlass(g, stream);
}

int grid_for(int64_t items, int threads, int sms) {
  int64_t blocks = (items + threads - 1) / threads;
  const int64_t cap = int64_t(sms > 0 ? sms : 132) * 8;
  if (blocks > cap) blocks = cap;
  return int(blocks < 1 ? 1 : blocks);
}

}  // namespace

size_t moe_fc2_finalize_workspace_size(const Fc2FinalizeArgs& args) {
  if (!validate_fc2(args, false).ok()) return 0;
  return fc2_workspace_layout(args, std::max(kFc2MaxSmCount, current_sm_count(nullptr))).total;
}

namespace {

Status run_fc2_finalize(const Fc2FinalizeArgs& a, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  int major = 0;
  const int sms = current_sm_count(&major);
  FM_REQUIRE_SUPPORTED(major == 9, kOp, "device", "needs an sm_90 (Hopper) GPU (compute capability ", major,
                       ".x)");
  Fc2GemmChoice choice;
  FM_RETURN_IF_ERROR(choose_fc2_gemm_kernel(a, &choice));  // a pinned kernel this build or shape lacks: kNotSupported
  const Fc2WorkspaceLayout l = fc2_workspace_layout(a, sms);
  FM_REQUIRE(workspace_bytes >= l.total, kOp, "workspace_bytes", "too small: ", workspace_bytes, " < ", l.total,
             " (ask moe_fc2_finalize_workspace_size)");
  FM_REQUIRE(l.total == 0 || workspace != nullptr, kOp, "workspace", "must not be null");
  FM_REQUIRE(reinterpret_cast<uintptr_t>(workspace) % 256 == 0, kOp, "workspace", "must be 256-byte aligned");

  const int64_t T = a.num_tokens, H = a.hidden;
  const int64_t out_stride = a.out_stride ? a.out_stride : H;
  char* ws = static_cast<char*>(workspace);

  Sm90Fc2GemmParams g{};
  g.A = a.A;
  g.W2 = a.W2;
  g.offsets = a.expert_first_token_offset;
  g.p2u = a.permuted_row_to_unpermuted_row;
  g.scales = a.scales;
  g.bias = a.apply_bias ? a.bias : nullptr;
  g.fp8 = a.fp8;
  g.a_scales = a.a_scales;
  g.w2_scales = a.w2_scales;
  g.weights = a.weights;
  g.w2_mx_scales = static_cast<const uint8_t*>(a.w2_mx_scales);
  g.T = int(T);
  g.k = a.k;
  g.H = int(H);
  g.I = int(a.inter);
  g.E = a.num_experts_per_node;
  g.group_ws = ws + l.group;
  g.cutlass_ws = ws + l.cutlass;
  g.cutlass_ws_bytes = l.cutlass_bytes;
  g.sm_count = sms;
  g.kernel = choice.kernel;
  g.raster_along_n = a.tuning.raster == 2;
  g.swizzle = a.tuning.swizzle;

  const size_t slots = size_t(T) * size_t(a.k);
  const int64_t shared_stride = a.shared_stride ? a.shared_stride : H;
  const auto* shared = static_cast<const __nv_bfloat16*>(a.shared_output);
  TokenRows rows;  // the tokens the op writes: all, or (no fill) those of the local rows
  rows.T = T;
  if (!a.fill) {
    rows.p2u = a.permuted_row_to_unpermuted_row;
    rows.offsets = a.expert_first_token_offset;
    rows.E = a.num_experts_per_node;
  }
  switch (a.mode) {
    case Fc2Mode::kAtomic: {
      if (!a.fill) {
        fc2_seed_local_rows<<<grid_for(T * H / 8, 256, sms), 256, 0, stream>>>(rows, H,
                                                                          static_cast<__nv_bfloat16*>(a.out),
                                                                          out_stride, shared, shared_stride);
        FM_RETURN_IF_ERROR(detail::check_launch(kOp));
      } else if (shared) {
        FM_RETURN_IF_ERROR(detail::cuda_status(
            cudaMemcpy2DAsync(a.out, size_t(out_stride) * 2, shared, size_t(shared_stride) * 2, size_t(H) * 2,
                              size_t(T), cudaMemcpyDeviceToDevice, stream),
            kOp, "copying shared_output into out"));
      } else if (!a.out_already_zeroed) {
        FM_RETURN_IF_ERROR(detail::cuda_status(
            cudaMemset2DAsync(a.out, size_t(out_stride) * 2, 0, size_t(H) * 2, size_t(T), stream), kOp,
            "zeroing out"));
      }
      g.op = Fc2EpilogueOp::kRedBf16;
      g.dst = a.out;
      g.dst_stride = out_stride;
      g.vec16 = reinterpret_cast<uintptr_t>(a.out) % 16 == 0 && out_stride % 8 == 0;
      g.add_to_out = a.out_already_zeroed || shared != nullptr;
      return run_gemm(g, stream);
    }
    case Fc2Mode::kAtomicFp32: {
      float* acc32 = reinterpret_cast<float*>(ws + l.acc32);
      FM_RETURN_IF_ERROR(detail::cuda_status(cudaMemsetAsync(acc32, 0, size_t(T) * H * 4, stream), kOp,
                                             "zeroing the fp32 accumulator"));
      g.op = Fc2EpilogueOp::kRedFp32;
      g.dst = acc32;
      g.dst_stride = H;
      g.vec16 = true;  // workspace, 256-byte aligned, H % 8 == 0
      FM_RETURN_IF_ERROR(run_gemm(g, stream));
      fc2_cast_rows<<<grid_for(T * H / 8, 256, sms), 256, 0, stream>>>(
          acc32, rows, H, static_cast<__nv_bfloat16*>(a.out), out_stride, shared, shared_stride);
      return detail::check_launch(kOp);
    }
    case Fc2Mode::kDeterministic:
    case Fc2Mode::kUnfused: {
      const bool det = a.mode == Fc2Mode::kDeterministic;
      int32_t* u2p = reinterpret_cast<int32_t*>(ws + l.u2p);
      int32_t* experts = reinterpret_cast<int32_t*>(ws + l.experts);
      FM_RETURN_IF_ERROR(detail::cuda_status(cudaMemsetAsync(u2p, 0xff, slots * 4, stream), kOp, "maps"));
      FM_RETURN_IF_ERROR(detail::cuda_status(cudaMemsetAsync(experts, 0xff, slots * 4, stream), kOp, "maps"));
      fc2_slot_maps<<<grid_for(int64_t(slots), 256, sms), 256, 0, stream>>>(
          a.permuted_row_to_unpermuted_row, a.expert_first_token_offset, a.num_experts_per_node, int(T), a.k,
          u2p, experts);
      FM_RETURN_IF_ERROR(detail::check_launch(kOp));
      g.op = det ? Fc2EpilogueOp::kRowsFp32Scaled : Fc2EpilogueOp::kRowsBf16;
      g.dst = ws + l.rows;
      g.dst_stride = H;
      g.vec16 = true;
      FM_RETURN_IF_ERROR(run_gemm(g, stream));
      FinalizeMoeRoutingArgs f;
      f.expanded_permuted_rows = ws + l.rows;
      f.rows_dtype = det ? DType::kFloat32 : DType::kBFloat16;
      f.num_rows = int64_t(slots);
      f.rows_stride = H;
      f.unpermuted_row_to_permuted_row = u2p;
      f.token_selected_experts = experts;
      f.scales = det ? nullptr : a.scales;  // deterministic rows are already w*(acc+bias)
      f.bias = (!det && a.apply_bias) ? a.bias : nullptr;
      f.bias_stride = H;
      f.out = a.out;
      f.out_dtype = DType::kBFloat16;
      f.out_stride = out_stride;
      f.num_tokens = T;
      f.hidden = H;
      f.k = a.k;
      f.start_expert_id = 0;
      f.num_experts_per_node = a.num_experts_per_node;
      f.shared_output = a.shared_output;
      f.shared_stride = shared_stride;
      f.fill = a.fill;
      f.permuted_row_to_unpermuted_row = a.permuted_row_to_unpermuted_row;
      f.expert_first_token_offset = a.expert_first_token_offset;
      f.enable_pdl = false;
      return finalize_moe_routing(f, stream);
    }
  }
  return Status(StatusCode::kInvalidArgument, detail::concat(kOp, ": mode: unknown"));
}

}  // namespace

Status moe_fc2_finalize(const Fc2FinalizeArgs& a, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  // Zero tokens: valid on any device and build, nothing to launch.
  return detail::gpu_entry(kOp, validate_moe_fc2_finalize(a), stream, a.num_tokens == 0,
                           [&] { return run_fc2_finalize(a, workspace, workspace_bytes, stream); });
}

}  // namespace flashmix
