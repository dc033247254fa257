"""The vocoder's elementwise work between convolutions, as two fused steps (PyTorch or Triton).

Tensors are frame-major (B, L, C), channels innermost; per-channel parameters are (C,) or (K, C).
The HiFT's elementwise ops fall into two shapes, each one pass over memory:

* :func:`combine` — ``v = a + b`` or ``v = a + (b + c)`` (``a`` optionally reflect-padded by one
  frame on the left: ``ReflectionPad1d((1, 0))``), kept when asked, and K Snake activations of
  ``v``: ``y_k = v + inv_k · sin(alpha_k · v)²`` with ``inv = 1 / (alpha + 1e-9)`` (the
  upstream ``Snake``), written in the convolutions' dtype. It covers a ResBlock's inner Snake, its
  residual add with the next dilation's Snake, and a stage's merge of upsampled and source
  branches with the first Snake of each of its ResBlocks.
* :func:`accumulate` — ``s = t + r`` (a ResBlock's last residual add), ``acc + s`` (the sum over
  a stage's ResBlocks), and at the stage's end ``leaky_relu(acc / K, slope)`` in the
  convolutions' dtype (the next upsampling's or ``conv_post``'s input).

And, for a model kept in the upstream channel-major (B, C, T) layout (the causal HiFT),
:func:`snake_channels`: one Snake per element, with the parameters (1, C, 1).

The PyTorch versions keep the upstream's operation order (so float32 results equal the
upstream's elementwise math bitwise, and ``torch.compile`` fuses each into one kernel); the
Triton versions (CUDA) are single kernels with float32 math, any input dtypes, output dtypes
as asked. Both are per-element, hence batch-invariant.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["combine", "accumulate", "snake_channels", "SNAKE_EPS"]

SNAKE_EPS = 1e-9  # the upstream Snake's no_div_by_zero


def _triton_ok(backend: str, *tensors: Optional[torch.Tensor]) -> bool:
    if backend == "torch":
        return False
    ts = [t for t in tensors if t is not None]
    if any(t.dtype == torch.float64 for t in ts):
        return False
    return backend == "triton" or all(t.is_cuda for t in ts)


def combine(a: torch.Tensor, b: Optional[torch.Tensor] = None, c: Optional[torch.Tensor] = None, *,
            alpha: Optional[torch.Tensor] = None, inv: Optional[torch.Tensor] = None, reflect: bool = False,
            keep_sum: bool = False, out_dtype: torch.dtype, act_dtype: torch.dtype = torch.float32,
            backend: str = "auto") -> tuple[Optional[torch.Tensor], list[torch.Tensor]]:
    """``v = pad(a) [+ b | + (b + c)]`` and ``[snake_k(v)]`` (module docstring).

    Args:
        a: (B, L_a, C); with ``reflect`` L_a = L - 1, else L.
        b, c: optional (B, L, C).
        alpha, inv: optional (K, C) Snake parameters in ``act_dtype`` (K = 0 when None).
        keep_sum: return ``v`` (in ``act_dtype``), else None.
        out_dtype: dtype of the Snake outputs.
        backend: "auto" (Triton for CUDA tensors that are not float64), "torch", or "triton"
            (also for CPU tensors: the Triton interpreter, tests).
    Returns:
        (v or None, list of K tensors (B, L, C) in ``out_dtype``).
    """
    if _triton_ok(backend, a, b, c):
        from ...kernels.vocoder_elementwise import combine_triton

        return combine_triton(a, b, c, alpha, inv, reflect, keep_sum, out_dtype)
    v = a.to(act_dtype)
    if reflect:
        v = torch.cat([v[:, 1:2], v], dim=1)
    if b is not None:
        rest = b.to(act_dtype) if c is None else b.to(act_dtype) + c.to(act_dtype)
        v = v + rest
    ys = []
    for k in range(0 if alpha is None else alpha.shape[0]):
        ys.append((v + inv[k] * torch.sin(v * alpha[k]).pow(2)).to(out_dtype))
    return (v if keep_sum else None), ys


def accumulate(t: torch.Tensor, r: Optional[torch.Tensor] = None, acc: Optional[torch.Tensor] = None, *,
               divisor: Optional[float] = None, slope: Optional[float] = None, out_dtype: torch.dtype,
               act_dtype: torch.dtype = torch.float32, backend: str = "auto") -> torch.Tensor:
    """``s = t [+ r]``, ``acc + s`` when ``acc`` is given, then with ``divisor``:
    ``leaky_relu(s / divisor, slope)`` in ``out_dtype``; without it ``s`` in ``act_dtype``.

    Args:
        t, r, acc: (B, L, C) (``r``, ``acc`` optional).
    Returns:
        (B, L, C).
    """
    if _triton_ok(backend, t, r, acc):
        from ...kernels.vocoder_elementwise import accumulate_triton

        return accumulate_triton(t, r, acc, divisor, slope, out_dtype if divisor is not None else act_dtype)
    s = t.to(act_dtype)
    if r is not None:
        s = s + r.to(act_dtype)
    if acc is not None:
        s = acc + s
    if divisor is None:
        return s
    return F.leaky_relu(s / divisor, slope).to(out_dtype)


def snake_channels(x: torch.Tensor, alpha: torch.Tensor, inv: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """The upstream ``Snake`` on a channel-major tensor: ``x + inv · sin(x · alpha)²``.

    Args:
        x: (B, C, T) float16 / bfloat16 / float32 / float64.
        alpha, inv: (1, C, 1) in x's dtype; ``inv = 1 / (alpha + 1e-9)`` made once by the caller
            (as the upstream makes it per call, so the PyTorch path equals the upstream bitwise).
        backend: as :func:`combine` (Triton: one kernel, float32 math, x's dtype out).
    Returns:
        (B, C, T) in x's dtype.
    """
    if _triton_ok(backend, x):
        from ...kernels.vocoder_elementwise import snake_channels_triton

        return snake_channels_triton(x, alpha, inv)
    return x + inv * pow(torch.sin(x * alpha), 2)
