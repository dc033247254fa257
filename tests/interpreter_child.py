"""Environment of a child interpreter that runs the Triton kernels in Triton's interpreter.

``TRITON_INTERPRET`` is read when a kernel is decorated (module import), so the interpreter cases
run in a child process. The child imports ``torch_cfm`` from this checkout whether or not the
package is installed (the GPU box runs the suite from a bare copy of the tree).
"""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def interpreter_env(*, hide_gpus: bool = True, **extra: str) -> dict[str, str]:
    """``os.environ`` with ``TRITON_INTERPRET=1``, the checkout first on ``PYTHONPATH``, no visible
    CUDA device (``hide_gpus``) and ``extra``."""
    env = dict(os.environ, TRITON_INTERPRET="1", **extra)
    if hide_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return env
