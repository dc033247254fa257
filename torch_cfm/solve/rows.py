"""The rows one arena solve covers: their staged inputs in CFG form, their first state, their outputs.

A :class:`~torch_cfm.models.cache.CacheArena` stages every slot's chunk (mu, cond, spks, lengths).
A solve covers all slots, or the slots an index lists (then it gathers their rows and scatters
its results back, so its cost follows the solved slots, not the arena). Slot r owns CFG rows r
(cond) and R + r (uncond: mu = spks = cond = 0, the same x; docs/design.md §3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import fail, shape_str


@dataclass(frozen=True)
class SolveShape:
    """The python values one solve is built from (what a captured graph of it depends on).

    Attributes:
        t_len: T, the chunk frames staged (a bucket; each slot's own T_r <= T is in the arena).
        cache_frames: Lb, the cache window read: >= the cache length of every solved slot.
        steps: (first, stop): the Euler steps run, 0 <= first < stop <= n (a prompt solve spread
            over ticks runs one span per call; docs/design.md §8).
        n_timesteps, cfg_rate, keep_oldest: the solve's constants (docs/design.md §3).
    """

    t_len: int
    cache_frames: int
    steps: tuple[int, int]
    n_timesteps: int
    cfg_rate: float
    keep_oldest: int

    @property
    def commits(self) -> bool:
        """Whether this call runs the solve's last step (and commits lengths, keys, trim and mel)."""
        return self.steps[1] == self.n_timesteps


def check_steps(steps: Optional[tuple[int, int]], n_timesteps: int, x_state: Optional[torch.Tensor],
                rows: int, t_len: int) -> tuple[int, int]:
    """``steps`` checked (None = the whole solve): (first, stop) with 0 <= first < stop <= n, and an
    ``x_state`` of at least (rows, 80, t_len) float32 where the solve spans several calls."""
    op = "ArenaSolver"
    if steps is None:
        return 0, n_timesteps
    if not (isinstance(steps, tuple) and len(steps) == 2 and all(isinstance(v, int) for v in steps)
            and 0 <= steps[0] < steps[1] <= n_timesteps):
        fail(op, "steps", f"be a tuple (first, stop) of ints with 0 <= first < stop <= n_timesteps={n_timesteps}",
             repr(steps))
    if steps != (0, n_timesteps) and (
            not isinstance(x_state, torch.Tensor) or x_state.dtype != torch.float32 or x_state.dim() != 3
            or x_state.shape[0] != rows or x_state.shape[2] < t_len):
        fail(op, "x_state", f"be a float32 tensor of shape ({rows}, 80, >= {t_len}) when steps={steps}",
             shape_str(x_state) if isinstance(x_state, torch.Tensor) else "None (an arena without step_state)")
    return steps


class SolvedRows:
    """The solved slots' inputs, gathered and doubled into CFG rows, and where their results go.

    Attributes:
        slots: (S,) int64 slot index, or None (every slot, S = R).
        rows: (2S,) int64 CFG rows in the arena (None with every slot).
        vl, cl: (S,) int64 chunk frames T_r in [0, T] and cache frames L_r in [0, Lb].
        prompt: (S,) prompt frames P_r (the trim threshold is P_r + keep_oldest).
        vl2, cl2: (2S,) int32 per CFG row. mu2, cond2: (2S, 80, T); spks2: (2S, 80) in the arena's dtype.
        x: (S, 80, T) first Euler state: noise frames [L_r, L_r + T) of slot r, or the state a
            previous span kept in the arena's ``x_state``.
    """

    def __init__(self, arena, noise: torch.Tensor, shape: SolveShape, slots: Optional[torch.Tensor]) -> None:
        t_len = shape.t_len
        self.arena, self.shape, self.slots = arena, shape, slots
        mu, cond, spks = arena.mu[:, :, :t_len], arena.cond[:, :, :t_len], arena.spks
        vl_in, cl_in, prompt = arena.valid_lengths, arena.cache_lengths, arena.prompt_lengths
        self.rows = None
        if slots is not None:
            self.rows = torch.cat([slots, slots + arena.rows])
            mu, cond, spks = mu.index_select(0, slots), cond.index_select(0, slots), spks.index_select(0, slots)
            vl_in, cl_in, prompt = vl_in.index_select(0, slots), cl_in.index_select(0, slots), prompt.index_select(0, slots)
        n_rows = mu.shape[0]
        self.prompt = prompt
        self.cl = cl_in.to(torch.int64).clamp(0, shape.cache_frames)
        self.vl = vl_in.to(torch.int64).clamp(0, t_len)
        self._state = self._state_in = None
        if shape.steps[0] > 0 or not shape.commits:  # a solve spread over calls reads or keeps its state
            self._state = arena.x_state[:, :, :t_len]
            self._state_in = self._state if slots is None else self._state.index_select(0, slots)
        if shape.steps[0] > 0:
            self.x = self._state_in
        else:  # slot r starts from noise frames [L_r, L_r + T); cast by the stepper
            frames = (self.cl[:, None] + torch.arange(t_len, device=mu.device)[None]).clamp(max=noise.shape[2] - 1)
            self.x = noise[0].index_select(1, frames.reshape(-1)).view(-1, n_rows, t_len).transpose(0, 1)
        dtype = mu.dtype
        zeros = torch.zeros_like(mu)
        self.mu2 = torch.cat([mu, zeros])
        self.cond2 = torch.cat([cond, zeros]).to(dtype)
        self.spks2 = torch.cat([spks, torch.zeros_like(spks)]).to(dtype)
        self.vl2 = torch.cat([self.vl, self.vl]).to(torch.int32)
        self.cl2 = torch.cat([self.cl, self.cl]).to(torch.int32)

    def commit(self, x: torch.Tensor, new_lengths: torch.Tensor) -> None:
        """The solve's last call: each solved slot's mel into ``out_mel``, its trimmed length into
        ``cache_lengths``."""
        out_mel, cache_lengths = self.arena.out_mel[:, :, :self.shape.t_len], self.arena.cache_lengths
        if self.slots is None:
            out_mel.copy_(x)  # copy_ casts (x is float32 on the fused route)
            cache_lengths.copy_(new_lengths)
        else:
            out_mel.index_copy_(0, self.slots, x.to(out_mel.dtype))
            cache_lengths.index_copy_(0, self.slots, new_lengths.to(cache_lengths.dtype))

    def keep(self, x: torch.Tensor) -> None:
        """A solve continued by a later call: the busy rows' Euler state into the arena's ``x_state``
        (idle rows keep theirs)."""
        busy = (self.vl > 0)[:, None, None]
        new = torch.where(busy, x.to(torch.float32), self._state_in)
        if self.slots is None:
            self._state.copy_(new)
        else:
            self._state.index_copy_(0, self.slots, new)


__all__ = ["SolveShape", "SolvedRows", "check_steps"]
