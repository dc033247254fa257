"""Small host-side helpers shared by the Triton launchers (device guard, SM count, dtype names)."""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch


@functools.lru_cache(maxsize=None)
def _sm_count_cached(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached; a host query, no sync).

    For a CPU device (Triton interpreter) returns a fixed 132 (an H200) so that the tile
    heuristics pick the same shapes as on the GPU the project tunes for.
    """
    if device.type != "cuda":
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count_cached(index)


@contextlib.contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """Make ``device`` current while launching, so Triton picks its current stream.

    Triton launches on the *current* device's current stream whatever the tensors' device is;
    entering the guard only when it differs keeps the common case free of host overhead.
    """
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            yield
    else:
        yield
