"""The DiT block's K ≤ 512 GEMMs on a hand-written SM90a kernel (``csrc/cuda/dit_linear_kernel.cuh``).

``out = a @ w.T (+ bias) (GELU)`` for fp16/bf16 at the body's shapes (M = N·T or N·(T+2) token rows,
K = 512, N = 512 / 1536 / 2048). One warpgroup per 64 × BN tile issues wgmma from TMA-loaded,
128-byte-swizzled shared memory; the whole K stays resident. Launched with programmatic dependent
launch (PDL), each CTA loads its weight tile *before* ``griddepcontrol.wait``, so the weights stream
in while the kernel in front of it finishes: the part cuBLAS cannot do. ``bench/wgmma_gemm.py`` times
each role against cuBLAS; fc1 + GELU alone is slower than cuBLAS, but its early trigger lets the
split-K fc2 behind it load its weights while fc1 runs.

TF32 (``linear_into(..., tf32=True)`` with fp32 operands): the same GEMM for fp32 bodies computing in
TF32. The tensor maps load fp32 as TFLOAT32, so the TMA unit rounds both operands to nearest TF32 (as
cuBLAS's TF32 GEMMs do; truncating would bias every product toward zero) and wgmma m64nNk8 tf32
accumulates in fp32. Only the weight tile of the whole K fits beside a 64-row a tile (a alone is
128 KB), so a streams through a ring of 4 stages; tiles are at most 96 wide.

Split-K (:func:`linear_splitk_into`): for K above 512 (the block's fc2, K = 2048) grid z splits K
into chunks of at most 512 and each CTA writes an fp32 partial sum; the body's row-norm kernel adds
the partials (and the bias) as it reads them.

QKV + cache (:func:`qkv_cache_into`): the block's 16-bit QKV GEMM on the in-place cache arena with
the q/k-cache kernel's work in its epilogue (per-head q/k LayerNorm, queries out, k/v appended to the
arena), one kernel instead of two.

It is an optional part of ``torch_cfm._C_cuda`` (built for ``TORCH_CUDA_ARCH_LIST=9.0a``); the body's
wgmma plans (:mod:`torch_cfm.kernels.body_plans`) use it where :func:`not_supported_reasons` is empty
and fall back to cuBLAS otherwise.
"""

from __future__ import annotations

from typing import Optional

import torch

from .cfm_attention_cuda import _extension

# Flags of the kernel (csrc/cuda/dit_linear_kernel.cuh)
TRIGGER_EARLY = 1  # griddepcontrol.launch_dependents as soon as the operand loads are issued
GELU_TANH = 2
NO_BIAS = 4
MAX_K = 512
BLOCK_NS = (32, 64, 96, 128)
TF32_BLOCK_NS = (32, 64, 96)  # fp32: the weight tile of the whole K is resident (96 x 512 x 4 = 192 KB at most)
SPLITK_BLOCK_NS = (64, 128)
# (splits, BN) of the split-K form at the body's fc2 (400 x 2048 x 512): 4 x 128 = 112 CTAs of
# 192 KB shared memory at M = 400, one wave (the fastest of 4/8 splits x BN 64/128 in the step)
SPLITK_CONFIG = (4, 128)
# fp32 (TF32): BN 64 (a 128-wide fp32 weight tile of K' = 512 does not fit), 224 CTAs at M = 400
TF32_SPLITK_CONFIG = (4, 64)


def block_n_for(n: int, dtype: torch.dtype = torch.float16) -> Optional[int]:
    """The tile width for an output of ``n`` columns (bench/wgmma_gemm.py's fastest per role):
    32 for N = 512 (112 CTAs at M = 400), 96 where it divides N (1536: 112 CTAs), else 128 (16-bit
    only), else 64."""
    if n <= 512 and n % 32 == 0:
        return 32
    for bn in (96, 128, 64):
        if n % bn == 0 and (bn in TF32_BLOCK_NS or dtype != torch.float32):
            return bn
    return None


_REASONS: dict[int, Optional[str]] = {}  # device index -> device_reason, once settled
_CAPTURING = "not probed yet, and the first call is inside a CUDA-graph capture (run one call eagerly first)"


def device_reason(device: torch.device) -> Optional[str]:
    """Why the kernel cannot run on ``device`` (None: it can); settled once per device (asked per GEMM).
    The first call per device launches a one-time probe; a first call inside a CUDA-graph capture
    gets a reason (cuBLAS serves that capture) instead of breaking it."""
    if device.type != "cuda":
        return "the wgmma GEMM is CUDA-only"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _REASONS:
        why = _device_reason(index)
        if why is _CAPTURING:
            return why
        _REASONS[index] = why
    return _REASONS[index]


def _device_reason(index: int) -> Optional[str]:
    module, why = _extension()
    if module is None:
        return why
    if not hasattr(module, "dit_linear_into"):
        return "torch_cfm._C_cuda was built without the DiT GEMM (rebuild the extension)"
    if torch.cuda.get_device_capability(index) != (9, 0):
        return "the wgmma GEMM needs an SM90 (Hopper) GPU"
    if torch.cuda.is_current_stream_capturing():  # the probe is a synchronous launch
        return _CAPTURING
    with torch.cuda.device(index):
        if not module.dit_linear_available():
            return "torch_cfm._C_cuda has no sm_90a code (build with TORCH_CUDA_ARCH_LIST=9.0a)"
    return None


def _tma_operand_reasons(a: torch.Tensor, w: torch.Tensor) -> list[str]:
    """The TMA loads' needs of the two operands."""
    return [f"{name} needs unit column stride and 16-byte aligned rows (TMA)" for name, t in (("a", a), ("w", w))
            if t.stride(1) != 1 or t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16]


def _dtype_reasons(tensors: tuple[torch.Tensor, ...], tf32: bool) -> list[str]:
    """The operands' dtype rule: one dtype, fp16 or bf16, or fp32 (computed in TF32) when ``tf32``."""
    dtypes = (torch.float16, torch.bfloat16) + ((torch.float32,) if tf32 else ())
    if tensors[0].dtype in dtypes and all(t.dtype == tensors[0].dtype for t in tensors):
        return []
    return [f"{'fp16/bf16/fp32' if tf32 else 'fp16/bf16 (fp32: with tf32=True)'} operands of one dtype only, got "
            + ", ".join(str(t.dtype) for t in tensors)]


def _k_reasons(a: torch.Tensor, splits: int = 1) -> list[str]:
    """K must come in whole 128-byte stages (64 16-bit or 32 fp32 elements), at most MAX_K per CTA."""
    k, step = a.shape[1], 128 // a.element_size()
    if k and k % (step * splits) == 0 and k // splits <= MAX_K:
        return []
    if splits == 1:
        return [f"K must be a positive multiple of {step} up to {MAX_K}, got {k}"]
    return [f"K must split {splits} ways into multiples of {step} up to {MAX_K}, got {k}"]


def _entry_reasons(device: torch.device, entry: str, what: str) -> list[str]:
    """Why the extension entry point ``entry`` cannot run on ``device`` (empty: it can)."""
    why = device_reason(device)
    if why is None and not hasattr(_extension()[0], entry):
        why = f"torch_cfm._C_cuda was built without {what} (rebuild the extension)"
    return [why] if why else []


def not_supported_reasons(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tf32: bool = False) -> list[str]:
    """Why ``out = a @ w.T`` cannot run on this kernel; empty when it can. fp32 operands run in TF32
    (rounded to nearest as they load) and only when the caller asks for it with ``tf32``."""
    reasons = _dtype_reasons((a, w, out), tf32)
    if a.dim() != 2 or w.dim() != 2 or out.dim() != 2:
        return reasons + ["2-D operands only"]
    n = w.shape[0]
    reasons += _k_reasons(a)
    if block_n_for(n, a.dtype) is None:
        reasons.append(f"N must be a multiple of 32, got {n}")
    reasons += _tma_operand_reasons(a, w)
    if out.stride(1) != 1 or out.stride(0) % 2 or out.data_ptr() % (2 * out.element_size()):
        reasons.append("out needs unit column stride and aligned column pairs")
    return reasons or _entry_reasons(a.device, "dit_linear_into", "the DiT GEMM")


def _splitk_config(dtype: torch.dtype, config: Optional[tuple[int, int]]) -> tuple[int, int]:
    return config or (TF32_SPLITK_CONFIG if dtype == torch.float32 else SPLITK_CONFIG)


def splitk_not_supported_reasons(a: torch.Tensor, w: torch.Tensor, partials: torch.Tensor,
                                 config: Optional[tuple[int, int]] = None, tf32: bool = False) -> list[str]:
    """Why the split-K form (:func:`linear_splitk_into`) cannot run; empty when it can."""
    splits, block_n = _splitk_config(a.dtype, config)
    reasons = _dtype_reasons((a, w), tf32)
    if a.dim() != 2 or w.dim() != 2 or partials.dim() != 3:
        return reasons + ["2-D a and w, 3-D partials only"]
    m, n = a.shape[0], w.shape[0]
    if partials.dtype != torch.float32 or tuple(partials.shape) != (splits, m, n) or not partials.is_contiguous():
        reasons.append(f"partials must be contiguous float32 {(splits, m, n)}, got {partials.dtype} "
                       f"{tuple(partials.shape)}")
    reasons += _k_reasons(a, splits)
    block_ns = (64,) if a.dtype == torch.float32 else SPLITK_BLOCK_NS
    if block_n not in block_ns or n % block_n:
        reasons.append(f"N must be a multiple of block_n {block_n} (one of {block_ns}), got {n}")
    reasons += _tma_operand_reasons(a, w)
    return reasons or _entry_reasons(a.device, "dit_linear_splitk_into", "the split-K GEMM")


def linear_splitk_into(a: torch.Tensor, w: torch.Tensor, partials: torch.Tensor, *, pdl: bool = True,
                       config: Optional[tuple[int, int]] = None, tf32: bool = False) -> bool:
    """``partials[z] = a[:, zK':(z+1)K'] @ w[:, zK':(z+1)K'].T`` in fp32 (K' = K / splits) on the wgmma
    kernel; False (nothing launched) where :func:`splitk_not_supported_reasons` is not empty.
    ``partials.sum(0)`` is ``a @ w.T``; no bias (the reader adds it).

    Args:
        a: (M, K) fp16/bf16, or fp32 with ``tf32`` (computed in TF32, as :func:`linear_into`).
        w: (N, K), the dtype of ``a``.
        partials: (splits, M, N) float32, contiguous, written.
        config: (splits, BN); None: :data:`SPLITK_CONFIG` (fp32: :data:`TF32_SPLITK_CONFIG`).
    """
    if splitk_not_supported_reasons(a, w, partials, config, tf32):
        return False
    splits, block_n = _splitk_config(a.dtype, config)
    module, _ = _extension()
    module.dit_linear_splitk_into(a, w, partials, block_n, pdl, TRIGGER_EARLY, splits)
    return True


def qkv_cache_not_supported_reasons(a: torch.Tensor, w: torch.Tensor, q_out: torch.Tensor, cache: torch.Tensor,
                                    t_len: int) -> list[str]:
    """Why :func:`qkv_cache_into` cannot run; empty when it can (fp16/bf16 only)."""
    reasons = _dtype_reasons((a, w, q_out, cache), False)
    if a.dim() != 2 or w.dim() != 2 or q_out.dim() != 2 or cache.dim() != 4:
        return reasons + ["a, w, q_out 2-D and cache 4-D only"]
    m, heads = a.shape[0], cache.shape[1]
    if cache.shape[3] != 128 or cache.stride(3) != 1:
        reasons.append(f"head_dim 64 (cache channels 128, unit stride) only, got {cache.shape[3]}")
    if heads % 2 or w.shape[0] != 3 * 64 * heads:  # 128-wide tiles hold two heads
        reasons.append(f"an even number of heads and w of 3 x heads x 64 rows, got {heads} heads, {w.shape[0]} rows")
    if t_len <= 0 or m != cache.shape[0] * t_len:
        reasons.append(f"a must have N x t_len = {cache.shape[0]} x {t_len} rows, got {m}")
    reasons += _k_reasons(a)
    reasons += _tma_operand_reasons(a, w)
    if not q_out.is_contiguous() or tuple(q_out.shape) != (m, 64 * heads):
        reasons.append("q_out must be contiguous (M, heads x 64)")
    if cache.data_ptr() % (2 * cache.element_size()) or any(st % 2 for st in cache.stride()[:3]):
        reasons.append("cache needs aligned column pairs")
    return reasons or _entry_reasons(a.device, "dit_linear_qkv_cache_into", "the QKV + cache GEMM")


def qkv_cache_into(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, norms: tuple[torch.Tensor, ...],
                   q_out: torch.Tensor, cache: torch.Tensor, valid: torch.Tensor, cached: torch.Tensor, *,
                   t_len: int, eps: float, pdl: bool = True) -> bool:
    """The block's QKV GEMM on the in-place arena, q/k-cache epilogue included; False (nothing launched)
    where :func:`qkv_cache_not_supported_reasons` is not empty.

    Args:
        a: (N·T, K) fp16/bf16 block input rows.
        w: (3·H·64, K) packed q | k | v weight; bias (3·H·64,).
        norms: (qn_w, qn_b, kn_w, kn_b), each (64,): the per-head q/k LayerNorm affine.
        q_out: (N·T, H·64) normalised queries, written for every row.
        cache: arena block (N, H, P, 128) holding L_n old frames in reversed key order; the T_n current
            frames of row n go to [L_n, L_n + T_n), reversed too (the q/k-cache kernel's APPEND mode).
        valid, cached: clamped int32 (N,) T_n and L_n.
    """
    if qkv_cache_not_supported_reasons(a, w, q_out, cache, t_len):
        return False
    module, _ = _extension()
    module.dit_linear_qkv_cache_into(a, w, bias.contiguous(), *(t.contiguous() for t in norms), q_out, cache,
                                     valid, cached, t_len, eps, pdl, TRIGGER_EARLY)
    return True


def linear_into(a: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor, *,
                gelu: bool = False, pdl: bool = True, tf32: bool = False) -> bool:
    """``out = a @ w.T (+ bias)`` (GELU, tanh form, when ``gelu``) on the wgmma kernel; False (nothing
    launched) where :func:`not_supported_reasons` is not empty, for the caller's cuBLAS fallback.

    Args:
        a: (M, K) fp16/bf16, K a multiple of 64 up to 512; or fp32 with ``tf32`` (K a multiple of 32).
        w: (N, K), the dtype of ``a``.
        bias: (N,) or None.
        out: (M, N), written.
        pdl: launch with programmatic dependent launch (the weight tile loads before the wait).
        tf32: allow fp32 operands, computed in TF32 (both rounded to nearest TF32, fp32 accumulation:
            the numerics of a cuBLAS TF32 GEMM). Never for "ieee" fp32 calls.
    """
    if not_supported_reasons(a, w, out, tf32):
        return False
    module, _ = _extension()
    flags = TRIGGER_EARLY | (GELU_TANH if gelu else 0) | (NO_BIAS if bias is None else 0)
    module.dit_linear_into(a, w, None if bias is None else bias.contiguous(), out, block_n_for(w.shape[0], a.dtype),
                           pdl, flags, 1)
    return True
