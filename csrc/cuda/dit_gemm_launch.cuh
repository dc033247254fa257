// Launch of the DiT GEMM kernel (dit_gemm_kernel.cuh) for one dtype over the instantiated tile
// configs; included by dit_gemm_{f16,bf16}.cu so the two compile in parallel.
#pragma once

#include <atomic>

#include "dit_gemm_kernel.cuh"
#include "dit_gemm_params.h"

namespace torch_cfm {
namespace cuda_gemm {

template <typename T, int BM, int BN, int KS, int BK, int WM, int WN, int EPI>
void launch_gemm(const GemmParams& p, bool pdl, cudaStream_t stream) {
  using G = GemmGeometry<sizeof(T), BM, BN, KS, BK>;
  auto kernel = dit_gemm_kernel<T, BM, BN, KS, BK, WM, WN, EPI>;
  constexpr int kMaxDevices = 64;  // beyond: the attribute is set on every launch
  static std::atomic<bool> attribute_set[kMaxDevices];
  int device = 0;
  cudaGetDevice(&device);
  if (device >= kMaxDevices || !attribute_set[device].exchange(true)) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, G::kSmemBytes);
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(p.n / BN, (p.m + BM - 1) / BM, p.k / KS);
  config.blockDim = dim3(WM * WN * 32);
  config.dynamicSmemBytes = G::kSmemBytes;
  config.stream = stream;
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = pdl ? 1 : 0;
  cudaLaunchKernelEx(&config, kernel, p);  // errors surface through the caller's launch check
}

}  // namespace cuda_gemm
}  // namespace torch_cfm

#define TORCH_CFM_GEMM_EPI_CASE(BM, BN, KS, BK, WM, WN, EPI)                       \
  if (epilogue == EPI) {                                                                  \
    launch_gemm<T, BM, BN, KS, BK, WM, WN, EPI>(p, pdl, stream);                  \
    return true;                                                                          \
  }
#define TORCH_CFM_GEMM_LAUNCH_CASE(BM, BN, KS, BK, WM, WN)                        \
  if (block_m == BM && block_n == BN) {                                                   \
    TORCH_CFM_GEMM_EPI_CASE(BM, BN, KS, BK, WM, WN, kBias)                        \
    TORCH_CFM_GEMM_EPI_CASE(BM, BN, KS, BK, WM, WN, kBiasGelu)                    \
    TORCH_CFM_GEMM_EPI_CASE(BM, BN, KS, BK, WM, WN, kPartial)                     \
    TORCH_CFM_GEMM_EPI_CASE(BM, BN, KS, BK, WM, WN, kNone)                        \
  }
