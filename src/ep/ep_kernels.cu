// The all-to-all way's kernels (spec §14.3): plan, pack, unpack, combine
// reduce. Rows move as 16-byte words (H % 8 == 0, strides % 8 == 0, 16-byte
// aligned bases: checked on the host).
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>

#include "common/vec.cuh"
#include "ep/ep_internal.h"

namespace flashmix::ep {

namespace {

constexpr int kPlanThreads = 512;
constexpr int kPlanItems = 4;  // consecutive tokens per thread per pass
constexpr int kRowThreads = 128;

struct Geometry {
  int rank, world, k;
  int e_local;
  int64_t C, T_max, H;
  int scale_cols;      // fp8_rows: H / 128 scales per row (in the meta rows); else 0
  int64_t in_row_vec;  // 16-byte words of a dispatched row
  size_t meta_stride, meta_row, in_stride, rows_stride;
  // Offsets of the regions a peer's kernels reach in this rank's workspace.
  size_t off_recv_meta, off_recv_x, off_expert_out;
  char* const* peers;  // PeerBases::ws: [W] workspace bases, or null (NCCL)
};

Geometry geometry(const EpShape& s, const Layout& l, PeerBases peers = {}) {
  Geometry g;
  g.rank = s.rank;
  g.world = s.world;
  g.k = s.k;
  g.e_local = s.num_experts / s.world;
  g.C = l.C;
  g.T_max = l.T_max;
  g.H = s.hidden;
  g.scale_cols = int(scale_cols(s));
  g.in_row_vec = int64_t(in_row_bytes(s) / 16);
  g.meta_stride = l.meta_stride;
  g.meta_row = meta_row_bytes(s);
  g.in_stride = l.in_stride;
  g.rows_stride = l.rows_stride;
  g.off_recv_meta = l.recv_meta;
  g.off_recv_x = l.recv_x;
  g.off_expert_out = l.expert_out;
  g.peers = peers.ws;
  return g;
}

// The meta slab that holds what this rank sends to d: d's receive slab
// `rank` itself for d == rank or with the direct transport, else the send
// slab of peer d (NCCL moves it).
__device__ __forceinline__ char* meta_slab_for(const Geometry& g, char* send_meta, char* recv_meta, int d) {
  if (g.peers != nullptr) return g.peers[d] + g.off_recv_meta + size_t(g.rank) * g.meta_stride;
  return d == g.rank ? recv_meta + size_t(g.rank) * g.meta_stride
                     : send_meta + size_t(peer_slot(d, g.rank)) * g.meta_stride;
}

// Likewise the row slab for d.
__device__ __forceinline__ char* row_slab_for(const Geometry& g, char* send_rows, char* recv_x, int d) {
  if (g.peers != nullptr) return g.peers[d] + g.off_recv_x + size_t(g.rank) * g.in_stride;
  return d == g.rank ? recv_x + size_t(g.rank) * g.in_stride : send_rows + size_t(peer_slot(d, g.rank)) * g.in_stride;
}

// One block per destination d: token t goes to d when one of its k ids is in
// d's range; its row in d's slab is the number of earlier tokens that go to d
// (a stable, deterministic order).
__global__ void __launch_bounds__(kPlanThreads) plan_kernel(Geometry g, int64_t T, const int32_t* __restrict__ ids,
                                                            int32_t* __restrict__ plan_row,
                                                            int32_t* __restrict__ plan_counts, char* send_meta,
                                                            char* recv_meta, int32_t* dropped) {
  using Scan = cub::BlockScan<int, kPlanThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  const int d = blockIdx.x;
  const int lo = d * g.e_local, hi = lo + g.e_local;
  int64_t carry = 0;
  for (int64_t base = 0; base < T; base += int64_t(kPlanThreads) * kPlanItems) {
    const int64_t t0 = base + int64_t(threadIdx.x) * kPlanItems;
    int flag[kPlanItems];
    int mine = 0;
#pragma unroll
    for (int i = 0; i < kPlanItems; ++i) {
      const int64_t t = t0 + i;
      flag[i] = 0;
      if (t < T) {
        for (int j = 0; j < g.k; ++j) {
          const int e = ids[t * g.k + j];
          flag[i] |= (e >= lo && e < hi);
        }
      }
      mine += flag[i];
    }
    int before = 0, pass_total = 0;
    Scan(scan_storage).ExclusiveSum(mine, before, pass_total);
    int64_t row = carry + before;
#pragma unroll
    for (int i = 0; i < kPlanItems; ++i) {
      const int64_t t = t0 + i;
      if (t < T) plan_row[int64_t(d) * g.T_max + t] = flag[i] ? int32_t(row) : -1;
      row += flag[i];
    }
    carry += pass_total;
    __syncthreads();  // scan_storage is reused by the next pass
  }
  if (threadIdx.x == 0) {
    plan_counts[d] = int32_t(carry);
    *reinterpret_cast<int32_t*>(meta_slab_for(g, send_meta, recv_meta, d)) = int32_t(carry);
    if (dropped != nullptr && carry > g.C) atomicAdd(dropped, int32_t(carry - g.C));
    if (g.peers != nullptr) __threadfence_system();  // the header in d's slab, before the handshake's release
  }
}

// Token t's meta row (its k ids, k weights, with fp8_rows its row's scales)
// at `meta`.
__device__ __forceinline__ void write_meta(const Geometry& g, char* meta, int64_t t, const int32_t* __restrict__ ids,
                                           const float* __restrict__ weights, const float* __restrict__ x_scales) {
  for (int j = 0; j < g.k; ++j) {
    reinterpret_cast<int32_t*>(meta)[j] = ids[t * g.k + j];
    reinterpret_cast<float*>(meta)[g.k + j] = weights[t * g.k + j];
  }
  for (int c = 0; c < g.scale_cols; ++c)
    reinterpret_cast<float*>(meta)[2 * g.k + c] = x_scales[t * g.scale_cols + c];
}

// The block copies 16-byte words [c_lo, c_hi) of one row `src` to the n rows
// dst[]: read once, written n times. With the direct transport each thread's
// stores to peers are then ordered (system fence) before whatever release
// follows.
__device__ __forceinline__ void copy_row(const Geometry& g, const uint4* __restrict__ src, uint4* const* dst, int n,
                                         int64_t c_lo, int64_t c_hi) {
  // kUnroll loads in flight per thread before their stores.
  constexpr int kUnroll = 4;
  int64_t c = c_lo + threadIdx.x;
  for (; c + (kUnroll - 1) * kRowThreads < c_hi; c += kUnroll * kRowThreads) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = src[c + u * kRowThreads];
    for (int i = 0; i < n; ++i)
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) dst[i][c + u * kRowThreads] = v[u];
  }
  for (; c < c_hi; c += kRowThreads) {
    const uint4 v = src[c];
    for (int i = 0; i < n; ++i) dst[i][c] = v;
  }
  if (g.peers != nullptr) __threadfence_system();
}

// One block per token: its k ids and weights, then its row, to every
// destination it goes to (read once, written once per destination).
__global__ void __launch_bounds__(kRowThreads) pack_kernel(Geometry g, const int32_t* __restrict__ plan_row,
                                                           const uint4* __restrict__ X, int64_t x_stride_vec,
                                                           const float* __restrict__ x_scales,
                                                           const int32_t* __restrict__ ids,
                                                           const float* __restrict__ weights, char* send_meta,
                                                           char* recv_meta, char* send_rows, char* recv_x) {
  extern __shared__ uint4* dst_rows[];  // [W]: destination row pointers, in rank order
  __shared__ int num_dst;
  const int64_t t = blockIdx.x;
  if (threadIdx.x == 0) {
    int n = 0;
    for (int d = 0; d < g.world; ++d) {
      const int32_t row = plan_row[int64_t(d) * g.T_max + t];
      if (row < 0 || row >= g.C) continue;  // not sent, or past the capacity (counted by the plan)
      write_meta(g, meta_slab_for(g, send_meta, recv_meta, d) + kMetaHeaderBytes + size_t(row) * g.meta_row, t, ids,
                 weights, x_scales);
      dst_rows[n++] = reinterpret_cast<uint4*>(row_slab_for(g, send_rows, recv_x, d)) + int64_t(row) * g.in_row_vec;
    }
    num_dst = n;
  }
  __syncthreads();
  // Direct transport: copy_row's system fence orders this thread's stores to
  // peers before the handshake's release (the next kernel).
  copy_row(g, X + t * x_stride_vec, dst_rows, num_dst, 0, g.in_row_vec);
}

// Received row r (of W C): ids and weights out of the meta slabs; rows past
// what arrived get id -1 (so the experts skip them) and weight 0.
__device__ __forceinline__ void unpack_row(const Geometry& g, int64_t r, const char* __restrict__ recv_meta,
                                           int32_t* __restrict__ recv_ids, float* __restrict__ recv_weights,
                                           int32_t* __restrict__ recv_counts, float* __restrict__ recv_x_scales) {
  const int s = int(r / g.C);
  const int64_t i = r - int64_t(s) * g.C;
  const char* slab = recv_meta + size_t(s) * g.meta_stride;
  const int64_t sent = *reinterpret_cast<const int32_t*>(slab);
  const int64_t count = sent < g.C ? sent : g.C;
  if (i == 0) recv_counts[s] = int32_t(count);
  int32_t* out_ids = recv_ids + r * g.k;
  float* out_w = recv_weights + r * g.k;
  if (i < count) {
    const char* meta = slab + kMetaHeaderBytes + size_t(i) * g.meta_row;
    for (int j = 0; j < g.k; ++j) {
      out_ids[j] = reinterpret_cast<const int32_t*>(meta)[j];
      out_w[j] = reinterpret_cast<const float*>(meta)[g.k + j];
    }
    for (int c = 0; c < g.scale_cols; ++c)
      recv_x_scales[r * g.scale_cols + c] = reinterpret_cast<const float*>(meta)[2 * g.k + c];
  } else {
    for (int j = 0; j < g.k; ++j) {
      out_ids[j] = -1;
      out_w[j] = 0.f;
    }
  }
}

// One thread per received row (unpack_row).
__global__ void unpack_kernel(Geometry g, const char* __restrict__ recv_meta, int32_t* __restrict__ recv_ids,
                              float* __restrict__ recv_weights, int32_t* __restrict__ recv_counts,
                              float* __restrict__ recv_x_scales) {
  const int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r < g.world * g.C) unpack_row(g, r, recv_meta, recv_ids, recv_weights, recv_counts, recv_x_scales);
}

__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const uint4& v) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    acc[2 * i] += f.x;
    acc[2 * i + 1] += f.y;
  }
}

// The block sums 16-byte words [c_lo, c_hi) of token t: the rows its ranks
// sent back, in rank order in fp32, + shared_output, one rounding. A token cut
// by the capacity gets NaN. src_rows: [W] pointers in shared memory.
__device__ __forceinline__ void combine_token(const Geometry& g, int64_t t, const int32_t* __restrict__ plan_row,
                                              const char* expert_out, const char* comb_rows,
                                              const uint4* __restrict__ shared, int64_t shared_stride_vec,
                                              uint4* __restrict__ out, int64_t out_stride_vec, const uint4** src_rows,
                                              int64_t c_lo, int64_t c_hi) {
  __shared__ int num_src;
  __shared__ int cut;
  const int64_t nvec = g.H / 8;
  if (threadIdx.x == 0) {
    int n = 0, c = 0;
    for (int d = 0; d < g.world; ++d) {
      const int32_t row = plan_row[int64_t(d) * g.T_max + t];
      if (row < 0) continue;
      if (row >= g.C) {
        c = 1;
        continue;
      }
      // Direct transport: rank d's expert_out slab `rank` itself.
      const char* slab = g.peers != nullptr ? g.peers[d] + g.off_expert_out + size_t(g.rank) * g.rows_stride
                         : d == g.rank      ? expert_out + size_t(g.rank) * g.rows_stride
                                            : comb_rows + size_t(peer_slot(d, g.rank)) * g.rows_stride;
      src_rows[n++] = reinterpret_cast<const uint4*>(slab) + int64_t(row) * nvec;
    }
    num_src = n;
    cut = c;
  }
  __syncthreads();
  const int n = num_src;
  const float nan_or_zero = cut ? __int_as_float(0x7fc00000) : 0.f;
  // Two column vectors per step, and up to kInFlight ranks' rows loaded
  // before they are added: their loads in flight together (the peers' rows
  // come over NVLink); each vector's sum still runs over the ranks in order.
  constexpr int kInFlight = 4;
  for (int64_t c0 = c_lo + threadIdx.x; c0 < c_hi; c0 += 2 * kRowThreads) {
    const int64_t c1 = c0 + kRowThreads;
    const bool two = c1 < c_hi;
    float acc0[8], acc1[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc0[i] = acc1[i] = nan_or_zero;
    for (int i0 = 0; i0 < n; i0 += kInFlight) {
      uint4 a[kInFlight], b[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        a[u] = i0 + u < n ? src_rows[i0 + u][c0] : uint4{};
        b[u] = i0 + u < n && two ? src_rows[i0 + u][c1] : uint4{};
      }
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        if (i0 + u < n) {
          add_bf16x8(acc0, a[u]);
          add_bf16x8(acc1, b[u]);
        }
      }
    }
    if (shared != nullptr) {
      add_bf16x8(acc0, shared[t * shared_stride_vec + c0]);
      if (two) add_bf16x8(acc1, shared[t * shared_stride_vec + c1]);
    }
    uint4 o0, o1;
    __nv_bfloat162* h0 = reinterpret_cast<__nv_bfloat162*>(&o0);
    __nv_bfloat162* h1 = reinterpret_cast<__nv_bfloat162*>(&o1);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      h0[i] = __floats2bfloat162_rn(acc0[2 * i], acc0[2 * i + 1]);
      h1[i] = __floats2bfloat162_rn(acc1[2 * i], acc1[2 * i + 1]);
    }
    out[t * out_stride_vec + c0] = o0;
    if (two) out[t * out_stride_vec + c1] = o1;
  }
}

// One block per token (combine_token).
__global__ void __launch_bounds__(kRowThreads) combine_kernel(Geometry g, const int32_t* __restrict__ plan_row,
                                                              const char* expert_out, const char* comb_rows,
                                                              const uint4* __restrict__ shared,
                                                              int64_t shared_stride_vec, uint4* __restrict__ out,
                                                              int64_t out_stride_vec) {
  extern __shared__ const uint4* src_rows[];  // [W]
  combine_token(g, blockIdx.x, plan_row, expert_out, comb_rows, shared, shared_stride_vec, out, out_stride_vec,
                src_rows, 0, g.H / 8);
}

// Lane d (< W, != rank) of the calling warp publishes `call` into rank d's
// flag[kind][rank] with a system-scope release after a system fence, so every
// store this rank made before (the pack's rows into d's slab, or the experts'
// expert_out that d will read) is visible to d once d sees the flag.
__device__ __forceinline__ void announce(int world, int rank, char* const* peers, size_t off_sync, SyncKind kind,
                                         uint64_t call) {
  __threadfence_system();
  for (int d = int(threadIdx.x % 32); d < world; d += 32) {
    if (d == rank) continue;
    uint64_t* flag = reinterpret_cast<uint64_t*>(peers[d] + off_sync + sync_flag_offset(world, kind, rank));
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(flag), "l"(call) : "memory");
  }
}

// Lane d (< W, != rank) of the calling warp waits (acquire) until peer d's
// flag[kind][d] in this rank's sync words `mine` reaches `call`.
__device__ __forceinline__ void await_peers(int world, int rank, const char* mine, SyncKind kind, uint64_t call) {
  for (int d = int(threadIdx.x % 32); d < world; d += 32) {
    if (d == rank) continue;
    const uint64_t* flag = reinterpret_cast<const uint64_t*>(mine + sync_flag_offset(world, kind, d));
    uint64_t seen;
    for (;;) {
      asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(seen) : "l"(flag) : "memory");
      if (seen >= call) break;
      __nanosleep(64);
    }
  }
  __syncwarp();
}

// This rank's next call of `kind` (its epoch + 1), and the epoch advanced to
// it once the call's handshake is through.
__device__ __forceinline__ uint64_t next_call(const char* mine, int world, SyncKind kind) {
  return *reinterpret_cast<const volatile uint64_t*>(mine + sync_epoch_offset(world, kind)) + 1;
}
__device__ __forceinline__ void advance_epoch(char* mine, int world, SyncKind kind, uint64_t call) {
  *reinterpret_cast<volatile uint64_t*>(mine + sync_epoch_offset(world, kind)) = call;
}

// One warp: this call (epoch + 1) announced to every peer, every peer's
// awaited, then lane 0 advances the epoch.
__global__ void handshake_kernel(int world, int rank, char* const* peers, size_t off_sync, SyncKind kind) {
  char* mine = peers[rank] + off_sync;
  const uint64_t call = next_call(mine, world, kind);
  announce(world, rank, peers, off_sync, kind, call);
  await_peers(world, rank, mine, kind, call);
  if (threadIdx.x == 0) advance_epoch(mine, world, kind, call);
}

// Whether this block is the last of the grid to finish its part of a fused
// call: every thread's stores are ordered before its block's count (system
// fences on both sides, as the classic last-block reduction); the last block
// resets the count for the next call (no block of this call touches it again).
__device__ __forceinline__ bool last_block_done(char* mine, int world, SyncKind kind) {
  __shared__ int last;
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned int* done = reinterpret_cast<unsigned int*>(mine + sync_done_offset(world, kind));
    const unsigned int before = atomicAdd(done, 1u);
    last = before == gridDim.x * gridDim.y - 1;
    if (last) {
      *reinterpret_cast<volatile unsigned int*>(done) = 0;
      __threadfence_system();
    }
  }
  __syncthreads();
  return last != 0;
}

// The fused kernels split a row over blocks of kFusedPartVecs 16-byte words
// (blockIdx.y), so that a decode call has enough blocks to keep the
// links' latency covered.
constexpr int64_t kFusedPartVecs = 2 * kRowThreads;

// The fused dispatch (direct transport, T <= kFusedMaxTokens, W <=
// kFusedMaxWorld): blocks (token, part of its row) (one block when T == 0).
//  1. every token's destinations as a bit mask, in shared memory;
//  2. thread d: the token's row in d's slab (the earlier tokens that go to d,
//     plan_kernel's order); part 0 writes it and its meta row there; block
//     (0, 0) also d's count (plan counts, d's slab header, the cut rows into
//     *dropped);
//  3. the block's part of the row to each destination (copy_row);
//  4. the last block to finish announces this rank's call to every peer,
//     awaits theirs, advances the epoch and unpacks the W C received rows.
// Only the last block waits, so the blocks never wait on each other's
// residency.
__global__ void __launch_bounds__(kRowThreads) dispatch_fused_kernel(
    Geometry g, int64_t T, const int32_t* __restrict__ ids, const float* __restrict__ weights,
    const uint4* __restrict__ X, int64_t x_stride_vec, const float* __restrict__ x_scales,
    int32_t* __restrict__ plan_row, int32_t* __restrict__ plan_counts, int32_t* dropped, size_t off_sync,
    char* __restrict__ recv_meta, int32_t* __restrict__ recv_ids, float* __restrict__ recv_weights,
    int32_t* __restrict__ recv_counts, float* __restrict__ recv_x_scales) {
  __shared__ uint64_t dest_mask[kFusedMaxTokens];
  __shared__ uint4* dst_rows[kFusedMaxWorld];
  __shared__ int32_t row_of[kFusedMaxWorld];
  __shared__ int num_dst;
  __shared__ int cut_rows;
  __shared__ uint64_t call;
  char* mine = g.peers[g.rank] + off_sync;
  const int64_t t = blockIdx.x;
  const bool part0 = blockIdx.y == 0;
  const int i = int(threadIdx.x);
  static_assert(kFusedMaxTokens == kRowThreads, "one token's mask a thread");
  {
    uint64_t m = 0;
    if (i < T) {
      const int64_t experts = int64_t(g.world) * g.e_local;
      for (int j = 0; j < g.k; ++j) {
        const int e = ids[int64_t(i) * g.k + j];
        if (e >= 0 && e < experts) m |= uint64_t(1) << (e / g.e_local);
      }
    }
    dest_mask[i] = m;
  }
  if (i == 0) {
    call = next_call(mine, g.world, kSyncDispatch);
    cut_rows = 0;
  }
  __syncthreads();
  if (i < g.world) {
    const int d = i;
    int before = 0, total = 0;
    for (int64_t u = 0; u < T; ++u) {
      const int bit = int(dest_mask[u] >> d) & 1;
      before += u < t ? bit : 0;
      total += bit;
    }
    int32_t row = -1;
    if (t < T) {
      row = (dest_mask[t] >> d) & 1 ? int32_t(before) : -1;
      if (part0) plan_row[int64_t(d) * g.T_max + t] = row;
      if (part0 && row >= 0 && row < g.C)
        write_meta(g, meta_slab_for(g, nullptr, nullptr, d) + kMetaHeaderBytes + size_t(row) * g.meta_row, t, ids,
                   weights, x_scales);
    }
    row_of[d] = row;
    if (blockIdx.x == 0 && part0) {
      plan_counts[d] = total;
      *reinterpret_cast<int32_t*>(meta_slab_for(g, nullptr, nullptr, d)) = total;
      if (total > g.C) atomicAdd(&cut_rows, int(total - g.C));
    }
  }
  __syncthreads();
  if (i == 0) {
    if (blockIdx.x == 0 && part0 && dropped != nullptr) *dropped = cut_rows;
    int n = 0;
    for (int d = 0; d < g.world; ++d) {
      const int32_t row = row_of[d];
      if (row >= 0 && row < g.C)
        dst_rows[n++] = reinterpret_cast<uint4*>(row_slab_for(g, nullptr, nullptr, d)) + int64_t(row) * g.in_row_vec;
    }
    num_dst = n;
  }
  __syncthreads();
  const int64_t c_lo = int64_t(blockIdx.y) * kFusedPartVecs;
  if (t < T) copy_row(g, X + t * x_stride_vec, dst_rows, num_dst, c_lo, min(c_lo + kFusedPartVecs, g.in_row_vec));
  if (!last_block_done(mine, g.world, kSyncDispatch)) return;
  if (i < 32) {
    announce(g.world, g.rank, g.peers, off_sync, kSyncDispatch, call);
    await_peers(g.world, g.rank, mine, kSyncDispatch, call);
    if (i == 0) advance_epoch(mine, g.world, kSyncDispatch, call);
  }
  __syncthreads();
  for (int64_t r = i; r < g.world * g.C; r += kRowThreads)
    unpack_row(g, r, recv_meta, recv_ids, recv_weights, recv_counts, recv_x_scales);
}

// The fused combine (direct transport, as dispatch_fused_kernel): blocks
// (token, part of its row) (one when T == 0). Every block announces this rank's call (the
// same value: this rank's expert_out is complete, by stream order) and waits
// for every peer's, so no block waits on another's residency; then it sums
// its token (combine_token); the last block to finish advances the epoch.
__global__ void __launch_bounds__(kRowThreads) combine_fused_kernel(Geometry g, int64_t T,
                                                                    const int32_t* __restrict__ plan_row,
                                                                    size_t off_sync, const uint4* __restrict__ shared,
                                                                    int64_t shared_stride_vec, uint4* __restrict__ out,
                                                                    int64_t out_stride_vec) {
  __shared__ const uint4* src_rows[kFusedMaxWorld];
  char* mine = g.peers[g.rank] + off_sync;
  const uint64_t call = next_call(mine, g.world, kSyncCombine);
  if (threadIdx.x < 32) {
    announce(g.world, g.rank, g.peers, off_sync, kSyncCombine, call);
    await_peers(g.world, g.rank, mine, kSyncCombine, call);
  }
  __syncthreads();
  const int64_t c_lo = int64_t(blockIdx.y) * kFusedPartVecs;
  if (int64_t(blockIdx.x) < T)
    combine_token(g, blockIdx.x, plan_row, nullptr, nullptr, shared, shared_stride_vec, out, out_stride_vec, src_rows,
                  c_lo, min(c_lo + kFusedPartVecs, g.H / 8));
  if (last_block_done(mine, g.world, kSyncCombine) && threadIdx.x == 0)
    advance_epoch(mine, g.world, kSyncCombine, call);
}

// The dynamic shared memory of pack's dst_rows[] / combine's src_rows[] (one
// pointer a rank), rounded up to whole groups of 4: ptxas reads these arrays
// with 16-byte LDS.128s, which at an odd world take the last pointer with the
// 8 bytes after it (compute-sanitizer caught combine's at world 1).
size_t row_pointers_smem_bytes(int world) { return sizeof(void*) * size_t((world + 3) / 4 * 4); }

// n fp32 values -> out_dtype, one rounding each (the fp32 partial's sum).
template <typename Out>
__global__ void convert_kernel(const float4* __restrict__ in, Out* __restrict__ out, int64_t n4) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x) {
    const float4 v = in[i];
    out[4 * i + 0] = dev::from_float<Out>(v.x);
    out[4 * i + 1] = dev::from_float<Out>(v.y);
    out[4 * i + 2] = dev::from_float<Out>(v.z);
    out[4 * i + 3] = dev::from_float<Out>(v.w);
  }
}

}  // namespace

cudaError_t launch_convert_from_f32(const float* in, void* out, DType out_dtype, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int64_t n4 = n / 4;  // n is a multiple of 8 (rows of H % 8 == 0)
  const unsigned blocks = unsigned(std::min<int64_t>((n4 + 255) / 256, 4096));
  const float4* in4 = reinterpret_cast<const float4*>(in);
  switch (out_dtype) {
    case DType::kBFloat16:
      convert_kernel<<<blocks, 256, 0, stream>>>(in4, static_cast<__nv_bfloat16*>(out), n4);
      break;
    case DType::kFloat16:
      convert_kernel<<<blocks, 256, 0, stream>>>(in4, static_cast<__half*>(out), n4);
      break;
    case DType::kFloat32:
      return cudaMemcpyAsync(out, in, size_t(n) * 4, cudaMemcpyDeviceToDevice, stream);
  }
  return cudaGetLastError();
}

cudaError_t launch_plan(const EpShape& s, const Layout& l, char* ws, PeerBases peers, int64_t T, const int32_t* ids,
                        int32_t* dropped, cudaStream_t stream) {
  const Geometry g = geometry(s, l, peers);
  plan_kernel<<<s.world, kPlanThreads, 0, stream>>>(
      g, T, ids, reinterpret_cast<int32_t*>(ws + l.plan_row), reinterpret_cast<int32_t*>(ws + l.plan_counts),
      ws + l.send_meta, ws + l.recv_meta, dropped);
  return cudaGetLastError();
}

cudaError_t launch_pack(const EpShape& s, const Layout& l, char* ws, PeerBases peers, int64_t T, const void* X,
                        int64_t x_stride_bytes, const float* x_scales, const int32_t* ids, const float* weights,
                        cudaStream_t stream) {
  if (T == 0) return cudaSuccess;
  const Geometry g = geometry(s, l, peers);
  pack_kernel<<<unsigned(T), kRowThreads, row_pointers_smem_bytes(s.world), stream>>>(
      g, reinterpret_cast<const int32_t*>(ws + l.plan_row), static_cast<const uint4*>(X), x_stride_bytes / 16,
      x_scales, ids, weights, ws + l.send_meta, ws + l.recv_meta, ws + l.send_rows, ws + l.recv_x);
  return cudaGetLastError();
}

cudaError_t launch_unpack(const EpShape& s, const Layout& l, char* ws, cudaStream_t stream) {
  const Geometry g = geometry(s, l);
  const int64_t rows = int64_t(s.world) * l.C;
  constexpr int kThreads = 256;
  unpack_kernel<<<unsigned((rows + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      g, ws + l.recv_meta, reinterpret_cast<int32_t*>(ws + l.recv_ids), reinterpret_cast<float*>(ws + l.recv_weights),
      reinterpret_cast<int32_t*>(ws + l.recv_counts), reinterpret_cast<float*>(ws + l.recv_x_scales));
  return cudaGetLastError();
}

cudaError_t launch_combine_reduce(const EpShape& s, const Layout& l, const char* ws, PeerBases peers, int64_t T,
                                  const void* shared, int64_t shared_stride, void* out, int64_t out_stride,
                                  cudaStream_t stream) {
  if (T == 0) return cudaSuccess;
  const Geometry g = geometry(s, l, peers);
  combine_kernel<<<unsigned(T), kRowThreads, row_pointers_smem_bytes(s.world), stream>>>(
      g, reinterpret_cast<const int32_t*>(ws + l.plan_row), ws + l.expert_out, ws + l.comb_rows,
      static_cast<const uint4*>(shared), shared_stride / 8, static_cast<uint4*>(out), out_stride / 8);
  return cudaGetLastError();
}

bool use_fused_direct(const EpShape& s, int64_t T) {
  const char* pin = std::getenv("FLASHMIX_EP_DIRECT_KERNELS");
  if (pin != nullptr && std::strcmp(pin, "split") == 0) return false;
  const bool lifted = pin != nullptr && std::strcmp(pin, "fused") == 0;
  return T <= kFusedMaxTokens && s.world <= kFusedMaxWorld &&
         (lifted || int64_t(s.world) * ep_recv_capacity(s) <= kFusedMaxUnpackRows);
}

cudaError_t launch_dispatch_fused(const EpShape& s, const Layout& l, char* ws, PeerBases peers, int64_t T,
                                  const void* X, int64_t x_stride_bytes, const float* x_scales, const int32_t* ids,
                                  const float* weights, int32_t* dropped, cudaStream_t stream) {
  const Geometry g = geometry(s, l, peers);
  const dim3 grid(unsigned(std::max<int64_t>(T, 1)), unsigned((g.in_row_vec + kFusedPartVecs - 1) / kFusedPartVecs));
  dispatch_fused_kernel<<<grid, kRowThreads, 0, stream>>>(
      g, T, ids, weights, static_cast<const uint4*>(X), x_stride_bytes / 16, x_scales,
      reinterpret_cast<int32_t*>(ws + l.plan_row), reinterpret_cast<int32_t*>(ws + l.plan_counts), dropped, l.sync,
      ws + l.recv_meta, reinterpret_cast<int32_t*>(ws + l.recv_ids), reinterpret_cast<float*>(ws + l.recv_weights),
      reinterpret_cast<int32_t*>(ws + l.recv_counts), reinterpret_cast<float*>(ws + l.recv_x_scales));
  return cudaGetLastError();
}

cudaError_t launch_combine_fused(const EpShape& s, const Layout& l, char* ws, PeerBases peers, int64_t T,
                                 const void* shared, int64_t shared_stride, void* out, int64_t out_stride,
                                 cudaStream_t stream) {
  const Geometry g = geometry(s, l, peers);
  const dim3 grid(unsigned(std::max<int64_t>(T, 1)), unsigned((g.H / 8 + kFusedPartVecs - 1) / kFusedPartVecs));
  combine_fused_kernel<<<grid, kRowThreads, 0, stream>>>(
      g, T, reinterpret_cast<const int32_t*>(ws + l.plan_row), l.sync, static_cast<const uint4*>(shared),
      shared_stride / 8, static_cast<uint4*>(out), out_stride / 8);
  return cudaGetLastError();
}

cudaError_t launch_handshake(const EpShape& s, const Layout& l, char*, PeerBases peers, SyncKind kind,
                             cudaStream_t stream) {
  handshake_kernel<<<1, 32, 0, stream>>>(s.world, s.rank, peers.ws, l.sync, kind);
  return cudaGetLastError();
}

}  // namespace flashmix::ep
