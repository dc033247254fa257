"""The solve layer: the one chunk-solve engine and its CUDA-graph replay (docs/design.md §3, §8).

* :class:`ArenaSolver` (:mod:`.engine`): a chunk's n-step CFG Euler solve over a cache arena,
  composed of the solved rows (:mod:`.rows`), a stepper (:mod:`.steppers`: fused body or the
  estimator's own step) and a cache layout (:mod:`.caches`: newest first, keyed in place, keyed
  in a scratch copy, keyed for a dense stepper).
* :class:`GraphedArenaSolver` (:mod:`.graphed`): the same call replayed from one CUDA graph per
  shape through the package's :class:`~torch_cfm.graphs.GraphCache`.
* :class:`StreamingCFM` (:mod:`.streaming`): the estimator, its noise and schedule, and the
  upstream-equivalent ``forward_chunk``.
"""

from .engine import ArenaSolver, run_steps
from .graphed import GraphedArenaSolver
from .rows import SolveShape
from .schedule import euler_timesteps, schedule_tables
from .streaming import StreamingCFM

__all__ = ["ArenaSolver", "GraphedArenaSolver", "SolveShape", "StreamingCFM", "euler_timesteps", "run_steps",
           "schedule_tables"]
