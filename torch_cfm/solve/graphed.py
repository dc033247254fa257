"""The arena solve replayed from CUDA graphs: :class:`ArenaSolver`'s call, one graph per shape.

:class:`GraphedArenaSolver` has the solver's call signature. It keys each call by what the
captured solve depends on: the arena (its buffers are read and written in place, never
reallocated) and its noise buffer, the :class:`~torch_cfm.solve.rows.SolveShape`, the shape of
``slots`` (its values are copied into the captured index), the estimator and its packed weights
(a repack after a weight change is a new key), and torch's TF32 flag; and runs it through the
package's :class:`~torch_cfm.graphs.GraphCache` in its in-place form (``warmup`` eager calls, then
a capture, then replays; eager off CUDA and where a capture fails).
"""

from __future__ import annotations

from typing import Hashable, Optional

import torch

from ..graphs import GraphCache
from ..packing import packed_for
from .engine import ArenaSolver


def _meta(t: Optional[torch.Tensor]) -> Optional[tuple]:
    return None if t is None else (tuple(t.shape), t.dtype, t.device)


class GraphedArenaSolver:
    """``solver``'s solves replayed from ``cache`` (module docstring).

    Args:
        solver: the :class:`ArenaSolver` to capture.
        cache: the graph cache (default: a new one of ``max_graphs`` keys, warm-up 1).
    Attributes:
        solver, cache.
    """

    def __init__(self, solver: ArenaSolver, cache: Optional[GraphCache] = None, *, max_graphs: int = 8) -> None:
        self.solver = solver
        self.cache = cache if cache is not None else GraphCache("solve", max_graphs=max_graphs)

    def _weights_key(self, arena) -> Optional[int]:
        try:
            return id(packed_for(self.solver.estimator, arena.att.dtype, arena.att.device))
        except (ValueError, TypeError, AttributeError):  # an estimator the fused body cannot pack
            return None

    def key(self, arena, noise: torch.Tensor, shape, slots: Optional[torch.Tensor]) -> Hashable:
        """What a captured solve of this call depends on."""
        return (id(self.solver.estimator), self.solver.fused, self._weights_key(arena), arena.identity, noise.data_ptr(), _meta(noise),
                shape, _meta(slots), torch.backends.cuda.matmul.allow_tf32)

    def __call__(self, arena, noise: torch.Tensor, *, t_len: int, cache_frames: int,
                 slots: Optional[torch.Tensor] = None, steps: Optional[tuple[int, int]] = None) -> None:
        shape = self.solver.shape(arena, t_len, cache_frames, steps)
        label = dict(rows=arena.rows, slots=None if slots is None else int(slots.shape[0]), t_len=t_len,
                     cache_frames=cache_frames, dtype=str(arena.att.dtype).replace("torch.", ""))
        if steps is not None:
            label["steps"] = shape.steps

        def solve(slots_in: Optional[torch.Tensor]) -> None:
            self.solver(arena, noise, t_len=t_len, cache_frames=cache_frames, slots=slots_in, steps=steps)

        self.cache.run(self.key(arena, noise, shape, slots), solve, (slots,), device=arena.att.device, label=label)


__all__ = ["GraphedArenaSolver"]
