"""The HiFT vocoder's decode at many streams: torch_cfm's HiFTVocoder against the upstream module.

op "vocoder_decode", shape {B, T, samples}: ``decode(mel, source)`` of B one-second chunks of
T = 58 mel frames (50 new + the 8 cached ones, as ``Token2wav.stream`` feeds the HiFT) and their
source excitation, replayed from one CUDA graph (``_harness.time_cuda_graph``; the upstream decode
made capturable by ``torch_cfm.models.hift_capturable.capturable``: the same math with a host-sync-free
inverse STFT). Providers:

* ``upstream_hift``: the package's ``HiFTGenerator.decode`` on the whole batch, precision "ieee"
  (fp32, cuDNN TF32 off: how vLLM-Omni runs it), "tf32" (PyTorch's default), "fp16" / "bf16"
  (CUDA autocast; its inverse STFT fed float32, so the error is the 16-bit convolutions');
* ``torch_cfm``: :class:`torch_cfm.models.vocoder.HiFTVocoder` in each precision; variants
  ``kernels`` (its default: the fused Triton convolutions at TF32 / 16-bit, cuDNN at IEEE),
  ``compiled`` (``torch.compile`` of its PyTorch math; slow to compile, ``--compiled`` picks the
  precisions), ``slab16`` (16-row slabs, how the library convolutions are made batch-invariant).

op "vocoder_forward": torch_cfm's whole per-tick step, ``HiFTVocoder.stream_chunk`` (f0 predictor,
per-stream source, cached source samples, decode, the overlap fade) at the default precision.

Inputs: the shipped HiFT sizes with the module's seeded random initialisation, ``conv_post``'s
log-magnitude bias raised so the waveform peaks near 0.8 (inside the ±0.99 clamp, so the error is
the decode's, not the clamp's); random mel; the source from a 100-250 Hz f0 contour with unvoiced
stretches (torch_cfm's HarmonicSource). ``rel_err`` / ``max_err``: against a float64 decode of the
same mel and source (the upstream module cast to float64). ``batch_invariant``: whether row 0 of
the batch equals that stream decoded alone, bitwise.

    BENCH_COMMIT=$(git rev-parse --short HEAD) python3 bench/vocoder.py --out "$OUT"     # ~2-3 min
    python3 bench/vocoder.py --quick --out "$OUT"                                          # ~40 s
    python3 bench/vocoder.py --dry-run --out /tmp/v                                        # CPU smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, os.path.join(ROOT, "tests"), ROOT]

import torch  # noqa: E402

import _harness as H  # noqa: E402

# the upstream HiFT made capturable (the same math, a host-sync-free inverse STFT)
from torch_cfm.models.hift_capturable import capturable  # noqa: E402

S = 480  # samples per mel frame
UPSTREAM_PRECISIONS = ("ieee", "tf32", "fp16", "bf16")


def build_hift(seed: int, device: torch.device, tiny: bool = False):
    """The shipped HiFTGenerator (random init; ``tiny``: the tests' tiny one)."""
    import upstream_flow as U

    U.load()
    hifigan = importlib.import_module("stepaudio2.flashcosyvoice.modules.hifigan")
    torch.manual_seed(seed)
    if tiny:
        import token2wav_reference as R

        hift = R.build_hift(seed=seed)
    else:
        hift = hifigan.HiFTGenerator().eval()
    hift = hift.to(device)
    hift.stft_window = hift.stft_window.to(device)
    return hift


def scale_output(hift, mel: torch.Tensor, source: torch.Tensor, peak: float = 0.8) -> None:
    """Add log(k) to conv_post's log-magnitude biases: every magnitude, hence the waveform, x k."""
    with torch.no_grad(), capturable(hift):
        top = hift.decode(x=mel, s=source).abs().max().item()
        hift.conv_post.bias[: hift.istft_params["n_fft"] // 2 + 1] += math.log(peak / top)


def make_inputs(hift, batch: int, frames: int, seed: int, device: torch.device):
    from torch_cfm.models.vocoder import HarmonicSource, stream_rng

    g = torch.Generator().manual_seed(seed)
    mel = torch.randn(batch, 80, frames, generator=g).to(device)
    f0 = 100 + 150 * torch.rand(batch, frames, generator=g)
    f0 = f0.cumsum(1) / torch.arange(1, frames + 1)  # a smooth-ish contour
    f0[:, frames // 3: frames // 3 + 6] = 0.0
    source, _ = HarmonicSource(hift.m_source).to(device)(f0.to(device), stream_rng(range(batch), device))
    return mel, source[:, None]


def upstream_call(hift, precision: str, mel, source):
    half = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)

    @contextlib.contextmanager
    def context():
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=precision == "tf32"), \
                torch.autocast("cuda", dtype=half or torch.float16, enabled=half is not None, cache_enabled=False):
            yield

    def run():
        with torch.no_grad(), capturable(hift, hift.stft_window):
            if half is not None:  # the inverse STFT in float32: the error measured is the 16-bit convolutions'
                inner = hift._istft
                hift._istft = lambda m, p: inner(m.float(), p.float())
            return hift.decode(x=mel, s=source)

    return run, context


def _timer(args):
    return H.dry_run_timer if args.dry_run else H.time_cuda_graph


def measure(fn, context, args, ref64, alone=None) -> dict:
    with context():
        out = fn()
    timing = _timer(args)(fn, calls=args.calls, repeats=args.repeats, warmup=2, context=context)
    fields = dict(timing, ms_p50=round(timing["us_p50"] / 1000, 3), rel_err=H.rel_err(out, ref64),
                  max_err=(out.double() - ref64).abs().max().item())
    if alone is not None:
        with context():
            fields["batch_invariant"] = bool(torch.equal(alone(), out[:1]))
    return fields


def run(args) -> list[dict]:
    from torch_cfm.models.vocoder import HiFTVocoder, stream_rng

    device = torch.device("cpu" if args.dry_run else "cuda")
    env = H.env_info()
    if args.run:
        env["run_id"] = args.run
    hift = build_hift(args.seed, device, tiny=args.dry_run)
    mel, source = make_inputs(hift, args.streams, args.frames, args.seed + 1, device)
    scale_output(hift, mel, source)
    h64 = copy.deepcopy(hift).double()
    h64.stft_window = h64.stft_window.double()
    with torch.no_grad(), capturable(h64, h64.stft_window):
        ref64 = h64.decode(x=mel.double(), s=source.double())
    del h64
    shape = {"B": args.streams, "T": args.frames, "samples": args.frames * S}
    rows: list[dict] = []

    def add(op, provider, variant, precision, t0, **fields):
        row = H.make_row(env, op=op, provider=provider, variant=variant, shape=shape, dtype="fp32",
                         precision=precision, timing="cpu_wall" if args.dry_run else "cuda_graph",
                         setup_s=round(time.time() - t0, 1),
                         peak=round(ref64.abs().max().item(), 3), **fields)
        rows.append(row)
        print(f"{op:15s} {provider:14s} {variant:9s} {precision:5s} {row.get('ms_p50') or 0:8.2f} ms  "
              f"rel_err {row.get('rel_err') or float('nan'):.2e}  {row.get('error') or ''}", flush=True)

    for precision in args.upstream.split(","):
        t0 = time.time()
        try:
            fn, ctx = upstream_call(hift, precision, mel, source)
            add("vocoder_decode", "upstream_hift", "autocast" if precision in ("fp16", "bf16") else "",
                precision, t0, **measure(fn, ctx, args, ref64))
        except Exception as exc:  # noqa: BLE001 - a failing provider still gets a row
            add("vocoder_decode", "upstream_hift", "", precision, t0, error=f"{type(exc).__name__}: {exc}"[:300])
    variants = [("kernels", p, {}) for p in args.precisions.split(",")]
    variants += [("compiled", p, {"compiled": True}) for p in args.compiled.split(",") if p]
    variants += [("slab16", p, {"slab_rows": 16}) for p in args.slab.split(",") if p]
    for variant, precision, options in variants:
        t0 = time.time()
        try:
            voc = HiFTVocoder(hift, precision=precision, **options)
            fn = lambda v=voc: v.decode(mel, source)  # noqa: E731
            # (a compiled decode would compile again for one row)
            alone = None if variant == "compiled" else (lambda v=voc: v.decode(mel[:1], source[:1]))  # noqa: E731
            add("vocoder_decode", "torch_cfm", variant, precision, t0, decision=voc.decision.describe(),
                **measure(fn, contextlib.nullcontext, args, ref64, alone))
        except Exception as exc:  # noqa: BLE001
            add("vocoder_decode", "torch_cfm", variant, precision, t0, error=f"{type(exc).__name__}: {exc}"[:300])
    t0 = time.time()
    try:
        voc = HiFTVocoder(hift)
        rng = stream_rng(range(args.streams), device)
        n = min(8 * S, args.frames * S // 2)  # Token2wav.stream's overlap (less in --dry-run's short chunks)
        cache, previous = source[:, :, :n].clone(), source[:, 0, -n:].clone()
        window = torch.hamming_window(2 * n, periodic=False, dtype=torch.float64, device=device)
        timing = _timer(args)(lambda: voc.stream_chunk(mel, rng, cache, previous, window), calls=args.calls,
                              repeats=args.repeats, warmup=2)
        add("vocoder_forward", "torch_cfm", "kernels", voc.decision.choice, t0,
            ms_p50=round(timing["us_p50"] / 1000, 3), **timing)
    except Exception as exc:  # noqa: BLE001
        add("vocoder_forward", "torch_cfm", "kernels", "auto", t0, error=f"{type(exc).__name__}: {exc}"[:300])
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--frames", type=int, default=58)
    ap.add_argument("--upstream", default=",".join(UPSTREAM_PRECISIONS), help="upstream precisions")
    ap.add_argument("--precisions", default="ieee,tf32,fp16,bf16", help="torch_cfm precisions (Triton kernels)")
    ap.add_argument("--compiled", default="tf32", help="torch_cfm precisions also timed compiled ('' = none; "
                    "each compile takes about a minute)")
    ap.add_argument("--slab", default="tf32", help="precisions also timed in 16-row slabs ('' = none)")
    ap.add_argument("--calls", type=int, default=3, help="decodes per captured graph")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run", default=None, help="run id (default: random)")
    ap.add_argument("--quick", action="store_true", help="16 streams, fp32 IEEE/TF32 + fp16, nothing compiled")
    ap.add_argument("--dry-run", action="store_true", help="tiny HiFT on the CPU, 2 streams (smoke test)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    if args.quick or args.dry_run:
        args.streams, args.repeats, args.calls = 16, 5, 2
        args.upstream, args.precisions, args.compiled, args.slab = "ieee,tf32", "ieee,tf32,fp16", "", "tf32"
    if args.dry_run:
        args.streams, args.frames, args.upstream, args.precisions = 2, 6, "ieee", "ieee,bf16"
    elif not torch.cuda.is_available():
        print("vocoder: needs CUDA (or --dry-run)")
        return 1
    rows = run(args)
    path = os.path.join(args.out, "vocoder.json")
    H.upsert_rows(path, rows, table=False, identity=H.IDENTITIES["vocoder"])
    print()
    print("| provider | variant | precision | ms (p50) | rel err vs fp64 | max err | batch-invariant |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["op"] != "vocoder_decode":
            continue
        ms = r.get("error") or r.get("ms_p50")
        print(f"| {r['provider']} | {r['variant']} | {r['precision']} | {ms} | "
              f"{r.get('rel_err') or float('nan'):.2e} | {r.get('max_err') or float('nan'):.2e} | "
              f"{r.get('batch_invariant', '')} |")
    print(f"\nrows: {path}; command: python3 bench/vocoder.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
