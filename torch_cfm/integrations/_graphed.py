"""Replay a function of tensors from CUDA graphs, one graph per input signature, checked once.

:class:`GraphedCall` wraps a callable (e.g. an upstream module's bound ``forward_chunk``) whose
work depends only on its tensor arguments' values and on python values that are part of the
signature (shapes, dtypes, ``None``-ness, scalars, the autocast state, the TF32 flags). Per signature: the first
``warmup`` calls run eagerly; the next call runs eagerly too (its result is returned), captures
the function over static copies of the inputs, replays the graph on the call's inputs and
compares the replay with the eager result; only a capture that succeeds and matches (relative
Frobenius error within the dtype's bound, same structure, shapes, dtypes and finiteness) is
kept. Later calls copy their inputs into the static ones, replay, and return copies of the
outputs. Anything else (CPU tensors, autograd, a failed or mismatching capture) runs eagerly,
so the wrapper never changes results beyond the check's bound; ``events`` says what happened.

``random=True`` is for functions that draw from the device's default CUDA generator: the check
replays from the generator state the eager call started from (a replay reads the generator's
seed and offset when it starts and advances it by the captured draws, as the eager kernels do),
so only a graph that reproduces the eager random stream is kept; the generator is then left as
the eager call left it.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

log = logging.getLogger("torch_cfm.integrations")

_CHECK_REL = {torch.float16: 1e-2, torch.bfloat16: 2e-2}  # default (fp32 / fp64): 1e-4


def _map(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(_map(o, fn) for o in obj)
    if isinstance(obj, list):
        return [_map(o, fn) for o in obj]
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    return obj


def _leaves(obj: Any) -> list:
    out: list = []
    _map(obj, out.append)
    return out


def _signature(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return ("tensor", tuple(obj.shape), obj.dtype, obj.device)
    if isinstance(obj, (tuple, list)):
        return (type(obj).__name__, tuple(_signature(o) for o in obj))
    if isinstance(obj, dict):
        return ("dict", tuple((k, _signature(v)) for k, v in sorted(obj.items())))
    return ("value", obj)


def _mismatch(got: Any, expected: Any) -> Optional[str]:
    """Why a replay's outputs differ from the eager ones (None: they agree)."""
    a, b = _leaves(got), _leaves(expected)
    if _signature(got) != _signature(expected) or len(a) != len(b):
        return "outputs of another structure, shape or dtype"
    for i, (x, y) in enumerate(zip(a, b)):
        if x.numel() == 0:
            continue
        if not torch.equal(torch.isfinite(x), torch.isfinite(y)):
            return f"output {i}: non-finite values differ"
        xd, yd = x.double().nan_to_num(), y.double().nan_to_num()
        err = ((xd - yd).norm() / yd.norm().clamp_min(1e-30)).item()
        bound = _CHECK_REL.get(y.dtype, 1e-4)
        if err > bound:
            return f"output {i}: relative error {err:.2e} > {bound:.0e}"
    return None


@dataclass
class _Entry:
    calls: int = 0
    graph: Optional["torch.cuda.CUDAGraph"] = None
    static_args: Any = None
    static_kwargs: Any = None
    static_out: Any = None
    failed: Optional[str] = None
    replays: int = 0


class GraphedCall:
    """``fn`` replayed from one CUDA graph per input signature (see the module docstring).

    Args:
        fn: the callable (tensors, None, python values, nested in tuples/lists/dicts); a bound
            method is held weakly (its object is expected to own the wrapper).
        name: for logs and ``events``.
        warmup: eager calls per signature before the capturing call (>= 1).
        max_graphs: graphs kept (least recently used dropped).
        random: ``fn`` draws from the default CUDA generator (see the module docstring).
    Attributes:
        events: one line per capture, rejection and eviction.
    """

    def __init__(self, fn: Callable, *, name: str, warmup: int = 1, max_graphs: int = 16,
                 random: bool = False) -> None:
        if warmup < 1:
            raise ValueError(f"GraphedCall: warmup must be >= 1, got {warmup}")
        # A bound method is held weakly: its object usually owns this wrapper, and a cycle would
        # keep the captured graphs' memory pools alive until the next full garbage collection.
        self._fn = weakref.WeakMethod(fn) if inspect.ismethod(fn) else (lambda: fn)
        self.name, self.warmup, self.max_graphs = name, warmup, max_graphs
        self.random = random
        self.entries: "OrderedDict[Any, _Entry]" = OrderedDict()
        self.events: list[str] = []

    def _note(self, msg: str) -> None:
        self.events.append(msg)
        log.info("%s: %s", self.name, msg)

    @property
    def fn(self) -> Callable:
        fn = self._fn()
        if fn is None:
            raise ReferenceError(f"GraphedCall {self.name}: the object of its method is gone")
        return fn

    @property
    def graph_count(self) -> int:
        return sum(1 for e in self.entries.values() if e.graph is not None)

    def __call__(self, *args, **kwargs):
        kwargs = dict(sorted(kwargs.items()))  # one leaf order per signature
        tensors = _leaves((args, kwargs))
        if not tensors or any(t.device.type != "cuda" for t in tensors) or torch.is_grad_enabled():
            return self.fn(*args, **kwargs)
        enabled = torch.is_autocast_enabled("cuda")
        autocast = (enabled, torch.get_autocast_dtype("cuda") if enabled else None)
        # the fp32 math modes are baked into the captured kernels: part of the key
        math = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        key = (_signature(args), _signature(kwargs), autocast, math)
        ent = self.entries.get(key)
        if ent is None:
            while len(self.entries) >= self.max_graphs:
                self.entries.popitem(last=False)
                self._note(f"dropped a graph (LRU, budget {self.max_graphs})")
            ent = self.entries[key] = _Entry()
        self.entries.move_to_end(key)
        if ent.graph is None:
            ent.calls += 1
            capturing = ent.failed is None and ent.calls > self.warmup
            device = tensors[0].device
            start = torch.cuda.get_rng_state(device) if capturing and self.random else None
            expected = self.fn(*args, **kwargs)
            if capturing:
                self._capture(ent, args, kwargs, expected, autocast, start, device)
            return expected
        self._copy_in(ent, args, kwargs)
        ent.graph.replay()
        ent.replays += 1
        return _map(ent.static_out, torch.clone)

    @staticmethod
    def _copy_in(ent: _Entry, args, kwargs) -> None:
        for dst, src in zip(_leaves((ent.static_args, ent.static_kwargs)), _leaves((args, kwargs))):
            dst.copy_(src)

    def _capture(self, ent: _Entry, args, kwargs, expected, autocast, rng_start, device) -> None:
        rng_end = None if rng_start is None else torch.cuda.get_rng_state(device)
        try:
            with torch.inference_mode(False), torch.no_grad():
                ent.static_args = _map(args, torch.clone)
                ent.static_kwargs = _map(kwargs, torch.clone)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                # autocast's weight-cast cache must be off while capturing (torch.cuda.graph notes)
                cast = torch.autocast("cuda", dtype=autocast[1], enabled=autocast[0], cache_enabled=False)
                # each graph has its own memory pool: replays come in any order
                with torch.cuda.graph(graph), cast if autocast[0] else contextlib.nullcontext():
                    ent.static_out = self.fn(*ent.static_args, **ent.static_kwargs)
                self._copy_in(ent, args, kwargs)
                if rng_start is not None:
                    torch.cuda.set_rng_state(rng_start, device)
                graph.replay()
                why = _mismatch(ent.static_out, expected)
        except Exception as exc:  # noqa: BLE001 - any capture failure keeps this signature eager
            why = f"capture failed: {type(exc).__name__}: {str(exc)[:200]}"
        finally:
            if rng_end is not None:
                torch.cuda.set_rng_state(rng_end, device)
        if why is not None:
            ent.failed, ent.static_args, ent.static_kwargs, ent.static_out = why, None, None, None
            self._note(f"kept eager ({why}) for inputs " + ", ".join(
                str(tuple(t.shape)) for t in _leaves((args, kwargs))))
            return
        ent.graph = graph
        self._note("captured a graph (" + ", ".join(
            str(tuple(t.shape)) for t in _leaves((args, kwargs))) + ")")
