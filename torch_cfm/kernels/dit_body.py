"""The host driver of one fused DiT body call (sync-free, graph-capturable).

The body (one estimator evaluation of a chunk, docs/design.md §1-2, §4) is GEMMs stitched together by the
body's own kernels, each doing everything between two GEMMs in one pass: the row-norm boundaries
(:mod:`torch_cfm.kernels.rownorm`), the q/k-cache write (:mod:`torch_cfm.kernels.qk_cache`) before
``cfm_attention``, or both fused with the attention (:mod:`torch_cfm.kernels.dit_attention`). Which
kernel runs each role is a :class:`~torch_cfm.kernels.body_plans.BodyPlan` from the tuning table
(:mod:`torch_cfm.kernels.body_plans`); :func:`dit_body_triton` reads one plan and nothing else.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional, Union

import torch

from .. import policy
from ..config import CONV_LN_EPS, QK_NORM_EPS
from ..errors import dtype_str, fail, shape_str
from ..reference.dit_body import clamp_lengths
from ..packing import (GATE_A, GATE_C, GATE_M, MOD_VECTORS, PER_BLOCK, SCALE_A, SCALE_C, SCALE_M,
                       SHIFT_A, SHIFT_C, SHIFT_M)
from . import cutlass_gemm, dit_linear_cuda
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


class _Block(NamedTuple):
    """One DiT block's packed weights, in the packed list's order (:mod:`torch_cfm.packing`)."""

    qkv_w: torch.Tensor
    qkv_b: torch.Tensor
    qn_w: torch.Tensor
    qn_b: torch.Tensor
    kn_w: torch.Tensor
    kn_b: torch.Tensor
    proj_w: torch.Tensor
    proj_b: torch.Tensor
    c1_w: torch.Tensor
    c1_b: torch.Tensor
    cn_w: torch.Tensor
    cn_b: torch.Tensor
    c2_w: torch.Tensor
    c2_b: torch.Tensor
    fc1_w: torch.Tensor
    fc1_b: torch.Tensor
    fc2_w: torch.Tensor
    fc2_b: torch.Tensor


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
    in reversed key order (frame j = newest-first key L_n - 1 - j); the call writes its T_n current keys at
    [L_n, L_n + T_n), reversed too, and copies nothing else, so afterwards frames [0, T_n + L_n) are
    the row's docs/design.md §2 new cache in reversed order. P >= L_n + T_n for every row (``cached`` +
    ``valid``), which the caller guarantees.

    ``valid``/``cached`` must already be clamped int32 (N,) on the device; ``mod_table`` float32
    (R, depth+1, 9, C) contiguous. GEMMs run in cuBLAS (on CPU: torch, for the Triton interpreter)
    with the caller's TF32 setting, or on the wgmma kernel where the plan says so (each call it cannot
    take stays on cuBLAS); attention through ``torch_cfm::cfm_attention``.

    ``plan``: a :class:`~torch_cfm.kernels.body_plans.BodyPlan`, or the name of one in the call's
    dtype family ("cublas", "fused_attention", "wgmma", 16-bit: "fused_attention_warp_rownorm"); None:
    the tuning table's (:func:`plan_for`).
    Per block, "cublas" runs 3 row-norms + q/k cache + attention + 6 GEMMs + GELU = 12 kernels;
    "fused_attention" fuses the q/k cache into the attention (11; on the arena only in its
    "fused_attention_warp_rownorm" form, whose attention kernel appends to the arena); "wgmma" runs
    qkv, proj, the conv GEMMs and the MLP on the wgmma kernel, fc2 as split-K partials summed by the
    row-norm behind it, and on the arena (16-bit) the QKV GEMM with the q/k-cache work in its
    epilogue (11).
    """
    p = plan_for(x_in, precision, plan, arena)
    if arena and att_cache is not None:
        raise ValueError("dit_body_triton: arena=True takes att_cache=None (the arena is out[2])")
    vel, new_cnn, new_att = out
    body = _BodyCall(p, x_in, weights, mod_table, valid, cached, precision, arena)
    body.in_proj(x_in, weights[0], weights[1])
    for i in range(body.depth):
        blk = _Block(*weights[2 + PER_BLOCK * i: 2 + PER_BLOCK * (i + 1)])
        old = att_cache[i] if att_cache is not None and att_cache.shape[3] > 0 else None
        body.attention(blk, old, new_att[i])
        body.conv(i, blk, cnn_cache[i] if cnn_cache is not None else None, new_cnn[i])
        body.mlp(i, blk)
    body.out_proj(weights[-2], weights[-1], vel)
    return vel, new_cnn, new_att


class _BodyCall:
    """One body call's plan, sizes, scratch buffers and launch settings. :func:`dit_body_triton` calls
    its parts in the body's order: :meth:`in_proj`, then per block :meth:`attention`, :meth:`conv`,
    :meth:`mlp`, and :meth:`out_proj`. Row-norm boundaries write the fp32 residual stream ``h`` and the
    next GEMM's operand."""

    def __init__(self, p: BodyPlan, x_in: torch.Tensor, weights: list[torch.Tensor], mod_table: torch.Tensor,
                 valid: torch.Tensor, cached: torch.Tensor, precision: Optional[str], arena: bool) -> None:
        self.p, self.table, self.valid, self.cached, self.arena = p, mod_table, valid, cached, arena
        n_rows, _, t_len, self.depth, c, heads, head_dim, inner, mlp = _body_sizes(x_in, weights)
        self.n_rows, self.t_len, self.c = n_rows, t_len, c
        self.heads, self.head_dim, self.inner = heads, head_dim, inner
        self.m = m = n_rows * t_len
        self.cd = cd = x_in.dtype
        self.dev = dev = x_in.device
        self.precision = precision
        self.att_precision = _attention_precision(cd, precision)
        self.key_lengths = valid + cached

        self.h = torch.empty((m, c), dtype=torch.float32, device=dev)
        self.a = torch.empty((m, c), dtype=cd, device=dev)
        self.y = torch.empty((m, c), dtype=cd, device=dev)
        self.qkv = torch.empty((m, 3 * inner), dtype=cd, device=dev)
        # the queries, or the attention output
        self.qbuf = torch.empty((n_rows, t_len, heads, head_dim), dtype=cd, device=dev)
        self.hist1 = torch.empty((n_rows * (t_len + CONV_HISTORY), c), dtype=cd, device=dev)
        self.hist2 = torch.empty_like(self.hist1)
        self.z = torch.empty((n_rows * (t_len + CONV_HISTORY), 3 * c), dtype=cd, device=dev)
        self.fbuf = torch.empty((m, mlp), dtype=cd, device=dev)
        self.common = dict(n_rows=n_rows, t_len=t_len)
        # fp32 operands go to the wgmma kernel only as TF32 (its linear_into refuses IEEE fp32 calls)
        self.tf32 = cd == torch.float32 and precision == "tf32"
        self.linear_pdl = plan_pdl(p, "linear", dev)
        self.rn = dict(pdl=plan_pdl(p, "rownorm", dev), launch=p.rownorm_launch)
        self.qk_pdl = plan_pdl(p, "qk_cache", dev)

        self.fc2_parts = None  # the split-K fc2's fp32 partial sums (splits, M, C)
        self.fc2_config = p.fc2_splitk or (dit_linear_cuda.TF32_SPLITK_CONFIG if cd == torch.float32
                                           else dit_linear_cuda.SPLITK_CONFIG)
        if p.fc2 == "wgmma_splitk":
            self.fc2_parts = torch.empty((self.fc2_config[0], m, c), dtype=torch.float32, device=dev)

    def gemm(self, kernel: str, a_, w_, b_, out_) -> None:
        """``out_ = a_ @ w_.T (+ b_)``: on the wgmma kernel or the CUTLASS library where the role's kernel
        says so and the call fits it, else cuBLAS."""
        if kernel == "wgmma" and linear_into(a_, w_, b_, out_, pdl=self.linear_pdl, tf32=self.tf32):
            return
        if kernel == "cutlass" and cutlass_gemm.linear_into(a_, w_, b_, out_, self.p.cutlass):
            return
        _cublas_mm(a_, w_, b_, out_)

    def in_proj(self, x_in: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> None:
        """Staged input -> in_proj (bias added in the first boundary kernel) -> LN, modulation (a) of block 0."""
        c = self.c
        y0 = torch.matmul(x_in.transpose(1, 2), w.t()).view(self.m, c)
        rownorm(y0, self.h, self.a, self.valid, bias=b, has_res=False, table=self.table,
                shift=_mod_off(0, SHIFT_A, c), scale=_mod_off(0, SCALE_A, c), **self.rn, **self.common)

    def attention(self, blk: _Block, old: Optional[torch.Tensor], new_att: torch.Tensor) -> None:
        """Packed QKV GEMM, q/k norm + cache write, attention over the new cache, proj GEMM into ``y``.
        On the arena the cache write is the append (qk_cache's, the QKV GEMM's epilogue's or, for
        attention_cache, the attention kernel's own) and the attention reads the arena in place."""
        p, m, inner, heads, head_dim = self.p, self.m, self.inner, self.heads, self.head_dim
        norms = (blk.qn_w, blk.qn_b, blk.kn_w, blk.kn_b)
        if p.attention == "attention_cache":
            self.gemm(p.qkv, self.a, blk.qkv_w, blk.qkv_b, self.qkv)
            attention_cache(self.qkv, norms, old, new_att, self.qbuf, self.valid, self.cached, heads=heads,
                            head_dim=head_dim, dot_precision=_fused_attention_dot_precision(self.cd, self.precision),
                            append=self.arena, pdl=plan_pdl(p, "attention_cache", self.dev),
                            launch=dict(p.attention_launch), **self.common)
            self.gemm(p.proj, self.qbuf.view(m, inner), blk.proj_w, blk.proj_b, self.y)
            return
        if not (self.arena and p.arena_qkv == "wgmma_qk_cache" and qkv_cache_into(
                self.a, blk.qkv_w, blk.qkv_b, norms, self.qbuf.view(m, inner), new_att, self.valid, self.cached,
                t_len=self.t_len, eps=QK_NORM_EPS, pdl=self.linear_pdl)):
            self.gemm(p.qkv, self.a, blk.qkv_w, blk.qkv_b, self.qkv)
            qk_cache(self.qkv, norms, self.qbuf, old, new_att, self.valid, self.cached, heads=heads,
                     head_dim=head_dim, append=self.arena, pdl=self.qk_pdl, **self.common)
        o = torch.ops.torch_cfm.cfm_attention.default(
            self.qbuf.permute(0, 2, 1, 3), new_att[..., :head_dim], new_att[..., head_dim:], self.key_lengths,
            None, None, self.att_precision)
        self.gemm(p.proj, o.transpose(1, 2).reshape(m, inner), blk.proj_w, blk.proj_b, self.y)

    def conv(self, i: int, blk: _Block, cnn_i: Optional[torch.Tensor], new_cnn: torch.Tensor) -> None:
        """Block ``i``'s conv module: three row-norm boundaries around the two conv-tap GEMMs."""
        c, p, h, table = self.c, self.p, self.h, self.table
        # residual + gate_a, LN, modulation (c) -> conv-1 history (frames 0,1 from the conv cache)
        rownorm(self.y, h, self.hist1, self.valid, table=table, gate=_mod_off(i, GATE_A, c),
                shift=_mod_off(i, SHIFT_C, c), scale=_mod_off(i, SCALE_C, c), out_t=self.t_len + CONV_HISTORY,
                out_off=CONV_HISTORY, head=(cnn_i, 0), **self.rn, **self.common)
        self.gemm(p.conv, self.hist1, blk.c1_w, None, self.z)
        # conv-1 tap sum + bias, affine LN, Mish -> conv-2 history; emit conv-1 cache
        rownorm(self.z, h, self.hist2, self.valid, taps=True, bias=blk.c1_b, has_res=False, write_h=False,
                ln_affine=(blk.cn_w, blk.cn_b), eps=CONV_LN_EPS, out_t=self.t_len + CONV_HISTORY,
                out_off=CONV_HISTORY, head=(cnn_i, c), emit=(self.hist1, new_cnn, 0), **self.rn, **self.common)
        self.gemm(p.conv, self.hist2, blk.c2_w, None, self.z)
        # conv-2 tap sum + bias, residual + gate_c, LN, modulation (m); emit conv-2 cache
        rownorm(self.z, h, self.a, self.valid, taps=True, bias=blk.c2_b, table=table, gate=_mod_off(i, GATE_C, c),
                shift=_mod_off(i, SHIFT_M, c), scale=_mod_off(i, SCALE_M, c),
                emit=(self.hist2, new_cnn, c), **self.rn, **self.common)

    def mlp(self, i: int, blk: _Block) -> None:
        """Block ``i``'s MLP (fc1 + GELU, fc2) and the boundary into block ``i + 1`` (or the output)."""
        c, a, fbuf = self.c, self.a, self.fbuf
        if self.p.fc1 == "wgmma_gelu" and linear_into(a, blk.fc1_w, blk.fc1_b, fbuf, gelu=True,
                                                       pdl=self.linear_pdl, tf32=self.tf32):
            pass
        elif self.dev.type == "cuda":
            # GELU (tanh) in the cuBLASLt epilogue; torch applies the same GELU after the GEMM
            # where Lt cannot take the call. (Its CPU kernel uses the erf GELU: not used there.)
            torch._addmm_activation(blk.fc1_b, a, blk.fc1_w.t(), use_gelu=True, out=fbuf)
        else:
            torch.addmm(blk.fc1_b, a, blk.fc1_w.t(), out=fbuf)
            torch.ops.aten.gelu_(fbuf, approximate="tanh")
        nxt = (i + 1, SHIFT_A, SCALE_A) if i + 1 < self.depth else (self.depth, 0, 1)
        if self.fc2_parts is not None and linear_splitk_into(fbuf, blk.fc2_w, self.fc2_parts, pdl=self.linear_pdl,
                                                             config=self.fc2_config, tf32=self.tf32):
            y_fc2, b_fc2 = self.fc2_parts, blk.fc2_b  # the row-norm adds the partials and the bias
        else:
            self.gemm(self.p.fc2, fbuf, blk.fc2_w, blk.fc2_b, self.y)  # wgmma_splitk that could not run: cuBLAS
            y_fc2, b_fc2 = self.y, None
        rownorm(y_fc2, self.h, a, self.valid, bias=b_fc2, table=self.table, gate=_mod_off(i, GATE_M, c),
                shift=_mod_off(nxt[0], nxt[1], c), scale=_mod_off(nxt[0], nxt[2], c), **self.rn, **self.common)

    def out_proj(self, w: torch.Tensor, b: torch.Tensor, vel: torch.Tensor) -> None:
        """The final LN'd stream (``a``) -> velocity (N, Cout, T)."""
        n_rows, t_len = self.n_rows, self.t_len
        torch.baddbmm(b[None, :, None], w.expand(n_rows, -1, -1), self.a.view(n_rows, t_len, self.c).transpose(1, 2),
                      out=vel)


def _cublas_mm(a: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor) -> None:
    """``out = a @ w.T (+ bias)`` on cuBLAS."""
    if bias is None:
        torch.mm(a, w.t(), out=out)
    else:
        torch.addmm(bias, a, w.t(), out=out)


__all__ = ["CONV_HISTORY", "BodyPlan", "cfg_euler", "choose_variant", "dit_body_triton", "plan_for", "qk_cache",
           "rownorm", "wgmma_available"]


# --------------------------------------------------------------------------------------------
# entry points writing into preallocated outputs (the op's CUDA kernel and the solver)
# --------------------------------------------------------------------------------------------

def dit_body_fused_into(x_in, weights, mod_table, cnn_cache, att_cache, valid_lengths, cache_lengths,
                        precision: Optional[str], out: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                        plan=None):
    """The fused path writing into preallocated ``out`` (used by the op and the graph runner).

    ``plan`` picks the kernels of :func:`torch_cfm.kernels.dit_body.dit_body_triton`: a
    :class:`torch_cfm.kernels.body_plans.BodyPlan` or a plan name ("cublas", "fused_attention", "wgmma"); None = the
    tuning table's. Every plan is checked against the same oracle.

    Runs the Triton driver on any device (CPU works under TRITON_INTERPRET=1) with cuBLAS TF32
    set from ``precision`` for float32 ("tf32"/"ieee"; "auto"/None follows torch's setting).
    """
    n_rows, _, t_len = x_in.shape
    cache_len = 0 if att_cache is None else att_cache.shape[3]
    valid = clamp_lengths(valid_lengths, n_rows, t_len, x_in.device)
    cached = clamp_lengths(cache_lengths, n_rows, cache_len, x_in.device)
    prec, scope = _driver_precision(x_in, precision)
    with scope:
        return dit_body_triton(x_in, list(weights), mod_table.contiguous(), cnn_cache, att_cache, valid, cached,
                               prec, out, plan)


def _driver_precision(x_in: torch.Tensor, precision: Optional[str]):
    """(resolved dot precision, context setting cuBLAS TF32 from it for float32 CUDA bodies)."""
    prec = policy.resolve_precision(x_in.dtype, precision or "auto")
    scope = (policy.tf32_scope(prec == "tf32") if x_in.dtype == torch.float32 and x_in.is_cuda
             else contextlib.nullcontext())
    return prec, scope


def dit_body_arena_into(x_in, weights, mod_table, cnn_cache, att_arena, valid_lengths, cache_lengths,
                        precision: Optional[str], out: tuple[torch.Tensor, torch.Tensor], plan=None):
    """The fused body on an in-place attention-cache arena (the whole-solve runner's form).

    ``att_arena`` (depth, N, H, P, 2D) holds row n's ``cache_lengths[n]`` old keys at frames [0, L_n)
    in reversed key order (:func:`torch_cfm.models.cache.reverse_keys`); the call appends the T_n
    current keys behind them (reversed too) and copies no old frame, so the arena then holds the
    docs/design.md §2 new cache, reversed, at [0, T_n + L_n). ``out`` = (velocity (N, Cout, T), new conv cache
    (depth, N, 2C, 2)). Lengths are clamped to [0, T] and [0, P - T]. Same math as the op within
    the docs/design.md §6 oracle (the attention sums its keys in another order). ``plan``: as
    :func:`dit_body_fused_into` (a plan with an arena form); None: the tuning table's arena plan.
    """
    n_rows, _, t_len = x_in.shape
    if att_arena.dim() != 5 or att_arena.shape[1] != n_rows or att_arena.shape[3] < t_len:
        fail("dit_body_arena_into", "att_arena", f"be (depth, N={n_rows}, H, P >= T={t_len}, 2D)",
             shape_str(att_arena))
    if att_arena.dtype != x_in.dtype or att_arena.device != x_in.device:
        fail("dit_body_arena_into", "att_arena", f"be {dtype_str(x_in.dtype)} on {x_in.device}",
             f"{dtype_str(att_arena.dtype)} on {att_arena.device}")
    valid = clamp_lengths(valid_lengths, n_rows, t_len, x_in.device)
    cached = clamp_lengths(cache_lengths, n_rows, att_arena.shape[3] - t_len, x_in.device)
    prec, scope = _driver_precision(x_in, precision)
    with scope:
        vel, cnn, _ = dit_body_triton(x_in, list(weights), mod_table.contiguous(), cnn_cache, None, valid, cached,
                                      prec, (out[0], out[1], att_arena), plan, arena=True)
    return vel, cnn
