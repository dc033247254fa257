// CPU kernel of torch_cfm::cfm_attention: the reference math in ATen (fp32 accumulation), so an
// AOTInductor package runs it without Python. Mirrors torch_cfm/reference/cfm_attention.py and the
// argument checks of torch_cfm/ops/_checks.py (ValueError naming the argument).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>
#include <sstream>
#include <string>

namespace torch_cfm {
namespace {

std::string shape_str(const at::Tensor& t) {
  std::ostringstream os;
  os << "(";
  for (int64_t i = 0; i < t.dim(); ++i) os << (i ? ", " : "") << t.size(i);
  os << (t.dim() == 1 ? ",)" : ")");
  return os.str();
}

void check_index_vector(const char* arg, const c10::optional<at::Tensor>& t, int64_t n_rows,
                        const at::Tensor& q) {
  if (!t.has_value()) return;
  TORCH_CHECK_VALUE(t->scalar_type() == at::kInt && t->dim() == 1 && t->size(0) == n_rows,
                    "cfm_attention: ", arg, " must be int32 of shape (N,)=(", n_rows, ",), got ",
                    t->scalar_type(), " ", shape_str(*t));
  TORCH_CHECK_VALUE(t->device() == q.device(), "cfm_attention: ", arg,
                    " must be on q's device ", q.device(), ", got ", t->device());
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const c10::optional<at::Tensor>& key_lengths,
                  const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& kv_rows,
                  c10::string_view precision) {
  const char* names[] = {"q", "k", "v"};
  const at::Tensor* ts[] = {&q, &k, &v};
  for (int i = 0; i < 3; ++i) {
    TORCH_CHECK_VALUE(ts[i]->dim() == 4, "cfm_attention: ", names[i], " must have rank 4, got rank ",
                      ts[i]->dim(), " ", shape_str(*ts[i]));
  }
  auto dt = q.scalar_type();
  TORCH_CHECK_VALUE(dt == at::kHalf || dt == at::kBFloat16 || dt == at::kFloat,
                    "cfm_attention: q must be float16, bfloat16 or float32, got ", dt);
  for (int i = 1; i < 3; ++i) {
    TORCH_CHECK_VALUE(ts[i]->scalar_type() == dt, "cfm_attention: ", names[i],
                      " must have q's dtype ", dt, ", got ", ts[i]->scalar_type());
    TORCH_CHECK_VALUE(ts[i]->device() == q.device(), "cfm_attention: ", names[i],
                      " must be on q's device ", q.device(), ", got ", ts[i]->device());
  }
  const int64_t n_rows = q.size(0), heads = q.size(1), head_dim = q.size(3);
  TORCH_CHECK_VALUE(head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128,
                    "cfm_attention: q must have head dim D in (16, 32, 64, 128), got D=", head_dim);
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(), "cfm_attention: k and v must have the same shape, got k ",
                    shape_str(k), " v ", shape_str(v));
  const bool pool = kv_rows.has_value();
  TORCH_CHECK_VALUE((pool || k.size(0) == n_rows) && k.size(1) == heads && k.size(3) == head_dim,
                    "cfm_attention: k must have shape (", pool ? "R" : std::to_string(n_rows), ", ",
                    heads, ", K, ", head_dim, ") to match q ", shape_str(q), ", got ", shape_str(k));
  TORCH_CHECK_VALUE(!pool || k.size(0) > 0 || n_rows == 0,
                    "cfm_attention: k must have at least one pool row when kv_rows is given");
  check_index_vector("key_lengths", key_lengths, n_rows, q);
  check_index_vector("kv_rows", kv_rows, n_rows, q);
  if (mask.has_value()) {
    TORCH_CHECK_VALUE(mask->scalar_type() == at::kBool && mask->dim() == 3 &&
                          mask->size(0) == n_rows && mask->size(1) == q.size(2) &&
                          mask->size(2) == k.size(2),
                      "cfm_attention: mask must be bool of shape (N, Q, K)=(", n_rows, ", ",
                      q.size(2), ", ", k.size(2), "), got ", mask->scalar_type(), " ",
                      shape_str(*mask));
    TORCH_CHECK_VALUE(mask->device() == q.device(), "cfm_attention: mask must be on q's device");
  }
  TORCH_CHECK_VALUE(precision == "auto" || precision == "tf32" || precision == "ieee",
                    "cfm_attention: precision must be one of ('auto', 'tf32', 'ieee'), got '",
                    std::string(precision), "'");
}

at::Tensor cfm_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const c10::optional<at::Tensor>& key_lengths,
                             const c10::optional<at::Tensor>& mask,
                             const c10::optional<at::Tensor>& kv_rows, c10::string_view precision) {
  check_inputs(q, k, v, key_lengths, mask, kv_rows, precision);
  const int64_t n_rows = q.size(0), heads = q.size(1), q_len = q.size(2), head_dim = q.size(3);
  // Output values (N, H, Q, D) stored as contiguous (N, Q, H, D).
  at::Tensor out = at::empty({n_rows, q_len, heads, head_dim}, q.options()).transpose(1, 2);
  if (out.numel() == 0) return out;

  at::Tensor kk = k, vv = v;
  if (kv_rows.has_value()) {
    at::Tensor rows = kv_rows->to(at::kLong).clamp(0, k.size(0) - 1);
    kk = k.index_select(0, rows);
    vv = v.index_select(0, rows);
  }
  const int64_t k_len = kk.size(2);
  if (k_len == 0) return out.zero_();  // no keys at all: every query has no valid key
  at::Tensor qf = q.to(at::kFloat), kf = kk.to(at::kFloat), vf = vv.to(at::kFloat);
  at::Tensor scores = at::matmul(qf, kf.transpose(-1, -2)).mul_(1.0 / std::sqrt((double)head_dim));
  if (key_lengths.has_value() || mask.has_value()) {
    at::Tensor keep;
    if (key_lengths.has_value()) {
      at::Tensor lengths = key_lengths->to(at::kLong).clamp(0, k_len);
      at::Tensor key_ok = at::arange(k_len, lengths.options()).view({1, k_len}) < lengths.view({n_rows, 1});
      // Frames past a row's length are padding and may hold anything (NaN, inf): never read them,
      // as the GPU kernel never loads them (0 * NaN would leak through the P.V product).
      vf = vf.masked_fill(key_ok.logical_not().view({n_rows, 1, k_len, 1}), 0.0);
      keep = key_ok.view({n_rows, 1, k_len}).expand({n_rows, q_len, k_len});
    }
    if (mask.has_value()) keep = keep.defined() ? keep.logical_and(*mask) : *mask;
    scores.masked_fill_(keep.unsqueeze(1).logical_not(), -std::numeric_limits<float>::infinity());
  }
  at::Tensor row_max = std::get<0>(scores.max(-1, /*keepdim=*/true));
  row_max = at::where(row_max.isfinite(), row_max, at::zeros_like(row_max));
  at::Tensor probs = (scores - row_max).exp_();
  at::Tensor denom = probs.sum(-1, /*keepdim=*/true);
  at::Tensor result = at::matmul(probs, vf).div_(at::where(denom > 0, denom, at::ones_like(denom)));
  out.copy_(result);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_cfm, CPU, m) { m.impl("cfm_attention", &cfm_attention_cpu); }

}  // namespace torch_cfm
