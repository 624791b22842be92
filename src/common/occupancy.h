// Host-side launch-shape queries, cached: a kernel's resident blocks per SM
// (for a block size and dynamic shared memory) and the device's SM count
// do not change while the process runs, and asking the runtime on every
// launch costs microseconds of host time -- as much as a decode-sized kernel
// runs. Thread-safe; keyed by device, so several GPUs each get their own.
#pragma once

#include <cstddef>
#include <map>
#include <mutex>
#include <tuple>

#include <cuda_runtime.h>

namespace flashmix::detail {

struct LaunchShape {
  int device = 0;
  int sms = 0;            // multiprocessors of the current device
  int blocks_per_sm = 0;  // resident blocks of `kernel` per SM at this block size and shared memory
};

// Fills `out` for the current device. Returns the first CUDA error (and
// caches nothing then).
inline cudaError_t query_launch_shape(const void* kernel, int threads, size_t smem, LaunchShape& out) {
  using Key = std::tuple<const void*, int, int, size_t>;
  static std::mutex mutex;
  static std::map<Key, LaunchShape> cache;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const Key key{kernel, device, threads, smem};
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = cache.find(key);
    if (it != cache.end()) {
      out = it->second;
      return cudaSuccess;
    }
  }
  LaunchShape s;
  s.device = device;
  err = cudaDeviceGetAttribute(&s.sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&s.blocks_per_sm, kernel, threads, smem);
  if (err != cudaSuccess) return err;
  std::lock_guard<std::mutex> lock(mutex);
  cache.emplace(key, s);
  out = s;
  return cudaSuccess;
}

}  // namespace flashmix::detail
