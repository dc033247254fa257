"""Environment of a child interpreter that runs the Triton kernels in Triton's interpreter.

``TRITON_INTERPRET`` is read when a kernel is decorated (module import), so the interpreter cases
run in a child process. The child imports ``torch_cfm`` from this checkout whether or not the
package is installed (the GPU box runs the suite from a bare copy of the tree).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def interpreter_env(*, hide_gpus: bool = True, **extra: str) -> dict[str, str]:
    """``os.environ`` with ``TRITON_INTERPRET=1``, the checkout first on ``PYTHONPATH``, no visible
    CUDA device (``hide_gpus``) and ``extra``."""
    env = dict(os.environ, TRITON_INTERPRET="1", **extra)
    if hide_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return env


def run_child_file(test_file: str, out_path: str, timeout: float = 300) -> Any:
    """Run ``python test_file --child out_path`` in :func:`interpreter_env` (the tests folder and
    the checkout on ``PYTHONPATH``) and load what the child saved to ``out_path``."""
    here = os.path.dirname(os.path.abspath(test_file))
    env = interpreter_env()
    env["PYTHONPATH"] = os.pathsep.join([here, env["PYTHONPATH"]])
    proc = subprocess.run([sys.executable, os.path.abspath(test_file), "--child", out_path], env=env, cwd=here,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out_path)
