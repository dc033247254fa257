"""``CFMServer``: many streams' CFM solves over preallocated cache arenas, any subset per tick.

Requests are opened with a speaker embedding and a prompt (solved as the request's first chunk,
cond = prompt mel, as the upstream cache setup does); then any subset of open requests is solved
together, one chunk each, even when their chunk and cache lengths differ. Caches live in one keyed
:class:`~torch_cfm.models.cache.CacheArena` per batch bucket, allocated once (docs/design.md §8);
each solve runs the one engine (:class:`~torch_cfm.solve.ArenaSolver`) over a bucket's slots
(slots without a chunk are idle rows, left unchanged), so its shapes depend only on the bucket and
the bucketed chunk and cache lengths (:class:`~torch_cfm.buckets.Buckets`), ready for CUDA graphs.

    >>> server = CFMServer(cfm, max_requests=4, max_prompt_frames=300, chunk_buckets=[50],
    ...                    cache_buckets=[0, 200, 400], slot_buckets=[1, 4], graphs=True)
    >>> report = server.warmup()                                      # every graph, captured
    >>> server.open_request("a", spks_a, prompt_mu=mu_p, prompt_mel=mel_p)
    >>> out = server.solve_chunk({"a": mu_chunk, "b": (mu_b, None)})   # {"a": (80, T_a), ...}
    >>> server.close_request("a")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Mapping, Optional, Sequence

import torch

from ..buckets import Buckets
from ..errors import fail, shape_str
from ..graphs import GraphCache
from ..models.cache import TRIM_KEEP_OLDEST, CacheArena, trimmed_length
from ..solve import GraphedArenaSolver, StreamingCFM
from . import warmup as _warmup
from .prompt_cohorts import PromptCohorts
from .reports import AdmissionError, MemoryPlan, WarmupReport
from .voice_cache import VoiceCache, VoiceState, content_key, open_voices, state_mismatch


@dataclass
class _Request:
    bucket: int
    slot: int
    prompt_len: int
    cache_len: int = 0  # host mirror of arena.cache_lengths[slot]
    chunks: int = 0
    pending: bool = False  # its prompt solve is spread over ticks and not finished
    voice: Optional[Hashable] = None  # the voice-cache key its prompt solve is kept under
    voice_extra: Optional[dict] = None  # other stages' prompt state kept with it


class CFMServer:
    """Streaming CFM server: open/close requests, solve chunks for any subset at once.

    Args:
        cfm: the :class:`~torch_cfm.solve.StreamingCFM` (estimator + noise + schedule).
        max_requests: request slots in total (default 4); split into ``buckets`` when given.
        buckets: slots per batch bucket, e.g. (1, 4, 8): one arena each; a request takes a free
            slot of the smallest bucket that has one. Default: one bucket of ``max_requests``.
        max_prompt_frames: longest prompt P; arenas hold ``P + 100`` cache frames (the trim bound).
        max_chunk_frames: longest chunk (default 100); staging holds ``max(P, this)`` frames so the
            prompt fits as a chunk.
        chunk_buckets / cache_buckets / slot_buckets: optional sorted chunk lengths T, cache
            windows Lb and solved-slot counts S a solve is rounded up to (fewer distinct shapes for
            CUDA graphs; :class:`~torch_cfm.buckets.Buckets`); default: exact.
        device, dtype: of the arenas (default: the estimator's parameters').
        fused: the fused body (None = the dispatch policy).
        append_in_place: give each attention cache ``max_chunk_frames`` extra frames (+25 % arena
            bytes at the defaults) so that a chunk solved over every slot of a bucket appends its
            keys in place and trims by refilling dropped frames (default True). False, or a solve
            of some slots only: the rows are copied out per step and only changed frames copied
            back. Either way the arena is keyed.
        graphs: replay each solve shape from a CUDA graph (:class:`~torch_cfm.solve.GraphedArenaSolver`;
            eager on CPU and where a capture fails). Pair with the bucket tables.
        max_graphs: the graph cache's budget (LRU; default 8); :meth:`warmup` raises it to the
            number of shapes it warms.
        max_memory_bytes: optional limit on the arenas' (and voice cache's) bytes; a configuration
            over it raises :class:`AdmissionError` naming the limit, the bytes per stream and the
            streams that fit.
        prompt_steps_per_tick: None (default): a prompt is solved whole when its request opens.
            An int k in [1, n]: prompt solves are spread over ticks, k Euler steps per
            :meth:`advance_prompts` call, with the same result (:mod:`~torch_cfm.serving.prompt_cohorts`):
            tick times stay near their median under bursty arrivals, at the price of n/k ticks
            before a new request's first chunk.
        voice_cache_bytes: keep solved prompts (at most this many bytes, LRU) and copy them into
            every request that opens with the same voice instead of solving again
            (:mod:`~torch_cfm.serving.voice_cache`; ``open_request(voice=...)``). None: no cache.
    Attributes:
        arenas: list of :class:`~torch_cfm.models.cache.CacheArena`, one per bucket (never reallocated).
        solver: the per-bucket solve (:class:`~torch_cfm.solve.ArenaSolver`, or its graphed form).
        graph_cache: the :class:`~torch_cfm.graphs.GraphCache` of the solves (None without graphs).
        voices: the :class:`~torch_cfm.serving.voice_cache.VoiceCache` (None without one).
        buckets: the :class:`~torch_cfm.buckets.Buckets` of the solves.
        bytes_per_stream: arena bytes of one request slot (:class:`MemoryPlan`).
    """

    def __init__(self, cfm: StreamingCFM, *, max_requests: int = 4, buckets: Optional[Sequence[int]] = None,
                 max_prompt_frames: int = 300, max_chunk_frames: int = 100,
                 chunk_buckets: Optional[Sequence[int]] = None, cache_buckets: Optional[Sequence[int]] = None,
                 slot_buckets: Optional[Sequence[int]] = None,
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None,
                 fused: Optional[bool] = None, graphs: bool = False, append_in_place: bool = True,
                 max_graphs: int = 8, max_memory_bytes: Optional[int] = None,
                 prompt_steps_per_tick: Optional[int] = None, voice_cache_bytes: Optional[int] = None) -> None:
        op = "CFMServer"
        for name, val in (("max_requests", max_requests), ("max_chunk_frames", max_chunk_frames)):
            if not isinstance(val, int) or val <= 0:
                fail(op, name, "be a positive int", repr(val))
        if not isinstance(max_prompt_frames, int) or max_prompt_frames < 0:
            fail(op, "max_prompt_frames", "be an int >= 0", repr(max_prompt_frames))
        slot_counts = tuple(buckets) if buckets is not None else (max_requests,)
        if not slot_counts or any(not isinstance(b, int) or b <= 0 for b in slot_counts):
            fail(op, "buckets", "be a non-empty sequence of positive ints", repr(buckets))
        if prompt_steps_per_tick is not None and (
                not isinstance(prompt_steps_per_tick, int) or isinstance(prompt_steps_per_tick, bool)
                or not 1 <= prompt_steps_per_tick <= cfm.n_timesteps):
            fail(op, "prompt_steps_per_tick", f"be None or an int in [1, n_timesteps={cfm.n_timesteps}]",
                 repr(prompt_steps_per_tick))
        for name, val in (("max_memory_bytes", max_memory_bytes), ("voice_cache_bytes", voice_cache_bytes)):
            if val is not None and (not isinstance(val, int) or isinstance(val, bool) or val <= 0):
                fail(op, name, "be a positive int (bytes) or None", repr(val))
        param = next(cfm.estimator.parameters())
        self.cfm, self.config = cfm, cfm.estimator.config
        self.device = torch.device(device) if device is not None else param.device
        self.dtype = dtype or param.dtype
        self.fused = fused
        self.max_prompt_frames = max_prompt_frames
        self.max_cache_frames = max_prompt_frames + TRIM_KEEP_OLDEST
        self.max_chunk_frames = max(max_chunk_frames, max_prompt_frames)
        self.buckets = Buckets.of(chunk_buckets, cache_buckets, slot_buckets)
        self.noise = cfm.noise.to(device=self.device, dtype=self.dtype)
        self.prompt_steps_per_tick = prompt_steps_per_tick
        self._cohorts = PromptCohorts(self, prompt_steps_per_tick) if prompt_steps_per_tick is not None else None
        self.max_memory_bytes = max_memory_bytes
        self._append = max_chunk_frames if append_in_place else 0
        self.bytes_per_stream = self._arena(1, torch.device("meta")).nbytes()
        self._check_budget(sum(slot_counts), voice_cache_bytes or 0)
        self.arenas = [self._arena(rows, self.device) for rows in sorted(slot_counts)]
        self._free = [list(range(a.rows)) for a in self.arenas]
        self._requests: dict[Hashable, _Request] = {}
        self.voices = VoiceCache(voice_cache_bytes) if voice_cache_bytes is not None else None
        solver = cfm.solver(fused)
        self.graph_cache = GraphCache("CFMServer", max_graphs=max_graphs) if graphs else None
        self.solver = GraphedArenaSolver(solver, self.graph_cache) if graphs else solver

    def _check_budget(self, slots: int, voice_bytes: int) -> None:
        need = slots * self.bytes_per_stream + voice_bytes
        limit = self.max_memory_bytes
        if limit is not None and need > limit:
            raise AdmissionError(
                f"CFMServer: {slots} request slots need {slots * self.bytes_per_stream} bytes of arenas "
                f"({self.bytes_per_stream} bytes per stream in {str(self.dtype).replace('torch.', '')})"
                + (f" and the voice cache {voice_bytes}" if voice_bytes else "")
                + f" > max_memory_bytes={limit}; {max(limit - voice_bytes, 0) // self.bytes_per_stream} streams fit "
                "(use fewer slots, shorter max_prompt_frames/max_chunk_frames or append_in_place=False)")

    def _arena(self, rows: int, device: torch.device) -> CacheArena:
        return CacheArena.allocate(self.config, self.cfm.n_timesteps, rows, self.max_cache_frames,
                                   self.max_chunk_frames, device, self.dtype, self._append,
                                   step_state=self.prompt_steps_per_tick is not None)

    # ------------------------------------------------------------------ bucket tables
    @property
    def chunk_buckets(self) -> Optional[list[int]]:
        return None if self.buckets.chunks is None else list(self.buckets.chunks)

    @property
    def cache_buckets(self) -> Optional[list[int]]:
        return None if self.buckets.caches is None else list(self.buckets.caches)

    @property
    def slot_buckets(self) -> Optional[list[int]]:
        return None if self.buckets.slots is None else list(self.buckets.slots)

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

    def open_request(self, request_id: Hashable, spks: Optional[torch.Tensor] = None, *,
                     prompt_mu: Optional[torch.Tensor] = None, prompt_mel: Optional[torch.Tensor] = None,
                     prompt_len: Optional[int] = None, voice: Optional[Hashable] = None,
                     voice_extra: Optional[dict] = None) -> Optional[torch.Tensor]:
        """Reserve a slot for a request; solve its prompt as the first chunk when given.

        Args:
            request_id: any hashable, not already open.
            spks: (80,) or (1, 80) speaker embedding, kept for the request's life (may be omitted
                when ``voice`` names a cached voice: the voice's own is used).
            prompt_mu: optional (80, P) or (1, 80, P) encoder output of the prompt tokens.
            prompt_mel: optional prompt mel of the same shape (the cond of the prompt chunk;
                None = zeros).
            prompt_len: P for the trim (default: prompt_mu's frames, else 0). When the prompt is
                not given here, the caller sends it as the first ``solve_chunk``.
            voice: with a voice cache, the key its solved prompt is kept under (default: the
                content of spks, prompt_mu, prompt_mel and P). A voice already kept is copied into
                the slot instead of solved (also with ``prompt_steps_per_tick``: the request is
                ready at once); then the prompt tensors may be omitted. False: neither looked up
                nor kept.
            voice_extra: other stages' prompt state to keep with the voice (returned by
                :meth:`voice_state` on later hits).
        Returns:
            the prompt chunk's mel (80, P) when prompt_mu is given, else None. With
            ``prompt_steps_per_tick`` and no cached voice the prompt is staged and queued instead
            (None is returned): :meth:`advance_prompts` solves it over the next ticks, and the
            request takes chunks once :meth:`ready`.
        Raises:
            ValueError: duplicate id, bad shapes, prompt longer than max_prompt_frames.
            AdmissionError (a RuntimeError): no free slot (close a request first); the message
                names the slot limit and the bytes per stream.
        """
        op = "CFMServer.open_request"
        if request_id in self._requests:
            fail(op, "request_id", "not be open already", repr(request_id))
        cached = None
        if voice is not None and voice is not False and self.voices is not None and prompt_mu is None:
            cached = self.voices.peek(voice)
            if cached is None:
                fail(op, "voice", "name a cached voice when no prompt is given", repr(voice))
            spks = cached.spks if spks is None else spks
        if spks is None:
            fail(op, "spks", "be given (or a cached voice)", "None")
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
        if cached is not None:
            prompt_len = cached.prompt_len
        key = voice if cached is not None else None
        if self.voices is not None and prompt_mu is not None and voice is not False:
            key = voice if voice is not None else content_key(spks, prompt_mu, prompt_mel, prompt_len, self.dtype)
        bucket, state = self._free_bucket(op), None if key is None else self.voices.get(key)
        req = self._take_slot(request_id, bucket, spks, prompt_len, fresh=state is None)
        if state is not None:
            return self._restore_voice(req, state)
        if prompt_mu is None:
            return None
        req.voice, req.voice_extra = key, voice_extra
        if self._cohorts is None:
            mel = self.solve_chunk({request_id: (prompt_mu, prompt_mel)})[request_id]
            self.remember_voice(request_id, req, mel)
            return mel
        self._stage(self.arenas[req.bucket], self._groups([(request_id, req, prompt_mu, prompt_mel)]))
        req.pending = True
        self._cohorts.queue(request_id, req, prompt_mu.shape[1])
        return None

    def open_copy(self, request_id: Hashable, state: VoiceState) -> torch.Tensor:
        """Open a request from a copy of ``state`` (a :meth:`prompt_state` of this server), without
        a solve: ready at once. Returns its prompt mel (80, P). Raises as :meth:`open_request`."""
        op = "CFMServer.open_copy"
        if request_id in self._requests:
            fail(op, "request_id", "not be open already", repr(request_id))
        why = state_mismatch(state, self.arenas[0], self.max_prompt_frames)
        if why:
            fail(op, "state", "be a prompt state of this server (CFMServer.prompt_state)", why)
        req = self._take_slot(request_id, self._free_bucket(op), state.spks[None], state.prompt_len, fresh=False)
        return self._restore_voice(req, state)

    def _free_bucket(self, op: str) -> int:
        """The first bucket with a free slot (AdmissionError: none)."""
        bucket = next((b for b, free in enumerate(self._free) if free), None)
        if bucket is None:
            raise AdmissionError(
                f"{op}: no free request slot: all {sum(a.rows for a in self.arenas)} slots (max_requests/buckets) "
                f"are open, {self.bytes_per_stream} bytes per stream; close a request first or build the "
                "server with more slots")
        return bucket

    def _take_slot(self, request_id: Hashable, bucket: int, spks: torch.Tensor, prompt_len: int, fresh=True) -> _Request:
        slot = self._free[bucket].pop(0)
        arena = self.arenas[bucket]
        arena.spks[slot].copy_(spks[0])
        arena.prompt_lengths[slot] = prompt_len
        if fresh:  # a new request starts with zero conv history (docs/design.md §2); not fresh: a voice restored
            arena.cache_lengths[slot] = 0
            arena.cnn[:, :, slot::arena.rows].zero_()  # its cond and uncond rows
        self._requests[request_id] = req = _Request(bucket, slot, prompt_len)
        return req

    def close_request(self, request_id: Hashable) -> None:
        """Free the request's slot (its rows become idle; caches are reused by the next request).
        A request whose prompt solve is under way leaves its cohort: its slot stays out of use
        until that cohort's last step (at most n / ``prompt_steps_per_tick`` ticks)."""
        req = self._get(request_id, "CFMServer.close_request")
        del self._requests[request_id]
        if req.pending and not self._cohorts.leave(request_id, req):
            return  # the slot is released when its cohort ends
        self.release(req.bucket, req.slot)

    def release(self, bucket: int, slot: int) -> None:
        """A slot back to the free list (its caches are reused by the next request)."""
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
        return {} if self._cohorts is None else self._cohorts.advance()

    # ------------------------------------------------------------------ voices
    def remember_voice(self, request_id: Hashable, req: _Request, mel: torch.Tensor) -> None:
        """After a request's prompt solve: keep its slot's state under its voice key (with a voice cache)."""
        if self.voices is not None and req.voice is not None:
            self.keep_voice(request_id, req.voice, mel, req.voice_extra)
        req.voice_extra = None  # kept with the voice (or not at all): the request holds no copy

    def keep_voice(self, request_id: Hashable, voice: Hashable, mel: torch.Tensor, extra: Optional[dict] = None) -> bool:
        """Keep an open request's state (right after its prompt solve) under ``voice`` in the voice
        cache, with ``mel`` (its prompt mel, (80, P)) and other stages' ``extra`` state. Returns
        whether it was kept (False without a voice cache, or when it exceeds the cache's budget)."""
        self._get(request_id, "CFMServer.keep_voice")
        return self.voices is not None and self.voices.put(voice, self.prompt_state(request_id, mel, extra))

    def prompt_state(self, request_id: Hashable, mel: torch.Tensor, extra: Optional[dict] = None) -> VoiceState:
        """A copy of an open request's state right after its prompt solve (its slot's caches, P and
        speaker embedding) with its prompt ``mel`` (80, P) and other stages' ``extra`` state."""
        req = self._get(request_id, "CFMServer.prompt_state")
        if req.pending or req.chunks != 1:
            fail("CFMServer.prompt_state", "request_id", "name a request just after its prompt solve", repr(request_id))
        return VoiceState.of_slot(self.arenas[req.bucket], req.slot, req.cache_len, req.prompt_len, mel, extra)

    def voice_state(self, voice: Hashable) -> Optional[VoiceState]:
        """The cached state of ``voice`` (None: not cached, or no voice cache); not counted as a lookup."""
        return None if self.voices is None else self.voices.peek(voice)

    def open_voices(self, requests: Mapping[Hashable, Hashable]) -> dict[Hashable, torch.Tensor]:
        """Open requests from cached voices ({request id: voice}), as :meth:`open_request` with
        ``voice=`` and no prompt does for each (counted hits, ready at once), the requests of one
        voice restored together in a fixed number of launches (:func:`~torch_cfm.serving.voice_cache.
        open_voices`). Returns {request id: prompt mel (80, P)}.

        Raises:
            ValueError: an id already open, a voice not cached (nothing is opened).
            AdmissionError: fewer free slots than requests (nothing is opened).
        """
        return open_voices(self, requests, _Request)

    def _restore_voice(self, req: _Request, state: VoiceState) -> torch.Tensor:
        """A prompt state into the request's slot (bitwise its solve's state); the prompt mel returned."""
        state.restore(self.arenas[req.bucket], req.slot)
        req.cache_len, req.chunks = state.cache_len, 1
        return state.mel.clone()

    # ------------------------------------------------------------------ caches
    def request_caches(self, request_id: Hashable) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of a request's caches in the upstream layout (valid frames only):
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
        self.arenas[req.bucket].load_request_caches(req.slot, cnn, att, op=op)  # checked before anything is written
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
        staged: dict[int, list] = {}
        for rid, item in chunks.items():
            req = self._get(rid, op)
            if req.pending:
                fail(op, f"chunks[{rid!r}]", "name a ready request", "a request whose prompt solve is under way",
                     "advance_prompts() solves it over the next ticks; ready(request_id) says when")
            mu, cond = item if isinstance(item, (tuple, list)) else (item, None)
            mu = self._as_2d(op, f"chunks[{rid!r}] mu", mu)
            if not 1 <= mu.shape[1] <= self.max_chunk_frames:
                fail(op, f"chunks[{rid!r}] mu", f"have 1..{self.max_chunk_frames} frames", str(mu.shape[1]),
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
        t_len = self.buckets.chunk(max(mu.shape[1] for _, _, mu, _ in items), arena.max_chunk_frames)
        lengths = [0] * arena.rows
        for _, req, mu, _ in items:
            lengths[req.slot] = mu.shape[1]
        groups = self._stage(arena, self._groups(items))
        arena.valid_lengths.copy_(self.host_values(lengths, torch.int32), non_blocking=True)
        # Only the requests of this chunk are solved (compacted) unless every slot is busy.
        held = {r.slot: r.cache_len for r in self._requests.values() if r.bucket == bucket}
        slots = self._solve_slots(arena, sorted(req.slot for _, req, _, _ in items), held)
        slot_index = self.device_index(slots) if len(slots) < arena.rows else None
        # Every solved slot (idle padding included) must fit in the cache window.
        cache_frames = self.buckets.cache(max(held.get(slot, 0) for slot in slots), arena.max_cache_frames)
        self.solve_arena(arena, t_len, cache_frames, slot_index)
        for _, req, mu, _ in items:
            req.cache_len = trimmed_length(req.cache_len + mu.shape[1], req.prompt_len)
            req.chunks += 1
        return self.gather(arena, groups)

    def solve_arena(self, arena: CacheArena, t_len: int, cache_frames: int, slots: Optional[torch.Tensor],
                    steps: Optional[tuple[int, int]] = None) -> None:
        """One solve of a bucket's arena at static shapes (T, Lb, S), or Euler steps ``steps`` of one
        spread over ticks: what ticks, prompt cohorts and the warm-up run."""
        self.solver(arena, self.noise, t_len=t_len, cache_frames=cache_frames, slots=slots, steps=steps)

    @staticmethod
    def gather(arena: CacheArena, groups: dict[int, tuple[list, Optional[torch.Tensor]]]) -> dict[Hashable, torch.Tensor]:
        """{request id: its solved mel (80, T_n)} from ``{T_n: (items, slot index)}`` (items start with
        (request id, request); :meth:`slot_index` of them): one gather per length, split into views."""
        result = {}
        for t_n, (group, index) in groups.items():
            if index is None:
                rid, req = group[0][:2]
                result[rid] = arena.out_mel[req.slot, :, :t_n].clone()
            else:
                mel = arena.out_mel[:, :, :t_n].index_select(0, index)
                result.update({item[0]: mel[i] for i, item in enumerate(group)})
        return result

    def slot_index(self, group: list) -> Optional[torch.Tensor]:
        """The (S,) int64 device index of the slots of ``group`` (items start with (request id,
        request)); None for one item (read and written by plain slicing)."""
        return None if len(group) == 1 else self.device_index([item[1].slot for item in group])

    @staticmethod
    def _groups(items) -> dict[int, list]:
        """The (request id, request, mu, cond) items by chunk length T_n."""
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
            index = self.slot_index(group)
            arena.mu[:, :, :t_n].index_copy_(0, index, torch.stack([mu for _, _, mu, _ in group]))
            if all(cond is None for _, _, _, cond in group):
                arena.cond[:, :, :t_n].index_fill_(0, index, 0)
            else:
                arena.cond[:, :, :t_n].index_copy_(0, index, torch.stack(
                    [torch.zeros_like(mu) if cond is None else cond for _, _, mu, cond in group]))
            staged[t_n] = (group, index)
        return staged

    def _solve_slots(self, arena: CacheArena, active: list[int], held: Mapping[int, int]) -> list[int]:
        """The slots one solve covers: the active ones, padded with idle slots (0 frames this
        chunk, caches unchanged) up to a slot bucket so solve shapes repeat. Padding takes free
        slots first, then the open requests' slots with the shortest caches (``held``: slot ->
        cache frames): the cache window covers every solved slot, so padding with a settled
        stream's slot would widen a prompt solve's window (another shape, more work)."""
        target = self.buckets.slot_count(len(active), arena.rows)
        if target >= arena.rows:
            return list(range(arena.rows))
        taken = set(active)
        spare = sorted((s for s in range(arena.rows) if s not in taken), key=lambda s: (held.get(s, 0), s))
        return sorted(active + spare[:target - len(active)])

    # ------------------------------------------------------------------ start-up
    def warmup_shapes(self, *, chunk_frames: Optional[Iterable[int]] = None,
                      cache_frames: Optional[Iterable[int]] = None, slot_counts: Optional[Iterable[int]] = None,
                      pairs: Optional[Iterable[tuple[int, int]]] = None) -> list[tuple[int, int, int, int]]:
        """Every solve shape (bucket, S, T, Lb) a prompt solve or tick can produce
        (:func:`torch_cfm.serving.warmup.warmup_shapes`)."""
        return _warmup.warmup_shapes(self, chunk_frames=chunk_frames, cache_frames=cache_frames,
                                     slot_counts=slot_counts, pairs=pairs)

    def prompt_shapes(self, prompt_frames: Optional[Iterable[int]] = None) -> list[tuple[int, int, int, tuple]]:
        """Every (bucket, S, T, steps) a prompt cohort produces (:func:`torch_cfm.serving.warmup.prompt_shapes`)."""
        return _warmup.prompt_shapes(self, prompt_frames)

    def warmup(self, *, progress: bool = True, chunk_frames: Optional[Iterable[int]] = None,
               cache_frames: Optional[Iterable[int]] = None, slot_counts: Optional[Iterable[int]] = None,
               pairs: Optional[Iterable[tuple[int, int]]] = None, prompt_frames: Optional[Iterable[int]] = None,
               voices: Optional[Mapping[Hashable, tuple]] = None) -> WarmupReport:
        """Compile every kernel and capture every graph of the configured buckets, and solve the
        given voices ahead, before serving (:func:`torch_cfm.serving.warmup.warmup`)."""
        return _warmup.warmup(self, progress=progress, chunk_frames=chunk_frames, cache_frames=cache_frames,
                              slot_counts=slot_counts, pairs=pairs, prompt_frames=prompt_frames, voices=voices)

    def memory_plan(self) -> MemoryPlan:
        """Bytes per stream and in all of the arenas (compute dtype), plus captured graph pools and
        the voice cache's budget."""
        return MemoryPlan(dtype=self.dtype, bytes_per_stream=self.bytes_per_stream,
                          slots=sum(a.rows for a in self.arenas), arena_bytes=sum(a.nbytes() for a in self.arenas),
                          graph_pool_bytes=0 if self.graph_cache is None else self.graph_cache.pool_bytes,
                          voice_cache_bytes=0 if self.voices is None else self.voices.max_bytes,
                          max_memory_bytes=self.max_memory_bytes)

    # ------------------------------------------------------------------ helpers
    def host_values(self, values: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor to copy to the device without a host sync: pinned on CUDA (a copy from
        pageable memory makes the host wait for the stream, i.e. for the previous chunk's solve,
        so the next graph launch could not overlap it). The caching host allocator keeps the
        pinned block until the asynchronous copy has run."""
        host = torch.tensor(values, dtype=dtype)
        return host.pin_memory() if self.device.type == "cuda" else host

    def device_index(self, slots: Sequence[int]) -> torch.Tensor:
        """(S,) int64 slot index on the device, copied without a host sync."""
        return self.host_values(slots, torch.int64).to(self.device, non_blocking=True)

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


__all__ = ["CFMServer"]
