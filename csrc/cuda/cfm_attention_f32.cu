// cfm_attention CUDA kernel instantiations for float (see cfm_attention_kernel.cuh).
#include "cfm_attention_launch.cuh"

namespace torch_cfm {
namespace cuda_attention {

bool launch_f32(const Params& p, int blocks, int bk, int wq, int wk, int nbuf, int cluster, int kv_groups,
               bool pdl, cudaStream_t stream) {
  using T = float;
  TORCH_CFM_CONFIGS_32(TORCH_CFM_LAUNCH_CASE)
  return false;
}

}  // namespace cuda_attention
}  // namespace torch_cfm
