"""The cosine Euler schedule of docs/design.md §3 and the fused body's modulation tables of it."""

from __future__ import annotations

import contextlib
import weakref

import torch

from .. import policy
from ..config import cosine_timesteps
from ..packing import PackedDiT, modulation_table


def euler_timesteps(n_timesteps: int) -> list[float]:
    """``t_i = 1 - cos(pi/2 * i/n)``, i = 0..n, as python floats (baked into captured graphs)."""
    return [float(v) for v in cosine_timesteps(n_timesteps, torch.float64)]


def schedule_tables(packed: PackedDiT, n_steps: int) -> torch.Tensor:
    """Modulation tables (n, 1, depth+1, 9, C) float32 of the schedule's times t_0..t_{n-1}."""
    ts = cosine_timesteps(n_steps, torch.float64)
    return torch.stack([modulation_table(packed, ts[i:i + 1].to(packed.device)) for i in range(n_steps)])


# Tables per packed weights, keyed by the PackedDiT's id and dropped with it (a repack after a
# parameter change is a new object); filled only outside CUDA-graph capture, so a cached table
# never lives in a graph's private pool.
_TABLES: dict[int, tuple[weakref.ref, dict]] = {}


def cached_schedule_tables(packed: PackedDiT, n_steps: int, precision: str) -> torch.Tensor:
    """:func:`schedule_tables`, computed once per (packed weights, n, dot precision)."""
    key = (n_steps, precision)
    entry = _TABLES.get(id(packed))
    if entry is not None and entry[0]() is packed and key in entry[1]:
        return entry[1][key]
    scope = (policy.tf32_scope(precision == "tf32") if packed.dtype == torch.float32 and packed.device.type == "cuda"
             else contextlib.nullcontext())
    with scope:
        tables = schedule_tables(packed, n_steps)
    capturing = packed.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if not capturing:
        if entry is None or entry[0]() is not packed:
            entry = (weakref.ref(packed, lambda _, k=id(packed): _TABLES.pop(k, None)), {})
            _TABLES[id(packed)] = entry
        entry[1][key] = tables
    return tables


__all__ = ["euler_timesteps", "schedule_tables", "cached_schedule_tables"]
