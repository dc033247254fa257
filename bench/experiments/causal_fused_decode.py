"""The causal HiFT decode: the model's own (cuDNN) against the fused one (issues 40, 43).

:class:`~torch_cfm.models.vocoder.causal_decode.FusedCausalDecode` runs ``CausalHiFTGenerator``'s
decode on the HiFT vocoder's fused Triton convolutions (its module docstring). ``--check``
compares it with the upstream's float32 decode against a float64 one (CPU: Triton's
interpreter, tiny sizes); the GPU run times a steady 86-frame decode (history + chunk +
lookahead) at B streams from CUDA graphs, cuDNN under ``capturable_causal`` against the fused
one at TF32 and fp16, then a whole steady chunk (``CausalVocoderCore.run``) with each decode,
then each decode's error against float64 by model width (``errors_by_width``), and writes
``causal_fused_decode.json`` (the committed run: ``bench/experiments/causal_fused_decode.json``).

    STEPAUDIO2_PATH=.upstream/minicpmo-utils TRITON_INTERPRET=1 python3 bench/experiments/causal_fused_decode.py --check
    STEPAUDIO2_PATH=.upstream/minicpmo-utils python3 bench/experiments/causal_fused_decode.py --out "$OUT"
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [HERE, os.path.dirname(HERE), os.path.join(ROOT, "tests"), ROOT]

import torch  # noqa: E402

from oracle import err_rel_fro as _err  # noqa: E402  (tests/oracle.py: relative Frobenius error)
from torch_cfm.models.vocoder.causal_decode import FusedCausalDecode  # noqa: E402


def check(mods, P) -> dict:
    """Tiny sizes on the CPU: the fused decode (IEEE and TF32 operands) and the upstream's float32
    decode, each against the upstream's float64 decode, finalizing and not."""
    model = P.build_causal_hift(mods, seed=1, **P.TINY_CAUSAL)
    exact = copy.deepcopy(model).double()
    gen = torch.Generator().manual_seed(3)
    mel = torch.randn(2, 80, 24, generator=gen)
    source = torch.randn(2, 1, 24 * 480, generator=gen) * 0.1
    rows = {}
    for finalize in (True, False):
        with torch.no_grad():
            ref64 = exact.decode(mel.double(), source.double(), finalize=finalize)
            up32 = model.decode(mel, source, finalize=finalize)
        row = dict(upstream_fp32=_err(up32, ref64), shape=list(ref64.shape))
        for prec in ("ieee", "tf32"):
            out = FusedCausalDecode(model, precision=prec, kernels="triton").decode(mel, source, finalize)
            assert out.shape == ref64.shape, (prec, finalize, out.shape, ref64.shape)
            row[prec] = _err(out, ref64)
        rows[f"finalize={finalize}"] = row
        print(f"finalize={finalize}: error vs float64 {row}", flush=True)
    ok = all(r["ieee"] <= 2 * r["upstream_fp32"] + 1e-6 for r in rows.values())
    print("ieee within 2x the upstream fp32 error + 1e-6:", ok)
    return dict(rows=rows, ieee_within_bound=ok)


def timing(mods, P, batches: list[int], out: str) -> None:
    import _harness as H
    from torch_cfm.models.vocoder.causal import CausalModelParts, capturable_causal

    dev = torch.device("cuda")
    model = P.build_causal_hift(mods, seed=1, **P.SHIPPED_CAUSAL).to(dev)
    exact = copy.deepcopy(model).double()
    parts = CausalModelParts.of(model)
    window = model.stft_window.to(dev)
    fused = {p: FusedCausalDecode(model, precision=p) for p in ("tf32", "fp16")}
    rows = []
    for b in batches:
        gen = torch.Generator(device=dev).manual_seed(b)
        mel = torch.randn(b, 80, 86, generator=gen, device=dev)
        source = torch.randn(b, 1, 86 * 480, generator=gen, device=dev) * 0.1
        with torch.no_grad():
            ref64 = exact.decode(mel.double(), source.double(), finalize=False)

        def today():
            with capturable_causal(model, window, parts):
                return model.decode(mel, source, finalize=False)

        candidates = {"cudnn_tf32": today, **{f"fused_{p}": (lambda f=f: f.decode(mel, source, False))
                                              for p, f in fused.items()}}
        for name, fn in candidates.items():
            with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, allow_tf32=True):
                t = H.time_cuda_graph(fn, calls=2, repeats=9, warmup=2)
                err = _err(fn(), ref64)
            row = dict(H.env_info(), op="causal_fused_decode", B=b, frames=86, variant=name,
                       ms=round(t["us_p50"] / 1e3, 3), rel_err_vs_fp64=err)
            rows.append(row)
            print({k: row[k] for k in ("B", "variant", "ms", "rel_err_vs_fp64")}, flush=True)
    rows += chunk_timing(mods, P, model, fused["tf32"], batches)
    rows += errors_by_width(mods, P)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "causal_fused_decode.json"), "w") as f:
        json.dump(rows, f, indent=1)


def errors_by_width(mods, P, widths=(16, 64, 512)) -> list[dict]:
    """One 86-frame decode per model width (``base_channels`` = ``f0_channels``): the upstream's
    at cuDNN TF32 and at IEEE float32, and the fused one at TF32, each against float64. Whether a
    narrow layer runs on cuDNN's tensor cores at all decides how much of the upstream's "TF32"
    error is TF32's: the fused convolutions round every layer's operands."""
    import _harness as H

    dev = torch.device("cuda")
    rows = []
    for width in widths:
        model = P.build_causal_hift(mods, seed=1, base_channels=width, f0_channels=width).to(dev)
        gen = torch.Generator(device=dev).manual_seed(width)
        mel = torch.randn(1, 80, 86, generator=gen, device=dev)
        source = torch.randn(1, 1, 86 * 480, generator=gen, device=dev) * 0.1
        with torch.no_grad():
            ref64 = copy.deepcopy(model).double().decode(mel.double(), source.double(), finalize=False)
            row = dict(H.env_info(), op="causal_fused_error", width=width, B=1, frames=86)
            for name, tf32 in (("upstream_tf32", True), ("upstream_ieee", False)):
                with torch.backends.cudnn.flags(enabled=True, allow_tf32=tf32):
                    row[name] = _err(model.decode(mel, source, finalize=False), ref64)
            row["fused_tf32"] = _err(FusedCausalDecode(model, precision="tf32").decode(mel, source, False), ref64)
        row["fused_over_upstream_tf32"] = row["fused_tf32"] / row["upstream_tf32"]
        rows.append(row)
        print({k: v for k, v in row.items() if k == "width" or "tf32" in k or "ieee" in k}, flush=True)
    return rows


def chunk_timing(mods, P, model, fused: FusedCausalDecode, batches: list[int]) -> list[dict]:
    """A whole steady 50-frame chunk (``CausalVocoderCore.run``: f0, source, decode) at B streams
    from CUDA graphs, its decode the model's (cuDNN) and then the fused one (``core.fused``)."""
    import _harness as H
    from causal_vocoder_profile import steady_chunk
    from torch_cfm.models.vocoder.causal import CausalVocoderCore

    dev = torch.device("cuda")
    core = CausalVocoderCore(mods.BoundedVocoder(model), decoder="upstream")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    with torch.no_grad():
        state, plan = steady_chunk(core, gen)
        for b in batches:
            mel, source, phase = (state[k].expand(b, *state[k].shape[1:]).contiguous()
                                  for k in ("mel", "source", "phase"))
            chunk = torch.randn(b, 80, 50, device=dev, generator=gen)
            base = torch.zeros(b, dtype=torch.int64, device=dev)
            outs = {}
            for name in ("today", "fused_tf32"):
                core.fused = None if name == "today" else fused
                with torch.backends.cudnn.flags(enabled=True, allow_tf32=True):
                    t = H.time_cuda_graph(lambda: core.run(plan, mel, source, phase, chunk, base), calls=2,
                                          repeats=9, warmup=2)
                    outs[name] = core.run(plan, mel, source, phase, chunk, base)[0]
                row = dict(H.env_info(), op="causal_fused_chunk", B=b, frames=50, variant=name,
                           ms=round(t["us_p50"] / 1e3, 3))
                if name != "today":
                    row["rel_diff_vs_today"] = _err(outs[name], outs["today"])
                rows.append(row)
                print({k: row.get(k) for k in ("B", "variant", "ms", "rel_diff_vs_today")}, flush=True)
            core.fused = None
    return rows


def main() -> int:
    import upstream_packages as P

    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="CPU, tiny sizes, Triton's interpreter")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    mods = P.load_minicpmo_token2wav()
    if args.check:
        result = check(mods, P)
        return 0 if result["ieee_within_bound"] else 1
    if not args.out:
        ap.error("--out is required for the GPU timing")
    timing(mods, P, [int(b) for b in args.batches.split(",")], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
