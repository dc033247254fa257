"""One Triton kernel for a DiT block's attention *and* its new attention cache (the body plan
"fused_attention").

The plan "cublas" runs two kernels per block between the QKV GEMM and the proj GEMM:
``_dit_qk_cache_kernel`` (q/k LayerNorm over D, the new (N, H, T+L, 2D) cache written whole:
current frames, then the old ones, then zeros) and ``cfm_attention`` over that new cache.
``_dit_attention_cache_kernel`` does both in one launch with two kinds of program:

* attention programs, one per (row, head, query tile): normalise their queries in registers, walk
  the current frames f < T_n (k normalised in registers, ``BLOCK_C`` frames at a time; query tile 0
  also writes them into the new cache), then the old frames j < L_n where they are, in the old
  cache, with ``cfm_attention``'s tile step (key order does not matter to the math). FP32
  statistics, ``exp2`` with the log2(e)/sqrt(D) scale folded in; a row with no valid key gets
  exactly 0.
* copy programs, one per (row, head, ``COPY_F`` frames of the new cache): frames T_n <= f < T + L
  get old frame f - T_n below T_n + L_n and zeros beyond. They depend on nothing the attention
  programs compute, so the copy runs beside the key walks.

Every frame of the new cache is written exactly once. Same math and rounding points as the two
kernels (q and k rounded to the compute dtype before the dots, the cache stores what the dots
read), so it is checked against the same docs/design.md §6 oracle. The tuning table
(:mod:`torch_cfm.kernels.body_plans`) picks it for 16-bit bodies of N >= 32 rows, where both forms
are bound by the new cache's copy traffic.

APPEND (the in-place arena, :func:`torch_cfm.kernels.dit_body.dit_body_triton` with ``arena=True``;
the plan "fused_attention_warp_rownorm"): the cache is an arena block (N, H, P, 2D) already holding
row n's L_n old frames at [0, L_n) in reversed key order. Attention programs only: query tile 0
writes current frame f at L_n + T_n - 1 - f (as ``_dit_qk_cache_kernel``'s APPEND), every tile
walks the current frames in registers and the old frames in place at [0, L_n), which no program
writes in this launch (a tile never reads [L_n, L_n + T_n), which tile 0 is writing). Nothing else
is written.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ..config import QK_NORM_EPS
from ._launch import launch_kwargs, on_device, pdl_prologue
from .cfm_attention import _cfm_attention_fwd_inner

LOG2E = 1.4426950408889634


@triton.jit
def _layer_norm_rows(x, w_ptr, b_ptr, offs_d, eps, HEAD_DIM: tl.constexpr):
    """LayerNorm of each row of x (rows, D) float32 over D, with the (D,) affine."""
    mu = tl.sum(x, axis=1) / HEAD_DIM
    xc = x - mu[:, None]
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / HEAD_DIM + eps)
    return (xc * rstd[:, None] * tl.load(w_ptr + offs_d).to(tl.float32)[None, :]
            + tl.load(b_ptr + offs_d).to(tl.float32)[None, :])


@triton.jit
def _store_tile(new_base, f, k, v, ok, s_new_f, s_new_e, offs_d, HEAD_DIM: tl.constexpr):
    rows = new_base + f.to(tl.int64)[:, None] * s_new_f
    tl.store(rows + offs_d[None, :] * s_new_e, k, mask=ok[:, None])
    tl.store(rows + (HEAD_DIM + offs_d)[None, :] * s_new_e, v, mask=ok[:, None])


@triton.jit
def _attend_tile(q, k, v, f, length, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr):
    """Online-softmax update with one key tile (keys f >= length ignored)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    s = tl.where((f < length)[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s * qk_scale - m_ref[:, None])
    alpha = tl.math.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _copy_old_frames(old_ptr, s_old_n, s_old_h, s_old_f, s_old_e, new_ptr, s_new_n, s_new_h, s_new_f, s_new_e,
                     valid_ptr, cached_ptr, c, f_chunks, H, T, L,
                     HAS_OLD: tl.constexpr, HEAD_DIM: tl.constexpr, COPY_F: tl.constexpr, USE_PDL: tl.constexpr):
    """Copy program ``c``: frames ``[chunk·COPY_F, (chunk+1)·COPY_F) ∩ [T_n, T+L)`` of one (row, head)
    of the new cache: old frame ``f - T_n`` below ``T_n + L_n``, zeros beyond."""
    chunk = c % f_chunks
    nh = c // f_chunks
    n = (nh // H).to(tl.int64)
    h = nh % H
    tn = tl.load(valid_ptr + n)
    ln = tl.load(cached_ptr + n) if HAS_OLD else 0
    pdl_prologue(USE_PDL)
    f = chunk * COPY_F + tl.arange(0, COPY_F)
    offs_e = tl.arange(0, 2 * HEAD_DIM)
    mine = (f >= tn) & (f < T + L)  # frames below T_n hold current keys: the attention programs' part
    j = f - tn
    x = tl.zeros([COPY_F, 2 * HEAD_DIM], dtype=new_ptr.dtype.element_ty)
    if HAS_OLD:
        src = old_ptr + n * s_old_n + h * s_old_h + j.to(tl.int64)[:, None] * s_old_f + offs_e[None, :] * s_old_e
        x = tl.load(src, mask=(mine & (j < ln))[:, None], other=0.0).to(new_ptr.dtype.element_ty)
    dst = new_ptr + n * s_new_n + h * s_new_h + f.to(tl.int64)[:, None] * s_new_f + offs_e[None, :] * s_new_e
    tl.store(dst, x, mask=mine[:, None])


@triton.jit(do_not_specialize=["T", "L", "H", "q_tiles", "n_attn", "f_chunks"])
def _dit_attention_cache_kernel(
    qkv_ptr, stride_qkv,        # (N*T, 3*H*D) packed q | k | v GEMM output (bias included)
    qn_w_ptr, qn_b_ptr, kn_w_ptr, kn_b_ptr,  # (D,) q/k LayerNorm affine
    old_ptr, s_old_n, s_old_h, s_old_f, s_old_e,   # (N, H, L, 2D) old cache [HAS_OLD]; APPEND: the arena
    new_ptr, s_new_n, s_new_h, s_new_f, s_new_e,   # (N, H, T+L, 2D) new cache (written); APPEND: (N, H, P, 2D) arena
    out_ptr,                    # (N, T, H, D) contiguous attention output (written)
    valid_ptr, cached_ptr,      # (N,) int32 T_n, L_n, already clamped to [0, T] / [0, L] (APPEND: [0, P - T])
    T, L, H, q_tiles, n_attn, f_chunks, eps, qk_scale,
    HAS_OLD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_C: tl.constexpr, COPY_F: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
    APPEND: tl.constexpr,
):
    pid = tl.program_id(0)
    if not APPEND and pid >= n_attn:  # APPEND: attention programs only (the grid has no copy programs)
        _copy_old_frames(old_ptr, s_old_n, s_old_h, s_old_f, s_old_e, new_ptr, s_new_n, s_new_h, s_new_f, s_new_e,
                         valid_ptr, cached_ptr, pid - n_attn, f_chunks, H, T, L, HAS_OLD, HEAD_DIM, COPY_F, USE_PDL)
    else:
        q_tile = pid % q_tiles
        nh = pid // q_tiles
        n = (nh // H).to(tl.int64)
        h = nh % H
        offs_d = tl.arange(0, HEAD_DIM)
        inner = H * HEAD_DIM
        # the lengths are body inputs, not written by the QKV GEMM in front: read before the PDL wait
        tn = tl.load(valid_ptr + n)
        ln = tl.load(cached_ptr + n) if HAS_OLD else 0
        pdl_prologue(USE_PDL)
        cdt = new_ptr.dtype.element_ty

        # queries (every current frame, padding queries included, as qk_cache): LayerNorm over D, rounded
        # to the compute dtype as qk_cache's query buffer is
        tq = q_tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
        q_ok = tq < T
        x = tl.load(qkv_ptr + (n * T + tq)[:, None] * stride_qkv + (h * HEAD_DIM + offs_d)[None, :],
                    mask=q_ok[:, None], other=0.0).to(tl.float32)
        q = _layer_norm_rows(x, qn_w_ptr, qn_b_ptr, offs_d, eps, HEAD_DIM).to(cdt)

        m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
        acc = tl.zeros([BLOCK_Q, HEAD_DIM], dtype=tl.float32)
        write_cache = q_tile == 0  # current frames of the new cache: written by query tile 0 only

        # 1. the current frames f < T_n (k normalised in registers), BLOCK_C at a time: they are the
        #    new cache's first T_n frames (APPEND: the arena's frames L_n + T_n - 1 - f, which no tile
        #    reads back). Small tiles: the k LayerNorm keeps a (BLOCK_C, D) fp32 block live.
        new_base = new_ptr + n * s_new_n + h * s_new_h
        offs_c = tl.arange(0, BLOCK_C)
        for k0 in range(0, tn, BLOCK_C):
            f = k0 + offs_c
            pos = f
            if APPEND:
                pos = ln + tn - 1 - f
            cur = f < tn
            krow = (n * T + f)[:, None] * stride_qkv
            kx = tl.load(qkv_ptr + krow + (inner + h * HEAD_DIM + offs_d)[None, :], mask=cur[:, None], other=0.0)
            k = _layer_norm_rows(kx.to(tl.float32), kn_w_ptr, kn_b_ptr, offs_d, eps, HEAD_DIM).to(cdt)
            v = tl.load(qkv_ptr + krow + (2 * inner + h * HEAD_DIM + offs_d)[None, :], mask=cur[:, None],
                        other=0.0).to(cdt)
            if write_cache:
                _store_tile(new_base, pos, k, v, cur, s_new_f, s_new_e, offs_d, HEAD_DIM)
            m_i, l_i, acc = _attend_tile(q, k, v, f, tn, m_i, l_i, acc, qk_scale, DOT_PRECISION)
        # 2. the old frames j < L_n, read where they are (the old cache, APPEND: the arena's [0, L_n);
        #    key order does not matter), with cfm_attention's tile step: whole tiles unmasked, then at
        #    most one masked tail tile (its loads masked to j < L_n). The copy into the new cache is the
        #    copy programs' work, in parallel with this walk; APPEND copies nothing.
        if HAS_OLD:
            offs_k = tl.arange(0, BLOCK_K)
            old_base = old_ptr + n * s_old_n + h * s_old_h
            j_mid = (ln // BLOCK_K) * BLOCK_K
            # arguments: q whole (QK_SLABS = 1), k/v = the halves of the old cache rows, no mask
            # (HAS_MASK = False: m_base and its strides unused), then MASK_KEYS off / on
            for j0 in range(0, j_mid, BLOCK_K):
                m_i, l_i, acc = _cfm_attention_fwd_inner(
                    q, q, q, q, m_i, l_i, acc, j0, ln, old_base, old_base + HEAD_DIM * s_old_e, old_base, tq, q_ok,
                    offs_d, offs_k, s_old_f, s_old_e, s_old_f, s_old_e, 0, 0, qk_scale, 0.0,
                    False, False, DOT_PRECISION, 1)
            for j0 in range(j_mid, ln, BLOCK_K):
                m_i, l_i, acc = _cfm_attention_fwd_inner(
                    q, q, q, q, m_i, l_i, acc, j0, ln, old_base, old_base + HEAD_DIM * s_old_e, old_base, tq, q_ok,
                    offs_d, offs_k, s_old_f, s_old_e, s_old_f, s_old_e, 0, 0, qk_scale, 0.0,
                    False, True, DOT_PRECISION, 1)

        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # no valid key: acc = 0 -> exactly 0
        tl.store(out_ptr + ((n * T + tq) * inner + h * HEAD_DIM)[:, None] + offs_d[None, :], o.to(cdt),
                 mask=q_ok[:, None])


# Launch parameters by compute-dtype family: 16-bit: cfm_attention's tiles (64-key steps, 4 warps,
# 3 stages); fp32: 32-key steps; 16-frame tiles for the current frames; copy programs of 64 (16-bit) /
# 32 (fp32) frames. A body plan may replace any of them (BodyPlan.attention_launch).
LAUNCH = {"16bit": dict(block_k=64, block_c=16, copy_f=64, num_warps=4, num_stages=3),
          "fp32": dict(block_k=32, block_c=16, copy_f=32, num_warps=4, num_stages=2)}


def attention_tiles(dtype: torch.dtype, head_dim: int, t_len: int, launch: Optional[dict] = None) -> dict:
    """Launch parameters: the query tiles of the "cublas" plan's attention (wgmma-sized for 16-bit
    inputs) and :data:`LAUNCH`, with ``launch``'s entries in place of theirs."""
    block_q = 16 if t_len <= 16 else 32 if (t_len <= 32 or dtype == torch.float32) else 64
    cfg = dict(LAUNCH["fp32" if dtype == torch.float32 else "16bit"], block_q=block_q)
    cfg.update(launch or {})
    if head_dim > 64:
        cfg["block_k"] = min(cfg["block_k"], 32)
    return cfg


def attention_cache(qkv: torch.Tensor, norms: tuple[torch.Tensor, ...], old: Optional[torch.Tensor],
                    new: torch.Tensor, out: torch.Tensor, valid: torch.Tensor, cached: torch.Tensor, *,
                    n_rows: int, t_len: int, heads: int, head_dim: int, dot_precision: str,
                    append: bool = False, pdl: bool = False, launch: Optional[dict] = None) -> None:
    """Launch ``_dit_attention_cache_kernel`` for one block (sync-free, graph-capturable).

    Args:
        qkv: (N*T, 3*H*D) packed q | k | v (the QKV GEMM output, bias included), compute dtype.
        norms: (q_w, q_b, k_w, k_b), each (D,).
        old: (N, H, L, 2D) old cache in the compute dtype, or None (L = 0; with ``append``: None).
        new: (N, H, T+L, 2D) new cache, written whole (current frames, old frames, zeros); with
            ``append``: an arena block (N, H, P, 2D), P >= T, holding row n's L_n old frames at
            [0, L_n) in reversed key order, read in place; the T_n current frames are written at
            L_n + T_n - 1 - f and nothing else (the module docstring's APPEND).
        out: (N, T, H, D) contiguous attention output.
        valid, cached: (N,) int32 T_n, L_n, already clamped (with ``append``: L_n to [0, P - T]).
        dot_precision: Triton ``input_precision`` ("tf32" for 16-bit inputs, "tf32" | "tf32x3" |
            "ieee" for float32).
        append: the in-place arena form (attention programs only, no copy programs).
        pdl: launch with programmatic dependent launch (the caller's rule; the lengths are read
            before the wait, so the kernel in front must not write ``valid``/``cached``).
        launch: launch parameters in place of :func:`attention_tiles`' (block_q, block_k, block_c,
            copy_f, num_warps, num_stages; copy_f unused with ``append``).
    """
    if append and old is not None:
        raise ValueError("attention_cache: append takes old=None (the old frames are read in the arena)")
    l_len = (new.shape[2] - t_len) if append else (0 if old is None else old.shape[2])
    if n_rows == 0 or t_len + l_len == 0 or (append and t_len == 0):  # append: no current frame, nothing to do
        return
    if not out.is_contiguous():
        raise ValueError("attention_cache: out must be a contiguous (N, T, H, D) buffer")
    cfg = attention_tiles(new.dtype, head_dim, t_len, launch)
    q_tiles = triton.cdiv(t_len, cfg["block_q"])
    n_attn = n_rows * heads * q_tiles
    f_chunks = 0 if append else triton.cdiv(t_len + l_len, cfg["copy_f"])
    # the old frames: the old cache, or in place in the arena (none where it has no room for any)
    o = new if append else (old if old is not None and l_len > 0 else new)
    has_old = l_len > 0 if append else o is not new
    with on_device(qkv.device):
        _dit_attention_cache_kernel[(n_attn + n_rows * heads * f_chunks,)](
            qkv, qkv.stride(0), *norms,
            o, o.stride(0), o.stride(1), o.stride(2), o.stride(3),
            new, new.stride(0), new.stride(1), new.stride(2), new.stride(3),
            out, valid, cached, t_len, l_len, heads, q_tiles, n_attn, f_chunks, QK_NORM_EPS,
            LOG2E / math.sqrt(head_dim),
            HAS_OLD=has_old, HEAD_DIM=head_dim, BLOCK_Q=cfg["block_q"], BLOCK_K=cfg["block_k"],
            BLOCK_C=cfg["block_c"], COPY_F=cfg["copy_f"], DOT_PRECISION=dot_precision, USE_PDL=pdl,
            APPEND=append, num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"], **launch_kwargs(pdl))
