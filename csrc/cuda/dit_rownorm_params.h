// Host/device interface of the DiT body's row-norm CUDA kernel (dit_rownorm.cu): one block boundary
// of the fused body (residual + gate + LayerNorm + modulation, or conv tap sum + affine LayerNorm +
// Mish) over C = 512 channels, the same semantics as the Triton kernel `_dit_rownorm_kernel`
// (torch_cfm/kernels/dit_body.py). Plain C++: the torch binding includes it without nvcc.
#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

namespace torch_cfm {
namespace cuda_rownorm {

constexpr int kChannels = 512;  // C of the shipped model; one warp holds one row (16 channels per lane)

// Element strides and offsets are in elements of the tensor they index. Optional pointers are
// nullptr when absent; the `has_*` flags of the Triton kernel become those nulls.
struct Params {
  const void* y;            // GEMM rows (M, C) [plain] or conv taps (N*(T+2), 3C) [taps], compute dtype
  int64_t stride_y;         // elements between rows of y
  const void* bias;         // (C,) compute dtype, added to y; nullptr: none
  float* h;                 // (M, C) float32 residual stream: read when has_res, written when write_h
  const float* table;       // (R, depth+1, 9, C) float32 modulation table; nullptr: none (affine LN only)
  int64_t stride_tab;       // elements between rows of the table (0 when one row serves every sequence)
  int64_t gate_off, shift_off, scale_off;  // element offsets inside a table row; gate_off < 0: no gate
  const void* ln_w;         // (C,) affine LayerNorm weight/bias (norm = 1), compute dtype
  const void* ln_b;
  void* out;                // output rows, compute dtype: row of token (n, t) = n * out_t + out_off + t
  int64_t out_t, out_off;
  const void* cnn;          // old conv cache (N, 2C, 2), compute dtype [head]; nullptr: zeros
  int64_t cnn_sn, cnn_sc, cnn_sj, head_cbase;
  const void* emit_src;     // (N*(T+2), C) history whose frames T_n, T_n + 1 are emitted [emit]
  void* emit_dst;           // new conv cache (N, 2C, 2), compute dtype
  int64_t emit_sn, emit_sc, emit_sj, emit_cbase;
  const int32_t* valid;     // (N,) clamped valid lengths T_n
  int m, t_len;             // token rows M = N*T, frames per row T
  float eps;
  int has_res, write_h, head, emit;
};

// Launches the kernel for dtype `dtype` (0 fp16, 1 bf16, 2 fp32), conv taps or plain y (`taps`),
// adaLN modulation (norm 0) or affine LayerNorm + Mish (norm 1), as a programmatic dependent launch
// when `pdl`; false for an unknown dtype/norm.
bool launch(const Params& p, int dtype, bool taps, int norm, bool pdl, cudaStream_t stream);

}  // namespace cuda_rownorm
}  // namespace torch_cfm
