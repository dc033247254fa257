"""The vocoder tile table against the rule, whole decode, one process (experiment; issue 43).

``HiFTVocoder.decode`` of B streams x 58 frames replayed from a CUDA graph, alternately with
``vocoder_tiles.TABLE`` as shipped and emptied (every key on ``rule_tiles``), ``--rounds`` times each
so drift hits both sides; per side the p50 over all pooled repeats, the ratio table/rule and the
waveform difference between the sides. With ``--candidate``, a third side: the table a fresh
``bench/vocoder_tiles.py`` run would write (its ``vocoder_tiles.json``: per key the fastest tiles where
they beat the rule's by more than ``--margin``), so a re-sweep is checked over whole decodes against
the shipped table in the same process. Writes ``vocoder_table_ab.json`` under --out.

    python3 bench/experiments/vocoder_table_ab.py --streams 16,64 --out "$OUT"
    python3 bench/experiments/vocoder_table_ab.py --candidate "$OUT/vocoder_tiles/vocoder_tiles.json" --out "$OUT"
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


def candidate_table(path: str, margin: float, shipped: dict) -> dict:
    """The tile table a sweep's rows make: the newest run's ``bench/vocoder_tiles.table_entries``;
    the shipped entries of the families the run did not sweep."""
    from vocoder_tiles import table_entries

    from torch_cfm.kernels.vocoder_tiles import ConvTiles

    with open(path) as f:
        rows = [r for r in json.load(f) if r.get("op") == "vocoder_tiles" and r.get("us_p50")]
    if not rows:
        raise SystemExit(f"--candidate: no timed vocoder_tiles rows in {path}")
    run = max(r["run_id"] for r in rows)
    rows = [r for r in rows if r["run_id"] == run]
    swept = {r["dtype"] for r in rows}
    table = {key: tiles for key, tiles in shipped.items() if key[0] not in swept}
    for fam, layer, chosen, _ in table_entries(rows, margin):
        c_in, c_out, taps, phases, length = layer.split("x")
        table[(fam, int(c_in), int(c_out), int(taps), int(phases), length)] = ConvTiles.parse(chosen)
    print(f"candidate table: {len(table)} keys, {sorted(swept)} from run {run}", flush=True)
    return table


def main() -> int:
    import torch_cfm.kernels.vocoder_tiles as VT
    from torch_cfm.models.vocoder import HiFTVocoder

    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", default="16,64")
    ap.add_argument("--frames", type=int, default=58)
    ap.add_argument("--precisions", default="tf32,fp16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--candidate", help="a vocoder_tiles.json: time the table it makes as a third side")
    ap.add_argument("--margin", type=float, default=0.03)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    hift = V.build_hift(0, dev)
    shipped = dict(VT.TABLE)
    tables = {"table": shipped, "rule": {}}
    if args.candidate:
        tables["candidate"] = candidate_table(args.candidate, args.margin, shipped)
    rows = []
    for b in [int(s) for s in args.streams.split(",")]:
        mel, source = V.make_inputs(hift, b, args.frames, 1, dev)
        V.scale_output(hift, mel, source)
        for prec in args.precisions.split(","):
            voc = HiFTVocoder(hift, precision=prec)
            samples = {side: [] for side in tables}
            outs = {}
            for _ in range(args.rounds):
                for side, table in tables.items():
                    VT.TABLE.clear()
                    VT.TABLE.update(table)
                    H.time_cuda_graph(lambda: voc.decode(mel, source), calls=2, repeats=9, warmup=2,
                                      samples=samples[side])
                    if side not in outs:  # one decode per side: the samples do not change between rounds
                        outs[side] = voc.decode(mel, source).double()
            VT.TABLE.clear()
            VT.TABLE.update(shipped)
            ms = {k: statistics.median(v) / 1e3 for k, v in samples.items()}
            diff = float((outs["table"] - outs["rule"]).norm() / outs["rule"].norm())
            row = dict(H.env_info(), op="vocoder_table_ab", B=b, table_ms=round(ms["table"], 3))
            if "candidate" in tables:  # ahead of the rest: the results table shows a row's first fields
                row.update(candidate_ms=round(ms["candidate"], 3),
                           candidate_ratio=round(ms["candidate"] / ms["table"], 4),
                           candidate_rel_diff=float((outs["candidate"] - outs["table"]).norm() / outs["table"].norm()))
            row.update(rule_ms=round(ms["rule"], 3), ratio=round(ms["table"] / ms["rule"], 4), rel_diff=diff,
                       frames=args.frames, precision=prec, table_keys=len(shipped))
            if "candidate" in tables:
                row["candidate_keys"] = len(tables["candidate"])
            rows.append(row)
            print({k: v for k, v in row.items() if k in ("B", "precision", "rel_diff") or k.endswith(("_ms", "ratio"))},
                  flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "vocoder_table_ab.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
