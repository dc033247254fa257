"""The one CUDA-graph cache of torch_cfm: every graph the package captures is captured here.

A :class:`GraphCache` maps a key (what the captured work depends on: shapes, dtypes, the storage of
the buffers it writes, the TF32 flags, ...) to a :class:`GraphEntry`. For each key the first
``warmup`` calls run eagerly (they compile kernels and create library handles), the next one
captures, and later calls copy their inputs into the captured ones and replay. Two forms:

* **in place** (``check=False``): the function writes its results into tensors that outlive the
  call (an arena solve, :class:`torch_cfm.solve.GraphedArenaSolver`). The capturing call runs
  nothing while it captures, then replays, which does the work.
* **checked** (``check=True``): the function returns its results (:class:`GraphedCall`, for the
  upstream modules the integrations replay). The capturing call runs eagerly and returns that
  result; the graph is kept only if its replay on the same inputs equals it within the dtype's
  bound (same structure, shapes, dtypes and finiteness). Replays return copies of the outputs.

A capture that fails (or disagrees) leaves its key eager, with the reason in ``events`` (and the
``torch_cfm.graphs`` logger). At most ``max_graphs`` keys are kept (least recently used dropped
first). Off CUDA every call runs eagerly and keys and counters are kept the same way, so a caller
can check on any device that no new key appeared after its warm-up.

The graphs of one cache share one memory pool per device (as vLLM's captures do): a capture may
reuse the blocks an earlier one freed (its intermediates), so the cache holds about its largest
graph's scratch rather than the sum over keys. That is safe because the calls of one cache never
overlap (one stream, one call at a time) and nothing a replay leaves in the pool is read after the
next call: the in-place form's results live outside it and replays return copies of the outputs
(``static_out`` stays allocated, so no later capture reuses it).

``shared_io=True`` (checked form) carves every key's static inputs from one buffer and its outputs
from another (:class:`SharedStatic`): each replay copies its inputs in right before it runs and its
outputs out right after (the capture copies the function's results into the shared outputs), so a
cache holds about its largest key's inputs and outputs rather than the sum over keys (the encoder
stage's batched conformer caches: 2.1 GiB at 16 streams and 10.3 at 64 otherwise,
``bench/experiments/encoder_graph_bytes.py``).

``random=True`` is for functions that draw from the device's default CUDA generator: the check
replays from the generator state the eager call started from (a replay reads the generator's seed
and offset when it starts and advances it by the captured draws, as eager kernels do), so only a
graph that reproduces the eager random stream is kept; the generator is left as the eager call
left it.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional

import torch

log = logging.getLogger("torch_cfm.graphs")

# Relative Frobenius bound of a checked replay against its eager call, by output dtype (others: 1e-4)
_CHECK_REL = {torch.float16: 1e-2, torch.bfloat16: 2e-2}


def tree_map(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``fn`` applied to every tensor of a tree of tuples, lists and dicts (other leaves kept)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(tree_map(o, fn) for o in obj)
    if isinstance(obj, list):
        return [tree_map(o, fn) for o in obj]
    if isinstance(obj, dict):
        return {k: tree_map(v, fn) for k, v in obj.items()}
    return obj


def tree_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors of a tree, in a fixed order."""
    out: list[torch.Tensor] = []
    tree_map(obj, out.append)
    return out


def signature(obj: Any) -> Hashable:
    """A hashable description of a tree: each tensor's shape, dtype and device, other values as they are."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", tuple(obj.shape), obj.dtype, obj.device)
    if isinstance(obj, (tuple, list)):
        return (type(obj).__name__, tuple(signature(o) for o in obj))
    if isinstance(obj, dict):
        return ("dict", tuple((k, signature(v)) for k, v in sorted(obj.items())))
    return ("value", obj)


def mismatch(got: Any, expected: Any) -> Optional[str]:
    """Why a replay's outputs differ from the eager ones (None: they agree within the dtype's bound)."""
    a, b = tree_tensors(got), tree_tensors(expected)
    if signature(got) != signature(expected) or len(a) != len(b):
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


class SharedStatic:
    """One buffer that the static tensors of a cache's keys are carved from (``shared_io``).

    Each key's tensors lie one after the other from the buffer's start, 256-byte aligned. A key that
    needs more than the buffer gets a new one of at least twice the size; keys captured before keep
    views of the old one until they are dropped.
    """

    ALIGN = 256

    def __init__(self) -> None:
        self.buffer: Optional[torch.Tensor] = None

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def carve(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Contiguous tensors of the shapes and dtypes of ``tensors`` (one device), uninitialised."""
        if not tensors:
            return []
        sizes = [-(-t.numel() * t.element_size() // self.ALIGN) * self.ALIGN for t in tensors]
        buf, device = self.buffer, tensors[0].device
        if buf is None or buf.device != device or buf.numel() < sum(sizes):
            grown = 2 * buf.numel() if buf is not None and buf.device == device else 0
            self.buffer = buf = torch.empty(max(sum(sizes), grown), dtype=torch.uint8, device=device)
        views, offset = [], 0
        for t, size in zip(tensors, sizes):
            views.append(buf[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape))
            offset += size
        return views


def _replace_tensors(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with its tensors replaced, in :func:`tree_tensors` order, by ``tensors``."""
    it = iter(tensors)
    return tree_map(obj, lambda _: next(it))


@dataclass
class GraphEntry:
    """One key of a :class:`GraphCache`.

    Attributes:
        label: what the key stands for, readable (a dict of sizes for solves, shapes for calls).
        graph: the captured graph (None: not captured yet, off CUDA, or the capture failed).
        failed: why the capture failed or was rejected (the key then stays eager).
        eager_calls, replays: calls run eagerly / replayed for this key.
        pool_bytes: device memory the capture added to the cache's graph pool, 0 before a capture
            (later captures reuse what earlier ones freed, so this is often 0 after the first).
    """

    label: Any
    graph: Optional["torch.cuda.CUDAGraph"] = None
    failed: Optional[str] = None
    eager_calls: int = 0
    replays: int = 0
    pool_bytes: int = 0
    static_args: Any = None
    static_kwargs: Any = None
    static_out: Any = None

    def copy_in(self, args: Any, kwargs: Any) -> None:
        """The call's inputs into the captured ones (only those whose storage is not the captured one)."""
        for dst, src in zip(tree_tensors((self.static_args, self.static_kwargs)), tree_tensors((args, kwargs))):
            if src.data_ptr() != dst.data_ptr():
                dst.copy_(src)


class GraphCache:
    """Captured CUDA graphs by key, LRU-bounded (module docstring).

    Args:
        name: for events and logs.
        max_graphs: keys kept (least recently used dropped first); >= 1.
        warmup: eager calls per key before the capturing call; >= 1.
        check: the checked form (the function returns its results; module docstring).
        random: the function draws from the default CUDA generator (checked form only).
        shared_io: the keys' static inputs and outputs carved from shared buffers (checked form
            only; module docstring).
    Attributes:
        hits, misses: lookups that found / created a key. captures: graphs captured.
        shared: the (inputs, outputs) :class:`SharedStatic` pair (None without ``shared_io``).
        events: captures, failures, rejections and evictions, one line each.
    """

    def __init__(self, name: str, *, max_graphs: int = 8, warmup: int = 1, check: bool = False,
                 random: bool = False, shared_io: bool = False) -> None:
        for arg, value in (("max_graphs", max_graphs), ("warmup", warmup)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GraphCache: {arg} must be an int >= 1, got {value!r}")
        if shared_io and not check:
            raise ValueError("GraphCache: shared_io needs check=True (the outputs' shapes come from the eager call)")
        self.shared = (SharedStatic(), SharedStatic()) if shared_io else None  # (inputs, outputs)
        self.name, self.max_graphs, self.warmup = name, max_graphs, warmup
        self.check, self.random = check, random
        self._keys: "OrderedDict[Hashable, GraphEntry]" = OrderedDict()
        self._pools: dict[int, Any] = {}  # CUDA device index -> torch.cuda.graph_pool_handle()
        self.hits = self.misses = self.captures = 0
        self.events: list[str] = []

    # ------------------------------------------------------------------ observation
    def entries(self) -> list[GraphEntry]:
        """Every kept key, least recently used first."""
        return list(self._keys.values())

    @property
    def graph_count(self) -> int:
        """Keys that hold a captured graph."""
        return sum(e.graph is not None for e in self._keys.values())

    @property
    def pool_bytes(self) -> int:
        """Device memory reserved by the kept graphs' captures."""
        return sum(e.pool_bytes for e in self._keys.values())

    @property
    def shared_bytes(self) -> int:
        """Bytes of the shared static buffers now (``shared_io``; 0 without)."""
        return 0 if self.shared is None else sum(b.nbytes for b in self.shared)

    def calls_per_capture(self, device: torch.device) -> int:
        """Calls of a new key until its graph exists: ``warmup`` eager calls and the capturing call
        on CUDA; 1 elsewhere."""
        return self.warmup + 1 if torch.device(device).type == "cuda" else 1

    def _note(self, msg: str) -> None:
        self.events.append(msg)
        log.info("%s: %s", self.name, msg)

    # ------------------------------------------------------------------ calls
    def entry(self, key: Hashable, label: Any = None) -> GraphEntry:
        """The key's entry (created on first use, most recently used after this call)."""
        ent = self._keys.get(key)
        if ent is None:
            self.misses += 1
            while len(self._keys) >= self.max_graphs:
                self._keys.popitem(last=False)
                self._note(f"evicted a graph (LRU, budget {self.max_graphs})")
            ent = self._keys[key] = GraphEntry(label=label)
        else:
            self.hits += 1
        self._keys.move_to_end(key)
        return ent

    def run(self, key: Hashable, fn: Callable, args: tuple = (), kwargs: Optional[dict] = None, *,
            device: torch.device, label: Any = None) -> Any:
        """``fn(*args, **kwargs)`` for ``key``: eagerly, captured now, or replayed (module docstring).

        ``args``/``kwargs`` are trees of tensors and python values; their tensors are the inputs a
        replay copies in. Returns what ``fn`` returns (the checked form: copies of a replay's outputs).
        """
        kwargs = {} if kwargs is None else kwargs
        ent = self.entry(key, label)
        if ent.graph is not None:
            return self._replay(ent, args, kwargs)
        if torch.device(device).type != "cuda" or ent.failed is not None or ent.eager_calls < self.warmup:
            ent.eager_calls += 1
            return fn(*args, **kwargs)
        if self.check:
            return self._capture_checked(ent, fn, args, kwargs, torch.device(device))
        if not self._capture(ent, fn, args, kwargs, torch.device(device)):
            ent.eager_calls += 1
            return fn(*args, **kwargs)
        self._accept(ent)
        return self._replay(ent, args, kwargs)

    def _replay(self, ent: GraphEntry, args: tuple, kwargs: dict) -> Any:
        ent.copy_in(args, kwargs)
        ent.graph.replay()
        ent.replays += 1
        return None if ent.static_out is None else tree_map(ent.static_out, torch.clone)

    def _static_io(self, args: tuple, kwargs: dict, expected: Any) -> tuple[tuple, dict, Optional[list]]:
        """Static copies of the inputs and, with ``shared_io``, the views the outputs go to."""
        if self.shared is None:
            return tree_map(args, torch.clone), tree_map(kwargs, torch.clone), None
        inputs = tree_tensors((args, kwargs))
        views = self.shared[0].carve(inputs)
        for dst, src in zip(views, inputs):
            dst.copy_(src)
        static_args, static_kwargs = _replace_tensors((args, kwargs), views)
        return static_args, static_kwargs, self.shared[1].carve(tree_tensors(expected))

    def _capture(self, ent: GraphEntry, fn: Callable, args: tuple, kwargs: dict, device: torch.device,
                 expected: Any = None) -> bool:
        """Capture ``fn`` over static copies of the inputs (``expected``: the eager outputs of the
        checked form); False (reason in events) when it fails."""
        try:
            with torch.inference_mode(False), torch.no_grad():
                ent.static_args, ent.static_kwargs, outs = self._static_io(args, kwargs, expected)
                # torch.cuda.graph() empties the allocator cache on entry: empty it first so the
                # reserved-bytes delta is this graph's pool alone
                torch.cuda.synchronize(device)
                torch.cuda.empty_cache()
                before = torch.cuda.memory_reserved(device)
                graph = torch.cuda.CUDAGraph()
                enabled = torch.is_autocast_enabled("cuda")
                # autocast's weight-cast cache must be off while capturing (torch.cuda.graph notes)
                cast = (torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
                        if enabled else contextlib.nullcontext())
                index = torch.cuda.current_device() if device.index is None else device.index
                pool = self._pools.get(index)
                if pool is None:
                    pool = self._pools[index] = torch.cuda.graph_pool_handle()
                with torch.cuda.graph(graph, pool=pool), cast:
                    out = fn(*ent.static_args, **ent.static_kwargs)
                    if outs is not None:  # the results into the shared outputs; their own memory is scratch
                        got = tree_tensors(out)
                        if [(t.shape, t.dtype) for t in got] != [(t.shape, t.dtype) for t in outs]:
                            raise RuntimeError("outputs of another shape or dtype than the eager call's")
                        for dst, src in zip(outs, got):
                            dst.copy_(src)
                        out = _replace_tensors(out, outs)
                ent.pool_bytes = max(0, torch.cuda.memory_reserved(device) - before)
        except Exception as exc:  # noqa: BLE001 - any capture failure keeps this key eager
            self._reject(ent, f"capture failed: {type(exc).__name__}: {str(exc)[:200]}")
            return False
        ent.graph, ent.static_out = graph, out
        return True

    def _accept(self, ent: GraphEntry) -> None:
        self.captures += 1
        self._note(f"captured a graph ({ent.label}, pool {ent.pool_bytes / 2**20:.1f} MiB)")

    def _capture_checked(self, ent: GraphEntry, fn: Callable, args: tuple, kwargs: dict,
                         device: torch.device) -> Any:
        """The checked form's capturing call: eager result returned, graph kept only if its replay agrees."""
        start = torch.cuda.get_rng_state(device) if self.random else None
        expected = fn(*args, **kwargs)
        end = torch.cuda.get_rng_state(device) if self.random else None
        ent.eager_calls += 1
        try:
            if self._capture(ent, fn, args, kwargs, device, expected):
                if start is not None:
                    torch.cuda.set_rng_state(start, device)
                ent.copy_in(args, kwargs)
                ent.graph.replay()
                why = mismatch(ent.static_out, expected)
                if why is None:
                    self._accept(ent)
                else:
                    self._reject(ent, why)
        finally:
            if end is not None:
                torch.cuda.set_rng_state(end, device)
        return expected

    def _reject(self, ent: GraphEntry, why: str) -> None:
        ent.failed, ent.graph = why, None
        ent.static_args = ent.static_kwargs = ent.static_out = None
        self._note(f"kept eager ({why}) for {ent.label}")


class GraphedCall:
    """``fn`` replayed from one checked CUDA graph per input signature (a :class:`GraphCache`), or
    with ``in_place=True`` from an in-place one.

    The signature is the tensors' shapes, dtypes and devices, the other arguments' values, the
    autocast state and the TF32 flags (baked into captured kernels). Calls with a CPU tensor, with
    grad enabled, or without tensors run ``fn`` eagerly and are not counted.

    Args:
        fn: the callable (tensors, None, python values, nested in tuples/lists/dicts); a bound
            method is held weakly (its object is expected to own the wrapper, and a cycle would keep
            the graphs' memory pools alive until the next full garbage collection).
        name: for logs and events.
        warmup: eager calls per signature before the capturing call (>= 1).
        max_graphs: graphs kept (least recently used dropped).
        random: ``fn`` draws from the default CUDA generator (module docstring).
        shared_io: the signatures' static inputs and outputs in shared buffers (module docstring).
        in_place: the in-place form: ``fn`` writes its results into tensors that outlive the call
            (captured at their addresses: they must keep them) and returns None; no check, no output
            copies (module docstring).
    Attributes:
        cache: the :class:`GraphCache` (``events``, ``entries()``, counters).
    """

    def __init__(self, fn: Callable, *, name: str, warmup: int = 1, max_graphs: int = 16,
                 random: bool = False, shared_io: bool = False, in_place: bool = False) -> None:
        self._fn = weakref.WeakMethod(fn) if inspect.ismethod(fn) else (lambda: fn)
        self.name = name
        self.cache = GraphCache(name, max_graphs=max_graphs, warmup=warmup, check=not in_place, random=random,
                                shared_io=shared_io)

    @property
    def fn(self) -> Callable:
        fn = self._fn()
        if fn is None:
            raise ReferenceError(f"GraphedCall {self.name}: the object of its method is gone")
        return fn

    @property
    def graph_count(self) -> int:
        return self.cache.graph_count

    @property
    def events(self) -> list[str]:
        return self.cache.events

    def __call__(self, *args, **kwargs):
        kwargs = dict(sorted(kwargs.items()))  # one leaf order per signature
        tensors = tree_tensors((args, kwargs))
        if not tensors or any(t.device.type != "cuda" for t in tensors) or torch.is_grad_enabled():
            return self.fn(*args, **kwargs)
        enabled = torch.is_autocast_enabled("cuda")
        autocast = (enabled, torch.get_autocast_dtype("cuda") if enabled else None)
        math = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        key = (signature(args), signature(kwargs), autocast, math)
        label = "inputs " + ", ".join(str(tuple(t.shape)) for t in tensors)
        return self.cache.run(key, self.fn, args, kwargs, device=tensors[0].device, label=label)


__all__ = ["GraphCache", "GraphEntry", "GraphedCall", "SharedStatic", "signature", "mismatch", "tree_map", "tree_tensors"]
