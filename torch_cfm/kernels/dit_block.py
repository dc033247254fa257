"""Persistent per-block kernel of the fused DiT body (body variant "v7").

v1 spends ~12 launches on one DiT block and every launch at M = N*T ≈ 400 token rows is latency
bound (3-7 µs, bench/NOTES.md sessions 2-8), so the step is ~200 dependent launches. Here one
launch runs a whole block as 11 *phases* over a fixed grid of programs; each program walks the
tiles of a phase (``tile = pid, pid + G, ...``) and the phases are separated by a grid-wide
barrier (an atomic counter in global memory), so the per-launch drain/ramp becomes a barrier:

====  ===========  =====================================================================
 #    phase        tiles
====  ===========  =====================================================================
 0    qkv          packed-QKV GEMM tiles (one head each: q/k LayerNorm, current k|v frames
                   into the new cache)
 1    attention    (row, head, BQ queries) over the current frames in the new cache and the
                   old frames in the old cache
 2    proj         attention-output projection, split-K, FP32 partials
 3    norm_a       residual + gate_a, LayerNorm, modulation (c) -> conv-1 history
 4    conv1        conv-1 taps GEMM over the history
 5    norm_c1      tap sum + bias, affine LayerNorm, Mish -> conv-2 history; conv-1 cache
 6    conv2        conv-2 taps GEMM
 7    norm_c2      tap sum + bias, residual + gate_c, LayerNorm, modulation (m); conv-2 cache
 8    fc1          MLP up-projection, GELU (tanh)
 9    fc2          MLP down-projection, split-K, FP32 partials
 10   norm_m       residual + gate_m, LayerNorm, next block's modulation (a)
====  ===========  =====================================================================

The copy of the old frames into the new attention cache has no consumer inside the block, so
its tiles are shared out over phases COPY_LO..COPY_HI-1 to the programs that a phase leaves idle.
The row-norm phases are :func:`torch_cfm.kernels.dit_body._rownorm_rows` (v1's boundary
kernel) and the QKV epilogue is v2's, so v7 computes the same math as v1 with Triton GEMMs.

Launches (:class:`BlockPlan`): by default a block is one persistent launch of G = CTAS x #SM
programs (CTAS = 2). Every program must be resident at once, else a barrier would wait on
programs that cannot start: the compiled kernel's registers and shared memory are checked
against CTAS programs per SM before the first launch. A bounded spin turns a broken barrier into
a wrong result plus a raised flag (``bar[1]``), never a hang. ``SPLIT_AT`` cuts a block into
groups of phases; a one-phase launch runs one program per tile without a barrier, in a kernel
compiled with only that phase's code (``PHASE_MASK``). Off CUDA (the Triton interpreter) every
phase is its own launch.

Measured (bench/NOTES.md, session 9): within the SPEC §6 oracle and bitwise reproducible, but
81 µs per block at (8, 50, 400) fp16 against ≈ 58 µs for v1 — each phase costs about what its own
launch would — so :func:`~torch_cfm.kernels.dit_body.choose_variant` never picks it.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..config import BLOCK_LN_EPS, CONV_LN_EPS, QK_NORM_EPS
from ..packing import GATE_A, GATE_C, GATE_M, PER_BLOCK, SCALE_A, SCALE_C, SCALE_M, SHIFT_A, SHIFT_C, SHIFT_M
from ._launch import on_device, sm_count
from .dit_body import (CONV_HISTORY, _body_sizes, _dot_precision, _gelu_tanh, _mod_off, _qkv_head_epilogue,
                       _rownorm_rows, rownorm)

PHASES = ("qkv", "attention", "proj", "norm_a", "conv1", "norm_c1", "conv2", "norm_c2", "fc1", "fc2", "norm_m")
MAX_SPIN = 1 << 22  # barrier polls before a program gives up (≈ seconds): a hang becomes a flag
SPLIT_PROJ = 2      # split-K factors of the two GEMMs whose consumer (a row-norm) sums partials
SPLIT_FC2 = 4       # (at most: narrower models take the largest that divides K into BK steps)
BLOCK_KV = 64
# Launch configuration (bench/dit_block.py --configs overrides any key):
#   BM: GEMM tile rows (tile columns = D, one head); BQ: attention queries per tile; ROWS: token
#   rows per row-norm tile; CF: new-cache frames per old-frame copy tile; COPY_LO/COPY_HI: the
#   phases that share the old-frame copy; num_warps; num_stages: Triton's software pipelining
#   depth; CTAS: persistent programs per SM (G = CTAS x #SM); optional maxnreg: a register cap
#   (Triton's launch option) so that CTAS programs fit one SM's 64K registers.
#   SPLIT_AT: a bitmask of the phases that start a new launch (0: the whole block in one launch;
#   2046: one launch per phase); SPECIALIZE: a launch's kernel holds only its phases' code (0: every
#   launch runs the whole-block kernel, the tests' reference for the barrier).
#   FLOW: a launch's phases wait on per-(phase, sequence) counters of finished tiles instead of
#   grid barriers, so phases overlap across sequences (not yet run on a GPU).
#   G_MAX: a cap on the persistent grid (0: none; 1 lets the interpreter run the synchronised
#   paths: one program never waits on another); MAX_SPIN_: polls before a wait gives up.
CONFIG = dict(BM=64, BQ=32, ROWS=4, CF=64, COPY_LO=1, COPY_HI=11, num_warps=4, num_stages=3, CTAS=2, SPLIT_AT=0,
              SPECIALIZE=1, FLOW=0, G_MAX=0, MAX_SPIN_=MAX_SPIN)
ALL_PHASES = (1 << 11) - 1
REGISTERS_PER_SM = 65536
SHARED_PER_SM = 227 * 1024
# persistent launches already checked to be resident: (device index, dtype, grid, compile options)
_RESIDENT: set = set()
PERSISTENT = True   # CUDA: one launch per block with grid barriers (False: one launch per phase)


@triton.jit
def _grid_sync(bar_ptr, target, MAX_SPIN_: tl.constexpr):
    """Grid-wide barrier: every program adds 1 to ``bar[0]`` and waits until it reaches ``target``
    (= G x barriers passed so far in this body call). Release/acquire at GPU scope order this
    phase's stores before the next phase's loads in every program."""
    tl.debug_barrier()
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    spins = 0
    while (tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu") < target) & (spins < MAX_SPIN_):
        spins += 1
    if spins >= MAX_SPIN_:
        tl.atomic_add(bar_ptr + 1, 1, sem="relaxed", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _seq_tiles(phase, n, T, H, C, MLP, D: tl.constexpr, BM: tl.constexpr, BQ: tl.constexpr, ROWS: tl.constexpr,
               S_PROJ: tl.constexpr, S_FC2: tl.constexpr):
    """How many tiles of ``phase`` touch sequence n (rows [n*Tp, (n+1)*Tp) of the phase's row
    space: Tp = T + 2 for the conv GEMMs, T otherwise): the FLOW count of (phase, n) per block."""
    tp = T
    per = 1
    size = ROWS
    if phase == 0:
        per = 3 * H
        size = BM
    if phase == 2:
        per = (C // D) * S_PROJ
        size = BM
    if phase == 4:
        per = 3 * C // D
        size = BM
        tp = T + 2
    if phase == 6:
        per = 3 * C // D
        size = BM
        tp = T + 2
    if phase == 8:
        per = MLP // D
        size = BM
    if phase == 9:
        per = (C // D) * S_FC2
        size = BM
    count = per * (((n + 1) * tp - 1) // size - (n * tp) // size + 1)
    if phase == 1:
        count = H * tl.cdiv(T, BQ)
    return count


@triton.jit
def _flow_signal(dep_ptr, phase, r0, r1, TP, NR):
    """This tile of ``phase`` (rows [r0, r1) of a row space with TP rows per sequence) is done:
    count it for every sequence it touches (release: its stores first)."""
    tl.debug_barrier()
    for n in range(r0 // TP, tl.minimum((r1 - 1) // TP, NR - 1) + 1):
        tl.atomic_add(dep_ptr + phase * NR + n, 1, sem="release", scope="gpu")


@triton.jit
def _flow_wait(dep_ptr, flag_ptr, prod, r0, r1, TP, NR, blk, T, H, C, MLP, D: tl.constexpr, BM: tl.constexpr,
               BQ: tl.constexpr, ROWS: tl.constexpr, S_PROJ: tl.constexpr, S_FC2: tl.constexpr,
               MAX_SPIN_: tl.constexpr):
    """Wait until every tile of phase ``prod`` of this body call's blocks 0..blk touching the
    sequences of rows [r0, r1) (TP rows per sequence) is done (acquire: their stores visible)."""
    for n in range(r0 // TP, tl.minimum((r1 - 1) // TP, NR - 1) + 1):
        target = (blk + 1) * _seq_tiles(prod, n, T, H, C, MLP, D, BM, BQ, ROWS, S_PROJ, S_FC2)
        spins = 0
        cnt_ptr = dep_ptr + prod * NR + n
        while (tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu") < target) & (spins < MAX_SPIN_):
            spins += 1
        if spins >= MAX_SPIN_:
            tl.atomic_add(flag_ptr, 1, sem="relaxed", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _gemm_tile(a_ptr, lda, w_ptr, ldw, m0, n0, k_lo, k_hi, M, NOUT,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """(BM, BN) float32 tile of a (M, K) @ w (NOUT, K)^T over k in [k_lo, k_hi) (multiples of BK)."""
    offs_m = m0 + tl.arange(0, BM)
    offs_n = n0 + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * lda
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * ldw
    m_ok = (offs_m < M)[:, None]
    n_ok = (offs_n < NOUT)[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        a = tl.load(a_rows + (k0 + offs_k)[None, :], mask=m_ok, other=0.0)
        w = tl.load(w_cols + (k0 + offs_k)[:, None], mask=n_ok, other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _store_tile(c_ptr, ldc, acc, m0, n0, M, NOUT, BM: tl.constexpr, BN: tl.constexpr):
    offs_m = m0 + tl.arange(0, BM)
    offs_n = n0 + tl.arange(0, BN)
    ok = (offs_m < M)[:, None] & (offs_n < NOUT)[None, :]
    tl.store(c_ptr + offs_m.to(tl.int64)[:, None] * ldc + offs_n[None, :], acc.to(c_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _attention_tile(q_ptr, o_ptr, new_ptr, s_new_n, s_new_h, s_new_f, s_new_e,
                    old_ptr, s_old_n, s_old_h, s_old_f, s_old_e, n, h, q0, tn, kl, T, INNER, qk_scale,
                    D: tl.constexpr, BQ: tl.constexpr, BKV: tl.constexpr, HAS_OLD: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    """Queries [q0, q0 + BQ) of row n, head h over its ``kl`` = T_n + L_n keys: frames [0, T_n)
    from the new cache (written by the qkv phase), [T_n, kl) straight from the old cache (so the
    old-frame copy into the new cache can run in any phase). Online softmax in FP32, base 2
    (``qk_scale`` = log2(e) / sqrt(D)). No key -> exactly 0."""
    t = q0 + tl.arange(0, BQ)
    d = tl.arange(0, D)
    t_ok = (t < T)[:, None]
    rows = (n * T + t).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * INNER + (h * D + d)[None, :], mask=t_ok, other=0.0)
    m_i = tl.full([BQ], float("-inf"), tl.float32)
    l_i = tl.zeros([BQ], tl.float32)
    acc = tl.zeros([BQ, D], tl.float32)
    new_base = new_ptr + n * s_new_n + h * s_new_h
    old_base = old_ptr + n * s_old_n + h * s_old_h
    for k0 in range(0, kl, BKV):
        f = k0 + tl.arange(0, BKV)
        f_ok = f < kl
        rk = new_base + f.to(tl.int64) * s_new_f
        if HAS_OLD:
            rk = tl.where(f < tn, rk, old_base + (f - tn).to(tl.int64) * s_old_f)
            e_new = tl.where(f < tn, s_new_e, s_old_e)
        else:
            e_new = tl.zeros([BKV], tl.int64) + s_new_e
        kt = tl.load(rk[None, :] + d[:, None] * e_new[None, :], mask=f_ok[None, :], other=0.0)
        s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(f_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: frame k0 < kl is valid
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(rk[:, None] + (D + d)[None, :] * e_new[:, None], mask=f_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(o_ptr + rows[:, None] * INNER + (h * D + d)[None, :], out.to(o_ptr.dtype.element_ty), mask=t_ok)


@triton.jit
def _old_frames_tile(old_ptr, s_old_n, s_old_h, s_old_f, s_old_e, new_ptr, s_new_n, s_new_h, s_new_f, s_new_e,
                     n, h, f0, tn, ln, T, L, D: tl.constexpr, CF: tl.constexpr, HAS_OLD: tl.constexpr):
    """New-cache frames f in [f0, f0 + CF) with T_n <= f < T + L: old frame f - T_n if it is one
    of the L_n cached ones, else zeros (SPEC §2 layout)."""
    f = f0 + tl.arange(0, CF)
    e = tl.arange(0, 2 * D)
    dst_ok = ((f >= tn) & (f < T + L))[:, None]
    j = (f - tn).to(tl.int64)
    if HAS_OLD:
        src_ok = dst_ok & (j < ln)[:, None]
        val = tl.load(old_ptr + n * s_old_n + h * s_old_h + j[:, None] * s_old_f + e[None, :] * s_old_e,
                      mask=src_ok, other=0.0)
    else:
        val = tl.zeros([CF, 2 * D], dtype=tl.float32)
    tl.store(new_ptr + n * s_new_n + h * s_new_h + f.to(tl.int64)[:, None] * s_new_f + e[None, :] * s_new_e,
             val.to(new_ptr.dtype.element_ty), mask=dst_ok)


@triton.jit
def _splitk_phase(pid, G, a_ptr, w_ptr, y_ptr, M, NOUT, K, S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  dep_ptr, flag_ptr, blk, me, ph_lo, NR, T, H, MLP, BQ: tl.constexpr, ROWS: tl.constexpr,
                  S_PROJ: tl.constexpr, S_FC2: tl.constexpr, FLOW: tl.constexpr, MAX_SPIN_: tl.constexpr):
    """y[s] (M, NOUT) float32 = a[:, ks] @ w[:, ks]^T over the s-th of S equal K slices
    (phase ``me``; FLOW: each tile waits for phase me - 1 on its rows' sequences, unless that ran
    in an earlier launch, ``me == ph_lo``)."""
    n_mt = tl.cdiv(M, BM)
    n_nt = NOUT // BN
    ks = K // S
    for tile in range(pid, n_mt * n_nt * S, G):
        s = tile // (n_mt * n_nt)
        r = tile % (n_mt * n_nt)
        m0 = (r // n_nt) * BM
        n0 = (r % n_nt) * BN
        if FLOW:
            if me > ph_lo:
                _flow_wait(dep_ptr, flag_ptr, me - 1, m0, m0 + BM, T, NR, blk, T, H, NOUT, MLP, BN, BM, BQ, ROWS,
                           S_PROJ, S_FC2, MAX_SPIN_)
        acc = _gemm_tile(a_ptr, K, w_ptr, K, m0, n0, s * ks, s * ks + ks, M, NOUT, BM, BN, BK, DOT_PRECISION)
        _store_tile(y_ptr + s * M * NOUT, NOUT, acc, m0, n0, M, NOUT, BM, BN)
        if FLOW:
            _flow_signal(dep_ptr, me, m0, m0 + BM, T, NR)


@triton.jit
def _taps_phase(pid, G, hist_ptr, w_ptr, z_ptr, MH, C, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                DOT_PRECISION: tl.constexpr,
                dep_ptr, flag_ptr, blk, me, ph_lo, NR, T, H, MLP, BQ: tl.constexpr, ROWS: tl.constexpr,
                S_PROJ: tl.constexpr, S_FC2: tl.constexpr, FLOW: tl.constexpr, MAX_SPIN_: tl.constexpr):
    """z (N*(T+2), 3C) = history (N*(T+2), C) @ stacked taps (3C, C)^T (the tap sum is downstream;
    phase ``me``; FLOW: as :func:`_splitk_phase`, rows in the history's T + 2 per sequence)."""
    n_nt = 3 * C // BN
    for tile in range(pid, tl.cdiv(MH, BM) * n_nt, G):
        m0 = (tile // n_nt) * BM
        n0 = (tile % n_nt) * BN
        if FLOW:
            if me > ph_lo:
                _flow_wait(dep_ptr, flag_ptr, me - 1, m0, m0 + BM, T + 2, NR, blk, T, H, C, MLP, BN, BM, BQ, ROWS,
                           S_PROJ, S_FC2, MAX_SPIN_)
        acc = _gemm_tile(hist_ptr, C, w_ptr, C, m0, n0, 0, C, MH, 3 * C, BM, BN, BK, DOT_PRECISION)
        _store_tile(z_ptr, 3 * C, acc, m0, n0, MH, 3 * C, BM, BN)
        if FLOW:
            _flow_signal(dep_ptr, me, m0, m0 + BM, T + 2, NR)


# bar_base and the phase range change between the launches of one step: not specialised, so a step
# compiles one kernel, not one per (block, phase) value pattern
@triton.jit(do_not_specialize=["bar_base", "blk", "ph_lo", "ph_hi"])
def _dit_block_kernel(
    # activations: a / h / hist* / f as in v1; q, o (M, H*D); y, y2 (SPLIT, M, C) float32 partials of
    # proj and fc2; z, z2 (N*(T+2), 3C) conv-1 and conv-2 taps (separate: no reuse hazards under FLOW)
    a_ptr, h_ptr, q_ptr, o_ptr, y_ptr, y2_ptr, hist1_ptr, hist2_ptr, z_ptr, z2_ptr, f_ptr,
    # this block's packed weights (torch_cfm.packing)
    qkv_w, qkv_b, qn_w, qn_b, kn_w, kn_b, proj_w, proj_b, c1_w, c1_b, cn_w, cn_b, c2_w, c2_b,
    fc1_w, fc1_b, fc2_w, fc2_b,
    tab_ptr, stride_tab,        # modulation table, and the offsets of this block's vectors in a row
    gate_a, shift_c, scale_c, gate_c, shift_m, scale_m, gate_m, shift_n, scale_n,
    cnn_ptr, s_cnn_n, s_cnn_c, s_cnn_j,          # old conv cache (N, 2C, 2) of this block [HAS_CNN]
    ncnn_ptr, s_ncnn_n, s_ncnn_c, s_ncnn_j,      # new conv cache (N, 2C, 2)
    old_ptr, s_old_n, s_old_h, s_old_f, s_old_e,  # old attention cache (N, H, L, 2D) [HAS_OLD]
    new_ptr, s_new_n, s_new_h, s_new_f, s_new_e,  # new attention cache (N, H, T+L, 2D)
    valid_ptr, cached_ptr,      # (N,) int32 clamped T_n, L_n
    bar_ptr, bar_base,          # barrier counter (int32 [2], zero at the body call's start); barriers before
    dep_ptr, blk,               # FLOW: (11, N) int32 tiles done per (phase, sequence), zero at the call's start;
                                # this block's index in the call
    NR, T, L, C, H, MLP, qk_scale, eps_block, eps_conv, eps_qk,
    ph_lo, ph_hi,               # phases [ph_lo, ph_hi) of this launch
    D: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BQ: tl.constexpr, BKV: tl.constexpr,
    CF: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr, S_PROJ: tl.constexpr, S_FC2: tl.constexpr,
    HAS_CNN: tl.constexpr, HAS_OLD: tl.constexpr, SYNC: tl.constexpr, DOT_PRECISION: tl.constexpr,
    COPY_LO: tl.constexpr, COPY_HI: tl.constexpr, MAX_SPIN_: tl.constexpr,
    PHASE_MASK: tl.constexpr,   # bit p set: phase p's code is compiled in (launches run only those phases)
    FLOW: tl.constexpr,         # per-sequence dependency counters instead of grid barriers (see BlockPlan)
):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    INNER = H * D
    M = NR * T
    MH = NR * (T + 2)
    n_mt = tl.cdiv(M, BM)
    n_norm = tl.cdiv(M, ROWS)
    n_cf = tl.cdiv(T + L, CF)
    n_copy = NR * H * n_cf
    for phase in range(ph_lo, ph_hi):
        n_work = n_norm
        if (PHASE_MASK >> 0) & 1:
            if phase == 0:  # packed QKV, one head per tile
                n_work = n_mt * (3 * INNER // D)
                for tile in range(pid, n_work, G):
                    m0 = (tile // (3 * INNER // D)) * BM
                    n0 = (tile % (3 * INNER // D)) * D
                    acc = _gemm_tile(a_ptr, C, qkv_w, C, m0, n0, 0, C, M, 3 * INNER, BM, D, BK, DOT_PRECISION)
                    acc += tl.load(qkv_b + n0 + tl.arange(0, D)).to(tl.float32)[None, :]
                    offs_m = m0 + tl.arange(0, BM)
                    _qkv_head_epilogue(acc, offs_m, offs_m < M, n0, T, H, eps_qk, qn_w, qn_b, kn_w, kn_b, q_ptr,
                                       new_ptr, s_new_n, s_new_h, s_new_f, s_new_e, valid_ptr, D)
                    if FLOW:
                        _flow_signal(dep_ptr, 0, m0, m0 + BM, T, NR)
        if (PHASE_MASK >> 1) & 1:
            if phase == 1:  # attention
                n_qt = tl.cdiv(T, BQ)
                n_work = NR * H * n_qt
                for tile in range(pid, n_work, G):
                    nh = tile // n_qt
                    seq = nh // H
                    if FLOW:
                        if phase > ph_lo:  # (else the producer ran in an earlier launch)
                            _flow_wait(dep_ptr, bar_ptr + 1, 0, seq * T, seq * T + 1, T,
                                       NR, blk, T, H, C, MLP, D, BM, BQ, ROWS, S_PROJ, S_FC2, MAX_SPIN_)
                    n = seq.to(tl.int64)
                    tn = tl.load(valid_ptr + n)
                    kl = tn + tl.load(cached_ptr + n)
                    _attention_tile(q_ptr, o_ptr, new_ptr, s_new_n, s_new_h, s_new_f, s_new_e,
                                    old_ptr, s_old_n, s_old_h, s_old_f, s_old_e, n, nh % H,
                                    (tile % n_qt) * BQ, tn, kl, T, INNER, qk_scale, D, BQ, BKV, HAS_OLD, DOT_PRECISION)
                    if FLOW:
                        _flow_signal(dep_ptr, 1, seq * T, seq * T + 1, T, NR)
        if (PHASE_MASK >> 2) & 1:
            if phase == 2:  # proj: split-K into float32 partials
                n_work = n_mt * (C // D) * S_PROJ
                _splitk_phase(pid, G, o_ptr, proj_w, y_ptr, M, C, INNER, S_PROJ, BM, D, BK, DOT_PRECISION,
                              dep_ptr, bar_ptr + 1, blk, 2, ph_lo, NR, T, H, MLP, BQ, ROWS, S_PROJ, S_FC2, FLOW,
                              MAX_SPIN_)
        if (PHASE_MASK >> 3) & 1:
            if phase == 3:  # proj + bias, residual + gate_a, LN, modulation (c) -> conv-1 history
                for tile in range(pid, n_norm, G):
                    if FLOW:
                        if phase > ph_lo:  # (else the producer ran in an earlier launch)
                            _flow_wait(dep_ptr, bar_ptr + 1, 2, tile * ROWS, tile * ROWS + ROWS, T,
                                       NR, blk, T, H, C, MLP, D, BM, BQ, ROWS, S_PROJ, S_FC2, MAX_SPIN_)
                    _rownorm_rows(tile * ROWS, y_ptr, C, M * C, proj_b, h_ptr, tab_ptr, stride_tab, gate_a, shift_c,
                                  scale_c, h_ptr, h_ptr, hist1_ptr, T + 2, 2, cnn_ptr, s_cnn_n, s_cnn_c, s_cnn_j, 0,
                                  h_ptr, h_ptr, 0, 0, 0, 0, valid_ptr, M, T, C, eps_block,
                                  False, True, True, True, True, 0, True, HAS_CNN, False, S_PROJ, ROWS, BLOCK_C, False, False)
                    if FLOW:
                        _flow_signal(dep_ptr, 3, tile * ROWS, tile * ROWS + ROWS, T, NR)
        if (PHASE_MASK >> 4) & 1:
            if phase == 4:  # conv-1 taps GEMM over the history
                n_work = tl.cdiv(MH, BM) * (3 * C // D)
                _taps_phase(pid, G, hist1_ptr, c1_w, z_ptr, MH, C, BM, D, BK, DOT_PRECISION,
                            dep_ptr, bar_ptr + 1, blk, 4, ph_lo, NR, T, H, MLP, BQ, ROWS, S_PROJ, S_FC2, FLOW,
                            MAX_SPIN_)
        if (PHASE_MASK >> 5) & 1:
            if phase == 5:  # conv-1 tap sum + bias, affine LN, Mish -> conv-2 history; conv-1 cache
                for tile in range(pid, n_norm, G):
                    if FLOW:
                        if phase > ph_lo:  # (else the producer ran in an earlier launch)
                            _flow_wait(dep_ptr, bar_ptr + 1, 4, tile * ROWS, tile * ROWS + ROWS, T,
                                       NR, blk, T, H, C, MLP, D, BM, BQ, ROWS, S_PROJ, S_FC2, MAX_SPIN_)
                    _rownorm_rows(tile * ROWS, z_ptr, 3 * C, 0, c1_b, h_ptr, tab_ptr, stride_tab, 0, 0, 0, cn_w, cn_b,
                                  hist2_ptr, T + 2, 2, cnn_ptr, s_cnn_n, s_cnn_c, s_cnn_j, C,
                                  hist1_ptr, ncnn_ptr, s_ncnn_n, s_ncnn_c, s_ncnn_j, 0, valid_ptr, M, T, C, eps_conv,
                                  True, True, False, False, False, 1, True, HAS_CNN, True, 1, ROWS, BLOCK_C, False, False)
                    if FLOW:
                        _flow_signal(dep_ptr, 5, tile * ROWS, tile * ROWS + ROWS, T, NR)
        if (PHASE_MASK >> 6) & 1:
            if phase == 6:  # conv-2 taps GEMM
                n_work = tl.cdiv(MH, BM) * (3 * C // D)
                _taps_phase(pid, G, hist2_ptr, c2_w, z2_ptr, MH, C, BM, D, BK, DOT_PRECISION,
                            dep_ptr, bar_ptr + 1, blk, 6, ph_lo, NR, T, H, MLP, BQ, ROWS, S_PROJ, S_FC2, FLOW,
                            MAX_SPIN_)
        if (PHASE_MASK >> 7) & 1:
            if phase == 7:  # conv-2 tap sum + bias, residual + gate_c, LN, modulation (m); conv-2 cache
                for tile in range(pid, n_norm, G):
                    if FLOW:
                        if phase > ph_lo:  # (else the producer ran in an earlier launch)
                            _flow_wait(dep_ptr, bar_ptr + 1, 6, tile * ROWS, tile * ROWS + ROWS, T,
                                       NR, blk, T, H, C, MLP, D, BM, BQ, ROWS, S_PROJ, S_FC2, MAX_SPIN_)
                    _rownorm_rows(tile * ROWS, z2_ptr, 3 * C, 0, c2_b, h_ptr, tab_ptr, stride_tab, gate_c, shift_m,
                                  scale_m, h_ptr, h_ptr, a_ptr, T, 0, h_ptr, 0, 0, 0, 0,
                                  hist2_ptr, ncnn_ptr, s_ncnn_n, s_ncnn_c, s_ncnn_j, C, valid_ptr, M, T, C, eps_block,
                                  True, True, True, True, True, 0, False, False, True, 1, ROWS, BLOCK_C, False, False)
                    if FLOW:
                        _flow_signal(dep_ptr, 7, tile * ROWS, tile * ROWS + ROWS, T, NR)
        if (PHASE_MASK >> 8) & 1:
            if phase == 8:  # fc1 + GELU
                n_nt = MLP // D
                n_work = n_mt * n_nt
                for tile in range(pid, n_work, G):
                    m0 = (tile // n_nt) * BM
                    n0 = (tile % n_nt) * D
                    if FLOW:
                        if phase > ph_lo:  # (else the producer ran in an earlier launch)
                            _flow_wait(dep_ptr, bar_ptr + 1, 7, m0, m0 + BM, T,
                                       NR, blk, T, H, C, MLP, D, BM, BQ, ROWS, S_PROJ, S_FC2, MAX_SPIN_)
                    acc = _gemm_tile(a_ptr, C, fc1_w, C, m0, n0, 0, C, M, MLP, BM, D, BK, DOT_PRECISION)
                    acc += tl.load(fc1_b + n0 + tl.arange(0, D)).to(tl.float32)[None, :]
                    _store_tile(f_ptr, MLP, _gelu_tanh(acc), m0, n0, M, MLP, BM, D)
                    if FLOW:
                        _flow_signal(dep_ptr, 8, m0, m0 + BM, T, NR)
        if (PHASE_MASK >> 9) & 1:
            if phase == 9:  # fc2: split-K into float32 partials
                n_work = n_mt * (C // D) * S_FC2
                _splitk_phase(pid, G, f_ptr, fc2_w, y2_ptr, M, C, MLP, S_FC2, BM, D, BK, DOT_PRECISION,
                              dep_ptr, bar_ptr + 1, blk, 9, ph_lo, NR, T, H, MLP, BQ, ROWS, S_PROJ, S_FC2, FLOW,
                              MAX_SPIN_)
        if (PHASE_MASK >> 10) & 1:
            if phase == 10:  # fc2 + bias, residual + gate_m, LN, next block's modulation (a)
                for tile in range(pid, n_norm, G):
                    if FLOW:
                        if phase > ph_lo:  # (else the producer ran in an earlier launch)
                            _flow_wait(dep_ptr, bar_ptr + 1, 9, tile * ROWS, tile * ROWS + ROWS, T,
                                       NR, blk, T, H, C, MLP, D, BM, BQ, ROWS, S_PROJ, S_FC2, MAX_SPIN_)
                    _rownorm_rows(tile * ROWS, y2_ptr, C, M * C, fc2_b, h_ptr, tab_ptr, stride_tab, gate_m, shift_n,
                                  scale_n, h_ptr, h_ptr, a_ptr, T, 0, h_ptr, 0, 0, 0, 0,
                                  h_ptr, h_ptr, 0, 0, 0, 0, valid_ptr, M, T, C, eps_block,
                                  False, True, True, True, True, 0, False, False, False, S_FC2, ROWS, BLOCK_C, False, False)
        # old frames of the new cache: an even share of the copy tiles in each phase of
        # [COPY_LO, COPY_HI), taken by the programs after this phase's last work tile
        if (phase >= COPY_LO) & (phase < COPY_HI):
            j_lo = (phase - COPY_LO) * n_copy // (COPY_HI - COPY_LO)
            j_hi = (phase - COPY_LO + 1) * n_copy // (COPY_HI - COPY_LO)
            for tile in range(n_work + ((pid - n_work) % G + G) % G, n_work + j_hi - j_lo, G):
                j = j_lo + tile - n_work
                nh = j // n_cf
                n = (nh // H).to(tl.int64)
                _old_frames_tile(old_ptr, s_old_n, s_old_h, s_old_f, s_old_e, new_ptr, s_new_n, s_new_h,
                                 s_new_f, s_new_e, n, nh % H, (j % n_cf) * CF, tl.load(valid_ptr + n),
                                 tl.load(cached_ptr + n), T, L, D, CF, HAS_OLD)
        if SYNC:
            if phase + 1 < ph_hi:
                _grid_sync(bar_ptr, (bar_base + phase - ph_lo + 1) * G, MAX_SPIN_)


def split_factors(inner: int, mlp: int, block_k: int) -> tuple[int, int]:
    """Split-K factors of proj (K = H*D) and fc2 (K = mlp): the largest <= SPLIT_PROJ / SPLIT_FC2
    whose K slices are whole BK steps."""
    def largest(k, want):
        return next(s for s in range(want, 0, -1) if k % (s * block_k) == 0)

    return largest(inner, SPLIT_PROJ), largest(mlp, SPLIT_FC2)


def _phase_tiles(n_rows: int, t_len: int, l_len: int, c: int, heads: int, head_dim: int, mlp: int,
                 cfg: dict) -> list[int]:
    """Tiles of each phase incl. its share of the copy tiles (the kernel derives the same counts;
    this sizes the per-phase grids)."""
    m, mh = n_rows * t_len, n_rows * (t_len + CONV_HISTORY)
    inner = heads * head_dim
    mt, mht = triton.cdiv(m, cfg["BM"]), triton.cdiv(mh, cfg["BM"])
    norm = triton.cdiv(m, cfg["ROWS"])
    s_proj, s_fc2 = split_factors(inner, mlp, min(64, head_dim))
    work = [mt * 3 * inner // head_dim, n_rows * heads * triton.cdiv(t_len, cfg["BQ"]),
            mt * (c // head_dim) * s_proj, norm, mht * 3 * c // head_dim, norm, mht * 3 * c // head_dim, norm,
            mt * mlp // head_dim, mt * (c // head_dim) * s_fc2, norm]
    n_copy = n_rows * heads * triton.cdiv(t_len + l_len, cfg["CF"])
    lo, hi = cfg["COPY_LO"], cfg["COPY_HI"]
    for p in range(lo, hi):
        work[p] += (p - lo + 1) * n_copy // (hi - lo) - (p - lo) * n_copy // (hi - lo)
    return work


def launch_groups(split_at: int) -> list[tuple[int, int]]:
    """The phase ranges [lo, hi) of one block's launches: a launch starts at phase 0 and at every
    phase p > 0 whose bit is set in ``split_at``."""
    starts = [0] + [p for p in range(1, len(PHASES)) if (split_at >> p) & 1]
    return list(zip(starts, starts[1:] + [len(PHASES)]))


def phase_mask(lo: int, hi: int) -> int:
    return ((1 << hi) - 1) & ~((1 << lo) - 1)


def v7_unsupported(c: int, heads: int, head_dim: int, mlp: int) -> list[str]:
    """Why the v7 body cannot run these widths (empty: it can). Its GEMM tiles are one head wide
    and walk K in steps of min(64, head_dim)."""
    reasons = []
    if head_dim not in (16, 32, 64, 128):
        reasons.append(f"head_dim={head_dim} not in (16, 32, 64, 128)")
    bk = min(64, head_dim)
    for name, k in (("hidden", c), ("heads*head_dim", heads * head_dim), ("mlp", mlp)):
        if k % head_dim or k % bk:
            reasons.append(f"{name}={k} is not a multiple of head_dim={head_dim}")
    return reasons


class BlockPlan:
    """The launches of one v7 body call: its buffers, grids and per-block kernel arguments.

    ``block(i)`` runs block i as the config says: one launch per group of phases
    (:func:`launch_groups`; a group of several phases runs on the persistent grid behind grid
    barriers, a single phase on one program per tile), or one launch per phase off CUDA.
    ``launch(i, grid, lo, hi, ...)`` runs any phase range (the bench, ``bench/dit_block.py``).
    """

    def __init__(self, x_in, weights, table, cnn_cache, att_cache, valid, cached, precision, out, *,
                 persistent: Optional[bool] = None, bar: Optional[torch.Tensor] = None,
                 config: Optional[dict] = None):
        _, new_cnn, new_att = out
        n_rows, _, t_len, depth, c, heads, head_dim, inner, mlp = _body_sizes(x_in, weights)
        reasons = v7_unsupported(c, heads, head_dim, mlp)
        if reasons:
            raise ValueError("dit_body_triton: variant 'v7' cannot run this model: " + "; ".join(reasons))
        m, mh = n_rows * t_len, n_rows * (t_len + CONV_HISTORY)
        cd, dev = x_in.dtype, x_in.device
        l_len = 0 if att_cache is None else att_cache.shape[3]
        self.device, self.depth, self.c = dev, depth, c
        cfg = dict(CONFIG, **(config or {}))
        if not (0 <= cfg["COPY_LO"] < cfg["COPY_HI"] <= len(PHASES)) or cfg["num_warps"] > 8:
            raise ValueError(f"dit_block: bad launch config {cfg}")
        self.ctas = cfg.pop("CTAS")
        split_at = cfg.pop("SPLIT_AT")
        self.specialize = bool(cfg.pop("SPECIALIZE"))
        self.flow = bool(cfg.pop("FLOW"))
        g_max = cfg.pop("G_MAX")
        # off CUDA (the interpreter runs programs one after another) only a one-program grid may wait
        persistent = PERSISTENT and dev.type == "cuda" if persistent is None else persistent
        if persistent and dev.type != "cuda" and g_max != 1:
            raise ValueError("dit_block: a persistent launch off CUDA needs config G_MAX=1")
        self.groups = launch_groups(split_at if persistent else ALL_PHASES)
        self.barriers_per_block = 0 if self.flow else sum(hi - lo - 1 for lo, hi in self.groups)
        s_proj, s_fc2 = split_factors(inner, mlp, min(64, head_dim))
        self.h = torch.empty((m, c), dtype=torch.float32, device=dev)
        self.a = torch.empty((m, c), dtype=cd, device=dev)
        bufs = (self.a, self.h, torch.empty((m, inner), dtype=cd, device=dev),  # q
                torch.empty((m, inner), dtype=cd, device=dev),  # attention output
                torch.empty((s_proj, m, c), dtype=torch.float32, device=dev),  # proj split-K partials
                torch.empty((s_fc2, m, c), dtype=torch.float32, device=dev),  # fc2 split-K partials
                torch.empty((mh, c), dtype=cd, device=dev), torch.empty((mh, c), dtype=cd, device=dev),  # histories
                torch.empty((mh, 3 * c), dtype=cd, device=dev), torch.empty((mh, 3 * c), dtype=cd, device=dev),  # taps
                torch.empty((m, mlp), dtype=cd, device=dev))  # MLP hidden
        self.bar = torch.zeros(2, dtype=torch.int32, device=dev) if bar is None else bar
        self.deps = torch.zeros((len(PHASES), n_rows) if self.flow else (1, 1), dtype=torch.int32, device=dev)
        self.tiles = _phase_tiles(n_rows, t_len, l_len, c, heads, head_dim, mlp, cfg)
        self.grid = min(self.ctas * sm_count(dev), max(self.tiles), g_max or max(self.tiles))
        stride_tab = 0 if table.shape[0] == 1 else table.stride(0)
        self.consts = dict(cfg, D=head_dim, BK=min(64, head_dim), BKV=BLOCK_KV, BLOCK_C=triton.next_power_of_2(c),
                           S_PROJ=s_proj, S_FC2=s_fc2, HAS_CNN=cnn_cache is not None, HAS_OLD=l_len > 0,
                           DOT_PRECISION=_dot_precision(cd, precision))
        self._args = []
        for i in range(depth):
            nxt = (i + 1, SHIFT_A, SCALE_A) if i + 1 < depth else (depth, 0, 1)
            mods = [_mod_off(i, GATE_A, c), _mod_off(i, SHIFT_C, c), _mod_off(i, SCALE_C, c), _mod_off(i, GATE_C, c),
                    _mod_off(i, SHIFT_M, c), _mod_off(i, SCALE_M, c), _mod_off(i, GATE_M, c),
                    _mod_off(nxt[0], nxt[1], c), _mod_off(nxt[0], nxt[2], c)]
            cnn_i = cnn_cache[i] if cnn_cache is not None else new_cnn[i]
            old_i = att_cache[i] if l_len > 0 else new_att[i]
            new_i, ncnn_i = new_att[i], new_cnn[i]
            self._args.append((
                [*bufs, *weights[2 + PER_BLOCK * i: 2 + PER_BLOCK * (i + 1)], table, stride_tab, *mods,
                 cnn_i, cnn_i.stride(0), cnn_i.stride(1), cnn_i.stride(2),
                 ncnn_i, ncnn_i.stride(0), ncnn_i.stride(1), ncnn_i.stride(2),
                 old_i, *old_i.stride(), new_i, *new_i.stride(), valid, cached, self.bar],
                [self.deps, i, n_rows, t_len, l_len, c, heads, mlp, 1.4426950408889634 / head_dim ** 0.5,
                 BLOCK_LN_EPS, CONV_LN_EPS, QK_NORM_EPS]))

    def launch(self, i: int, grid: int, lo: int, hi: int, *, bar_base: int = 0, mask: Optional[int] = None,
               sync: Optional[bool] = None):
        """Phases [lo, hi) of block i on ``grid`` programs. ``mask``: the phases compiled into the
        kernel (default: exactly [lo, hi)); ``sync``: programs wait for each other between the
        phases — grid barriers, or the FLOW counters (default: when there are several; then
        ``grid`` must be the persistent grid)."""
        mask = phase_mask(lo, hi) if mask is None else mask
        sync = hi - lo > 1 if sync is None else sync
        head, tail = self._args[i]
        flow = sync and self.flow
        consts = dict(self.consts, PHASE_MASK=mask, SYNC=sync and not flow, FLOW=flow)
        if sync and self.device.type == "cuda":
            key = (self.device.index, self.a.dtype, grid, tuple(sorted(consts.items())))
            if key not in _RESIDENT:  # once per process, not per body call
                self._check_fits(grid, consts)
                _RESIDENT.add(key)
        with on_device(self.device):
            return _dit_block_kernel[(grid,)](*head, bar_base, *tail, lo, hi, **consts)

    def reset(self) -> None:
        """Zero the barrier and FLOW counters (a body call starts from fresh ones; a graph that
        replays one block's launches must reset them itself)."""
        self.bar.zero_()
        self.deps.zero_()

    def block(self, i: int) -> None:
        base = i * self.barriers_per_block
        for lo, hi in self.groups:
            self.launch(i, self.grid if hi - lo > 1 else self.tiles[lo], lo, hi, bar_base=base,
                        mask=None if self.specialize else ALL_PHASES)
            base += hi - lo - 1

    def _check_fits(self, grid: int, consts: dict) -> None:
        """All programs of a launch with barriers must be resident at once (else a barrier would
        wait on programs that cannot start): compile first, then check the programs per SM."""
        head, tail = self._args[0]
        k = _dit_block_kernel.warmup(*head, 0, *tail, 0, len(PHASES), grid=(grid,), **consts)
        if not hasattr(k, "n_regs"):
            k._init_handles()  # Triton loads the binary (and learns its register count) lazily
        per_sm = -(-grid // sm_count(self.device))
        warps = consts["num_warps"]
        regs = -(-max(k.n_regs, 1) * 32 // 256) * 256 * warps  # allocated per warp in units of 256
        shared = k.metadata.shared
        if per_sm * regs > REGISTERS_PER_SM or per_sm * shared > SHARED_PER_SM:
            raise ValueError(f"dit_block: {per_sm} programs per SM do not fit ({k.n_regs} registers x "
                             f"{warps} warps, {shared} B shared each); lower CTAS or set maxnreg")


def body_v7(x_in, weights, table, cnn_cache, att_cache, valid, cached, precision, out, *,
            persistent: Optional[bool] = None, bar: Optional[torch.Tensor] = None, config: Optional[dict] = None,
            plans: Optional[list] = None):
    """The "v7" body: in_proj + boundary row-norm, one persistent launch per block
    (:func:`_dit_block_kernel`), final layer. Arguments as
    :func:`torch_cfm.kernels.dit_body.dit_body_triton`; ``persistent`` None = :data:`PERSISTENT`
    on CUDA (the interpreter always launches phase by phase). ``bar``: the barrier counter
    (int32 (2,), zero; tests read it back), else a fresh one. ``config``: overrides of
    :data:`CONFIG`. ``plans``: the :class:`BlockPlan` is appended to it (tests)."""
    vel = out[0]
    n_rows, _, t_len, depth, c = _body_sizes(x_in, weights)[:5]
    plan = BlockPlan(x_in, weights, table, cnn_cache, att_cache, valid, cached, precision, out,
                     persistent=persistent, bar=bar, config=config)
    if plans is not None:
        plans.append(plan)
    y0 = torch.matmul(x_in.transpose(1, 2), weights[0].t()).view(n_rows * t_len, c)
    rownorm(y0, plan.h, plan.a, valid, bias=weights[1], has_res=False, table=table,
            shift=_mod_off(0, SHIFT_A, c), scale=_mod_off(0, SCALE_A, c), n_rows=n_rows, t_len=t_len)
    for i in range(depth):
        plan.block(i)
    out_w, out_b = weights[-2], weights[-1]
    torch.baddbmm(out_b[None, :, None], out_w.expand(n_rows, -1, -1), plan.a.view(n_rows, t_len, c).transpose(1, 2),
                  out=vel)
    return out
