"""The steady CFM tick under two (or more) kernel choices, timed in one process (experiments; issue 41).

Each side builds its own ``CFMServer(graphs=True)`` at ``streams`` streams (``bench/dit_step.settled_server``: caches
settled at 450 frames, 50-frame chunks, 10 steps, fp16) inside its context (a patched rule, a ``use_plan`` block),
so its graphs are captured with that side's kernels; the sides are then timed alternately over rounds (CUDA events,
median of ``repeats`` replays a round) and their mels compared.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
from typing import Callable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]

import torch  # noqa: E402

import dit_step as D  # noqa: E402


def tick_ab(streams: int, sides: dict[str, Optional[Callable[[], contextlib.AbstractContextManager]]], base,
            rounds: int = 3, repeats: int = 15) -> dict:
    """{side: median ms a tick, "rounds_ms": {side: [ms a round]}, "max_rel_diff": {side: vs the first side}}."""
    dtype = torch.float16
    built = {}
    for side, ctx in sides.items():
        model = copy.deepcopy(base).to(device=D.DEVICE, dtype=dtype)
        g = torch.Generator().manual_seed(2)
        with torch.no_grad(), (ctx() if ctx is not None else contextlib.nullcontext()):
            built[side] = D.settled_server(model, dtype, streams, 50, 450, 10, g)
    args = argparse.Namespace(repeats=repeats)
    ms = {s: [] for s in built}
    with torch.no_grad():
        for _ in range(rounds):
            for side, (server, chunks) in built.items():
                ms[side].append(D.time_replay(lambda: server.solve_chunk(chunks), args)["us_p50"] / 1000)
        outs = {side: server.solve_chunk(chunks) for side, (server, chunks) in built.items()}
    first = next(iter(outs))
    diffs = {side: max(((outs[first][r].float() - o[r].float()).norm() / outs[first][r].float().norm()).item()
                       for r in o) for side, o in outs.items() if side != first}
    del built
    if D.DEVICE == "cuda":
        torch.cuda.empty_cache()
    out = {side: round(sorted(v)[len(v) // 2], 3) for side, v in ms.items()}
    return dict(out, streams=streams, rows=2 * streams, rounds_ms={s: [round(x, 3) for x in v] for s, v in ms.items()},
                max_rel_diff=diffs)
