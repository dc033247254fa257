"""The vocoder convolution's operand copies through L1 (experiment; issue 43).

Triton turns the fused convolution's operand loads (``kernels/vocoder_conv.py``) into 16-byte
``cp.async.cg`` copies, which bypass L1: each of a layer's taps reads its shifted input rows from L2
again, and every program reads the layer's weights from L2 again. The ResBlock convolutions run at
the SMs' L2 ingest rate (``vocoder_conv_ncu.md``: 77-80 % L2 throughput). Triton picks
``cp.async.ca`` (cached in L1) only for copies narrower than 16 bytes; the variants here get it by
hiding the channel offsets' contiguity beyond 8 bytes (``(lane // VEC) * VEC + lane % VEC``: the
same offsets, 8-byte copies):

* ``shipped``: the kernel as it ships;
* ``ca_a``: the input rows through L1 (8-byte ``cp.async.ca``), the weights as shipped;
* ``ca_aw``: the input rows and the weights through L1.

Each variant is the shipped kernel's source with that one change (generated at run time, so it
follows the shipped kernel), swapped in for the shipped one while it is measured. Per tuning-table
key of one 64-stream decode (``bench/vocoder_tiles.py``'s recording, the table's tiles): outputs
against the shipped kernel's (the same products in the same order: bitwise equal expected), then
µs per decode's worth of the key's calls in a CUDA graph; then the whole decode per variant.

Measured on an H100 and dropped: ``vocoder_conv_l1.md`` (both variants 5-24 % slower per key, the decode
17.0 -> 19.1 / 20.4 ms).

    python3 bench/experiments/vocoder_conv_l1.py --out "$OUT"              # GPU
    python3 bench/experiments/vocoder_conv_l1.py --dry-run --out /tmp/l1   # CPU: interpreter, tiny HiFT
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [os.path.dirname(HERE), ROOT, os.path.join(ROOT, "tests")]

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported

import torch  # noqa: E402

import _harness as H  # noqa: E402

_CI = "        ci = (it % kb) * BLOCK_K + tl.arange(0, BLOCK_K)\n"
_A_MASK = "mask=row_ok[:, None] & ci_ok[None, :], other=0.0)\n"
_W_LOAD = "w = tl.trans(tl.load(w_ptr + ((ph * TAPS + m) * C_out + n)[:, None] * C_in + ci[None, :],"


def variant_source(name: str) -> str:
    """The shipped kernel module's source with variant ``name``'s change (ValueError if an anchor moved)."""
    with open(os.path.join(ROOT, "torch_cfm", "kernels", "vocoder_conv.py")) as f:
        src = f.read()
    for anchor in (_CI, _A_MASK, _W_LOAD, "from ._launch", "from .vocoder_"):
        if anchor not in src:
            raise ValueError(f"vocoder_conv_l1: the shipped kernel changed ({anchor.strip()!r} not found)")
    src = src.replace("from ._launch", "from torch_cfm.kernels._launch").replace(
        "from .vocoder_", "from torch_cfm.kernels.vocoder_")
    pairs = ("        lane = tl.arange(0, BLOCK_K)\n"  # the same offsets, contiguous in 8-byte runs
             "        VEC: tl.constexpr = 64 // x_ptr.dtype.element_ty.primitive_bitwidth\n"
             "        ci_pairs = (it % kb) * BLOCK_K + (lane // VEC) * VEC + lane % VEC\n")
    if name == "ca_a":  # the input rows' addresses through ci_pairs, the weights' through ci
        src = src.replace(_CI, _CI + pairs)
        src = src.replace("a = tl.load(x_row + idx[:, None] * C_in + ci[None, :]",
                          "a = tl.load(x_row + idx[:, None] * C_in + ci_pairs[None, :]")
    elif name == "ca_aw":
        src = src.replace(_CI, pairs + "        ci = ci_pairs\n")
    elif name != "shipped":
        raise ValueError(f"unknown variant {name!r}")
    return src


def load_variant(name: str, folder: str):
    """The variant's ``_vocoder_conv_kernel`` (a module written to ``folder`` and imported)."""
    path = os.path.join(folder, f"vocoder_conv_{name}.py")
    with open(path, "w") as f:
        f.write(variant_source(name))
    spec = importlib.util.spec_from_file_location(f"vocoder_conv_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look themselves up there
    spec.loader.exec_module(mod)
    return mod._vocoder_conv_kernel


def main() -> int:
    import vocoder_tiles as VTB

    import torch_cfm.kernels.vocoder_conv as VC
    from torch_cfm.kernels.vocoder_tiles import conv_tiles, layer_text

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default="tf32,fp16")
    ap.add_argument("--variants", default="shipped,ca_a,ca_aw")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--frames", type=int, default=58)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.dry_run:
        families, streams, frames, device, timer = ["ieee"], 1, 6, torch.device("cpu"), H.dry_run_timer
    else:
        families, streams, frames = args.families.split(","), args.streams, args.frames
        device, timer = torch.device("cuda"), H.time_cuda_graph
    folder = tempfile.mkdtemp(prefix="vocoder_conv_l1_")
    shipped = VC._vocoder_conv_kernel
    kernels = {v: (shipped if v == "shipped" else load_variant(v, folder)) for v in args.variants.split(",")}
    env, rows = H.env_info(), []
    timing = "dry_run" if args.dry_run else "cuda_graph"
    for fam in families:
        voc, mel, source = VTB.build(fam, streams, frames, args.dry_run, device)
        groups = VTB.record(voc, mel, source)
        refs = {}
        for variant, kernel in kernels.items():
            VC._vocoder_conv_kernel = kernel
            try:
                for key, calls in sorted(groups.items(), key=lambda kv: kv[0][1:]):
                    tiles = conv_tiles(key)
                    with torch.no_grad():
                        outs = VTB.replay(calls, tiles)
                    refs.setdefault(key, outs)
                    err = VTB.rel_to(outs, refs[key])

                    def run(calls=calls, tiles=tiles):
                        with torch.no_grad():
                            VTB.replay(calls, tiles)
                    t = timer(run, calls=3, repeats=args.repeats, warmup=2)
                    rows.append(H.make_row(env, op="vocoder_conv_l1", provider="torch_cfm", variant=variant,
                                           shape=dict(layer=layer_text(key), calls=len(calls), streams=streams,
                                                      frames=frames, tiles=tiles.name),
                                           dtype=fam, timing=timing, rel_err=err, **t))
                    print(f"{fam} {variant:8s} {layer_text(key):22s} x{len(calls):<2d} {tiles.name} "
                          f"{rows[-1]['us_p50']:9.1f} us  err {err:.1e}", flush=True)

                def decode():
                    with torch.no_grad():
                        voc.decode(mel, source)
                t = timer(decode, calls=2, repeats=args.repeats, warmup=2)
                rows.append(H.make_row(env, op="vocoder_conv_l1_decode", provider="torch_cfm", variant=variant,
                                       shape=dict(streams=streams, frames=frames), dtype=fam,
                                       timing=timing, **t))
                print(f"{fam} {variant:8s} decode {rows[-1]['us_p50'] / 1e3:.3f} ms", flush=True)
            finally:
                VC._vocoder_conv_kernel = shipped
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "vocoder_conv_l1.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
