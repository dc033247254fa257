#!/usr/bin/env python3
"""Launch tiles of the vocoder's fused convolution, per tuning-table key (feeds ``kernels/vocoder_tiles.TABLE``).

One ``HiFTVocoder.decode`` at the shipped HiFT sizes (``--streams`` chunks of ``--frames`` mel frames: a
one-second chunk and the 8 cached frames by default) is recorded: every ``conv_fused_triton`` call with
its real operands and epilogue. The calls are grouped by table key (``vocoder_tiles.layer_key``:
operand family, C_in, C_out, taps, phases, short or long phases). Per key, the rule's tiles
(``rule_tiles``) and each candidate (clipped to the layer's channel counts) replay all of that key's
calls of one decode:
- first checked against the rule's launch (relative Frobenius error of every output over the rule's, at
  most ``BOUND[family]``: the same products summed in another order; a candidate over it is not timed);
- then timed as µs per decode's worth of those calls in a CUDA graph (``--calls`` per graph, median of
  ``--repeats`` replays).

Every candidate is compiled first by parallel child processes at 16 streams (a multiple of 16, as
the timed batch must be: Triton specialises the batch-sized output stride on divisibility by 16), so
the timed pass only loads kernels.

Rows (``op`` "vocoder_tiles", provider "torch_cfm", variant the tiles' name (``m128n64k32w4s3``),
shape {c_in, c_out, taps, phases, length, streams, frames, calls}, dtype the family, ``rule`` true for the
rule's tiles, ``speedup`` rule µs / these µs, ``gflop`` and ``mbytes`` the key's work for a floor: every
tap's multiply-adds, each operand and output through memory once) go to ``<out>/vocoder_tiles.json``
with provenance (GPU, versions, commit: env ``BENCH_COMMIT`` where no .git is current, run id) and a table to
``<out>/vocoder_tiles.md``. The run prints, per key whose best candidate beats the rule by more than
``--margin``, its ``TABLE`` line (family, layer, chosen tiles, the rule's tiles) and the run id the
evidence ids are made of.

    python3 bench/vocoder_tiles.py --out "$OUT/vocoder_tiles" [--quick] [--families tf32,fp16] [--streams 64]
    python3 bench/vocoder_tiles.py --dry-run --out /tmp/vt   # CPU: interpreter, tiny HiFT, one replay each
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests"), os.path.dirname(HERE)]

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported

import torch  # noqa: E402

import _harness as H  # noqa: E402

# (BLOCK_M, BLOCK_N cap, BLOCK_K cap, warps, stages); BLOCK_N / BLOCK_K are clipped to the layer's
# channel counts (as the rule clips them), duplicates after clipping are dropped.
CANDIDATES = [(64, 64, 32, 4, 3), (64, 128, 32, 4, 3), (128, 64, 32, 4, 3), (128, 128, 32, 8, 3),
              (128, 64, 32, 4, 4), (128, 128, 32, 8, 4), (256, 64, 32, 8, 3), (128, 32, 32, 4, 3),
              (128, 64, 64, 4, 3), (128, 128, 64, 8, 3), (64, 64, 64, 4, 4), (64, 128, 64, 4, 3),
              (128, 64, 32, 8, 3)]
# the last: 128 x 64 on 8 warps, about 104 registers where 4 warps need 208-230 (sm_90, Triton 3.6,
# `bench/kernel_resources.py`), so 3 programs fit an SM with 25 % fewer operand bytes than 64 x 64
QUICK = [0, 2, 4, 6, 8, 9, 12]
# a candidate's outputs against the rule's: the same products, summed in another order, then rounded
# to the output dtype (16-bit outputs: up to an ulp apart)
BOUND = {"ieee": 1e-5, "tf32": 1e-5, "fp16": 2e-3, "bf16": 1.6e-2}
CHILD_STREAMS = 16


def clipped(cand: tuple, key: tuple):
    from torch_cfm.kernels.vocoder_tiles import ConvTiles, channel_block

    _, c_in, c_out, _, _, _ = key
    bm, bn, bk, warps, stages = cand
    return ConvTiles(bm, channel_block(c_out, bn), channel_block(c_in, bk), warps, stages)


def candidates_of(key: tuple, picks: list[int]) -> list:
    """The rule's tiles first, then each picked candidate clipped to the key's layer, without repeats."""
    from torch_cfm.kernels.vocoder_tiles import rule_tiles

    out = [rule_tiles(key)]
    for i in picks:
        t = clipped(CANDIDATES[i], key)
        if t.name not in {o.name for o in out}:
            out.append(t)
    return out


def build(family: str, streams: int, frames: int, tiny: bool, device: torch.device):
    """(vocoder, mel, source) at the shipped sizes (``tiny``: the tests' tiny HiFT)."""
    import vocoder as V

    from torch_cfm.models.vocoder import HiFTVocoder

    hift = V.build_hift(0, device, tiny=tiny)
    mel, source = V.make_inputs(hift, streams, frames, 1, device)
    kernels = "triton" if device.type == "cpu" else "auto"
    return HiFTVocoder(hift, precision=family, kernels=kernels), mel, source


def record(voc, mel, source) -> dict:
    """{table key: [(conv, x, kwargs), ...]} of one decode, in call order."""
    import torch_cfm.kernels.vocoder_conv as VC

    inner, calls = VC.conv_fused_triton, {}

    def recorder(conv, x, **kw):
        frames_out = conv.out_frames(x.shape[1])
        phases = conv.stride if conv.transposed else 1
        calls.setdefault(VC.launch_key(conv, -(-frames_out // phases), kw["dot"]), []).append((conv, x, kw))
        return inner(conv, x, **kw)

    VC.conv_fused_triton = recorder
    try:
        with torch.no_grad():
            voc.decode(mel, source)
    finally:
        VC.conv_fused_triton = inner
    return calls


def replay(calls: list, tiles) -> list:
    """Every output tensor of the key's calls launched with ``tiles``."""
    from torch_cfm.kernels.vocoder_conv import conv_fused_triton

    outs = []
    for conv, x, kw in calls:
        s, ys = conv_fused_triton(conv, x, **kw, tiles=tiles)
        outs += ([s] if s is not None else []) + ys
    return outs


def work_of(calls: list) -> tuple[float, float]:
    """(GFLOP, MB) of a key's calls: the multiply-adds of every tap (a transposed convolution's masked
    taps excluded), and each operand and output through memory once (the floor's terms)."""
    flop = nbytes = 0.0
    for conv, x, kw in calls:
        batch, frames, c_in = x.shape
        l_out = conv.out_frames(frames)
        taps_per_frame = conv.ksize / conv.stride if conv.transposed else conv.ksize
        flop += 2.0 * batch * l_out * conv.c_out * c_in * taps_per_frame
        out = batch * l_out * conv.c_out
        snakes = 0 if kw.get("alpha") is None else kw["alpha"].shape[0]
        nbytes += x.numel() * x.element_size() + conv.weight.numel() * conv.weight.element_size()
        size = {k: torch.finfo(kw.get(k, torch.float32)).bits // 8 for k in ("y_dtype", "s_dtype")}
        nbytes += out * (snakes * size["y_dtype"] + (size["s_dtype"] if kw.get("store_s") else 0))
        nbytes += sum(t.numel() * t.element_size() for t in (kw.get("r"), kw.get("acc"), kw.get("a")) if t is not None)
    return flop / 1e9, nbytes / 1e6


def rel_to(outs: list, refs: list) -> float:
    num = sum(float((o.double() - r.double()).square().sum()) for o, r in zip(outs, refs))
    den = sum(float(r.double().square().sum()) for r in refs)
    return (num / den) ** 0.5 if den > 0 else float(num > 0)


def table_entries(rows: list[dict], margin: float) -> list[tuple[str, str, str, str]]:
    """The ``TABLE`` entries one run's rows make: (family, layer, chosen tiles, the rule's tiles) per key
    whose fastest timed tiles beat the rule's by more than ``margin`` (rule µs / best µs > 1 + margin)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        if r.get("op") == "vocoder_tiles" and not r.get("error") and r.get("us_p50") is not None:
            sh = r["shape"]
            layer = "x".join(str(sh[k]) for k in ("c_in", "c_out", "taps", "phases", "length"))
            groups.setdefault((r["dtype"], layer), []).append(r)
    entries = []
    for (fam, layer), group in groups.items():
        rule = next((r for r in group if r.get("rule")), None)
        best = min(group, key=lambda r: r["us_p50"])
        if rule is not None and best is not rule and rule["us_p50"] > (1 + margin) * best["us_p50"]:
            entries.append((fam, layer, best["variant"], rule["variant"]))
    return entries


def compile_child(family: str, index: int, frames: int) -> int:
    """Compile every key's launch with candidate ``index`` (-1: the rule's tiles) into Triton's disk cache."""
    voc, mel, source = build(family, CHILD_STREAMS, frames, False, torch.device("cuda"))
    for key, calls in record(voc, mel, source).items():
        tiles = candidates_of(key, [])[0] if index < 0 else clipped(CANDIDATES[index], key)
        try:
            replay(calls, tiles)
        except Exception as exc:  # noqa: BLE001  (a tile the GPU cannot hold: reported by the timed pass)
            print(f"compile {family} {key} {tiles.name}: {str(exc)[:120]}", flush=True)
    torch.cuda.synchronize()
    return 0


def compile_all(families: list[str], picks: list[int], frames: int, jobs: int) -> None:
    todo = [(f, i) for f in families for i in [-1] + picks]
    running: list = []
    t0 = time.time()
    while todo or running:
        while todo and len(running) < jobs:
            f, i = todo.pop(0)
            running.append(subprocess.Popen([sys.executable, __file__, "--compile-child", f"{f}:{i}:{frames}"]))
        running[0].wait()
        running = [p for p in running if p.poll() is None]
    print(f"compiled {len(families) * (len(picks) + 1)} candidate sets in {time.time() - t0:.0f} s", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default="tf32,fp16", help="comma list of ieee, tf32, fp16, bf16")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--frames", type=int, default=58)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--margin", type=float, default=0.03, help="a table entry needs rule µs / best µs > 1 + margin")
    ap.add_argument("--jobs", type=int, default=12, help="parallel compile children")
    ap.add_argument("--quick", action="store_true", help=f"candidates {QUICK}, 5 repeats")
    ap.add_argument("--dry-run", action="store_true", help="CPU: interpreter, tiny HiFT, one stream, one replay")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "bench", "results"))
    args = ap.parse_args(argv)

    from torch_cfm.kernels.vocoder_tiles import layer_text

    families = [f for f in args.families.split(",") if f]
    bad = [f for f in families if f not in BOUND]
    if bad:
        ap.error(f"--families: unknown {bad} (choose from {sorted(BOUND)})")
    picks = QUICK if args.quick else list(range(len(CANDIDATES)))
    if args.dry_run:
        families, picks, streams, frames, device = ["ieee"], [0], 1, 6, torch.device("cpu")
        timer = H.dry_run_timer
    else:
        if not torch.cuda.is_available():
            sys.exit("bench/vocoder_tiles.py: needs CUDA (or --dry-run)")
        if args.streams % 16:
            ap.error("--streams must be a multiple of 16 (the compile children's specialisation)")
        streams, frames, device = args.streams, args.frames, torch.device("cuda")
        timer = H.time_cuda_graph
        compile_all(families, picks, frames, args.jobs)
    repeats = 5 if args.quick else args.repeats
    env = H.env_info()
    rows = []
    for fam in families:
        voc, mel, source = build(fam, streams, frames, args.dry_run, device)
        groups = record(voc, mel, source)
        for key, calls in sorted(groups.items(), key=lambda kv: kv[0][1:]):
            shape = dict(c_in=key[1], c_out=key[2], taps=key[3], phases=key[4], length=key[5], streams=streams,
                         frames=frames, calls=len(calls))
            work = dict(zip(("gflop", "mbytes"), (round(v, 3) for v in work_of(calls))))
            refs, timed = None, []
            for index, tiles in enumerate(candidates_of(key, picks)):
                base = dict(op="vocoder_tiles", provider="torch_cfm", variant=tiles.name, shape=shape, dtype=fam,
                            timing="dry_run" if args.dry_run else "cuda_graph", rule=index == 0)
                try:
                    with torch.no_grad():
                        outs = replay(calls, tiles)
                    err = 0.0 if index == 0 else rel_to(outs, refs)
                    refs = outs if index == 0 else refs
                    if err > BOUND[fam]:
                        rows.append(H.make_row(env, **base, rel_err=err, error=f"off the rule by {err:.2e}"))
                        continue

                    def run(calls=calls, tiles=tiles):
                        with torch.no_grad():
                            replay(calls, tiles)
                    t = timer(run, calls=args.calls, repeats=repeats, warmup=2)
                except Exception as exc:  # noqa: BLE001  (out of shared memory, registers: not a candidate here)
                    if index == 0:
                        raise
                    rows.append(H.make_row(env, **base, error=str(exc)[:200]))
                    continue
                row = H.make_row(env, **base, rel_err=err, **work, **t)
                timed.append((tiles, row))
                rows.append(row)
            rule_us = timed[0][1]["us_p50"]
            for _, row in timed:
                row["speedup"] = round(rule_us / row["us_p50"], 3) if row["us_p50"] else None
            best_tiles, best = min(timed, key=lambda tr: tr[1]["us_p50"])
            line = (f"{fam:5s} {layer_text(key):22s} x{len(calls):<2d} rule {timed[0][0].name} {rule_us:8.1f} us, "
                    f"best {best_tiles.name} {best['us_p50']:8.1f} us")
            print(line, flush=True)
    path = os.path.join(args.out, "vocoder_tiles.json")
    H.upsert_rows(path, rows)
    print(f"{len(rows)} rows -> {path}")
    entries = [f'    ("{fam}", "{layer}", "{chosen}", "{rule}"),'
               for fam, layer, chosen, rule in table_entries(rows, args.margin)]
    if entries:
        print(f"TABLE entries (kernels/vocoder_tiles.py, run=\"{env['run_id']}\"):\n" + "\n".join(entries))
    return 0


if __name__ == "__main__":
    if "--compile-child" in sys.argv:
        fam, index, frames = sys.argv[sys.argv.index("--compile-child") + 1].split(":")
        sys.exit(compile_child(fam, int(index), int(frames)))
    sys.exit(main())
