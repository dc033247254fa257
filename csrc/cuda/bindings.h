// The torch-facing functions of torch_cfm._C_cuda, registered with Python in module.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <string>
#include <tuple>
#include <vector>

namespace torch_cfm {
namespace cuda_attention {

void cfm_attention_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const c10::optional<at::Tensor>& key_lengths, const c10::optional<at::Tensor>& mask,
                       const c10::optional<at::Tensor>& kv_rows, at::Tensor& out, int64_t block_k,
                       int64_t q_groups, int64_t key_splits, int64_t buffers, int64_t cluster,
                       int64_t kv_groups, bool pdl, int64_t ablate);

using ConfigTuple = std::tuple<std::string, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>;
std::vector<ConfigTuple> configs();

}  // namespace cuda_attention

namespace cuda_rownorm {

void dit_rownorm(const at::Tensor& y, const c10::optional<at::Tensor>& bias, at::Tensor& h,
                 const c10::optional<at::Tensor>& table, int64_t gate_off, int64_t shift_off, int64_t scale_off,
                 const c10::optional<at::Tensor>& ln_w, const c10::optional<at::Tensor>& ln_b, at::Tensor& out,
                 int64_t out_t, int64_t out_off, bool head, const c10::optional<at::Tensor>& cnn,
                 int64_t head_cbase, const c10::optional<at::Tensor>& emit_src,
                 const c10::optional<at::Tensor>& emit_dst, int64_t emit_cbase, const at::Tensor& valid,
                 int64_t n_rows, int64_t t_len, double eps, bool taps, bool has_res, bool write_h, bool pdl);

}  // namespace cuda_rownorm
}  // namespace torch_cfm
