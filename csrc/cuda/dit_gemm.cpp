// torch binding of the DiT GEMM kernel (csrc/cuda/dit_gemm_kernel.cuh), part of the optional
// extension torch_cfm._C_cuda (registered in cfm_attention.cpp's module). The Python side
// (torch_cfm/kernels/dit_gemm_cuda.py) checks coverage first; these checks are the last line.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <tuple>
#include <vector>

#include "dit_gemm_params.h"

namespace torch_cfm {
namespace cuda_gemm {

// out = a · wᵀ with `epilogue` 0 (+ bias), 1 (+ bias, tanh GELU), 2 (fp32 partial sums per 512-column
// K slice into out (K / 512, M, N)) or 3 (nothing); tile (block_m, block_n); PDL launch when `pdl`.
void dit_gemm(const at::Tensor& a, const at::Tensor& w, const c10::optional<at::Tensor>& bias, at::Tensor& out,
              int64_t epilogue, int64_t block_m, int64_t block_n, bool pdl) {
  TORCH_CHECK_VALUE(a.is_cuda() && a.dim() == 2 && w.dim() == 2 && a.size(1) == w.size(1),
                    "dit_gemm (CUDA kernel): a (M, K) and w (N, K) on CUDA");
  TORCH_CHECK_VALUE(a.scalar_type() == w.scalar_type() &&
                        (a.scalar_type() == at::kHalf || a.scalar_type() == at::kBFloat16),
                    "dit_gemm (CUDA kernel): a and w both float16 or both bfloat16");
  TORCH_CHECK_VALUE(a.stride(1) == 1 && w.stride(1) == 1 && out.stride(-1) == 1,
                    "dit_gemm (CUDA kernel): unit stride along K and along out's columns");
  const int64_t m = a.size(0), n = w.size(0), k = a.size(1);
  TORCH_CHECK_VALUE(k % kSliceK == 0 && n % block_n == 0, "dit_gemm (CUDA kernel): K % 512 == 0 and N % block_n == 0");
  TORCH_CHECK_VALUE(epilogue >= 0 && epilogue <= 3, "dit_gemm (CUDA kernel): epilogue in 0..3");
  const bool partial = epilogue == 2;
  TORCH_CHECK_VALUE(partial || k == kSliceK, "dit_gemm (CUDA kernel): K > 512 needs the partial epilogue");
  if (partial) {
    TORCH_CHECK_VALUE(out.scalar_type() == at::kFloat && out.dim() == 3 && out.size(0) == k / kSliceK &&
                          out.size(1) == m && out.size(2) == n,
                      "dit_gemm (CUDA kernel): partial out is float32 (K / 512, M, N)");
  } else {
    TORCH_CHECK_VALUE(out.scalar_type() == a.scalar_type() && out.dim() == 2 && out.size(0) == m && out.size(1) == n,
                      "dit_gemm (CUDA kernel): out (M, N) in a's dtype");
  }
  const bool has_bias = epilogue == 0 || epilogue == 1;
  TORCH_CHECK_VALUE(!has_bias || (bias.has_value() && bias->scalar_type() == a.scalar_type() && bias->numel() == n &&
                                  bias->is_contiguous()),
                    "dit_gemm (CUDA kernel): bias (N,) contiguous in a's dtype");
  for (const at::Tensor* t : {&a, &w, static_cast<const at::Tensor*>(&out)}) {
    TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0,
                      "dit_gemm (CUDA kernel): 16-byte aligned operands");
  }
  TORCH_CHECK_VALUE(a.stride(0) % 8 == 0 && w.stride(0) % 8 == 0, "dit_gemm (CUDA kernel): 16-byte aligned rows");
  if (m == 0) return;
  const c10::cuda::CUDAGuard guard(a.device());
  GemmParams p{};
  p.a = a.data_ptr();
  p.w = w.data_ptr();
  p.bias = has_bias ? bias->data_ptr() : nullptr;
  p.out = out.data_ptr();
  p.a_sm = a.stride(0), p.w_sn = w.stride(0);
  p.o_sm = partial ? out.stride(1) : out.stride(0);
  p.o_split = partial ? out.stride(0) : 0;
  p.m = static_cast<int>(m), p.n = static_cast<int>(n), p.k = static_cast<int>(k);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(a.device().index()).stream();
  const int bm = static_cast<int>(block_m), bn = static_cast<int>(block_n), epi = static_cast<int>(epilogue);
  const bool launched = a.scalar_type() == at::kHalf ? launch_gemm_f16(p, bm, bn, epi, pdl, stream)
                                                     : launch_gemm_bf16(p, bm, bn, epi, pdl, stream);
  TORCH_CHECK_VALUE(launched, "dit_gemm (CUDA kernel): no instantiation for (block_m, block_n) = (", block_m, ", ",
                    block_n, ")");
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The instantiated tile configs as (block_m, block_n, shared-memory bytes per CTA for 16-bit operands).
std::vector<std::tuple<int64_t, int64_t, int64_t>> gemm_configs() {
  std::vector<std::tuple<int64_t, int64_t, int64_t>> all;
#define TORCH_CFM_GEMM_LIST(BM, BN, KS, BK, WM, WN) all.emplace_back(BM, BN, GemmGeometry<2, BM, BN, KS, BK>::kSmemBytes);
  TORCH_CFM_GEMM_CONFIGS(TORCH_CFM_GEMM_LIST)
#undef TORCH_CFM_GEMM_LIST
  return all;
}

}  // namespace cuda_gemm
}  // namespace torch_cfm
