// DiT GEMM kernel instantiations for __nv_bfloat16 (see dit_gemm_kernel.cuh).
#include "dit_gemm_launch.cuh"

namespace torch_cfm {
namespace cuda_gemm {

bool launch_gemm_bf16(const GemmParams& p, int block_m, int block_n, int epilogue, bool pdl, cudaStream_t stream) {
  using T = __nv_bfloat16;
  TORCH_CFM_GEMM_CONFIGS(TORCH_CFM_GEMM_LAUNCH_CASE)
  return false;
}

}  // namespace cuda_gemm
}  // namespace torch_cfm
