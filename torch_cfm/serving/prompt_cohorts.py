"""Prompt solves spread over ticks (``CFMServer(prompt_steps_per_tick=k)``, docs/design.md §8).

Step i of a solve reads and writes only step i's caches, so a prompt's n Euler steps can run k at
a time, one span per serving tick, with the same result as one whole solve. Prompts opened before
the same tick form a cohort, solved as groups whose sizes are slot buckets (largest first), each
over its own slots only (cache window 0), so their shapes repeat and warm up ahead. A request
closed mid-prompt stays in its cohort as an idle row; its slot returns to the free list when the
cohort ends (a slot must not settle while a solve that holds it has yet to commit).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Hashable, Optional

import torch

from ..models.cache import trimmed_length


@dataclass
class Cohort:
    """Prompt solves that run together: requests of one bucket admitted before the same tick, as
    many as a slot bucket holds, solved over their own slots (``index``) at Euler step ``next_step``.

    Attributes:
        bucket: the arena's index. items: (request id, request, T_r) in slot order.
        t_len: the chunk bucket of the longest prompt. index: (S,) int64 slots on the device, None
            = the bucket's every slot. closed: members closed before the end (idle rows).
    """

    bucket: int
    items: list
    t_len: int
    index: Optional[torch.Tensor]
    next_step: int = 0
    closed: set = field(default_factory=set)


class PromptCohorts:
    """The server's queued and running spread prompt solves (module docstring)."""

    def __init__(self, server, steps_per_tick: int) -> None:
        # the server owns this: a weak reference, so that dropping the server frees its arenas at once
        self.server, self.steps_per_tick = weakref.proxy(server), steps_per_tick
        self._admitting: dict[int, list] = {}  # bucket -> (request id, request, T_r) opened since the last tick
        self._cohorts: list[Cohort] = []

    def queue(self, request_id: Hashable, req, t_len: int) -> None:
        """A request whose prompt is staged in its slot: it starts at the next :meth:`advance`."""
        self._admitting.setdefault(req.bucket, []).append((request_id, req, t_len))

    def leave(self, request_id: Hashable, req) -> bool:
        """A pending request closes. Returns whether its slot is free now (queued: yes; under way:
        it stays in its cohort as an idle row and returns when the cohort ends)."""
        queued = self._admitting.get(req.bucket, [])
        if any(rid == request_id for rid, _, _ in queued):
            queued[:] = [item for item in queued if item[0] != request_id]
            return True
        cohort = next(c for c in self._cohorts if any(rid == request_id for rid, _, _ in c.items))
        cohort.closed.add(request_id)
        return False

    def advance(self) -> dict[Hashable, torch.Tensor]:
        """Every queued prompt solve advances by ``steps_per_tick`` Euler steps; requests opened
        since the last call start now, as cohorts. Returns {request id: prompt mel (80, P)} of the
        prompts whose last step ran."""
        n = self.server.cfm.n_timesteps
        for bucket, queued in self._admitting.items():
            self._cohorts += self._form(bucket, queued)
        self._admitting = {}
        done: dict[Hashable, torch.Tensor] = {}
        for cohort in list(self._cohorts):
            first = cohort.next_step
            cohort.next_step = min(first + self.steps_per_tick, n)
            self._solve(cohort, (first, cohort.next_step))
            if cohort.next_step == n:
                done.update(self._finish(cohort))
        return done

    def sizes(self, count: int, rows: int) -> list[int]:
        """Group sizes of ``count`` prompts: the largest slot bucket that fits, repeatedly (exact
        sizes below the smallest bucket, or without slot buckets)."""
        buckets = [b for b in (self.server.buckets.slots or []) if b <= rows]
        sizes = []
        while count > 0:
            size = max((b for b in buckets if b <= count), default=count)
            sizes.append(size)
            count -= size
        return sizes

    def _form(self, bucket: int, queued: list) -> list[Cohort]:
        server = self.server
        arena = server.arenas[bucket]
        cohorts, start = [], 0
        for size in self.sizes(len(queued), arena.rows):
            items = sorted(queued[start:start + size], key=lambda item: item[1].slot)
            start += size
            t_len = server.buckets.chunk(max(t for _, _, t in items), arena.max_chunk_frames)
            index = None
            if size < arena.rows:
                index = server.device_index([req.slot for _, req, _ in items])
            cohorts.append(Cohort(bucket, items, t_len, index))
        return cohorts

    def _solve(self, cohort: Cohort, steps: tuple[int, int]) -> None:
        server = self.server
        arena = server.arenas[cohort.bucket]
        lengths = [0] * arena.rows
        for rid, req, t_n in cohort.items:
            lengths[req.slot] = 0 if rid in cohort.closed else t_n
        arena.valid_lengths.copy_(server.host_values(lengths, torch.int32), non_blocking=True)
        window = server.buckets.cache(0, arena.max_cache_frames)
        server.solve_arena(arena, cohort.t_len, window, cohort.index, steps)

    def _finish(self, cohort: Cohort) -> dict[Hashable, torch.Tensor]:
        server = self.server
        self._cohorts.remove(cohort)
        arena = server.arenas[cohort.bucket]
        by_length: dict[int, list] = {}
        for rid, req, t_n in cohort.items:
            if rid in cohort.closed:
                server.release(cohort.bucket, req.slot)
                continue
            req.cache_len = trimmed_length(t_n, req.prompt_len)
            req.chunks += 1
            req.pending = False
            by_length.setdefault(t_n, []).append((rid, req))
        mels = server.gather(arena, {t_n: (group, server.slot_index(group)) for t_n, group in by_length.items()})
        for group in by_length.values():
            for rid, req in group:
                server.remember_voice(rid, req, mels[rid])
        return mels


__all__ = ["Cohort", "PromptCohorts"]
