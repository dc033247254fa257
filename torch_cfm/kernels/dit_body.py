"""The host driver of one fused DiT body call (sync-free, graph-capturable).

The body (one estimator evaluation of a chunk, SPEC §1-2, §4) is GEMMs stitched together by the
body's own kernels, each doing everything between two GEMMs in one pass: the row-norm boundaries
(:mod:`torch_cfm.kernels.rownorm`), the q/k-cache write (:mod:`torch_cfm.kernels.qk_cache`) before
``cfm_attention``, or both fused with the attention (:mod:`torch_cfm.kernels.dit_attention`). Which
kernel runs each role is a :class:`~torch_cfm.kernels.body_plans.BodyPlan` from the tuning table
(:mod:`torch_cfm.kernels.body_plans`); :func:`dit_body_triton` reads one plan and nothing else.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from ..config import CONV_LN_EPS, QK_NORM_EPS
from ..packing import (GATE_A, GATE_C, GATE_M, MOD_VECTORS, PER_BLOCK, SCALE_A, SCALE_C, SCALE_M,
                       SHIFT_A, SHIFT_C, SHIFT_M)
from . import dit_linear_cuda
from ._launch import pdl_supported, plan_pdl
from .body_plans import BodyPlan, body_plan, choose_variant, named_plan, resolve_plan, scoped_plan
from .cfg_euler import cfg_euler
from .cfm_attention import AttentionConfig
from .dit_attention import attention_cache
from .dit_linear_cuda import device_reason, linear_into, linear_splitk_into, qkv_cache_into
from .qk_cache import qk_cache
from .rownorm import rownorm

CONV_HISTORY = 2  # causal conv k=3: 2 cached frames in front of the chunk


def wgmma_available(device: torch.device) -> bool:
    """Whether the wgmma plans' GEMMs run on ``device``: the SM90a kernel is there and PDL is on (each
    GEMM loads its weights under the kernel in front of it only with PDL)."""
    return pdl_supported(device) and device_reason(device) is None


def plan_for(x_in: torch.Tensor, precision: Optional[str], plan: Union[BodyPlan, str, None] = None,
             arena: bool = False) -> BodyPlan:
    """The plan one body call runs: ``plan`` (a BodyPlan or a plan name, :func:`body_plans.named_plan`)
    or, without one, the :func:`body_plans.use_plan` block's or the table's for the call's dtype and rows
    (on the arena: their ``arena_plan`` where they have no arena form); with its fallback where the
    wgmma kernel cannot run."""
    if plan is not None:
        chosen = named_plan(plan, x_in.dtype, precision)
        if arena and chosen.arena_plan is not None:
            raise ValueError(f"dit_body_triton: arena=True needs a plan with an arena form, got {chosen.name!r}")
    elif scoped_plan() is not None:
        chosen = named_plan(scoped_plan(), x_in.dtype, precision)
        chosen = chosen.arena_plan if arena and chosen.arena_plan is not None else chosen
    else:
        chosen = body_plan(x_in.dtype, precision, x_in.shape[0], arena=arena)
    return resolve_plan(chosen, wgmma=not chosen.uses_wgmma or wgmma_available(x_in.device))


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


def _fused_attention_dot_precision(dtype: torch.dtype, precision: Optional[str]) -> str:
    """attention_cache's dots: as ``cfm_attention``'s (fp32 "ieee" = its default ``ieee_dot``, 3xTF32)."""
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
    plan: Union[BodyPlan, str, None] = None,
    arena: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One fused body call writing into ``out`` = (velocity (N, Cout, T), new_cnn_cache
    (depth, N, 2C, 2), new_att_cache (depth, N, H, T+L, 2D)).

    ``arena=True`` (the in-place form; ``att_cache`` must be None): ``out[2]`` is the attention-cache
    arena (depth, N, H, P, 2D), read and written in place. Row n's L_n old keys sit at frames [0, L_n)
    in reversed key order (frame j = SPEC key L_n - 1 - j); the call writes its T_n current keys at
    [L_n, L_n + T_n), reversed too, and copies nothing else, so afterwards frames [0, T_n + L_n) are
    the row's SPEC §2 new cache in reversed order. P >= L_n + T_n for every row (``cached`` +
    ``valid``), which the caller guarantees.

    ``valid``/``cached`` must already be clamped int32 (N,) on the device; ``mod_table`` float32
    (R, depth+1, 9, C) contiguous. GEMMs run in cuBLAS (on CPU: torch, for the Triton interpreter)
    with the caller's TF32 setting, or on the wgmma kernel where the plan says so (each call it cannot
    take stays on cuBLAS); attention through ``torch_cfm::cfm_attention``.

    ``plan``: a :class:`~torch_cfm.kernels.body_plans.BodyPlan`, or the name of one in the call's
    dtype family ("v1", "v5", "v9"); None: the tuning table's (:func:`plan_for`). Per block, v1 runs
    3 row-norms + q/k cache + attention + 6 GEMMs + GELU = 12 kernels; v5 fuses the q/k cache into
    the attention (11); v9 runs qkv, proj, the conv GEMMs and the MLP on the wgmma kernel, fc2 as
    split-K partials summed by the row-norm behind it, and on the arena (16-bit) the QKV GEMM with the
    q/k-cache work in its epilogue (11).
    """
    p = plan_for(x_in, precision, plan, arena)
    if arena and att_cache is not None:
        raise ValueError("dit_body_triton: arena=True takes att_cache=None (the arena is out[2])")
    vel, new_cnn, new_att = out
    n_rows, _, t_len, depth, c, heads, head_dim, inner, mlp = _body_sizes(x_in, weights)
    m = n_rows * t_len
    cd = x_in.dtype
    dev = x_in.device
    att_precision = _attention_precision(cd, precision)
    key_lengths = valid + cached

    h = torch.empty((m, c), dtype=torch.float32, device=dev)
    a = torch.empty((m, c), dtype=cd, device=dev)
    y = torch.empty((m, c), dtype=cd, device=dev)
    qkv = torch.empty((m, 3 * inner), dtype=cd, device=dev)
    qbuf = torch.empty((n_rows, t_len, heads, head_dim), dtype=cd, device=dev)  # queries, or the attention output
    hist1 = torch.empty((n_rows * (t_len + CONV_HISTORY), c), dtype=cd, device=dev)
    hist2 = torch.empty_like(hist1)
    z = torch.empty((n_rows * (t_len + CONV_HISTORY), 3 * c), dtype=cd, device=dev)
    fbuf = torch.empty((m, mlp), dtype=cd, device=dev)
    common = dict(n_rows=n_rows, t_len=t_len)
    # fp32 operands go to the wgmma kernel only as TF32 (its linear_into refuses IEEE fp32 calls)
    tf32 = cd == torch.float32 and precision == "tf32"
    linear_pdl = plan_pdl(p, "linear", dev)
    rn = dict(pdl=plan_pdl(p, "rownorm", dev), launch=p.rownorm_launch)
    qk_pdl = plan_pdl(p, "qk_cache", dev)

    def gemm(kernel: str, a_, w_, b_, out_):
        """``out_ = a_ @ w_.T (+ b_)``: on the wgmma kernel where the role's kernel says so and the
        call fits it, else cuBLAS."""
        if kernel == "wgmma" and linear_into(a_, w_, b_, out_, pdl=linear_pdl, tf32=tf32):
            return
        _cublas_mm(a_, w_, b_, out_)

    fc2_parts = None  # the split-K fc2's fp32 partial sums (splits, M, C)
    fc2_config = p.fc2_splitk or (dit_linear_cuda.TF32_SPLITK_CONFIG if cd == torch.float32
                                  else dit_linear_cuda.SPLITK_CONFIG)
    if p.fc2 == "wgmma_splitk":
        fc2_parts = torch.empty((fc2_config[0], m, c), dtype=torch.float32, device=dev)

    # staged input -> in_proj (bias added in the first boundary kernel)
    y0 = torch.matmul(x_in.transpose(1, 2), weights[0].t()).view(m, c)
    rownorm(y0, h, a, valid, bias=weights[1], has_res=False, table=mod_table,
            shift=_mod_off(0, SHIFT_A, c), scale=_mod_off(0, SCALE_A, c), **rn, **common)
    for i in range(depth):
        (qkv_w, qkv_b, qn_w, qn_b, kn_w, kn_b, proj_w, proj_b, c1_w, c1_b, cn_w, cn_b,
         c2_w, c2_b, fc1_w, fc1_b, fc2_w, fc2_b) = weights[2 + PER_BLOCK * i: 2 + PER_BLOCK * (i + 1)]
        cnn_i = cnn_cache[i] if cnn_cache is not None else None
        norms = (qn_w, qn_b, kn_w, kn_b)
        old = att_cache[i] if att_cache is not None and att_cache.shape[3] > 0 else None
        # attention: packed QKV GEMM, q/k norm + cache write, attention over the new cache
        if p.attention == "attention_cache":
            gemm(p.qkv, a, qkv_w, qkv_b, qkv)
            attention_cache(qkv, norms, old, new_att[i], qbuf, valid, cached, heads=heads, head_dim=head_dim,
                            dot_precision=_fused_attention_dot_precision(cd, precision),
                            pdl=plan_pdl(p, "attention_cache", dev), launch=dict(p.attention_launch), **common)
            gemm(p.proj, qbuf.view(m, inner), proj_w, proj_b, y)
        else:
            if not (arena and p.arena_qkv == "wgmma_qk_cache" and qkv_cache_into(
                    a, qkv_w, qkv_b, norms, qbuf.view(m, inner), new_att[i], valid, cached, t_len=t_len,
                    eps=QK_NORM_EPS, pdl=linear_pdl)):
                gemm(p.qkv, a, qkv_w, qkv_b, qkv)
                qk_cache(qkv, norms, qbuf, old, new_att[i], valid, cached, heads=heads, head_dim=head_dim,
                         append=arena, pdl=qk_pdl, **common)
            kv = new_att[i]
            o = torch.ops.torch_cfm.cfm_attention.default(
                qbuf.permute(0, 2, 1, 3), kv[..., :head_dim], kv[..., head_dim:], key_lengths, None, None,
                att_precision)
            gemm(p.proj, o.transpose(1, 2).reshape(m, inner), proj_w, proj_b, y)
        # residual + gate_a, LN, modulation (c) -> conv-1 history (frames 0,1 from the conv cache)
        rownorm(y, h, hist1, valid, table=mod_table, gate=_mod_off(i, GATE_A, c), shift=_mod_off(i, SHIFT_C, c),
                scale=_mod_off(i, SCALE_C, c), out_t=t_len + CONV_HISTORY, out_off=CONV_HISTORY, head=(cnn_i, 0),
                **rn, **common)
        gemm(p.conv, hist1, c1_w, None, z)
        # conv-1 tap sum + bias, affine LN, Mish -> conv-2 history; emit conv-1 cache
        rownorm(z, h, hist2, valid, taps=True, bias=c1_b, has_res=False, write_h=False,
                ln_affine=(cn_w, cn_b), eps=CONV_LN_EPS, out_t=t_len + CONV_HISTORY, out_off=CONV_HISTORY,
                head=(cnn_i, c), emit=(hist1, new_cnn[i], 0), **rn, **common)
        gemm(p.conv, hist2, c2_w, None, z)
        # conv-2 tap sum + bias, residual + gate_c, LN, modulation (m); emit conv-2 cache
        rownorm(z, h, a, valid, taps=True, bias=c2_b, table=mod_table, gate=_mod_off(i, GATE_C, c),
                shift=_mod_off(i, SHIFT_M, c), scale=_mod_off(i, SCALE_M, c),
                emit=(hist2, new_cnn[i], c), **rn, **common)
        # MLP
        if p.fc1 == "wgmma_gelu" and linear_into(a, fc1_w, fc1_b, fbuf, gelu=True, pdl=linear_pdl, tf32=tf32):
            pass
        elif dev.type == "cuda":
            # GELU (tanh) in the cuBLASLt epilogue; torch applies the same GELU after the GEMM
            # where Lt cannot take the call. (Its CPU kernel uses the erf GELU: not used there.)
            torch._addmm_activation(fc1_b, a, fc1_w.t(), use_gelu=True, out=fbuf)
        else:
            torch.addmm(fc1_b, a, fc1_w.t(), out=fbuf)
            torch.ops.aten.gelu_(fbuf, approximate="tanh")
        nxt = (i + 1, SHIFT_A, SCALE_A) if i + 1 < depth else (depth, 0, 1)
        if fc2_parts is not None and linear_splitk_into(fbuf, fc2_w, fc2_parts, pdl=linear_pdl, config=fc2_config,
                                                        tf32=tf32):
            y_fc2, b_fc2 = fc2_parts, fc2_b  # the row-norm adds the partials and the bias
        else:
            torch.addmm(fc2_b, fbuf, fc2_w.t(), out=y)
            y_fc2, b_fc2 = y, None
        rownorm(y_fc2, h, a, valid, bias=b_fc2, table=mod_table, gate=_mod_off(i, GATE_M, c),
                shift=_mod_off(nxt[0], nxt[1], c), scale=_mod_off(nxt[0], nxt[2], c), **rn, **common)
    out_w, out_b = weights[-2], weights[-1]
    torch.baddbmm(out_b[None, :, None], out_w.expand(n_rows, -1, -1), a.view(n_rows, t_len, c).transpose(1, 2),
                  out=vel)
    return vel, new_cnn, new_att


def _cublas_mm(a: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor) -> None:
    """``out = a @ w.T (+ bias)`` on cuBLAS."""
    if bias is None:
        torch.mm(a, w.t(), out=out)
    else:
        torch.addmm(bias, a, w.t(), out=out)


__all__ = ["CONV_HISTORY", "BodyPlan", "cfg_euler", "choose_variant", "dit_body_triton", "plan_for", "qk_cache",
           "rownorm", "wgmma_available"]
