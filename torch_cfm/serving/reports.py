"""What the servers report: admission errors, memory plans and warm-up reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


class AdmissionError(RuntimeError):
    """A stream (or a server's arenas) does not fit: no free request slot, or the bytes exceed
    ``max_memory_bytes``. The message names the limit and the need."""


@dataclass
class MemoryPlan:
    """Device memory of a :class:`~torch_cfm.serving.CFMServer` (bytes).

    Attributes:
        dtype: the compute dtype of the arenas.
        bytes_per_stream: one request slot of an arena: attention caches of its two CFG rows for
            every Euler step (``n·depth·2·H·(M + A)·2D`` elements), conv caches
            (``n·depth·2·2C·2``), staging (mu, cond, out_mel: ``3·80·Tmax``; spks 80) in the
            compute dtype, plus its int32 frame keys (M) and lengths (3).
        slots: request slots of all buckets; arena_bytes: all arenas (= slots × bytes_per_stream).
        graph_pool_bytes: memory reserved by the captured graphs (0 before a warm-up / on CPU).
        voice_cache_bytes: the voice-prompt cache's budget (0 without one).
        max_memory_bytes: the configured limit (None = no limit).
    """

    dtype: torch.dtype
    bytes_per_stream: int
    slots: int
    arena_bytes: int
    graph_pool_bytes: int = 0
    voice_cache_bytes: int = 0
    max_memory_bytes: Optional[int] = None

    @property
    def total_bytes(self) -> int:
        return self.arena_bytes + self.graph_pool_bytes + self.voice_cache_bytes


@dataclass
class WarmupReport:
    """What a server's ``warmup`` ran.

    Attributes:
        shapes: solve shapes warmed (one per bucket × slot count × chunk bucket × cache bucket),
            each a label dict (rows, slots, t_len, cache_frames[, steps]).
        graphs: captured graphs held by the server's graph cache afterwards (0 on CPU / eager).
        graph_pool_bytes: memory their captures reserved. arena_bytes: the arenas'.
        voices: voice prompts solved ahead into the voice cache.
        seconds: wall time of the warm-up.
    """

    shapes: list = field(default_factory=list)
    graphs: int = 0
    graph_pool_bytes: int = 0
    arena_bytes: int = 0
    voices: int = 0
    seconds: float = 0.0

    def __str__(self) -> str:
        voices = f", {self.voices} voices solved" if self.voices else ""
        return (f"warmup: {len(self.shapes)} shapes, {self.graphs} graphs, graph pools "
                f"{self.graph_pool_bytes / 2**20:.1f} MiB, arenas {self.arena_bytes / 2**20:.1f} MiB{voices}, "
                f"{self.seconds:.2f} s")


__all__ = ["AdmissionError", "MemoryPlan", "WarmupReport"]
