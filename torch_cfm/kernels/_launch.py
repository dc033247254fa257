"""Small host-side helpers shared by the Triton launchers (device guard, SM count, dtype names)."""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch
import triton
import triton.language as tl

from .body_plans import PDL_CAPABLE_KERNELS, BodyPlan

try:  # grid dependency control (PDL) device functions: Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _HAS_GDC = True
except ImportError:  # pragma: no cover - older Triton: PDL stays off
    gdc_launch_dependents = gdc_wait = None
    _HAS_GDC = False


@functools.lru_cache(maxsize=None)
def _sm_count_cached(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached; a host query, no sync).

    For a CPU device (Triton interpreter) returns a fixed 132 (an H200) so that the tile
    heuristics pick the same shapes as on the GPU the project tunes for.
    """
    if device.type != "cuda":
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count_cached(index)


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch available for kernels on ``device``: the device and env rule
    (:func:`torch_cfm.policy.pdl_allowed`) and a Triton with grid dependency control. Off on CPU
    (the Triton interpreter has no grid dependency control)."""
    from .. import policy

    return _HAS_GDC and policy.pdl_allowed(device)


def plan_pdl(plan: BodyPlan, kernel: str, device: torch.device) -> bool:
    """PDL for the body kernel ``kernel`` under ``plan`` (:attr:`BodyPlan.pdl`) on ``device``."""
    assert kernel in PDL_CAPABLE_KERNELS, kernel  # a misspelt launcher name would silently mean "off"
    return kernel in plan.pdl and pdl_supported(device)


@triton.jit
def pdl_prologue(USE_PDL: tl.constexpr):
    """Wait for the previous kernel in the stream to finish (its writes visible), then let the
    next one be scheduled. Every program passes the wait, so "kernel done" keeps implying "all
    earlier kernels done".

    Loads placed before it overlap the previous kernel's tail; they may only read what the
    *immediately preceding* kernel does not write (everything older is complete: that kernel
    itself waited, or was launched without PDL). The body kernels load weights, modulation
    tables, lengths and old caches there, always behind one of the body's GEMMs."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


def launch_kwargs(use_pdl: bool) -> dict:
    """Extra Triton launch options: ``launch_pdl`` only when PDL is on (older launchers lack it)."""
    return {"launch_pdl": True} if use_pdl else {}


@contextlib.contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """Make ``device`` current while launching, so Triton picks its current stream.

    Triton launches on the *current* device's current stream whatever the tensors' device is;
    entering the guard only when it differs keeps the common case free of host overhead.
    """
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            yield
    else:
        yield
