"""The model side of torch_cfm (SPEC §1-3).

* :class:`DiT` / :class:`DiTConfig`: the checkpoint-compatible estimator (full and streaming
  chunk forwards, ragged rows); :func:`load_checkpoint` for upstream weights.
* :class:`StreamingCFM`: cosine-schedule Euler solve with CFG over the fixed noise buffer.
* :class:`CFMServer`: open/close requests and solve chunks of any subset of them at once over
  preallocated cache arenas, with a start-up warm-up and a memory plan; :func:`solve_arena_chunk`
  is the one solve engine (the server's, ``StreamingCFM.forward_chunk``'s and the CUDA-graph
  runners' in :mod:`torch_cfm.graphs`).
"""

from ..config import DiTConfig
from .cache import CacheArena, trim_attention_cache, trim_gather_index, trimmed_length
from .checkpoint import config_from_state_dict, estimator_state_dict
from .dit import DiT, load_checkpoint, random_dit
from .server import AdmissionError, CFMServer
from .solver import StreamingCFM, euler_timesteps, solve_arena_chunk

__all__ = [
    "DiTConfig", "DiT", "random_dit", "load_checkpoint", "estimator_state_dict", "config_from_state_dict",
    "StreamingCFM", "CFMServer", "AdmissionError", "CacheArena", "solve_arena_chunk", "euler_timesteps",
    "trim_attention_cache", "trim_gather_index", "trimmed_length",
]
