"""The fused body's q/k-cache kernel: q/k LayerNorm over D fused with the new attention cache write
(row n: its T_n current k|v frames, then its L_n old frames, then zeros; or, on the in-place arena,
its current frames appended behind the old ones), and its host launcher.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..config import QK_NORM_EPS
from ._launch import launch_kwargs, on_device, pdl_prologue


@triton.jit
def _dit_qk_cache_kernel(
    qkv_ptr, stride_qkv,        # (N*T, 3*H*D) packed q | k | v GEMM output
    qn_w_ptr, qn_b_ptr, kn_w_ptr, kn_b_ptr,  # (D,) q/k LayerNorm affine
    q_out_ptr,                  # (N, T, H, D) contiguous normalised queries
    old_ptr, s_old_n, s_old_h, s_old_f, s_old_e,   # (N, H, L, 2D) old cache [HAS_OLD]
    new_ptr, s_new_n, s_new_h, s_new_f, s_new_e,   # (N, H, T+L, 2D) new cache
    valid_ptr, cached_ptr,      # (N,) int32 clamped T_n, L_n
    T, L, H, eps,
    HAS_OLD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_F: tl.constexpr,
    APPEND: tl.constexpr, USE_PDL: tl.constexpr,
):
    """q/k LayerNorm, queries out, and the new cache of one (row, head, frame tile). APPEND (the
    in-place arena, :func:`dit_body_triton` with ``arena=True``): the cache already holds the row's
    L_n old frames at [0, L_n) in reversed key order; current frame f goes to L_n + T_n - 1 - f and
    nothing else is written."""
    pid_nh = tl.program_id(0)
    pid_f = tl.program_id(1)
    n = (pid_nh // H).to(tl.int64)
    h = pid_nh % H
    f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    d = tl.arange(0, HEAD_DIM)
    inner = H * HEAD_DIM
    # Body inputs (lengths, the old cache) and weights: loaded before the PDL wait (the QKV GEMM in
    # front of this kernel writes none of them; _launch.pdl_prologue)
    tn = tl.load(valid_ptr + n)
    ln = tl.load(cached_ptr + n)
    is_q = f < T
    in_cur = f < tn
    j = f - tn
    in_old = (f >= tn) & (j < ln)
    in_new = f < T + L
    row = (n * T + f)[:, None] * stride_qkv
    qn_w = tl.load(qn_w_ptr + d).to(tl.float32)[None, :]
    qn_b = tl.load(qn_b_ptr + d).to(tl.float32)[None, :]
    kn_w = tl.load(kn_w_ptr + d).to(tl.float32)[None, :]
    kn_b = tl.load(kn_b_ptr + d).to(tl.float32)[None, :]
    if HAS_OLD:
        om = in_old[:, None]
        o_base = old_ptr + n * s_old_n + h * s_old_h + j.to(tl.int64)[:, None] * s_old_f
        ko = tl.load(o_base + d[None, :] * s_old_e, mask=om, other=0.0).to(tl.float32)
        vo = tl.load(o_base + (HEAD_DIM + d)[None, :] * s_old_e, mask=om, other=0.0).to(tl.float32)
    pdl_prologue(USE_PDL)

    qm = is_q[:, None]
    cm = in_cur[:, None]
    xq = tl.load(qkv_ptr + row + (h * HEAD_DIM + d)[None, :], mask=qm, other=0.0).to(tl.float32)
    # k and v loaded with q, before the queries' store (a load may not move past a store that could alias it)
    xk = tl.load(qkv_ptr + row + (inner + h * HEAD_DIM + d)[None, :], mask=cm, other=0.0).to(tl.float32)
    vv = tl.load(qkv_ptr + row + (2 * inner + h * HEAD_DIM + d)[None, :], mask=cm, other=0.0).to(tl.float32)

    # queries: LayerNorm over D (affine), every current frame (padding queries included)
    mu = tl.sum(xq, axis=1) / HEAD_DIM
    xc = xq - mu[:, None]
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / HEAD_DIM + eps)
    qv = xc * rstd[:, None] * qn_w + qn_b
    q_off = ((n * T + f) * inner)[:, None] + (h * HEAD_DIM + d)[None, :]
    tl.store(q_out_ptr + q_off, qv.to(q_out_ptr.dtype.element_ty), mask=qm)

    # keys/values of the new cache: current frames (k normalised), then old frames, then zeros
    mu = tl.sum(xk, axis=1) / HEAD_DIM
    xc = xk - mu[:, None]
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / HEAD_DIM + eps)
    kv = xc * rstd[:, None] * kn_w + kn_b
    if HAS_OLD:
        kv = tl.where(cm, kv, ko)
        vv = tl.where(cm, vv, vo)
    else:
        kv = tl.where(cm, kv, 0.0)
    pos = f
    if APPEND:
        nm = in_cur[:, None]
        pos = ln + tn - 1 - f
    else:
        nm = in_new[:, None]
    n_base = new_ptr + n * s_new_n + h * s_new_h + pos.to(tl.int64)[:, None] * s_new_f
    tl.store(n_base + d[None, :] * s_new_e, kv.to(new_ptr.dtype.element_ty), mask=nm)
    tl.store(n_base + (HEAD_DIM + d)[None, :] * s_new_e, vv.to(new_ptr.dtype.element_ty), mask=nm)


def qk_cache(qkv: torch.Tensor, norms: tuple[torch.Tensor, ...], q_out: torch.Tensor,
             old: Optional[torch.Tensor], new: torch.Tensor, valid: torch.Tensor, cached: torch.Tensor,
             *, n_rows: int, t_len: int, heads: int, head_dim: int, append: bool = False,
             pdl: bool = False) -> None:
    """Launch ``_dit_qk_cache_kernel``: q/k LayerNorm + the new (N, H, T+L, 2D) cache of one block.

    ``append``: ``new`` is a block
    of the in-place arena (N, H, P, 2D) holding L_n old frames in reversed key order; the T_n
    current frames are written behind them, reversed too (``old`` must be None). ``pdl``: launch with
    programmatic dependent launch (the caller's plan)."""
    if append and old is not None:
        raise ValueError("qk_cache: append takes old=None (the old frames are not copied)")
    l_len = 0 if old is None else old.shape[2]
    total = t_len + l_len
    if n_rows == 0 or total == 0:
        return
    block_f = 32 if head_dim <= 64 else 16
    o = old if old is not None else new
    grid = (n_rows * heads, triton.cdiv(total, block_f))
    with on_device(qkv.device):
        _dit_qk_cache_kernel[grid](
            qkv, qkv.stride(0), *norms, q_out,
            o, o.stride(0), o.stride(1), o.stride(2), o.stride(3),
            new, new.stride(0), new.stride(1), new.stride(2), new.stride(3),
            valid, cached, t_len, l_len, heads, QK_NORM_EPS,
            HAS_OLD=old is not None and l_len > 0, HEAD_DIM=head_dim, BLOCK_F=block_f, APPEND=append,
            USE_PDL=pdl, num_warps=4, **launch_kwargs(pdl))
