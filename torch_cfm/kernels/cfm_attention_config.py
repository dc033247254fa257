"""Launch parameters of ``cfm_attention``'s Triton kernel and the per-shape rule that picks them.

:class:`AttentionConfig` is one kernel variant (tiles, split-K, pipelining, how fp32 "ieee" dots
run); :func:`choose_config` picks one from the call's shape alone: no autotuning, so the choice is
deterministic, the first call compiles exactly one variant, the Triton interpreter runs the same
code and graph capture never benchmarks. :func:`use_pdl` is the kernel's programmatic dependent
launch rule. No Triton import: the launcher (:mod:`torch_cfm.kernels.cfm_attention`) and the benches
read these anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class AttentionConfig:
    """Launch parameters of one kernel variant.

    Attributes:
        block_q: queries per program (16, 32, 64 or 128).
        block_k: keys per loop step (16..128).
        splits: programs sharing one (row, head, query tile)'s keys; 1 = no combine kernel.
        num_warps: warps per program of the main kernel.
        num_stages: software-pipelining depth of the key loop.
        peel: walk whole key tiles without bound tests and mask only the last one.
        ieee_dot: how fp32 "ieee" dots run: "tf32x3" (error-compensated TF32 on tensor cores:
            three TF32 products per dot, FP32-level accuracy) or "ieee" (FP32 FMA, slow).
        pdl: programmatic dependent launch (SM90+): the kernel is scheduled while its predecessor
            in the stream still runs and waits (``griddepcontrol.wait``) before its first memory
            access. None = :func:`use_pdl` (on for grids of at most one program per SM).
        merge: how split partials are merged (splits > 1): "kernel" (a second, combine kernel) or
            "last" (the last program of a tile to finish merges them, counted with one atomic per
            tile: no second launch; see :class:`~torch_cfm.kernels.cfm_attention.ArrivalCounters`).
        qk_slab: width of the head-dim slices whose q·k partial dots each run into a fresh
            accumulator and are summed in FP32 (0 = one dot over the whole head dim). A single dot
            accumulates all D products in one running FP32 sum; on sharp softmaxes that sum's
            rounding puts fp32 "ieee" outputs outside docs/design.md §6's bound (up to 3.3× the
            bound at D = 128, K = 437); 32-wide slices stay within it, like cuBLAS's FP32 GEMM
            (docs/performance.md). :func:`choose_config` sets 32 for "ieee" and D > 32.
    """

    block_q: int
    block_k: int
    splits: int = 1
    num_warps: int = 4
    num_stages: int = 2
    peel: bool = True
    ieee_dot: str = "tf32x3"
    pdl: Optional[bool] = None
    merge: str = "kernel"
    qk_slab: int = 0

    @property
    def name(self) -> str:
        extra = ("" if self.peel else "_nopeel") + ("" if self.ieee_dot == "tf32x3" else "_fma")
        extra += "" if self.pdl is None else ("_pdl" if self.pdl else "_nopdl")
        extra += "_last" if self.merge == "last" and self.splits > 1 else ""
        extra += f"_slab{self.qk_slab}" if self.qk_slab else ""
        return f"q{self.block_q}_k{self.block_k}_s{self.splits}_w{self.num_warps}_st{self.num_stages}{extra}"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def choose_config(dtype: torch.dtype, head_dim: int, rows_heads: int, q_len: int, k_len: int,
                  n_sm: int = 132, precision: Optional[str] = None) -> AttentionConfig:
    """Tiles and splits for one call, from the shape alone (tuned on an H200, see docs/performance.md).

    At the docs/design.md §7 shapes one (row, head, query-tile) program walking all its keys beats
    every split-K variant up to K = 524: the combine kernel costs more than the shorter key walk
    saves. fp16/bf16: 64-query tiles (Hopper wgmma), 64-key steps, 3-stage pipeline, peeled tail.
    fp32 (tf32 and the 3xTF32 "ieee" dots): 32-query tiles, 64-key steps; 16-query tiles when
    there are very few programs; tf32 pipelines 3 deep at medium sizes and walks unpeeled at
    large ones. Splits: fp32 with so few programs that two key halves still fit one wave
    (K >= 256) splits in 2, merged by the last program (fp16 gains nothing from a split there).
    Long key ranges with few programs split too (a conservative extrapolation beyond the measured
    K <= 524), also merged in-kernel: one wave by construction, where the last-program merge beats
    the combine kernel. D = 128 tiles are chosen from the ptxas register report (no spills), not
    timed; D = 16/32 reuse the D = 64 choice. fp32 "ieee" with D > 32 sums q·k in 32-wide head-dim
    slices (``qk_slab``: docs/design.md §6 on sharp softmaxes, no measurable time).

    Args:
        dtype: q/k/v dtype.
        head_dim: D.
        rows_heads: N·H, the (row, head) pairs.
        q_len: Q; k_len: K (the padded key count; ragged lengths are split in the kernel).
        n_sm: SMs of the device (132 on H100/H200).
        precision: "tf32" | "ieee" for float32 (None: treated as "ieee").
    """
    num_stages, peel, num_warps = 2, True, 4
    if dtype == torch.float32:
        block_q = 16 if q_len <= 16 else 32
        programs = rows_heads * _cdiv(q_len, block_q)
        if programs <= n_sm // 4:
            block_q = 16
        elif precision == "tf32":
            if programs <= 2 * n_sm:
                num_stages = 3
            else:
                peel = False
        block_k = 64 if head_dim <= 64 else 32
        if head_dim > 64 and precision != "tf32" and block_q > 16:
            num_warps = 8  # 3xTF32 at D = 128 spills with 4 warps (ptxas report, sm_90)
    else:
        block_q = 16 if q_len <= 16 else 32 if q_len <= 32 else 64
        block_k = 64 if head_dim <= 64 else 32  # D = 128: 64-key tiles spill with a mask
        num_stages = 3
    tiles = rows_heads * _cdiv(q_len, block_q)
    splits, merge = 1, "kernel"
    if k_len >= 2048 and tiles < n_sm:
        splits, merge = min(_cdiv(k_len, 1024), max(1, n_sm // tiles), 8), "last"
    elif dtype == torch.float32 and k_len >= 256 and 2 * tiles <= n_sm:
        splits, merge = 2, "last"  # fp32 with few programs: two key halves in one wave
    # fp32 "ieee": q·k in 32-wide head-dim slices summed in FP32 (docs/design.md §6 on sharp softmaxes)
    qk_slab = 32 if dtype == torch.float32 and precision != "tf32" and head_dim > 32 else 0
    return AttentionConfig(block_q, block_k, splits, num_warps=num_warps, num_stages=num_stages, peel=peel,
                           merge=merge, qk_slab=qk_slab)


def use_pdl(programs: int, n_sm: int) -> bool:
    """Programmatic dependent launch by default only for grids of at most one program per SM.

    PDL hides part of the launch of small grids (docs/performance.md); on grids of more than one
    wave the next call's early-resident programs take SM slots from this call's second wave, and
    it costs time instead.
    """
    return programs <= n_sm


def qk_slabs(config: AttentionConfig, head_dim: int) -> int:
    """How many head-dim slices ``config.qk_slab`` cuts a D-wide q·k dot into: 1, 2 or 4."""
    if not config.qk_slab or config.qk_slab >= head_dim:
        return 1
    slabs = head_dim // config.qk_slab
    if slabs * config.qk_slab != head_dim or slabs not in (2, 4) or config.qk_slab < 16:
        raise ValueError(f"AttentionConfig.qk_slab={config.qk_slab} must cut head_dim={head_dim} into 2 or 4 "
                         "slices of at least 16")
    return slabs
