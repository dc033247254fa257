"""The dependent-phase floor of one estimator step under the H200's measured ingest limit (no GPU needed).

docs/design.md §7's floor (``floor_us`` in bench/dit_step.py: FLOPs at the matmul ceiling, or weights and caches
once through HBM) is 0.09 ms at (8, 50, 400) fp16. It is not what bounds this workload. Every phase of
a block needs the whole output of the phase before it, and every SM takes in its operands at a
limited rate. The model that fitted every measured GEMM chain (bench/wgmma_gemm.py; docs/performance.md):

    phase µs = sync + (bytes one SM takes in) / rate

- ``rate``: one SM's ingest while all SMs load together (bench/results/sm_ingest.md, bulk copies from
  L2 at 132 CTAs: 51-56 GB/s at 128-192 KB per SM, ≈ 67 GB/s marginal). TMA multicast does not raise
  it: each SM still receives the bytes.
- ``sync``: one grid-wide dependency, either a kernel boundary under PDL or a grid barrier
  (0.9-1.0 µs at 132 CTAs, measured with grid barriers). 0 is a perfect dataflow design, where a phase starts on each
  tile as soon as that tile's inputs exist, so that only the bytes count.

Everything else is assumed as favourable as it can be:
- each GEMM gets its best tile (a rows × b columns with a·b ≤ 32768 fp32 accumulators per SM) and
  split-K factor s, in ceil(tiles / SMs) waves, with only the consumer's re-read of the fp32
  partials charged for the split;
- GELU, the q/k norm and the cache writes cost nothing;
- attention reads each K/V frame once, spread over every SM.

Phases per block: qkv, attention, proj, conv 1 and conv 2 (three taps over the T + 2 history rows),
fc1, fc2. Two structures:
- ``fused``: the four row-norm boundaries cost nothing. This is a lower bound on any design that keeps
  these operand precisions.
- ``norm phases``: each boundary is a phase of its own, as in the shipped body (11-12 kernels per
  block). It reads the rows it normalises: the GEMM output and the fp32 residual, or the three conv
  taps.

Both are floors of the in-place (arena) step. The functional step also copies the old cache frames
into the new cache tensor (docs/design.md §2). That is HBM traffic, 52 µs at (8, 50, 400) fp16 and 210 µs at
N = 32 (docs/design.md §7's copy rate), which a copy engine could overlap with the compute.

    python3 bench/ingest_floor.py [--rates 50,55,67] [--syncs 1.0,0.5,0] [--out bench/results]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from torch_cfm.config import BODY_BENCH_SHAPES, DiTConfig  # noqa: E402

SMS = 132  # H200
MAX_ACC = 32768  # fp32 accumulators one SM holds for its output tile (2 warpgroups x 128 threads x 128)
TILE_ROWS = (64, 128, 192, 256)  # wgmma M granularity
TILE_COLS = tuple(range(32, 1025, 32))
SPLITS = (1, 2, 4, 8)
OPERAND_BYTES = {"fp16": 2, "bf16": 2, "fp32-tf32": 4}  # fp32 operands stay fp32 through the TF32 MMA
BAR_MS = {(8, 50, 400, "fp16"): 0.30, (32, 50, 400, "fp16"): 0.80, (8, 50, 400, "fp32-tf32"): 0.60}  # the step targets (docs/performance.md)


@dataclass(frozen=True)
class Tile:
    rows: int
    cols: int
    splits: int


def gemm_ingest_bytes(m: int, k: int, n: int, elem: int, tile: Tile, sms: int = SMS) -> float:
    """Bytes one SM takes in for an (m, k) x (k, n) GEMM cut into ``tile``s, one tile per SM per wave:
    per tile the a rows and b weight columns over K / s; with s > 1, its share of the consumer's
    re-read of s fp32 partial outputs."""
    tiles = math.ceil(m / tile.rows) * math.ceil(n / tile.cols) * tile.splits
    waves = math.ceil(tiles / sms)
    per_sm = waves * (tile.rows + tile.cols) * (k // tile.splits) * elem
    if tile.splits > 1:
        per_sm += m * n * tile.splits * 4 / sms
    return per_sm


def best_gemm(m: int, k: int, n: int, elem: int, rate_gbs: float, sync_us: float) -> tuple[float, Tile, float]:
    """(µs, tile, bytes per SM) of the fastest tiling of one GEMM phase under the model."""
    best: Optional[tuple[float, Tile, float]] = None
    for rows in TILE_ROWS:
        for cols in TILE_COLS:
            if rows * cols > MAX_ACC:
                continue
            for s in SPLITS:
                if k % s:
                    continue
                tile = Tile(rows, cols, s)
                b = gemm_ingest_bytes(m, k, n, elem, tile)
                us = sync_us + b / (rate_gbs * 1e3)
                if best is None or us < best[0]:
                    best = (us, tile, b)
    assert best is not None
    return best


def block_phases(cfg: DiTConfig, n: int, t: int, l_len: int, elem: int, rate_gbs: float, sync_us: float,
                 norm_phases: bool = False) -> list[tuple[str, float, Optional[Tile], float]]:
    """(phase, µs, tile or None, bytes per SM) for the 7 dependent phases of one block, 11 with
    ``norm_phases`` (the row-norm boundaries in front of qkv, conv 1, conv 2 and fc1)."""
    c, m, hist = cfg.hidden, n * t, n * (t + cfg.conv_cache_frames)
    gemms = {"qkv": (m, c, 3 * cfg.inner), "proj": (m, cfg.inner, c),
             "conv1": (hist, c, cfg.conv_kernel * c), "conv2": (hist, c, cfg.conv_kernel * c),
             "fc1": (m, c, cfg.mlp_hidden), "fc2": (m, cfg.mlp_hidden, c)}
    kv_bytes = n * cfg.heads * (l_len + t) * 2 * cfg.head_dim * elem / SMS
    taps = hist * cfg.conv_kernel * c * elem  # a conv's three tap outputs over the history rows
    norm_bytes = {"norm>qkv": m * c * (elem + 4), "norm>conv1": m * c * (elem + 4),  # y and the fp32 residual
                  "norm>conv2": taps, "norm>fc1": taps + m * c * 4}
    order = ("qkv", "attention", "proj", "conv1", "conv2", "fc1", "fc2")
    if norm_phases:
        order = ("norm>qkv", "qkv", "attention", "proj", "norm>conv1", "conv1", "norm>conv2", "conv2", "norm>fc1",
                 "fc1", "fc2")
    phases = []
    for name in order:
        if name == "attention" or name in norm_bytes:
            b = kv_bytes if name == "attention" else norm_bytes[name] / SMS
            phases.append((name, sync_us + b / (rate_gbs * 1e3), None, b))
        else:
            phases.append((name,) + best_gemm(*gemms[name], elem, rate_gbs, sync_us))
    return phases


def step_floor_us(cfg: DiTConfig, n: int, t: int, l_len: int, dname: str, rate_gbs: float, sync_us: float,
                  norm_phases: bool = False) -> float:
    """The model's floor of one in-place estimator step (all blocks), µs."""
    phases = block_phases(cfg, n, t, l_len, OPERAND_BYTES[dname], rate_gbs, sync_us, norm_phases)
    return cfg.depth * sum(p[1] for p in phases)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="50,55,67", help="per-SM ingest rates, GB/s")
    ap.add_argument("--syncs", default="1.0,0.5,0",
                    help="µs per grid-wide dependency (0: perfect dataflow, only the bytes count)")
    ap.add_argument("--dtypes", default="fp16,fp32-tf32")
    ap.add_argument("--out", default=None, help="write ingest_floor.md here")
    args = ap.parse_args(argv)
    cfg = DiTConfig()
    rates = [float(r) for r in args.rates.split(",")]
    syncs = [float(s) for s in args.syncs.split(",")]
    dnames = args.dtypes.split(",")
    combos = [(r, s) for r in rates for s in syncs]
    lines = ["# Step floor under the ingest model, ms (bench/ingest_floor.py; the in-place step)", "",
             "| N, T, L | dtype | row-norms | " + " | ".join(f"{r:g} GB/s, sync {s:g} µs" for r, s in combos)
             + " | target |", "|---|---|---|" + "---|" * len(combos) + "---|"]
    for n, t, l_len in BODY_BENCH_SHAPES:
        for d in dnames:
            for norms in (False, True):
                cells = [f"{step_floor_us(cfg, n, t, l_len, d, r, s, norms) / 1e3:.3f}" for r, s in combos]
                bar = BAR_MS.get((n, t, l_len, d))
                lines.append(f"| {n}, {t}, {l_len} | {d} | {'norm phases' if norms else 'fused'} | "
                             + " | ".join(cells) + f" | {bar if bar else ''} |")
    r0, s0 = combos[0]
    lines += ["", f"Per block at (8, 50, 400), {r0:g} GB/s, sync {s0:g} µs (best tile: rows x cols / split-K):", "",
              "| dtype | phase | µs | KB per SM | tile |", "|---|---|---|---|---|"]
    for d in dnames:
        for name, us, tile, b in block_phases(cfg, 8, 50, 400, OPERAND_BYTES[d], r0, s0, norm_phases=True):
            shape = (f"{tile.rows} x {tile.cols} / {tile.splits}" if tile
                     else "K/V once over all SMs" if name == "attention" else "its rows once")
            lines.append(f"| {d} | {name} | {us:.2f} | {b / 1024:.0f} | {shape} |")
    lines += ["", "Reproduce: `python3 bench/ingest_floor.py "
              + f"--rates {args.rates} --syncs {args.syncs} --dtypes {args.dtypes}`"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "ingest_floor.md"), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
