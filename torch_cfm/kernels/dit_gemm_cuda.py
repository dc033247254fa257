"""The DiT body's linear layers on the hand-written CUDA GEMM (``csrc/cuda/dit_gemm_kernel.cuh``).

``out = a · wᵀ`` (``w`` in nn.Linear layout) with one of four epilogues: + bias, + bias then GELU
(tanh), fp32 split-K partials per 512-column K slice (the consumer adds the slices and the bias), or
nothing. Under programmatic dependent launch (``pdl=True``, SM90) each CTA copies its weight slab into
shared memory *before* it waits for the kernel in front of it, so in a chain of dependent kernels only
the activations are taken in on the critical path (bench/NOTES.md, session 14).

Coverage (:func:`not_supported_reasons`): CUDA, fp16/bf16 operands, K a multiple of 512, N a multiple
of the tile width, unit stride along K, 16-byte aligned rows. The extension is the optional
``torch_cfm._C_cuda`` build (:mod:`torch_cfm.kernels.cfm_attention_cuda`).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .cfm_attention_cuda import _extension

SLICE_K = 512  # K columns per CTA (csrc/cuda/dit_gemm_params.h: kSliceK)
EPILOGUES = {"bias": 0, "bias_gelu": 1, "partial": 2, "none": 3}


@functools.lru_cache(maxsize=1)
def instantiated_tiles() -> tuple[tuple[int, int], ...]:
    """(block_m, block_n) tiles compiled into the extension (empty when it is not built)."""
    module, _ = _extension()
    if module is None or not hasattr(module, "gemm_configs"):
        return ()
    return tuple((bm, bn) for bm, bn, _ in module.gemm_configs())


def choose_tile(m: int, n: int, k_slices: int, sms: int = 132) -> tuple[int, int]:
    """The (block_m, block_n) tile for an (m, n) output with ``k_slices`` K slices.

    Largest tile (64 × 64: fewest operand bytes per output) unless its grid leaves more than half of
    the SMs idle; then 32-row tiles, which double the CTAs (at M = 400, N = 512: 56 → 104 CTAs)."""
    ctas = -(-m // 64) * (n // 64) * k_slices
    if ctas * 2 <= sms and n % 64 == 0:
        return 32, 64
    return (64, 64) if n % 64 == 0 else (64, 32)


def not_supported_reasons(a: torch.Tensor, w: torch.Tensor, epilogue: str) -> list[str]:
    """Why the CUDA GEMM cannot take ``a (M, K) · w (N, K)ᵀ`` with ``epilogue`` (empty: it can)."""
    reasons = []
    module, why = _extension()
    if module is None or not hasattr(module, "dit_gemm"):
        reasons.append(why or "torch_cfm._C_cuda has no dit_gemm (rebuild the extension)")
    if a.device.type != "cuda":
        reasons.append(f"needs CUDA tensors, got {a.device.type}")
    elif torch.cuda.get_device_capability(a.device) < (8, 0):
        reasons.append("needs NVIDIA SM80+ (mma.sync m16n8k16, cp.async)")
    if a.dtype not in (torch.float16, torch.bfloat16) or w.dtype != a.dtype:
        reasons.append(f"needs float16 or bfloat16 operands of one dtype, got {a.dtype} and {w.dtype}")
    if a.dim() != 2 or w.dim() != 2 or a.shape[1] != w.shape[1]:
        reasons.append(f"needs a (M, K) and w (N, K), got {tuple(a.shape)} and {tuple(w.shape)}")
        return reasons
    k, n = a.shape[1], w.shape[0]
    if k % SLICE_K or (k != SLICE_K and epilogue != "partial"):
        reasons.append(f"needs K = 512 (or a multiple with the partial epilogue), got K = {k}")
    if n % 32:
        reasons.append(f"needs N % 32 == 0, got {n}")
    if a.stride(1) != 1 or w.stride(1) != 1 or a.stride(0) % 8 or w.stride(0) % 8:
        reasons.append("needs unit stride along K and 16-byte aligned rows")
    if a.data_ptr() % 16 or w.data_ptr() % 16:
        reasons.append("needs 16-byte aligned operands")
    return reasons


def dit_gemm(a: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor, *,
             epilogue: str = "bias", pdl: bool = False, tile: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """``out = epilogue(a · wᵀ)`` on the CUDA GEMM; inputs must pass :func:`not_supported_reasons`.

    Args:
        a: (M, K) fp16/bf16 activations. w: (N, K) weight, same dtype. bias: (N,) same dtype
            ("bias" / "bias_gelu"), else None.
        out: (M, N) in a's dtype, or for "partial" float32 (K / 512, M, N).
        epilogue: "bias" | "bias_gelu" | "partial" | "none".
        pdl: launch as a programmatic dependent launch (SM90; the weight slab loads before the wait).
        tile: (block_m, block_n), default :func:`choose_tile`.
    """
    if epilogue not in EPILOGUES:
        raise ValueError(f"dit_gemm: epilogue must be one of {tuple(EPILOGUES)}, got {epilogue!r}")
    module, why = _extension()
    if module is None:
        raise RuntimeError(f"dit_gemm: {why}")
    m, k = a.shape
    bm, bn = tile or choose_tile(m, w.shape[0], k // SLICE_K)
    module.dit_gemm(a, w, bias, out, EPILOGUES[epilogue], bm, bn, bool(pdl))
    return out
