// The DiT block's K <= 512 GEMMs on the SM90a wgmma kernel (dit_linear_kernel.cuh): host entry points,
// registered in the torch_cfm._C_cuda module (cfm_attention.cpp).
#pragma once

#include <torch/extension.h>

#include <optional>

namespace torch_cfm {
namespace dit_linear {

// out = a @ w.T (+ bias) (GELU, tanh form): a (M, K), w (N, K), out (M, N), one dtype: fp16 or bf16, or
// fp32 computed in TF32 (operands rounded to nearest TF32); K a multiple of 64 (fp32: 32) up to 512, N a
// multiple of block_n (32, 64, 96, or 128 for 16-bit), unit column strides, 16-byte aligned a/w rows and bases. flags: 1 trigger dependents early, 2 GELU (tanh), 4 no bias.
// pdl: launch with programmatic stream serialization (the weights load before the wait).
void linear_into(const at::Tensor& a, const at::Tensor& w, const std::optional<at::Tensor>& bias, at::Tensor& out,
                 int64_t block_n, bool pdl, int64_t flags, int64_t cluster);

// Split-K: partials[z] = a[:, z K' : (z + 1) K'] @ w[:, z K' : (z + 1) K']^T in fp32, K' = K / splits a
// multiple of 64 (fp32 operands, computed in TF32: 32) up to 512; partials a contiguous float32 (splits, M,
// N) tensor, block_n 64 or (16-bit) 128. The sum
// over z (and any bias) is the caller's: the body's row-norm kernel adds them up. flags: 1 only.
void linear_splitk_into(const at::Tensor& a, const at::Tensor& w, at::Tensor& partials, int64_t block_n, bool pdl,
                        int64_t flags, int64_t splits);

// The block's QKV GEMM on the in-place attention-cache arena (kQkvCache in dit_linear_kernel.cuh): q | k | v
// = a @ w.T + bias, q and k LayerNormed per 64-wide head (affine qn_* / kn_*, eps); q -> q_out (M, heads x 64),
// k and v of row r = n t_len + t, t < valid[n], to frame cached[n] + valid[n] - 1 - t of cache (N, heads, P,
// 128). valid / cached: clamped int32 (N,). fp16/bf16 (128-wide tiles: heads even). flags: 1 only.
void linear_qkv_cache_into(const at::Tensor& a, const at::Tensor& w, const at::Tensor& bias, const at::Tensor& qn_w,
                           const at::Tensor& qn_b, const at::Tensor& kn_w, const at::Tensor& kn_b, at::Tensor& q_out,
                           at::Tensor& cache, const at::Tensor& valid, const at::Tensor& cached, int64_t t_len,
                           double eps, bool pdl, int64_t flags);

// Whether this build carries the sm_90a kernel code for the current device (a one-time probe launch).
bool available();

}  // namespace dit_linear
}  // namespace torch_cfm
