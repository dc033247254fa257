"""Triton kernels of the fused DiT body and their host launchers (no torch.library here).

The body (one estimator evaluation of a chunk, SPEC §1-2, §4) is cuBLAS GEMMs stitched together
by three Triton kernels that do everything between them in one pass each:

* ``_dit_rownorm_kernel``: per token row, ``y`` (a GEMM output, or the 3 shifted taps of a causal
  conv GEMM summed here) + bias -> optional gated residual update of the float32 stream ``h`` ->
  LayerNorm (float32 statistics) -> adaLN modulation from the per-step table, or affine + Mish ->
  written in the compute dtype to the next GEMM's input, optionally into a conv history buffer
  whose first 2 frames it gathers from the conv cache, and optionally emitting the new conv
  cache (the last 2 valid frames of an earlier history buffer). One kernel per block boundary.
* ``_dit_qk_cache_kernel``: q/k LayerNorm over D fused with the new attention cache write
  (row n: its T_n current k|v frames, then its L_n old frames, then zeros).
* ``_cfg_euler_kernel``: CFG combine + Euler update of x, written back into the staged input.

Variant "v5" replaces the q/k-norm kernel and the attention call of each block with one kernel
(:mod:`torch_cfm.kernels.dit_attention`).

:func:`dit_body_triton` is the host driver of one body call (sync-free, graph-capturable).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..config import BLOCK_LN_EPS, CONV_LN_EPS, QK_NORM_EPS
from ..packing import (GATE_A, GATE_C, GATE_M, MOD_VECTORS, PER_BLOCK, SCALE_A, SCALE_C, SCALE_M,
                       SHIFT_A, SHIFT_C, SHIFT_M)
from ._launch import launch_kwargs, on_device, pdl_prologue, pdl_supported
from . import dit_linear_cuda
from .dit_linear_cuda import (V9_MAX_ROWS, device_reason, linear_into, linear_rownorm_into, linear_splitk_into,
                              qkv_cache_into)
from .cfm_attention import AttentionConfig
from .dit_attention import attention_cache

CONV_HISTORY = 2  # causal conv k=3: 2 cached frames in front of the chunk
VARIANTS = ("v1", "v2", "v3", "v4", "v5", "v7", "v9")
DEFAULT_VARIANT = None  # None: per dtype/precision from VARIANT_BY_PRECISION (set from bench/NOTES.md)
# Measured on the H200 (bench/NOTES.md, sessions 2-3, (8, 50, 400) fp16 per step): v1 1.123 ms (0.982 with
# one row per rownorm program), v2 1.165, v3 3.98, v4 1.039 vs v1 1.041 (no gain).
# v3's Triton TF32 dots are ~2x cuBLAS TF32 error (outside the oracle): never for tf32.
VARIANT_BY_PRECISION = {"fp16": "v1", "bf16": "v1", "tf32": "v1", "ieee": "v1"}
# v9 (the wgmma GEMMs, with PDL on the row-norm and q/k-cache kernels around them) for 16-bit bodies
# of at most this many rows. Session 16 (bench/NOTES.md), (8, 50, 400) fp16, interleaved rounds:
# 868 / 821 µs against v1's 976 / 930 (two machines); at (32, 50, 400) v9 is 21 % slower than v1
# (M = 1600: several waves of its one-tile-per-CTA grid), so wider bodies keep v1 / v5. Where the
# kernel cannot run (not SM90, extension not built for 9.0a) or PDL is off (TORCH_CFM_PDL=0), v9 is
# v1 call for call, with v1's PDL set.
V9_MAX_ROWS_16BIT = V9_MAX_ROWS
ARENA_VARIANTS = ("v1", "v9")  # the variants with the in-place arena form (arena=True)
# v9's fc2 (K = 2048) as a split-K wgmma GEMM (dit_linear_cuda.SPLITK_CONFIG) whose fp32 partial sums
# the row-norm kernel behind it adds up, bias included; and fc1 (+ GELU) on the wgmma kernel, whose early
# trigger lets fc2 load its weights under it. Session 17 (bench/NOTES.md), (8, 50, 400) fp16, interleaved
# rounds, µs: v9 with both on cuBLAS 830, fc2 split-K 807, + fc1 776 (v1: 937). fc1 alone gained nothing
# (session 16: 823 vs 821, cuBLAS fc2 behind it cannot start early).
V9_FC1 = True
V9_FC2 = True
# v9 on the in-place arena: the QKV GEMM does the q/k-cache kernel's work in its epilogue (per-head q/k
# LayerNorm, queries out, k/v appended to the arena): one kernel fewer per block. Session 18
# (bench/NOTES.md), (8, 50, 400) fp16 arena step, interleaved rounds: 731 µs on vs 735 off (-29
# predicted); whole solve 7.36 ms (7.40 before).
V9_QKV_CACHE = True
# v9 for fp32 bodies computing in TF32: qkv, proj and both conv GEMMs on the kernel's TF32 form (operands
# rounded to nearest TF32 by the TMA loads; dit_linear_cuda), fc1/fc2 too with V9_TF32_MLP; chosen for
# TF32 bodies of at most V9_MAX_ROWS rows. Session 18 (bench/NOTES.md), (8, 50, 400) fp32-tf32, interleaved rounds, µs:
# step v1 1466 -> v9 1402, arena step 1376 -> 1336 (MLP on cuBLAS); whole solve B = 4 13.81 -> 13.39 ms
# (12.97 with V9_TF32_MLP).
V9_TF32 = True
# v9's MLP in TF32 bodies on the kernel too: fc1 + GELU (BN 64) and fc2 as the split-K form
# (dit_linear_cuda.TF32_SPLITK_CONFIG), as V9_FC1 / V9_FC2 do for 16-bit bodies. Session 18, (8, 50, 400)
# fp32-tf32, interleaved rounds, µs: v9 1377 -> 1362 with it (v1 1438); arena step 1299 (v1 1352).
V9_TF32_MLP = True
# ... and its QKV GEMM on the arena with the q/k-cache epilogue (V9_QKV_CACHE's, in 64-wide fp32 tiles:
# 168 CTAs at M = 400 where the plain TF32 qkv runs 112). Its GPU tests pass (session 19), but it is slower:
# (8, 50, 400) fp32-tf32 arena step, interleaved rounds, µs: 1371 on vs 1347 off (bench/NOTES.md): off.
V9_TF32_QKV_CACHE = False
# v9: the proj GEMM with the row-norm behind it (gate, residual, adaLN, the conv-1 history's head frames) in
# its epilogue, one launch per 64-row block cluster of C / 64 CTAs that add up the LayerNorm statistics
# through distributed shared memory (dit_linear_cuda.linear_rownorm_into): one kernel fewer per block (10).
# Its GPU tests pass (session 19), but as first built its epilogue interleaved global loads with stores
# (one dependent round trip per column pair): 11.7 µs per call against 3.6 + 2.0 for the GEMM and the
# row-norm kernel, and the fp16 step 1027 vs 812 µs. With each phase's loads before its stores (session 20,
# bench/wgmma_gemm.py --parts rownorm): 5.75 µs per boundary in a chain against 5.02 for the two launches
# (whose row-norm hides under the next GEMM's weight loads with PDL), step 883 vs 819 µs: off.
V9_PROJ_ROWNORM = False
# v5 for 16-bit bodies of at least this many rows. Session 6 (bench/NOTES.md): at (32, 50, 400)
# fp16 v5 beat v1 by 4-9 % in five separate runs and in interleaved rounds, bf16 by 6 %; at
# (8, 50, 400) the runs disagree (-5 % .. +17 %); for TF32 v5 is 6-11 % slower at both sizes.
V5_MIN_ROWS_16BIT = 32


def v9_gemm_roles() -> str:
    """The block GEMMs that v9 runs on the wgmma kernel (for explain())."""
    proj = "proj" + (" (+ the row-norm behind it)" if V9_PROJ_ROWNORM else "")
    roles = ", ".join(["qkv" + (" (+ q/k cache on the arena)" if V9_QKV_CACHE else ""), proj, "conv"]
                      + (["fc1"] if V9_FC1 else []) + (["fc2 (split-K)"] if V9_FC2 else []))
    if not V9_TF32:
        return roles + "; TF32 bodies: cuBLAS (V9_TF32 off)"
    tf32_qkv = "qkv" + (" (+ q/k cache on the arena)" if V9_QKV_CACHE and V9_TF32_QKV_CACHE else "")
    return roles + f"; TF32 bodies too: {tf32_qkv}, {proj}, conv" + (", fc1, fc2 (split-K)" if V9_TF32_MLP else "")


def choose_variant(dtype: torch.dtype, precision: Optional[str], n_rows: Optional[int] = None) -> str:
    """The body variant for a compute dtype (fp32: by dot precision) and, for 16-bit and (with
    ``V9_TF32``) TF32 bodies, the number of rows N (None: the per-dtype choice); DEFAULT_VARIANT overrides."""
    if DEFAULT_VARIANT is not None:
        return DEFAULT_VARIANT
    if dtype in (torch.float16, torch.bfloat16):
        if n_rows is not None and n_rows >= V5_MIN_ROWS_16BIT:
            return "v5"
        if n_rows is not None and n_rows <= V9_MAX_ROWS_16BIT:
            return "v9"
        return VARIANT_BY_PRECISION["fp16" if dtype == torch.float16 else "bf16"]
    if precision == "tf32" and V9_TF32 and n_rows is not None and n_rows <= V9_MAX_ROWS_16BIT:
        return "v9"
    return VARIANT_BY_PRECISION["tf32" if precision == "tf32" else "ieee"]


# The body's own Triton kernels launched with programmatic dependent launch (where
# _launch.pdl_supported allows it), by compute-dtype family and kernel name ("rownorm",
# "qk_cache", "attention_cache" (v5), "cfg_euler"). Session 6, interleaved re-captures
# (bench/NOTES.md): PDL on the rownorm kernels gives fp32-tf32 -1.3 % (8, 50, 400) and -1.6 %
# (32, 50, 400); for fp16 it costs +3 % at (32, 50, 400) and nothing clear at N = 8, and on the
# q/k-cache and v5 kernels it never helps. PDL_KERNELS_OVERRIDE replaces the set for every dtype
# (bench A/B: bench/dit_step.py --sweep-variants pdl). cfm_attention keeps its own rule
# (kernels.cfm_attention.use_pdl). "linear" is v9's wgmma GEMM, whose weight load before the wait
# is why it exists. Family "wgmma" is v9 where that GEMM runs: session 16's sweep (bench/NOTES.md),
# (8, 50, 400) fp16, µs: v1 976; v9 with PDL on the GEMMs only 1024, + row-norm 910,
# + q/k cache 868 (the Triton kernels' early trigger lets each GEMM load its weights under them).
PDL_CAPABLE_KERNELS = frozenset({"rownorm", "qk_cache", "attention_cache", "cfg_euler", "linear"})
BODY_PDL_KERNELS = {"16bit": frozenset(), "fp32": frozenset({"rownorm", "cfg_euler"}),
                    "wgmma": frozenset({"linear", "rownorm", "qk_cache"})}
PDL_KERNELS_OVERRIDE: Optional[frozenset] = None


def body_pdl(device: torch.device, kernel: str, dtype: torch.dtype, family: Optional[str] = None) -> bool:
    """PDL for the body kernel ``kernel`` computing in ``dtype`` on ``device`` (:data:`BODY_PDL_KERNELS`;
    ``family`` picks a set other than the dtype's, e.g. "wgmma" for v9's kernels)."""
    assert kernel in PDL_CAPABLE_KERNELS, kernel  # a misspelt launcher name would silently mean "off"
    if PDL_KERNELS_OVERRIDE is not None:
        kernels = PDL_KERNELS_OVERRIDE
    else:
        kernels = BODY_PDL_KERNELS[family or ("fp32" if dtype == torch.float32 else "16bit")]
    return kernel in kernels and pdl_supported(device)


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
    EARLY_FRAMES: tl.constexpr,
):
    """One row-norm tile: ROWS token rows from ``row0`` (arguments as commented above). Launched
    by ``_dit_rownorm_kernel`` (one tile per program) and run inside the persistent block kernel
    (:mod:`torch_cfm.kernels.dit_block`), which also sums SPLITS split-K partials of a plain ``y``."""
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
    if EARLY_FRAMES:  # the first rows' frame loads issued with y's, before any store (EARLY_LOADS)
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

    # Without EARLY_FRAMES each frame is loaded right before its store (the order measured on the GPU)
    if not EARLY_FRAMES:
        first = row_ok & (t == 0)
        fmask = first[:, None] & col_ok[None, :]
    if HEAD:  # history frames 0, 1 <- old conv cache (zeros without one)
        for j in tl.static_range(2):
            if EARLY_FRAMES:
                if j == 0:
                    hv = head0
                else:
                    hv = head1
            else:
                hv = _head_frame(cnn_ptr, stride_cnn_n, stride_cnn_c, stride_cnn_j, head_cbase, n, cols, fmask, j,
                                 HAS_CNN, ROWS, BLOCK_C)
            tl.store(out_ptr + (n * out_t + j)[:, None] * C + cols[None, :], hv.to(out_ptr.dtype.element_ty),
                     mask=fmask)
    if EMIT:  # new conv cache = history frames T_n, T_n + 1 (the last 2 of [cache ; chunk[:T_n]])
        if not EARLY_FRAMES:
            tn = tl.load(valid_ptr + n, mask=first, other=0).to(tl.int64)
        for j in tl.static_range(2):
            if EARLY_FRAMES:
                if j == 0:
                    ev = emit0
                else:
                    ev = emit1
            else:
                ev = _emit_frame(emit_src_ptr, n, tn, cols, fmask, T, C, j)
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
    EARLY_FRAMES: tl.constexpr,
):
    """One block boundary, ROWS token rows per program (arguments: :func:`_rownorm_rows`)."""
    _rownorm_rows(
        tl.program_id(0) * ROWS, y_ptr, stride_y, split_stride, bias_ptr, h_ptr, tab_ptr, stride_tab, gate_off, shift_off,
        scale_off, lnw_ptr, lnb_ptr, out_ptr, out_t, out_off, cnn_ptr, stride_cnn_n, stride_cnn_c, stride_cnn_j,
        head_cbase, emit_src_ptr, emit_ptr, stride_emit_n, stride_emit_c, stride_emit_j, emit_cbase, valid_ptr,
        M, T, C, eps, TAPS, HAS_BIAS, HAS_RES, WRITE_H, HAS_GATE, NORM, HEAD, HAS_CNN, EMIT, SPLITS, ROWS, BLOCK_C,
        USE_PDL, EARLY_FRAMES)


@triton.jit
def _dit_qk_cache_kernel(
    qkv_ptr, stride_qkv,        # (N*T, 3*H*D) packed q | k | v GEMM output
    qn_w_ptr, qn_b_ptr, kn_w_ptr, kn_b_ptr,  # (D,) q/k LayerNorm affine
    q_out_ptr,                  # (N, T, H, D) contiguous normalised queries
    old_ptr, s_old_n, s_old_h, s_old_f, s_old_e,   # (N, H, L, 2D) old cache [HAS_OLD]
    new_ptr, s_new_n, s_new_h, s_new_f, s_new_e,   # (N, H, T+L, 2D) new cache
    valid_ptr, cached_ptr,      # (N,) int32 clamped T_n, L_n
    T, L, H, eps,
    HAS_OLD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_F: tl.constexpr, CUR_ONLY: tl.constexpr,
    APPEND: tl.constexpr, USE_PDL: tl.constexpr, EARLY_LOADS: tl.constexpr,
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
    if EARLY_LOADS:  # k and v with q, before the queries' store (dit_body.EARLY_LOADS)
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
    if not EARLY_LOADS:
        xk = tl.load(qkv_ptr + row + (inner + h * HEAD_DIM + d)[None, :], mask=cm, other=0.0).to(tl.float32)
    mu = tl.sum(xk, axis=1) / HEAD_DIM
    xc = xk - mu[:, None]
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / HEAD_DIM + eps)
    kv = xc * rstd[:, None] * kn_w + kn_b
    if not EARLY_LOADS:
        vv = tl.load(qkv_ptr + row + (2 * inner + h * HEAD_DIM + d)[None, :], mask=cm, other=0.0).to(tl.float32)
    if HAS_OLD:
        kv = tl.where(cm, kv, ko)
        vv = tl.where(cm, vv, vo)
    else:
        kv = tl.where(cm, kv, 0.0)
    pos = f
    if CUR_ONLY or APPEND:  # CUR_ONLY: frames [T_n, T+L) belong to another kernel (v4's side-stream shift)
        nm = in_cur[:, None]
    else:
        nm = in_new[:, None]
    if APPEND:
        pos = ln + tn - 1 - f
    n_base = new_ptr + n * s_new_n + h * s_new_h + pos.to(tl.int64)[:, None] * s_new_f
    tl.store(n_base + d[None, :] * s_new_e, kv.to(new_ptr.dtype.element_ty), mask=nm)
    tl.store(n_base + (HEAD_DIM + d)[None, :] * s_new_e, vv.to(new_ptr.dtype.element_ty), mask=nm)


@triton.jit
def _cfg_euler_kernel(
    x_ptr,                      # (B, Cm, T) float32 state, updated in place
    v_ptr, s_v_n, s_v_c, s_v_t,  # (2B, Cm, T) velocity: cond rows [0, B), uncond rows [B, 2B)
    st_ptr, s_st_n, s_st_c, s_st_t,  # (2B, Cin, T) staged input; channels [0, Cm) <- x for both halves
    B, Cm, T, dt, cfg_rate,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    total = B * Cm * T
    ok = idx < total
    b = (idx // (Cm * T)).to(tl.int64)
    c = (idx // T) % Cm
    t = idx % T
    pdl_prologue(USE_PDL)
    vc = tl.load(v_ptr + b * s_v_n + c * s_v_c + t * s_v_t, mask=ok, other=0.0).to(tl.float32)
    vu = tl.load(v_ptr + (b + B) * s_v_n + c * s_v_c + t * s_v_t, mask=ok, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + idx, mask=ok, other=0.0)
    x = x + dt * ((1.0 + cfg_rate) * vc - cfg_rate * vu)
    tl.store(x_ptr + idx, x, mask=ok)
    xs = x.to(st_ptr.dtype.element_ty)
    tl.store(st_ptr + b * s_st_n + c * s_st_c + t * s_st_t, xs, mask=ok)
    tl.store(st_ptr + (b + B) * s_st_n + c * s_st_c + t * s_st_t, xs, mask=ok)


@triton.jit
def _gelu_tanh(x):
    u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))  # 0.5 x (1 + tanh(u))


@triton.jit
def _dit_gemm_kernel(
    a_ptr, stride_a,            # (M, K) activations, compute dtype
    w_ptr, stride_w,            # (Nout, K) weight (nn.Linear layout)
    bias_ptr,                   # (Nout,)
    c_ptr, stride_c,            # (M, Nout) output [EPI 0, 1]
    qn_w_ptr, qn_b_ptr, kn_w_ptr, kn_b_ptr,  # (D,) q/k LayerNorm affine [EPI 2]
    q_out_ptr,                  # (N, T, H, D) contiguous normalised queries [EPI 2]
    new_ptr, s_new_n, s_new_h, s_new_f, s_new_e,  # (N, H, T+L, 2D) new cache [EPI 2]
    valid_ptr,                  # (N,) int32 clamped T_n [EPI 2]
    M, NOUT, K, T, H, eps,
    EPI: tl.constexpr,          # 0: + bias; 1: + bias, GELU(tanh); 2: packed qkv -> q/k norm + cache write
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < NOUT
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_a
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_w
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        a = tl.load(a_rows + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :], other=0.0)
        w = tl.load(w_cols + kk[:, None], mask=(kk < K)[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if EPI == 0:
        tl.store(c_ptr + offs_m.to(tl.int64)[:, None] * stride_c + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])
    elif EPI == 1:
        tl.store(c_ptr + offs_m.to(tl.int64)[:, None] * stride_c + offs_n[None, :],
                 _gelu_tanh(acc).to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    else:  # BLOCK_N == D: this tile is one head of q, k or v
        _qkv_head_epilogue(acc, offs_m, m_ok, pid_n * BLOCK_N, T, H, eps, qn_w_ptr, qn_b_ptr, kn_w_ptr, kn_b_ptr,
                           q_out_ptr, new_ptr, s_new_n, s_new_h, s_new_f, s_new_e, valid_ptr, BLOCK_N)


@triton.jit
def _qkv_head_epilogue(
    acc,                        # (BLOCK_M, D) float32 packed-QKV GEMM tile, bias included
    offs_m, m_ok,               # its token rows (n*T + t) and their validity
    col0,                       # its first column in the packed q | k | v output (a multiple of D)
    T, H, eps,
    qn_w_ptr, qn_b_ptr, kn_w_ptr, kn_b_ptr,  # (D,) q/k LayerNorm affine
    q_out_ptr,                  # (N, T, H, D) contiguous normalised queries
    new_ptr, s_new_n, s_new_h, s_new_f, s_new_e,  # (N, H, T+L, 2D) new cache
    valid_ptr,                  # (N,) int32 clamped T_n
    D: tl.constexpr,
):
    """One head of q (LayerNorm -> ``q_out``), k (LayerNorm -> new cache frames t < T_n) or v
    (-> new cache frames t < T_n)."""
    inner = H * D
    seg = col0 // inner
    h = (col0 % inner) // D
    d = tl.arange(0, D)
    n = (offs_m // T).to(tl.int64)
    t = offs_m % T
    if seg < 2:
        mu = tl.sum(acc, axis=1) / D
        xc = acc - mu[:, None]
        z = xc * tl.rsqrt(tl.sum(xc * xc, axis=1) / D + eps)[:, None]
        if seg == 0:
            z = z * tl.load(qn_w_ptr + d).to(tl.float32)[None, :] + tl.load(qn_b_ptr + d).to(tl.float32)[None, :]
            q_off = offs_m.to(tl.int64)[:, None] * inner + (h * D + d)[None, :]
            tl.store(q_out_ptr + q_off, z.to(q_out_ptr.dtype.element_ty), mask=m_ok[:, None])
        else:
            z = z * tl.load(kn_w_ptr + d).to(tl.float32)[None, :] + tl.load(kn_b_ptr + d).to(tl.float32)[None, :]
            tn = tl.load(valid_ptr + n, mask=m_ok, other=0)
            ok = (m_ok & (t < tn))[:, None]
            dst = new_ptr + n[:, None] * s_new_n + h * s_new_h + t.to(tl.int64)[:, None] * s_new_f
            tl.store(dst + d[None, :] * s_new_e, z.to(new_ptr.dtype.element_ty), mask=ok)
    else:
        tn = tl.load(valid_ptr + n, mask=m_ok, other=0)
        ok = (m_ok & (t < tn))[:, None]
        dst = new_ptr + n[:, None] * s_new_n + h * s_new_h + t.to(tl.int64)[:, None] * s_new_f
        tl.store(dst + (D + d)[None, :] * s_new_e, acc.to(new_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dit_cache_shift_kernel(
    old_ptr, s_old_b, s_old_n, s_old_h, s_old_f, s_old_e,   # (depth, N, H, L, 2D) old caches [HAS_OLD]
    new_ptr, s_new_b, s_new_n, s_new_h, s_new_f, s_new_e,   # (depth, N, H, T+L, 2D) new caches
    valid_ptr, cached_ptr,      # (N,) int32 clamped T_n, L_n
    N, H, T, L,
    HAS_OLD: tl.constexpr, WIDTH: tl.constexpr, BLOCK_F: tl.constexpr,
):
    """Frames [T_n, T+L) of every block's new cache: the L_n old frames, then zeros."""
    pid = tl.program_id(0)
    pid_f = tl.program_id(1)
    blk = (pid // (N * H)).to(tl.int64)
    n = ((pid // H) % N).to(tl.int64)
    h = pid % H
    f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    e = tl.arange(0, WIDTH)
    tn = tl.load(valid_ptr + n)
    ln = tl.load(cached_ptr + n)
    j = f - tn
    dst_ok = (f >= tn) & (f < T + L)
    if HAS_OLD:
        src_ok = dst_ok & (j < ln)
        src = old_ptr + blk * s_old_b + n * s_old_n + h * s_old_h + j.to(tl.int64)[:, None] * s_old_f + e[None, :] * s_old_e
        val = tl.load(src, mask=src_ok[:, None], other=0.0)
    else:
        val = tl.zeros([BLOCK_F, WIDTH], dtype=tl.float32)
    dst = new_ptr + blk * s_new_b + n * s_new_n + h * s_new_h + f.to(tl.int64)[:, None] * s_new_f + e[None, :] * s_new_e
    tl.store(dst, val.to(new_ptr.dtype.element_ty), mask=dst_ok[:, None])


# --------------------------------------------------------------------------------------------
# host launchers
# --------------------------------------------------------------------------------------------

# (rows per program, num_warps) of the row-norm kernel for every launch; None: rownorm_launch's rule.
# For the bench's A/B (bench/dit_step.py --sweep-variants rownorm).
ROWNORM_LAUNCH_OVERRIDE: Optional[tuple[int, int]] = None
# Loads issued before the first store where the kernel would otherwise load after storing: the row-norm
# kernel's head / emit frames (rows with t == 0: the old conv cache's frames, and the history frames
# T_n, T_n + 1 behind valid[n]) with y's loads, the q/k-cache kernel's k and v with q, and the QKV + cache
# epilogue's T_n / L_n (dit_linear_cuda.qkv_cache_into(early_loads=...)). A load may
# not move past a store that could alias it, so late loads add dependent memory round trips: 1 (head)
# or 2 (emit) to the row-norm programs that have them, the kernel's slowest (3 of the 4 row-norms per
# block), and 1 to every q/k-cache program. Session 20 (H200, bench/dit_step.py --sweep-variants early
# --sweep-kernels): the 65 row-norm launches of a step 192.2 -> 169.3 µs fp16 (204.3 -> 180.1 TF32), the 16
# q/k-cache launches 56.0 -> 46.8 µs (TF32), the QKV + cache epilogue unchanged; on.
EARLY_LOADS = True


def rownorm_launch(block_c: int) -> tuple[int, int]:
    """(rows per program, num_warps) of ``_dit_rownorm_kernel`` for rows padded to ``block_c`` channels."""
    if ROWNORM_LAUNCH_OVERRIDE is not None:
        return ROWNORM_LAUNCH_OVERRIDE
    # One 512-channel row per 4-warp program: measured on the H200 at (8, 50, 400) fp16 the 65
    # rownorm launches of a step take 206 µs this way vs 287 µs with 4 rows per program (more
    # programs in flight hide the dependent load latency; bench/NOTES.md, 2026-12-01 01:27).
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
    pdl_family: Optional[str] = None,
) -> None:
    """Launch ``_dit_rownorm_kernel`` (see its comments). ``y``: (M, C) rows, (N*(T+2), 3C) conv taps
    (``taps``), or (S, M, C) split-K partial sums, added up as they are read. ``gate``/``shift``/``scale``
    are element offsets into a table row; ``head`` = (old conv cache (N, 2C, 2) or None, channel base);
    ``emit`` = (history (N*(T+2), C), new conv cache (N, 2C, 2), channel base); ``pdl_family``: the
    :func:`body_pdl` set (None: by dtype)."""
    c = h.shape[1]
    m = n_rows * t_len
    if m == 0:
        return
    block_c = triton.next_power_of_2(c)
    rows, warps = rownorm_launch(block_c)
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
    pdl = body_pdl(h.device, "rownorm", out.dtype, pdl_family)
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
            EARLY_FRAMES=EARLY_LOADS,
            num_warps=warps, **launch_kwargs(pdl))


def qk_cache(qkv: torch.Tensor, norms: tuple[torch.Tensor, ...], q_out: torch.Tensor,
             old: Optional[torch.Tensor], new: torch.Tensor, valid: torch.Tensor, cached: torch.Tensor,
             *, n_rows: int, t_len: int, heads: int, head_dim: int, current_only: bool = False,
             append: bool = False, pdl_family: Optional[str] = None) -> None:
    """Launch ``_dit_qk_cache_kernel``: q/k LayerNorm + the new (N, H, T+L, 2D) cache of one block.

    ``current_only``: write the T_n current frames of each row and nothing else (``old`` must be
    None); frames [T_n, T+L) are then written by :func:`cache_shift`. ``append``: ``new`` is a block
    of the in-place arena (N, H, P, 2D) holding L_n old frames in reversed key order; the T_n
    current frames are written behind them, reversed too (``old`` must be None)."""
    if (current_only or append) and old is not None:
        raise ValueError("qk_cache: current_only / append take old=None (the old frames are not copied)")
    l_len = 0 if old is None else old.shape[2]
    total = t_len + l_len
    if n_rows == 0 or total == 0:
        return
    block_f = 32 if head_dim <= 64 else 16
    o = old if old is not None else new
    grid = (n_rows * heads, triton.cdiv(total, block_f))
    pdl = body_pdl(qkv.device, "qk_cache", qkv.dtype, pdl_family)
    with on_device(qkv.device):
        _dit_qk_cache_kernel[grid](
            qkv, qkv.stride(0), *norms, q_out,
            o, o.stride(0), o.stride(1), o.stride(2), o.stride(3),
            new, new.stride(0), new.stride(1), new.stride(2), new.stride(3),
            valid, cached, t_len, l_len, heads, QK_NORM_EPS,
            HAS_OLD=old is not None and l_len > 0, HEAD_DIM=head_dim, BLOCK_F=block_f, CUR_ONLY=current_only,
            APPEND=append, USE_PDL=pdl, EARLY_LOADS=EARLY_LOADS, num_warps=4, **launch_kwargs(pdl))


def cfg_euler(x: torch.Tensor, v: torch.Tensor, staged: torch.Tensor, dt: float, cfg_rate: float) -> None:
    """x (B, Cm, T) float32 += dt * ((1+r) v[:B] - r v[B:]); staged[:, :Cm] <- x for both halves."""
    b, cm, t_len = x.shape
    if not x.is_contiguous():
        raise ValueError("cfg_euler: x (the Euler state) must be contiguous: the kernel indexes it densely")
    total = b * cm * t_len
    if total == 0:
        return
    block = 1024
    pdl = body_pdl(x.device, "cfg_euler", staged.dtype)
    with on_device(x.device):
        _cfg_euler_kernel[(triton.cdiv(total, block),)](
            x, v, v.stride(0), v.stride(1), v.stride(2), staged, staged.stride(0), staged.stride(1),
            staged.stride(2), b, cm, t_len, float(dt), float(cfg_rate), BLOCK=block, USE_PDL=pdl, num_warps=4,
            **launch_kwargs(pdl))


def _dot_precision(dtype: torch.dtype, precision: Optional[str]) -> str:
    if dtype == torch.float32:
        return "tf32" if precision == "tf32" else "ieee"
    return "tf32"  # ignored by tl.dot for 16-bit operands (tensor cores, FP32 accumulation)


def _gemm_tiles(m: int, nout: int, k: int, dtype: torch.dtype, block_n: Optional[int] = None) -> tuple[int, int, int]:
    block_m = 64 if m > 32 else max(16, triton.next_power_of_2(max(m, 1)))
    block_n = block_n or (128 if nout >= 1024 else 64)
    block_k = 32 if dtype == torch.float32 else 64
    return block_m, block_n, min(block_k, max(16, triton.next_power_of_2(k)))


def gemm(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, out: torch.Tensor, *, gelu: bool = False,
         precision: Optional[str] = None) -> torch.Tensor:
    """out (M, Nout) = a (M, K) @ w (Nout, K)^T + bias [, GELU tanh] with a Triton GEMM."""
    m, k = a.shape
    nout = w.shape[0]
    if m == 0:
        return out
    bm, bn, bk = _gemm_tiles(m, nout, k, a.dtype)
    grid = (triton.cdiv(m, bm), triton.cdiv(nout, bn))
    with on_device(a.device):
        _dit_gemm_kernel[grid](
            a, a.stride(0), w, w.stride(0), bias, out, out.stride(0),
            bias, bias, bias, bias, out, out, 0, 0, 0, 0, bias,
            m, nout, k, 1, 1, 0.0,
            EPI=1 if gelu else 0, DOT_PRECISION=_dot_precision(a.dtype, precision),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=3)
    return out


def qkv_gemm_cache(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, norms: tuple[torch.Tensor, ...],
                   q_out: torch.Tensor, new: torch.Tensor, valid: torch.Tensor, *, t_len: int, heads: int,
                   head_dim: int, precision: Optional[str] = None) -> None:
    """Packed QKV GEMM whose epilogue LayerNorms q and k per head, writes q to ``q_out`` and the
    current k|v frames t < T_n of each row to the new cache (N, H, T+L, 2D)."""
    m, k = a.shape
    nout = w.shape[0]
    if m == 0:
        return
    bm, bn, bk = _gemm_tiles(m, nout, k, a.dtype, block_n=head_dim)
    grid = (triton.cdiv(m, bm), nout // head_dim)
    with on_device(a.device):
        _dit_gemm_kernel[grid](
            a, a.stride(0), w, w.stride(0), bias, q_out, 0,
            *norms, q_out, new, new.stride(0), new.stride(1), new.stride(2), new.stride(3), valid,
            m, nout, k, t_len, heads, QK_NORM_EPS,
            EPI=2, DOT_PRECISION=_dot_precision(a.dtype, precision),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=3)


def cache_shift(old: Optional[torch.Tensor], new: torch.Tensor, valid: torch.Tensor, cached: torch.Tensor) -> None:
    """Frames [T_n, T+L) of every block's new cache (depth, N, H, T+L, 2D): old frames, then zeros."""
    depth, n_rows, heads, total, width = new.shape
    if new.numel() == 0:
        return
    l_len = 0 if old is None else old.shape[3]
    o = old if old is not None and l_len > 0 else new
    block_f = 16 if width >= 128 else 32
    grid = (depth * n_rows * heads, triton.cdiv(total, block_f))
    with on_device(new.device):
        _dit_cache_shift_kernel[grid](
            o, *o.stride(), new, *new.stride(), valid, cached, n_rows, heads, total - l_len, l_len,
            HAS_OLD=o is not new, WIDTH=width, BLOCK_F=block_f, num_warps=4)


_SIDE_STREAMS: dict = {}  # (device index, caller stream handle) -> side stream of v4's cache shift


class _OldFramesOnSideStream:
    """v4: frames [T_n, T+L) of every block's new cache (its L_n old frames, then zeros), one
    :func:`cache_shift` launch per block on a side stream forked from the caller's stream at the
    start of the step. Nothing computed in the step feeds them, so they run under the step's
    latency-bound GEMMs; block i's attention waits only for block i's copy (:meth:`wait`), and
    :meth:`join` puts the caller's stream behind all of them before the body returns (a proper
    fork/join, so CUDA-graph capture records it as graph edges). Each caller stream gets its own
    side stream. On CPU (Triton interpreter) the copies simply run first, in order.
    """

    def __init__(self, old: Optional[torch.Tensor], new: torch.Tensor, valid: torch.Tensor,
                 cached: torch.Tensor) -> None:
        depth = new.shape[0]
        olds = [None if old is None or old.shape[3] == 0 else old[i:i + 1] for i in range(depth)]
        self.events: list = []
        self.side = None
        if new.device.type != "cuda":
            for i in range(depth):
                cache_shift(olds[i], new[i:i + 1], valid, cached)
            return
        main = torch.cuda.current_stream(new.device)
        key = (new.device.index, main.cuda_stream)
        side = _SIDE_STREAMS.get(key)
        if side is None:
            side = torch.cuda.Stream(device=new.device)
            if side.cuda_stream == main.cuda_stream:  # the pool wrapped onto the caller's stream
                side = torch.cuda.Stream(device=new.device)
            _SIDE_STREAMS[key] = side
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for i in range(depth):
                cache_shift(olds[i], new[i:i + 1], valid, cached)
                event = torch.cuda.Event()
                event.record(side)
                self.events.append(event)
        self.side, self.main = side, main

    def wait(self, block: int) -> None:
        if self.events:
            self.main.wait_event(self.events[block])

    def join(self) -> None:
        if self.side is not None:
            self.main.wait_stream(self.side)


# --------------------------------------------------------------------------------------------
# the body driver
# --------------------------------------------------------------------------------------------

def _body_sizes(x_in: torch.Tensor, weights: list[torch.Tensor]) -> tuple[int, ...]:
    """(N, Cin, T, depth, C, H, D, H*D, MLP hidden) of one body call, from the staged input and the
    packed weight list (layout: :mod:`torch_cfm.packing`)."""
    n_rows, cin, t_len = x_in.shape
    depth = (len(weights) - 4) // PER_BLOCK
    head_dim = weights[4].shape[0]
    inner = weights[2].shape[0] // 3
    mlp = weights[16].shape[0] if depth else 0
    return n_rows, cin, t_len, depth, weights[0].shape[0], inner // head_dim, head_dim, inner, mlp


def _attention_precision(dtype: torch.dtype, precision: Optional[str]) -> str:
    """The ``precision`` argument the body passes to ``cfm_attention``."""
    return precision if (dtype == torch.float32 and precision in ("tf32", "ieee")) else "auto"


def _v5_dot_precision(dtype: torch.dtype, precision: Optional[str]) -> str:
    """v5's attention dots: as ``cfm_attention``'s (fp32 "ieee" = its default ``ieee_dot``, 3xTF32)."""
    if dtype != torch.float32:
        return "tf32"  # ignored for 16-bit operands
    return "tf32" if precision == "tf32" else AttentionConfig.ieee_dot


def _mod_off(i: int, j: int, c: int) -> int:
    return (i * MOD_VECTORS + j) * c


def dit_body_triton(
    x_in: torch.Tensor,
    weights: list[torch.Tensor],
    mod_table: torch.Tensor,
    cnn_cache: Optional[torch.Tensor],
    att_cache: Optional[torch.Tensor],
    valid: torch.Tensor,
    cached: torch.Tensor,
    precision: Optional[str],
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    variant: Optional[str] = None,
    arena: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One fused body call writing into ``out`` = (velocity (N, Cout, T), new_cnn_cache
    (depth, N, 2C, 2), new_att_cache (depth, N, H, T+L, 2D)).

    ``arena=True`` (the in-place form; ``att_cache`` must be None and the variant v1): ``out[2]`` is
    the attention-cache arena (depth, N, H, P, 2D), read and written in place. Row n's L_n old keys
    sit at frames [0, L_n) in reversed key order (frame j = SPEC key L_n - 1 - j); the call writes
    its T_n current keys at [L_n, L_n + T_n), reversed too, and copies nothing else, so afterwards
    frames [0, T_n + L_n) are the row's SPEC §2 new cache in reversed order. P >= L_n + T_n for every
    row (``cached`` + ``valid``), which the caller guarantees.

    ``valid``/``cached`` must already be clamped int32 (N,) on the device; ``mod_table`` float32
    (R, depth+1, 9, C) contiguous. GEMMs run in cuBLAS (on CPU: torch, for the Triton interpreter)
    with the caller's TF32 setting; attention through ``torch_cfm::cfm_attention``.
    Variants (``variant``; default :func:`choose_variant`):

    * "v1": cuBLAS for every GEMM; per block 3 rownorm + qk_cache + attention + 6 GEMMs + GELU
      = 12 kernels.
    * "v2": Triton GEMMs for QKV (epilogue: q/k LayerNorm + new-cache write of the current
      frames) and fc1 (epilogue: GELU); the old-frame shift of every block's cache in one kernel
      per step; per block 3 rownorm + attention + 6 GEMMs = 10 kernels.
    * "v3": every GEMM in Triton with the normalisations in its prologue/epilogue
      (:mod:`torch_cfm.kernels.dit_gemm`): per block QKV, attention, proj, conv 1, conv 2, fc1,
      fc2 = 7 kernels (+ 1 cache-shift kernel, in_proj and final layer per step).
    * "v4": v1 whose q/k-norm kernel writes only the current frames; the old frames of every
      block's new cache are copied on a side stream forked at the start of the step
      (:class:`_OldFramesOnSideStream`), off the critical path: 12 kernels per block on the
      caller's stream + 1 copy per block beside it.
    * "v5": v1 with the q/k norm, the new-cache write and the attention in one kernel
      (:mod:`torch_cfm.kernels.dit_attention`): 11 kernels per block.
    * "v7": one persistent launch per block, its 11 phases separated by grid barriers
      (:mod:`torch_cfm.kernels.dit_block`); in_proj and the final layer as v1.
    * "v9": v1 with the qkv, proj and both conv-tap GEMMs on the SM90a wgmma kernel
      (:mod:`torch_cfm.kernels.dit_linear_cuda`), launched with PDL so that each loads its weights
      while the kernel in front finishes; fc1 + GELU too (``V9_FC1``), and fc2 (K = 2048) as its
      split-K form, the fp32 partials summed by the row-norm behind it (``V9_FC2``); with
      ``V9_QKV_CACHE`` the QKV GEMM on the arena does the q/k-cache kernel's work in its epilogue
      (11 kernels per block). fp32 bodies computing in TF32 (``V9_TF32``) run the same GEMMs in
      the kernel's TF32 form (fc1/fc2 with ``V9_TF32_MLP``, the QKV + cache epilogue with
      ``V9_TF32_QKV_CACHE``); with ``V9_PROJ_ROWNORM`` the proj GEMM does the row-norm behind it in
      its epilogue (10 kernels per block). IEEE fp32 bodies are exactly v1. Every unsupported call
      stays on cuBLAS.
    """
    if variant is None:
        variant = choose_variant(x_in.dtype, precision, x_in.shape[0])
        if arena and variant not in ARENA_VARIANTS:
            variant = "v1"
    if variant not in VARIANTS:
        raise ValueError(f"dit_body_triton: variant must be one of {VARIANTS}, got {variant!r}")
    if arena and (variant not in ARENA_VARIANTS or att_cache is not None):
        raise ValueError(f"dit_body_triton: arena=True runs variant v1 or v9 without att_cache, got {variant!r}")
    vel, new_cnn, new_att = out
    if variant == "v3":
        return _body_v3(x_in, weights, mod_table, cnn_cache, att_cache, valid, cached, precision, out)
    if variant == "v7" and x_in.shape[0] * x_in.shape[2] > 0:  # no token rows: v1 copies the caches
        from .dit_block import body_v7

        return body_v7(x_in, weights, mod_table, cnn_cache, att_cache, valid, cached, precision, out)
    n_rows, _, t_len, depth, c, heads, head_dim, inner, mlp = _body_sizes(x_in, weights)
    m = n_rows * t_len
    cd = x_in.dtype
    dev = x_in.device
    att_precision = _attention_precision(cd, precision)
    key_lengths = valid + cached

    h = torch.empty((m, c), dtype=torch.float32, device=dev)
    a = torch.empty((m, c), dtype=cd, device=dev)
    y = torch.empty((m, c), dtype=cd, device=dev)
    qkv = None if variant == "v2" else torch.empty((m, 3 * inner), dtype=cd, device=dev)
    qbuf = torch.empty((n_rows, t_len, heads, head_dim), dtype=cd, device=dev)  # v5: the attention output
    hist1 = torch.empty((n_rows * (t_len + CONV_HISTORY), c), dtype=cd, device=dev)
    hist2 = torch.empty_like(hist1)
    z = torch.empty((n_rows * (t_len + CONV_HISTORY), 3 * c), dtype=cd, device=dev)
    fbuf = torch.empty((m, mlp), dtype=cd, device=dev)
    common = dict(n_rows=n_rows, t_len=t_len)
    v2 = variant == "v2"
    # v9: the wgmma GEMMs, and the PDL set measured with them (v1's, call for call, where they cannot
    # run, or where PDL is off: without PDL, v9 measured 3 % slower than v1, session 16)
    # fp32 bodies take its TF32 form (V9_TF32; never for "ieee"): qkv, proj, the conv GEMMs and, with
    # V9_TF32_MLP, fc1 and the split-K fc2; with V9_TF32_QKV_CACHE the QKV + cache epilogue on the arena.
    tf32 = cd == torch.float32 and precision == "tf32" and V9_TF32
    wgmma16 = variant == "v9" and cd in (torch.float16, torch.bfloat16)
    wgmma = (wgmma16 or (variant == "v9" and tf32)) and pdl_supported(dev) and device_reason(dev) is None
    wgmma16 = wgmma16 and wgmma
    fam = "wgmma" if wgmma else None
    if wgmma:
        linear_pdl = body_pdl(dev, "linear", cd, fam)

        def mm(a_, w_, b_, out_):  # the wgmma kernel where it applies, else cuBLAS (v1's call)
            if not linear_into(a_, w_, b_, out_, pdl=linear_pdl, tf32=tf32):
                _cublas_mm(a_, w_, b_, out_)
    else:
        mm = _cublas_mm
    # v9's fc2 partial sums (splits, M, C) in fp32, where the split-K form runs
    fc2_parts = None
    mlp_wgmma = wgmma16 or (wgmma and V9_TF32_MLP)  # the MLP GEMMs on the kernel too
    if mlp_wgmma and V9_FC2:
        splits = (dit_linear_cuda.TF32_SPLITK_CONFIG if tf32 else dit_linear_cuda.SPLITK_CONFIG)[0]
        fc2_parts = torch.empty((splits, m, c), dtype=torch.float32, device=dev)
    if v2:
        cache_shift(att_cache, new_att, valid, cached)
    shift = _OldFramesOnSideStream(att_cache, new_att, valid, cached) if variant == "v4" else None

    # staged input -> in_proj (bias added in the first boundary kernel)
    y0 = torch.matmul(x_in.transpose(1, 2), weights[0].t()).view(m, c)
    rownorm(y0, h, a, valid, bias=weights[1], has_res=False, table=mod_table,
            shift=_mod_off(0, SHIFT_A, c), scale=_mod_off(0, SCALE_A, c), pdl_family=fam, **common)
    for i in range(depth):
        (qkv_w, qkv_b, qn_w, qn_b, kn_w, kn_b, proj_w, proj_b, c1_w, c1_b, cn_w, cn_b,
         c2_w, c2_b, fc1_w, fc1_b, fc2_w, fc2_b) = weights[2 + PER_BLOCK * i: 2 + PER_BLOCK * (i + 1)]
        cnn_i = cnn_cache[i] if cnn_cache is not None else None
        # attention: packed QKV GEMM, q/k norm + cache write, attention over the new cache
        if variant == "v5":
            torch.addmm(qkv_b, a, qkv_w.t(), out=qkv)
            old = att_cache[i] if att_cache is not None and att_cache.shape[3] > 0 else None
            attention_cache(qkv, (qn_w, qn_b, kn_w, kn_b), old, new_att[i], qbuf, valid, cached,
                            heads=heads, head_dim=head_dim, dot_precision=_v5_dot_precision(cd, precision),
                            pdl=body_pdl(dev, "attention_cache", cd), **common)
            torch.addmm(proj_b, qbuf.view(m, inner), proj_w.t(), out=y)
        elif v2:
            qkv_gemm_cache(a, qkv_w, qkv_b, (qn_w, qn_b, kn_w, kn_b), qbuf, new_att[i], valid, t_len=t_len,
                           heads=heads, head_dim=head_dim, precision=precision)
        elif shift is not None:
            torch.addmm(qkv_b, a, qkv_w.t(), out=qkv)
            qk_cache(qkv, (qn_w, qn_b, kn_w, kn_b), qbuf, None, new_att[i], valid, cached,
                     heads=heads, head_dim=head_dim, current_only=True, **common)
            shift.wait(i)
        elif wgmma and arena and V9_QKV_CACHE and (wgmma16 or V9_TF32_QKV_CACHE) and qkv_cache_into(
                a, qkv_w, qkv_b, (qn_w, qn_b, kn_w, kn_b), qbuf.view(m, inner), new_att[i], valid, cached,
                t_len=t_len, eps=QK_NORM_EPS, pdl=linear_pdl, tf32=tf32, early_loads=EARLY_LOADS):
            pass  # the q/k LayerNorm, the queries and the arena's new frames came out of the GEMM's epilogue
        else:
            mm(a, qkv_w, qkv_b, qkv)
            old = att_cache[i] if att_cache is not None and att_cache.shape[3] > 0 else None
            qk_cache(qkv, (qn_w, qn_b, kn_w, kn_b), qbuf, old, new_att[i], valid, cached,
                     heads=heads, head_dim=head_dim, append=arena, pdl_family=fam, **common)
        if variant != "v5":
            kv = new_att[i]
            o = torch.ops.torch_cfm.cfm_attention.default(
                qbuf.permute(0, 2, 1, 3), kv[..., :head_dim], kv[..., head_dim:], key_lengths, None, None,
                att_precision)
            o_rows = o.transpose(1, 2).reshape(m, inner)
        # residual + gate_a, LN, modulation (c) -> conv-1 history (frames 0,1 from the conv cache): in the
        # proj GEMM's epilogue (v9, V9_PROJ_ROWNORM) or by the row-norm kernel after it
        boundary = dict(gate=_mod_off(i, GATE_A, c), shift=_mod_off(i, SHIFT_C, c), scale=_mod_off(i, SCALE_C, c),
                        out_t=t_len + CONV_HISTORY, out_off=CONV_HISTORY, head=(cnn_i, 0))
        fused_proj = (variant != "v5" and wgmma and V9_PROJ_ROWNORM and linear_rownorm_into(
            o_rows, proj_w, proj_b, h, mod_table, hist1, t_len=t_len, eps=BLOCK_LN_EPS, pdl=linear_pdl, tf32=tf32,
            **boundary))
        if not fused_proj:
            if variant != "v5":
                mm(o_rows, proj_w, proj_b, y)
            rownorm(y, h, hist1, valid, table=mod_table, pdl_family=fam, **boundary, **common)
        mm(hist1, c1_w, None, z)
        # conv-1 tap sum + bias, affine LN, Mish -> conv-2 history; emit conv-1 cache
        rownorm(z, h, hist2, valid, taps=True, bias=c1_b, has_res=False, write_h=False,
                ln_affine=(cn_w, cn_b), eps=CONV_LN_EPS, out_t=t_len + CONV_HISTORY, out_off=CONV_HISTORY,
                head=(cnn_i, c), emit=(hist1, new_cnn[i], 0), pdl_family=fam, **common)
        mm(hist2, c2_w, None, z)
        # conv-2 tap sum + bias, residual + gate_c, LN, modulation (m); emit conv-2 cache
        rownorm(z, h, a, valid, taps=True, bias=c2_b, table=mod_table, gate=_mod_off(i, GATE_C, c),
                shift=_mod_off(i, SHIFT_M, c), scale=_mod_off(i, SCALE_M, c),
                emit=(hist2, new_cnn[i], c), pdl_family=fam, **common)
        # MLP
        if v2:
            gemm(a, fc1_w, fc1_b, fbuf, gelu=True, precision=precision)
        elif mlp_wgmma and V9_FC1 and linear_into(a, fc1_w, fc1_b, fbuf, gelu=True, pdl=linear_pdl, tf32=tf32):
            pass
        elif dev.type == "cuda":
            # GELU (tanh) in the cuBLASLt epilogue; torch applies the same GELU after the GEMM
            # where Lt cannot take the call. (Its CPU kernel uses the erf GELU: not used there.)
            torch._addmm_activation(fc1_b, a, fc1_w.t(), use_gelu=True, out=fbuf)
        else:
            torch.addmm(fc1_b, a, fc1_w.t(), out=fbuf)
            torch.ops.aten.gelu_(fbuf, approximate="tanh")
        nxt = (i + 1, SHIFT_A, SCALE_A) if i + 1 < depth else (depth, 0, 1)
        if fc2_parts is not None and linear_splitk_into(fbuf, fc2_w, fc2_parts, pdl=linear_pdl, tf32=tf32):
            y_fc2, b_fc2 = fc2_parts, fc2_b  # the row-norm adds the partials and the bias
        else:
            torch.addmm(fc2_b, fbuf, fc2_w.t(), out=y)
            y_fc2, b_fc2 = y, None
        rownorm(y_fc2, h, a, valid, bias=b_fc2, table=mod_table, gate=_mod_off(i, GATE_M, c),
                shift=_mod_off(nxt[0], nxt[1], c), scale=_mod_off(nxt[0], nxt[2], c), pdl_family=fam, **common)
    out_w, out_b = weights[-2], weights[-1]
    torch.baddbmm(out_b[None, :, None], out_w.expand(n_rows, -1, -1), a.view(n_rows, t_len, c).transpose(1, 2),
                  out=vel)
    if shift is not None:
        shift.join()
    return vel, new_cnn, new_att


def _cublas_mm(a: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor) -> None:
    """``out = a @ w.T (+ bias)`` on cuBLAS: v1's GEMMs."""
    if bias is None:
        torch.mm(a, w.t(), out=out)
    else:
        torch.addmm(bias, a, w.t(), out=out)


def _body_v3(x_in, weights, table, cnn_cache, att_cache, valid, cached, precision, out):
    """The "v3" body: 7 kernels per block (see :func:`dit_body_triton`)."""
    from .dit_gemm import fused_gemm, linear_strides, stat_tiles, tap_strides

    vel, new_cnn, new_att = out
    n_rows, cin, t_len, depth, c, heads, head_dim, inner, mlp = _body_sizes(x_in, weights)
    m = n_rows * t_len
    cd, dev = x_in.dtype, x_in.device
    att_precision = _attention_precision(cd, precision)
    key_lengths = valid + cached
    nt = stat_tiles(c)
    h = torch.empty((m, c), dtype=torch.float32, device=dev)
    hstats = torch.empty((m, nt, 2), dtype=torch.float32, device=dev)
    u = torch.empty((m, c), dtype=torch.float32, device=dev)
    ustats = torch.empty((m, nt, 2), dtype=torch.float32, device=dev)
    qbuf = torch.empty((n_rows, t_len, heads, head_dim), dtype=cd, device=dev)  # v5: the attention output
    fbuf = torch.empty((m, mlp), dtype=cd, device=dev)
    common = dict(m=m, t_len=t_len, c=c, valid=valid, precision=precision)

    lin = linear_strides

    def taps(w):
        return tap_strides(w, c)

    cache_shift(att_cache, new_att, valid, cached)
    in_w, in_b = weights[0], weights[1]
    fused_gemm(w=in_w, w_strides=lin(in_w), bias=in_b, out=h, nout=c, k=cin, a_mode=0, epi=3, a=x_in,
               a_strides=(x_in.stride(0), x_in.stride(2), x_in.stride(1)), ostats=hstats, **common)
    for i in range(depth):
        (qkv_w, qkv_b, qn_w, qn_b, kn_w, kn_b, proj_w, proj_b, c1_w, c1_b, cn_w, cn_b,
         c2_w, c2_b, fc1_w, fc1_b, fc2_w, fc2_b) = weights[2 + PER_BLOCK * i: 2 + PER_BLOCK * (i + 1)]
        cnn_i = cnn_cache[i] if cnn_cache is not None else None
        fused_gemm(w=qkv_w, w_strides=lin(qkv_w), bias=qkv_b, out=qbuf, nout=3 * inner, k=c, a_mode=1, epi=2,
                   src=h, sstats=hstats, table=table, shift=_mod_off(i, SHIFT_A, c), scale=_mod_off(i, SCALE_A, c),
                   qk=(qn_w, qn_b, kn_w, kn_b, new_att[i]), heads=heads, block_n=head_dim, eps_a=BLOCK_LN_EPS,
                   eps_qk=QK_NORM_EPS, **common)
        kv = new_att[i]
        o = torch.ops.torch_cfm.cfm_attention.default(
            qbuf.permute(0, 2, 1, 3), kv[..., :head_dim], kv[..., head_dim:], key_lengths, None, None,
            att_precision)
        o3 = o.transpose(1, 2).reshape(n_rows, t_len, inner)
        fused_gemm(w=proj_w, w_strides=lin(proj_w), bias=proj_b, out=h, nout=c, k=inner, a_mode=0, epi=3, a=o3,
                   a_strides=o3.stride(), table=table, gate=_mod_off(i, GATE_A, c), has_res=True, ostats=hstats,
                   **common)
        fused_gemm(w=c1_w, w_strides=taps(c1_w), bias=c1_b, out=u, nout=c, k=3 * c, a_mode=2, epi=4, src=h,
                   sstats=hstats, table=table, shift=_mod_off(i, SHIFT_C, c), scale=_mod_off(i, SCALE_C, c),
                   cnn=cnn_i, emit=new_cnn[i], cnn_base=0, ostats=ustats, eps_a=BLOCK_LN_EPS, **common)
        fused_gemm(w=c2_w, w_strides=taps(c2_w), bias=c2_b, out=h, nout=c, k=3 * c, a_mode=3, epi=3, src=u,
                   sstats=ustats, ln=(cn_w, cn_b), cnn=cnn_i, emit=new_cnn[i], cnn_base=c, table=table,
                   gate=_mod_off(i, GATE_C, c), has_res=True, ostats=hstats, eps_a=CONV_LN_EPS, **common)
        fused_gemm(w=fc1_w, w_strides=lin(fc1_w), bias=fc1_b, out=fbuf, out_strides=(t_len * mlp, mlp, 1),
                   nout=mlp, k=c, a_mode=1, epi=1, src=h, sstats=hstats, table=table,
                   shift=_mod_off(i, SHIFT_M, c), scale=_mod_off(i, SCALE_M, c), eps_a=BLOCK_LN_EPS, **common)
        fused_gemm(w=fc2_w, w_strides=lin(fc2_w), bias=fc2_b, out=h, nout=c, k=mlp, a_mode=0, epi=3, a=fbuf,
                   a_strides=(t_len * mlp, mlp, 1), table=table, gate=_mod_off(i, GATE_M, c), has_res=True,
                   ostats=hstats, **common)
    out_w, out_b = weights[-2], weights[-1]
    fused_gemm(w=out_w, w_strides=lin(out_w), bias=out_b, out=vel, out_strides=(vel.stride(0), vel.stride(2),
               vel.stride(1)), nout=out_w.shape[0], k=c, a_mode=1, epi=0, src=h, sstats=hstats, table=table,
               shift=_mod_off(depth, 0, c), scale=_mod_off(depth, 1, c), eps_a=BLOCK_LN_EPS, **common)
    return vel, new_cnn, new_att
