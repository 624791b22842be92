// The device toolkit's memory half: vectors of N elements moved with the
// widest aligned accesses (16 bytes per instruction at most), and float
// conversion for each storage type. Every kernel uses these.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/reduce.cuh"
#include "flashmix/dtype.h"

namespace flashmix::dev {

// Storage type for each DType.
template <DType> struct StorageOf;
template <> struct StorageOf<DType::kFloat32> { using type = float; };
template <> struct StorageOf<DType::kFloat16> { using type = __half; };
template <> struct StorageOf<DType::kBFloat16> { using type = __nv_bfloat16; };

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// N elements of T, aligned to their size up to 16 bytes. Larger vectors are
// moved as several 16-byte accesses.
template <typename T, int N>
struct alignas(sizeof(T) * N < 16 ? sizeof(T) * N : 16) Vec {
  T v[N];
};

// Bytes of alignment Vec<T, N> needs.
template <typename T, int N>
constexpr int vec_alignment() { return sizeof(T) * N < 16 ? int(sizeof(T) * N) : 16; }

namespace detail {
template <int kBytes> struct Word;
template <> struct Word<2> { using type = uint16_t; };
template <> struct Word<4> { using type = uint32_t; };
template <> struct Word<8> { using type = uint2; };
template <> struct Word<16> { using type = uint4; };
}  // namespace detail

// Loads N elements with the widest aligned accesses; Load is the word load
// (a cache policy).
template <typename T, int N, typename Load>
__device__ __forceinline__ Vec<T, N> load_words(const T* p, Load load) {
  constexpr int kBytes = vec_alignment<T, N>();
  using W = typename detail::Word<kBytes>::type;
  constexpr int kWords = int(sizeof(T) * N) / kBytes;
  Vec<T, N> out;
  const W* src = reinterpret_cast<const W*>(p);
  W* dst = reinterpret_cast<W*>(&out);
#pragma unroll
  for (int i = 0; i < kWords; ++i) dst[i] = load(src + i);
  return out;
}

// Streaming loads (evict first): data read exactly once, such as expert rows.
template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_stream(const T* p) {
  return load_words<T, N>(p, [](const auto* w) { return __ldcs(w); });
}

// Loads through the read-only path: data reused across blocks (bias rows).
template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_ro(const T* p) {
  return load_words<T, N>(p, [](const auto* w) { return __ldg(w); });
}

template <typename T, int N>
__device__ __forceinline__ void store(T* p, const Vec<T, N>& x) {
  constexpr int kBytes = vec_alignment<T, N>();
  using W = typename detail::Word<kBytes>::type;
  constexpr int kWords = int(sizeof(T) * N) / kBytes;
  W* dst = reinterpret_cast<W*>(p);
  const W* src = reinterpret_cast<const W*>(&x);
#pragma unroll
  for (int i = 0; i < kWords; ++i) dst[i] = src[i];
}

// (hi:lo) >> bits, low word; bits < 32. On the host too, for the tests.
__host__ __device__ __forceinline__ uint32_t funnel_right(uint32_t lo, uint32_t hi, uint32_t bits) {
#ifdef __CUDA_ARCH__
  return __funnelshift_r(lo, hi, bits);
#else
  return uint32_t(((uint64_t(hi) << 32) | lo) >> bits);
#endif
}

// The 16 bytes that start `shift` elements into `lo` and run on into `hi`
// (lo, hi: two consecutive 16-byte-aligned vectors of a row; 0 <= shift < V).
// How a row that is not 16-byte aligned is still read with 16-byte loads:
// each lane loads the aligned vector at its position, takes its neighbour's
// as `hi` (a shuffle) and shifts. Word selection by selects, not indexing,
// so nothing goes to local memory (sm_90a SASS: ~9 SEL + 4 SHF per vector).
// Host-callable (tests/cpu/test_vec_realign.cu).
template <typename T, int V>
__host__ __device__ __forceinline__ Vec<T, V> realign16(const uint4& lo, const uint4& hi, int shift) {
  static_assert(sizeof(T) * V == 16, "realign16 moves 16-byte vectors");
  const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  const int bytes = shift * int(sizeof(T));
  const int q = bytes >> 2;                   // whole words, 0..3
  const uint32_t bits = uint32_t(bytes & 3) * 8u;  // 0, or 16 for 2-byte elements at an odd position
  // t = w[q .. q+4]: a two-stage barrel shift (by 2 words, then by 1).
  uint32_t u[6], t[5];
#pragma unroll
  for (int i = 0; i < 6; ++i) u[i] = (q & 2) ? w[i + 2] : w[i];
#pragma unroll
  for (int i = 0; i < 5; ++i) t[i] = (q & 1) ? u[i + 1] : u[i];
  uint4 o;
  o.x = funnel_right(t[0], t[1], bits);
  o.y = funnel_right(t[1], t[2], bits);
  o.z = funnel_right(t[2], t[3], bits);
  o.w = funnel_right(t[3], t[4], bits);
  return reinterpret_cast<const Vec<T, V>&>(o);
}

// A 16-byte vector from the next lane of the warp (up = false) or the
// previous one (up = true). Every lane of the warp calls it.
__device__ __forceinline__ uint4 shfl16(const uint4& x, bool up) {
  uint4 y;
  y.x = up ? __shfl_up_sync(kFullMask, x.x, 1) : __shfl_down_sync(kFullMask, x.x, 1);
  y.y = up ? __shfl_up_sync(kFullMask, x.y, 1) : __shfl_down_sync(kFullMask, x.y, 1);
  y.z = up ? __shfl_up_sync(kFullMask, x.z, 1) : __shfl_down_sync(kFullMask, x.z, 1);
  y.w = up ? __shfl_up_sync(kFullMask, x.w, 1) : __shfl_down_sync(kFullMask, x.w, 1);
  return y;
}

// The realigned read, warp-wide: this lane's aligned vector `lo` with the
// next lane's as `hi` (realign16). Every lane of the warp calls it.
template <typename T, int V>
__device__ __forceinline__ Vec<T, V> realign_with_next_lane(const uint4& lo, int shift) {
  return realign16<T, V>(lo, shfl16(lo, false), shift);
}

// Storing a warp's run of V-element vectors (lane l holds columns
// [c + lV, c + lV + V), lanes 0..last) into a row that starts `shift`
// elements past a 16-byte boundary, without touching a column outside the run
// (other warps write next to it). Lane l >= 1 writes the aligned 16 bytes
// that end inside its vector: lane l-1's last `shift` elements and its own
// first V - shift (realign16(prev, own, V - shift)); lane 0 writes its first
// V - shift elements one by one, the last lane its last `shift`. With
// shift == 0 every lane writes its own vector. What one lane does:
struct RealignedStore {
  bool vector;      // the 16-byte store (at the aligned address lV - shift past c)
  int first, last;  // its own elements [first, last) stored one by one
};
__host__ __device__ inline RealignedStore realigned_store(int lane, bool last_lane, int shift, int V) {
  if (shift == 0) return {true, 0, 0};
  RealignedStore r{lane > 0, lane > 0 ? V - shift : 0, V - shift};
  if (last_lane) r.last = V;
  return r;
}

// Brings the line holding p into L2 without using a register for the data.
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Asynchronous 16-byte copy global -> shared (sm_80+), bypassing L1. The data
// in flight occupies shared memory, not registers. A thread sees its own
// copies after cp_async_wait<N>() has retired all but its N newest groups.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// True when p is aligned to `bytes`.
__host__ __device__ inline bool is_aligned(const void* p, int bytes) {
  return (reinterpret_cast<uintptr_t>(p) % uintptr_t(bytes)) == 0;
}

}  // namespace flashmix::dev
