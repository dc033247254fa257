"""The one shape of a bad-argument error: ``<op>: <arg> must <expectation>, got <actual>[; <remedy>]``.

Every layer raises ``ValueError`` through :func:`fail`, reading metadata only (shape, dtype,
device: never data, so a check never synchronises and runs unchanged under FakeTensorMode).
"""

from __future__ import annotations

import torch


def shape_str(t: torch.Tensor) -> str:
    dims = [str(s) for s in t.shape]
    return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"


def dtype_str(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def fail(op: str, arg: str, expectation: str, got: str, remedy: str = "") -> None:
    msg = f"{op}: {arg} must {expectation}, got {got}"
    raise ValueError(msg + (f"; {remedy}" if remedy else ""))


__all__ = ["fail", "shape_str", "dtype_str"]
