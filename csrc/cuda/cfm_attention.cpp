// torch binding of the hand-written cfm_attention CUDA kernel (csrc/cuda/cfm_attention_kernel.cuh),
// built as the optional extension torch_cfm._C_cuda where torch has CUDA and nvcc exists (setup.py).
// torch_cfm/kernels/cfm_attention_cuda.py decides when the kernel applies and calls
// `cfm_attention_fwd` from the CUDA kernel of torch_cfm::cfm_attention, with validated inputs.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "cfm_attention_params.h"
#include "dit_linear.h"

namespace torch_cfm {
namespace cuda_attention {

// Writes cfm_attention(q, k, v, ...) into `out` (N, H, Q, D) with tile config (block_k, q_groups,
// key_splits, buffers, cluster, kv_groups), as a programmatic dependent launch when `pdl` (SM90+).
// Raises ValueError for inputs outside the kernel's coverage or a config that is not instantiated;
// the Python side checks both first, so these are the last line only.
void cfm_attention_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const c10::optional<at::Tensor>& key_lengths, const c10::optional<at::Tensor>& mask,
                       const c10::optional<at::Tensor>& kv_rows, at::Tensor& out, int64_t block_k,
                       int64_t q_groups, int64_t key_splits, int64_t buffers, int64_t cluster,
                       int64_t kv_groups, bool pdl) {
  TORCH_CHECK_VALUE(q.is_cuda() && q.dim() == 4 && q.size(3) == 64,
                    "cfm_attention (CUDA kernel): needs CUDA inputs with D = 64");
  TORCH_CHECK_VALUE(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 && out.stride(3) == 1,
                    "cfm_attention (CUDA kernel): needs unit stride along D");
  const c10::cuda::CUDAGuard guard(q.device());
  Params p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.out = out.data_ptr();
  p.key_lengths = key_lengths.has_value() ? key_lengths->data_ptr<int32_t>() : nullptr;
  p.mask = mask.has_value() ? static_cast<const uint8_t*>(mask->data_ptr()) : nullptr;
  p.kv_rows = kv_rows.has_value() ? kv_rows->data_ptr<int32_t>() : nullptr;
  p.q_sn = q.stride(0), p.q_sh = q.stride(1), p.q_sq = q.stride(2);
  p.k_sn = k.stride(0), p.k_sh = k.stride(1), p.k_sk = k.stride(2);
  p.v_sn = v.stride(0), p.v_sh = v.stride(1), p.v_sk = v.stride(2);
  if (mask.has_value()) p.m_sn = mask->stride(0), p.m_sq = mask->stride(1), p.m_sk = mask->stride(2);
  p.o_sn = out.stride(0), p.o_sh = out.stride(1), p.o_sq = out.stride(2);
  p.n_heads = static_cast<int>(q.size(1));
  p.q_len = static_cast<int>(q.size(2));
  p.k_len = static_cast<int>(k.size(2));
  p.n_pool = static_cast<int>(k.size(0));
  p.q_tiles = static_cast<int>((q.size(2) + 16 * q_groups - 1) / (16 * q_groups));
  p.scale_log2 = static_cast<float>(1.4426950408889634 / std::sqrt(static_cast<double>(q.size(3))));
  const int64_t rows_heads = q.size(0) * q.size(1);
  if (rows_heads == 0 || p.q_len == 0) return;
  // cluster > 1: one cluster per (row, head, group of `cluster` query tiles); launch_* launches
  // blocks · cluster CTAs.
  const int blocks = static_cast<int>(rows_heads * ((p.q_tiles + cluster - 1) / cluster));
  const int bk = static_cast<int>(block_k), wq = static_cast<int>(q_groups);
  const int wk = static_cast<int>(key_splits), nbuf = static_cast<int>(buffers), kvg = static_cast<int>(kv_groups);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  bool launched = false;
  switch (q.scalar_type()) {
    case at::kHalf:
      launched = launch_f16(p, blocks, bk, wq, wk, nbuf, static_cast<int>(cluster), kvg, pdl, stream);
      break;
    case at::kBFloat16:
      launched = launch_bf16(p, blocks, bk, wq, wk, nbuf, static_cast<int>(cluster), kvg, pdl, stream);
      break;
    case at::kFloat:
      launched = launch_f32(p, blocks, bk, wq, wk, nbuf, static_cast<int>(cluster), kvg, pdl, stream);
      break;
    default:
      break;
  }
  TORCH_CHECK_VALUE(launched, "cfm_attention (CUDA kernel): no instantiation for dtype ", q.scalar_type(),
                    " and (block_k, q_groups, key_splits, buffers, cluster, kv_groups) = (", block_k, ", ",
                    q_groups, ", ", key_splits, ", ", buffers, ", ", cluster, ", ", kv_groups, ")");
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The instantiated configs as (family, block_k, q_groups, key_splits, buffers, cluster, kv_groups,
// shared-memory bytes per CTA); family "16bit" | "fp32".
using ConfigTuple = std::tuple<std::string, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>;
std::vector<ConfigTuple> configs() {
  std::vector<ConfigTuple> all;
#define TORCH_CFM_LIST16(BK, WQ, WK, NBUF, C, KVG) \
  all.emplace_back("16bit", BK, WQ, WK, NBUF, C, KVG, Geometry<2, 64, BK, WQ, WK, NBUF, C>::kSmemBytes);
#define TORCH_CFM_LIST32(BK, WQ, WK, NBUF, C, KVG) \
  all.emplace_back("fp32", BK, WQ, WK, NBUF, C, KVG, Geometry<4, 64, BK, WQ, WK, NBUF, C>::kSmemBytes);
  TORCH_CFM_CONFIGS_16(TORCH_CFM_LIST16)
  TORCH_CFM_CONFIGS_32(TORCH_CFM_LIST32)
#undef TORCH_CFM_LIST16
#undef TORCH_CFM_LIST32
  return all;
}

}  // namespace cuda_attention
}  // namespace torch_cfm

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torch_cfm CUDA kernels (optional build, csrc/cuda/)";
  m.def("cfm_attention_fwd", &torch_cfm::cuda_attention::cfm_attention_fwd,
        "cfm_attention into a preallocated out (D = 64, validated inputs)", pybind11::arg("q"), pybind11::arg("k"),
        pybind11::arg("v"), pybind11::arg("key_lengths"), pybind11::arg("mask"), pybind11::arg("kv_rows"),
        pybind11::arg("out"), pybind11::arg("block_k"), pybind11::arg("q_groups"), pybind11::arg("key_splits"),
        pybind11::arg("buffers"), pybind11::arg("cluster") = 1, pybind11::arg("kv_groups") = 1,
        pybind11::arg("pdl") = false);
  m.def("dit_linear_into", &torch_cfm::dit_linear::linear_into,
        "out = a @ w.T (+ bias) (GELU) on the SM90a wgmma kernel (csrc/cuda/dit_linear_kernel.cuh)",
        pybind11::arg("a"), pybind11::arg("w"), pybind11::arg("bias"), pybind11::arg("out"), pybind11::arg("block_n"),
        pybind11::arg("pdl") = false, pybind11::arg("flags") = 0, pybind11::arg("cluster") = 1);
  m.def("dit_linear_splitk_into", &torch_cfm::dit_linear::linear_splitk_into,
        "partials[z] = a[:, K chunk z] @ w[:, K chunk z].T in fp32 on the SM90a wgmma kernel (split-K)",
        pybind11::arg("a"), pybind11::arg("w"), pybind11::arg("partials"), pybind11::arg("block_n"),
        pybind11::arg("pdl") = false, pybind11::arg("flags") = 0, pybind11::arg("splits") = 1);
  m.def("dit_linear_qkv_cache_into", &torch_cfm::dit_linear::linear_qkv_cache_into,
        "the block's QKV GEMM with q/k LayerNorm, queries out and k/v appended to the in-place cache arena",
        pybind11::arg("a"), pybind11::arg("w"), pybind11::arg("bias"), pybind11::arg("qn_w"), pybind11::arg("qn_b"),
        pybind11::arg("kn_w"), pybind11::arg("kn_b"), pybind11::arg("q_out"), pybind11::arg("cache"),
        pybind11::arg("valid"), pybind11::arg("cached"), pybind11::arg("t_len"), pybind11::arg("eps"),
        pybind11::arg("pdl") = false, pybind11::arg("flags") = 0);
  m.def("dit_linear_available", &torch_cfm::dit_linear::available,
        "whether this build runs the SM90a DiT GEMM kernel on the current device (cached probe)");
  m.def("configs", &torch_cfm::cuda_attention::configs,
        "instantiated (family, block_k, q_groups, key_splits, buffers, cluster, kv_groups, smem_bytes)");
}
