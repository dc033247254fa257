"""Issue 43: why the vocoder's fused convolutions run at 100-170 TFLOP/s (H100 TF32, 64 streams):
one decode's ``_vocoder_conv_kernel`` launches under Nsight Compute (throughput against peak for
SM, tensor pipes, L1, L2 and HBM; warp stall reasons; occupancy). This script runs the decode;
``ncu`` profiles only the third one (the first two compile and warm up):

    ncu --clock-control none --profile-from-start off -k regex:vocoder_conv --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats \\
        --section Occupancy --section LaunchStats -f -o "$OUT/ncu_tf32" \\
        python3 bench/experiments/vocoder_conv_ncu.py --precision tf32
    ncu --import "$OUT/ncu_tf32.ncu-rep" --csv --page details > "$OUT/ncu_tf32.csv"
    python3 bench/experiments/vocoder_conv_ncu.py --summarize "$OUT/ncu_tf32.csv" "$OUT/ncu_fp16.csv"

``--summarize`` prints one table per CSV: a row per launch, named by the decode's order (conv_pre;
per stage the upsampling, the source's downsampling, its ResBlock's six convolutions, the last of
which is the stage merge with three Snake outputs, then the three ResBlocks' six each; conv_post).

The HiFT at its shipped sizes, random weights scaled as ``bench/vocoder.py`` does, ``--streams``
one-second chunks (58 frames with the 8 cached ones); precision and tiles as dispatch picks them.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(ROOT, "tests"), ROOT]

import torch  # noqa: E402

import vocoder as V  # noqa: E402


COLUMNS = [("Duration", "µs"), ("Compute (SM) Throughput", "SM %"), ("L2 Cache Throughput", "L2 %"),
           ("DRAM Throughput", "DRAM %"), ("L1/TEX Hit Rate", "L1 hit %"), ("Achieved Occupancy", "occupancy %"),
           ("Registers Per Thread", "registers"), ("Warp Cycles Per Issued Instruction", "cycles / issue")]


def layer_names(stages: int = 3, resblock_kernels=(3, 7, 11), source_kernels=(7, 7, 11)) -> list[str]:
    """The fused convolutions of one decode, in launch order (the shipped HiFT)."""
    names = ["conv_pre"]
    pairs = [f"c{c} d{d}" for d in (1, 3, 5) for c in (1, 2)]
    for i in range(stages):
        names += [f"s{i} up", f"s{i} source down"]
        names += [f"s{i} source k{source_kernels[i]} {p}" for p in pairs[:-1]] + [f"s{i} merge (3 Snakes)"]
        names += [f"s{i} k{k} {p}" for k in resblock_kernels for p in pairs]
    return names + ["conv_post"]


def summarize(path: str) -> str:
    import csv

    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    metrics: dict[str, dict] = {}
    for r in rows:
        m = metrics.setdefault(r["ID"], {"grid": r["Grid Size"], "block": r["Block Size"]})
        value = r["Metric Value"].replace(",", "")
        if r["Metric Name"] == "Duration" and r["Metric Unit"] in ("ms", "msecond"):
            value = str(float(value) * 1e3)
        m[r["Metric Name"]] = value
    names = layer_names()
    if len(metrics) != len(names):
        names = [f"launch {i}" for i in range(len(metrics))]
    lines = ["| launch | layer | grid | " + " | ".join(label for _, label in COLUMNS) + " |",
             "|---" * (3 + len(COLUMNS)) + "|"]
    total = 0.0
    for (key, m), name in zip(sorted(metrics.items(), key=lambda kv: int(kv[0])), names):
        total += float(m.get("Duration", 0))
        lines.append(f"| {key} | {name} | {m['grid']} | " + " | ".join(m.get(k, "-") for k, _ in COLUMNS) + " |")
    return "\n".join(lines + ["", f"{len(metrics)} launches, {total / 1e3:.2f} ms under the profiler"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", default="tf32")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--frames", type=int, default=58)
    ap.add_argument("--summarize", nargs="+", metavar="CSV", help="print the tables of ncu CSV exports instead")
    args = ap.parse_args()
    if args.summarize:
        for path in args.summarize:
            print(f"## {os.path.basename(path)}\n\n{summarize(path)}\n")
        return 0
    from torch_cfm.models.vocoder import HiFTVocoder

    dev = torch.device("cuda")
    hift = V.build_hift(0, dev)
    mel, source = V.make_inputs(hift, args.streams, args.frames, 1, dev)
    V.scale_output(hift, mel, source)
    voc = HiFTVocoder(hift, precision=args.precision)
    for _ in range(2):
        voc.decode(mel, source)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    voc.decode(mel, source)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"decoded {args.streams} x {args.frames} frames at {args.precision}: {voc.fused_convs} fused convolutions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
