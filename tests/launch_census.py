"""ATen ops a ``Token2wavServer`` tick runs outside its CUDA graphs, per stage (tests and
``bench/experiments/host_ops_census.py``).

On a GPU each such op is a kernel launch plus dispatcher time on the host; a stage built for many
streams runs a fixed handful around its graph replays, not some per stream. On the CPU the server
runs eagerly, so the functions that are CUDA graphs on a GPU are wrapped to count as one replay
each, their insides not counted.
"""

from __future__ import annotations

import collections

from torch.utils._python_dispatch import TorchDispatchMode

VIEWS = frozenset({"view", "_unsafe_view", "slice", "select", "unsqueeze", "squeeze", "transpose", "t", "permute",
                   "expand", "as_strided", "narrow", "alias", "detach", "split", "unbind", "lift_fresh"})


class OpCensus(TorchDispatchMode):
    """Counts ATen ops per (stage, op) while a stage is current and no graph body runs; views
    (no kernel) apart."""

    def __init__(self) -> None:
        super().__init__()
        self.stage, self.depth = None, 0
        self.ops: collections.Counter = collections.Counter()
        self.views: collections.Counter = collections.Counter()
        self.replays: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.stage is not None and self.depth == 0:
            name = func.overloadpacket.__name__
            (self.views if name in VIEWS else self.ops)[(self.stage, name)] += 1
        return func(*args, **(kwargs or {}))

    def graph_body(self, fn):
        """``fn`` as a CUDA graph runs it: one replay, its ops not counted."""
        def wrapped(*args, **kwargs):
            if self.stage is not None and self.depth == 0:
                self.replays[self.stage] += 1
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
        return wrapped

    def staged(self, stage: str, fn):
        """``fn`` with its ops counted under ``stage``."""
        def wrapped(*args, **kwargs):
            saved, self.stage = self.stage, stage
            try:
                return fn(*args, **kwargs)
            finally:
                self.stage = saved
        return wrapped

    def per_stage(self) -> dict[str, int]:
        """{stage: ops counted} (views apart)."""
        out: collections.Counter = collections.Counter()
        for (stage, _), n in self.ops.items():
            out[stage] += n
        return dict(out)

    def report(self, ticks: int) -> dict[str, dict]:
        """Per stage and tick: ops, views, replays and the most frequent ops."""
        out: dict[str, dict] = {}
        for stage, ops in self.per_stage().items():
            top = sorted(((name, n) for (st, name), n in self.ops.items() if st == stage), key=lambda kv: -kv[1])
            views = sum(n for (st, _), n in self.views.items() if st == stage)
            out[stage] = {"ops_per_tick": round(ops / ticks, 1), "views_per_tick": round(views / ticks, 1),
                          "replays_per_tick": round(self.replays[stage] / ticks, 1),
                          "top_ops_per_tick": {name: round(n / ticks, 1) for name, n in top[:8]}}
        return out


class _Stage:
    """A stage with its ``__call__`` replaced (the server calls ``self.encoder(items)``)."""

    def __init__(self, stage, call) -> None:
        self._stage, self._call = stage, call

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._stage, name)


def instrument(server, census: OpCensus) -> None:
    """Count ``server``'s stages (encoder, cfm, vocoder, and "tick": the step's own work around them)
    into ``census``, each graphed call (the encoder's slot and ragged calls, the CFM's whole solve,
    the vocoder's calls) as one replay."""
    server.step = census.staged("tick", server.step)  # what no stage below runs
    enc = server.encoder
    enc.call, enc.ragged_call = census.graph_body(enc.call), census.graph_body(enc.ragged_call)
    server.encoder = _Stage(enc, census.staged("encoder", enc.__call__))
    cfm = server.cfm_server
    cfm.solver = _Stage(cfm.solver, census.graph_body(cfm.solver.__call__))
    cfm.solve_chunk = census.staged("cfm", cfm.solve_chunk)
    voc = server.vocoder
    if voc is not None:
        for name in ("call", "f0_call", "decode_call", "source_call"):
            if getattr(voc, name, None) is not None:
                setattr(voc, name, census.graph_body(getattr(voc, name)))
        server.vocoder = _Stage(voc, census.staged("vocoder", voc.__call__))


__all__ = ["OpCensus", "instrument", "VIEWS"]
