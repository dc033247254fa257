"""A server's start-up: every solve shape it can meet, run (and captured) before the first request.

:func:`warmup_shapes` lists the (bucket, S, T, Lb) shapes ticks and prompt solves produce,
:func:`prompt_shapes` the step spans of paced prompt cohorts, and :func:`warmup` runs each on
all-idle slots (so no cache or length changes) until its graph exists, then solves the voices it
is given into the voice cache. Afterwards no prompt solve or tick compiles or captures.
"""

from __future__ import annotations

import sys
import time
from typing import Hashable, Iterable, Mapping, Optional

import torch

from ..buckets import reachable
from ..errors import fail
from .reports import WarmupReport


def _given(op: str, arg: str, values: Optional[Iterable[int]], low: int, high: int) -> Optional[list[int]]:
    """An explicit warm-up list, checked and clipped to [low, high] (None when not given)."""
    if values is None:
        return None
    out = sorted({int(v) for v in values})
    if not out or any(v < low for v in out):
        fail(op, arg, f"be a non-empty list of ints >= {low}", repr(values))
    return sorted({min(v, high) for v in out})


def warmup_shapes(server, *, chunk_frames: Optional[Iterable[int]] = None, cache_frames: Optional[Iterable[int]] = None,
                  slot_counts: Optional[Iterable[int]] = None,
                  pairs: Optional[Iterable[tuple[int, int]]] = None) -> list[tuple[int, int, int, int]]:
    """Every solve shape (bucket, S, T, Lb) a prompt solve or tick of ``server`` can produce.

    T runs over the chunk buckets (clipped to the staging length; the staging length itself when a
    chunk or prompt can exceed the largest bucket), Lb over the cache buckets likewise, S over the
    slot buckets (the bucket's whole arena once S reaches it), per batch bucket. ``chunk_frames`` /
    ``cache_frames`` / ``slot_counts`` restrict or replace those sets; ``pairs`` replaces the T x Lb
    product by the (chunk frames, cache frames) pairs a workload meets (e.g. one stream's prompt
    and chunks under the trim; :func:`torch_cfm.buckets.shared_solve_shapes` for many streams).
    Given lengths are rounded up to the buckets exactly as a solve rounds them.

    Raises:
        ValueError: no chunk (or cache) buckets and no explicit list: exact lengths give a shape
            per length, which no warm-up can cover.
    """
    op = "CFMServer.warmup"
    b = server.buckets
    pair_list = None
    if pairs is not None:
        pair_list = [tuple(p) for p in pairs]
        if not pair_list or any(len(p) != 2 or p[0] < 1 or p[1] < 0 for p in pair_list):
            fail(op, "pairs", "be a non-empty list of (chunk frames >= 1, cache frames >= 0)", repr(pairs))
    shapes = []
    for bucket, arena in enumerate(server.arenas):
        chunk_limit, cache_limit = arena.max_chunk_frames, arena.max_cache_frames
        counts = _given(op, "slot_counts", slot_counts, 1, arena.rows) \
            or reachable(b.slots, arena.rows, 1) or list(range(1, arena.rows + 1))
        counts = sorted({b.slot_count(c, arena.rows) for c in counts})
        if pair_list is not None:
            sizes = sorted({(b.chunk(t, chunk_limit), b.cache(lb, cache_limit)) for t, lb in pair_list})
        else:
            chunks = _given(op, "chunk_frames", chunk_frames, 1, chunk_limit) or reachable(b.chunks, chunk_limit, 1)
            caches = _given(op, "cache_frames", cache_frames, 0, cache_limit) or reachable(b.caches, cache_limit, 0)
            if chunks is None:
                fail(op, "chunk_frames", "be given when the server has no chunk_buckets", "None",
                     "build the server with chunk_buckets=[...] (exact lengths give a shape per length)")
            if caches is None:
                fail(op, "cache_frames", "be given when the server has no cache_buckets", "None",
                     "build the server with cache_buckets=[...] (exact lengths give a shape per length)")
            sizes = sorted({(b.chunk(t, chunk_limit), b.cache(lb, cache_limit)) for t in chunks for lb in caches})
        shapes += [(bucket, s, t, lb) for s in counts for t, lb in sizes]
    return shapes


def prompt_shapes(server, prompt_frames: Optional[Iterable[int]] = None) -> list[tuple[int, int, int, tuple]]:
    """Every (bucket, S, T, steps) a paced prompt cohort produces: S over the cohort sizes, T over
    ``prompt_frames`` (default ``max_prompt_frames``) rounded as a solve rounds them, steps over the
    spans of the schedule; cache window 0 (rounded up to the cache buckets). [] without pacing."""
    if server.prompt_steps_per_tick is None:
        return []
    given = [server.max_prompt_frames] if prompt_frames is None else [int(v) for v in prompt_frames]
    if not given or any(not 1 <= v <= server.max_chunk_frames for v in given):
        fail("CFMServer.warmup", "prompt_frames", f"be a non-empty list of ints in [1, {server.max_chunk_frames}]",
             repr(prompt_frames))
    n, k = server.cfm.n_timesteps, server.prompt_steps_per_tick
    spans = [(s, min(s + k, n)) for s in range(0, n, k)]
    shapes = []
    for bucket, arena in enumerate(server.arenas):
        sizes = sorted({size for count in range(1, arena.rows + 1) for size in server._cohorts.sizes(count, arena.rows)})
        lengths = sorted({server.buckets.chunk(v, arena.max_chunk_frames) for v in given})
        shapes += [(bucket, size, t, span) for size in sizes for t in lengths for span in spans]
    return shapes


def warmup(server, *, progress: bool = True, chunk_frames: Optional[Iterable[int]] = None,
           cache_frames: Optional[Iterable[int]] = None, slot_counts: Optional[Iterable[int]] = None,
           pairs: Optional[Iterable[tuple[int, int]]] = None, prompt_frames: Optional[Iterable[int]] = None,
           voices: Optional[Mapping[Hashable, tuple]] = None) -> WarmupReport:
    """Compile every kernel and capture every graph of ``server``'s buckets, before serving.

    Runs each shape of :func:`warmup_shapes` (the prompt solves' shapes included: a prompt is a
    chunk of up to ``max_prompt_frames``) on all-idle slots; with graphs on CUDA each shape is run
    until its graph is captured, and the graph cache's budget is raised to hold them all. With
    ``prompt_steps_per_tick`` the prompt cohorts' step spans are warmed too (:func:`prompt_shapes`
    of ``prompt_frames``; ``pairs`` then need only the chunks' (T, L)).

    Args:
        progress: one stderr line per shape (False = silent).
        chunk_frames, cache_frames, slot_counts, pairs: see :func:`warmup_shapes`.
        prompt_frames: prompt lengths whose spread solves to warm (default ``max_prompt_frames``).
        voices: ``{voice key: (spks, prompt_mu, prompt_mel)}`` solved now into the voice cache
            (needs ``voice_cache_bytes``): streams opening with these voices skip their solve.
    Returns:
        :class:`~torch_cfm.serving.reports.WarmupReport`.
    Raises:
        RuntimeError: requests are open (warm up at start-up: an idle slot's cache must fit every
            warmed cache window).
        ValueError: see :func:`warmup_shapes`; ``voices`` without a voice cache.
    """
    if server.open_requests:
        raise RuntimeError(f"CFMServer.warmup: {len(server.open_requests)} requests are open; warm up before "
                           "opening requests")
    if voices and server.voices is None:
        fail("CFMServer.warmup", "voices", "be given only to a server with a voice cache", f"{len(voices)} voices",
             "build the server with voice_cache_bytes=...")
    shapes = [(*shape, None) for shape in warmup_shapes(server, chunk_frames=chunk_frames, cache_frames=cache_frames,
                                                        slot_counts=slot_counts, pairs=pairs)]
    window = server.buckets.cache(0, server.max_cache_frames)
    shapes += [(bucket, size, t, window, span) for bucket, size, t, span in prompt_shapes(server, prompt_frames)]
    cache = server.graph_cache
    if cache is not None:  # keep every warmed key (and any held before)
        cache.max_graphs = max(cache.max_graphs, len(shapes) + len(cache.entries()))
    calls = cache.calls_per_capture(server.device) if cache is not None else 1
    start = time.perf_counter()
    report = WarmupReport(arena_bytes=sum(a.nbytes() for a in server.arenas))
    for i, (bucket, n_slots, t_len, lb, span) in enumerate(shapes):
        arena = server.arenas[bucket]
        tick = time.perf_counter()
        arena.valid_lengths.zero_()  # every slot idle: caches, lengths and Euler states come out unchanged
        index = None if n_slots >= arena.rows else torch.arange(n_slots, device=server.device)
        with torch.no_grad():
            for _ in range(calls):
                server.solve_arena(arena, t_len, lb, index, span)
        if server.device.type == "cuda":
            torch.cuda.synchronize(server.device)
        label = dict(rows=arena.rows, slots=n_slots, t_len=t_len, cache_frames=lb)
        if span is not None:
            label["steps"] = span
        report.shapes.append(label)
        if progress:
            print(f"CFMServer.warmup [{i + 1}/{len(shapes)}] slots {n_slots}/{arena.rows} T={t_len} "
                  f"Lb={lb}{'' if span is None else f' steps {span[0]}-{span[1]}'}: "
                  f"{time.perf_counter() - tick:.2f} s", file=sys.stderr, flush=True)
    report.voices = _solve_voices(server, voices or {}, progress)
    report.seconds = time.perf_counter() - start
    if cache is not None:
        report.graphs, report.graph_pool_bytes = cache.graph_count, cache.pool_bytes
    if progress:
        print(f"CFMServer.{report}", file=sys.stderr, flush=True)
    return report


def _solve_voices(server, voices: Mapping[Hashable, tuple], progress: bool) -> int:
    """Each voice's prompt solved once, through a request opened and closed for it."""
    for i, (key, (spks, prompt_mu, prompt_mel)) in enumerate(voices.items()):
        rid = ("__voice__", key)
        server.open_request(rid, spks, prompt_mu=prompt_mu, prompt_mel=prompt_mel, voice=key)
        while not server.ready(rid):
            server.advance_prompts()
        server.close_request(rid)
        if progress:
            print(f"CFMServer.warmup voice [{i + 1}/{len(voices)}] {key!r}: solved", file=sys.stderr, flush=True)
    return len(voices)


__all__ = ["warmup", "warmup_shapes", "prompt_shapes"]
