"""Host-side launches of a tokens -> waveform tick, per stage (experiment; issue 43; no GPU needed).

On CUDA every stage of ``Token2wavServer`` replays CUDA graphs, and around them runs eager work:
per-stream concatenations, state copies, slicing. Each eager ATen op that touches a tensor is a
kernel launch plus the dispatcher's host time (several µs each on CUDA). Where a stage's eager ops
run before its graph (or after a sync) the GPU waits for them.

This counts them on the CPU (``tests/launch_census.py``): the server runs the tiny modules eagerly,
an ATen dispatch mode counts every op per stage ("tick": the step's own work around the stages),
and the functions that are CUDA graphs on a GPU (the CFM's whole solve, the encoder's slot call,
the vocoder's chunk call) count as one replay each, their insides not counted. The chunks' tokens
are int32, as the serving bench feeds them.

    python3 bench/experiments/host_ops_census.py --streams 16,64 [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [os.path.dirname(HERE), ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402

from launch_census import OpCensus, instrument  # noqa: E402


def census_at(streams: int, ticks: int) -> dict:
    import serving as S
    import upstream_flow as U
    import token2wav_reference as R
    from torch_cfm.models.cache import TRIM_KEEP_OLDEST
    from torch_cfm.serving import StreamPrompt, Token2wavServer

    torch.manual_seed(0)
    wl = S.Workload(prompt_tokens=10, chunk_tokens=28, prompt_mix=(), chunks=ticks + 2, n_steps=2, ticks=ticks,
                    warm_ticks=1)
    flow = U.build_flow(U.TINY, seed=0)
    if U.TINY.buffer_frames < wl.prompt_frames + TRIM_KEEP_OLDEST + wl.chunk_frames:
        U.resize_scratch_buffers(flow, wl.prompt_frames + TRIM_KEEP_OLDEST + wl.chunk_frames)
    hift = R.build_hift(seed=0)
    inputs = S.Inputs(U.TINY, wl, "cpu", torch.float32, voices=4)
    server = Token2wavServer(flow, hift, max_streams=streams, max_prompt_frames=wl.prompt_frames,
                             max_chunk_tokens=wl.chunk_tokens, n_timesteps=wl.n_steps, dtype=torch.float32)
    census = OpCensus()
    instrument(server, census)
    ids = list(range(streams))
    server.open_many({sid: StreamPrompt(p.tokens, p.mel, p.spk, sid) for sid in ids for p in [inputs.prompt(sid)]})
    with torch.no_grad():
        server.step({sid: inputs.chunk(sid, 0) for sid in ids})  # the first chunk (no vocoder history)
        with census:
            for k in range(ticks):
                server.step({sid: inputs.chunk(sid, k + 1) for sid in ids})
    return census.report(ticks)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", default="16,64")
    ap.add_argument("--ticks", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    result = {}
    for c in (int(s) for s in args.streams.split(",")):
        result[c] = census_at(c, args.ticks)
        for stage, d in result[c].items():
            print(f"streams {c:3d} {stage:8s} ops/tick {d['ops_per_tick']:7.1f}  views {d['views_per_tick']:7.1f}  "
                  f"replays {d['replays_per_tick']:5.1f}  top {d['top_ops_per_tick']}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host_ops_census.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
