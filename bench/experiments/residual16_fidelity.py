"""Issue 41: the fused body with a 16-bit residual stream, its whole-stream accuracy before any kernel.

Why: at 64 streams the row-norm boundaries take 8.4 ms of a ~42 ms H100 tick at HBM rate, and two
thirds of their bytes are the float32 residual stream ``h`` (read and written at three boundaries a
block). Kept in fp16 it would move half the bytes (about 45 -> 32 MB a boundary at 6,400 rows, a
third of the row-norm time), and it would make the CUTLASS fold of the boundary pay
(``cutlass_residual_rowstats.md``). Issue 41's bar: whole-stream fp16 fidelity no worse than
today's fused path. This measures the question on the CPU.

How: one stream as ``Token2wav.stream`` drives the decoder (the workload of ``fp8_fidelity.py``:
a 300-frame prompt solve, then 8 chunks of 50 frames, 10 Euler steps with CFG 0.7, the trim to
prompt + 100 frames), solved as the server solves on the GPU: the fused stepper (float32 Euler
state, the staged input updated in place) with the body on its reference,
:func:`torch_cfm.reference.dit_body.dit_body_reference` (the fused kernels' numerics: GEMMs in the
compute dtype, LayerNorm, modulation, tap sums and the residual stream in float32), its
``residual`` rounding switched per run. Runs, each against the float64 run of the same path: fp16 with the float32 residual
(what ships), fp16 with an fp16 residual, fp16 with a bf16 residual; the upstream fp16 module's
error on the same workload is read from ``fp8_fidelity.json`` when present (same seed).

    python3 bench/experiments/residual16_fidelity.py [--quick] [--out FILE.json]

About 7 minutes on 2 CPU threads at the shipped sizes (``--quick``: a tiny config, under a minute).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import fp8_fidelity as F  # noqa: E402  (its workload, stream driver pieces and error summary)
from torch_cfm.models import DiT, DiTConfig  # noqa: E402
from torch_cfm.solve import StreamingCFM  # noqa: E402
from torch_cfm.reference.dit_body import dit_body_reference  # noqa: E402
from torch_cfm.solve import steppers  # noqa: E402


RUNS = {  # name -> (compute dtype, residual dtype; None = the float32 stream that ships)
    "fused fp16, float32 residual (ships)": (torch.float16, None),
    "fused fp16, fp16 residual": (torch.float16, torch.float16),
    "fused fp16, bf16 residual": (torch.float16, torch.bfloat16),
}


def _body_into(residual):
    """``kernels.dit_body.dit_body_fused_into`` on the reference (the fused kernels' numerics, the
    residual stream rounded to ``residual``), writing into ``out`` as the Triton driver does."""
    def body_into(x_in, weights, mod_table, cnn_cache, att_cache, valid_lengths, cache_lengths, precision, out,
                  plan=None):
        for o, r in zip(out, dit_body_reference(x_in, list(weights), mod_table, cnn_cache, att_cache, valid_lengths,
                                                cache_lengths, residual=residual)):
            o.copy_(r)
        return out
    return body_into


def _cfg_euler(x, v, staged, dt, cfg_rate):
    """``kernels.cfg_euler.cfg_euler`` in torch: the float32 state's guided Euler step, staged for both halves."""
    b, cm = x.shape[:2]
    x += dt * ((1.0 + cfg_rate) * v[:b].float() - cfg_rate * v[b:].float())
    staged[:b, :cm] = x.to(staged.dtype)
    staged[b:, :cm] = x.to(staged.dtype)


def run_stream(master: DiT, dtype: torch.dtype, residual, w: "F.Workload"):
    """(prompt mel, [chunk mels], cache lengths) of the stream through the fused stepper (float32
    Euler state, staged input) on the reference body in ``dtype``, the residual stream rounded to
    ``residual`` (None: float32)."""
    import torch_cfm.kernels.dit_body as K

    model = copy.deepcopy(master).to(dtype)
    solo = F.Solo(StreamingCFM(model, n_timesteps=F.N_STEPS, cfg_rate=F.CFG_RATE, noise=w.noise),
                  w.spks.to(dtype), w.prompt_frames)
    saved = steppers.fused_precision, K.dit_body_fused_into, K.cfg_euler
    steppers.fused_precision = lambda *args: "ieee" if dtype != torch.float16 else ""  # the policy: no fused CPU
    K.dit_body_fused_into, K.cfg_euler = _body_into(residual), _cfg_euler
    try:
        prompt_mel = solo.chunk(w.prompt_mu.to(dtype), w.prompt_mel.to(dtype))
        mels, lengths = [], []
        for mu in w.chunks:
            mels.append(solo.chunk(mu.to(dtype)))
            lengths.append(solo.att.shape[-2])
    finally:
        steppers.fused_precision, K.dit_body_fused_into, K.cfg_euler = saved
    return prompt_mel.double(), [m.double() for m in mels], lengths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    F.workload_args(ap)
    ap.add_argument("--out", default=os.path.join(HERE, "residual16_fidelity.json"))
    args = ap.parse_args()

    cfg = DiTConfig(hidden=64, depth=2, heads=4, head_dim=16) if args.quick else DiTConfig()
    prompt = args.prompt if args.prompt is not None else (150 if args.quick else 300)
    w = F.make_workload(prompt, args.chunks, args.chunk, args.seed)
    master = DiT(cfg).random_init_(args.seed + 2)  # fp8_fidelity's (the upstream estimator's) weights
    setup = {"config": dataclasses.asdict(cfg), "prompt_frames": prompt, "chunks": args.chunks,
             "chunk_frames": args.chunk, "n_timesteps": F.N_STEPS, "cfg_rate": F.CFG_RATE, "seed": args.seed,
             "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine()}
    start = time.perf_counter()
    ref = run_stream(master, torch.float64, None, w)
    rows = {"fused fp64 (reference)": {"seconds": round(time.perf_counter() - start, 1)}}
    print(f"reference: {rows['fused fp64 (reference)']['seconds']} s", flush=True)
    for name, (dtype, residual) in RUNS.items():
        start = time.perf_counter()
        row = F.errors(run_stream(master, dtype, residual, w), ref)
        row["seconds"] = round(time.perf_counter() - start, 1)
        rows[name] = row
        print(f"{name}: stream {row['stream_rel_l2']:.3e}, worst chunk {row['worst_chunk_rel_l2']:.3e}, "
              f"prompt {row['prompt_rel_l2']:.3e} ({row['seconds']} s)", flush=True)
    base = rows["fused fp16, float32 residual (ships)"]["stream_rel_l2"]
    for name in RUNS:
        rows[name]["x_ships"] = rows[name]["stream_rel_l2"] / base
    upstream = os.path.join(HERE, "fp8_fidelity.json")
    if os.path.exists(upstream):  # the upstream fp16 module on the same workload, when the setups agree
        with open(upstream) as fh:
            fp8 = json.load(fh)
        if all(fp8.get(k) == setup[k] for k in ("config", "prompt_frames", "chunks", "chunk_frames", "seed")):
            up = fp8["rows"].get("upstream fp16", {}).get("stream_rel_l2")
            setup["upstream_fp16_stream_rel_l2"] = up
            print(f"upstream fp16 module (fp8_fidelity.json): stream {up:.3e}")
    with open(args.out, "w") as fh:
        json.dump({**setup, "rows": rows}, fh, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
