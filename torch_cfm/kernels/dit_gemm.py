"""A Triton GEMM with the DiT body's normalisations fused into its prologue and epilogue.

Used by the "v3" variant of :func:`torch_cfm.kernels.dit_body.dit_body_triton` (7 kernels per
block: QKV, attention, proj, conv 1, conv 2, fc1, fc2). No torch.library here.

``out = A' @ W^T`` where the A' tile is produced on the fly (``A_MODE``):

* 0: plain A, any (n, t, k) strides (attention output, GELU activations, the staged input);
* 1: adaLN of the float32 residual ``h``: ``(h - mean) * rstd * (1 + scale) + shift``; the row
  statistics come from the per-tile partial (sum, M2) pairs the previous epilogue wrote, combined
  with Chan's parallel formula (float32);
* 2: causal conv 1 as an implicit GEMM over the (2+T)-frame history: K runs over 3 taps x C;
  history frames 0, 1 come from the old conv cache, the others are adaLN(h) of earlier frames;
* 3: causal conv 2 likewise, the history being Mish(LayerNorm_affine(u)) of conv 1's output u.

Modes 2/3 also emit the new conv cache (history frames T_n, T_n+1 of each row) from the programs
of the first column tile. Epilogues (``EPI``): 0 store (+bias) with (n, t, col) strides; 1 GELU
(tanh); 2 packed QKV -> q/k LayerNorm per head, q stored, current k|v frames t < T_n written to
the new attention cache; 3 residual ``h = h + gate * (acc + bias)`` plus its partial row
statistics; 4 ``u = acc + bias`` (float32) plus partial statistics.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._launch import on_device
from .dit_body import _qkv_head_epilogue


@triton.jit
def _gelu_tanh(x):
    u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))


@triton.jit
def _mish(z):
    e = tl.exp(tl.minimum(z, 20.0))
    p = e * (e + 2.0)
    return tl.where(z > 20.0, z, z * p / (p + 2.0))


@triton.jit
def _row_stats(stats_ptr, rows, ok, NT, C, eps, STAT_BN: tl.constexpr):
    """mean, rstd of full rows from per-tile (sum, M2) partials: stats (M, NT, 2) float32."""
    base = stats_ptr + rows.to(tl.int64) * (NT * 2)
    tot = rows.to(tl.float32) * 0.0
    for j in range(NT):
        tot += tl.load(base + j * 2, mask=ok, other=0.0)
    mean = tot / C
    m2 = rows.to(tl.float32) * 0.0
    for j in range(NT):
        nj = tl.minimum(C - j * STAT_BN, STAT_BN).to(tl.float32)
        s = tl.load(base + j * 2, mask=ok, other=0.0)
        q = tl.load(base + j * 2 + 1, mask=ok, other=0.0)
        d = s / nj - mean
        m2 += q + nj * d * d
    return mean, tl.rsqrt(m2 / C + eps)


@triton.jit
def _src_rows(src_ptr, rows, ok, kk, k_ok, mean, rstd, n, tab_ptr, stride_tab, shift_off, scale_off,
              lnw_ptr, lnb_ptr, C, MISH: tl.constexpr, TAB_ROWS: tl.constexpr):
    """Normalised source values (BLOCK, BLOCK_K) float32: adaLN(h) or Mish(LN_affine(u))."""
    m2 = ok[:, None] & k_ok[None, :]
    x = tl.load(src_ptr + rows.to(tl.int64)[:, None] * C + kk[None, :], mask=m2, other=0.0)
    z = (x - mean[:, None]) * rstd[:, None]
    if MISH:
        z = z * tl.load(lnw_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)[None, :] \
            + tl.load(lnb_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        z = _mish(z)
    elif TAB_ROWS:  # one table per row
        tab = tab_ptr + n[:, None] * stride_tab + kk[None, :]
        z = z * tl.load(tab + scale_off, mask=m2, other=0.0) + tl.load(tab + shift_off, mask=m2, other=0.0)
    else:  # one table shared by every row: 1-D vectors, broadcast
        z = z * tl.load(tab_ptr + scale_off + kk, mask=k_ok, other=0.0)[None, :] \
            + tl.load(tab_ptr + shift_off + kk, mask=k_ok, other=0.0)[None, :]
    return z


@triton.jit
def _dit_fused_gemm_kernel(
    a_ptr, s_a_n, s_a_t, s_a_k,                 # A_MODE 0: A[m, k] = a[n, t, k]
    src_ptr, sstats_ptr,                        # A_MODE 1-3: (M, C) float32 source + its (M, NT, 2) stats
    tab_ptr, stride_tab, shift_off, scale_off,  # A_MODE 1/2: modulation table (1 + scale stored)
    lnw_ptr, lnb_ptr,                           # A_MODE 3: LayerNorm affine between the convs
    cnn_ptr, s_cnn_n, s_cnn_c, s_cnn_j,         # A_MODE 2/3: old conv cache (N, 2C, 2) [HAS_CNN]
    emit_ptr, s_emit_n, s_emit_c, s_emit_j,     # A_MODE 2/3: new conv cache (N, 2C, 2)
    cnn_base,                                   # channel base of this conv in both conv caches
    w_ptr, s_w_n, s_w_k, s_w_tap,               # W[n_out, k] (+ tap * s_w_tap)
    bias_ptr,                                   # (NOUT,)
    c_ptr, s_c_n, s_c_t, s_c_col,               # output (EPI 0/1/3/4) or q_out (EPI 2)
    gate_off,                                   # EPI 3: gate vector offset in a table row
    ostats_ptr,                                 # EPI 3/4: (M, NT, 2) partial stats out
    qn_w_ptr, qn_b_ptr, kn_w_ptr, kn_b_ptr,     # EPI 2: q/k LayerNorm affine
    new_ptr, s_new_n, s_new_h, s_new_f, s_new_e,  # EPI 2: new attention cache (N, H, T+L, 2D)
    valid_ptr,                                  # (N,) int32 clamped T_n
    M, NOUT, K, T, C, NT, H, eps_a, eps_qk,
    A_MODE: tl.constexpr, EPI: tl.constexpr, HAS_RES: tl.constexpr, HAS_GATE: tl.constexpr,
    HAS_CNN: tl.constexpr, TAB_ROWS: tl.constexpr, A_ROWMAJOR: tl.constexpr, OUT_ROWMAJOR: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, STAT_BN: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < NOUT
    n = (offs_m // T).to(tl.int64)
    t = offs_m % T
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * s_w_n
    dtype = w_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)

    if A_MODE == 0:
        if A_ROWMAJOR:  # s_a_n == T * s_a_t: row m at m * s_a_t (keeps contiguity visible)
            a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * s_a_t
        else:
            a_rows = a_ptr + n[:, None] * s_a_n + t.to(tl.int64)[:, None] * s_a_t
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            k_ok = kk < K
            a = tl.load(a_rows + kk[None, :] * s_a_k, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_cols + kk[:, None] * s_w_k, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(a.to(dtype), w, acc, input_precision=DOT_PRECISION)
    elif A_MODE == 1:
        mean, rstd = _row_stats(sstats_ptr, offs_m, m_ok, NT, C, eps_a, STAT_BN)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            k_ok = kk < K
            a = _src_rows(src_ptr, offs_m, m_ok, kk, k_ok, mean, rstd, n, tab_ptr, stride_tab, shift_off,
                          scale_off, lnw_ptr, lnb_ptr, C, False, TAB_ROWS)
            w = tl.load(w_cols + kk[:, None] * s_w_k, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(a.to(dtype), w, acc, input_precision=DOT_PRECISION)
    else:  # implicit causal conv over [cache(2) ; chunk]: output frame t reads history frames t, t+1, t+2
        for tap in tl.static_range(3):
            f = t + tap                       # history frame
            from_cache = m_ok & (f < 2)
            from_src = m_ok & (f >= 2)
            srow = offs_m + tap - 2           # chunk row of history frame f (same sequence n)
            mean, rstd = _row_stats(sstats_ptr, srow, from_src, NT, C, eps_a, STAT_BN)
            for k0 in range(0, C, BLOCK_K):
                kk = k0 + offs_k
                k_ok = kk < C
                a = _src_rows(src_ptr, srow, from_src, kk, k_ok, mean, rstd, n, tab_ptr, stride_tab, shift_off,
                              scale_off, lnw_ptr, lnb_ptr, C, A_MODE == 3, TAB_ROWS)
                if HAS_CNN:
                    cv = tl.load(cnn_ptr + n[:, None] * s_cnn_n + (cnn_base + kk)[None, :] * s_cnn_c
                                 + f.to(tl.int64)[:, None] * s_cnn_j,
                                 mask=from_cache[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
                    a = tl.where(from_cache[:, None], cv, a)
                else:
                    a = tl.where(from_cache[:, None], 0.0, a)
                w = tl.load(w_cols + tap * s_w_tap + kk[:, None] * s_w_k, mask=k_ok[:, None] & n_ok[None, :],
                            other=0.0)
                acc = tl.dot(a.to(dtype), w, acc, input_precision=DOT_PRECISION)
        if pid_n == 0:  # new conv cache: history frames T_n, T_n + 1 of each sequence starting here
            first = m_ok & (t == 0)
            tn = tl.load(valid_ptr + n, mask=first, other=0)
            for e in tl.static_range(2):
                f = tn + e
                c_cache = first & (f < 2)
                c_src = first & (f >= 2)
                srow = offs_m + f - 2
                mean, rstd = _row_stats(sstats_ptr, srow, c_src, NT, C, eps_a, STAT_BN)
                for k0 in range(0, C, BLOCK_K):
                    kk = k0 + offs_k
                    k_ok = kk < C
                    v = _src_rows(src_ptr, srow, c_src, kk, k_ok, mean, rstd, n, tab_ptr, stride_tab, shift_off,
                                  scale_off, lnw_ptr, lnb_ptr, C, A_MODE == 3, TAB_ROWS).to(dtype).to(tl.float32)
                    if HAS_CNN:
                        cv = tl.load(cnn_ptr + n[:, None] * s_cnn_n + (cnn_base + kk)[None, :] * s_cnn_c
                                     + f.to(tl.int64)[:, None] * s_cnn_j,
                                     mask=c_cache[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
                        v = tl.where(c_cache[:, None], cv, v)
                    else:
                        v = tl.where(c_cache[:, None], 0.0, v)
                    tl.store(emit_ptr + n[:, None] * s_emit_n + (cnn_base + kk)[None, :] * s_emit_c + e * s_emit_j,
                             v.to(emit_ptr.dtype.element_ty), mask=first[:, None] & k_ok[None, :])

    acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    ok2 = m_ok[:, None] & n_ok[None, :]
    if EPI == 0 or EPI == 1:
        if EPI == 1:
            acc = _gelu_tanh(acc)
        if OUT_ROWMAJOR:
            dst = c_ptr + offs_m.to(tl.int64)[:, None] * s_c_t + offs_n[None, :] * s_c_col
        else:
            dst = c_ptr + n[:, None] * s_c_n + t.to(tl.int64)[:, None] * s_c_t + offs_n[None, :] * s_c_col
        tl.store(dst, acc.to(c_ptr.dtype.element_ty), mask=ok2)
    elif EPI == 2:  # BLOCK_N == D: this tile is one head of q, k or v
        _qkv_head_epilogue(acc, offs_m, m_ok, pid_n * BLOCK_N, T, H, eps_qk, qn_w_ptr, qn_b_ptr, kn_w_ptr, kn_b_ptr,
                           c_ptr, new_ptr, s_new_n, s_new_h, s_new_f, s_new_e, valid_ptr, BLOCK_N)
    else:  # EPI 3 (residual) / 4 (conv-1 output): float32 rows of width C, plus partial stats
        if EPI == 3:
            if HAS_GATE:
                if TAB_ROWS:
                    acc = acc * tl.load(tab_ptr + n[:, None] * stride_tab + gate_off + offs_n[None, :], mask=ok2,
                                        other=0.0)
                else:
                    acc = acc * tl.load(tab_ptr + gate_off + offs_n, mask=n_ok, other=0.0)[None, :]
            if HAS_RES:
                acc += tl.load(c_ptr + offs_m.to(tl.int64)[:, None] * C + offs_n[None, :], mask=ok2, other=0.0)
        tl.store(c_ptr + offs_m.to(tl.int64)[:, None] * C + offs_n[None, :], acc, mask=ok2)
        nj = tl.minimum(NOUT - pid_n * BLOCK_N, BLOCK_N).to(tl.float32)
        accm = tl.where(ok2, acc, 0.0)
        s = tl.sum(accm, axis=1)
        dev = tl.where(ok2, acc - (s / nj)[:, None], 0.0)
        m2 = tl.sum(dev * dev, axis=1)
        sp = ostats_ptr + offs_m.to(tl.int64) * (NT * 2) + pid_n * 2
        tl.store(sp, s, mask=m_ok)
        tl.store(sp + 1, m2, mask=m_ok)


# --------------------------------------------------------------------------------------------
# host launcher
# --------------------------------------------------------------------------------------------

STAT_BN = 64  # column tile of every epilogue that writes row statistics (EPI 3/4)
# Tile overrides for tuning sweeps (bench/dit_step.py --sweep): keys block_m, num_warps, num_stages.
TILE_OVERRIDE: dict = {}


def linear_strides(w) -> tuple[int, int, int]:
    """``w_strides`` of a (Nout, K) linear weight (no taps)."""
    return (w.stride(0), w.stride(1), 0)


def tap_strides(w, c: int) -> tuple[int, int, int]:
    """``w_strides`` of packed conv taps (3C, C): tap j, output o, input channel at row j·C + o."""
    return (w.stride(0), w.stride(1), c * w.stride(0))


def stat_tiles(c: int) -> int:
    """NT: partial-statistics tiles per row of width C."""
    return triton.cdiv(c, STAT_BN)


def fused_gemm(*, w, w_strides, bias, out, out_strides=(0, 0, 0), m, nout, k, t_len, c, valid, a_mode, epi,
               precision, a=None, a_strides=(0, 0, 0), src=None, sstats=None, table=None, shift=0, scale=0,
               ln=None, cnn=None, emit=None, cnn_base=0, gate=None, has_res=False, ostats=None, qk=None,
               heads=1, eps_a=1e-6, eps_qk=1e-5, block_n=None) -> None:
    """Launch ``_dit_fused_gemm_kernel`` (see the module docstring for modes and arguments).

    ``qk`` = (qn_w, qn_b, kn_w, kn_b, new_cache (N, H, T+L, 2D)) for EPI 2 (``out`` = q buffer).
    """
    import torch

    if m == 0:
        return
    if epi in (3, 4):
        block_n = STAT_BN
    block_n = block_n or (128 if nout >= 1024 else 64)
    n_tiles = triton.cdiv(nout, block_n)
    block_m = 64 if m > 32 else max(16, triton.next_power_of_2(m))  # 64: one wgmma warpgroup tile
    block_m = TILE_OVERRIDE.get("block_m", block_m)
    num_warps = TILE_OVERRIDE.get("num_warps", 4)
    num_stages = TILE_OVERRIDE.get("num_stages", 3)
    fp32 = w.dtype == torch.float32
    block_k = min(32 if fp32 else 64, max(16, triton.next_power_of_2(min(k, c) if a_mode >= 2 else k)))
    dot_precision = ("tf32" if precision == "tf32" else "ieee") if fp32 else "tf32"
    dummy = bias
    tab = table if table is not None else dummy
    stride_tab = 0 if table is None or table.shape[0] == 1 else table.stride(0)
    lnw, lnb = ln if ln is not None else (dummy, dummy)
    cnn_t = cnn if cnn is not None else dummy
    cnn_s = cnn.stride() if cnn is not None else (0, 0, 0)
    emit_t = emit if emit is not None else dummy
    emit_s = emit.stride() if emit is not None else (0, 0, 0)
    qn_w, qn_b, kn_w, kn_b, new = qk if qk is not None else (dummy, dummy, dummy, dummy, None)
    new_t = new if new is not None else dummy
    new_s = new.stride() if new is not None else (0, 0, 0, 0)
    grid = (triton.cdiv(m, block_m), n_tiles)
    with on_device(w.device):
        _launch(grid, a if a is not None else dummy, a_strides, src if src is not None else dummy,
                sstats if sstats is not None else dummy, tab, stride_tab, shift, scale, lnw, lnb, cnn_t, cnn_s,
                emit_t, emit_s, cnn_base, w, w_strides, bias, out, out_strides, gate, ostats if ostats is not None
                else dummy, qn_w, qn_b, kn_w, kn_b, new_t, new_s, valid, m, nout, k, t_len, c, heads, eps_a, eps_qk,
                a_mode, epi, has_res, cnn is not None, dot_precision, block_m, block_n, block_k, num_warps,
                num_stages)


def _launch(grid, a, a_s, src, sstats, tab, stride_tab, shift, scale, lnw, lnb, cnn_t, cnn_s, emit_t, emit_s,
            cnn_base, w, w_s, bias, out, out_s, gate, ostats, qn_w, qn_b, kn_w, kn_b, new_t, new_s, valid,
            m, nout, k, t_len, c, heads, eps_a, eps_qk, a_mode, epi, has_res, has_cnn, dot_precision,
            block_m, block_n, block_k, num_warps, num_stages):
    _dit_fused_gemm_kernel[grid](
        a, *a_s, src, sstats, tab, stride_tab, shift, scale, lnw, lnb,
        cnn_t, *cnn_s, emit_t, *emit_s, cnn_base,
        w, *w_s, bias,
        out, *out_s, gate or 0, ostats,
        qn_w, qn_b, kn_w, kn_b, new_t, *new_s, valid,
        m, nout, k, t_len, c, stat_tiles(c), heads, eps_a, eps_qk,
        A_MODE=a_mode, EPI=epi, HAS_RES=has_res, HAS_GATE=gate is not None, HAS_CNN=has_cnn,
        TAB_ROWS=stride_tab != 0, A_ROWMAJOR=a_s[0] == t_len * a_s[1], OUT_ROWMAJOR=out_s[0] == t_len * out_s[1],
        DOT_PRECISION=dot_precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STAT_BN=STAT_BN,
        num_warps=num_warps, num_stages=num_stages)
