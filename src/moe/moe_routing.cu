// MoE routing maps on the GPU (spec §1).
//
// Math: a slot s = j*T + t is local when e = experts[t*k + j] - start lies in
// [0, E_local). The local slots are sorted by e, stably in s (a counting sort):
//   expert_first_token_offset[e] = number of local slots with expert < e
//   p = offset[e] + #{local s' < s with the same e}
//   unpermuted_row_to_permuted_row[s] = p (or -1),  permuted_row_to_unpermuted_row[p] = s
//   permuted_input[p, :] = input[t, :]                         (optional)
//   or its e4m3 codes and 1 x 128 scales (the FP8 expansion, optional)
//
// Paths (chosen on the host from k*T only, see moe_routing_plan.h):
//   single block (k*T <= 2048 by default, decode): one launch counts, scans
//     and scatters, everything in shared memory.
//   multi (prefill): count per segment -> stable scatter per segment, each
//     scatter block scanning the counts itself (two launches, while the
//     counts are at most 16K: MoeRoutingPlan::scatter_scans), or a one-block
//     scan over (segment, expert) between them (three). Chained with PDL.
// Ranking inside a block: each warp takes 32 consecutive slots; one ballot per
// key bit gives the lanes with the same expert, so a slot's rank is the number of its
// lower peers plus the counts of the same expert in lower warps (shared
// memory) plus the running count of earlier steps. No sort, no atomics on
// the rank itself, and the order is fully defined: bitwise repeatable.
//
// Roofline: the maps move 4 bytes read + 8 bytes written per slot (k*T*12 B,
// 0.8 MB at T=8192, k=8): a few hundred ns at HBM speed, so the maps are
// latency-bound (launches and the dependent scan). The expansion moves
// (T' + P)*H elements, T' the tokens with a local slot (one read of each such
// input row, one write per local slot) and is
// bandwidth-bound: it should reach the device copy bandwidth.
#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include <cub/block/block_scan.cuh>
#include <cuda_runtime.h>

#include "common/check.h"
#include "common/kernel_fit.h"
#include "common/launch.cuh"
#include "common/reduce.cuh"
#include "common/vec.cuh"
#include "flashmix/moe.h"
#include "fp8/quantize_fp8_device.cuh"
#include "moe/moe_routing_plan.h"

namespace flashmix {
namespace {

constexpr const char* kOp = "build_moe_routing_maps";
constexpr int kThreads = detail::kRoutingThreads;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxItems = detail::kRoutingMaxItems;

// Keys: the local expert, -1 for a non-local slot, -2 for a lane past the end.
constexpr int kNotLocal = -1;
constexpr int kPastEnd = -2;

// The lanes of this warp holding the same key. Built from one ballot per key
// bit (the keys lie in [-2, E), so E + 2 values), as CUB's radix-rank-match
// does. The first version used __match_any_sync and spent about 2 us per
// 512-slot step in one block (H200); ballots cost a few cycles each.
// `bits` is warp-uniform.
__device__ __forceinline__ unsigned warp_peers(int key, int bits) {
  const unsigned v = unsigned(key + 2);
  unsigned peers = dev::kFullMask;
  for (int b = 0; b < bits; ++b) {
    const unsigned set = __ballot_sync(dev::kFullMask, (v >> b) & 1u);
    peers &= ((v >> b) & 1u) ? set : ~set;
  }
  return peers;
}

struct SlotSource {
  const int32_t* experts;  // [T, k]
  int32_t T;
  int32_t k;
  int32_t start;
  int32_t E;
  int32_t slots;  // k*T
  int32_t key_bits;  // bits of key + 2, key in [-2, E)
};

__device__ __forceinline__ int load_key(const SlotSource& src, int64_t s) {
  if (s >= src.slots) return kPastEnd;
  const int32_t j = int32_t(s) / src.T, t = int32_t(s) - j * src.T;
  const int32_t e = __ldg(src.experts + int64_t(t) * src.k + j);
  // Unsigned difference: any int32 id (negative too) below start wraps past E.
  const uint32_t local = uint32_t(e) - uint32_t(src.start);
  return local < uint32_t(src.E) ? int(local) : kNotLocal;
}

// Loads the expert keys of one segment (items steps of kThreads slots) into registers.
__device__ __forceinline__ void load_segment(const SlotSource& src, int64_t seg_start, int items,
                                             int (&keys)[kMaxItems]) {
#pragma unroll
  for (int i = 0; i < kMaxItems; ++i)
    keys[i] = i < items ? load_key(src, seg_start + int64_t(i) * kThreads + threadIdx.x) : kPastEnd;
}

// Adds the segment's local slots into hist[E] (shared), one atomic per
// (warp, expert) rather than per slot: all-to-one-expert routing stays cheap.
__device__ __forceinline__ void count_segment(const int (&keys)[kMaxItems], int items, int key_bits, int* hist) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < kMaxItems; ++i) {
    if (i >= items) break;
    const unsigned peers = warp_peers(keys[i], key_bits);
    const bool leader = (peers >> lane) == 1u;  // highest lane of its group
    if (leader && keys[i] >= 0) atomicAdd(hist + keys[i], __popc(peers));
  }
}

// Ranks one step of kThreads consecutive slots and writes both maps.
// running[e]: permuted row of expert e's next slot (shared); warp_count
// [kWarps][E] (shared, all zero on entry and on exit).
__device__ __forceinline__ void scatter_step(int key, int64_t s, int key_bits, int* running, uint16_t* warp_count,
                                             int E, int32_t* __restrict__ p2u, int32_t* __restrict__ u2p) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned peers = warp_peers(key, key_bits);
  const unsigned lower = peers & ((1u << lane) - 1u);
  const bool leader = (peers >> lane) == 1u;
  const int count = __popc(peers);
  if (leader && key >= 0) warp_count[warp * E + key] = uint16_t(count);
  __syncthreads();
  if (key >= 0) {
    int p = running[key] + __popc(lower);
    for (int w = 0; w < warp; ++w) p += warp_count[w * E + key];
    u2p[s] = p;
    p2u[p] = int32_t(s);
  } else if (key == kNotLocal) {
    u2p[s] = -1;
  }
  __syncthreads();  // every rank above read running[] and warp_count[]
  if (leader && key >= 0) {
    atomicAdd(running + key, count);
    warp_count[warp * E + key] = 0;
  }
  __syncwarp();  // the next step's leader in this warp may be another lane
}

__device__ __forceinline__ void zero_shared(int* p, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) p[i] = 0;
}

// Scatters one segment: its keys, `items` steps of kThreads slots from slot seg_start.
__device__ __forceinline__ void scatter_segment(const int (&keys)[kMaxItems], int items, int64_t seg_start,
                                                const SlotSource& src, int* running, uint16_t* warp_count,
                                                int32_t* __restrict__ p2u, int32_t* __restrict__ u2p) {
#pragma unroll
  for (int i = 0; i < kMaxItems; ++i) {
    if (i >= items) break;
    scatter_step(keys[i], seg_start + int64_t(i) * kThreads + threadIdx.x, src.key_bits, running, warp_count,
                 src.E, p2u, u2p);
  }
}

using ExpertScan = cub::BlockScan<int, kThreads>;

// Exclusive scan over the experts of count_of[E] (shared; E <= 1024, two a
// thread): put(e, base) for each expert, after every count is read. Returns
// the total (in every thread).
template <class Put>
__device__ __forceinline__ int scan_experts(const int* count_of, int E, ExpertScan::TempStorage& storage, Put put) {
  int c[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int e = int(threadIdx.x) * 2 + i;
    c[i] = e < E ? count_of[e] : 0;
  }
  int total;
  ExpertScan(storage).ExclusiveSum(c, c, total);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int e = int(threadIdx.x) * 2 + i;
    if (e < E) put(e, c[i]);
  }
  return total;
}

// Shared memory of the scatter kernels: running[E] int32, then warp_count[kWarps][E] uint16.
inline size_t scatter_smem_bytes(int E) {
  return size_t(E) * sizeof(int) + size_t(kWarps) * E * sizeof(uint16_t);
}

// ---- moe_forward's side work (detail::RoutingSideWork), spread over blocks ---
// [first_block, first_block + blocks) of the grid (the caller's blocks only).
__device__ void side_work(const detail::RoutingSideWork& w, int first_block, int blocks) {
  const int64_t first = int64_t(int(blockIdx.x) - first_block) * blockDim.x + threadIdx.x,
                step = int64_t(blocks) * blockDim.x;
  if (w.zero != nullptr && w.zero_ids != nullptr) {
    // Rows of tokens with a local id only; first and step are multiples of 32.
    const int lane = int(threadIdx.x & 31);
    const int64_t per_row = w.zero_row_bytes / 16;
    for (int64_t r = first / 32; r < w.zero_rows; r += step / 32) {
      const int e = lane < w.zero_k ? w.zero_ids[r * w.zero_k + lane] : -1;
      if (!__any_sync(~0u, e >= w.zero_lo && e - w.zero_lo < w.zero_n)) continue;
      char* row = static_cast<char*>(w.zero) + r * w.zero_stride_bytes;
      for (int64_t i = lane; i < per_row; i += 32) *reinterpret_cast<uint4*>(row + i * 16) = make_uint4(0, 0, 0, 0);
    }
  } else if (w.zero != nullptr) {
    const int64_t per_row = w.zero_row_bytes / 16, total = w.zero_rows * per_row;
    const bool dense = w.zero_stride_bytes == w.zero_row_bytes;
    for (int64_t i = first; i < total; i += step) {
      const int64_t r = dense ? 0 : i / per_row;
      const int64_t off = dense ? i * 16 : r * w.zero_stride_bytes + (i - r * per_row) * 16;
      *reinterpret_cast<uint4*>(static_cast<char*>(w.zero) + off) = make_uint4(0, 0, 0, 0);
    }
  }
  if (w.prefetch != nullptr) {
    const int64_t per_row = (w.prefetch_row_bytes + 127) / 128, total = w.prefetch_rows * per_row;
    for (int64_t i = first; i < total; i += step) {
      const int64_t r = i / per_row;
      const char* line = static_cast<const char*>(w.prefetch) + r * w.prefetch_stride_bytes + (i - r * per_row) * 128;
      asm volatile("prefetch.global.L2::evict_last [%0];\n" ::"l"(line));
    }
  }
  if (w.quant_x != nullptr) {
    // quantize_fp8's 1 x 128 layout: a team of four lanes a block, lane l its
    // chunks 4 i + l. first and step are multiples of four, so a team's lanes
    // take the same blocks and leave the loop together.
    using namespace fp8_dev;
    constexpr int kLanes = 4, kChunks = 128 / 8 / kLanes;
    const int64_t col_blocks = w.quant_cols / 128, total = w.quant_rows * col_blocks;
    const int lane = int(threadIdx.x % kLanes);
    const unsigned team = 0xfu << (threadIdx.x & 28u);
    for (int64_t g = first / kLanes; g < total; g += step / kLanes) {
      const int64_t r = g / col_blocks, cb = g - r * col_blocks;
      const uint16_t* x = static_cast<const uint16_t*>(w.quant_x) + r * w.quant_x_stride + cb * 128 + 8 * lane;
      Chunk c[kChunks];
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
        const uint4 v = *reinterpret_cast<const uint4*>(x + 8 * kLanes * i);
        c[i] = Chunk{{v.x, v.y, v.z, v.w}};
      }
      uint2 q[kChunks];
      const Scale sc = quantize_team_block<ScaleFormat::kFloat32>(c, team, q);
      uint8_t* dst = static_cast<uint8_t*>(w.quant_q) + r * w.quant_q_stride + cb * 128 + 8 * lane;
#pragma unroll
      for (int i = 0; i < kChunks; ++i) *reinterpret_cast<uint2*>(dst + 8 * kLanes * i) = q[i];
      if (lane == 0) store_scale(w.quant_scales, uint32_t(g), sc.stored, false);
    }
  }
}

// ---- single block: count, scan and scatter in one launch (decode) ---------
__global__ void __launch_bounds__(kThreads)
moe_routing_single_block_kernel(SlotSource src, int items, int64_t* __restrict__ offsets,
                                int32_t* __restrict__ p2u, int32_t* __restrict__ u2p, detail::RoutingSideWork side) {
  extern __shared__ int smem[];
  int* running = smem;
  uint16_t* warp_count = reinterpret_cast<uint16_t*>(smem + src.E);
  __shared__ ExpertScan::TempStorage scan_storage;

  dev::grid_dependency_wait();  // the experts (and the side work's X) may come from the previous kernel
  if (blockIdx.x > 0) {  // blocks 1.. : the side work alone
    side_work(side, 1, int(gridDim.x) - 1);
    return;
  }
  zero_shared(running, src.E);
  zero_shared(reinterpret_cast<int*>(warp_count), (kWarps * src.E + 1) / 2);
  int keys[kMaxItems];
  load_segment(src, 0, items, keys);
  __syncthreads();
  count_segment(keys, items, src.key_bits, running);
  __syncthreads();

  // Exclusive scan of the counts (in place in running[]).
  const int block_total = scan_experts(running, src.E, scan_storage, [&](int e, int base) {
    running[e] = base;
    offsets[e] = base;
  });
  if (threadIdx.x == 0) offsets[src.E] = block_total;
  __syncthreads();
  dev::allow_dependents_launch();
  scatter_segment(keys, items, 0, src, running, warp_count, p2u, u2p);
}

// ---- multi: 1) count per segment --------------------------------------------
__global__ void __launch_bounds__(kThreads)
moe_routing_count_kernel(SlotSource src, int items, int segments, int32_t* __restrict__ counts,
                         int64_t seg_stride, int64_t expert_stride, detail::RoutingSideWork side) {
  extern __shared__ int hist[];
  if (side.before_wait) side_work(side, 0, gridDim.x);
  dev::grid_dependency_wait();
  if (int(blockIdx.x) >= segments) {  // a block of the side work alone (RoutingSideWork::min_blocks)
    if (!side.before_wait) side_work(side, 0, gridDim.x);
    return;
  }
  zero_shared(hist, src.E);
  int keys[kMaxItems];
  load_segment(src, int64_t(blockIdx.x) * items * kThreads, items, keys);
  __syncthreads();
  count_segment(keys, items, src.key_bits, hist);
  __syncthreads();
  dev::allow_dependents_launch();
  int32_t* col = counts + int64_t(blockIdx.x) * seg_stride;
  for (int e = threadIdx.x; e < src.E; e += blockDim.x) col[e * expert_stride] = hist[e];
  // [E][segments_pad]: block 0 zeroes the padding segments (read as 16-byte quads).
  if (blockIdx.x == 0 && seg_stride == 1) {
    const int pad = int(expert_stride) - segments;
    for (int i = threadIdx.x; i < pad * src.E; i += blockDim.x)
      counts[int64_t(i / pad) * expert_stride + segments + i % pad] = 0;
  }
  if (!side.before_wait) side_work(side, 0, gridDim.x);
}

// ---- multi: 2) one block turns the counts into per-(segment, expert) bases --
// Thread (g, e) owns expert e over a contiguous group g of segments, so the
// loads of a warp are 32 consecutive experts of one segment (coalesced).
constexpr int kScanThreads = 1024;
constexpr int kScanCache = 16;

__global__ void __launch_bounds__(kScanThreads)
moe_routing_scan_kernel(int32_t* __restrict__ counts, int num_segments, int E, int64_t* __restrict__ offsets) {
  __shared__ int partial[kScanThreads];  // [groups][E_pad]
  using BlockScan = cub::BlockScan<int, kScanThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  const int e_pad = (E + 31) & ~31;
  const int groups = kScanThreads / e_pad;
  const int g = threadIdx.x / e_pad, e = threadIdx.x % e_pad;
  const bool active = g < groups && e < E;
  const int per_group = (num_segments + groups - 1) / groups;
  const int seg_begin = min(g * per_group, num_segments), seg_end = min(seg_begin + per_group, num_segments);

  dev::grid_dependency_wait();
  // The first kScanCache counts stay in registers for the second pass, and
  // their loads are all in flight at once (one L2 round trip, not 16).
  int cache[kScanCache];
  int sum = 0;
#pragma unroll
  for (int i = 0; i < kScanCache; ++i) {
    const int seg = seg_begin + i;
    cache[i] = active && seg < seg_end ? counts[int64_t(seg) * E + e] : 0;
  }
  if (active) {
#pragma unroll 8
    for (int seg = seg_begin + kScanCache; seg < seg_end; ++seg) sum += counts[int64_t(seg) * E + e];
  }
#pragma unroll
  for (int i = 0; i < kScanCache; ++i) sum += cache[i];
  partial[threadIdx.x] = sum;
  __syncthreads();

  // Per expert: exclusive scan over the groups, and the expert's total.
  int expert_total = 0;
  if (threadIdx.x < E) {
    for (int gg = 0; gg < groups; ++gg) {
      const int v = partial[gg * e_pad + threadIdx.x];
      partial[gg * e_pad + threadIdx.x] = expert_total;
      expert_total += v;
    }
  }
  int expert_base, total;
  BlockScan(scan_storage).ExclusiveSum(expert_total, expert_base, total);
  if (threadIdx.x < E) {
    offsets[threadIdx.x] = expert_base;
    for (int gg = 0; gg < groups; ++gg) partial[gg * e_pad + threadIdx.x] += expert_base;
  }
  if (threadIdx.x == 0) offsets[E] = total;
  __syncthreads();
  dev::allow_dependents_launch();

  if (active) {
    int base = partial[threadIdx.x];
#pragma unroll
    for (int i = 0; i < kScanCache; ++i) {
      const int seg = seg_begin + i;
      if (seg < seg_end) {
        counts[int64_t(seg) * E + e] = base;
        base += cache[i];
      }
    }
#pragma unroll 8
    for (int seg = seg_begin + kScanCache; seg < seg_end; ++seg) {
      int32_t* p = counts + int64_t(seg) * E + e;
      const int c = *p;
      *p = base;
      base += c;
    }
  }
}

// ---- multi: 3) stable scatter per segment --------------------------------
__global__ void __launch_bounds__(kThreads)
moe_routing_scatter_kernel(SlotSource src, int items, const int32_t* __restrict__ bases /* [segments][E] */,
                           int32_t* __restrict__ p2u, int32_t* __restrict__ u2p) {
  extern __shared__ int smem[];
  int* running = smem;
  uint16_t* warp_count = reinterpret_cast<uint16_t*>(smem + src.E);
  const int64_t seg_start = int64_t(blockIdx.x) * items * kThreads;
  // The expert ids are not written by the scan: load them before waiting.
  int keys[kMaxItems];
  load_segment(src, seg_start, items, keys);
  zero_shared(reinterpret_cast<int*>(warp_count), (kWarps * src.E + 1) / 2);
  dev::grid_dependency_wait();
  const int32_t* row = bases + int64_t(blockIdx.x) * src.E;
  for (int e = threadIdx.x; e < src.E; e += blockDim.x) running[e] = row[e];
  __syncthreads();
  dev::allow_dependents_launch();
  scatter_segment(keys, items, seg_start, src, running, warp_count, p2u, u2p);
}

// ---- multi, two launches: 2) each block scans the counts, then scatters ------
// Block b needs, per expert e, offset[e] (the exclusive scan over experts of
// the totals) plus e's count in the segments below b. Thread (g, e) sums
// expert e's counts over part g of the segments ([E][segments_pad]: 16-byte
// loads), in all and below b; the parts meet by shared atomics, one block
// scan gives the offsets (block 0 writes them), and the scatter goes on as
// moe_routing_scatter_kernel's. The counts are plain loads (the count kernel
// wrote them; read after the dependency wait).
__global__ void __launch_bounds__(kThreads)
moe_routing_scan_scatter_kernel(SlotSource src, int items, int segments_pad, const int32_t* counts,
                                int64_t* __restrict__ offsets, int32_t* __restrict__ p2u,
                                int32_t* __restrict__ u2p) {
  extern __shared__ int smem[];
  int* running = smem;
  uint16_t* warp_count = reinterpret_cast<uint16_t*>(smem + src.E);
  __shared__ int total_of[detail::kRoutingMaxExperts], below_of[detail::kRoutingMaxExperts];
  __shared__ ExpertScan::TempStorage scan_storage;
  const int E = src.E, b = int(blockIdx.x);
  const int64_t seg_start = int64_t(b) * items * kThreads;
  // The expert ids are not written by the count kernel: load them before waiting.
  int keys[kMaxItems];
  load_segment(src, seg_start, items, keys);
  zero_shared(reinterpret_cast<int*>(warp_count), (kWarps * E + 1) / 2);
  zero_shared(total_of, E);
  zero_shared(below_of, E);
  __syncthreads();
  dev::grid_dependency_wait();

  // ew: E rounded up to a power of 2, at most kThreads (experts e0, e0 + ew, ...).
  int ew = 1;
  while (ew < E && ew < kThreads) ew <<= 1;
  const int parts = kThreads / ew, g = int(threadIdx.x) / ew, e0 = int(threadIdx.x) % ew;
  const int quads = segments_pad / 4, per_part = (quads + parts - 1) / parts;
  const int q_begin = min(g * per_part, quads), q_end = min(q_begin + per_part, quads);
  for (int e = e0; e < E; e += ew) {
    const int4* q = reinterpret_cast<const int4*>(counts + int64_t(e) * segments_pad);
    int all = 0, below = 0;
#pragma unroll 4
    for (int qi = q_begin; qi < q_end; ++qi) {
      const int4 c = q[qi];
      const int s0 = 4 * qi;
      all += (c.x + c.y) + (c.z + c.w);
      below += (s0 < b ? c.x : 0) + (s0 + 1 < b ? c.y : 0) + (s0 + 2 < b ? c.z : 0) + (s0 + 3 < b ? c.w : 0);
    }
    if (all) atomicAdd(total_of + e, all);
    if (below) atomicAdd(below_of + e, below);
  }
  __syncthreads();
  const int block_total = scan_experts(total_of, E, scan_storage, [&](int e, int base) {
    running[e] = base + below_of[e];
    if (b == 0) offsets[e] = base;
  });
  if (b == 0 && threadIdx.x == 0) offsets[E] = block_total;
  __syncthreads();
  dev::allow_dependents_launch();
  scatter_segment(keys, items, seg_start, src, running, warp_count, p2u, u2p);
}

// ---- expansion: permuted_input[p] = input[t] ------------------------------
// Token-major: a block reads its part of row t once and writes it to each of
// the token's (up to k) permuted rows, so the input is read once, not k times.
// Bytes: (tokens with a local slot + P) * H elements; bandwidth-bound. Word is the widest access the
// pointers and strides allow (16 bytes normally).
constexpr int kExpandThreads = 128;
constexpr int kExpandUnroll = 2;

// Token t's permuted rows (u2p[j*T + t], -1 for a non-local slot) into the
// block's shared rows[0..k); u2p comes from the previous kernel of this call.
// False when the token has no local slot: its row is not read at all (expert
// parallelism: about a third of the tokens for 32 of 256 experts, k = 8).
// Both expansions (copy and FP8) start with it.
__device__ __forceinline__ bool token_local_rows(const int32_t* __restrict__ u2p, int32_t t, int32_t T, int k,
                                                 int32_t* rows) {
  dev::grid_dependency_wait();
  if (threadIdx.x < k) rows[threadIdx.x] = u2p[int64_t(threadIdx.x) * T + t];
  __syncthreads();
  dev::allow_dependents_launch();
  bool any_local = false;
  for (int j = 0; j < k; ++j) any_local |= rows[j] >= 0;
  return any_local;
}

template <typename Word>
__global__ void __launch_bounds__(kExpandThreads)
moe_routing_expand_kernel(const char* __restrict__ input, int64_t in_stride_bytes, char* __restrict__ out,
                          int64_t out_stride_bytes, int words_per_row, int tail_units,
                          const int32_t* __restrict__ u2p, int32_t T, int k) {
  __shared__ int32_t rows[16];
  const int32_t t = blockIdx.x;
  if (!token_local_rows(u2p, t, T, k, rows)) return;
  const Word* src = reinterpret_cast<const Word*>(input + int64_t(t) * in_stride_bytes);
  // The row's last bytes that do not fill a Word (a row length that is not
  // a multiple of the word, e.g. H = 7003 in padded rows): 2-byte units
  // (pointers are element-aligned), by the first block of the row.
  if (blockIdx.y == 0) {
    const auto* src2 = reinterpret_cast<const unsigned short*>(src + words_per_row);
    for (int i = threadIdx.x; i < tail_units; i += kExpandThreads) {
      const unsigned short x = src2[i];
      for (int j = 0; j < k; ++j)
        if (rows[j] >= 0)
          reinterpret_cast<unsigned short*>(out + int64_t(rows[j]) * out_stride_bytes + int64_t(words_per_row) *
                                                                                            int64_t(sizeof(Word)))[i] = x;
    }
  }
  const int stride = gridDim.y * kExpandThreads;
  for (int v0 = blockIdx.y * kExpandThreads + threadIdx.x; v0 < words_per_row; v0 += stride * kExpandUnroll) {
    Word x[kExpandUnroll];
#pragma unroll
    for (int u = 0; u < kExpandUnroll; ++u) {
      const int v = v0 + u * stride;
      if (v < words_per_row) x[u] = __ldcs(src + v);  // each input word is read once
    }
    for (int j = 0; j < k; ++j) {
      const int32_t p = rows[j];
      if (p < 0) continue;
      Word* dst = reinterpret_cast<Word*>(out + int64_t(p) * out_stride_bytes);
#pragma unroll
      for (int u = 0; u < kExpandUnroll; ++u) {
        const int v = v0 + u * stride;
        if (v < words_per_row) dst[v] = x[u];
      }
    }
  }
}

// ---- FP8 expansion (spec §1.4): permuted_input[p] = Q(input[t]) ----------
// Token-major like the copy: four lanes quantise one 1 x 128 block of row t
// (lane l its 8-column chunks 4 i + l, i < 4: 64 contiguous bytes a load
// instruction), with quantize_fp8's arithmetic (fp8_dev, so the bytes equal
// quantize_fp8's; its 1 x 128 kernel's lane layout, docs/quantize_fp8.md: the
// block's scale and divisor once per 32 values a lane), and write its 128
// e4m3 bytes and its scale to each of the token's local permuted rows.
// Bytes: 2 H a token with a local slot read, (H + H / 32) a local slot
// written.
constexpr int kExpandFp8Lanes = 4;                                                  // a block's lanes
constexpr int kExpandFp8Chunks = 128 / 8 / kExpandFp8Lanes;                         // 4 a lane
constexpr int kExpandFp8Groups = kExpandThreads / kExpandFp8Lanes;                  // blocks a CTA a pass

template <ScaleFormat F>
__global__ void __launch_bounds__(kExpandThreads)
moe_routing_expand_fp8_kernel(const uint16_t* __restrict__ input, int64_t in_stride, uint8_t* __restrict__ out,
                              int64_t out_stride, void* __restrict__ scales, int col_blocks,
                              const int32_t* __restrict__ u2p, int32_t T, int k) {
  using namespace fp8_dev;
  __shared__ int32_t rows[16];
  const int32_t t = blockIdx.x;
  if (!token_local_rows(u2p, t, T, k, rows)) return;
  const uint16_t* src = input + int64_t(t) * in_stride;
  const int lane = threadIdx.x % kExpandFp8Lanes;
  const unsigned team = 0xfu << (threadIdx.x & 28u);
  const int stride = gridDim.y * kExpandFp8Groups;
  // The four lanes of a team take the same blocks (uniform for the reduction).
  for (int cb = blockIdx.y * kExpandFp8Groups + int(threadIdx.x / kExpandFp8Lanes); cb < col_blocks; cb += stride) {
    const uint16_t* x = src + int64_t(cb) * 128 + 8 * lane;
    Chunk c[kExpandFp8Chunks];
#pragma unroll
    for (int i = 0; i < kExpandFp8Chunks; ++i) {
      const uint4 v = __ldcs(reinterpret_cast<const uint4*>(x + 8 * kExpandFp8Lanes * i));
      c[i] = Chunk{{v.x, v.y, v.z, v.w}};
    }
    uint2 q[kExpandFp8Chunks];
    const Scale sc = quantize_team_block<F>(c, team, q);
    for (int j = 0; j < k; ++j) {
      const int32_t p = rows[j];
      if (p < 0) continue;
      uint8_t* dst = out + int64_t(p) * out_stride + int64_t(cb) * 128 + 8 * lane;
#pragma unroll
      for (int i = 0; i < kExpandFp8Chunks; ++i) *reinterpret_cast<uint2*>(dst + 8 * kExpandFp8Lanes * i) = q[i];
      if (lane == 0) store_scale(scales, uint32_t(int64_t(p) * col_blocks + cb), sc.stored, F == ScaleFormat::kUE8M0);
    }
  }
}

// Blocks a row is split over, so that few tokens still fill the GPU (about
// 1024 blocks): at most as many as the row has `per_block`-unit pieces of
// its `units`, at least 1.
int64_t row_parts(int64_t num_tokens, int64_t units, int64_t per_block) {
  const int64_t max_parts = (units + per_block - 1) / per_block;
  int64_t parts = (1024 + num_tokens - 1) / num_tokens;
  if (parts > max_parts) parts = max_parts;
  if (parts < 1) parts = 1;
  return parts;
}

template <ScaleFormat F>
cudaError_t launch_expand_fp8(const MoeRoutingArgs& a, cudaStream_t stream) {
  const int64_t in_stride = a.input_stride ? a.input_stride : a.hidden;
  const int64_t out_stride = a.permuted_input_stride ? a.permuted_input_stride : a.hidden;
  const int col_blocks = int(a.hidden / 128);
  // As the copy: a row's 128-column blocks split over blocks when there are few tokens.
  const int64_t parts = row_parts(a.num_tokens, col_blocks, int64_t(kExpandFp8Groups));
  return dev::launch(moe_routing_expand_fp8_kernel<F>, dim3(unsigned(a.num_tokens), unsigned(parts)),
                     dim3(kExpandThreads), 0, stream, a.enable_pdl, static_cast<const uint16_t*>(a.input), in_stride,
                     static_cast<uint8_t*>(a.permuted_input), out_stride, a.permuted_input_scales, col_blocks,
                     static_cast<const int32_t*>(a.unpermuted_row_to_permuted_row), int32_t(a.num_tokens), a.k);
}

template <typename Word>
cudaError_t launch_expand(const MoeRoutingArgs& a, cudaStream_t stream) {
  const int64_t es = int64_t(dtype_size(a.input_dtype));
  const int64_t in_stride = (a.input_stride ? a.input_stride : a.hidden) * es;
  const int64_t out_stride = (a.permuted_input_stride ? a.permuted_input_stride : a.hidden) * es;
  const int words = int(a.hidden * es / int64_t(sizeof(Word)));
  const int tail_units = int((a.hidden * es - int64_t(words) * int64_t(sizeof(Word))) / 2);
  // Enough blocks to fill the GPU at decode sizes: a row's words split over
  // blocks when there are few tokens.
  const int64_t parts = row_parts(a.num_tokens, words, int64_t(kExpandThreads) * kExpandUnroll);
  return dev::launch(moe_routing_expand_kernel<Word>, dim3(unsigned(a.num_tokens), unsigned(parts)),
                     dim3(kExpandThreads), 0, stream, a.enable_pdl, static_cast<const char*>(a.input),
                     in_stride, static_cast<char*>(a.permuted_input), out_stride, words, tail_units,
                     static_cast<const int32_t*>(a.unpermuted_row_to_permuted_row), int32_t(a.num_tokens), a.k);
}

// The widest word (16, 8, 4 or 2 bytes) dividing both pointers and both row
// strides: 16 for the usual contiguous bf16/fp16/fp32 rows. A row length that
// is not a multiple of it leaves a tail the kernel copies in 2-byte units.
int expand_word_bytes(const MoeRoutingArgs& a) {
  const int64_t es = int64_t(dtype_size(a.input_dtype));
  const uint64_t in_stride = uint64_t((a.input_stride ? a.input_stride : a.hidden) * es);
  const uint64_t out_stride = uint64_t((a.permuted_input_stride ? a.permuted_input_stride : a.hidden) * es);
  const uint64_t bits = reinterpret_cast<uintptr_t>(a.input) | reinterpret_cast<uintptr_t>(a.permuted_input) |
                        in_stride | out_stride;
  for (int w = 16; w > 2; w /= 2)
    if (bits % uint64_t(w) == 0) return w;
  return 2;
}

// Lets `kernel` take `bytes` of dynamic shared memory on the current device.
Status set_smem(const void* kernel, size_t bytes) {
  if (bytes <= detail::kDefaultDynamicSmem) return Status::Ok();
  int max_dynamic = 0;
  FM_RETURN_IF_ERROR(
      detail::cuda_status(detail::prepare_kernel(kernel, false, &max_dynamic), kOp, "kernel attributes"));
  FM_REQUIRE_SUPPORTED(bytes <= size_t(max_dynamic), kOp, "num_experts_per_node",
                       "needs ", bytes, " bytes of shared memory per block, more than this device allows (",
                       max_dynamic, ")");
  return Status::Ok();
}

Status run_routing(const MoeRoutingArgs& a, const detail::RoutingSideWork& side, void* workspace,
                   size_t workspace_bytes, cudaStream_t stream) {
  const detail::MoeRoutingPlan plan = detail::plan_moe_routing(a);
  FM_REQUIRE(workspace_bytes >= plan.workspace_bytes, kOp, "workspace_bytes", "must be >= ",
             plan.workspace_bytes, " (build_moe_routing_maps_workspace_size), got ", workspace_bytes);
  FM_REQUIRE(plan.workspace_bytes == 0 || workspace != nullptr, kOp, "workspace", "must not be null");
  FM_RETURN_IF_ERROR(detail::check_stream(stream, kOp));

  const int E = a.num_experts_per_node;
  if (a.num_tokens == 0) {
    // Nothing to route; zero the offsets so a consumer reading them on the
    // device (the grouped GEMM) sees E empty experts.
    return detail::cuda_status(
        cudaMemsetAsync(a.expert_first_token_offset, 0, sizeof(int64_t) * (size_t(E) + 1), stream), kOp,
        "cudaMemsetAsync");
  }

  int key_bits = 0;
  while ((1 << key_bits) < E + 2) ++key_bits;
  SlotSource src{a.token_selected_experts, int32_t(a.num_tokens), int32_t(a.k), int32_t(a.start_expert_id),
                 int32_t(E), int32_t(plan.slots), key_bits};
  const size_t scatter_smem = scatter_smem_bytes(E);
  cudaError_t err;
  if (plan.single_block) {
    FM_RETURN_IF_ERROR(set_smem(reinterpret_cast<const void*>(moe_routing_single_block_kernel), scatter_smem));
    const bool any_side = side.zero != nullptr || side.quant_x != nullptr;
    const unsigned blocks = any_side ? unsigned(std::max(side.min_blocks, 2)) : 1u;
    err = dev::launch(moe_routing_single_block_kernel, dim3(blocks), dim3(kThreads), scatter_smem, stream,
                      a.enable_pdl, src, plan.items, a.expert_first_token_offset,
                      a.permuted_row_to_unpermuted_row, a.unpermuted_row_to_permuted_row, side);
    FM_RETURN_IF_ERROR(detail::cuda_status(err, kOp, "single-block kernel launch"));
  } else {
    // Align the caller's workspace to 256 bytes (the query added the slack).
    const uintptr_t raw = reinterpret_cast<uintptr_t>(workspace);
    int32_t* counts = reinterpret_cast<int32_t*>((raw + 255) & ~uintptr_t(255));
    const unsigned segments = unsigned(plan.num_segments);
    const bool any_side = side.zero != nullptr || side.prefetch != nullptr;
    const unsigned count_blocks = any_side && side.min_blocks > int(segments) ? unsigned(side.min_blocks) : segments;
    // FLASHMIX_ROUTING_SCAN_KERNEL=1 takes the three launches where two would do (tests, A/B).
    const char* pin = std::getenv("FLASHMIX_ROUTING_SCAN_KERNEL");
    const bool two = plan.scatter_scans && !(pin != nullptr && pin[0] == '1');
    const int64_t seg_stride = two ? 1 : E, expert_stride = two ? plan.segments_pad : 1;
    err = dev::launch(moe_routing_count_kernel, dim3(count_blocks), dim3(kThreads), sizeof(int) * size_t(E), stream,
                      a.enable_pdl, src, plan.items, int(segments), counts, seg_stride, expert_stride, side);
    FM_RETURN_IF_ERROR(detail::cuda_status(err, kOp, "count kernel launch"));
    if (two) {
      const void* k = reinterpret_cast<const void*>(moe_routing_scan_scatter_kernel);
      FM_RETURN_IF_ERROR(set_smem(k, scatter_smem));
      err = dev::launch(moe_routing_scan_scatter_kernel, dim3(segments), dim3(kThreads), scatter_smem, stream,
                        a.enable_pdl, src, plan.items, int(plan.segments_pad), static_cast<const int32_t*>(counts),
                        a.expert_first_token_offset, a.permuted_row_to_unpermuted_row,
                        a.unpermuted_row_to_permuted_row);
      FM_RETURN_IF_ERROR(detail::cuda_status(err, kOp, "scan + scatter kernel launch"));
    } else {
      err = dev::launch(moe_routing_scan_kernel, dim3(1), dim3(kScanThreads), 0, stream, a.enable_pdl, counts,
                        int(plan.num_segments), E, a.expert_first_token_offset);
      FM_RETURN_IF_ERROR(detail::cuda_status(err, kOp, "scan kernel launch"));
      FM_RETURN_IF_ERROR(set_smem(reinterpret_cast<const void*>(moe_routing_scatter_kernel), scatter_smem));
      err = dev::launch(moe_routing_scatter_kernel, dim3(segments), dim3(kThreads), scatter_smem, stream,
                        a.enable_pdl, src, plan.items, static_cast<const int32_t*>(counts),
                        a.permuted_row_to_unpermuted_row, a.unpermuted_row_to_permuted_row);
      FM_RETURN_IF_ERROR(detail::cuda_status(err, kOp, "scatter kernel launch"));
    }
  }

  if (a.input != nullptr && a.permuted_input_scales != nullptr) {
    err = a.permuted_scale_format == ScaleFormat::kUE8M0 ? launch_expand_fp8<ScaleFormat::kUE8M0>(a, stream)
                                                          : launch_expand_fp8<ScaleFormat::kFloat32>(a, stream);
    FM_RETURN_IF_ERROR(detail::cuda_status(err, kOp, "FP8 expand kernel launch"));
  } else if (a.input != nullptr) {
    switch (expand_word_bytes(a)) {
      case 16: err = launch_expand<uint4>(a, stream); break;
      case 8: err = launch_expand<uint2>(a, stream); break;
      case 4: err = launch_expand<unsigned int>(a, stream); break;
      default: err = launch_expand<unsigned short>(a, stream); break;
    }
    FM_RETURN_IF_ERROR(detail::cuda_status(err, kOp, "expand kernel launch"));
  }
  return detail::check_launch(kOp);
}

}  // namespace

Status build_moe_routing_maps(const MoeRoutingArgs& a, void* workspace, size_t workspace_bytes,
                              cudaStream_t stream) {
  FM_RETURN_IF_ERROR(validate_moe_routing_maps(a));
  return detail::without_cuda_error_left(
      kOp, [&] { return run_routing(a, detail::RoutingSideWork{}, workspace, workspace_bytes, stream); });
}

Status detail::build_moe_routing_maps_with(const MoeRoutingArgs& a, const RoutingSideWork& side, void* workspace,
                                           size_t workspace_bytes, cudaStream_t stream) {
  return detail::without_cuda_error_left(kOp, [&] { return run_routing(a, side, workspace, workspace_bytes, stream); });
}

}  // namespace flashmix
