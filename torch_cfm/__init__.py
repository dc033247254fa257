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

from . import policy  # noqa: E402
from .compile import compile  # noqa: E402,A004  torch_cfm.compile(model, **options) (compile rules)
from .config import DiTConfig, SolverConfig  # noqa: E402
from .diagnostics import explain  # noqa: E402
from .models import DiT, load_checkpoint  # noqa: E402
from .ops import cfm_attention, dit_body  # noqa: E402
from .serving import CFMServer  # noqa: E402
from .solve import StreamingCFM  # noqa: E402

__version__ = "0.1.0"

__all__ = ["cfm_attention", "dit_body", "explain", "policy", "compile", "DiTConfig", "SolverConfig",
           "DiT", "StreamingCFM", "CFMServer", "load_checkpoint", "__version__"]
