// torch binding of the DiT body's row-norm CUDA kernel (dit_rownorm.cu; its own name: setup.py compiles both to objects named after the source). The Python side
// (torch_cfm/kernels/dit_rownorm_cuda.py) checks shapes, dtypes and alignment and falls back to the
// Triton kernel where this one does not apply; the checks here are the last line only.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "bindings.h"
#include "dit_rownorm_params.h"

namespace torch_cfm {
namespace cuda_rownorm {

namespace {
const void* ptr_or_null(const c10::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr() : nullptr; }
}  // namespace

void dit_rownorm(const at::Tensor& y, const c10::optional<at::Tensor>& bias, at::Tensor& h,
                 const c10::optional<at::Tensor>& table, int64_t gate_off, int64_t shift_off, int64_t scale_off,
                 const c10::optional<at::Tensor>& ln_w, const c10::optional<at::Tensor>& ln_b, at::Tensor& out,
                 int64_t out_t, int64_t out_off, bool head, const c10::optional<at::Tensor>& cnn,
                 int64_t head_cbase, const c10::optional<at::Tensor>& emit_src,
                 const c10::optional<at::Tensor>& emit_dst, int64_t emit_cbase, const at::Tensor& valid,
                 int64_t n_rows, int64_t t_len, double eps, bool taps, bool has_res, bool write_h, bool pdl) {
  TORCH_CHECK_VALUE(y.is_cuda() && h.is_cuda() && out.is_cuda(), "dit_rownorm (CUDA kernel): needs CUDA tensors");
  TORCH_CHECK_VALUE(h.dim() == 2 && h.size(1) == kChannels && h.scalar_type() == at::kFloat && h.is_contiguous(),
                    "dit_rownorm (CUDA kernel): h must be a contiguous float32 (M, ", kChannels, ")");
  TORCH_CHECK_VALUE(y.dim() == 2 && y.stride(1) == 1 && out.is_contiguous() && y.scalar_type() == out.scalar_type(),
                    "dit_rownorm (CUDA kernel): y needs unit column stride, out contiguous, both one dtype");
  const bool norm_affine = ln_w.has_value();
  TORCH_CHECK_VALUE(norm_affine || table.has_value(), "dit_rownorm (CUDA kernel): adaLN needs the table");
  const c10::cuda::CUDAGuard guard(y.device());
  Params p{};
  p.y = y.data_ptr();
  p.stride_y = y.stride(0);
  p.bias = ptr_or_null(bias);
  p.h = h.data_ptr<float>();
  p.table = table.has_value() ? table->data_ptr<float>() : nullptr;
  p.stride_tab = table.has_value() && table->size(0) > 1 ? table->stride(0) : 0;
  p.gate_off = gate_off, p.shift_off = shift_off, p.scale_off = scale_off;
  p.ln_w = ptr_or_null(ln_w);
  p.ln_b = ptr_or_null(ln_b);
  p.out = out.data_ptr();
  p.out_t = out_t, p.out_off = out_off;
  p.cnn = ptr_or_null(cnn);
  if (cnn.has_value()) p.cnn_sn = cnn->stride(0), p.cnn_sc = cnn->stride(1), p.cnn_sj = cnn->stride(2);
  p.head_cbase = head_cbase;
  p.emit_src = ptr_or_null(emit_src);
  p.emit_dst = emit_dst.has_value() ? emit_dst->data_ptr() : nullptr;
  if (emit_dst.has_value()) p.emit_sn = emit_dst->stride(0), p.emit_sc = emit_dst->stride(1), p.emit_sj = emit_dst->stride(2);
  p.emit_cbase = emit_cbase;
  p.valid = valid.data_ptr<int32_t>();
  p.m = static_cast<int>(n_rows * t_len);
  p.t_len = static_cast<int>(t_len);
  p.eps = static_cast<float>(eps);
  p.has_res = has_res, p.write_h = write_h, p.head = head, p.emit = emit_dst.has_value();
  const int dtype = y.scalar_type() == at::kHalf ? 0 : y.scalar_type() == at::kBFloat16 ? 1
                    : y.scalar_type() == at::kFloat ? 2 : -1;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(y.device().index()).stream();
  TORCH_CHECK_VALUE(launch(p, dtype, taps, norm_affine ? 1 : 0, pdl, stream),
                    "dit_rownorm (CUDA kernel): no instantiation for dtype ", y.scalar_type());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda_rownorm
}  // namespace torch_cfm
