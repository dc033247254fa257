"""torch_cfm: fast, compile-ready flow-matching (CFM) DiT speech decoders.

Importing the package loads the C++ extension (op schemas + CPU kernels), then registers the
Python side of each op (fake kernels, autocast rules, CUDA kernels).
"""

from __future__ import annotations

import torch  # noqa: F401  (loads libtorch before the extension)

try:
    from . import _C  # noqa: F401  (runs TORCH_LIBRARY registrations)
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "torch_cfm: the C++ extension torch_cfm._C is not built or does not match this torch "
        f"({exc}). Rebuild in place: python -m pip install --no-build-isolation --no-deps -e ."
    ) from exc

from . import _source_layout, policy

_source_layout.install()
from .config import DiTConfig, SolverConfig
from .diagnostics import explain
from .ops import cfm_attention
from .models import CFMServer, DiT, StreamingCFM, load_checkpoint
from .compile import compile  # noqa: A004  torch_cfm.compile(model, **options) (compile rules)

__version__ = "0.1.0"

__all__ = ["cfm_attention", "explain", "policy", "DiTConfig", "SolverConfig", "__version__",
           "DiT", "StreamingCFM", "CFMServer", "load_checkpoint"]
