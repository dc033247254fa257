"""What one Euler step runs: the estimator evaluation of every CFG row, the guidance and the update.

Two steppers, chosen per solve by :func:`stepper_for`:

* :class:`FusedStepper`: a torch_cfm :class:`~torch_cfm.models.DiT` computing in the arena's dtype
  where the policy says fused: each step is one fused body call (:mod:`torch_cfm.kernels.dit_body`)
  on weights packed once, with the schedule's modulation tables computed once per weights, the
  staged input built once and updated in place by one CFG/Euler kernel per step, and a float32
  Euler state (within the docs/design.md §6 oracle of the per-step path). Its attention caches are
  :data:`~torch_cfm.solve.caches.IN_PLACE` on a keyed arena (the body appends its keys there) and
  :data:`~torch_cfm.solve.caches.DENSE` otherwise.
* :class:`ReferenceStepper`: anything else: the estimator's own ``forward_chunk`` per step (the
  model's reference path, or its fused hook), guidance and Euler in the arena's dtype.

A stepper is made per solve call: :meth:`start` takes the first state (S, 80, T), :meth:`step`
runs step i on that step's caches and returns their new values, :meth:`result` gives the state.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .. import policy
from ..models.dit import DiT
from ..models.fused_forward import stage_input
from ..ops.dit_body import body_outputs, check_dit_body
from ..packing import packed_for
from .caches import DENSE, IN_PLACE
from .rows import SolvedRows
from .schedule import cached_schedule_tables


def fused_precision(estimator: nn.Module, device: torch.device, dtype: Optional[torch.dtype], fused: Optional[bool],
                    t_len: int) -> Optional[str]:
    """The fused body's dot precision ("tf32" | "ieee" | "" for 16-bit) when a solve may run the
    estimator as the fused body directly (a torch_cfm DiT in ``dtype``, the policy says fused, not
    tracing), else None. ``dtype``: the arena's, None when its staged inputs are in another dtype."""
    if dtype is None or not isinstance(estimator, DiT) or t_len == 0 or torch.compiler.is_compiling():
        return None
    if torch.is_autocast_enabled(device.type) or estimator.in_proj.weight.dtype != dtype:
        return None  # forward_chunk would compute in another dtype than the arena's
    decision = policy.decide(device, dtype, fused=fused)
    if not decision.fused:
        return None
    return decision.precision or ""


class ReferenceStepper:
    """Euler steps through ``estimator.forward_chunk`` (CFG rows, Euler in the staged dtype)."""

    form = DENSE

    def __init__(self, estimator: nn.Module, solved: SolvedRows, timesteps: list[float], cfg_rate: float,
                 fused: Optional[bool]) -> None:
        self.estimator, self.solved, self.ts, self.cfg_rate, self.fused = estimator, solved, timesteps, cfg_rate, fused

    def start(self, x: torch.Tensor) -> None:
        self.x = x.to(self.solved.mu2.dtype)

    def step(self, i: int, cnn: torch.Tensor, att: Optional[torch.Tensor]):
        s, x, n_rows = self.solved, self.x, self.x.shape[0]
        t = torch.full((2 * n_rows,), self.ts[i], device=x.device, dtype=x.dtype)
        v, new_cnn, new_att = self.estimator.forward_chunk(torch.cat([x, x]), s.mu2, t, s.spks2, s.cond2, cnn, att,
                                                           valid_lengths=s.vl2, cache_lengths=s.cl2, fused=self.fused)
        v = (1.0 + self.cfg_rate) * v[:n_rows] - self.cfg_rate * v[n_rows:]
        self.x = x + (self.ts[i + 1] - self.ts[i]) * v.to(x.dtype)
        return new_cnn, new_att

    def result(self) -> torch.Tensor:
        return self.x


class FusedStepper:
    """Euler steps on the fused body with a float32 state (module docstring); ``keyed``: the
    arena is keyed, so the body appends in place (:data:`IN_PLACE`)."""

    def __init__(self, estimator: nn.Module, solved: SolvedRows, timesteps: list[float], cfg_rate: float,
                 precision: str, keyed: bool) -> None:
        from ..kernels.dit_body import (cfg_euler, dit_body_arena_into,  # Triton is optional: imported on
                                        dit_body_fused_into)  # the first fused solve
        self._euler, self._into = cfg_euler, dit_body_arena_into if keyed else dit_body_fused_into
        self.form = IN_PLACE if keyed else DENSE
        self.solved, self.ts, self.cfg_rate, self.precision = solved, timesteps, cfg_rate, precision
        dtype = solved.mu2.dtype
        self.packed = packed_for(estimator, dtype, solved.mu2.device)
        self.tables = cached_schedule_tables(self.packed, len(timesteps) - 1, precision)
        self._outs = None

    def start(self, x: torch.Tensor) -> None:
        s = self.solved
        self.staged = stage_input(torch.cat([x, x]), s.mu2, s.spks2, s.cond2, s.mu2.dtype)
        # a copy: cfg_euler updates the state in place (densely), and x may be a view of the noise
        self.x32 = x.to(torch.float32, memory_format=torch.contiguous_format, copy=True)

    def step(self, i: int, cnn: torch.Tensor, att: Optional[torch.Tensor]):
        s, table = self.solved, self.tables[i]
        in_place = self.form == IN_PLACE
        if self._outs is None:
            sizes = check_dit_body(self.staged, self.packed.body, table, cnn, None if in_place else att, s.vl2, s.cl2,
                                   self.precision or "auto")
            self._outs = body_outputs(self.staged, sizes, with_att=not in_place)
        out = self._into(self.staged, self.packed.body, table, cnn, att, s.vl2, s.cl2, self.precision or None,
                         self._outs)
        self._euler(self.x32, out[0], self.staged, self.ts[i + 1] - self.ts[i], self.cfg_rate)
        return out[1], (None if in_place else out[2])

    def result(self) -> torch.Tensor:
        return self.x32


def stepper_for(estimator: nn.Module, arena, solved: SolvedRows, timesteps: list[float], cfg_rate: float,
                fused: Optional[bool]):
    """The fused stepper where :func:`fused_precision` allows it, else the reference stepper."""
    att = arena.att
    precision = fused_precision(estimator, att.device, att.dtype if att.dtype == arena.mu.dtype else None, fused,
                                solved.shape.t_len)
    if precision is None:
        return ReferenceStepper(estimator, solved, timesteps, cfg_rate, fused)
    return FusedStepper(estimator, solved, timesteps, cfg_rate, precision, keyed=arena.frame_keys is not None)


__all__ = ["FusedStepper", "ReferenceStepper", "fused_precision", "stepper_for"]
