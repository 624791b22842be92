// flashmix_ep: the routed-expert layer across GPUs on NCCL (spec §14).
//
// Expert placement: with W ranks and E experts (E % W == 0), rank r holds
// experts [r * E/W, (r + 1) * E/W). Two ways to run the layer:
//
//  1. Replicated tokens (ep_moe_forward_replicated, ep_finalize_reduce): every
//     rank has the same T tokens and routing, computes the partial output of
//     its own experts, and NCCL sums the partials (all_reduce: tokens stay
//     replicated; reduce_scatter: rank r keeps rows [r*T/W, (r+1)*T/W)).
//
//  2. Sharded tokens, all-to-all (ep_dispatch, ep_combine, ep_moe_forward):
//     each rank owns its own T_r tokens. Dispatch sends a token's row once to
//     each rank that holds at least one of its k experts, with its k ids and
//     weights; the receiving rank runs its experts over what it received
//     (moe_forward pre-reduces a token's local slots into one row); combine
//     sends that row back and the owner sums the rows in rank order.
//
// Everything is asynchronous on the caller's stream and takes a caller-owned
// workspace (size query + buffer). kCapacity sizing issues only fixed-size
// NCCL calls and is capturable in a CUDA graph; kExact exchanges the counts
// first and synchronises the stream once per dispatch (not capturable).
// The C++ API takes the caller's ncclComm_t; its rank and size must equal
// EpShape::rank and EpShape::world.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "flashmix/moe.h"
#include "flashmix/status.h"

namespace flashmix {

// ---------------------------------------------------------------------------
// Way 1: replicated tokens, reduce after.

enum class EpReduce {
  kAllReduce = 0,      // out [T, H] on every rank (tokens stay replicated)
  kReduceScatter = 1,  // out [T/W, H]: rank r's rows [r*T/W, (r+1)*T/W); T % W == 0
};

// moe_forward over this rank's experts, then the partials summed across the
// communicator. `moe` is the single-GPU layer's arguments with the rank's
// expert range (start_expert_id = rank * E_local, num_experts_per_node =
// E_local = num_experts / W); its `fill` is ignored (the partial is always
// filled), shared_output is added on rank 0 only (once in the sum), and its
// out / out_stride are ignored: the result goes to `out` below. The partial
// is bf16 (what moe_forward writes), summed by NCCL in bf16 (spec §14.2).
struct EpReplicatedArgs {
  MoeForwardArgs moe;
  EpReduce reduce = EpReduce::kAllReduce;
  void* out = nullptr;  // bf16, contiguous: [T, H] (all-reduce) or [T/W, H] (reduce-scatter)
};
size_t ep_moe_forward_replicated_workspace_size(const EpReplicatedArgs& args, int world);
Status ep_moe_forward_replicated(const EpReplicatedArgs& args, ncclComm_t comm, void* workspace,
                                 size_t workspace_bytes, cudaStream_t stream);

// The finalize seed's expert parallelism: finalize_moe_routing over this
// rank's expert range into a filled partial, then NCCL's sum. `finalize` is
// the single-GPU finalize's arguments with the rank's expert range; its fill,
// out, out_dtype and out_stride are replaced, and its shared_output (of
// partial_dtype) is added on rank 0 only (once in the sum).
// partial_dtype kFloat32 (the default, spec §14.2): the partial and the
// NCCL sum are fp32 and one rounding to `out_dtype` ends it; kBFloat16: the
// partial is rounded to bf16 and NCCL sums bf16 (half the bytes).
struct EpFinalizeReduceArgs {
  FinalizeMoeRoutingArgs finalize;
  EpReduce reduce = EpReduce::kReduceScatter;
  DType partial_dtype = DType::kFloat32;
  void* out = nullptr;                  // contiguous [T, H] or [T/W, H] of out_dtype
  DType out_dtype = DType::kBFloat16;
};
size_t ep_finalize_reduce_workspace_size(const EpFinalizeReduceArgs& args, int world);
Status ep_finalize_reduce(const EpFinalizeReduceArgs& args, ncclComm_t comm, void* workspace, size_t workspace_bytes,
                          cudaStream_t stream);

// ---------------------------------------------------------------------------
// Way 2: sharded tokens, all-to-all dispatch and combine.

enum class EpSizing {
  kCapacity = 0,  // fixed-size messages of recv_capacity rows: no host sync, graph-capturable
  kExact = 1,     // counts exchanged first, then exact-size messages: one stream sync per dispatch
};

// What every rank agrees on; it fixes the workspace layout. The receive side
// keeps `recv_capacity` rows per source rank (slab s = rows [s*C, (s+1)*C)).
struct EpShape {
  int rank = 0;                     // this rank, 0..world-1
  int world = 0;                    // W >= 1
  int64_t hidden = 0;               // H, a multiple of 8
  int k = 0;                        // experts per token, 1..16
  int num_experts = 0;              // E, a multiple of W
  int64_t max_tokens_per_rank = 0;  // the bound: every rank's T <= it (>= 1)
  // Rows a rank receives from one source, C. 0 means max_tokens_per_rank,
  // which never overflows (a token goes at most once to each rank). Less
  // saves memory and bytes; a source with more rows for one destination
  // overflows (spec §14.4): the rows past C are not sent, the owner's output
  // rows of those tokens are NaN and `dropped` counts them.
  int64_t recv_capacity = 0;
  EpSizing sizing = EpSizing::kCapacity;
  // FP8 dispatch (spec §14.3): rows are quantised 1 x 128 (quantize_fp8: e4m3
  // + fp32 scales) before they are sent, half the bytes of bf16; the receive
  // view's x is then e4m3 with x_scales beside it, and the experts run the
  // FP8 layer (ep_moe_forward: moe.fp8 = kBlock). H % 128 == 0. Combine
  // sends bf16 rows back either way.
  bool fp8_rows = false;
  // The workspace holds no NCCL send / combine slabs ((2W - 2) C rows of H
  // bf16 less, and W - 1 meta slabs): only the direct transport (peers,
  // spec §14.7) may run on it; every rank sets it alike.
  bool direct_only = false;
};

int64_t ep_recv_capacity(const EpShape& shape);  // C

// The direct transport over NVLink (spec §14.7): every rank maps every other
// rank's workspace (CUDA IPC, the handles exchanged once over the
// communicator), and dispatch / combine move the rows with their own kernels:
// the pack writes each row straight into the destination's receive slab, the
// combine reads the rows it sums straight from the ranks that computed them,
// and a flag per (rank, peer) in each workspace orders the two sides. No NCCL
// call and no host sync per dispatch or combine, in either sizing (only the
// rows that exist cross), capturable in a CUDA graph.
//
// ep_peers_create is collective (every rank of `comm` calls it, one thread or
// process per rank, with its own workspace of the same shape; a rank whose
// shape differs fails every rank) and synchronises `stream`: a set-up step,
// refused on a capturing stream. The workspace must be device memory of the
// current GPU from cudaMalloc (or an allocator built on it) that stays
// allocated until ep_peers_destroy; every GPU must reach every other (peer
// access; kNotSupported otherwise). Pass the result as EpDispatchArgs /
// EpCombineArgs / EpMoeForwardArgs::peers with that workspace
// (ep_moe_forward: its workspace, whose first ep_workspace_size bytes are the
// dispatch's). With peers, on every rank and in the same order, each dispatch
// on a workspace is followed by its combine before the next dispatch; the
// receive view is valid until the combine (peers write into it from their
// next dispatch on), and expert_out is written only between a dispatch and
// its combine. Nothing bounds the device-side wait for a peer that never
// arrives (as with NCCL, a rank that stops calling hangs the others).
struct EpPeers;
Status ep_peers_create(const EpShape& shape, void* workspace, size_t workspace_bytes, ncclComm_t comm,
                       cudaStream_t stream, EpPeers** peers);
// Collective with `comm`: waits for this GPU's work, unmaps and frees
// `peers`, then a barrier over the ranks (on `stream`); after it every rank
// has unmapped every workspace, so each may free its own. With comm null it
// only unmaps (the caller knows every rank is done with the workspaces).
// Null peers: nothing.
Status ep_peers_destroy(EpPeers* peers, ncclComm_t comm, cudaStream_t stream);
size_t ep_workspace_size(const EpShape& shape);  // dispatch + combine (not the experts' own workspace)

// The received rows inside the workspace, valid after ep_dispatch: rows
// [s*C, s*C + counts[s]) of slab s came from rank s, in that rank's token
// order; their k ids (global expert ids) and weights are in ids / weights;
// ids of the rows past counts[s] are -1 (so moe_forward skips them). The
// caller writes its experts' output for those rows into `expert_out` before
// ep_combine: one row per received row, already summed over the row's local
// slots (moe_forward with this rank's expert range does exactly this).
struct EpRecvView {
  int64_t rows = 0;             // W * C
  void* x = nullptr;            // bf16 [W*C, H] (fp8_rows: e4m3 codes, one byte each)
  float* x_scales = nullptr;    // fp8_rows: fp32 [W*C, H / 128]; else null
  int32_t* ids = nullptr;       // [W*C, k]
  float* weights = nullptr;     // [W*C, k]
  int32_t* counts = nullptr;    // [W] (device): rows received from each rank, <= C
  void* expert_out = nullptr;   // bf16 [W*C, H], written by the caller's experts
};
EpRecvView ep_recv_view(const EpShape& shape, void* workspace);

struct EpDispatchArgs {
  EpShape shape;
  int64_t num_tokens = 0;                  // T on this rank, 0..max_tokens_per_rank
  const void* X = nullptr;                 // bf16 [T, x_stride], 16-byte aligned
  int64_t x_stride = 0;                    // 0 means H; a multiple of 8
  const int32_t* topk_ids = nullptr;       // [T, k] global ids; an id outside [0, E) goes nowhere
  const float* topk_weights = nullptr;     // [T, k]
  int32_t* dropped = nullptr;              // optional (device, int32): this rank's (token, rank) pairs past C
  const EpPeers* peers = nullptr;          // the direct transport (made for this workspace); null: NCCL
};
Status ep_dispatch(const EpDispatchArgs& args, ncclComm_t comm, void* workspace, size_t workspace_bytes,
                   cudaStream_t stream);

// After ep_dispatch and the caller's experts (EpRecvView::expert_out):
//   out[t] = sum over ranks d in order 0..W-1 that t was sent to of
//            expert_out_d[row of t on d] (fp32 sum, one rounding) + shared_output[t]
// A token sent nowhere gets 0 (+ shared_output); one that overflowed gets NaN.
struct EpCombineArgs {
  EpShape shape;
  int64_t num_tokens = 0;                // the same T as the dispatch
  const void* shared_output = nullptr;   // bf16 [T, shared_stride] or null
  int64_t shared_stride = 0;             // 0 means H
  void* out = nullptr;                   // bf16 [T, out_stride]
  int64_t out_stride = 0;                // 0 means H
  const EpPeers* peers = nullptr;        // as the dispatch's
};
Status ep_combine(const EpCombineArgs& args, ncclComm_t comm, void* workspace, size_t workspace_bytes,
                  cudaStream_t stream);

// Dispatch, this rank's experts (moe_forward over the received rows), combine.
// `moe` holds the expert weights of this rank (E_local = E / W of them, as
// moe_forward takes them), the activation, the FC2 mode, FP8 settings, b2;
// its num_tokens, hidden, k, num_experts, expert range, X, routing, fill,
// shared_output and out fields are set here from the arguments below.
struct EpMoeForwardArgs {
  EpShape shape;
  int64_t num_tokens = 0;               // this rank's T
  const void* X = nullptr;              // bf16 [T, x_stride]
  int64_t x_stride = 0;
  const int32_t* topk_ids = nullptr;    // [T, k] (the router ran already)
  const float* topk_weights = nullptr;  // [T, k]
  MoeForwardArgs moe;                   // weights and settings (see above); inter = I
  const void* shared_output = nullptr;  // bf16 [T, shared_stride] or null
  int64_t shared_stride = 0;
  void* out = nullptr;                  // bf16 [T, out_stride]
  int64_t out_stride = 0;
  int32_t* dropped = nullptr;           // as EpDispatchArgs::dropped
  const EpPeers* peers = nullptr;       // the direct transport, made for this call's workspace; null: NCCL
};
size_t ep_moe_forward_workspace_size(const EpMoeForwardArgs& args);
Status ep_moe_forward(const EpMoeForwardArgs& args, ncclComm_t comm, void* workspace, size_t workspace_bytes,
                      cudaStream_t stream);

// ---------------------------------------------------------------------------
// CPU reference (spec §14.5): every rank of the all-to-all way simulated in
// one process, written from the spec. `plan` is what dispatch decides for one
// rank's tokens: for destination d and token t, the row in d's slab from this
// rank, or -1 (not sent); counts[d] before the capacity cut.
struct EpPlanCpu {
  std::vector<int32_t> row;     // [W, T]: row[d*T + t]
  std::vector<int64_t> counts;  // [W]
  int64_t dropped = 0;          // (token, d) pairs with row >= C
};
EpPlanCpu ep_plan_cpu(const EpShape& shape, int64_t num_tokens, const int32_t* topk_ids);

}  // namespace flashmix
