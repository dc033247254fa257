// cfm_attention CUDA kernel instantiations for __half (see cfm_attention_kernel.cuh).
#include "cfm_attention_launch.cuh"

namespace torch_cfm {
namespace cuda_attention {

bool launch_f16(const Params& p, int blocks, int bk, int wq, int wk, int nbuf, int cluster, int kv_groups,
               bool pdl, cudaStream_t stream) {
  using T = __half;
  TORCH_CFM_CONFIGS_16(TORCH_CFM_LAUNCH_CASE)
  return false;
}

}  // namespace cuda_attention
}  // namespace torch_cfm
