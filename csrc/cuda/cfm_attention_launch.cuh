// One launch function per dtype over the instantiated configs; included by cfm_attention_{f16,bf16,f32}.cu.
#pragma once

#include <atomic>

#include "cfm_attention_kernel.cuh"

namespace torch_cfm {
namespace cuda_attention {

constexpr int kMaxDevices = 64;  // devices whose attribute is remembered; beyond, set on every launch

template <typename T, int D, int BK, int WQ, int WK, int NBUF, int C, int KVG>
void launch_config(const Params& p, int blocks, bool pdl, cudaStream_t stream) {
  using G = Geometry<sizeof(T), D, BK, WQ, WK, NBUF, C>;
  auto kernel = cfm_attention_fwd_kernel<T, D, BK, WQ, WK, NBUF, C, KVG>;
  // Above 48 KB of dynamic shared memory needs an opt-in per kernel and per device (a host-side
  // attribute, no sync); the caller's device guard makes the current device the launch's.
  static std::atomic<bool> attribute_set[kMaxDevices];
  int device = 0;
  cudaGetDevice(&device);
  if (device >= kMaxDevices || !attribute_set[device].exchange(true)) {
    // a failure here surfaces as the launch error the caller checks
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, G::kSmemBytes);
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(blocks * C);  // C CTAs (one cluster) per work item
  config.blockDim = dim3(G::kThreads);
  config.dynamicSmemBytes = G::kSmemBytes;
  config.stream = stream;
  cudaLaunchAttribute attributes[2];
  unsigned int count = 0;
  if (C > 1) {
    attributes[count].id = cudaLaunchAttributeClusterDimension;
    attributes[count].val.clusterDim.x = C;
    attributes[count].val.clusterDim.y = 1;
    attributes[count].val.clusterDim.z = 1;
    ++count;
  }
  if (pdl) {
    attributes[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[count].val.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  config.attrs = attributes;
  config.numAttrs = count;
  cudaLaunchKernelEx(&config, kernel, p);  // errors surface through the caller's launch check
}

}  // namespace cuda_attention
}  // namespace torch_cfm

#define TORCH_CFM_LAUNCH_CASE(BK, WQ, WK, NBUF, C, KVG)                                       \
  if (bk == BK && wq == WQ && wk == WK && nbuf == NBUF && cluster == C && kv_groups == KVG) {  \
    launch_config<T, 64, BK, WQ, WK, NBUF, C, KVG>(p, blocks, pdl, stream);                   \
    return true;                                                               \
  }
