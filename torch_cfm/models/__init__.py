"""The model layer of torch_cfm (docs/design.md §1-2): what the modules compute.

* :class:`DiT` / :class:`DiTConfig`: the checkpoint-compatible estimator (full and streaming
  chunk forwards, ragged rows); :func:`load_checkpoint` for upstream weights; its fused-body hook
  (:mod:`.fused_forward`).
* :mod:`.cache`: the cache layouts, the streaming trim and the :class:`CacheArena` the solver
  and servers keep their streams in.

The solve engine is one layer up (:mod:`torch_cfm.solve`), the servers another (:mod:`torch_cfm.serving`).
"""

from ..config import DiTConfig
from .cache import CacheArena, trim_attention_cache, trim_gather_index, trimmed_length
from .checkpoint import config_from_state_dict, estimator_state_dict
from .dit import DiT, load_checkpoint, random_dit

__all__ = [
    "DiTConfig", "DiT", "random_dit", "load_checkpoint", "estimator_state_dict", "config_from_state_dict",
    "CacheArena", "trim_attention_cache", "trim_gather_index", "trimmed_length",
]
