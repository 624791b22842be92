// The routed-expert layer in one call (spec §10): the stages' ops chained on
// the caller's stream, their intermediates in one workspace.
//   router (optional)  logits -> ids [T, k], weights [T, k]
//   routing maps       ids -> expert_first_token_offset, p2u, u2p
//   moe_fc1            X (gathered through p2u), W1 -> act rows [k*T cap, I]
//   moe_fc2_finalize   rows, W2 -> out (+ shared_output), the chosen mode
// With fp8 = kBlock (spec §10.4) two quantize_fp8 passes (1 x 128, fp32
// scales) join them: X (token order, or the permuted copy's first P rows)
// before FC1, FC1's first P output rows before FC2; FC1 and FC2 run on e4m3.
// Every stage's arguments are built and validated before the first launch,
// so bad input launches nothing and touches no output. No host sync: P lives
// on the device (expert_first_token_offset), each kernel reads it there.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "common/check.h"
#include "common/kernel_fit.h"
#include "flashmix/fp8.h"
#include "flashmix/moe.h"
#include "fp8/quantize_fp8_internal.h"
#include "moe/expert_gemm_check.h"
#include "moe/moe_fc1_internal.h"
#include "moe/moe_fc2_internal.h"
#include "moe/moe_forward_internal.h"
#include "moe/moe_routing_plan.h"
#include "moe/sm90_fc1_gemm.h"

namespace flashmix {

namespace {

constexpr const char* kOp = "moe_forward";

size_t align256(size_t x) { return (x + 255) & ~size_t(255); }

struct Stages {
  bool run_router = false;
  MoeRouterArgs router;
  MoeRoutingArgs maps;
  MoeFc1Args fc1;
  Fc2FinalizeArgs fc2;
  // fp8: X (or its permuted copy) -> e4m3 for FC1; FC1's output -> e4m3 for FC2.
  bool fp8 = false;
  bool quantise_x = false;  // X [T, H] quantised by quantize_fp8 (fp8, gathered, not x_prequantised)
  QuantizeFp8Args quant_x, quant_act;
  // On the GPU, FC1 writes e4m3 rows + scales itself where its wide tile
  // does (fc1_q: fc1 with quant_act's outputs), bitwise quant_act of fc1's
  // rows (spec §9.8); the CPU path runs fc1 then quant_act.
  bool fc1_fp8_out = false;
  MoeFc1Args fc1_q;
};

// The input FC1 reads: the caller's X gathered in the kernel, or a permuted
// copy the routing maps write (the rule: MoeFc1Input::kAuto in moe.h).
// Rows per local expert are estimated as T * k / E (uniform routing over all E
// experts: E_local on an expert-parallel rank would overstate them by E / E_local).
bool use_permuted_copy(const MoeForwardArgs& a) {
  return moe_forward_fc1_input(a) == MoeFc1Input::kPermutedCopy;
}

bool is_fp8(const MoeForwardArgs& a) { return a.fp8 != MoeFp8Scaling::kNone; }

// FLASHMIX_LAYER_FC1_FP8_OUT=0 keeps FC1's bf16 rows and the quantisation
// pass where FC1 could write e4m3 itself (the A/B; read on every call).
bool fc1_fp8_out_allowed() {
  const char* e = std::getenv("FLASHMIX_LAYER_FC1_FP8_OUT");
  return e == nullptr || std::atoi(e) != 0;
}

// X arrives as e4m3 with its scales (MoeForwardArgs::x_scales): not quantised here.
bool x_prequantised(const MoeForwardArgs& a) { return is_fp8(a) && a.x_scales != nullptr; }

// The stages' arguments; workspace regions at `ws` + the layout's offsets
// (ws null: the size query, pointers into it left null).
Stages make_stages(const MoeForwardArgs& a, char* ws, const MoeForwardLayout& l) {
  auto at = [&](size_t off) -> char* { return ws ? ws + off : nullptr; };
  Stages s;
  const int64_t T = a.num_tokens;
  s.run_router = a.router_logits != nullptr;
  const int32_t* ids = a.token_selected_experts;
  const float* scales = a.token_final_scales;
  if (s.run_router) {
    s.router = a.router;
    s.router.logits = a.router_logits;
    s.router.num_tokens = T;
    s.router.num_experts = a.num_experts;
    s.router.k = a.k;
    s.router.token_selected_experts =
        a.selected_experts_out ? a.selected_experts_out : reinterpret_cast<int32_t*>(at(l.ids));
    s.router.token_final_scales = a.final_scales_out ? a.final_scales_out : reinterpret_cast<float*>(at(l.scales));
    s.router.enable_pdl = a.enable_pdl;
    ids = s.router.token_selected_experts;
    scales = s.router.token_final_scales;
  }
  int64_t* offsets = reinterpret_cast<int64_t*>(at(l.offsets));
  int32_t* p2u = reinterpret_cast<int32_t*>(at(l.p2u));
  s.maps.token_selected_experts = ids;
  s.maps.num_tokens = T;
  s.maps.k = a.k;
  s.maps.start_expert_id = a.start_expert_id;
  s.maps.num_experts_per_node = a.num_experts_per_node;
  s.maps.expert_first_token_offset = offsets;
  s.maps.permuted_row_to_unpermuted_row = p2u;
  s.maps.unpermuted_row_to_permuted_row = reinterpret_cast<int32_t*>(at(l.u2p));
  s.maps.enable_pdl = a.enable_pdl;
  const bool copy = use_permuted_copy(a);
  const bool fp8 = is_fp8(a);
  if (copy) {
    s.maps.input = a.X;
    s.maps.permuted_input = at(l.x_perm);
    s.maps.input_dtype = DType::kBFloat16;
    s.maps.hidden = a.hidden;
    s.maps.input_stride = a.x_stride;
    if (fp8) {
      // The maps quantise while they expand (spec §1.4): e4m3 rows and 1 x 128
      // fp32 scales of the first P permuted rows, no bf16 copy.
      s.maps.permuted_input = at(l.x_q);
      s.maps.permuted_input_scales = at(l.x_scales);
      s.maps.permuted_scale_format = ScaleFormat::kFloat32;
    }
  }

  s.fc1.X = copy ? at(l.x_perm) : a.X;
  s.fc1.x_stride = copy ? 0 : a.x_stride;
  s.fc1.x_permuted = copy;
  if (fp8) {
    // X -> e4m3 rows + fp32 scales [rows, H / 128]: gathered, X's T rows by
    // quantize_fp8; with the permuted copy, the maps' FP8 expansion writes the
    // first P of k*T rows.
    s.fp8 = true;
    s.quantise_x = !x_prequantised(a) && !copy;  // the permuted copy comes quantised from the maps
    s.quant_x.x = s.fc1.X;
    s.quant_x.x_stride = s.fc1.x_stride;
    s.quant_x.q = at(l.x_q);
    s.quant_x.scales = at(l.x_scales);
    s.quant_x.rows = T;
    s.quant_x.cols = a.hidden;
    s.quant_x.block = Fp8Block::k1x128;
    s.quant_x.scale_format = ScaleFormat::kFloat32;
    s.quant_x.enable_pdl = a.enable_pdl;
    const bool x_here = !x_prequantised(a);  // X's e4m3 rows in the workspace (quantised here or by the maps)
    s.fc1.X = x_here ? at(l.x_q) : a.X;
    s.fc1.x_stride = x_here ? 0 : a.x_stride;
    s.fc1.fp8 = a.fp8;
    s.fc1.x_scales = x_here ? reinterpret_cast<const float*>(at(l.x_scales)) : a.x_scales;
    s.fc1.w1_scales = a.w1_scales;
    // FC1's output [k*T capacity, I] -> e4m3, its first P rows (FC2 reads no others).
    s.quant_act.x = at(l.fc1_out);
    s.quant_act.q = at(l.act_q);
    s.quant_act.scales = at(l.act_scales);
    s.quant_act.rows = T * a.k;
    s.quant_act.cols = a.inter;
    s.quant_act.block = Fp8Block::k1x128;
    s.quant_act.scale_format = ScaleFormat::kFloat32;
    s.quant_act.enable_pdl = a.enable_pdl;
  }
  s.fc1.W1 = a.W1;
  s.fc1.weights = a.weights;
  s.fc1.w1_mx_scales = a.w1_mx_scales;
  s.fc1.layout = a.w1_layout;
  s.fc1.bias = a.b1;
  s.fc1.expert_first_token_offset = offsets;
  s.fc1.permuted_row_to_unpermuted_row = p2u;
  s.fc1.num_tokens = T;
  s.fc1.k = a.k;
  s.fc1.hidden = a.hidden;
  s.fc1.inter = a.inter;
  s.fc1.num_experts_per_node = a.num_experts_per_node;
  s.fc1.activation = a.activation;
  s.fc1.limit = a.activation_limit;
  s.fc1.alpha = a.activation_alpha;
  // FC1's bf16 rows, quantised by quantize_fp8 with fp8; or, where FC1
  // takes wide tiles with block-FP8 weights, FC1's own FP8 output (spec
  // §9.8; the narrow tile's FP8 output measured slower than bf16 rows and
  // the ~20 us quantisation pass; docs/moe_fc1.md).
  s.fc1.out = at(l.fc1_out);
  s.fc1.enable_pdl = a.enable_pdl;
  // (sm90_fc1_wide_tiles holds only for dense W1; MXFP4 W1 writes the FP8
  // output on its own wide tiles, sm90_fc1_mx_wide_tiles.)
  if (a.fp8 == MoeFp8Scaling::kBlock && fc1_fp8_out_allowed() &&
      (sm90_fc1_wide_tiles(a.fp8, a.weights, s.fc1.x_permuted, T, a.k, a.num_experts_per_node) ||
       sm90_fc1_mx_wide_tiles(a.fp8, a.weights, s.fc1.x_permuted, s.fc1.layout == Fc1WeightLayout::kInterleaved,
                              a.inter, T, a.k, a.num_experts_per_node))) {
    s.fc1_fp8_out = true;
    s.fc1_q = s.fc1;
    s.fc1_q.out = s.quant_act.q;
    s.fc1_q.out_scales = s.quant_act.scales;
    s.fc1_q.out_scale_format = s.quant_act.scale_format;
  }

  s.fc2.A = fp8 ? at(l.act_q) : at(l.fc1_out);
  s.fc2.W2 = a.W2;
  s.fc2.weights = a.weights;
  s.fc2.w2_mx_scales = a.w2_mx_scales;
  if (fp8) {
    s.fc2.fp8 = a.fp8;
    s.fc2.a_scales = reinterpret_cast<const float*>(at(l.act_scales));
    s.fc2.w2_scales = a.w2_scales;
  }
  s.fc2.expert_first_token_offset = offsets;
  s.fc2.permuted_row_to_unpermuted_row = p2u;
  s.fc2.scales = scales;
  s.fc2.bias = a.b2;
  s.fc2.apply_bias = a.apply_b2;
  s.fc2.num_tokens = T;
  s.fc2.k = a.k;
  s.fc2.hidden = a.hidden;
  s.fc2.inter = a.inter;
  s.fc2.num_experts_per_node = a.num_experts_per_node;
  s.fc2.out = a.out;
  s.fc2.out_stride = a.out_stride;
  s.fc2.mode = a.fc2_mode;
  s.fc2.shared_output = a.shared_output;
  s.fc2.shared_stride = a.shared_stride;
  s.fc2.fill = a.fill;
  s.fc2.tuning = a.fc2_tuning;
  return s;
}

// The glue the maps' kernels do for the layer (detail::RoutingSideWork):
// zero `out` where FC2 would memset it (kAtomic with fill and no
// shared_output: ~5 us and a break in the PDL chain between FC1 and FC2 at
// T = 4096, H = 2048 on an H100) or, without fill, seed it (only the rows
// of the tokens with a local slot, the ids read there: not before the
// dependency wait); on the multi-block path pull X into L2
// where FC1 gathers the caller's bf16 rows (before the count kernel's
// dependency wait when the layer's router runs in front of it:
// RoutingSideWork::before_wait); on the single-block path (decode) quantise
// X for the FP8 layers in blocks beside the maps' (the memset and the
// quantize_fp8 launch were ~6 us of a ~95 us FP8 layer at V4-Flash T = 16 on
// an H200, docs/moe_fc1.md). FLASHMIX_LAYER_SIDE_WORK=0 turns it off
// (same-binary A/B; read on every call).
detail::RoutingSideWork maps_side_work(const MoeForwardArgs& a, const Stages& s, int sms) {
  detail::RoutingSideWork w;
  const char* off = std::getenv("FLASHMIX_LAYER_SIDE_WORK");
  if (off != nullptr && off[0] == '0') return w;
  const bool single = detail::plan_moe_routing(s.maps).single_block;
  w.before_wait = !single && s.run_router;
  w.min_blocks = single ? 1 : 2 * sms;
  // Rows of hidden * 2 bytes, a multiple of 16 (the stages' validation holds H % 8 == 0).
  const int64_t out_stride_bytes = (a.out_stride ? a.out_stride : a.hidden) * 2;
  if (a.fc2_mode == Fc2Mode::kAtomic && a.shared_output == nullptr && reinterpret_cast<uintptr_t>(a.out) % 16 == 0 &&
      out_stride_bytes % 16 == 0 && (a.fill || !w.before_wait)) {
    w.zero = a.out;
    w.zero_rows = a.num_tokens;
    w.zero_row_bytes = a.hidden * 2;
    w.zero_stride_bytes = out_stride_bytes;
    if (!a.fill) {  // only the tokens with a local slot (FC2's seed of them, once a token)
      w.zero_ids = s.maps.token_selected_experts;
      w.zero_k = a.k;
      w.zero_lo = a.start_expert_id;
      w.zero_n = a.num_experts_per_node;
    }
  }
  if (single) {
    const QuantizeFp8Args& q = s.quant_x;
    const int64_t x_stride = q.x_stride ? q.x_stride : q.cols, q_stride = q.q_stride ? q.q_stride : q.cols;
    if (s.quantise_x && q.block == Fp8Block::k1x128 && q.scale_format == ScaleFormat::kFloat32 && q.batch == 1 &&
        reinterpret_cast<uintptr_t>(q.x) % 16 == 0 && x_stride % 8 == 0 && q_stride % 8 == 0 &&
        reinterpret_cast<uintptr_t>(q.q) % 8 == 0) {
      w.quant_x = q.x;
      w.quant_x_stride = x_stride;
      w.quant_rows = q.rows;
      w.quant_cols = q.cols;
      w.quant_q = q.q;
      w.quant_q_stride = q_stride;
      w.quant_scales = static_cast<float*>(q.scales);
    }
    // Blocks beside the maps' one: a team of four lanes a 1 x 128 block (X),
    // a 16-byte store a thread (out), up to one a multiprocessor.
    const int64_t lanes = std::max<int64_t>(w.quant_x ? w.quant_rows * (w.quant_cols / 128) * 4 : 0,
                                            w.zero ? w.zero_rows * w.zero_row_bytes / 16 : 0);
    w.min_blocks = 1 + int(std::min<int64_t>(sms, (lanes + detail::kRoutingThreads - 1) / detail::kRoutingThreads));
    return w;
  }
  if (!s.fc1.x_permuted && s.fc1.X == a.X && !s.quantise_x) {
    const int64_t elem = x_prequantised(a) ? 1 : 2;
    w.prefetch = a.X;
    w.prefetch_rows = a.num_tokens;
    w.prefetch_row_bytes = a.hidden * elem;
    w.prefetch_stride_bytes = (a.x_stride ? a.x_stride : a.hidden) * elem;
  }
  return w;
}

}  // namespace

MoeForwardLayout moe_forward_layout(const MoeForwardArgs& a) {
  MoeForwardLayout l;
  const Stages s = make_stages(a, nullptr, l);
  const size_t slots = size_t(a.num_tokens) * size_t(a.k);
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off = align256(off + bytes);
    return at;
  };
  if (a.router_logits) {
    l.ids = take(a.selected_experts_out ? 0 : slots * 4);
    l.scales = take(a.final_scales_out ? 0 : slots * 4);
  }
  l.offsets = take((size_t(a.num_experts_per_node) + 1) * 8);
  l.p2u = take(slots * 4);
  l.u2p = take(slots * 4);
  l.x_perm = take(use_permuted_copy(a) && !is_fp8(a) ? slots * size_t(a.hidden) * 2 : 0);
  l.maps_ws_bytes = build_moe_routing_maps_workspace_size(s.maps);
  l.maps_ws = take(l.maps_ws_bytes);
  l.fc1_out = take(slots * size_t(a.inter) * 2);
  if (is_fp8(a)) {
    const size_t x_rows = x_prequantised(a) ? 0 : use_permuted_copy(a) ? slots : size_t(a.num_tokens);
    l.x_q = take(x_rows * size_t(a.hidden));
    l.x_scales = take(x_rows * size_t(a.hidden / 128) * 4);
    l.act_q = take(slots * size_t(a.inter));
    l.act_scales = take(slots * size_t(a.inter / 128) * 4);
  }
  l.fc2_ws_bytes = moe_fc2_finalize_workspace_size(s.fc2);
  l.fc2_ws = take(l.fc2_ws_bytes);
  l.total = off;
  return l;
}

namespace {

// Every caller buffer with the bytes the layer may touch (null pointers give
// empty ranges).
struct CallerRanges {
  detail::Range X, router_logits, router_token_ids, router_hash_table, token_selected_experts,
      token_final_scales, selected_experts_out, final_scales_out, W1, b1, W2, b2, shared_output, out, w1_scales,
      w2_scales, x_scales, w1_mx_scales, w2_mx_scales;
};

CallerRanges caller_ranges(const MoeForwardArgs& a) {
  const int64_t T = a.num_tokens, E = a.num_experts_per_node, H = a.hidden, I = a.inter, slots = T * a.k;
  const int64_t x_stride = a.x_stride ? a.x_stride : H, out_stride = a.out_stride ? a.out_stride : H;
  const int64_t shared_stride = a.shared_stride ? a.shared_stride : H;
  const int64_t logit_bytes = a.router.logits_dtype == DType::kFloat32 ? 4 : 2;
  CallerRanges r;
  r.X = {"X", a.X, detail::rows_extent_bytes(T, x_stride, H, x_prequantised(a) ? 1 : 2)};
  r.x_scales = {"x_scales", x_prequantised(a) ? a.x_scales : nullptr, T * (H / 128) * 4};
  r.router_logits = {"router_logits", a.router_logits, T * a.num_experts * logit_bytes};
  const bool hash = a.router_logits && a.router.hash_table;  // the router's hash selection (spec §8.7)
  r.router_token_ids = {"router.token_ids", hash ? a.router.token_ids : nullptr,
                        T * (a.router.token_ids_int64 ? 8 : 4)};
  // An out-of-range vocab_size counts no bytes here: the router's own check names it.
  const bool table_sized = a.router.vocab_size > 0 && a.router.vocab_size <= std::numeric_limits<int64_t>::max() / 64;
  r.router_hash_table = {"router.hash_table", hash ? a.router.hash_table : nullptr,
                         hash && table_sized ? a.router.vocab_size * a.k * 4 : 0};
  r.token_selected_experts = {"token_selected_experts", a.token_selected_experts, slots * 4};
  r.token_final_scales = {"token_final_scales", a.token_final_scales, slots * 4};
  r.selected_experts_out = {"selected_experts_out", a.selected_experts_out, slots * 4};
  r.final_scales_out = {"final_scales_out", a.final_scales_out, slots * 4};
  const bool fp8 = is_fp8(a);
  const bool mx = a.weights == MoeWeightFormat::kMxfp4;
  const int64_t w1_elems = E * 2 * I * H, w2_elems = E * H * I;
  const int64_t wsize = fp8 ? 1 : 2;  // bytes an element of a dense W1 and W2
  r.W1 = {"W1", a.W1, mx ? w1_elems / 2 : w1_elems * wsize};
  r.b1 = {"b1", a.b1, E * 2 * I * 2};
  r.W2 = {"W2", a.W2, mx ? w2_elems / 2 : w2_elems * wsize};
  r.w1_scales = {"w1_scales", fp8 && !mx ? a.w1_scales : nullptr, E * ((2 * I + 127) / 128) * (H / 128) * 4};
  r.w2_scales = {"w2_scales", fp8 && !mx ? a.w2_scales : nullptr, E * ((H + 127) / 128) * (I / 128) * 4};
  r.w1_mx_scales = {"w1_mx_scales", mx ? a.w1_mx_scales : nullptr, w1_elems / 32};
  r.w2_mx_scales = {"w2_mx_scales", mx ? a.w2_mx_scales : nullptr, w2_elems / 32};
  r.b2 = {"b2", a.b2, E * H * 2};
  r.shared_output = {"shared_output", a.shared_output, detail::rows_extent_bytes(T, shared_stride, H, 2)};
  r.out = {"out", a.out, detail::rows_extent_bytes(T, out_stride, H, 2)};
  return r;
}

// Rules of the layer as a whole (the stages check their own arguments).
Status validate_own(const MoeForwardArgs& a, bool check_buffers) {
  FM_REQUIRE(a.num_tokens >= 0, kOp, "num_tokens", "must be >= 0 (got ", a.num_tokens, ")");
  FM_REQUIRE(a.k >= 1 && a.k <= 16, kOp, "k", "must be in [1, 16] (got ", a.k, ")");
  FM_REQUIRE(a.num_experts_per_node >= 1 && a.num_experts_per_node <= 1024, kOp, "num_experts_per_node",
             "must be in [1, 1024] (got ", a.num_experts_per_node, ")");
  FM_REQUIRE(a.start_expert_id >= 0, kOp, "start_expert_id", "must be >= 0 (got ", a.start_expert_id, ")");
  const int in = int(a.fc1_input);
  FM_REQUIRE(in >= 0 && in <= 2, kOp, "fc1_input", "unknown MoeFc1Input value ", in);
  const int f = int(a.fp8);
  FM_REQUIRE(f >= int(MoeFp8Scaling::kNone) && f <= int(MoeFp8Scaling::kTensor), kOp, "fp8",
             "unknown MoeFp8Scaling value ", f);
  FM_REQUIRE_SUPPORTED(a.fp8 != MoeFp8Scaling::kTensor, kOp, "fp8",
                       "tensor scaling is not supported by moe_forward (a per-tensor scale of X and of FC1's "
                       "output needs a global amax pass); use block");
  if (a.x_scales != nullptr) {
    FM_REQUIRE(a.fp8 == MoeFp8Scaling::kBlock, kOp, "x_scales",
               "is for an X already quantised 1 x 128: only with fp8 = block");
    FM_REQUIRE_SUPPORTED(a.fc1_input != MoeFc1Input::kPermutedCopy, kOp, "fc1_input",
                         "permuted_copy with an X already quantised (x_scales): FC1 gathers its rows; use auto or "
                         "gather");
  }
  bool mx = false;  // FC1's K is hidden, FC2's inter
  FM_RETURN_IF_ERROR(detail::validate_expert_weight_format(kOp, a.weights, a.fp8, a.hidden, "hidden", &mx));
  FM_RETURN_IF_ERROR(detail::validate_expert_weight_format(kOp, a.weights, a.fp8, a.inter, "inter", &mx));
  if (is_fp8(a)) {
    FM_REQUIRE(a.hidden % 128 == 0, kOp, "hidden",
               "must be a multiple of 128 with fp8 = block (X is quantised 1 x 128; got ", a.hidden, ")");
    FM_REQUIRE(a.inter % 128 == 0, kOp, "inter",
               "must be a multiple of 128 with fp8 = block (FC1's output is quantised 1 x 128; got ", a.inter, ")");
  }
  if (check_buffers && a.num_tokens > 0)
    FM_REQUIRE((a.router_logits != nullptr) != (a.token_selected_experts != nullptr), kOp, "router_logits",
               "give exactly one of router_logits and token_selected_experts (got ",
               a.router_logits ? "both" : "neither", ")");
  FM_REQUIRE(a.num_experts >= 0 && a.num_experts <= (1 << 20), kOp, "num_experts", "must be in [0, 2^20] (got ",
             a.num_experts, ")");
  if (a.router_logits != nullptr || a.token_selected_experts == nullptr) {
    FM_REQUIRE(a.num_experts >= 1, kOp, "num_experts", "must be >= 1 with router_logits (got ", a.num_experts, ")");
    FM_REQUIRE(a.k <= a.num_experts, kOp, "k", "must be <= num_experts (", a.num_experts, "; got ", a.k, ")");
    FM_REQUIRE(int64_t(a.start_expert_id) + a.num_experts_per_node <= a.num_experts, kOp, "num_experts_per_node",
               "this rank's experts [start_expert_id, start_expert_id + num_experts_per_node) = [",
               a.start_expert_id, ", ", int64_t(a.start_expert_id) + a.num_experts_per_node,
               ") must lie within the router's num_experts = ", a.num_experts);
  }
  if (a.num_tokens == 0 || !check_buffers) return Status::Ok();
  FM_REQUIRE(a.router_logits != nullptr || (a.router.hash_table == nullptr && a.router.token_ids == nullptr), kOp,
             "router.hash_table", "selects in the router: only with router_logits (the caller's ids are given)");
  FM_REQUIRE(a.router_logits == nullptr || a.token_final_scales == nullptr, kOp, "token_final_scales",
             "must be null with router_logits (the router makes the weights)");
  FM_REQUIRE(a.out != nullptr, kOp, "out", "must not be null");
  // X must suit FC1's gather whichever input the rule picks, so a layer valid
  // at one T is valid at every T.
  FM_REQUIRE(reinterpret_cast<uintptr_t>(a.X) % 16 == 0, kOp, "X", "must be 16-byte aligned");
  FM_REQUIRE(a.x_stride % 8 == 0, kOp, "x_stride", "must be a multiple of 8 (16-byte rows; got ", a.x_stride, ")");
  // `out` and the router's kept outputs overlap none of the inputs the stages
  // do not check against them (each stage checks its own).
  const CallerRanges r = caller_ranges(a);
  const detail::Range outs[] = {r.out, a.router_logits ? r.selected_experts_out : detail::Range{},
                                a.router_logits ? r.final_scales_out : detail::Range{}};
  const detail::Range ins[] = {r.X,         r.router_logits, r.router_token_ids, r.router_hash_table,
                               r.token_selected_experts, r.W1, r.b1, r.shared_output, r.w1_scales,
                               r.w2_scales, r.x_scales, r.w1_mx_scales, r.w2_mx_scales};
  return detail::check_no_overlap(kOp, outs, ins);
}

// The workspace overlaps no caller buffer (the stages check only the regions
// they use against their own arguments).
Status check_workspace_alone(const MoeForwardArgs& a, const void* ws, size_t bytes) {
  const CallerRanges r = caller_ranges(a);
  const detail::Range outs[] = {{"workspace", ws, int64_t(bytes)}};
  const detail::Range ins[] = {r.X,  r.router_logits, r.router_token_ids, r.router_hash_table,
                               r.token_selected_experts, r.token_final_scales,
                               r.selected_experts_out, r.final_scales_out, r.W1, r.b1, r.W2, r.b2,
                               r.shared_output, r.out, r.w1_scales, r.w2_scales, r.x_scales,
                               r.w1_mx_scales, r.w2_mx_scales};
  return detail::check_no_overlap(kOp, outs, ins);
}

// A stage's error, named as the layer's: "moe_forward: moe_fc1: W1: ...".
Status in_layer(const Status& st) {
  if (st.ok()) return st;
  return Status(st.code(), detail::concat(kOp, ": ", st.message()));
}

Status validate_stages(const MoeForwardArgs& a, const Stages& s, bool check_buffers) {
  FM_RETURN_IF_ERROR(validate_own(a, check_buffers));
  if (a.num_tokens == 0) return Status::Ok();
  if (s.run_router && check_buffers) FM_RETURN_IF_ERROR(in_layer(validate_moe_router(s.router)));
  FM_RETURN_IF_ERROR(in_layer(validate_routing(s.maps, check_buffers)));
  if (s.fp8 && check_buffers) {
    if (s.quantise_x) FM_RETURN_IF_ERROR(in_layer(validate_quantize_fp8(s.quant_x)));
    FM_RETURN_IF_ERROR(in_layer(validate_quantize_fp8(s.quant_act)));
  }
  FM_RETURN_IF_ERROR(in_layer(validate_fc1(s.fc1, check_buffers)));
  if (s.fc1_fp8_out) FM_RETURN_IF_ERROR(in_layer(validate_fc1(s.fc1_q, check_buffers)));
  return in_layer(validate_fc2(s.fc2, check_buffers));
}

}  // namespace

MoeFc1Input moe_forward_fc1_input(const MoeForwardArgs& a) {
  if (a.fc1_input != MoeFc1Input::kAuto) return a.fc1_input;
  if (x_prequantised(a)) return MoeFc1Input::kGather;
  const int64_t experts = a.num_experts > a.num_experts_per_node ? a.num_experts : a.num_experts_per_node;
  if (a.num_tokens * a.k < int64_t(64) * experts) return MoeFc1Input::kGather;
  // bf16 with I <= 1024: the wide tiles' gather costs FC1 less than the copy
  // (H100, Qwen3-MoE's T 4096 k 8 E 128 I 768 H 2048: layer 771 vs 780 us;
  // with I = 2048 the copy wins by ~60 us; docs/moe_fc1.md).
  if (!is_fp8(a) && a.weights == MoeWeightFormat::kDense && a.inter <= 1024) return MoeFc1Input::kGather;
  return MoeFc1Input::kPermutedCopy;
}

const char* to_string(MoeFc1Input input) {
  switch (input) {
    case MoeFc1Input::kAuto: return "auto";
    case MoeFc1Input::kGather: return "gather";
    case MoeFc1Input::kPermutedCopy: return "permuted_copy";
  }
  return "unknown";
}

Status validate_moe_forward(const MoeForwardArgs& a) {
  MoeForwardLayout l0;
  FM_RETURN_IF_ERROR(validate_stages(a, make_stages(a, nullptr, l0), false));
  if (a.num_tokens == 0) return validate_own(a, true);
  // Every stage's buffers too: the workspace regions stand at a placeholder
  // base (2^62: above every user-space address of x86-64 and AArch64, so it
  // overlaps no caller buffer), since validation reads no memory.
  char* const placeholder = reinterpret_cast<char*>(uintptr_t(1) << 62);
  return validate_stages(a, make_stages(a, placeholder, moe_forward_layout(a)), true);
}

size_t moe_forward_workspace_size(const MoeForwardArgs& a) {
  MoeForwardLayout l;
  if (!validate_stages(a, make_stages(a, nullptr, l), false).ok()) return 0;
  return moe_forward_layout(a).total;
}

Status moe_forward(const MoeForwardArgs& a, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  MoeForwardLayout l0;
  FM_RETURN_IF_ERROR(validate_stages(a, make_stages(a, nullptr, l0), false));
  if (a.num_tokens == 0) return Status::Ok();
  const MoeForwardLayout l = moe_forward_layout(a);
  FM_REQUIRE(workspace_bytes >= l.total, kOp, "workspace_bytes", "too small: ", workspace_bytes, " < ", l.total,
             " (ask moe_forward_workspace_size)");
  FM_REQUIRE(workspace != nullptr, kOp, "workspace", "must not be null");
  FM_REQUIRE(reinterpret_cast<uintptr_t>(workspace) % 256 == 0, kOp, "workspace", "must be 256-byte aligned");
  Stages s = make_stages(a, static_cast<char*>(workspace), l);
  FM_RETURN_IF_ERROR(validate_stages(a, s, true));  // every stage's buffers, before anything is enqueued
  FM_RETURN_IF_ERROR(check_workspace_alone(a, workspace, l.total));
  detail::DeviceProps dev;
  FM_RETURN_IF_ERROR(detail::cuda_status(detail::current_device_props(&dev), kOp, "device properties"));
  FM_REQUIRE_SUPPORTED(dev.cc_major == 9, kOp, "device", "needs an sm_90 (Hopper) GPU (compute capability ",
                       dev.cc_major, ".x)");
  if (s.run_router) FM_RETURN_IF_ERROR(in_layer(moe_router(s.router, stream)));
  const detail::RoutingSideWork side = maps_side_work(a, s, dev.sms);
  if (side.zero != nullptr) {
    // The count kernel zeroed out (every row; without fill those of the
    // tokens with a local slot), not FC2's memset or seed, so FC2 adds onto
    // it. Its fill then changes nothing (kAtomic's fill only says which rows
    // its own zeroing covers; the adds touch the local rows' tokens alone):
    // it is set because out_already_zeroed goes with fill.
    s.fc2.out_already_zeroed = true;
    s.fc2.fill = true;
  }
  FM_RETURN_IF_ERROR(in_layer(detail::build_moe_routing_maps_with(
      s.maps, side, static_cast<char*>(workspace) + l.maps_ws, l.maps_ws_bytes, stream)));
  const int64_t* live_rows = s.maps.expert_first_token_offset + a.num_experts_per_node;  // P, on the device
  if (s.quantise_x && side.quant_x == nullptr) FM_RETURN_IF_ERROR(in_layer(quantize_fp8(s.quant_x, stream)));
  if (s.fc1_fp8_out) {
    FM_RETURN_IF_ERROR(in_layer(moe_fc1(s.fc1_q, stream)));
  } else {
    FM_RETURN_IF_ERROR(in_layer(moe_fc1(s.fc1, stream)));
    if (s.fp8) FM_RETURN_IF_ERROR(in_layer(quantize_fp8_device_rows(s.quant_act, live_rows, stream)));
  }
  return in_layer(moe_fc2_finalize(s.fc2, static_cast<char*>(workspace) + l.fc2_ws, l.fc2_ws_bytes, stream));
}

Status moe_forward_cpu(const MoeForwardArgs& a) {
  MoeForwardLayout l0;
  FM_RETURN_IF_ERROR(validate_stages(a, make_stages(a, nullptr, l0), false));
  FM_RETURN_IF_ERROR(validate_own(a, true));
  if (a.num_tokens == 0) return Status::Ok();
  // The intermediates in host memory, laid out as on the GPU.
  const MoeForwardLayout l = moe_forward_layout(a);
  std::vector<uint64_t> ws((l.total + 7) / 8 + 32);
  char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(ws.data()) + 255) & ~uintptr_t(255));
  const Stages s = make_stages(a, base, l);
  if (s.run_router) FM_RETURN_IF_ERROR(in_layer(moe_router_cpu(s.router)));
  FM_RETURN_IF_ERROR(in_layer(build_moe_routing_maps_cpu(s.maps)));
  // The GPU's quantize passes cover the first P rows of the k*T capacity
  // buffers (token order: all T rows of X); so do these.
  const int64_t P = s.maps.expert_first_token_offset[a.num_experts_per_node];
  if (s.quantise_x) FM_RETURN_IF_ERROR(in_layer(quantize_fp8_cpu(s.quant_x)));
  FM_RETURN_IF_ERROR(in_layer(moe_fc1_cpu(s.fc1)));
  if (s.fp8) {
    QuantizeFp8Args qa = s.quant_act;
    qa.rows = P;
    FM_RETURN_IF_ERROR(in_layer(quantize_fp8_cpu(qa)));
  }
  return in_layer(moe_fc2_finalize_cpu(s.fc2));
}

}  // namespace flashmix
