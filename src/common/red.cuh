// Global reduction adds and 16-byte stores in asm, as the FC2 epilogues
// use them. Each is `asm volatile` with a memory clobber: issue order is
// kept, nothing waits for completion.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

namespace flashmix::dev {

// bits: a packed bf16x2 (low half at addr).
__device__ __forceinline__ void red_add_bf16x2(__nv_bfloat16* addr, uint32_t bits) {
  asm volatile("red.global.add.noftz.bf16x2 [%0], %1;" ::"l"(addr), "r"(bits) : "memory");
}

__device__ __forceinline__ void red_add_bf16x2(__nv_bfloat16* addr, float a, float b) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  red_add_bf16x2(addr, *reinterpret_cast<uint32_t*>(&v));
}

__device__ __forceinline__ void red_add_f32x2(float* addr, float a, float b) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(addr), "f"(a), "f"(b) : "memory");
}

__device__ __forceinline__ void red_add_bf16x8(__nv_bfloat16* addr, const uint32_t (&x)[4]) {
  asm volatile("red.global.v4.bf16x2.add.noftz [%0], {%1, %2, %3, %4};" ::"l"(addr), "r"(x[0]), "r"(x[1]),
               "r"(x[2]), "r"(x[3])
               : "memory");
}

__device__ __forceinline__ void red_add_f32x4(float* addr, float4 v) {
  asm volatile("red.global.v4.f32.add [%0], {%1, %2, %3, %4};" ::"l"(addr), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
               : "memory");
}

// 16-byte stores in asm: written as uint4 / float4 assignments, some of the
// per-mode bodies came out of the compiler as four 4-byte stores.
__device__ __forceinline__ void st_global_v4(void* addr, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

}  // namespace flashmix::dev
