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


SMEM_PER_SM = 228 * 1024  # SM90; each resident CTA also reserves 1 KB
SMEM_RESERVED_PER_CTA = 1024


@functools.lru_cache(maxsize=1)
def tile_table() -> tuple[tuple[int, int, int], ...]:
    """(block_m, block_n, shared-memory bytes per CTA) compiled into the extension (empty when it is
    not built; csrc/cuda/dit_gemm_params.h)."""
    module, _ = _extension()
    if module is None or not hasattr(module, "gemm_configs"):
        return ()
    return tuple(tuple(int(v) for v in cfg) for cfg in module.gemm_configs())


def instantiated_tiles() -> tuple[tuple[int, int], ...]:
    """(block_m, block_n) tiles compiled into the extension (empty when it is not built)."""
    return tuple((bm, bn) for bm, bn, _ in tile_table())


def choose_tile(m: int, n: int, k_slices: int, sms: int = 132,
                tiles: Optional[tuple[tuple[int, int, int], ...]] = None) -> tuple[int, int]:
    """The (block_m, block_n) tile for an (m, n) output with ``k_slices`` K slices.

    Fewest waves of CTAs (CTAs per SM from each tile's shared memory), then the narrowest tile: at
    M ≈ 400 a GEMM's time is the operand bytes each SM takes in (A's rows plus W's slab), so the
    most CTAs that still fit in one wave spread those bytes over the most SMs. At M = 400: qkv and
    the convs 64 × 96 (112 CTAs), proj 64 × 32 (112), fc1 and fc2 (4 K slices) 64 × 128 (112).
    ``tiles``: (block_m, block_n, smem bytes) candidates, default :func:`tile_table`."""
    best = None
    for bm, bn, smem in tiles if tiles is not None else tile_table():
        if n % bn:
            continue
        per_sm = max(1, SMEM_PER_SM // (smem + SMEM_RESERVED_PER_CTA))
        ctas = -(-m // bm) * (n // bn) * k_slices
        key = (-(-ctas // (sms * per_sm)), bm + bn)
        if best is None or key < best[0]:
            best = (key, (bm, bn))
    if best is None:
        raise ValueError(f"dit_gemm: no instantiated tile divides N = {n}")
    return best[1]


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
    if not any(n % bn == 0 for _, bn in instantiated_tiles() or ((0, 32),)):
        reasons.append(f"needs N divisible by a tile width {sorted({bn for _, bn in instantiated_tiles()})}, got {n}")
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
