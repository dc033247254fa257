"""The one solve engine: a chunk's n-step CFG Euler solve (docs/design.md §3) over a cache arena.

:class:`ArenaSolver` composes three parts and runs the step loop over them:

* the solved rows (:class:`~torch_cfm.solve.rows.SolvedRows`): the slots solved, their staged
  inputs in CFG form, their first state (noise at each slot's own offset, or the state a previous
  span kept) and where the results go;
* the stepper (:mod:`torch_cfm.solve.steppers`): fused body or the estimator's own step;
* the cache layout (:mod:`torch_cfm.solve.caches`): how each step's caches are read and written.

Everything that solves a chunk runs it: :class:`~torch_cfm.solve.streaming.StreamingCFM` (the
upstream-equivalent call, over a temporary newest-first arena), the servers (over their keyed
arenas) and the graph layer (:class:`~torch_cfm.solve.graphed.GraphedArenaSolver`, the same call
replayed from one CUDA graph per shape).

Contract of one call (what a CUDA-graph capture relies on): it reads the arena's staging buffers
(mu, cond, spks, valid and prompt lengths), ``noise`` and ``slots``, and updates in place the
attention and conv caches, ``cache_lengths``, ``frame_keys``, ``out_mel`` and ``x_state``; shapes
depend only on the arena's shapes and the :class:`~torch_cfm.solve.rows.SolveShape`; no host
synchronisation, no data-dependent python control flow; temporaries come from the caching allocator
(the graph pool under capture); the arena is never reallocated. A slot with ``valid_lengths[r] ==
0`` is idle: its caches and lengths come out unchanged.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..config import SolverConfig
from ..errors import fail
from .caches import layout_for
from .rows import SolvedRows, SolveShape, check_steps
from .schedule import euler_timesteps
from .steppers import stepper_for

_SOLVER = SolverConfig()


def run_steps(stepper, layout, steps: tuple[int, int]) -> None:
    """Euler steps ``first .. stop - 1``: each reads its caches, steps, writes its new caches."""
    for i in range(*steps):
        new_cnn, new_att = stepper.step(i, *layout.read(i))
        layout.write(i, new_cnn, new_att)


class ArenaSolver:
    """Solves one chunk for the staged slots of a cache arena, in place (module docstring).

    Args:
        estimator: a :class:`~torch_cfm.models.DiT` (or anything with its ``forward_chunk``).
        n_timesteps, cfg_rate: the schedule's steps n and the guidance rate r (docs/design.md §3).
        keep_oldest: the trim keeps a request's prompt frames and its oldest ``keep_oldest``.
        fused: the fused body (True / False; None = the dispatch policy).
    """

    def __init__(self, estimator: nn.Module, *, n_timesteps: int = _SOLVER.n_timesteps,
                 cfg_rate: float = _SOLVER.cfg_rate, keep_oldest: int = _SOLVER.trim_keep_oldest,
                 fused: Optional[bool] = None) -> None:
        if not isinstance(n_timesteps, int) or isinstance(n_timesteps, bool) or n_timesteps < 1:
            fail("ArenaSolver", "n_timesteps", "be an int >= 1", repr(n_timesteps))
        self.estimator, self.n_timesteps, self.cfg_rate = estimator, n_timesteps, float(cfg_rate)
        self.keep_oldest, self.fused = keep_oldest, fused
        self.timesteps = euler_timesteps(n_timesteps)

    def shape(self, arena, t_len: int, cache_frames: int, steps: Optional[tuple[int, int]] = None) -> SolveShape:
        """The checked :class:`SolveShape` of a call (``steps`` None = the whole solve)."""
        span = check_steps(steps, self.n_timesteps, arena.x_state, arena.rows, t_len)
        return SolveShape(t_len, cache_frames, tuple(span), self.n_timesteps, self.cfg_rate, self.keep_oldest)

    @torch.no_grad()
    def __call__(self, arena, noise: torch.Tensor, *, t_len: int, cache_frames: int,
                 slots: Optional[torch.Tensor] = None, steps: Optional[tuple[int, int]] = None) -> None:
        """Solve the chunk staged in ``arena`` (frames [0, t_len) of its staging buffers).

        Args:
            arena: a :class:`~torch_cfm.models.cache.CacheArena` (keyed, or newest first without
                ``frame_keys``).
            noise: (1, 80, F) noise buffer; slot r starts from frames [L_r, L_r + T).
            t_len: T, the chunk frames (each slot's own T_r is its ``valid_lengths`` entry).
            cache_frames: Lb, the cache window: >= the cache length of every slot solved (idle
                ones included) and <= the arena's frames.
            slots: optional (S,) int64 DISTINCT slot indices: solve only these (their rows are
                gathered and scattered back; other slots are not touched, their ``out_mel`` rows
                included). None = every slot.
            steps: optional (first, stop): run Euler steps first .. stop - 1 only (a solve spread
                over calls, docs/design.md §8). The Euler state between calls waits in
                ``arena.x_state`` (float32); before the last span nothing else is committed. The
                staged inputs and the slot set must be the same in every call of one solve.
        """
        shape = self.shape(arena, t_len, cache_frames, steps)
        solved = SolvedRows(arena, noise, shape, slots)
        stepper = stepper_for(self.estimator, arena, solved, self.timesteps, self.cfg_rate, self.fused)
        layout = layout_for(arena, solved, stepper.form)
        stepper.start(solved.x)
        run_steps(stepper, layout, shape.steps)
        if shape.commits:
            layout.commit()
            solved.commit(stepper.result(), layout.new_lengths)
        else:
            solved.keep(stepper.result())


__all__ = ["ArenaSolver", "run_steps"]
