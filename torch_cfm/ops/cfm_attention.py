"""``torch_cfm::cfm_attention``: public wrapper, fake kernel, autocast rule and CUDA kernels.

The schema and the CPU kernel live in C++ (``csrc/ops.cpp``, ``csrc/cpu/cfm_attention.cpp``) so
AOTInductor packages can run the op without Python. This module adds, to that schema:

* the fake (meta) kernel, validating like eager and returning the real kernel's layout;
* an autocast rule on AutocastCUDA / AutocastCPU that follows the ambient autocast dtype;
* the CUDA kernel: on NVIDIA SM80+ the hand-written CUDA kernel (optional build, ``csrc/cuda/``)
  where it covers the call and its tile rule picks it, Triton otherwise; SDPA below SM80 (see
  :func:`torch_cfm.policy.decide` and :func:`torch_cfm.policy.attention_kernel_choice`).
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import policy
from ..reference.cfm_attention import valid_key_mask
from ._checks import check_cfm_attention

_OP = "torch_cfm::cfm_attention"
_lib = torch.library.Library("torch_cfm", "IMPL")  # noqa: TOR901 - schema comes from csrc


def empty_attention_out(q: torch.Tensor) -> torch.Tensor:
    """(N, H, Q, D) output in q.dtype stored as contiguous (N, Q, H, D)."""
    n_rows, heads, q_len, head_dim = q.shape
    return q.new_empty((n_rows, q_len, heads, head_dim)).transpose(1, 2)


def cfm_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_lengths: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
    kv_rows: Optional[torch.Tensor] = None,
    precision: str = "auto",
) -> torch.Tensor:
    """Ragged, cache-aware attention: ``softmax(q kᵀ/√D over valid keys) v`` per (row, head).

    Key j of row n is valid when ``j < key_lengths[n]`` (lengths clamped to [0, K]) and
    ``mask[n, i, j]`` is True; a query with no valid key returns exactly 0 (never NaN). With
    ``kv_rows``, query row n reads keys/values from pool row ``kv_rows[n]`` (clamped to [0, R)).
    FP16/BF16 use tensor-core dots with FP32 accumulation and softmax; FP32 uses ``precision``.

    Args:
        q: (N, H, Q, D) float16 | bfloat16 | float32, any strides (e.g. a transposed view).
        k: (N, H, K, D), or (R, H, K, D) with kv_rows; q's dtype and device, any strides
            (e.g. ``cache[..., :D]`` of an interleaved (N, H, K, 2D) K/V cache).
        v: like k (e.g. ``cache[..., D:]``).
        key_lengths: optional (N,) int32. Keys at index >= key_lengths[n] are ignored.
        mask: optional bool (N, Q, K), True = attend, broadcast over heads; expanded
            (stride-0) masks are read in place. ANDed with key_lengths.
        kv_rows: optional (N,) int32 pool row of each query row.
        precision: fp32 dots: "tf32", "ieee", or "auto" (= torch.backends.cuda.matmul TF32
            setting, or env TORCH_CFM_TF32, at call/trace time). Ignored for fp16/bf16.
    Returns:
        (N, H, Q, D) in q.dtype, stored as contiguous (N, Q, H, D), so
        ``out.transpose(1, 2).reshape(N, Q, H * D)`` is free.
    Shapes: N rows, H heads, Q queries, K keys, D in {16, 32, 64, 128}, R pool rows.
    Devices: CPU -> C++ reference; CUDA SM80+ -> Triton; older CUDA -> SDPA
        (``torch_cfm.explain()`` prints the choice for this machine).
    Raises:
        ValueError: bad rank/shape/dtype/device of any argument (the message names it), in
            eager and under torch.compile (fake kernel).
    Graph safety: no host sync, allocates only the output, CUDA-graph capturable.
    Example:
        >>> q = torch.randn(2, 8, 50, 64)
        >>> cache = torch.randn(2, 8, 450, 128)          # K | V interleaved
        >>> lengths = torch.tensor([450, 300], dtype=torch.int32)
        >>> out = cfm_attention(q, cache[..., :64], cache[..., 64:], key_lengths=lengths)
        >>> out.shape
        torch.Size([2, 8, 50, 64])
    """
    check_cfm_attention(q, k, v, key_lengths, mask, kv_rows, precision)
    return torch.ops.torch_cfm.cfm_attention.default(q, k, v, key_lengths, mask, kv_rows, precision)


@torch.library.register_fake(_OP)
def _cfm_attention_fake(q, k, v, key_lengths=None, mask=None, kv_rows=None, precision="auto"):
    check_cfm_attention(q, k, v, key_lengths, mask, kv_rows, precision)
    return empty_attention_out(q)


def _cfm_attention_autocast(device_type: str):
    def autocast_impl(q, k, v, key_lengths=None, mask=None, kv_rows=None, precision="auto"):
        dtype = torch.get_autocast_dtype(device_type)
        q, k, v = (t.to(dtype) if t.is_floating_point() else t for t in (q, k, v))
        with torch.autocast(device_type, enabled=False):
            return torch.ops.torch_cfm.cfm_attention.default(q, k, v, key_lengths, mask, kv_rows, precision)

    return autocast_impl


_lib.impl("cfm_attention", _cfm_attention_autocast("cuda"), "AutocastCUDA")
_lib.impl("cfm_attention", _cfm_attention_autocast("cpu"), "AutocastCPU")


def cfm_attention_sdpa(q, k, v, key_lengths, mask, kv_rows, out: torch.Tensor) -> torch.Tensor:
    """Fallback for CUDA below SM80: SDPA with a dense mask; fully masked rows zeroed."""
    if kv_rows is not None:
        rows = kv_rows.long().clamp(0, k.shape[0] - 1)
        k, v = k.index_select(0, rows), v.index_select(0, rows)
    if k.shape[2] == 0:
        return out.zero_()
    keep = valid_key_mask(q.shape[0], q.shape[2], k.shape[2], q.device, key_lengths, mask)
    if key_lengths is not None:  # padding frames may hold NaN: never let them reach a product
        padding = torch.arange(k.shape[2], device=q.device)[None, :] >= key_lengths.long().clamp(0, k.shape[2])[:, None]
        k = k.masked_fill(padding[:, None, :, None], 0)
        v = v.masked_fill(padding[:, None, :, None], 0)
    res = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    if keep is not None:
        res = torch.where(keep.any(dim=-1, keepdim=True), res, torch.zeros((), dtype=res.dtype, device=res.device))
    out.copy_(res)
    return out


def _cfm_attention_cuda(q, k, v, key_lengths=None, mask=None, kv_rows=None, precision="auto"):
    check_cfm_attention(q, k, v, key_lengths, mask, kv_rows, precision)
    out = empty_attention_out(q)
    if out.numel() == 0:
        return out
    decision = policy.decide(q.device, q.dtype)
    if decision.backend != "sm80":
        return cfm_attention_sdpa(q, k, v, key_lengths, mask, kv_rows, out)
    precision = policy.resolve_precision(q.dtype, precision)
    config = select_cuda_kernel_config(q, k, v, precision)
    if config is not None:
        from ..kernels.cfm_attention_cuda import cfm_attention_cuda

        return cfm_attention_cuda(q, k, v, key_lengths, mask, kv_rows, out, config)
    from ..kernels.cfm_attention import cfm_attention_triton

    return cfm_attention_triton(q, k, v, key_lengths, mask, kv_rows, precision, out)


def select_cuda_kernel_config(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, precision: Optional[str]):
    """The SM80+ kernel choice of one validated call: a ``CudaAttentionConfig`` when the hand-written
    CUDA kernel runs it, None when the Triton kernel does.

    Follows env ``TORCH_CFM_ATTENTION_KERNEL`` (:func:`torch_cfm.policy.attention_kernel_choice`):
    "auto" takes the CUDA kernel where it covers the call, its tile rule picks it and the picked
    config's shared memory fits the GPU; "triton" never; "cuda" always (ValueError naming the
    reasons where it does not cover the call or the config does not fit).
    ``precision`` is the resolved one ("tf32" | "ieee" for float32, None for 16-bit).
    """
    choice = policy.attention_kernel_choice()
    if choice == "triton":
        return None
    from ..kernels import cfm_attention_cuda as cuda_kernel
    from ..kernels._launch import sm_count

    reasons = cuda_kernel.not_supported_reasons(q, k, v, precision)
    if reasons:
        if choice == "cuda":
            raise ValueError(f"cfm_attention: {policy.ENV_ATTENTION_KERNEL}=cuda, but the CUDA kernel does not "
                             f"cover this call: {'; '.join(reasons)}")
        return None
    config = cuda_kernel.choose_config(q.dtype, q.shape[0] * q.shape[1], q.shape[2], k.shape[2], sm_count(q.device))
    if config is None and choice == "cuda":
        config = cuda_kernel.default_config(q.dtype)
    why_not = None if config is None else cuda_kernel.config_device_reason(config, q.dtype, q.device)
    if why_not is not None:  # e.g. the 150 KB configs on SM86/89 GPUs (99 KB per CTA)
        if choice == "cuda":
            raise ValueError(f"cfm_attention: {policy.ENV_ATTENTION_KERNEL}=cuda, but {why_not}")
        return None
    return config


_lib.impl("cfm_attention", _cfm_attention_cuda, "CUDA")
