// Per-device facts about kernels, in one place. A function attribute set with
// cudaFuncSetAttribute applies to the current device only, and occupancy
// answers depend on the device, so every fact is kept under a (device,
// kernel, size) key behind one mutex: any number of devices and host threads
// may ask at once. Every kernel launcher in flashmix asks here; none keeps a
// cache of its own.
//
// Each function returns the CUDA error it met (and clears it, so that no
// error is left set for the caller); nothing is cached then. Function
// attributes and occupancy queries are not stream work: capture-safe.
#pragma once

#include <cstddef>

#include <cuda_runtime.h>

namespace flashmix::detail {

struct DeviceProps {
  int device = -1;
  int sms = 0;         // multiprocessors
  int cc_major = 0;    // compute capability
  int cc_minor = 0;
  int smem_optin = 0;  // largest shared memory per block with the opt-in attribute
};

// The current device's properties (cached per device).
cudaError_t current_device_props(DeviceProps* out);

// Lets `kernel` use as much dynamic shared memory as the current device
// allows (the per-block opt-in less the kernel's static shared memory) and,
// with `nonportable_cluster`, clusters of more than 8 CTAs. Done once per
// (device, kernel). *max_dynamic_smem: the dynamic shared memory a launch of
// `kernel` may now ask for on this device.
cudaError_t prepare_kernel(const void* kernel, bool nonportable_cluster, int* max_dynamic_smem);

// The PTX version (e.g. 90) of the image of `kernel` the current device runs:
// below 90 for an image built for an older target (JIT-compiled or not),
// which has none of sm_90's instructions. Cached per (device, kernel).
cudaError_t kernel_ptx_version(const void* kernel, int* out);

// Static + dynamic shared memory any kernel may use without prepare_kernel.
constexpr size_t kDefaultDynamicSmem = 48 * 1024;

// Resident CTAs of `kernel` per SM at `threads` per CTA and `smem` bytes of
// dynamic shared memory, on the current device (0: it does not fit). Calls
// prepare_kernel first (a kernel with static shared memory may pass 48 KB
// with a smaller dynamic part).
cudaError_t blocks_per_sm(const void* kernel, int threads, size_t smem, int* out);

// Clusters of `cluster` CTAs of `kernel` (at `threads` per CTA and `smem`
// bytes of dynamic shared memory) that can be resident at once on the current
// device (0: not even one). Calls prepare_kernel first (with the non-portable
// size allowed when cluster > 8).
cudaError_t active_clusters(const void* kernel, int threads, size_t smem, int cluster, int* out);

template <typename... Args>
const void* kernel_key(void (*kernel)(Args...)) {
  return reinterpret_cast<const void*>(kernel);
}

}  // namespace flashmix::detail
