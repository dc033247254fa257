"""CFG combine + Euler update of the solver state, written back into the staged input (one launch
per Euler step), and its host launcher.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import launch_kwargs, on_device, pdl_prologue, plan_pdl
from .body_plans import body_plan


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


def cfg_euler(x: torch.Tensor, v: torch.Tensor, staged: torch.Tensor, dt: float, cfg_rate: float) -> None:
    """x (B, Cm, T) float32 += dt * ((1+r) v[:B] - r v[B:]); staged[:, :Cm] <- x for both halves."""
    b, cm, t_len = x.shape
    if not x.is_contiguous():
        raise ValueError("cfg_euler: x (the Euler state) must be contiguous: the kernel indexes it densely")
    total = b * cm * t_len
    if total == 0:
        return
    block = 1024
    pdl = plan_pdl(body_plan(staged.dtype, None), "cfg_euler", x.device)  # by the staged dtype's plan
    with on_device(x.device):
        _cfg_euler_kernel[(triton.cdiv(total, block),)](
            x, v, v.stride(0), v.stride(1), v.stride(2), staged, staged.stride(0), staged.stride(1),
            staged.stride(2), b, cm, t_len, float(dt), float(cfg_rate), BLOCK=block, USE_PDL=pdl, num_warps=4,
            **launch_kwargs(pdl))
