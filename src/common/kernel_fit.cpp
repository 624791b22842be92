#include "common/kernel_fit.h"

#include <map>
#include <mutex>
#include <tuple>

namespace flashmix::detail {
namespace {

struct Cache {
  std::mutex mutex;
  std::map<int, DeviceProps> devices;                                       // device
  std::map<std::tuple<int, const void*, bool>, int> prepared;               // (device, kernel, nonportable)
  std::map<std::tuple<int, const void*, int, size_t>, int> blocks;          // (device, kernel, threads, smem)
  std::map<std::tuple<int, const void*, int, size_t, int>, int> clusters;   // (..., cluster)
  std::map<std::tuple<int, const void*>, int> ptx;                          // (device, kernel)
};

Cache& cache() {
  static Cache c;
  return c;
}

// Returns `err` after clearing it from the runtime's last-error slot: the
// failed query is ours, not the caller's.
cudaError_t cleared(cudaError_t err) {
  if (err != cudaSuccess) (void)cudaGetLastError();
  return err;
}

cudaError_t query_props(int device, DeviceProps* p) {
  p->device = device;
  cudaError_t err = cudaDeviceGetAttribute(&p->sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&p->cc_major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&p->cc_minor, cudaDevAttrComputeCapabilityMinor, device);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&p->smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  return cleared(err);
}

// The answer in `map` under make_key(the current device), or
// query(device, &value) stored there. The query runs outside the lock: two
// threads asking at once may both run it and store the same answer.
template <typename Map, typename MakeKey, typename Query>
cudaError_t cached(Map Cache::*map, MakeKey&& make_key, typename Map::mapped_type* out, Query&& query) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return cleared(err);
  Cache& c = cache();
  const auto key = make_key(device);
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    auto it = (c.*map).find(key);
    if (it != (c.*map).end()) {
      *out = it->second;
      return cudaSuccess;
    }
  }
  typename Map::mapped_type value{};
  err = query(device, &value);
  if (err != cudaSuccess) return cleared(err);
  std::lock_guard<std::mutex> lock(c.mutex);
  (c.*map).emplace(key, value);
  *out = value;
  return cudaSuccess;
}

}  // namespace

cudaError_t current_device_props(DeviceProps* out) {
  return cached(&Cache::devices, [](int device) { return device; }, out, query_props);
}

cudaError_t kernel_ptx_version(const void* kernel, int* out) {
  return cached(
      &Cache::ptx, [&](int device) { return std::make_tuple(device, kernel); }, out, [&](int, int* v) {
        cudaFuncAttributes fa{};
        const cudaError_t err = cudaFuncGetAttributes(&fa, kernel);
        *v = fa.ptxVersion;
        return err;
      });
}

cudaError_t prepare_kernel(const void* kernel, bool nonportable_cluster, int* max_dynamic_smem) {
  DeviceProps dev;
  cudaError_t err = current_device_props(&dev);
  if (err != cudaSuccess) return err;
  Cache& c = cache();
  const auto key = std::make_tuple(dev.device, kernel, nonportable_cluster);
  // Held across the attribute calls: two threads preparing the same kernel
  // on the same device set the same values, but the cache entry must not be
  // visible before the attributes are set.
  std::lock_guard<std::mutex> lock(c.mutex);
  auto it = c.prepared.find(key);
  if (it != c.prepared.end()) {
    *max_dynamic_smem = it->second;
    return cudaSuccess;
  }
  cudaFuncAttributes fa;
  err = cudaFuncGetAttributes(&fa, kernel);
  if (err != cudaSuccess) return cleared(err);
  const int bytes = dev.smem_optin - int(fa.sharedSizeBytes);
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess && nonportable_cluster)
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  if (err != cudaSuccess) return cleared(err);
  c.prepared.emplace(key, bytes);
  *max_dynamic_smem = bytes;
  return cudaSuccess;
}

namespace {

// Whether `smem` bytes of dynamic shared memory are allowed to `kernel` on
// the current device (setting its attributes first).
cudaError_t smem_allowed(const void* kernel, size_t smem, bool nonportable_cluster, bool* allowed) {
  // Always through prepare_kernel (cached): static + dynamic shared memory
  // may pass kDefaultDynamicSmem with any dynamic part, and only the opt-in
  // attribute allows that.
  *allowed = true;
  int max_dynamic = 0;
  const cudaError_t err = prepare_kernel(kernel, nonportable_cluster, &max_dynamic);
  *allowed = err == cudaSuccess && smem <= size_t(max_dynamic);
  return err;
}

}  // namespace

cudaError_t blocks_per_sm(const void* kernel, int threads, size_t smem, int* out) {
  bool allowed = false;
  if (const cudaError_t err = smem_allowed(kernel, smem, false, &allowed); err != cudaSuccess) return err;
  *out = 0;
  if (!allowed) return cudaSuccess;
  return cached(
      &Cache::blocks, [&](int device) { return std::make_tuple(device, kernel, threads, smem); }, out,
      [&](int, int* n) { return cudaOccupancyMaxActiveBlocksPerMultiprocessor(n, kernel, threads, smem); });
}

cudaError_t active_clusters(const void* kernel, int threads, size_t smem, int cluster, int* out) {
  bool allowed = false;
  if (const cudaError_t err = smem_allowed(kernel, smem, cluster > 8, &allowed); err != cudaSuccess) return err;
  *out = 0;
  if (!allowed) return cudaSuccess;
  auto key = [&](int device) { return std::make_tuple(device, kernel, threads, smem, cluster); };
  return cached(&Cache::clusters, key, out, [&](int, int* n) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = unsigned(cluster);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(unsigned(cluster));
    config.blockDim = dim3(unsigned(threads));
    config.dynamicSmemBytes = smem;
    config.attrs = attr;
    config.numAttrs = 1;
    return cudaOccupancyMaxActiveClusters(n, kernel, &config);
  });
}

}  // namespace flashmix::detail
