"""Experiment (not shipped): a Triton GEMM for the large-batch body, ``out = a @ w.T (+ bias) (then GELU-tanh)``.

The question it answered: does a Triton GEMM with a tile chosen per role shape beat cuBLAS at the
body's shapes of 32-128 rows (M = rows x 50, K = 512 or 2048, N = 512-2048)? It does not: at every
shape its best tile of :data:`CANDIDATES` is 13-62 % slower than cuBLAS (docs/performance.md §4;
``python3 bench/experiments/large_batch_probe.py --parts tiles``). The arena step with all its GEMMs
here was 19-23 % slower, 17 % with PDL on every kernel. Kept so the result can be rerun.

    a: (M, K) fp16/bf16, unit stride on K;  w: (N, K) same dtype, unit stride on K;
    bias: (N,) same dtype or None;  out: (M, N) same dtype, unit stride on N.

Reference: ``torch.addmm(bias, a, w.t())`` (+ ``gelu(approximate="tanh")``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from torch_cfm.kernels._launch import launch_kwargs, on_device, pdl_prologue

@dataclasses.dataclass(frozen=True)
class GemmTile:
    """One launch of :func:`gemm_into`: output tile BM x BN, K step BK, warps, pipeline stages."""

    bm: int
    bn: int
    bk: int = 64
    warps: int = 4
    stages: int = 4
    group_m: int = 8

    @property
    def name(self) -> str:
        return f"m{self.bm}n{self.bn}k{self.bk}w{self.warps}s{self.stages}"


# Candidate tiles (the sweep in bench/experiments/large_batch_probe.py times every one per shape)
CANDIDATES = (
    GemmTile(128, 128, 64, 4, 4), GemmTile(128, 128, 64, 8, 3), GemmTile(128, 256, 64, 8, 3),
    GemmTile(64, 128, 64, 4, 4), GemmTile(64, 256, 64, 4, 3), GemmTile(128, 64, 64, 4, 4),
    GemmTile(64, 64, 64, 4, 4), GemmTile(128, 128, 32, 4, 5), GemmTile(256, 128, 64, 8, 3),
)
DEFAULT_TILE = GemmTile(128, 128, 64, 4, 4)
# (first M, last M, K, N) -> tile; filled by the probe's sweep; the default elsewhere
TILES: dict[tuple[int, int, int, int], GemmTile] = {}


def choose_tile(m: int, k: int, n: int) -> GemmTile:
    """The tile of an (M, K) x (K, N) call: :data:`TILES`' entry for its M bucket, or the default."""
    for (lo, hi, kk, nn), tile in TILES.items():
        if lo <= m <= hi and kk == k and nn == n:
            return tile
    return DEFAULT_TILE


@triton.jit
def _gelu_tanh(x):
    u = 0.7978845608028654 * (x + 0.044715 * x * x * x)  # sqrt(2 / pi) (...)
    # tanh(u) = 1 - 2 / (exp(2u) + 1): finite for every u
    return 0.5 * x * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))


@triton.jit
def _dense_gemm_kernel(
    a_ptr, stride_am,           # (M, K)
    w_ptr, stride_wn,           # (N, K)
    bias_ptr,                   # (N,) [HAS_BIAS]
    out_ptr, stride_om,         # (M, N)
    M, N, K,
    HAS_BIAS: tl.constexpr, GELU: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    # grouped order: GROUP_M row tiles share each column tile of w while it is in L2
    per_group = GROUP_M * grid_n
    group = pid // per_group
    first_m = group * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m

    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    pdl_prologue(USE_PDL)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = (k0 + offs_k) < K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc)
        a_ptrs += BK
        w_ptrs += BK
    if HAS_BIAS:
        acc += bias[None, :]
    if GELU:
        acc = _gelu_tanh(acc)
    o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def gemm_into(a: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor, *,
              gelu: bool = False, tile: Optional[GemmTile] = None, pdl: bool = False) -> torch.Tensor:
    """``out = a @ w.T (+ bias)``, then GELU-tanh when ``gelu`` (shapes: module docstring).

    ``tile``: None for :func:`choose_tile`'s; ``pdl``: launch with programmatic dependent launch (the
    caller's plan, on devices that have it). Returns ``out``.
    """
    m, k = a.shape
    n = w.shape[0]
    if w.shape[1] != k or out.shape != (m, n) or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"gemm_into: incompatible shapes a {tuple(a.shape)}, w {tuple(w.shape)}, "
                         f"bias {None if bias is None else tuple(bias.shape)}, out {tuple(out.shape)}")
    if a.stride(1) != 1 or w.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("gemm_into: a, w and out need unit stride on their last dim")
    if m == 0 or n == 0:
        return out
    t = tile or choose_tile(m, k, n)
    grid = (triton.cdiv(m, t.bm) * triton.cdiv(n, t.bn),)
    with on_device(out.device):
        _dense_gemm_kernel[grid](
            a, a.stride(0), w, w.stride(0), bias if bias is not None else w, out, out.stride(0), m, n, k,
            HAS_BIAS=bias is not None, GELU=gelu, BM=t.bm, BN=t.bn, BK=t.bk, GROUP_M=t.group_m, USE_PDL=pdl,
            num_warps=t.warps, num_stages=t.stages, **launch_kwargs(pdl))
    return out


__all__ = ["CANDIDATES", "DEFAULT_TILE", "GemmTile", "TILES", "choose_tile", "gemm_into"]
