"""What % of the dense peak the DiT block's GEMMs can reach at 32-128 rows, by tile arithmetic (issue 41; no GPU).

Issue 41 asks each CUTLASS role to reach >= 85 % of the measured dense peak at 32 / 64 / 128 rows. At K = 512 a
CTA's operand bytes arrive at the SM's L2 ingest rate (``docs/performance.md`` §4: about 67 GB/s an SM when all
load together), so a tile of m x n outputs takes

    t_tile = max(2 m n K / (peak / SMs),  (m + n) K 2 B / ingest)

and is compute-bound only when m n / (m + n) >= ingest-limited intensity (84 at 739 TFLOP/s and 67 GB/s). A
persistent data-parallel kernel runs ceil(tiles / SMs) tiles on its busiest SM; an ideal stream-K schedule spreads
tiles / SMs of work on every SM (no fix-up cost). Bound = FLOPs at the peak / that time, with no launch, prologue
or epilogue time; an estimate, not a proof: the ingest rate is the §4 microbenchmark's, and a long K loop sustains
more (fc2, K = 2,048, measures above it). Tiles: every m x n of {64, 128, 256} x {64, 128, 256} whose fp32 accumulators fit
two consumer warpgroups (m n <= 128 x 256). The model is checked against the CUTLASS configs measured in
``bench/results/cutlass_gemm.json`` (data-parallel schedules only).

    python3 bench/experiments/gemm_tile_bound.py > bench/experiments/gemm_tile_bound.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

from torch_cfm.kernels.cutlass_gemm import body_roles  # noqa: E402

TILES = [(m, n) for m in (64, 128, 256) for n in (64, 128, 256) if m * n <= 128 * 256]


def tile_us(m: int, n: int, k: int, peak_tflops: float, ingest_gbs: float, sms: int) -> float:
    compute = 2.0 * m * n * k / (peak_tflops * 1e6 / sms)
    ingest = (m + n) * k * 2 / (ingest_gbs * 1e3)
    return max(compute, ingest)


def bound(mm: int, nn: int, k: int, m: int, n: int, peak: float, ingest: float, sms: int, stream_k: bool) -> float:
    """% of peak: the GEMM (mm, nn, k) on m x n tiles."""
    tiles = math.ceil(mm / m) * math.ceil(nn / n)
    per_sm = tiles / sms if stream_k else math.ceil(tiles / sms)
    floor_us = 2.0 * mm * nn * k / (peak * 1e6)
    return 100.0 * floor_us / (per_sm * tile_us(m, n, k, peak, ingest, sms))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peak", type=float, default=None, help="TFLOP/s (default: the peak row of cutlass_gemm.json)")
    ap.add_argument("--ingest", type=float, default=67.0, help="GB/s an SM, all SMs loading")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--data", default=os.path.join(ROOT, "bench", "results", "cutlass_gemm.json"))
    args = ap.parse_args()
    rows = json.load(open(args.data))
    peak = args.peak or next(r["tflops"] for r in rows if r.get("variant") == "peak")
    run = next(r["run_id"] for r in rows if r.get("variant") == "peak")
    print("# The DiT block's GEMMs: what tile arithmetic allows at 32-128 rows (issue 41)\n")
    print(f"Model: `bench/experiments/gemm_tile_bound.py` (its docstring); peak {peak} TFLOP/s (fp16, H100, run "
          f"{run}), ingest {args.ingest} GB/s an SM, {args.sms} SMs; no launch, prologue or epilogue time.\n")
    print("## The model against the measured CUTLASS configs (fp16, % of peak; data-parallel schedules)\n")
    print("| role | rows | config | bound % | measured % |")
    print("|---|---|---|---|---|")
    for r in rows:
        if r.get("provider") != "cutlass" or "streamk" in r["variant"] or r.get("pct_peak") is None:
            continue
        s = r["shape"]
        m, n = (int(x) for x in r["variant"].split("_")[-1].split("x")[:2]) if "c2x1" not in r["variant"] else \
            (int(x) for x in r["variant"].split("_")[1].split("x"))
        b = bound(s["M"], s["N"], s["K"], m, n, peak, args.ingest, args.sms, stream_k=False)
        print(f"| {s['role']} | {s['rows']} | {r['variant']} | {b:.0f} | {r['pct_peak']:.0f} |")
    print("\n## The best any feasible tile allows (fp16, % of peak)\n")
    print("| role | rows | M x N x K | data-parallel: best tile, bound % | ideal stream-K: best tile, bound % |")
    print("|---|---|---|---|---|")
    for nrows in (32, 64, 128):
        for role in body_roles(nrows):
            if role.name == "fc1":
                continue  # fc1's shape is qkv's with N = 2048; listed apart below
            cells = []
            for sk in (False, True):
                best = max(TILES, key=lambda t: bound(role.m, role.n, role.k, *t, peak, args.ingest, args.sms, sk))
                cells.append(f"{best[0]}x{best[1]}, {bound(role.m, role.n, role.k, *best, peak, args.ingest, args.sms, sk):.0f}")
            print(f"| {role.name} | {nrows} | {role.m} x {role.n} x {role.k} | {cells[0]} | {cells[1]} |")
    for nrows in (32, 64, 128):
        role = next(r for r in body_roles(nrows) if r.name == "fc1")
        cells = []
        for sk in (False, True):
            best = max(TILES, key=lambda t: bound(role.m, role.n, role.k, *t, peak, args.ingest, args.sms, sk))
            cells.append(f"{best[0]}x{best[1]}, {bound(role.m, role.n, role.k, *best, peak, args.ingest, args.sms, sk):.0f}")
        print(f"| fc1 | {nrows} | {role.m} x {role.n} x {role.k} | {cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
