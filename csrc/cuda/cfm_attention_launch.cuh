// One launch function per dtype over the instantiated configs; included by cfm_attention_{f16,bf16,f32}.cu.
#pragma once

#include "cfm_attention_kernel.cuh"

namespace torch_cfm {
namespace cuda_attention {

template <typename T, int D, int BK, int WQ, int WK, int NBUF>
void launch_config(const Params& p, int blocks, bool pdl, cudaStream_t stream) {
  using G = Geometry<T, D, BK, WQ, WK, NBUF>;
  auto kernel = cfm_attention_fwd_kernel<T, D, BK, WQ, WK, NBUF>;
  // Above 48 KB of dynamic shared memory needs an opt-in per kernel (host-side attribute, no sync).
  static const cudaError_t attribute =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, G::kSmemBytes);
  (void)attribute;  // a failure here surfaces as the launch error the caller checks
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(G::kThreads);
  config.dynamicSmemBytes = G::kSmemBytes;
  config.stream = stream;
  cudaLaunchAttribute attributes[1];
  attributes[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attributes;
  config.numAttrs = pdl ? 1 : 0;
  cudaLaunchKernelEx(&config, kernel, p);  // errors surface through the caller's launch check
}

}  // namespace cuda_attention
}  // namespace torch_cfm

#define TORCH_CFM_LAUNCH_CASE(BK, WQ, WK, NBUF)                      \
  if (bk == BK && wq == WQ && wk == WK && nbuf == NBUF) {            \
    launch_config<T, 64, BK, WQ, WK, NBUF>(p, blocks, pdl, stream);       \
    return true;                                                     \
  }
