"""Where the vocoder's time goes at many streams (experiment; not a shipped benchmark).

Times ``HiFTVocoder.decode`` / ``stream_chunk`` at B streams x 58 frames under CUDA graphs for
slab sizes and precisions, then profiles one eager decode: CUDA time per convolution shape and the
top kernels. Writes ``vocoder_profile.json`` under --out.

    python3 bench/experiments/vocoder_profile.py --streams 64 --out "$OUT"
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests"),
                os.path.dirname(os.path.dirname(HERE))]

import torch  # noqa: E402

import _harness as H  # noqa: E402
import vocoder as V  # noqa: E402


def profile(fn, top: int = 25) -> dict:
    from torch.profiler import ProfilerActivity, profile as prof

    fn()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as p:
        fn()
        torch.cuda.synchronize()
    ops = []
    for e in p.key_averages(group_by_input_shape=True):
        if e.key in ("aten::conv2d", "aten::conv_transpose2d", "aten::cat", "aten::copy_", "aten::mm",
                     "aten::bmm", "aten::matmul", "aten::clone", "aten::contiguous"):
            ops.append(dict(op=e.key, shapes=str(e.input_shapes)[:160], count=e.count,
                            cuda_ms=round(getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) / 1e3, 3)))
    ops.sort(key=lambda r: -r["cuda_ms"])
    kern = []
    for e in p.key_averages():
        t = getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
        if t and e.device_type.name == "CUDA" if hasattr(e, "device_type") else t:
            kern.append(dict(kernel=e.key[:120], count=e.count, ms=round(t / 1e3, 3)))
    kern.sort(key=lambda r: -r["ms"])
    total = round(sum(k["ms"] for k in kern), 3)
    return dict(ops=ops[:top], kernels=kern[:top], kernel_ms_total=total, kernel_count=sum(k["count"] for k in kern))


def layer_times(fn) -> list[dict]:
    """Each fused convolution of one eager ``fn()`` timed alone (synchronised around its launch,
    so small layers carry the launch and a sync): ms and TFLOP/s per layer shape (C_in, C_out,
    taps, dilation, stride, transposed, B x L_out)."""
    import time

    import torch_cfm.kernels.vocoder_conv as VC

    inner, rows = VC.conv_fused_triton, {}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def timed(conv, x, **kw):
        sync()
        t0 = time.perf_counter()
        out = inner(conv, x, **kw)
        sync()
        ms = (time.perf_counter() - t0) * 1e3
        ref = out[0] if out[0] is not None else out[1][0]
        key = (conv.c_in, conv.c_out, conv.ksize, conv.dilation, conv.stride, conv.transposed, ref.shape[0],
               ref.shape[1])
        row = rows.setdefault(key, dict(c_in=conv.c_in, c_out=conv.c_out, taps=conv.ksize, dilation=conv.dilation,
                                        stride=conv.stride, transposed=conv.transposed, batch=ref.shape[0],
                                        frames_out=ref.shape[1], calls=0, ms=0.0))
        row["calls"] += 1
        row["ms"] += ms
        return out

    fn()
    VC.conv_fused_triton = timed
    try:
        fn()
    finally:
        VC.conv_fused_triton = inner
    for row in rows.values():
        taps = row["taps"] / row["stride"] if row["transposed"] else row["taps"]  # taps per output, on average
        flop = 2.0 * row["batch"] * row["frames_out"] * row["c_out"] * row["c_in"] * taps * row["calls"]
        row["ms"] = round(row["ms"], 3)
        row["tflops"] = round(flop / row["ms"] / 1e9, 1)
    out = sorted(rows.values(), key=lambda r: -r["ms"])
    for row in out:
        print("  layer", row, flush=True)
    return out


def main() -> int:
    from torch_cfm.models.vocoder import HiFTVocoder, stream_rng

    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", default="16,64")
    ap.add_argument("--frames", type=int, default=58)
    ap.add_argument("--out", required=True)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--layers", action="store_true", help="ms and TFLOP/s per fused convolution (eager, events)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    hift = V.build_hift(0, dev)
    result = dict(env=H.env_info(), rows=[], profiles={})
    for b in [int(s) for s in args.streams.split(",")]:
        mel, source = V.make_inputs(hift, b, args.frames, 1, dev)
        V.scale_output(hift, mel, source)
        ref = None
        configs = [("tf32", None, "auto"), ("tf32", 4, "torch"), ("tf32", None, "torch"), ("fp16", None, "auto"),
                   ("fp16", None, "torch"), ("ieee", None, "torch")]
        for prec, slab, kern in configs:
            voc = HiFTVocoder(hift, precision=prec, slab_rows=slab, kernels=kern)
            t = H.time_cuda_graph(lambda: voc.decode(mel, source), calls=2, repeats=7, warmup=2)
            out = voc.decode(mel, source)
            ref = out.double() if ref is None and prec == "ieee" else ref
            print(prec, slab, kern, voc.fused_convs, round(t["us_p50"] / 1e3, 3), "ms", flush=True)
            row = dict(op="decode", B=b, precision=prec, slab=slab, kernels=kern, fused=voc.fused_convs,
                       ms=round(t["us_p50"] / 1e3, 3), out=out)
            if slab is None and prec != "ieee" and kern == "auto":
                rng = stream_rng(range(b), dev)
                n = 8 * V.S
                cache, prev = source[:, :, :n].clone(), source[:, 0, -n:].clone()
                win = torch.hamming_window(2 * n, periodic=False, dtype=torch.float64, device=dev).float()
                t2 = H.time_cuda_graph(lambda: voc.stream_chunk(mel, rng, cache, prev, win), calls=2, repeats=7,
                                       warmup=2)
                row["stream_chunk_ms"] = round(t2["us_p50"] / 1e3, 3)
                if args.profile and b == max(int(s) for s in args.streams.split(",")):
                    result["profiles"][f"{prec}_B{b}"] = profile(lambda: voc.decode(mel, source))
                if args.layers and voc.fused_convs:
                    result.setdefault("layers", {})[f"{prec}_B{b}"] = layer_times(lambda: voc.decode(mel, source))
            result["rows"].append(row)
        for row in result["rows"]:
            out = row.pop("out", None)
            if out is not None:
                row["rel_vs_ieee"] = float((out.double() - ref).norm() / ref.norm())
                print(row, flush=True)
        fn, ctx = V.upstream_call(hift, "tf32", mel, source)
        t = H.time_cuda_graph(fn, calls=2, repeats=7, warmup=2, context=ctx)
        result["rows"].append(dict(op="decode", B=b, precision="tf32", provider="upstream", ms=round(t["us_p50"] / 1e3, 3)))
        print(result["rows"][-1], flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "vocoder_profile.json"), "w") as f:
        json.dump(result, f, indent=1)
    for k, p in result["profiles"].items():
        print("==", k, "kernels", p["kernel_count"], "ms", p["kernel_ms_total"])
        for r in p["ops"][:14]:
            print("  ", r)
        for r in p["kernels"][:12]:
            print("  ", r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
