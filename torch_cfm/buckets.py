"""The one bucket policy: how solve and stage shapes are rounded up so that captured graphs repeat.

A captured CUDA graph serves one static shape. A serving loop meets many exact shapes (prompt
lengths, ragged chunks, cache windows growing to the trim bound, stream counts), so each is
rounded up to a bucket: a chunk of T frames is solved as a chunk of ``round_up(T)`` frames with
``T`` valid, a cache window of L frames as ``round_up(L)``, S streams as ``round_up(S)`` slots
with idle ones (docs/design.md §8). Results do not depend on the padding (docs/design.md §2).

:class:`Buckets` holds one such table per axis; :meth:`Buckets.for_graphs` is the table every
graphed solver of the package uses (the stepaudio2 integration's one-stream servers and the
many-stream :class:`~torch_cfm.serving.Token2wavServer`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

# Chunk lengths (frames): the streaming chunk (25 tokens = 50 frames), its last chunk (up to 28
# tokens = 56 frames), short tails, and prompt lengths in steps that keep the graph count small.
CHUNK_FRAMES = (2, 4, 8, 16, 25, 32, 50, 56, 64, 100, 128, 150, 200, 250, 300, 350, 400, 500, 600, 800, 1000)
CACHE_STEP = 50  # cache windows: every 50 frames up to the trim bound (prompt + 100)
SLOTS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # solved streams


def round_up(value: int, buckets: Optional[Sequence[int]], limit: int) -> int:
    """The smallest bucket >= ``value``, at most ``limit`` (``limit`` past the last bucket;
    ``value`` itself without buckets)."""
    if not buckets:
        return value
    i = bisect.bisect_left(buckets, value)
    return min(buckets[i], limit) if i < len(buckets) else limit


def padded_count(count: int, buckets: Optional[Sequence[int]]) -> int:
    """The batch size ``count`` rows are padded to: the first of the sorted ``buckets`` that holds
    them (``count`` itself past the last bucket, or without buckets)."""
    return next((b for b in (buckets or ()) if b >= count), count)


def reachable(buckets: Optional[Sequence[int]], limit: int, low: int) -> Optional[list[int]]:
    """Every value :func:`round_up` gives for inputs in [low, limit] (None without buckets)."""
    if not buckets:
        return None
    return sorted({round_up(v, buckets, limit) for v in [low, limit, *buckets] if low <= v <= limit})


@dataclass(frozen=True)
class Buckets:
    """Bucket tables of a solver's three shape axes (None: exact shapes on that axis).

    Attributes:
        chunks: sorted chunk lengths T (frames).
        caches: sorted cache windows L (frames).
        slots: sorted counts of solved request slots S.
    """

    chunks: Optional[tuple[int, ...]] = None
    caches: Optional[tuple[int, ...]] = None
    slots: Optional[tuple[int, ...]] = None

    @classmethod
    def of(cls, chunks: Optional[Iterable[int]] = None, caches: Optional[Iterable[int]] = None,
           slots: Optional[Iterable[int]] = None) -> "Buckets":
        """Tables from any iterables (sorted, repeats dropped; empty or None = exact)."""
        def table(values):
            return tuple(sorted({int(v) for v in values})) if values else None

        return cls(table(chunks), table(caches), table(slots))

    @classmethod
    def for_graphs(cls, *, max_chunk_frames: int, max_cache_frames: int, max_slots: int = 1) -> "Buckets":
        """The package's table for graphed solves of a server whose staging holds
        ``max_chunk_frames``, whose caches hold ``max_cache_frames`` and which solves up to
        ``max_slots`` requests at once: :data:`CHUNK_FRAMES`, every :data:`CACHE_STEP` frames and
        :data:`SLOTS` below those limits, plus the limits themselves."""
        return cls.of([b for b in CHUNK_FRAMES if b < max_chunk_frames] + [max_chunk_frames],
                      list(range(0, max_cache_frames, CACHE_STEP)) + [max_cache_frames],
                      [b for b in SLOTS if b < max_slots] + [max_slots])

    def chunk(self, frames: int, limit: int) -> int:
        """The chunk length a solve of ``frames`` frames runs at (at most ``limit``)."""
        return min(round_up(frames, self.chunks, limit), limit)

    def cache(self, frames: int, limit: int) -> int:
        """The cache window a solve whose longest cache holds ``frames`` frames reads (at most ``limit``)."""
        return min(round_up(frames, self.caches, limit), limit)

    def slot_count(self, count: int, limit: int) -> int:
        """The slots a solve of ``count`` requests covers (at most ``limit``: the whole arena)."""
        return min(round_up(count, self.slots, limit), limit)


def stream_solve_shapes(prompt_frames: Iterable[int] = (300,), chunk_frames: Sequence[int] = (50,),
                        last_chunk_frames: Sequence[int] = (56,), keep_oldest: int = 100) -> list[tuple[int, int]]:
    """(T, L) of every chunk solve one stream meets under ``Token2wav.stream``'s trims: the prompt
    (P, 0); each chunk length T at L = P, P + T, ... while the cache fits ``P + keep_oldest``
    frames (the trim bound), then at that bound; each last-chunk length at the bound. In first-met
    order, without repeats."""
    shapes: list[tuple[int, int]] = []

    def add(shape: tuple[int, int]) -> None:
        if shape not in shapes:
            shapes.append(shape)

    for p_len in prompt_frames:
        bound = p_len + keep_oldest
        add((p_len, 0))
        for t_len in chunk_frames:
            cache = p_len
            while True:
                add((t_len, cache))
                if cache == bound:
                    break
                cache = cache + t_len if cache + t_len <= bound else bound
        for t_len in last_chunk_frames:
            add((t_len, bound))
    return shapes


def shared_solve_shapes(prompt_frames: Sequence[int], chunk_frames: Sequence[int],
                        last_chunk_frames: Sequence[int], keep_oldest: int = 100) -> list[tuple[int, int]]:
    """(T, L) of every solve streams of these lengths can produce in one shared server: each
    stream's own (:func:`stream_solve_shapes`) and, since a solve's cache window covers every slot
    it solves (idle padding included), each prompt and chunk length at every window any stream
    meets (a prompt solve padded with a settled stream's slot, a last chunk next to a longer
    prompt's stream)."""
    own = stream_solve_shapes(prompt_frames, chunk_frames, last_chunk_frames, keep_oldest)
    windows = sorted({lb for _, lb in own if lb > 0})
    pairs = list(own)
    for t_len in [*prompt_frames, *chunk_frames, *last_chunk_frames]:
        pairs += [(t_len, lb) for lb in windows if (t_len, lb) not in pairs]
    return pairs


__all__ = ["Buckets", "CHUNK_FRAMES", "CACHE_STEP", "SLOTS", "round_up", "padded_count", "reachable",
           "stream_solve_shapes", "shared_solve_shapes"]
