"""The DiT body's row-norm boundary as a hand-written CUDA kernel (``csrc/cuda/dit_rownorm.cu``).

Same contract as the Triton launcher :func:`torch_cfm.kernels.dit_body.rownorm` (residual + gate +
LayerNorm + adaLN modulation, or conv tap sum + affine LayerNorm + Mish, with the conv-cache head
and emit frames). One warp per token row of C = 512 channels, statistics reduced with warp shuffles
only: the Triton kernel's 4-warp programs reduce through shared memory and two CTA barriers, and
the 65 row-norm launches of an (8, 50, 400) fp16 step were 20 % of its kernel time (bench/NOTES.md,
session 13).

Optional build (``torch_cfm._C_cuda``, as the CUDA attention kernel); :func:`not_supported_reasons`
says why a call stays on Triton (C != 512, unaligned rows, CPU, no build).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..config import MIN_CAPABILITY
from .cfm_attention_cuda import _extension

CHANNELS = 512  # csrc/cuda/dit_rownorm_params.h kChannels
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _misaligned(t: Optional[torch.Tensor]) -> bool:
    """True when ``t``'s rows cannot be read as 16-byte vectors (base pointer or a row stride)."""
    if t is None:
        return False
    size = t.element_size()
    return t.data_ptr() % 16 != 0 or t.stride(-1) != 1 or any((s * size) % 16 for s in t.stride()[:-1])


def not_supported_reasons(y: torch.Tensor, h: torch.Tensor, out: torch.Tensor, *, bias: Optional[torch.Tensor],
                          table: Optional[torch.Tensor], ln_affine: Optional[tuple[torch.Tensor, torch.Tensor]]
                          ) -> list[str]:
    """Why the CUDA row-norm kernel cannot run this boundary (arguments as in ``dit_body.rownorm``);
    empty when it can."""
    reasons = []
    _, why = _extension()
    if why is not None:
        reasons.append(why)
    if y.device.type != "cuda" or torch.version.hip is not None:
        reasons.append(f"needs an NVIDIA CUDA device, found {y.device.type}")
    else:
        from .. import policy

        cap = policy.device_capability(y.device)
        if cap is None or cap < MIN_CAPABILITY:
            reasons.append(f"needs SM{MIN_CAPABILITY[0]}{MIN_CAPABILITY[1]}+")
    if h.shape[-1] != CHANNELS:
        reasons.append(f"covers C = {CHANNELS} only, got C = {h.shape[-1]}")
    if y.dtype not in _DTYPES or out.dtype != y.dtype:
        reasons.append(f"needs y and out of one dtype in {_DTYPES}, got {y.dtype} / {out.dtype}")
    if not out.is_contiguous() or not h.is_contiguous():
        reasons.append("needs contiguous out and h")
    tensors = (y, h, out, bias, table) + (tuple(ln_affine) if ln_affine is not None else ())
    if any(_misaligned(t) for t in tensors):
        reasons.append("needs 16-byte aligned rows (data_ptr and row strides)")
    return reasons


def rownorm_cuda(y: torch.Tensor, h: torch.Tensor, out: torch.Tensor, valid: torch.Tensor, *, n_rows: int,
                 t_len: int, taps: bool, bias: Optional[torch.Tensor], has_res: bool, write_h: bool,
                 table: Optional[torch.Tensor], gate: Optional[int], shift: int, scale: int,
                 ln_affine: Optional[tuple[torch.Tensor, torch.Tensor]], eps: float, out_t: int, out_off: int,
                 head: Optional[tuple[Optional[torch.Tensor], int]],
                 emit: Optional[tuple[torch.Tensor, torch.Tensor, int]], pdl: bool) -> None:
    """Launch the CUDA row-norm kernel (arguments as in ``dit_body.rownorm``; the caller has checked
    :func:`not_supported_reasons`). Table offsets must be multiples of 8 (they are multiples of C)."""
    module, _ = _extension()
    cnn, head_cbase = head if head is not None else (None, 0)
    e_src, e_dst, e_cbase = emit if emit is not None else (None, None, 0)
    ln_w, ln_b = ln_affine if ln_affine is not None else (None, None)
    module.dit_rownorm(y, bias, h, table, -1 if gate is None else gate, shift, scale, ln_w, ln_b, out, out_t,
                       out_off, head is not None, cnn, head_cbase, e_src, e_dst, e_cbase, valid, n_rows, t_len, eps,
                       taps, has_res, write_h, pdl)
