"""``torch_cfm.explain()`` / ``python -m torch_cfm``: what runs on this machine, and why.

Prints versions, the device, the TF32 state, then for each op and dtype the decision of
:func:`torch_cfm.policy.decide` with its reasons (the same function eager dispatch and the
compile passes use). Given a model and example inputs, it also lists every candidate site of the
compile rules (see :mod:`torch_cfm.compile_rules`).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional, Sequence

import torch

from . import policy

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _versions() -> list[str]:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    return [f"torch {torch.__version__}", f"triton {triton_version}",
            f"python {sys.version.split()[0]}"]


def machine_report(device: Optional[torch.device] = None) -> str:
    """The text block ``explain()`` prints for one device (default: cuda:0 if present, else cpu)."""
    if device is None:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    lines = ["torch_cfm.explain", "inputs:"]
    lines.append("  versions:   " + ", ".join(_versions()))
    if device.type == "cuda" and torch.cuda.is_available():
        cap = torch.cuda.get_device_capability(device)
        lines.append(f"  device:     {device} {torch.cuda.get_device_name(device)} (SM{cap[0]}{cap[1]})")
    else:
        lines.append(f"  device:     {device}")
    lines.append(f"  tf32:       torch matmul={policy.torch_tf32_enabled()}, "
                 f"{policy.ENV_TF32}={os.environ.get(policy.ENV_TF32, '<unset>')}, "
                 f"allowed={policy.tf32_allowed()}")
    lines.append(f"  override:   {policy.ENV_FUSED}={os.environ.get(policy.ENV_FUSED, '<unset>')}")
    lines.append(f"  pdl:        {'allowed' if policy.pdl_allowed(device) else 'off'} (SM90+, "
                 f"{policy.ENV_PDL}={os.environ.get(policy.ENV_PDL, '<unset>')}; attention grids of one wave, "
                 "fp32 body row-norm kernels, the body's wgmma GEMMs and the kernels around them)")
    from .kernels import cfm_attention_cuda, cutlass_gemm, dit_linear_cuda
    from .kernels.body_plans import CUTLASS_MIN_ROWS, WGMMA_MAX_ROWS, describe_table, wgmma_roles

    lines.append(f"  attention:  {policy.ENV_ATTENTION_KERNEL}={os.environ.get(policy.ENV_ATTENTION_KERNEL, '<unset>')}; "
                 f"CUDA kernel {cfm_attention_cuda.build_status()}")
    why_not = dit_linear_cuda.device_reason(device) or (
        None if policy.pdl_allowed(device) else "PDL is off; the wgmma plans run their GEMMs only with it")
    lines.append("  body GEMMs: " + ("wgmma kernel (16-bit and TF32 bodies of at most "
                                      f"{WGMMA_MAX_ROWS} rows: {wgmma_roles()}; else cuBLAS)"
                                      if why_not is None else f"cuBLAS ({why_not})"))
    lines.append(f"  body plans: rows -> plan ({describe_table()}; torch_cfm/kernels/body_plans.py)")
    cutlass_why = cutlass_gemm.unavailable_reason()
    lines.append("  CUTLASS:    " + (f"{cutlass_gemm.library_path()} ({len(cutlass_gemm.configs())} configs)"
                                     if cutlass_why is None else f"not available: {cutlass_why}")
                 + f"; the 16-bit arena plan from {CUTLASS_MIN_ROWS} rows, cutlass_warp_rownorm, runs qkv, proj, "
                   "conv and fc2 on it (else cuBLAS)")
    lines.append("ops:")
    for dtype in _DTYPES:
        d = policy.decide(device, dtype)
        name = str(dtype).replace("torch.", "")
        prec = f" precision={d.precision}" if d.precision else ""
        family = " (where its tile rule picks it and it covers the call, else Triton)" \
            if d.attention_kernel == "cuda" else ""
        lines.append(f"  cfm_attention [{name}]: kernel={d.attention_kernel}{prec}{family}")
        lines.append(f"  dit_body      [{name}]: {'fused' if d.fused else 'reference'}"
                     + (f" [{d.source}]" if d.source != "policy" else ""))
        for reason in d.reasons:
            lines.append(f"      - {reason}")
    return "\n".join(lines)


def explain(model: Optional[torch.nn.Module] = None, example_inputs: Optional[Sequence[Any]] = None,
            *, device: Optional[torch.device] = None, file=None) -> str:
    """Print (and return) the dispatch decisions for this machine, and for ``model`` if given.

    Args:
        model: optional module to inspect; with ``example_inputs`` every candidate site of the
            compile rules is listed with its decision and reason.
        example_inputs: positional inputs for ``model``.
        device: device to report on (default: the model's / cuda:0 / cpu).
        file: stream to print to (default stdout); pass ``False`` to print nothing.
    """
    if model is not None:
        from .compile_rules import explain_model

        text = explain_model(model, example_inputs or ())
    else:
        text = machine_report(device)
    if file is not False:
        print(text, file=file or sys.stdout)
    return text

