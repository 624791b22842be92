// flashmix_ep's insides (spec §14): the workspace layout every rank derives
// from the same EpShape, and the four kernels of the all-to-all way. The
// kernels move bytes between this rank's buffers only; ep.cpp adds the NCCL
// transport between them, and the one-GPU loopback test plays the transport
// with copies.
//
//   dispatch: plan (rows per destination) -> pack (rows + meta into the send
//             slabs; this rank's own rows straight into its receive slab)
//             -> transport -> unpack (meta -> ids / weights / counts)
//   combine:  transport (expert_out slabs back to their owners)
//             -> reduce (each token's rows summed in rank order)
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "flashmix/ep.h"

namespace flashmix::ep {

constexpr const char* kDispatchOp = "ep_dispatch";
constexpr const char* kCombineOp = "ep_combine";
constexpr const char* kForwardOp = "ep_moe_forward";

// A meta slab: a 16-byte header (int32 count of rows the source meant to
// send, before the capacity cut) then C rows of k int32 ids + k fp32 weights
// (+ with fp8_rows the row's H / 128 fp32 scales).
constexpr size_t kMetaHeaderBytes = 16;
inline int64_t scale_cols(const EpShape& s) { return s.fp8_rows ? s.hidden / 128 : 0; }
inline size_t meta_row_bytes(const EpShape& s) { return size_t(s.k) * 8 + size_t(scale_cols(s)) * 4; }
// Bytes of a dispatched row: bf16, or e4m3 with fp8_rows.
inline size_t in_row_bytes(const EpShape& s) { return size_t(s.hidden) * (s.fp8_rows ? 1 : 2); }

inline size_t align256(size_t x) { return (x + 255) & ~size_t(255); }

#if defined(__CUDACC__)
#define FLASHMIX_EP_HOST_DEVICE __host__ __device__
#else
#define FLASHMIX_EP_HOST_DEVICE
#endif

// The slab of peer d among this rank's W - 1 peers (send and combine buffers
// hold no slab for the rank itself).
FLASHMIX_EP_HOST_DEVICE inline int peer_slot(int d, int rank) { return d < rank ? d : d - 1; }

struct Layout {
  int64_t C = 0;            // recv_capacity
  int64_t T_max = 0;        // max_tokens_per_rank
  size_t meta_stride = 0;   // bytes between meta slabs
  size_t in_stride = 0;     // bytes between dispatched row slabs (C rows of in_row_bytes, back to back)
  size_t rows_stride = 0;   // bytes between bf16 row slabs of the experts' output (C * H * 2, back to back)
  // Byte offsets into the workspace.
  size_t x_q = 0;           // fp8_rows: e4m3 [T_max, H], this rank's X quantised
  size_t x_q_scales = 0;    // fp8_rows: fp32 [T_max, H / 128]
  size_t plan_row = 0;      // int32 [W, T_max]: row of token t in d's slab, or -1
  size_t plan_counts = 0;   // int32 [W]: rows for d before the cut
  size_t send_meta = 0;     // (W-1) meta slabs
  size_t send_rows = 0;     // (W-1) row slabs
  size_t recv_meta = 0;     // W meta slabs
  size_t recv_x = 0;        // [W*C, H] bf16 (fp8_rows: e4m3)
  size_t recv_x_scales = 0; // fp8_rows: fp32 [W*C, H / 128]
  size_t recv_ids = 0;      // int32 [W*C, k]
  size_t recv_weights = 0;  // fp32 [W*C, k]
  size_t recv_counts = 0;   // int32 [W]
  size_t expert_out = 0;    // bf16 [W*C, H]
  size_t comb_rows = 0;     // (W-1) row slabs: expert_out rows back from each peer
  size_t sync = 0;          // the direct transport's flags (SyncWords)
  size_t total = 0;
};

// The direct transport's words in each workspace (uint64, zeroed by
// ep_peers_create): flag[kind][s] is the last call of that kind for which
// rank s has announced (dispatch: its rows and meta are in this rank's
// receive slab s; combine: its expert_out is complete); epoch[kind] counts
// this rank's calls of that kind; done[kind] counts the blocks of the
// one-kernel (fused) form that have finished their part of the current call
// (the last one resets it to 0 and advances the epoch).
enum SyncKind { kSyncDispatch = 0, kSyncCombine = 1 };
FLASHMIX_EP_HOST_DEVICE inline size_t sync_flag_offset(int world, SyncKind kind, int s) {
  return (size_t(kind) * size_t(world) + size_t(s)) * 8;
}
FLASHMIX_EP_HOST_DEVICE inline size_t sync_epoch_offset(int world, SyncKind kind) {
  return (2 * size_t(world) + size_t(kind)) * 8;
}
FLASHMIX_EP_HOST_DEVICE inline size_t sync_done_offset(int world, SyncKind kind) {
  return (2 * size_t(world) + 2 + size_t(kind)) * 8;
}
inline size_t sync_bytes(int world) { return (2 * size_t(world) + 4) * 8; }

// The direct transport's one-kernel forms (spec §14.7): dispatch as a single
// kernel (plan, pack, handshake and unpack) and combine as a single kernel
// (handshake and reduce), for decode-sized calls. One block a token, and the
// plan of every token in each block's shared memory: T <= kFusedMaxTokens,
// and a token's destinations as one 64-bit mask: W <= kFusedMaxWorld.
// The last block to finish unpacks all W C received rows, so the fused
// dispatch is taken only while that is small: W C <= kFusedMaxUnpackRows.
constexpr int64_t kFusedMaxTokens = 128;
constexpr int kFusedMaxWorld = 64;
constexpr int64_t kFusedMaxUnpackRows = 4096;
// Whether a call of T tokens on this shape takes the fused forms (the caller
// has the direct transport): T, W and W C within the bounds above.
// FLASHMIX_EP_DIRECT_KERNELS=split pins the kernel-per-step form (A/Bs and
// its tests); =fused lifts the W C bound.
bool use_fused_direct(const EpShape& s, int64_t T);

// What the kernels need to reach other ranks' workspaces: the device array
// of every rank's workspace base as mapped here ([W]; entry `rank` is this
// workspace), or null for the NCCL transport (rows go to the send slabs).
struct PeerBases {
  char* const* ws = nullptr;
};

// Valid only for a shape that passed check_shape.
Layout layout(const EpShape& s);

// The direct transport of one workspace (ep_peers.cpp). `peers` may be null
// (the NCCL transport) unless shape.direct_only: then the bases are null.
// Otherwise it must have been made for this shape and this workspace.
Status check_peers(const char* op, const EpPeers* peers, const EpShape& s, const void* workspace);
PeerBases peer_bases(const EpPeers* peers);

// The caller's workspace: at least `needed` bytes (what `size_query` answers),
// not null, 256-byte aligned. Every entry point's check.
Status check_workspace(const char* op, const void* ws, size_t bytes, size_t needed, const char* size_query);

// Host checks shared by every entry point (spec §14.6). `comm` may be null
// (the size queries and the loopback); when given, its rank and size must
// match the shape.
Status check_shape(const char* op, const EpShape& s, ncclComm_t comm);

// The kernels. ws is the workspace base; each returns the launch error.
// plan: zeroes nothing it does not own; writes plan_row, plan_counts, every
// meta header; adds this rank's cut pairs to *dropped (when not null; the
// caller zeroed it on the stream).
// With peers, plan and pack write the meta headers, meta rows and rows for
// rank d straight into d's receive slab `rank` (through peers.ws[d]).
cudaError_t launch_plan(const EpShape& s, const Layout& l, char* ws, PeerBases peers, int64_t T, const int32_t* ids,
                        int32_t* dropped, cudaStream_t stream);
// X: [T, x_stride] of in_row_bytes rows (bf16, or fp8_rows' e4m3 with x_scales [T, H / 128]).
cudaError_t launch_pack(const EpShape& s, const Layout& l, char* ws, PeerBases peers, int64_t T, const void* X,
                        int64_t x_stride_bytes, const float* x_scales, const int32_t* ids, const float* weights,
                        cudaStream_t stream);
cudaError_t launch_unpack(const EpShape& s, const Layout& l, char* ws, cudaStream_t stream);
// With peers the rows are read from the ranks that computed them (their
// expert_out slab `rank`), else from this rank's combine slabs.
cudaError_t launch_combine_reduce(const EpShape& s, const Layout& l, const char* ws, PeerBases peers, int64_t T,
                                  const void* shared, int64_t shared_stride, void* out, int64_t out_stride,
                                  cudaStream_t stream);
// The direct transport's handshake of one call of `kind`: this rank's epoch
// of that kind + 1 is stored (release, system scope) into flag[kind][rank] of
// every peer, then each peer's flag here is awaited (acquire) and the epoch
// advanced. Everything this rank wrote to peers before it (stream order) is
// visible to them when they pass theirs.
cudaError_t launch_handshake(const EpShape& s, const Layout& l, char* ws, PeerBases peers, SyncKind kind,
                             cudaStream_t stream);

// The fused forms (use_fused_direct): dispatch_fused does launch_plan +
// launch_pack + launch_handshake(kSyncDispatch) + launch_unpack (and stores
// *dropped itself: no zeroing before it); combine_fused does
// launch_handshake(kSyncCombine) + launch_combine_reduce. X as launch_pack's.
cudaError_t launch_dispatch_fused(const EpShape& s, const Layout& l, char* ws, PeerBases peers, int64_t T,
                                  const void* X, int64_t x_stride_bytes, const float* x_scales, const int32_t* ids,
                                  const float* weights, int32_t* dropped, cudaStream_t stream);
cudaError_t launch_combine_fused(const EpShape& s, const Layout& l, char* ws, PeerBases peers, int64_t T,
                                 const void* shared, int64_t shared_stride, void* out, int64_t out_stride,
                                 cudaStream_t stream);

// Way 1 (ep_finalize_reduce): the summed fp32 partial -> out_dtype. n % 4 == 0.
cudaError_t launch_convert_from_f32(const float* in, void* out, DType out_dtype, int64_t n, cudaStream_t stream);

}  // namespace flashmix::ep
