"""The fused body's row-norm boundary kernel (one launch per block boundary) and its host launcher.

``_dit_rownorm_kernel``, per token row: ``y`` (a GEMM output, its split-K partial sums, or the 3 shifted
taps of a causal conv GEMM summed here) + bias -> optional gated residual update of the float32 stream
``h`` -> LayerNorm (float32 statistics) -> adaLN modulation from the per-step table, or affine + Mish ->
written in the compute dtype to the next GEMM's input, optionally into a conv history buffer whose first
2 frames it gathers from the conv cache, and optionally emitting the new conv cache (the last 2 valid
frames of an earlier history buffer).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..config import BLOCK_LN_EPS
from ._launch import launch_kwargs, on_device, pdl_prologue


@triton.jit
def _rownorm_rows(
    row0,                       # first token row of this tile
    y_ptr, stride_y,            # GEMM output rows (M, C) [plain] or (N*(T+2), 3C) conv taps [TAPS]
    split_stride,               # elements between the SPLITS partial sums of y [plain]
    bias_ptr,                   # (C,) added to y [HAS_BIAS]
    h_ptr,                      # (M, C) float32 residual stream, read [HAS_RES] / written [WRITE_H]
    tab_ptr, stride_tab,        # (R, depth+1, 9, C) float32 modulation table; row stride 0 if R == 1
    gate_off, shift_off, scale_off,  # element offsets of the vectors inside a table row
    lnw_ptr, lnb_ptr,           # (C,) LayerNorm affine [NORM == 1]
    out_ptr,                    # output rows (., C) in the compute dtype
    out_t, out_off,             # output row of token (n, t) = n*out_t + out_off + t
    cnn_ptr, stride_cnn_n, stride_cnn_c, stride_cnn_j, head_cbase,  # old conv cache (N, 2C, 2) [HEAD]
    emit_src_ptr,               # (N*(T+2), C) history whose last 2 valid frames are emitted [EMIT]
    emit_ptr, stride_emit_n, stride_emit_c, stride_emit_j, emit_cbase,  # new conv cache (N, 2C, 2)
    valid_ptr,                  # (N,) int32 valid lengths, already clamped to [0, T]
    M, T, C, eps,
    TAPS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, WRITE_H: tl.constexpr,
    HAS_GATE: tl.constexpr, NORM: tl.constexpr, HEAD: tl.constexpr, HAS_CNN: tl.constexpr,
    EMIT: tl.constexpr, SPLITS: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One row-norm tile: ROWS token rows from ``row0`` (arguments as commented above); a plain ``y``
    may be SPLITS split-K partial sums, added up as they are read."""
    rows = row0 + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_C)
    row_ok = rows < M
    col_ok = cols < C
    ok = row_ok[:, None] & col_ok[None, :]
    n = (rows // T).to(tl.int64)
    t = rows % T
    rows64 = rows.to(tl.int64)

    # Weights and the step's modulation table: loaded before the PDL wait, while the GEMM in front
    # of this kernel drains (safe: that GEMM writes neither; _launch.pdl_prologue).
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tab_row = tab_ptr + n[:, None] * stride_tab + cols[None, :]
    if HAS_GATE:
        gate = tl.load(tab_row + gate_off, mask=ok, other=0.0)
    if NORM == 0:
        mod_scale = tl.load(tab_row + scale_off, mask=ok, other=0.0)
        mod_shift = tl.load(tab_row + shift_off, mask=ok, other=0.0)
    else:
        ln_w = tl.load(lnw_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        ln_b = tl.load(lnb_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    pdl_prologue(USE_PDL)

    # y: plain GEMM rows, or the sum of the 3 conv taps read at hist rows t, t+1, t+2
    if TAPS:
        hrow = n * (T + 2) + t
        y = tl.load(y_ptr + hrow[:, None] * stride_y + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        y += tl.load(y_ptr + (hrow + 1)[:, None] * stride_y + (C + cols)[None, :], mask=ok, other=0.0).to(tl.float32)
        y += tl.load(y_ptr + (hrow + 2)[:, None] * stride_y + (2 * C + cols)[None, :], mask=ok, other=0.0).to(tl.float32)
    else:
        y = tl.load(y_ptr + rows64[:, None] * stride_y + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        for s in tl.static_range(1, SPLITS):
            y += tl.load(y_ptr + s * split_stride + rows64[:, None] * stride_y + cols[None, :], mask=ok,
                         other=0.0).to(tl.float32)
    # The first rows' frame loads are issued with y's, before any store: a load may not move past a
    # store that could alias it, so loading them after the stores would add dependent round trips.
    first = row_ok & (t == 0)
    fmask = first[:, None] & col_ok[None, :]
    if HEAD:
        head0 = _head_frame(cnn_ptr, stride_cnn_n, stride_cnn_c, stride_cnn_j, head_cbase, n, cols, fmask, 0,
                            HAS_CNN, ROWS, BLOCK_C)
        head1 = _head_frame(cnn_ptr, stride_cnn_n, stride_cnn_c, stride_cnn_j, head_cbase, n, cols, fmask, 1,
                            HAS_CNN, ROWS, BLOCK_C)
    if EMIT:
        tn = tl.load(valid_ptr + n, mask=first, other=0).to(tl.int64)
        emit0 = _emit_frame(emit_src_ptr, n, tn, cols, fmask, T, C, 0)
        emit1 = _emit_frame(emit_src_ptr, n, tn, cols, fmask, T, C, 1)
    if HAS_BIAS:
        y += bias
    if HAS_GATE:
        y = y * gate
    if HAS_RES:
        y += tl.load(h_ptr + rows64[:, None] * C + cols[None, :], mask=ok, other=0.0)
    if WRITE_H:
        tl.store(h_ptr + rows64[:, None] * C + cols[None, :], y, mask=ok)

    # LayerNorm over C, float32 statistics
    mean = tl.sum(y, axis=1) / C
    diff = tl.where(ok, y - mean[:, None], 0.0)
    var = tl.sum(diff * diff, axis=1) / C
    z = diff * tl.rsqrt(var + eps)[:, None]
    if NORM == 0:  # adaLN: z * (1 + scale) + shift (the table stores 1 + scale)
        z = z * mod_scale + mod_shift
    else:  # affine LayerNorm then Mish: x * tanh(softplus(x)) = x * e(e+2) / (e(e+2) + 2), e = exp(x)
        z = z * ln_w + ln_b
        e = tl.exp(tl.minimum(z, 20.0))
        p = e * (e + 2.0)
        z = tl.where(z > 20.0, z, z * p / (p + 2.0))
    orow = n * out_t + out_off + t
    tl.store(out_ptr + orow[:, None] * C + cols[None, :], z.to(out_ptr.dtype.element_ty), mask=ok)

    if HEAD:  # history frames 0, 1 <- old conv cache (zeros without one)
        for j in tl.static_range(2):
            if j == 0:
                hv = head0
            else:
                hv = head1
            tl.store(out_ptr + (n * out_t + j)[:, None] * C + cols[None, :], hv.to(out_ptr.dtype.element_ty),
                     mask=fmask)
    if EMIT:  # new conv cache = history frames T_n, T_n + 1 (the last 2 of [cache ; chunk[:T_n]])
        for j in tl.static_range(2):
            if j == 0:
                ev = emit0
            else:
                ev = emit1
            tl.store(emit_ptr + n[:, None] * stride_emit_n + (emit_cbase + cols)[None, :] * stride_emit_c
                     + j * stride_emit_j, ev.to(emit_ptr.dtype.element_ty), mask=fmask)


@triton.jit
def _head_frame(cnn_ptr, stride_cnn_n, stride_cnn_c, stride_cnn_j, head_cbase, n, cols, fmask, j,
                HAS_CNN: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    """Frame j of the old conv cache (channels head_cbase + cols) of each row's sequence n, masked to
    ``fmask`` (zeros without a cache)."""
    if HAS_CNN:
        f = tl.load(cnn_ptr + n[:, None] * stride_cnn_n + (head_cbase + cols)[None, :] * stride_cnn_c
                    + j * stride_cnn_j, mask=fmask, other=0.0)
    else:
        f = tl.zeros([ROWS, BLOCK_C], dtype=tl.float32)
    return f


@triton.jit
def _emit_frame(emit_src_ptr, n, tn, cols, fmask, T, C, j):
    """History frame T_n + j of each first row's sequence n (for the new conv cache), masked to ``fmask``."""
    return tl.load(emit_src_ptr + (n * (T + 2) + tn + j)[:, None] * C + cols[None, :], mask=fmask, other=0.0)


@triton.jit
def _dit_rownorm_kernel(
    y_ptr, stride_y, split_stride, bias_ptr, h_ptr, tab_ptr, stride_tab, gate_off, shift_off, scale_off, lnw_ptr, lnb_ptr,
    out_ptr, out_t, out_off, cnn_ptr, stride_cnn_n, stride_cnn_c, stride_cnn_j, head_cbase,
    emit_src_ptr, emit_ptr, stride_emit_n, stride_emit_c, stride_emit_j, emit_cbase, valid_ptr,
    M, T, C, eps,
    TAPS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, WRITE_H: tl.constexpr,
    HAS_GATE: tl.constexpr, NORM: tl.constexpr, HEAD: tl.constexpr, HAS_CNN: tl.constexpr,
    EMIT: tl.constexpr, SPLITS: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One block boundary, ROWS token rows per program (arguments: :func:`_rownorm_rows`)."""
    _rownorm_rows(
        tl.program_id(0) * ROWS, y_ptr, stride_y, split_stride, bias_ptr, h_ptr, tab_ptr, stride_tab, gate_off, shift_off,
        scale_off, lnw_ptr, lnb_ptr, out_ptr, out_t, out_off, cnn_ptr, stride_cnn_n, stride_cnn_c, stride_cnn_j,
        head_cbase, emit_src_ptr, emit_ptr, stride_emit_n, stride_emit_c, stride_emit_j, emit_cbase, valid_ptr,
        M, T, C, eps, TAPS, HAS_BIAS, HAS_RES, WRITE_H, HAS_GATE, NORM, HEAD, HAS_CNN, EMIT, SPLITS, ROWS, BLOCK_C,
        USE_PDL)


def rownorm_launch(block_c: int) -> tuple[int, int]:
    """(rows per program, num_warps) of ``_dit_rownorm_kernel`` for rows padded to ``block_c`` channels:
    one 512-channel row per 4-warp program (more programs in flight hide the dependent load latency)."""
    rows = max(1, min(16, 512 // block_c))
    return rows, 4 if block_c * rows <= 2048 else 8


def rownorm(
    y: torch.Tensor, h: torch.Tensor, out: torch.Tensor, valid: torch.Tensor, *, n_rows: int, t_len: int,
    taps: bool = False, bias: Optional[torch.Tensor] = None, has_res: bool = True, write_h: bool = True,
    table: Optional[torch.Tensor] = None, gate: Optional[int] = None, shift: int = 0, scale: int = 0,
    ln_affine: Optional[tuple[torch.Tensor, torch.Tensor]] = None, eps: float = BLOCK_LN_EPS,
    out_t: Optional[int] = None, out_off: int = 0,
    head: Optional[tuple[Optional[torch.Tensor], int]] = None,
    emit: Optional[tuple[torch.Tensor, torch.Tensor, int]] = None,
    pdl: bool = False, launch: Optional[tuple[int, int]] = None,
) -> None:
    """Launch ``_dit_rownorm_kernel`` (see its comments). ``y``: (M, C) rows, (N*(T+2), 3C) conv taps
    (``taps``), or (S, M, C) split-K partial sums, added up as they are read. ``gate``/``shift``/``scale``
    are element offsets into a table row; ``head`` = (old conv cache (N, 2C, 2) or None, channel base);
    ``emit`` = (history (N*(T+2), C), new conv cache (N, 2C, 2), channel base); ``pdl``: launch with
    programmatic dependent launch (the caller's plan); ``launch``: (rows per program, num_warps), None
    for :func:`rownorm_launch`'s rule."""
    c = h.shape[1]
    m = n_rows * t_len
    if m == 0:
        return
    block_c = triton.next_power_of_2(c)
    rows, warps = launch or rownorm_launch(block_c)
    tab = table if table is not None else h
    stride_tab = 0 if table is None or table.shape[0] == 1 else table.stride(0)
    cnn, head_cbase = head if head is not None else (None, 0)
    cnn_t = cnn if cnn is not None else h
    if emit is not None:
        e_src, e_dst, e_cbase = emit
    else:
        e_src, e_dst, e_cbase = h, h.view(-1, 1, 1)[:1], 0
    lnw, lnb = ln_affine if ln_affine is not None else (h, h)
    grid = (triton.cdiv(m, rows),)
    splits, split_stride = (y.shape[0], y.stride(0)) if y.dim() == 3 else (1, 0)
    with on_device(h.device):
        _dit_rownorm_kernel[grid](
            y, y.stride(-2), split_stride, bias if bias is not None else h, h, tab, stride_tab,
            gate or 0, shift, scale, lnw, lnb, out, out_t if out_t is not None else t_len, out_off,
            cnn_t, cnn_t.stride(0) if cnn is not None else 0, cnn_t.stride(1) if cnn is not None else 0,
            cnn_t.stride(2) if cnn is not None else 0, head_cbase,
            e_src, e_dst, e_dst.stride(0), e_dst.stride(1), e_dst.stride(2), e_cbase,
            valid, m, t_len, c, eps,
            TAPS=taps, HAS_BIAS=bias is not None, HAS_RES=has_res, WRITE_H=write_h,
            HAS_GATE=gate is not None, NORM=0 if ln_affine is None else 1, HEAD=head is not None,
            HAS_CNN=cnn is not None, EMIT=emit is not None, SPLITS=splits, ROWS=rows, BLOCK_C=block_c, USE_PDL=pdl,
            num_warps=warps, **launch_kwargs(pdl))
