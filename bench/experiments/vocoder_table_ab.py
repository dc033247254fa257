"""The vocoder tile table against the rule, whole decode, one process (experiment; issue 43).

``HiFTVocoder.decode`` of B streams x 58 frames replayed from a CUDA graph, alternately with
``vocoder_tiles.TABLE`` as shipped and emptied (every key on ``rule_tiles``), ``--rounds`` times each
so drift hits both sides; per side the p50 over all pooled repeats, the ratio table/rule and the
waveform difference between the sides. Writes ``vocoder_table_ab.json`` under --out.

    python3 bench/experiments/vocoder_table_ab.py --streams 16,64 --out "$OUT"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]

import torch  # noqa: E402

import _harness as H  # noqa: E402
import vocoder as V  # noqa: E402


def main() -> int:
    import torch_cfm.kernels.vocoder_tiles as VT
    from torch_cfm.models.vocoder import HiFTVocoder

    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", default="16,64")
    ap.add_argument("--frames", type=int, default=58)
    ap.add_argument("--precisions", default="tf32,fp16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    hift = V.build_hift(0, dev)
    shipped = dict(VT.TABLE)
    rows = []
    for b in [int(s) for s in args.streams.split(",")]:
        mel, source = V.make_inputs(hift, b, args.frames, 1, dev)
        V.scale_output(hift, mel, source)
        for prec in args.precisions.split(","):
            voc = HiFTVocoder(hift, precision=prec)
            samples = {"table": [], "rule": []}
            outs = {}
            for _ in range(args.rounds):
                for side in ("table", "rule"):
                    VT.TABLE.clear()
                    if side == "table":
                        VT.TABLE.update(shipped)
                    H.time_cuda_graph(lambda: voc.decode(mel, source), calls=2, repeats=9, warmup=2,
                                      samples=samples[side])
                    if side not in outs:  # one decode per side: the samples do not change between rounds
                        outs[side] = voc.decode(mel, source).double()
            VT.TABLE.clear()
            VT.TABLE.update(shipped)
            ms = {k: statistics.median(v) / 1e3 for k, v in samples.items()}
            diff = float((outs["table"] - outs["rule"]).norm() / outs["rule"].norm())
            row = dict(H.env_info(), op="vocoder_table_ab", B=b, frames=args.frames, precision=prec,
                       table_ms=round(ms["table"], 3), rule_ms=round(ms["rule"], 3),
                       ratio=round(ms["table"] / ms["rule"], 4), rel_diff=diff, table_keys=len(shipped))
            rows.append(row)
            print({k: row[k] for k in ("B", "precision", "table_ms", "rule_ms", "ratio", "rel_diff")}, flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "vocoder_table_ab.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
