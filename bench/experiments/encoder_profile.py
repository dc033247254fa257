"""Where the encoder stage's time goes at many streams (issue 43 item 2; experiment, not a shipped bench).

``Token2wavServer`` (stage ``mel``, fp16, shipped flow sizes, one voice) at C streams in steady
ticks. Reports, per tick:

* the server's own stage clocks (encoder / CFM, synchronised wall time);
* the encoder stage split by part under ``torch.profiler``: the graph replay (gather, encoder,
  trimmed scatter into the slots), the slot index uploads, the whole stage; CPU ms and GPU kernel ms each;
* the graph replay alone, timed with CUDA events (the floor of today's structure);
* the top GPU kernels of the encoder stage.

    python3 bench/experiments/encoder_profile.py --streams 64 --out "$OUT"
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(ROOT, "tests"), ROOT]

import torch  # noqa: E402

import _harness as H  # noqa: E402
import serving as S  # noqa: E402
import upstream_flow as U  # noqa: E402
from torch_cfm.models.cache import TRIM_KEEP_OLDEST  # noqa: E402


def labelled(obj, attr: str, label: str) -> None:
    """Wrap ``obj.attr`` in a profiler range named ``label``."""
    inner = getattr(obj, attr)

    def call(*a, **kw):
        with torch.profiler.record_function(label):
            return inner(*a, **kw)

    setattr(obj, attr, call)


def timed(fn, dev: str) -> float:
    """ms of one ``fn()``: CUDA events on CUDA, the wall clock on the CPU."""
    if dev != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--ticks", type=int, default=10)
    ap.add_argument("--out", default=".")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run at tiny sizes")
    args = ap.parse_args()
    dev = args.device
    dtype = torch.float16 if dev == "cuda" else torch.float32
    size = U.SHIPPED if dev == "cuda" else U.TINY
    wl = S.Workload(prompt_tokens=150 if dev == "cuda" else 10, chunk_tokens=28, chunks=10 ** 6, n_steps=10, ticks=0, warm_ticks=0)
    flow = U.build_flow(size, seed=0)
    U.resize_scratch_buffers(flow, wl.prompt_frames + TRIM_KEEP_OLDEST + wl.chunk_frames)
    flow = flow.to(device=dev, dtype=dtype)
    inputs = S.Inputs(size, wl, dev, dtype, voices=1)
    prov = S.TorchCfmProvider(flow, None, "mel", args.streams, wl, inputs, dev, dtype)
    server = prov.server
    t0 = time.perf_counter()
    print(f"warmup: {server.warmup(prompt_frames=(wl.prompt_frames,), chunk_tokens=(wl.chunk_tokens,))} "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    ids = list(range(args.streams))
    prov.open(ids)
    for _ in range(6):  # caches grow to the trim bound
        prov.step(ids)
    enc = server.encoder
    cnn, att = enc.caches(0)
    print(f"conformer att cache per stream: {tuple(att.shape)} {att.dtype}, cnn {tuple(cnn.shape)}")

    server.timing = True
    for k in ("encoder", "cfm", "ticks"):
        server.stats[k] = 0
    walls = []
    for _ in range(args.ticks):
        walls.append(prov.step(ids)[0] * 1e3)
    ticks = server.stats["ticks"]
    clocks = dict(enc_ms=server.stats["encoder"] * 1e3 / ticks, cfm_ms=server.stats["cfm"] * 1e3 / ticks,
                  tick_ms_p50=sorted(walls)[len(walls) // 2])
    print("server clocks per tick:", {k: round(v, 2) for k, v in clocks.items()}, flush=True)
    server.timing = False

    # the graph replay alone: the batch a steady tick builds, replayed under CUDA events
    rows = ids + [ids[0]] * (enc.padded(len(ids)) - len(ids))
    tokens = torch.cat([inputs.chunk(sid, 0) for sid in rows], 0)
    source, dest = enc.slots.index(rows), enc.slots.index(ids, len(rows))
    length, prompt = enc.slots.length(0), wl.prompt_frames
    times = []
    with torch.no_grad(), enc.autocast():
        for _ in range(3):
            enc.call(tokens, source, dest, length, prompt, False)
        for _ in range(10):
            times.append(timed(lambda: enc.call(tokens, source, dest, length, prompt, False), dev))
    replay_ms = sorted(times)[len(times) // 2]
    print(f"encoder call alone (batch {len(rows)}: gather, encoder, trimmed scatter; one in-place graph): "
          f"{replay_ms:.2f} ms", flush=True)

    labelled(enc, "call", "enc.graph")
    labelled(enc.slots, "index", "enc.index")
    labelled(server, "encoder", "enc.stage")
    labelled(server.cfm_server, "solve_chunk", "cfm")
    from torch.profiler import ProfilerActivity, profile

    prof_ticks = 3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(prof_ticks):
            prov.step(ids)
        if dev == "cuda":
            torch.cuda.synchronize()
    parts = {}
    for e in p.key_averages():
        if e.key.startswith("enc.") or e.key == "cfm":
            parts[e.key] = dict(cpu_ms=round(e.cpu_time_total / 1e3 / prof_ticks, 3),
                                gpu_ms=round(getattr(e, "device_time_total", 0) / 1e3 / prof_ticks, 3),
                                calls=e.count // prof_ticks)
    kern = []
    for e in p.key_averages():
        t = getattr(e, "self_device_time_total", 0)
        if t and str(getattr(e, "device_type", "")).endswith("CUDA"):
            kern.append(dict(kernel=e.key[:110], per_tick=e.count / prof_ticks, ms=round(t / 1e3 / prof_ticks, 3)))
    kern.sort(key=lambda r: -r["ms"])
    ops = []
    for e in p.key_averages():
        if e.key.startswith("aten::") and e.cpu_time_total > 0:
            ops.append(dict(op=e.key, per_tick=e.count / prof_ticks, cpu_ms=round(e.cpu_time_total / 1e3 / prof_ticks, 3),
                            gpu_ms=round(getattr(e, "device_time_total", 0) / 1e3 / prof_ticks, 3)))
    ops.sort(key=lambda r: -r["gpu_ms"])
    print("parts per tick:", json.dumps(parts, indent=1))
    print("top kernels per tick (whole tick, CFM included):")
    for k in kern[:25]:
        print(f"  {k['ms']:8.3f} ms  x{k['per_tick']:6.1f}  {k['kernel']}")
    print("top aten ops per tick by GPU time:")
    for o in ops[:20]:
        print(f"  gpu {o['gpu_ms']:8.3f} cpu {o['cpu_ms']:8.3f} ms x{o['per_tick']:6.1f} {o['op']}")
    out = dict(streams=args.streams, att_shape=list(att.shape), clocks=clocks, replay_ms=replay_ms, parts=parts,
               kernels=kern[:40], ops=ops[:40], **H.env_info())
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"encoder_profile_{args.streams}.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
