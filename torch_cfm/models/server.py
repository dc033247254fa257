"""A batched, stateful streaming server over :class:`~torch_cfm.models.StreamingCFM`.

Requests are opened with a speaker embedding and a prompt (solved as the request's first chunk,
cond = prompt mel, exactly like the upstream cache setup), then any subset of open requests is
solved together, one chunk each, even when their chunk lengths and cache lengths differ. Caches
live in one keyed :class:`~torch_cfm.models.cache.CacheArena` per batch bucket, allocated once; each
solve runs :func:`~torch_cfm.models.solver.solve_arena_chunk` over a whole bucket (slots without
a chunk this time are idle rows with 0 valid frames, left unchanged), so its shapes depend only on
the bucket and on the (bucketed) chunk and cache lengths: ready for a CUDA-graph runner.

Start-up: :meth:`CFMServer.warmup` runs (and with ``graphs=True`` captures) every solve shape the
configured buckets can produce, so that no later prompt solve or tick compiles or captures;
:meth:`CFMServer.memory_plan` gives the bytes per stream and the arenas' total, and
``max_memory_bytes`` refuses a configuration that would not fit (:class:`AdmissionError`).

    >>> server = CFMServer(cfm, max_requests=4, max_prompt_frames=300, chunk_buckets=[50],
    ...                    cache_buckets=[0, 200, 400], slot_buckets=[1, 4], graphs=True)
    >>> report = server.warmup()                                      # every graph, captured
    >>> server.open_request("a", spks_a, prompt_mu=mu_p, prompt_mel=mel_p)
    >>> out = server.solve_chunk({"a": mu_chunk, "b": (mu_b, None)})   # {"a": (80, T_a), ...}
    >>> server.close_request("a")
"""

from __future__ import annotations

import bisect
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterable, Mapping, Optional, Sequence

import torch

from ..graphs import ArenaGraphSolver
from ..ops._checks import fail, shape_str
from .cache import TRIM_KEEP_OLDEST, CacheArena, trimmed_length
from .solver import StreamingCFM, solve_arena_chunk


class AdmissionError(RuntimeError):
    """A stream (or a server's arenas) does not fit: no free request slot, or the arenas' bytes
    exceed ``max_memory_bytes``. The message names the limit and the need."""


@dataclass
class MemoryPlan:
    """Device memory of a :class:`CFMServer` (bytes).

    Attributes:
        dtype: the compute dtype of the arenas.
        bytes_per_stream: one request slot of an arena: attention caches of its two CFG rows for
            every Euler step (``n·depth·2·H·(M + A)·2D`` elements), conv caches
            (``n·depth·2·2C·2``), staging (mu, cond, out_mel: ``3·80·Tmax``; spks 80) in the
            compute dtype, plus its int32 frame keys (M) and lengths (3).
        slots: request slots of all buckets; arena_bytes: all arenas (= slots × bytes_per_stream).
        graph_pool_bytes: memory reserved by the captured graphs (0 before a warm-up / on CPU).
        max_memory_bytes: the configured limit (None = no limit).
    """

    dtype: torch.dtype
    bytes_per_stream: int
    slots: int
    arena_bytes: int
    graph_pool_bytes: int = 0
    max_memory_bytes: Optional[int] = None

    @property
    def total_bytes(self) -> int:
        return self.arena_bytes + self.graph_pool_bytes


@dataclass
class WarmupReport:
    """What :meth:`CFMServer.warmup` ran.

    Attributes:
        shapes: solve shapes warmed (one per bucket × slot count × chunk bucket × cache bucket),
            each a label dict (rows, slots, t_len, cache_frames).
        graphs: captured graphs held by the server's graph solver afterwards (0 on CPU / eager).
        graph_pool_bytes: memory their captures reserved. arena_bytes: the arenas'.
        seconds: wall time of the warm-up.
    """

    shapes: list = field(default_factory=list)
    graphs: int = 0
    graph_pool_bytes: int = 0
    arena_bytes: int = 0
    seconds: float = 0.0

    def __str__(self) -> str:
        return (f"warmup: {len(self.shapes)} shapes, {self.graphs} graphs, graph pools "
                f"{self.graph_pool_bytes / 2**20:.1f} MiB, arenas {self.arena_bytes / 2**20:.1f} MiB, "
                f"{self.seconds:.2f} s")


@dataclass
class _Request:
    bucket: int
    slot: int
    prompt_len: int
    cache_len: int = 0  # host mirror of arena.cache_lengths[slot]
    chunks: int = 0
    pending: bool = False  # its prompt solve is spread over ticks and not finished


@dataclass
class _Cohort:
    """Prompt solves spread over ticks that run together: requests of one bucket admitted before
    the same tick, as many as a slot bucket holds (so shapes repeat), solved over their own slots
    (``index``) and at Euler step ``next_step``.
    A member closed before the end stays in the solve as an idle slot (``closed``) and its slot
    returns to the free list when the cohort ends."""

    bucket: int
    items: list  # (request id, _Request, T_r)
    t_len: int
    index: Optional[torch.Tensor]  # (S,) int64 slots on the device, None = the bucket's every slot
    next_step: int = 0
    closed: set = field(default_factory=set)


def _round_up(value: int, buckets: Optional[Sequence[int]], limit: int) -> int:
    if not buckets:
        return value
    i = bisect.bisect_left(buckets, value)
    return min(buckets[i], limit) if i < len(buckets) else limit


def _reachable(buckets: Optional[Sequence[int]], limit: int, low: int) -> Optional[list[int]]:
    """Every value ``_round_up(v, buckets, limit)`` takes for v in [low, limit] (None: no buckets)."""
    if not buckets:
        return None
    return sorted({_round_up(v, buckets, limit) for v in [low, limit, *buckets] if low <= v <= limit})


class CFMServer:
    """Streaming CFM server: open/close requests, solve chunks for any subset at once.

    Args:
        cfm: the :class:`StreamingCFM` (estimator + noise + schedule).
        max_requests: request slots in total (default 4); split into ``buckets`` when given.
        buckets: slots per batch bucket, e.g. (1, 4, 8): one arena each; a request takes a free
            slot of the smallest bucket that has one. Default: one bucket of ``max_requests``.
        max_prompt_frames: longest prompt P; arenas hold ``P + 100`` cache frames (the trim bound).
        max_chunk_frames: longest chunk (default 100); staging holds ``max(P, this)`` frames so the
            prompt fits as a chunk.
        chunk_buckets / cache_buckets: optional sorted lengths the chunk length T / cache window Lb
            of a solve are rounded up to (fewer distinct shapes for CUDA graphs); default: exact.
        slot_buckets: optional sorted counts the solved slots S are padded up to with idle slots
            (default: exactly the requests of the chunk; all slots once that reaches the bucket).
        device, dtype: of the arenas (default: the estimator's parameters').
        fused: passed to the estimator (None = policy).
        append_in_place: give each attention cache ``max_chunk_frames`` extra frames (+25 % arena
            bytes at the defaults) so that a chunk solved over every slot of a bucket appends its
            keys in place and trims by refilling dropped frames (default True). False, or a solve
            of some slots only: the rows are copied out per step and only changed frames copied
            back. Either way the arena is keyed (:class:`~torch_cfm.models.cache.CacheArena`).
        graphs: capture each bucket's whole n-step solve as a CUDA graph
            (:class:`torch_cfm.graphs.ArenaGraphSolver`; eager on CPU and for shapes it declines).
            Pair with ``chunk_buckets``/``cache_buckets``/``slot_buckets`` to bound the graph count.
        max_graphs: graph budget of that solver (LRU; default 8); :meth:`warmup` raises it to the
            number of shapes it warms.
        max_memory_bytes: optional limit on the arenas' bytes; a configuration over it raises
            :class:`AdmissionError` naming the limit, the bytes per stream and the streams that fit.
        prompt_steps_per_tick: None (default): a prompt is solved whole when its request opens.
            An int k in [1, n]: prompt solves are spread over ticks, k Euler steps per
            :meth:`advance_prompts` call, the same result as a whole solve (each step reads and
            writes its own caches only; the Euler state waits in the arena's ``x_state``). A tick
            then carries about k/n of the recent arrivals' prompt work instead of all of one
            tick's arrivals at once: tick times stay near their median under bursty arrivals, at
            the price of n/k ticks before a new request's first chunk. Prompts opened before the
            same tick form a cohort, solved as groups of slot-bucket sizes, each over its own slots
            only (cache window 0), so their shapes are few and warm up ahead (:meth:`warmup`
            ``prompt_frames``).
    Attributes:
        arenas: list of :class:`CacheArena`, one per bucket (never reallocated).
        solve_fn: the per-bucket solve, default :func:`solve_arena_chunk`; a CUDA-graph runner
            with the same signature may replace it.
        bytes_per_stream: arena bytes of one request slot (:class:`MemoryPlan`).
        AdmissionError: the error raised when a stream or the arenas do not fit.
    """

    def __init__(self, cfm: StreamingCFM, *, max_requests: int = 4, buckets: Optional[Sequence[int]] = None,
                 max_prompt_frames: int = 300, max_chunk_frames: int = 100,
                 chunk_buckets: Optional[Sequence[int]] = None, cache_buckets: Optional[Sequence[int]] = None,
                 slot_buckets: Optional[Sequence[int]] = None,
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None,
                 fused: Optional[bool] = None, graphs: bool = False, append_in_place: bool = True,
                 max_graphs: int = 8, max_memory_bytes: Optional[int] = None,
                 prompt_steps_per_tick: Optional[int] = None) -> None:
        op = "CFMServer"
        for name, val in (("max_requests", max_requests), ("max_chunk_frames", max_chunk_frames)):
            if not isinstance(val, int) or val <= 0:
                fail(op, name, "be a positive int", repr(val))
        if not isinstance(max_prompt_frames, int) or max_prompt_frames < 0:
            fail(op, "max_prompt_frames", "be an int >= 0", repr(max_prompt_frames))
        buckets = tuple(buckets) if buckets is not None else (max_requests,)
        if not buckets or any(not isinstance(b, int) or b <= 0 for b in buckets):
            fail(op, "buckets", "be a non-empty sequence of positive ints", repr(buckets))
        param = next(cfm.estimator.parameters())
        self.cfm = cfm
        self.config = cfm.estimator.config
        self.device = torch.device(device) if device is not None else param.device
        self.dtype = dtype or param.dtype
        self.fused = fused
        self.max_prompt_frames = max_prompt_frames
        self.max_cache_frames = max_prompt_frames + TRIM_KEEP_OLDEST
        self.max_chunk_frames = max(max_chunk_frames, max_prompt_frames)
        self.chunk_buckets = sorted(chunk_buckets) if chunk_buckets else None
        self.cache_buckets = sorted(cache_buckets) if cache_buckets else None
        self.slot_buckets = sorted(slot_buckets) if slot_buckets else None
        self.noise = cfm.noise.to(device=self.device, dtype=self.dtype)
        if prompt_steps_per_tick is not None and (
                not isinstance(prompt_steps_per_tick, int) or isinstance(prompt_steps_per_tick, bool)
                or not 1 <= prompt_steps_per_tick <= cfm.n_timesteps):
            fail(op, "prompt_steps_per_tick", f"be None or an int in [1, n_timesteps={cfm.n_timesteps}]",
                 repr(prompt_steps_per_tick))
        self.prompt_steps_per_tick = prompt_steps_per_tick
        self._admitting: dict[int, list] = {}  # bucket -> (request id, _Request, T_r) opened since the last tick
        self._cohorts: list[_Cohort] = []
        if max_memory_bytes is not None and (not isinstance(max_memory_bytes, int) or max_memory_bytes <= 0):
            fail(op, "max_memory_bytes", "be a positive int (bytes) or None", repr(max_memory_bytes))
        self.max_memory_bytes = max_memory_bytes
        self._append = max_chunk_frames if append_in_place else 0
        self.bytes_per_stream = self._arena(1, torch.device("meta")).nbytes()
        slots = sum(buckets)
        if max_memory_bytes is not None and slots * self.bytes_per_stream > max_memory_bytes:
            raise AdmissionError(
                f"{op}: {slots} request slots need {slots * self.bytes_per_stream} bytes of arenas "
                f"({self.bytes_per_stream} bytes per stream in {str(self.dtype).replace('torch.', '')}) "
                f"> max_memory_bytes={max_memory_bytes}; {max_memory_bytes // self.bytes_per_stream} streams fit "
                "(use fewer slots, shorter max_prompt_frames/max_chunk_frames or append_in_place=False)")
        self.arenas = [self._arena(rows, self.device) for rows in sorted(buckets)]
        self._free = [list(range(a.rows)) for a in self.arenas]
        self._requests: dict[Hashable, _Request] = {}
        self.solve_fn = ArenaGraphSolver(solve_arena_chunk, max_graphs=max_graphs) if graphs else solve_arena_chunk

    def _arena(self, rows: int, device: torch.device) -> CacheArena:
        return CacheArena.allocate(self.config, self.cfm.n_timesteps, rows, self.max_cache_frames,
                                   self.max_chunk_frames, device, self.dtype, self._append,
                                   step_state=self.prompt_steps_per_tick is not None)

    # ------------------------------------------------------------------ requests
    @property
    def open_requests(self) -> list[Hashable]:
        return list(self._requests)

    @property
    def free_slots(self) -> int:
        """Request slots a new request can take now (a slot closed mid-prompt returns when its
        cohort ends)."""
        return sum(len(free) for free in self._free)

    def cache_length(self, request_id: Hashable) -> int:
        """Valid attention-cache frames of an open request (after the last trim)."""
        return self._get(request_id, "CFMServer.cache_length").cache_len

    def open_request(self, request_id: Hashable, spks: torch.Tensor, *, prompt_mu: Optional[torch.Tensor] = None,
                     prompt_mel: Optional[torch.Tensor] = None, prompt_len: Optional[int] = None
                     ) -> Optional[torch.Tensor]:
        """Reserve a slot for a request; solve its prompt as the first chunk when given.

        Args:
            request_id: any hashable, not already open.
            spks: (80,) or (1, 80) speaker embedding, kept for the request's life.
            prompt_mu: optional (80, P) or (1, 80, P) encoder output of the prompt tokens.
            prompt_mel: optional prompt mel of the same shape (the cond of the prompt chunk;
                None = zeros).
            prompt_len: P for the trim (default: prompt_mu's frames, else 0). When the prompt is
                not given here, the caller sends it as the first ``solve_chunk``.
        Returns:
            the prompt chunk's mel (80, P) when prompt_mu is given, else None. With
            ``prompt_steps_per_tick`` the prompt is staged and queued instead (None is returned):
            :meth:`advance_prompts` solves it over the next ticks, and the request takes chunks
            once :meth:`ready`.
        Raises:
            ValueError: duplicate id, bad shapes, prompt longer than max_prompt_frames.
            AdmissionError (a RuntimeError): no free slot (close a request first); the message
                names the slot limit and the bytes per stream.
        """
        op = "CFMServer.open_request"
        if request_id in self._requests:
            fail(op, "request_id", "not be open already", repr(request_id))
        spks = self._as_2d(op, "spks", spks, vector=True)
        if prompt_mu is not None:
            prompt_mu = self._as_2d(op, "prompt_mu", prompt_mu)
            if not 1 <= prompt_mu.shape[1] <= self.max_chunk_frames:
                fail(op, "prompt_mu", f"have 1..{self.max_chunk_frames} frames", str(prompt_mu.shape[1]),
                     "build the server with a larger max_prompt_frames")
            if prompt_len is None:
                prompt_len = prompt_mu.shape[1]
            if prompt_mel is not None:  # checked before a slot is taken: a refused call changes nothing
                prompt_mel = self._as_2d(op, "prompt_mel", prompt_mel)
                if prompt_mel.shape != prompt_mu.shape:
                    fail(op, "prompt_mel", f"have prompt_mu's shape {shape_str(prompt_mu)}", shape_str(prompt_mel))
        prompt_len = 0 if prompt_len is None else prompt_len
        if not isinstance(prompt_len, int) or not 0 <= prompt_len <= self.max_prompt_frames:
            fail(op, "prompt_len", f"be an int in [0, max_prompt_frames={self.max_prompt_frames}]",
                 repr(prompt_len), "build the server with a larger max_prompt_frames")
        bucket = next((b for b, free in enumerate(self._free) if free), None)
        if bucket is None:
            raise AdmissionError(
                f"{op}: no free request slot: all {sum(a.rows for a in self.arenas)} slots (max_requests/buckets) "
                f"are open, {self.bytes_per_stream} bytes per stream; close a request first or build the "
                "server with more slots")
        slot = self._free[bucket].pop(0)
        arena = self.arenas[bucket]
        arena.spks[slot].copy_(spks[0])
        arena.prompt_lengths[slot] = prompt_len
        arena.cache_lengths[slot] = 0
        arena.cnn[:, :, slot].zero_()  # a new request starts with zero conv history (SPEC §2)
        arena.cnn[:, :, arena.rows + slot].zero_()
        req = self._requests[request_id] = _Request(bucket, slot, prompt_len)
        if prompt_mu is None:
            return None
        if self.prompt_steps_per_tick is None:
            return self.solve_chunk({request_id: (prompt_mu, prompt_mel)})[request_id]
        self._stage(arena, self._groups([(request_id, req, prompt_mu, prompt_mel)]))
        req.pending = True
        self._admitting.setdefault(bucket, []).append((request_id, req, prompt_mu.shape[1]))
        return None

    def close_request(self, request_id: Hashable) -> None:
        """Free the request's slot (its rows become idle; caches are reused by the next request).
        A request whose prompt solve is under way leaves its cohort: its slot stays out of use
        until that cohort's last step (at most n / ``prompt_steps_per_tick`` ticks)."""
        req = self._get(request_id, "CFMServer.close_request")
        del self._requests[request_id]
        if req.pending:
            queued = self._admitting.get(req.bucket, [])
            if any(rid == request_id for rid, _, _ in queued):
                queued[:] = [item for item in queued if item[0] != request_id]
            else:
                cohort = next(c for c in self._cohorts if any(rid == request_id for rid, _, _ in c.items))
                cohort.closed.add(request_id)
                return  # the slot is released by _finish_cohort
        self._release(req.bucket, req.slot)

    def _release(self, bucket: int, slot: int) -> None:
        arena = self.arenas[bucket]
        arena.cache_lengths[slot] = 0
        arena.prompt_lengths[slot] = 0
        self._free[bucket].append(slot)
        self._free[bucket].sort()

    def ready(self, request_id: Hashable) -> bool:
        """Whether an open request takes chunks: False while its prompt solve is spread over ticks."""
        return not self._get(request_id, "CFMServer.ready").pending

    @property
    def pending_prompts(self) -> list[Hashable]:
        """Requests whose prompt solve is queued or under way (``prompt_steps_per_tick``)."""
        return [rid for rid, req in self._requests.items() if req.pending]

    def advance_prompts(self) -> dict[Hashable, torch.Tensor]:
        """Advance every queued prompt solve by ``prompt_steps_per_tick`` Euler steps (one call per
        serving tick, before its :meth:`solve_chunk`). Requests opened since the last call start
        now, as cohorts of slot-bucket sizes. Returns ``{request_id: prompt mel (80, P)}`` for the
        prompts whose last step ran; those requests are :meth:`ready` from now on. Without
        ``prompt_steps_per_tick`` there is nothing to advance ({})."""
        if self.prompt_steps_per_tick is None:
            return {}
        for bucket, queued in self._admitting.items():
            self._cohorts += self._form_cohorts(bucket, queued)
        self._admitting = {}
        done: dict[Hashable, torch.Tensor] = {}
        for cohort in list(self._cohorts):
            first = cohort.next_step
            cohort.next_step = min(first + self.prompt_steps_per_tick, self.cfm.n_timesteps)
            self._solve_cohort(cohort, (first, cohort.next_step))
            if cohort.next_step == self.cfm.n_timesteps:
                done.update(self._finish_cohort(cohort))
        return done

    def _cohort_sizes(self, count: int, rows: int) -> list[int]:
        """Group sizes of ``count`` prompts: the largest slot bucket that fits, repeatedly (exact
        sizes below the smallest bucket, or without slot buckets)."""
        buckets = [b for b in (self.slot_buckets or []) if b <= rows]
        sizes = []
        while count > 0:
            size = max((b for b in buckets if b <= count), default=count)
            sizes.append(size)
            count -= size
        return sizes

    def _form_cohorts(self, bucket: int, queued: list) -> list[_Cohort]:
        arena = self.arenas[bucket]
        cohorts, start = [], 0
        for size in self._cohort_sizes(len(queued), arena.rows):
            items = sorted(queued[start:start + size], key=lambda item: item[1].slot)
            start += size
            t_len = _round_up(max(t for _, _, t in items), self.chunk_buckets, arena.max_chunk_frames)
            index = None
            if size < arena.rows:
                index = self._host_values([req.slot for _, req, _ in items], torch.int64).to(
                    self.device, non_blocking=True)
            cohorts.append(_Cohort(bucket, items, t_len, index))
        return cohorts

    def _solve_cohort(self, cohort: _Cohort, steps: tuple[int, int]) -> None:
        arena = self.arenas[cohort.bucket]
        lengths = [0] * arena.rows
        for rid, req, t_n in cohort.items:
            lengths[req.slot] = 0 if rid in cohort.closed else t_n
        arena.valid_lengths.copy_(self._host_values(lengths, torch.int32), non_blocking=True)
        window = _round_up(0, self.cache_buckets, arena.max_cache_frames)
        self._solve(arena, cohort.t_len, window, cohort.index, steps)

    def _finish_cohort(self, cohort: _Cohort) -> dict[Hashable, torch.Tensor]:
        self._cohorts.remove(cohort)
        arena = self.arenas[cohort.bucket]
        by_length: dict[int, list] = {}
        for rid, req, t_n in cohort.items:
            if rid in cohort.closed:
                self._release(cohort.bucket, req.slot)
                continue
            req.cache_len = trimmed_length(t_n, req.prompt_len)
            req.chunks += 1
            req.pending = False
            by_length.setdefault(t_n, []).append((rid, req))
        return self._gather(arena, {t_n: (group, self._slot_index(group)) for t_n, group in by_length.items()})

    def request_caches(self, request_id: Hashable) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of a request's caches in the SPEC layout (valid frames only):
        cnn (n, depth, 2, 2C, 2), att (n, depth, 2, H, L, 2D); row 0 = cond, 1 = uncond."""
        req = self._get(request_id, "CFMServer.request_caches")
        return self.arenas[req.bucket].request_caches(req.slot, req.cache_len)

    def load_request_caches(self, request_id: Hashable, cnn: torch.Tensor, att: torch.Tensor) -> None:
        """Replace an open request's caches with ``cnn``/``att`` in the layout :meth:`request_caches`
        returns (e.g. caches a caller trimmed or built elsewhere): cnn (n, depth, 2, 2C, 2) and att
        (n, depth, 2, H, L, 2D), L <= ``max_cache_frames``; its next chunk continues from them.

        Raises:
            ValueError: unknown/closed id, or a cache of the wrong shape, dtype or device.
        """
        op = "CFMServer.load_request_caches"
        req = self._get(request_id, op)
        arena = self.arenas[req.bucket]
        cfg, n = self.config, arena.att.shape[0]
        want_cnn = (n, cfg.depth, 2, 2 * cfg.hidden, cfg.conv_cache_frames)
        if not isinstance(cnn, torch.Tensor) or tuple(cnn.shape) != want_cnn:
            fail(op, "cnn", f"be a tensor of shape {want_cnn}", shape_str(cnn) if isinstance(cnn, torch.Tensor)
                 else type(cnn).__name__)
        if not isinstance(att, torch.Tensor) or att.dim() != 6 or \
                tuple(att.shape[:4]) + (att.shape[5],) != (n, cfg.depth, 2, cfg.heads, 2 * cfg.head_dim):
            fail(op, "att", f"be a tensor of shape ({n}, {cfg.depth}, 2, {cfg.heads}, L, {2 * cfg.head_dim})",
                 shape_str(att) if isinstance(att, torch.Tensor) else type(att).__name__)
        if att.shape[4] > arena.max_cache_frames:
            fail(op, "att", f"hold at most max_cache_frames={arena.max_cache_frames} frames", str(att.shape[4]),
                 "trim the cache first")
        for name, t in (("cnn", cnn), ("att", att)):
            if t.dtype != arena.att.dtype or t.device != arena.att.device:
                fail(op, name, f"be {arena.att.dtype} on {arena.att.device}", f"{t.dtype} on {t.device}")
        arena.load_request_caches(req.slot, cnn, att)
        req.cache_len = att.shape[4]

    # ------------------------------------------------------------------ solving
    def solve_chunk(self, chunks: Mapping[Hashable, Any]) -> dict[Hashable, torch.Tensor]:
        """Solve one chunk for each given open request, all at once (ragged lengths allowed).

        Args:
            chunks: ``{request_id: mu}`` or ``{request_id: (mu, cond)}``; mu (80, T) or (1, 80, T)
                with 1 <= T <= max_chunk_frames; cond the same shape or None (zeros).
        Returns:
            ``{request_id: mel (80, T)}`` (new tensors).
        Raises:
            ValueError: unknown/closed id or bad shapes (the message names the request).
        """
        op = "CFMServer.solve_chunk"
        staged: dict[int, list[tuple[Hashable, _Request, torch.Tensor, Optional[torch.Tensor]]]] = {}
        for rid, item in chunks.items():
            req = self._get(rid, op)
            if req.pending:
                fail(op, f"chunks[{rid!r}]", "name a ready request", "a request whose prompt solve is under way",
                     "advance_prompts() solves it over the next ticks; ready(request_id) says when")
            mu, cond = item if isinstance(item, (tuple, list)) else (item, None)
            mu = self._as_2d(op, f"chunks[{rid!r}] mu", mu)
            t_len = mu.shape[1]
            if not 1 <= t_len <= self.max_chunk_frames:
                fail(op, f"chunks[{rid!r}] mu", f"have 1..{self.max_chunk_frames} frames", str(t_len),
                     "build the server with a larger max_chunk_frames")
            if cond is not None:
                cond = self._as_2d(op, f"chunks[{rid!r}] cond", cond)
                if cond.shape != mu.shape:
                    fail(op, f"chunks[{rid!r}] cond", f"have mu's shape {shape_str(mu)}", shape_str(cond))
            staged.setdefault(req.bucket, []).append((rid, req, mu, cond))
        out: dict[Hashable, torch.Tensor] = {}
        for bucket, items in staged.items():
            out.update(self._solve_bucket(bucket, items))
        return {rid: out[rid] for rid in chunks}

    def _solve_bucket(self, bucket: int, items) -> dict[Hashable, torch.Tensor]:
        arena = self.arenas[bucket]
        t_max = max(mu.shape[1] for _, _, mu, _ in items)
        t_len = _round_up(t_max, self.chunk_buckets, arena.max_chunk_frames)
        lengths = [0] * arena.rows
        for _, req, mu, _ in items:
            lengths[req.slot] = mu.shape[1]
        groups = self._stage(arena, self._groups(items))
        arena.valid_lengths.copy_(self._host_values(lengths, torch.int32), non_blocking=True)
        # Only the requests of this chunk are solved (compacted) unless every slot is busy.
        held = {r.slot: r.cache_len for r in self._requests.values() if r.bucket == bucket}
        slots = self._solve_slots(arena, sorted(req.slot for _, req, _, _ in items), held)
        slot_index = None
        if len(slots) < arena.rows:
            slot_index = self._host_values(slots, torch.int64).to(self.device, non_blocking=True)
        # Every solved slot (idle padding included) must fit in the cache window.
        longest_cache = max(held.get(slot, 0) for slot in slots)
        cache_frames = _round_up(longest_cache, self.cache_buckets, arena.max_cache_frames)
        self._solve(arena, t_len, cache_frames, slot_index)
        for _, req, mu, _ in items:
            req.cache_len = trimmed_length(req.cache_len + mu.shape[1], req.prompt_len)
            req.chunks += 1
        return self._gather(arena, groups)

    @staticmethod
    def _gather(arena: CacheArena, groups: dict[int, tuple[list, Optional[torch.Tensor]]]
                ) -> dict[Hashable, torch.Tensor]:
        """{request id: its solved mel (80, T_n)} from ``{T_n: (items, slot index)}`` (items start with
        (request id, _Request); :meth:`_slot_index` of them): one gather per length, split into views."""
        result = {}
        for t_n, (group, index) in groups.items():
            if index is None:
                rid, req = group[0][:2]
                result[rid] = arena.out_mel[req.slot, :, :t_n].clone()
            else:
                mel = arena.out_mel[:, :, :t_n].index_select(0, index)
                result.update({item[0]: mel[i] for i, item in enumerate(group)})
        return result

    def _slot_index(self, group: list) -> Optional[torch.Tensor]:
        """The (S,) int64 device index of the slots of ``group`` (items start with (request id,
        _Request)); None for one item (read and written by plain slicing)."""
        if len(group) == 1:
            return None
        return self._host_values([item[1].slot for item in group], torch.int64).to(self.device, non_blocking=True)

    @staticmethod
    def _groups(items) -> dict[int, list]:
        """The (request id, _Request, mu, cond) items by chunk length T_n."""
        groups: dict[int, list] = {}
        for item in items:
            groups.setdefault(item[2].shape[1], []).append(item)
        return groups

    def _stage(self, arena: CacheArena, groups: dict[int, list]) -> dict[int, tuple[list, Optional[torch.Tensor]]]:
        """Write the chunks' mu and cond into their slots: one copy per chunk length for all the
        requests of that length (a launch per request would leave the GPU idle for most of a
        tick's host time at 64 streams). Returns {T_n: (items, slot index or None for one item)}."""
        staged: dict[int, tuple[list, Optional[torch.Tensor]]] = {}
        for t_n, group in groups.items():
            if len(group) == 1:
                _, req, mu, cond = group[0]
                arena.mu[req.slot, :, :t_n].copy_(mu)
                if cond is None:
                    arena.cond[req.slot, :, :t_n].zero_()
                else:
                    arena.cond[req.slot, :, :t_n].copy_(cond)
                staged[t_n] = (group, None)
                continue
            index = self._slot_index(group)
            arena.mu[:, :, :t_n].index_copy_(0, index, torch.stack([mu for _, _, mu, _ in group]))
            if all(cond is None for _, _, _, cond in group):
                arena.cond[:, :, :t_n].index_fill_(0, index, 0)
            else:
                arena.cond[:, :, :t_n].index_copy_(0, index, torch.stack(
                    [torch.zeros_like(mu) if cond is None else cond for _, _, mu, cond in group]))
            staged[t_n] = (group, index)
        return staged

    def _solve(self, arena: CacheArena, t_len: int, cache_frames: int, slot_index: Optional[torch.Tensor],
               steps: Optional[tuple[int, int]] = None) -> None:
        """One solve of a bucket's arena at static shapes (T, Lb, S), or Euler steps ``steps`` of one
        spread over ticks: what ticks, prompt cohorts and warm-up run."""
        spread = {} if steps is None else dict(steps=steps, x_state=arena.x_state)
        self.solve_fn(
            self.cfm.estimator, arena.att, arena.cnn, self.noise,
            arena.mu[:, :, :t_len], arena.spks, arena.cond[:, :, :t_len],
            arena.valid_lengths, arena.cache_lengths, arena.prompt_lengths, arena.out_mel[:, :, :t_len],
            cache_frames=cache_frames, n_timesteps=self.cfm.n_timesteps, cfg_rate=self.cfm.cfg_rate,
            fused=self.fused, slots=slot_index, frame_keys=arena.frame_keys, **spread)

    # ------------------------------------------------------------------ start-up
    def warmup_shapes(self, *, chunk_frames: Optional[Iterable[int]] = None,
                      cache_frames: Optional[Iterable[int]] = None,
                      slot_counts: Optional[Iterable[int]] = None,
                      pairs: Optional[Iterable[tuple[int, int]]] = None) -> list[tuple[int, int, int, int]]:
        """Every solve shape (bucket, S, T, Lb) a prompt solve or tick can produce.

        T runs over the chunk buckets (clipped to the staging length; the staging length itself
        when a chunk or prompt can exceed the largest bucket), Lb over the cache buckets likewise,
        S over the slot buckets (the bucket's whole arena once S reaches it), per batch bucket.
        ``chunk_frames`` / ``cache_frames`` / ``slot_counts`` restrict or replace those sets;
        ``pairs`` replaces the T x Lb product by the (chunk frames, cache frames) pairs a workload
        meets (e.g. one stream's prompt and chunks under the trim). A solve's window covers the
        caches of the idle slots padding it to its slot bucket too, so with several streams a prompt
        length also meets the chunks' windows (``Token2wavServer.solve_pairs`` lists them). Given
        lengths are rounded up to the buckets exactly as a solve rounds them.

        Raises:
            ValueError: no ``chunk_buckets`` (or ``cache_buckets``) and no explicit list: exact
                lengths give a shape per length, which no warm-up can cover.
        """
        op = "CFMServer.warmup"
        pair_list = None
        if pairs is not None:
            pair_list = [tuple(p) for p in pairs]
            if not pair_list or any(len(p) != 2 or p[0] < 1 or p[1] < 0 for p in pair_list):
                fail(op, "pairs", "be a non-empty list of (chunk frames >= 1, cache frames >= 0)", repr(pairs))
        shapes = []
        for bucket, arena in enumerate(self.arenas):
            def chunk(v: int) -> int:
                return min(_round_up(v, self.chunk_buckets, arena.max_chunk_frames), arena.max_chunk_frames)

            def cache(v: int) -> int:
                return min(_round_up(v, self.cache_buckets, arena.max_cache_frames), arena.max_cache_frames)

            counts = _given(op, "slot_counts", slot_counts, 1, arena.rows) \
                or _reachable(self.slot_buckets, arena.rows, 1) or list(range(1, arena.rows + 1))
            counts = sorted({min(_round_up(c, self.slot_buckets, arena.rows), arena.rows) for c in counts})
            if pair_list is not None:
                sizes = sorted({(chunk(t), cache(lb)) for t, lb in pair_list})
            else:
                chunks = _given(op, "chunk_frames", chunk_frames, 1, arena.max_chunk_frames) \
                    or _reachable(self.chunk_buckets, arena.max_chunk_frames, 1)
                caches = _given(op, "cache_frames", cache_frames, 0, arena.max_cache_frames) \
                    or _reachable(self.cache_buckets, arena.max_cache_frames, 0)
                if chunks is None:
                    fail(op, "chunk_frames", "be given when the server has no chunk_buckets", "None",
                         "build the server with chunk_buckets=[...] (exact lengths give a shape per length)")
                if caches is None:
                    fail(op, "cache_frames", "be given when the server has no cache_buckets", "None",
                         "build the server with cache_buckets=[...] (exact lengths give a shape per length)")
                sizes = sorted({(chunk(t), cache(lb)) for t in chunks for lb in caches})
            shapes += [(bucket, s, t, lb) for s in counts for t, lb in sizes]
        return shapes

    def prompt_shapes(self, prompt_frames: Optional[Iterable[int]] = None) -> list[tuple[int, int, int, tuple]]:
        """Every (bucket, S, T, steps) a prompt cohort produces with ``prompt_steps_per_tick``: S over
        the cohort sizes (:meth:`advance_prompts`), T over ``prompt_frames`` (default
        ``max_prompt_frames``) rounded as a solve rounds them, steps over the spans of the
        schedule; cache window 0 (rounded up to the cache buckets). [] without pacing."""
        if self.prompt_steps_per_tick is None:
            return []
        given = [self.max_prompt_frames] if prompt_frames is None else [int(v) for v in prompt_frames]
        if not given or any(not 1 <= v <= self.max_chunk_frames for v in given):
            fail("CFMServer.warmup", "prompt_frames", f"be a non-empty list of ints in [1, {self.max_chunk_frames}]",
                 repr(prompt_frames))
        n, k = self.cfm.n_timesteps, self.prompt_steps_per_tick
        spans = [(s, min(s + k, n)) for s in range(0, n, k)]
        shapes = []
        for bucket, arena in enumerate(self.arenas):
            sizes = sorted({size for count in range(1, arena.rows + 1)
                            for size in self._cohort_sizes(count, arena.rows)})
            lengths = sorted({_round_up(v, self.chunk_buckets, arena.max_chunk_frames) for v in given})
            shapes += [(bucket, size, t, span) for size in sizes for t in lengths for span in spans]
        return shapes

    def warmup(self, *, progress: bool = True, chunk_frames: Optional[Iterable[int]] = None,
               cache_frames: Optional[Iterable[int]] = None,
               slot_counts: Optional[Iterable[int]] = None,
               pairs: Optional[Iterable[tuple[int, int]]] = None,
               prompt_frames: Optional[Iterable[int]] = None) -> WarmupReport:
        """Compile every kernel and capture every graph of the configured buckets, before serving.

        Runs each shape of :meth:`warmup_shapes` (the prompt solves' shapes included: a prompt is
        a chunk of up to ``max_prompt_frames``) on all-idle slots, so no cache or length changes;
        with ``graphs=True`` on CUDA each shape is run until its graph is captured, and the graph
        solver's budget is raised to hold them all. Afterwards no prompt solve or tick of these
        buckets compiles or captures (``solve_fn.captures`` / ``misses`` stay put).

        With ``prompt_steps_per_tick`` the prompt cohorts' step spans are warmed too
        (:meth:`prompt_shapes` of ``prompt_frames``); ``pairs`` then need only the chunks' (T, L).

        Args:
            progress: one stderr line per shape (False = silent).
            chunk_frames, cache_frames, slot_counts, pairs: see :meth:`warmup_shapes`.
            prompt_frames: prompt lengths whose spread solves to warm (default
                ``max_prompt_frames``; ignored without ``prompt_steps_per_tick``).
        Returns:
            :class:`WarmupReport` (shapes, graph count, graph-pool and arena bytes, seconds).
        Raises:
            RuntimeError: requests are open (warm up at start-up: an idle slot's cache must fit
                every warmed cache window).
            ValueError: see :meth:`warmup_shapes`.
        """
        if self._requests:
            raise RuntimeError(f"CFMServer.warmup: {len(self._requests)} requests are open; warm up before "
                               "opening requests")
        shapes = [(*shape, None) for shape in self.warmup_shapes(
            chunk_frames=chunk_frames, cache_frames=cache_frames, slot_counts=slot_counts, pairs=pairs)]
        window = _round_up(0, self.cache_buckets, self.max_cache_frames)
        shapes += [(bucket, size, t, window, span) for bucket, size, t, span in self.prompt_shapes(prompt_frames)]
        solver = self.solve_fn if isinstance(self.solve_fn, ArenaGraphSolver) else None
        if solver is not None:  # keep every warmed key (and any held before)
            solver.max_graphs = max(solver.max_graphs, len(shapes) + len(solver.entries()))
        calls = solver.calls_per_capture(self.device) if solver is not None else 1
        start = time.perf_counter()
        report = WarmupReport(arena_bytes=sum(a.nbytes() for a in self.arenas))
        for i, (bucket, n_slots, t_len, lb, span) in enumerate(shapes):
            arena = self.arenas[bucket]
            tick = time.perf_counter()
            arena.valid_lengths.zero_()  # every slot idle: caches, lengths and Euler states come out unchanged
            index = None if n_slots >= arena.rows else torch.arange(n_slots, device=self.device)
            with torch.no_grad():
                for _ in range(calls):
                    self._solve(arena, t_len, lb, index, span)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            label = dict(rows=arena.rows, slots=n_slots, t_len=t_len, cache_frames=lb)
            if span is not None:
                label["steps"] = span
            report.shapes.append(label)
            if progress:
                print(f"CFMServer.warmup [{i + 1}/{len(shapes)}] slots {n_slots}/{arena.rows} T={t_len} "
                      f"Lb={lb}{'' if span is None else f' steps {span[0]}-{span[1]}'}: "
                      f"{time.perf_counter() - tick:.2f} s", file=sys.stderr, flush=True)
        report.seconds = time.perf_counter() - start
        if solver is not None:
            report.graphs, report.graph_pool_bytes = solver.graph_count, solver.pool_bytes
        if progress:
            print(f"CFMServer.{report}", file=sys.stderr, flush=True)
        return report

    def memory_plan(self) -> MemoryPlan:
        """Bytes per stream and in all of the arenas (compute dtype), plus captured graph pools."""
        pools = self.solve_fn.pool_bytes if isinstance(self.solve_fn, ArenaGraphSolver) else 0
        return MemoryPlan(dtype=self.dtype, bytes_per_stream=self.bytes_per_stream,
                          slots=sum(a.rows for a in self.arenas), arena_bytes=sum(a.nbytes() for a in self.arenas),
                          graph_pool_bytes=pools, max_memory_bytes=self.max_memory_bytes)

    # ------------------------------------------------------------------ helpers
    def _host_values(self, values: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor to copy to the device without a host sync: pinned on CUDA (a copy from
        pageable memory makes the host wait for the stream, i.e. for the previous chunk's solve,
        so the next graph launch could not overlap it). The caching host allocator keeps the
        pinned block until the asynchronous copy has run."""
        host = torch.tensor(values, dtype=dtype)
        return host.pin_memory() if self.device.type == "cuda" else host

    def _solve_slots(self, arena: CacheArena, active: list[int], held: Mapping[int, int]) -> list[int]:
        """The slots one solve covers: the active ones, padded with idle slots (0 frames this
        chunk, caches unchanged) up to a ``slot_buckets`` size so solve shapes repeat. Padding
        takes free slots first, then the open requests' slots with the shortest caches (``held``:
        slot -> cache frames): the cache window covers every solved slot, so padding with a
        settled stream's slot would widen a prompt solve's window (another shape, more work)."""
        target = _round_up(len(active), self.slot_buckets, arena.rows)
        if target >= arena.rows:
            return list(range(arena.rows))
        taken = set(active)
        spare = sorted((s for s in range(arena.rows) if s not in taken), key=lambda s: (held.get(s, 0), s))
        return sorted(active + spare[:target - len(active)])

    def _get(self, request_id: Hashable, op: str) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            fail(op, "request_id", "name an open request", repr(request_id),
                 f"open requests: {list(self._requests)[:8]}")
        return req  # type: ignore[return-value]

    def _as_2d(self, op: str, arg: str, t: Any, vector: bool = False) -> torch.Tensor:
        mel = self.config.out_channels
        if not isinstance(t, torch.Tensor):
            fail(op, arg, "be a torch.Tensor", type(t).__name__)
        if vector:
            if t.shape not in ((mel,), (1, mel)):
                fail(op, arg, f"have shape ({mel},) or (1, {mel})", shape_str(t))
            return t.reshape(1, mel).to(device=self.device, dtype=self.dtype)
        if t.dim() == 3 and t.shape[0] == 1:
            t = t[0]
        if t.dim() != 2 or t.shape[0] != mel:
            fail(op, arg, f"have shape ({mel}, T) or (1, {mel}, T)", shape_str(t))
        return t.to(device=self.device, dtype=self.dtype)

    def describe(self) -> str:
        arenas = ", ".join(a.describe() for a in self.arenas)
        return f"CFMServer({len(self._requests)} open; {arenas})"

    AdmissionError = AdmissionError


def _given(op: str, arg: str, values: Optional[Iterable[int]], low: int, high: int) -> Optional[list[int]]:
    """An explicit warm-up list, checked and clipped to [low, high] (None when not given)."""
    if values is None:
        return None
    out = sorted({int(v) for v in values})
    if not out or any(v < low for v in out):
        fail(op, arg, f"be a non-empty list of ints >= {low}", repr(values))
    return sorted({min(v, high) for v in out})


StreamingCFM.server_class = CFMServer
