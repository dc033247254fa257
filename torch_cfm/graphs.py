"""CUDA graphs of the arena solve: one capture engine, one graph per static shape.

:class:`ArenaGraphSolver` has :func:`~torch_cfm.models.solver.solve_arena_chunk`'s signature and
replays that whole n-step chunk solve (every Euler step's fused body, CFG/Euler updates, cache
write-back and trim) from one CUDA graph per static key. It is what ``CFMServer(graphs=True)``
installs as its ``solve_fn``. Its cache is observable: ``hits`` / ``misses`` count lookups,
``captures`` counts graph captures, :meth:`ArenaGraphSolver.entries` lists every key with a
readable label, so a caller can check that no capture happened after a warm-up.

:class:`CFMGraphRunner` is a bucketed wrapper over the same engine for callers that hold their
caches in the SPEC layout (``mu``/``x0``/caches in, mel and new caches out): each (B, T, L) bucket
owns a :class:`~torch_cfm.models.cache.CacheArena` of L + T frames, and its solves go through one
shared :class:`ArenaGraphSolver`.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from . import policy
from .models.cache import CacheArena, keyed_to_newest_first
from .models.solver import solve_arena_chunk
from .packing import packed_for

log = logging.getLogger("torch_cfm.graphs")

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16)
DEFAULT_CHUNK_BUCKETS = (25, 50, 56, 64, 100, 128, 150, 200, 300)
DEFAULT_CACHE_BUCKETS = (0, 100, 200, 300, 400, 500, 600, 800, 1024)


def _sig(t: Optional[torch.Tensor]) -> Optional[tuple]:
    if t is None:
        return None
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


def _meta(t: Optional[torch.Tensor]) -> Optional[tuple]:
    if t is None:
        return None
    return (tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


@dataclass
class GraphEntry:
    """One static key of an :class:`ArenaGraphSolver`.

    Attributes:
        label: readable shape of the key: ``rows`` (arena slots R), ``slots`` (solved slots S, None
            = all), ``t_len`` (T), ``cache_frames`` (Lb), ``dtype``.
        graph: the captured graph (None: not captured yet, on CPU, or the capture failed).
        failed: why the capture failed (that key stays eager).
        eager_calls, replays: solves run eagerly / replayed for this key.
        pool_bytes: device memory the capture reserved (its graph pool), 0 before a capture.
    """

    label: dict
    arena_ptr: int
    graph: Optional["torch.cuda.CUDAGraph"] = None
    inputs: dict = field(default_factory=dict)  # name -> static read-only tensor the graph reads
    failed: Optional[str] = None
    eager_calls: int = 0
    replays: int = 0
    pool_bytes: int = 0

    def replay(self, read: dict) -> None:
        """Copy the read-only inputs whose storage is not the captured one into it, then replay."""
        for k, v in read.items():
            if v is not None and v.data_ptr() != self.inputs[k].data_ptr():
                self.inputs[k].copy_(v)
        self.graph.replay()
        self.replays += 1


class ArenaGraphSolver:
    """A CUDA-graph wrapper with :func:`~torch_cfm.models.solver.solve_arena_chunk`'s signature.

    Plug into the model server: ``server.solve_fn = ArenaGraphSolver()``. Per static key (the
    in-place arena tensors by identity — ``att``, ``cnn``, ``cache_lengths``, ``out_mel``,
    ``frame_keys``, ``x_state`` —, the step span of a solve spread over calls, the shapes of the
    read-only inputs, the python ints, the estimator and its packed weights, torch's TF32 flag)
    the first ``warmup`` calls run eagerly (they are real solves: compile the kernels, create
    handles), the next call captures (capture runs nothing) and replays; later calls copy read-only
    inputs whose storage changed (e.g. a fresh ``slots`` tensor) into the captured ones and replay.
    A capture failure is logged and that key stays eager. At most ``max_graphs`` keys are kept
    (LRU). On CPU every call runs eagerly; keys and counters are kept the same way.

    Args:
        solve_fn: the solve to capture (default ``solve_arena_chunk``).
        max_graphs: graph budget (LRU eviction of keys).
        warmup: eager calls per key before capturing (>= 1).
    Attributes:
        hits, misses: lookups that found / created a key. captures: graphs captured.
        events: capture, failure and eviction log (also sent to logging).
    """

    READ_ONLY = ("noise", "mu", "spks", "cond", "valid_lengths", "prompt_lengths", "slots", "x0")

    def __init__(self, solve_fn: Optional[Callable[..., None]] = None, *, max_graphs: int = 8,
                 warmup: int = 1) -> None:
        if not isinstance(max_graphs, int) or max_graphs < 1:
            raise ValueError(f"ArenaGraphSolver: max_graphs must be an int >= 1, got {max_graphs!r}")
        if not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"ArenaGraphSolver: warmup must be an int >= 1, got {warmup!r}")
        self.solve_fn = solve_arena_chunk if solve_fn is None else solve_fn
        self.max_graphs, self.warmup = max_graphs, warmup
        self._keys: "OrderedDict[tuple, GraphEntry]" = OrderedDict()
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

    def calls_per_capture(self, device: torch.device) -> int:
        """Calls of one new key until its graph exists: ``warmup`` eager calls + the capture
        (on CUDA); 1 on other devices."""
        return self.warmup + 1 if torch.device(device).type == "cuda" else 1

    def discard(self, att: torch.Tensor) -> None:
        """Drop every key (and graph) captured on the arena ``att`` (before freeing it)."""
        ptr = att.data_ptr()
        for key in [k for k, e in self._keys.items() if e.arena_ptr == ptr]:
            del self._keys[key]

    def _note(self, msg: str) -> None:
        self.events.append(msg)
        log.info(msg)

    @staticmethod
    def _weights_key(estimator, dtype, device):
        try:
            return id(packed_for(estimator, dtype, device))
        except (ValueError, TypeError, AttributeError):
            return None

    # ------------------------------------------------------------------ solve
    def __call__(self, estimator, att, cnn, noise, mu, spks, cond, valid_lengths, cache_lengths, prompt_lengths,
                 out_mel, *, cache_frames: int, n_timesteps: int = 10, cfg_rate: float = 0.7,
                 keep_oldest: int = 100, fused: Optional[bool] = None, slots: Optional[torch.Tensor] = None,
                 frame_keys: Optional[torch.Tensor] = None, x0: Optional[torch.Tensor] = None,
                 steps: Optional[tuple[int, int]] = None, x_state: Optional[torch.Tensor] = None) -> None:
        kwargs = dict(cache_frames=cache_frames, n_timesteps=n_timesteps, cfg_rate=cfg_rate, keep_oldest=keep_oldest,
                      fused=fused)
        if steps is not None:  # a solve spread over calls: its step span is part of the key
            kwargs.update(steps=tuple(steps), x_state=x_state)
        read = dict(noise=noise, mu=mu, spks=spks, cond=cond, valid_lengths=valid_lengths,
                    prompt_lengths=prompt_lengths, slots=slots, x0=x0)

        def eager(inputs):
            extra = {} if inputs["x0"] is None else {"x0": inputs["x0"]}
            self.solve_fn(estimator, att, cnn, inputs["noise"], inputs["mu"], inputs["spks"], inputs["cond"],
                          inputs["valid_lengths"], cache_lengths, inputs["prompt_lengths"], out_mel,
                          slots=inputs["slots"], frame_keys=frame_keys, **kwargs, **extra)

        static_kwargs = {k: (_sig(v) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
        key = (id(estimator), self._weights_key(estimator, att.dtype, att.device),
               _sig(att), _sig(cnn), _sig(cache_lengths), _sig(out_mel), _sig(frame_keys),
               tuple((k, _meta(v)) for k, v in read.items()),
               tuple(sorted(static_kwargs.items(), key=lambda kv: kv[0])),
               torch.backends.cuda.matmul.allow_tf32)
        ent = self._keys.get(key)
        if ent is None:
            self.misses += 1
            while len(self._keys) >= self.max_graphs:
                self._keys.popitem(last=False)
                self._note(f"evicted a solve graph (LRU, budget {self.max_graphs})")
            label = dict(rows=mu.shape[0], slots=None if slots is None else int(slots.shape[0]), t_len=mu.shape[2],
                         cache_frames=cache_frames, dtype=str(att.dtype).replace("torch.", ""))
            if steps is not None:
                label["steps"] = tuple(steps)
            ent = GraphEntry(label=label, arena_ptr=att.data_ptr())
            self._keys[key] = ent
        else:
            self.hits += 1
        self._keys.move_to_end(key)
        if att.device.type != "cuda" or ent.failed is not None or (ent.graph is None and
                                                                   ent.eager_calls < self.warmup):
            ent.eager_calls += 1
            return eager(read)
        if ent.graph is None:
            self._capture(ent, eager, read, att.device)
            if ent.graph is None:
                ent.eager_calls += 1
                return eager(read)
        ent.replay(read)
        return None

    def _capture(self, ent: GraphEntry, eager, read: dict, device: torch.device) -> None:
        static = {k: (None if v is None else v.clone()) for k, v in read.items()}
        try:
            # torch.cuda.graph() empties the allocator cache on entry: empty it first so the
            # reserved-bytes delta is this graph's pool alone
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            before = torch.cuda.memory_reserved(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                eager(static)
            ent.pool_bytes = max(0, torch.cuda.memory_reserved(device) - before)
        except Exception as exc:  # noqa: BLE001 - any capture failure falls back to eager
            ent.failed = f"{type(exc).__name__}: {exc}"
            self._note(f"solve capture failed, eager instead ({ent.label}): {ent.failed}")
            return
        ent.graph, ent.inputs = graph, static
        self.captures += 1
        self._note(f"captured a solve graph ({ent.label}, pool {ent.pool_bytes / 2**20:.1f} MiB)")


# --------------------------------------------------------------------------------------------
# the bucketed SPEC-layout wrapper
# --------------------------------------------------------------------------------------------

@dataclass
class RunnerEntry:
    """One (B, T, L) bucket of a :class:`CFMGraphRunner`: its arena and static initial noise.

    ``arena`` holds B slots of L + T frames (keyed, no append room: L + T covers the new cache);
    ``x0`` (B, 80, T) float32 is each slot's initial noise."""

    key: tuple[int, int, int]
    arena: CacheArena
    x0: torch.Tensor
    graph: Optional[GraphEntry] = None  # the solver's captured entry of this arena, once captured

    def arena_bytes(self) -> int:
        """Bytes of the cache arena (attention and conv caches)."""
        return sum(t.numel() * t.element_size() for t in (self.arena.att, self.arena.cnn))


def _bucket(value: int, buckets: Sequence[int]) -> Optional[int]:
    i = bisect.bisect_left(list(buckets), value)
    return buckets[i] if i < len(buckets) else None


class CFMGraphRunner:
    """Whole n-step CFG chunk solves of one estimator on SPEC-layout caches, per bucket.

    Each solve is padded into its (B, T, L) bucket's arena and solved by the arena engine
    (:func:`~torch_cfm.models.solver.solve_arena_chunk`) through one :class:`ArenaGraphSolver`
    (a CUDA graph per bucket, eager on CPU or with ``use_graphs=False``).

    Args:
        model: the DiT estimator (SPEC §1 parameter names).
        dtype: compute dtype (float16 | bfloat16 | float32) of the body and the cache arena.
        device: a CUDA device (graphs); on CPU everything runs eagerly.
        n_timesteps, cfg_rate: the solve (SPEC §3).
        batch_buckets, chunk_buckets, cache_buckets: sorted bucket sizes for B requests,
            T frames, L cached frames; a larger shape runs eagerly on an arena of its own (logged).
        max_graphs: bucket budget; the least recently used bucket (arena + graph) is evicted.
        precision: fp32 dots "tf32" | "ieee" (None: torch's TF32 setting).
        use_graphs: False = always eager (same arenas, same kernels).
    """

    def __init__(self, model: torch.nn.Module, *, dtype: torch.dtype, device: torch.device | str,
                 n_timesteps: int = 10, cfg_rate: float = 0.7,
                 batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
                 chunk_buckets: Sequence[int] = DEFAULT_CHUNK_BUCKETS,
                 cache_buckets: Sequence[int] = DEFAULT_CACHE_BUCKETS,
                 max_graphs: int = 8, precision: Optional[str] = None, use_graphs: bool = True) -> None:
        if not isinstance(max_graphs, int) or max_graphs < 1:
            raise ValueError(f"CFMGraphRunner: max_graphs must be an int >= 1, got {max_graphs!r}")
        if not isinstance(n_timesteps, int) or n_timesteps < 1:
            raise ValueError(f"CFMGraphRunner: n_timesteps must be an int >= 1, got {n_timesteps!r}")
        self.model, self.dtype, self.device = model, dtype, torch.device(device)
        self.n_steps, self.cfg_rate = n_timesteps, float(cfg_rate)
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.chunk_buckets = tuple(sorted(chunk_buckets))
        self.cache_buckets = tuple(sorted(cache_buckets))
        self.max_graphs = max_graphs
        self.precision = policy.resolve_precision(dtype, precision or "auto")
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.solver = ArenaGraphSolver(max_graphs=max_graphs)
        self._packed = None
        self._entries: "OrderedDict[tuple[int, int, int], RunnerEntry]" = OrderedDict()
        self._events: list[str] = []

    @property
    def events(self) -> list[str]:
        """Bucket evictions and eager fallbacks, then the graph solver's capture log."""
        return self._events + self.solver.events

    def _note(self, msg: str) -> None:
        self._events.append(msg)
        log.info(msg)

    def _tf32(self):
        if self.dtype == torch.float32 and self.device.type == "cuda":
            return policy.tf32_scope(self.precision == "tf32")
        return contextlib.nullcontext()

    def bucket_for(self, batch: int, t_len: int, cache_len: int) -> Optional[tuple[int, int, int]]:
        """The (B, T, L) bucket a solve falls into, or None (runs eagerly)."""
        kb, kt, kl = (_bucket(batch, self.batch_buckets), _bucket(t_len, self.chunk_buckets),
                      _bucket(cache_len, self.cache_buckets))
        if kb is None or kt is None or kl is None:
            return None
        return kb, kt, kl

    def _allocate(self, key: tuple[int, int, int]) -> RunnerEntry:
        batch, t_len, cache_len = key
        arena = CacheArena.allocate(self.model.config, self.n_steps, batch, cache_len + t_len, t_len, self.device,
                                    self.dtype)
        mel = self.model.config.out_channels
        return RunnerEntry(key, arena, torch.zeros((batch, mel, t_len), device=self.device, dtype=torch.float32))

    def entry(self, key: tuple[int, int, int]) -> RunnerEntry:
        """The bucket's arena (allocated on first use; most recently used after this call).

        Checks the estimator's weights: after a change every bucket's graph is captured again
        (:meth:`run` replays a captured bucket directly, without the solver's key lookup)."""
        packed = packed_for(self.model, self.dtype, self.device)
        if packed is not self._packed:
            if self._packed is not None:
                self._note("weights changed: graphs captured again")
                for e in self._entries.values():
                    e.graph = None
            self._packed = packed
        ent = self._entries.get(key)
        if ent is None:
            while len(self._entries) >= self.max_graphs:
                old_key, old = self._entries.popitem(last=False)
                self.solver.discard(old.arena.att)
                self._note(f"evicted bucket {old_key} (LRU, budget {self.max_graphs})")
            ent = self._allocate(key)
            self._entries[key] = ent
        self._entries.move_to_end(key)
        return ent

    @property
    def graphs(self) -> dict[tuple[int, int, int], bool]:
        """Bucket -> captured?"""
        captured = {e.arena_ptr for e in self.solver.entries() if e.graph is not None}
        return {k: e.arena.att.data_ptr() in captured for k, e in self._entries.items()}

    def run(self, ent: RunnerEntry, graphs: Optional[bool] = None) -> None:
        """Solve the bucket's staged arena in place: replay its graph (the solver captures it when
        due; a captured bucket replays directly, its weights checked by :meth:`entry`)."""
        arena = ent.arena
        _, t_len, cache_len = ent.key
        use_graphs = self.use_graphs if graphs is None else graphs
        if use_graphs and ent.graph is not None and ent.graph.graph is not None:
            ent.graph.replay(dict(noise=ent.x0, mu=arena.mu, spks=arena.spks, cond=arena.cond,
                                  valid_lengths=arena.valid_lengths, prompt_lengths=arena.prompt_lengths,
                                  slots=None, x0=ent.x0))
            return
        solve = self.solver if use_graphs else solve_arena_chunk
        with self._tf32(), torch.no_grad():
            solve(self.model, arena.att, arena.cnn, ent.x0, arena.mu, arena.spks, arena.cond, arena.valid_lengths,
                  arena.cache_lengths, arena.prompt_lengths, arena.out_mel, cache_frames=cache_len,
                  n_timesteps=self.n_steps, cfg_rate=self.cfg_rate, keep_oldest=cache_len + t_len,
                  frame_keys=arena.frame_keys, x0=ent.x0)
        if use_graphs:
            ptr = arena.att.data_ptr()
            ent.graph = next((e for e in self.solver.entries() if e.arena_ptr == ptr and e.graph is not None), None)

    def run_eager(self, ent: RunnerEntry) -> None:
        """The solve on ``ent`` without a graph (same kernels as the replay)."""
        self.run(ent, graphs=False)

    def solve(self, mu: torch.Tensor, spks: Optional[torch.Tensor], cond: Optional[torch.Tensor],
              x0: torch.Tensor, att_cache: Optional[torch.Tensor] = None, cnn_cache: Optional[torch.Tensor] = None,
              valid_lengths: Optional[torch.Tensor] = None, cache_lengths: Optional[torch.Tensor] = None,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One chunk solve of B requests, copied into / out of the bucket's arena.

        Args:
            mu, cond: (B, 80, T); spks: (B, 80) (None = zeros); x0: (B, 80, T) initial noise.
            att_cache: (n, depth, 2B, H, L, 2D) or None; cnn_cache: (n, depth, 2B, 2C, 2) or None;
                rows ``[cond x B | uncond x B]``.
            valid_lengths, cache_lengths: optional (B,) int32 per request (default T / L).
        Returns:
            mel (B, 80, T), cnn caches (n, depth, 2B, 2C, 2), att caches (n, depth, 2B, H, T+L, 2D),
            in the compute dtype; request b's valid frames are a prefix as in SPEC §2 (zeros after).
        """
        b, _, t_len = mu.shape
        cache_len = 0 if att_cache is None else att_cache.shape[4]
        key = self.bucket_for(b, t_len, cache_len)
        if key is None:
            self._note(f"shape B={b} T={t_len} L={cache_len} beyond the largest bucket: eager")
            ent, graphs = self._allocate((b, t_len, cache_len)), False
        else:
            ent, graphs = self.entry(key), None
        arena, kb = ent.arena, ent.key[0]
        dev, cd = self.device, self.dtype
        with torch.no_grad():
            rows = torch.cat([torch.arange(b), kb + torch.arange(b)]).to(dev)
            lengths_v = (torch.full((b,), t_len, dtype=torch.int32, device=dev) if valid_lengths is None
                         else valid_lengths.to(device=dev, dtype=torch.int32).clamp(0, t_len))
            lengths_c = (torch.full((b,), cache_len, dtype=torch.int32, device=dev) if cache_lengths is None
                         else cache_lengths.to(device=dev, dtype=torch.int32).clamp(0, cache_len))

            def stage() -> None:
                for t in (arena.mu, arena.cond, arena.spks, arena.cnn, arena.valid_lengths, arena.cache_lengths,
                          arena.prompt_lengths, ent.x0):
                    t.zero_()
                arena.mu[:b, :, :t_len].copy_(mu)
                if cond is not None:
                    arena.cond[:b, :, :t_len].copy_(cond)
                if spks is not None:
                    arena.spks[:b].copy_(spks)
                ent.x0[:b, :, :t_len].copy_(x0)
                arena.valid_lengths[:b] = lengths_v
                arena.cache_lengths[:b] = lengths_c
                arena.frame_keys.copy_(torch.arange(arena.max_cache_frames, device=dev, dtype=torch.int32))
                if att_cache is not None and cache_len:  # identity keys: the SPEC layout, newest first
                    arena.att[:, :, rows, :, :cache_len] = att_cache.to(cd)
                if cnn_cache is not None:
                    arena.cnn[:, :, rows] = cnn_cache.to(cd)

            # A bucket's first solve is staged again until its graph exists (eager warm-up, then
            # the capture), so it is captured on first use like any later solve.
            first = graphs is None and self.use_graphs and not self.graphs.get(ent.key, False)
            for _ in range(self.solver.calls_per_capture(dev) if first else 1):
                stage()
                self.run(ent, graphs)
            mel = arena.out_mel[:b, :, :t_len].clone()
            slots = torch.arange(b, device=dev)
            keys = arena.frame_keys[torch.cat([slots, slots])]
            new_lengths = torch.cat([arena.cache_lengths[:b]] * 2)
            att = keyed_to_newest_first(arena.att[:, :, rows], keys, new_lengths, t_len + cache_len)
            cnn = arena.cnn[:, :, rows].clone()
        return mel, cnn, att


__all__ = ["ArenaGraphSolver", "CFMGraphRunner", "GraphEntry", "RunnerEntry"]
