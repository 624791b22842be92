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

}  // namespace

cudaError_t current_device_props(DeviceProps* out) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return cleared(err);
  Cache& c = cache();
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    auto it = c.devices.find(device);
    if (it != c.devices.end()) {
      *out = it->second;
      return cudaSuccess;
    }
  }
  DeviceProps p;
  err = query_props(device, &p);
  if (err != cudaSuccess) return err;
  std::lock_guard<std::mutex> lock(c.mutex);
  c.devices.emplace(device, p);
  *out = p;
  return cudaSuccess;
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

cudaError_t blocks_per_sm(const void* kernel, int threads, size_t smem, int* out) {
  cudaError_t err = cudaSuccess;
  if (smem > kDefaultDynamicSmem) {  // below it every kernel may launch without the attribute
    int max_dynamic = 0;
    err = prepare_kernel(kernel, false, &max_dynamic);
    if (err != cudaSuccess) return err;
    if (smem > size_t(max_dynamic)) {
      *out = 0;
      return cudaSuccess;
    }
  }
  int device = 0;
  err = cudaGetDevice(&device);
  if (err != cudaSuccess) return cleared(err);
  Cache& c = cache();
  const auto key = std::make_tuple(device, kernel, threads, smem);
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    auto it = c.blocks.find(key);
    if (it != c.blocks.end()) {
      *out = it->second;
      return cudaSuccess;
    }
  }
  int n = 0;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem);
  if (err != cudaSuccess) return cleared(err);
  std::lock_guard<std::mutex> lock(c.mutex);
  c.blocks.emplace(key, n);
  *out = n;
  return cudaSuccess;
}

cudaError_t active_clusters(const void* kernel, int threads, size_t smem, int cluster, int* out) {
  int max_dynamic = 0;
  cudaError_t err = prepare_kernel(kernel, cluster > 8, &max_dynamic);
  if (err != cudaSuccess) return err;
  if (smem > size_t(max_dynamic)) {
    *out = 0;
    return cudaSuccess;
  }
  int device = 0;
  err = cudaGetDevice(&device);
  if (err != cudaSuccess) return cleared(err);
  Cache& c = cache();
  const auto key = std::make_tuple(device, kernel, threads, smem, cluster);
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    auto it = c.clusters.find(key);
    if (it != c.clusters.end()) {
      *out = it->second;
      return cudaSuccess;
    }
  }
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
  int n = 0;
  err = cudaOccupancyMaxActiveClusters(&n, kernel, &config);
  if (err != cudaSuccess) return cleared(err);
  std::lock_guard<std::mutex> lock(c.mutex);
  c.clusters.emplace(key, n);
  *out = n;
  return cudaSuccess;
}

}  // namespace flashmix::detail
