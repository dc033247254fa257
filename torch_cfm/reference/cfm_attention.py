"""Reference math of ``cfm_attention`` (docs/design.md §4): plain PyTorch, any float dtype incl. float64."""

from __future__ import annotations

import math
from typing import Optional

import torch


def valid_key_mask(
    n_rows: int,
    q_len: int,
    k_len: int,
    device: torch.device,
    key_lengths: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
) -> Optional[torch.Tensor]:
    """(N, 1, Q, K) bool of keys each query may see, or None when everything is visible."""
    keep: Optional[torch.Tensor] = None
    if key_lengths is not None:
        lengths = key_lengths.to(device=device, dtype=torch.int64).clamp(0, k_len)
        keep = torch.arange(k_len, device=device)[None, None, :] < lengths[:, None, None]
        keep = keep.expand(n_rows, q_len, k_len)
    if mask is not None:
        keep = mask if keep is None else keep & mask
    return None if keep is None else keep[:, None]


def cfm_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_lengths: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
    kv_rows: Optional[torch.Tensor] = None,
    compute_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``softmax(q kᵀ/√D over valid keys) v``; a query with no valid key gives exactly 0.

    Args:
        q: (N, H, Q, D) float.
        k, v: (N, H, K, D), or (R, H, K, D) pools when ``kv_rows`` is given.
        key_lengths: optional (N,) integer; keys at index >= key_lengths[n] are invalid
            (clamped to [0, K]).
        mask: optional bool (N, Q, K), True = attend; combined with key_lengths by logical and.
        kv_rows: optional (N,) integer; query row n reads pool row kv_rows[n] (clamped to [0, R)).
        compute_dtype: dtype of the math (default: fp32 for fp16/bf16/fp32 input, else the
            input dtype, e.g. float64 for the oracle).
    Returns:
        (N, H, Q, D) in q.dtype (contiguous).
    """
    if compute_dtype is None:
        compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if kv_rows is not None:
        rows = kv_rows.to(device=k.device, dtype=torch.int64).clamp(0, k.shape[0] - 1)
        k, v = k.index_select(0, rows), v.index_select(0, rows)
    n_rows, _, q_len, head_dim = q.shape
    k_len = k.shape[2]
    if k_len == 0:
        return q.new_zeros(q.shape)
    qf, kf, vf = (t.to(compute_dtype) for t in (q, k, v))
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * (1.0 / math.sqrt(head_dim))
    keep = valid_key_mask(n_rows, q_len, k_len, q.device, key_lengths, mask)
    if key_lengths is not None:
        # Frames past a row's length are padding (any value, NaN included): never read them.
        lengths = key_lengths.to(device=q.device, dtype=torch.int64).clamp(0, k_len)
        padding = torch.arange(k_len, device=q.device)[None, :] >= lengths[:, None]
        vf = vf.masked_fill(padding[:, None, :, None], 0.0)
        kf = kf.masked_fill(padding[:, None, :, None], 0.0)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    probs = torch.exp(scores - row_max)
    denom = probs.sum(dim=-1, keepdim=True)
    out = torch.matmul(probs, vf) / torch.where(denom > 0, denom, torch.ones_like(denom))
    return out.to(q.dtype)
