// flashmix: Mixture-of-Experts operations (docs/spec.md §1-§3).
//
// Layouts follow TensorRT-LLM's so its users can switch:
//   token_selected_experts          int32 [T, k], global expert ids
//   unpermuted_row_to_permuted_row  int32 [k*T], index j*T + t, -1 for a non-local slot
//   permuted_row_to_unpermuted_row  int32 [P],   value j*T + t
//   expert_first_token_offset       int64 [E_local + 1], prefix sum of local rows per expert
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "flashmix/dtype.h"
#include "flashmix/fp8.h"
#include "flashmix/status.h"
// MoeFp8Scaling (FC1's FP8 modes, shared by Fc2FinalizeArgs).
#include "flashmix/moe_fc1.h"

namespace flashmix {

// Launch shape of the finalize kernels. Zeros mean "choose by shape" (the
// default); the benchmark sweeps these to justify the automatic choice.
struct FinalizeTuning {
  int threads_per_block = 0;  // a multiple of 32: 32..256 (schedule 2: 32..512)
  int vectors_per_thread = 0; // persistent warps: 16-byte column vectors a lane reduces at once, 1 or 2
  int chunks_per_token = 0;   // persistent warps: how many warps split one output row
  // 0: auto (token blocks for 16-bit rows without bias once T >= 7 tokens per SM, else 1);
  // 1: a persistent grid of warps walking (row, chunk) items; 2: token
  // blocks, a block per output token (rows on the 16-byte grid; otherwise 1).
  int schedule = 0;
};

// spec §2: out[t, c] = sum over local slots j of w[t,j] * (rows[u2p[j*T+t], c] + bias[e-start, c])
//                      (+ shared_output[t, c])
// Summed in fp32 in the fixed order j = 0..k-1 and rounded once: bitwise reproducible.
// Slots whose expert is outside [start_expert_id, start_expert_id + num_experts_per_node)
// are never read (their u2p entry and row may hold anything).
struct FinalizeMoeRoutingArgs {
  // Expert outputs in permuted order: [num_rows, rows_stride] of rows_dtype.
  const void* expanded_permuted_rows = nullptr;
  DType rows_dtype = DType::kBFloat16;
  int64_t num_rows = 0;     // rows in the buffer; every local u2p value is < num_rows
  int64_t rows_stride = 0;  // elements between rows (padded_H); 0 means `hidden`

  const int32_t* unpermuted_row_to_permuted_row = nullptr;  // [k*T]
  const int32_t* token_selected_experts = nullptr;          // [T, k]
  const float* scales = nullptr;  // [T, k] router weights; nullptr = NO_SCALE (all 1)

  // Per-expert bias [num_experts_per_node, bias_stride] of rows_dtype, added
  // before scaling; nullptr = none. bias_stride 0 means rows_stride.
  const void* bias = nullptr;
  int64_t bias_stride = 0;

  // Added once, unweighted (a shared expert or a residual): [T, shared_stride]
  // of out_dtype; nullptr = none. shared_stride 0 means `hidden`. May be
  // `out` itself with the same stride (in place); may not otherwise overlap
  // it. `out` overlaps no input.
  const void* shared_output = nullptr;
  int64_t shared_stride = 0;

  // Output [T, out_stride] of out_dtype; columns [0, hidden) are written.
  void* out = nullptr;
  DType out_dtype = DType::kBFloat16;
  int64_t out_stride = 0;  // 0 means `hidden`

  int64_t num_tokens = 0;  // T (0 is valid: nothing is launched)
  int64_t hidden = 0;      // H, any value >= 1
  int k = 0;               // experts per token, 1..16
  int start_expert_id = 0;
  int num_experts_per_node = 0;  // E_local

  // Filling (default): a token with no local slot gets 0 (+ shared_output).
  // No-filling: such tokens are left untouched and the work scales with the
  // number of local rows, not with T; it then needs the two maps below (the
  // local row count is read from expert_first_token_offset[E_local] on the
  // device, so no host sync is needed).
  bool fill = true;
  const int32_t* permuted_row_to_unpermuted_row = nullptr;  // [num_rows], no-filling only
  const int64_t* expert_first_token_offset = nullptr;       // [E_local + 1], no-filling only

  // Programmatic dependent launch: lets this kernel's launch overlap the tail
  // of the previous kernel on the stream (and the next kernel's with ours).
  // Results are identical either way.
  bool enable_pdl = true;
  // With enable_pdl: read the routing indices (unpermuted_row_to_permuted_row,
  // token_selected_experts, scales; when not filling also
  // permuted_row_to_unpermuted_row and expert_first_token_offset) before the
  // kernel ahead of this one on the stream has finished, so their round trip
  // hides behind its tail. Set it only when that kernel does not write them,
  // nor any kernel that may still run when ours starts (one ahead of it that
  // it let launch early, before its own dependency wait). In a MoE layer the
  // kernel ahead is the FC2 GEMM, which waits for its inputs before letting
  // ours launch, and the maps come from the routing kernels before it. The
  // rows, bias and shared_output are always read, and `out` written, after.
  // Results are identical either way.
  bool prefetch_indices = false;

  FinalizeTuning tuning;
};

// GPU entry point: asynchronous on `stream`, no host synchronisation, safe to
// capture in a CUDA graph. Device pointers.
Status finalize_moe_routing(const FinalizeMoeRoutingArgs& args, cudaStream_t stream);

// CPU reference backend (double accumulation, one rounding). Host pointers.
// Same validation as the GPU entry point.
Status finalize_moe_routing_cpu(const FinalizeMoeRoutingArgs& args);

// Host-side argument validation shared by both backends (no device access).
Status validate_finalize_moe_routing(const FinalizeMoeRoutingArgs& args);

// Debug entry point: copies the device-side index arrays to the host and
// checks them (expert ids, permutation indices in range, maps consistent).
// It SYNCHRONISES `stream`; not for production paths or graph capture.
Status debug_check_finalize_moe_routing_indices(const FinalizeMoeRoutingArgs& args,
                                                cudaStream_t stream);

}  // namespace flashmix

// ---------------------------------------------------------------------------
// MoE routing maps (spec §1): token_selected_experts -> the permutation that
// groups this GPU's slots by expert, plus (optionally) the gathered input rows.
// ---------------------------------------------------------------------------
namespace flashmix {

// Launch-path choice. Zero means "choose by shape" (the default); tests and
// the benchmark set it to exercise and compare both paths.
struct MoeRoutingTuning {
  // k*T at or below this runs as ONE block in ONE launch (decode); above it,
  // count per segment then stable scatter (two launches, or three with a
  // scan between them when segments x E_local > 16K).
  // 0 = automatic (2048); -1 = never one block; at most 8192.
  int single_block_max_slots = 0;
};

// A "slot" is (t, j), flattened slot-major as s = j*T + t. It is local when
// start_expert_id <= e < start_expert_id + num_experts_per_node, e = experts[t*k + j].
//
// P, the number of local slots, is only known on the device (it is
// expert_first_token_offset[E_local]). Size the outputs for the worst case,
// P = k*T: permuted_row_to_unpermuted_row and permuted_input hold k*T rows;
// only their first P rows are written, the rest is left untouched.
//
// Expert ids are device data and trusted: any int32 value is allowed, a value
// outside this rank's range (including one outside [0, E)) just means "not
// local". Out-of-range values never cause an out-of-bounds access.
struct MoeRoutingArgs {
  const int32_t* token_selected_experts = nullptr;  // [T, k], global expert ids
  int64_t num_tokens = 0;                           // T (0 is valid: offsets are zeroed, nothing else)
  int k = 0;                                        // 1..16; k*T must fit int32
  int start_expert_id = 0;                          // >= 0
  int num_experts_per_node = 0;                     // E_local, 1..1024

  // Outputs (none may overlap an input or another output):
  int64_t* expert_first_token_offset = nullptr;      // out [E_local + 1]
  int32_t* permuted_row_to_unpermuted_row = nullptr; // out [k*T] capacity, first P written: value j*T + t
  int32_t* unpermuted_row_to_permuted_row = nullptr; // out [k*T], index j*T + t; -1 for a non-local slot

  // Optional expansion: permuted_input[p, :hidden] = input[t, :hidden] for
  // permuted row p of token t. Give both pointers or neither. A plain copy, so
  // any dtype works; 16-byte vectors when pointers and row strides allow it,
  // narrower accesses otherwise (no alignment is required).
  const void* input = nullptr;       // [T, input_stride]
  void* permuted_input = nullptr;    // [k*T capacity, permuted_input_stride], first P rows written
  DType input_dtype = DType::kBFloat16;
  int64_t hidden = 0;                // H >= 1 when expanding
  int64_t input_stride = 0;          // elements between input rows; 0 means `hidden`
  int64_t permuted_input_stride = 0; // elements between permuted rows; 0 means `hidden`

  // Optional FP8 expansion (spec §1.4): with permuted_input_scales given, the
  // expansion quantises instead of copying. input is bf16 (input_dtype
  // kBFloat16); permuted_input receives e4m3 codes, one byte an element
  // (permuted_input_stride counts bytes), and permuted_input_scales one scale
  // per row per 128 columns: quantize_fp8's 1 x 128 blocks in
  // permuted_scale_format, bitwise what quantize_fp8 of the input rows
  // followed by the plain expansion writes. Needs hidden % 128 == 0, input
  // and input_stride 16-byte aligned (8 elements), permuted_input and its
  // stride 8-byte aligned, float scales 4-byte aligned. This is the FP8
  // layer's input to FC1 (moe_forward): the bf16 permuted copy is never written.
  void* permuted_input_scales = nullptr;  // [k*T capacity, hidden / 128] float or uint8, first P rows written
  ScaleFormat permuted_scale_format = ScaleFormat::kFloat32;

  // Programmatic dependent launch between our kernels and with the neighbours
  // on the stream. Results are identical either way.
  bool enable_pdl = true;

  MoeRoutingTuning tuning;
};

// Bytes of device workspace build_moe_routing_maps needs for these args (CUB
// style: ask, allocate once, pass it in; it may be reused by later calls on
// the same stream). Reads the sizes only (num_tokens, k, the expert range,
// tuning): the pointers may still be null. 0 for the single-launch path and
// for invalid sizes.
size_t build_moe_routing_maps_workspace_size(const MoeRoutingArgs& args);

// GPU entry point: asynchronous on `stream`, no host synchronisation, no
// allocation, safe to capture in a CUDA graph. Device pointers. The output
// is bitwise identical from run to run (the order is fully defined).
Status build_moe_routing_maps(const MoeRoutingArgs& args, void* workspace, size_t workspace_bytes,
                              cudaStream_t stream);

// CPU reference backend. Host pointers; same validation and same outputs.
Status build_moe_routing_maps_cpu(const MoeRoutingArgs& args);

// Host-side argument validation shared by both backends (no device access).
Status validate_moe_routing_maps(const MoeRoutingArgs& args);

}  // namespace flashmix

// ---------------------------------------------------------------------------
// MoE FC2 grouped GEMM with the finalize fused into its epilogue (spec §3).
//   out[t, :] = sum over local slots (t, j): w[t, j] * (A[p] @ W2[e]^T + bias[e])
// p the slot's permuted row, e its local expert. sm_90a only (TMA + wgmma):
// our own grouped GEMM by default (every mode but atomic_fp32, and that one
// too in builds without CUTLASS), CUTLASS's ptr-array grouped GEMM for
// atomic_fp32 when it is built in (Fc2GemmKernel below). Other GPUs get
// kNotSupported.
// ---------------------------------------------------------------------------
namespace flashmix {

enum class Fc2Mode : int {
  kAtomic = 0,         // epilogue scales rows and red.add's bf16x2 into `out` (k == 1: plain stores)
  kAtomicFp32 = 1,     // red.add into an fp32 [T, H] workspace, then one cast pass: one rounding
  kDeterministic = 2,  // epilogue stores w*(acc+bias) as fp32 rows, then a fixed-order (j = 0..k-1)
                       // fp32 sum: bitwise reproducible, one rounding
  kUnfused = 3,        // GEMM -> [P, H] bf16 rows, then finalize_moe_routing (the baseline)
};
// Which mode is fastest depends on the shape (H200, bench record
// NVIDIA_H200-20261124-015707, us): DeepSeek-like EP rank (k = 8, I = 2048)
// kAtomic 424 < kUnfused 464; Mixtral-like (k = 2, I = 14336) kAtomic 1421 <
// kUnfused 1431; Qwen3-MoE-like (k = 8, I = 768) kAtomic 240 < kUnfused 287.
// kUnfused needs a [P, H] bf16 workspace (moe_fc2_finalize_workspace_size);
// time both on the target shape when the workspace is affordable.

// The GEMM kernel under the finalize epilogue. kAuto (the default) picks one
// by mode and shape; the others pin it (tests, flashmix-bench). A pinned
// kernel that this build lacks or that cannot take the shape makes
// moe_fc2_finalize return kNotSupported naming tuning.gemm_kernel, with
// nothing launched.
enum class Fc2GemmKernel : int {
  // The automatic choice (measured, docs/fc2_grouped_gemm.md): kRows for
  // atomic, deterministic and unfused; for atomic_fp32 kCutlassPingpong when
  // 16 < T*k/E_local < 1024 rows a expert, kRows otherwise; kRows for every
  // mode in a build without CUTLASS.
  kAuto = 0,
  // Our own TMA + wgmma kernel (no CUTLASS): a tile is 128 H columns x all
  // rows of one expert (up to 272; larger experts in equal chunks), its wgmma
  // N sized per tile, so no MMA runs on padding rows. Always built; takes
  // every valid shape (E_local <= 1024, T * k < 2^31).
  kRows = 1,
  // CUTLASS sm90 ptr-array grouped GEMM, cooperative schedule, 128 x 256
  // tiles (rows x H columns), 1x1 cluster. Only in builds with CUTLASS.
  kCutlassCooperative = 2,
  // CUTLASS sm90 ptr-array grouped GEMM, pingpong schedule (one consumer
  // warpgroup's epilogue overlaps the other's mainloop), 64 x 256 tiles, 1x1
  // cluster. Only in builds with CUTLASS.
  kCutlassPingpong = 3,
};

// "auto", "rows", "cutlass_cooperative", "cutlass_pingpong" (the names the
// Python binding and flashmix-bench take); "unknown" for any other value.
const char* to_string(Fc2GemmKernel kernel);

struct Fc2Tuning {
  Fc2GemmKernel gemm_kernel = Fc2GemmKernel::kAuto;
  // Tile order and scheduler swizzle of the CUTLASS kernels (kRows orders its
  // tiles itself and ignores both):
  int raster = 0;   // 0 = automatic (M fastest), 1 = M fastest, 2 = N fastest
  int swizzle = 0;  // 0 = automatic (1), 1, 2, 4 or 8
};

struct Fc2FinalizeArgs {
  const void* A = nullptr;   // bf16 (or e4m3) [k*T capacity, I], permuted rows (first P used)
  const void* W2 = nullptr;  // bf16 (or e4m3) [E_local, H, I], each expert's H x I row-major (K-contiguous)
  // FP8 (spec §3.5; the formats: §11): with kBlock or kTensor, A and W2 hold
  // e4m3 codes and an element's value is its e4m3 value times its scale
  // (dequantised). kBlock needs I % 128 == 0, kTensor I % 16 == 0. Runs on
  // the kRows kernel only (the CUTLASS kernels take bf16).
  MoeFp8Scaling fp8 = MoeFp8Scaling::kNone;
  // kBlock: [k*T capacity rows, I / 128] (row p's scales of its 128-channel
  // blocks; the first P rows read); kTensor: [1]. Ignored with kNone.
  const float* a_scales = nullptr;
  // kBlock: [E_local, ceil(H / 128), I / 128], block (h / 128, i / 128) of
  // W2[e]; kTensor: [E_local]. Ignored with kNone.
  const float* w2_scales = nullptr;
  // kMxfp4 (MoeWeightFormat, spec §13.7): W2 is packed e2m1 [E_local, H, I /
  // 2] bytes (16-byte aligned) and w2_mx_scales its ue8m0 scales [E_local, H,
  // I / 32] (4-byte aligned); w2_scales is ignored. fp8 = kBlock (A e4m3, 1 x
  // 128 scales): W4A8; kNone (A bf16): W4A16. Needs I % 128 == 0; kRows kernel.
  MoeWeightFormat weights = MoeWeightFormat::kDense;
  const void* w2_mx_scales = nullptr;
  const int64_t* expert_first_token_offset = nullptr;       // [E_local + 1] (device)
  const int32_t* permuted_row_to_unpermuted_row = nullptr;  // [k*T capacity], first P read, value j*T + t (device)
  const float* scales = nullptr;  // [T, k] router weights; nullptr = all 1
  const void* bias = nullptr;     // bf16 [E_local, H] or nullptr; added before scaling
  bool apply_bias = true;         // false on all but one tensor-parallel rank: bias ignored

  int64_t num_tokens = 0;  // T (0 is valid: nothing is launched)
  int k = 0;               // 1..16
  int64_t hidden = 0;      // H, a multiple of 8 (TMA: 16-byte rows)
  int64_t inter = 0;       // I, a multiple of 8
  int num_experts_per_node = 0;  // E_local, 1..1024

  void* out = nullptr;     // bf16 [T, out_stride], columns [0, H) written; overlaps no input
  int64_t out_stride = 0;  // 0 means H; must be even (bf16x2 reduction adds)

  Fc2Mode mode = Fc2Mode::kAtomic;
  // kAtomic only: the caller has zeroed `out` (or holds a residual there that
  // the experts' sum is to be added to); the op then skips its own memset.
  // Not with shared_output, nor with fill = false.
  bool out_already_zeroed = false;

  // Added once, unweighted, to every token the op writes (a shared expert's
  // output or a residual): bf16 [T, shared_stride], nullptr = none. May not
  // overlap `out` (kAtomicFp32, kDeterministic, kUnfused add it in fp32 before
  // the one rounding; kAtomic copies it into `out` before the adds).
  const void* shared_output = nullptr;
  int64_t shared_stride = 0;  // 0 means H
  // true (default): a token with no local row gets 0 (+ shared_output).
  // false: such tokens are left untouched (expert parallelism: each rank
  // writes only its tokens); no host sync, P is read on the device.
  bool fill = true;

  Fc2Tuning tuning;
};

// Device workspace bytes for these args (CUB style); depends on the mode, T, k,
// H and E_local only: the pointers may still be null, and the answer holds on
// any device (it is sized for the most SMs an sm_90 GPU has). 0 for invalid
// sizes.
size_t moe_fc2_finalize_workspace_size(const Fc2FinalizeArgs& args);

// GPU entry point: asynchronous on `stream`, no host synchronisation, no
// allocation, safe to capture in a CUDA graph. `workspace` 256-byte aligned.
Status moe_fc2_finalize(const Fc2FinalizeArgs& args, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream);

// CPU reference (double accumulation, one rounding to bf16). Host pointers;
// same validation (workspace not needed).
Status moe_fc2_finalize_cpu(const Fc2FinalizeArgs& args);

// Host-side validation shared by both backends (no device access).
Status validate_moe_fc2_finalize(const Fc2FinalizeArgs& args);

}  // namespace flashmix

// The router (logits -> top-k experts and weights), spec §8.
#include "flashmix/moe_router.h"
// FC1 with the gather and the gated activation fused, spec §9.
#include "flashmix/moe_fc1.h"

// ---------------------------------------------------------------------------
// The routed-expert layer in one call (spec §10):
//   [router: logits -> ids, weights] -> routing maps -> FC1 + activation ->
//   FC2 + fused finalize (+ shared_output)
// Every stage on `stream`, no host sync, capturable in a CUDA graph; one
// workspace (moe_forward_workspace_size) holds every intermediate.
// ---------------------------------------------------------------------------
namespace flashmix {

// Where FC1's rows come from.
enum class MoeFc1Input : int {
  // kPermutedCopy when experts average at least 64 rows (T * k >= 64 * E,
  // E = num_experts, or E_local where that is larger or num_experts is not
  // given), except for bf16 weights with I <= 1024; else kGather (measured,
  // docs/moe_fc1.md: on the prefill shapes with large I the copy plus FC1's
  // TMA row boxes beat the in-kernel gather; with I = 768 the gather's wide
  // tiles win; at decode the gather costs nothing and saves the copy).
  kAuto = 0,
  kGather = 1,         // FC1 gathers X's rows itself (cp.async): no permuted copy exists
  kPermutedCopy = 2,   // the routing maps also write X's permuted rows into the workspace
};

// "auto", "gather", "permuted_copy"; "unknown" for any other value.
const char* to_string(MoeFc1Input input);

struct MoeForwardArgs {
  int64_t num_tokens = 0;  // T (0 is valid: nothing is launched; with fill, out is not touched either)
  int64_t hidden = 0;      // H, a multiple of 8
  int64_t inter = 0;       // I, a multiple of 8
  int k = 0;               // experts per token, 1..16
  int num_experts = 0;     // E, all experts (the router's width; ids are in [0, E))
  int start_expert_id = 0;       // this rank's first expert
  int num_experts_per_node = 0;  // E_local: this rank holds experts [start, start + E_local)

  const void* X = nullptr;  // bf16 [T, x_stride], token order
  int64_t x_stride = 0;     // 0 means H

  // Routing, one of:
  //  (a) router logits [T, E] (fp32 or bf16): the router runs (spec §8) with
  //      `router` (its logits/ids/weights/T/E/k fields are ignored here);
  //  (b) token_selected_experts [T, k] int32 + token_final_scales [T, k] fp32
  //      (the caller's router; scales may be null = all 1).
  const void* router_logits = nullptr;
  MoeRouterArgs router;
  const int32_t* token_selected_experts = nullptr;
  const float* token_final_scales = nullptr;
  // With (a), optional copies of what the router chose ([T, k] each; null = not kept).
  int32_t* selected_experts_out = nullptr;
  float* final_scales_out = nullptr;

  // FC1: W1 bf16 (e4m3 with fp8) [E_local, 2I, H]; bias bf16 [E_local, 2I] or null.
  const void* W1 = nullptr;
  Fc1WeightLayout w1_layout = Fc1WeightLayout::kGateUp;
  const void* b1 = nullptr;
  MoeActivation activation = MoeActivation::kSwiGLU;
  float activation_limit = 0.f;  // MoeFc1Args::limit
  float activation_alpha = 0.f;  // MoeFc1Args::alpha
  MoeFc1Input fc1_input = MoeFc1Input::kAuto;

  // FP8 weights (spec §10.4; the formats: §11). kNone (default): W1 and W2 are
  // bf16. kBlock: W1 and W2 hold e4m3 codes (torch.float8_e4m3fn) with fp32
  // scales per 128 x 128 block; X stays bf16 and the layer quantises it, and
  // FC1's output, 1 x 128 with fp32 scales (quantize_fp8) in its workspace,
  // then runs FC1 and FC2 on e4m3. Needs H % 128 == 0 and I % 128 == 0.
  // kTensor: kNotSupported (a per-tensor activation scale needs a global amax
  // pass that the layer does not have yet).
  MoeFp8Scaling fp8 = MoeFp8Scaling::kNone;
  // kBlock: [E_local, 2I / 128, H / 128], block (r / 128, h / 128) of W1[e]'s
  // rows r in W1's own row order (MoeFc1Args::w1_scales). Ignored with kNone.
  const float* w1_scales = nullptr;
  // kBlock: [E_local, ceil(H / 128), I / 128], block (h / 128, i / 128) of
  // W2[e] (Fc2FinalizeArgs::w2_scales). Ignored with kNone.
  const float* w2_scales = nullptr;
  // kBlock only: X already quantised. Non-null: X holds e4m3 codes [T,
  // x_stride] (one byte each) and these are their fp32 scales [T, H / 128]
  // (1 x 128 blocks, spec §11); the layer does not quantise X and FC1 gathers
  // its rows (fc1_input kAuto resolves to kGather; kPermutedCopy is
  // kNotSupported). What expert parallelism's FP8 dispatch hands over.
  const float* x_scales = nullptr;
  // MXFP4 weights (spec §13.7): W1 packed e2m1 [E_local, 2I, H / 2] + ue8m0
  // w1_mx_scales [E_local, 2I, H / 32]; W2 packed [E_local, H, I / 2] + ue8m0
  // w2_mx_scales [E_local, H, I / 32] (stack_deepseek_v4_experts builds
  // them). With fp8 = kBlock: W4A8, the FP8 layer's pipeline (X and FC1's
  // output quantised 1 x 128) with the weights converted in FC1 and FC2;
  // with kNone: W4A16 (bf16 activations). w1_scales / w2_scales are ignored.
  // Needs H % 128 == 0 and I % 128 == 0.
  MoeWeightFormat weights = MoeWeightFormat::kDense;
  const void* w1_mx_scales = nullptr;
  const void* w2_mx_scales = nullptr;

  // FC2: W2 bf16 (e4m3 with fp8) [E_local, H, I]; bias bf16 [E_local, H] or null (apply_b2
  // false on all but one tensor-parallel rank).
  const void* W2 = nullptr;
  const void* b2 = nullptr;
  bool apply_b2 = true;
  Fc2Mode fc2_mode = Fc2Mode::kAtomic;
  Fc2Tuning fc2_tuning;

  // Added once to every token written (shared expert or residual): bf16
  // [T, shared_stride] or null; 0 means H.
  const void* shared_output = nullptr;
  int64_t shared_stride = 0;
  // true: a token with no local expert gets 0 (+ shared_output); false: left untouched.
  bool fill = true;

  void* out = nullptr;  // bf16 [T, out_stride]; columns [0, H) written
  int64_t out_stride = 0;  // 0 means H

  bool enable_pdl = true;
};

// The FC1 input moe_forward runs for these args: fc1_input when pinned, else
// the kAuto rule's choice (never kAuto). Sizes only, no device access.
MoeFc1Input moe_forward_fc1_input(const MoeForwardArgs& args);

// Bytes of device workspace moe_forward needs (sizes only; 0 for invalid sizes).
size_t moe_forward_workspace_size(const MoeForwardArgs& args);

// GPU entry point: asynchronous on `stream`, no host synchronisation, no
// allocation, capturable. `workspace` 256-byte aligned. sm_90a.
Status moe_forward(const MoeForwardArgs& args, void* workspace, size_t workspace_bytes, cudaStream_t stream);

// CPU reference: the CPU references of the stages, chained (FC1's output
// rounded to bf16 as on the GPU; with fp8, quantize_fp8_cpu of X and of FC1's
// first P output rows, as on the GPU). Host pointers.
Status moe_forward_cpu(const MoeForwardArgs& args);

Status validate_moe_forward(const MoeForwardArgs& args);

}  // namespace flashmix
