"""``DiT.forward_chunk`` on the fused body: the model's hook into the ``torch_cfm::dit_body`` op.

The weights are packed once per (model, compute dtype, device) (:mod:`torch_cfm.packing`) and the
modulation table computed per call from ``t``; the op runs the whole estimator step.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .. import policy
from ..errors import fail, shape_str
from ..packing import modulation_table, packed_for



def stage_input(x: torch.Tensor, mu: torch.Tensor, spks: Optional[torch.Tensor], cond: Optional[torch.Tensor],
                dtype: torch.dtype) -> torch.Tensor:
    """``concat(x, mu, spks broadcast over time, cond)`` -> (N, 320, T) in ``dtype``."""
    n_rows, mel, t_len = x.shape
    spks = x.new_zeros((n_rows, mel)) if spks is None else spks
    cond = torch.zeros_like(x) if cond is None else cond
    return torch.cat([x.to(dtype), mu.to(dtype), spks.to(dtype)[:, :, None].expand(-1, -1, t_len),
                      cond.to(dtype)], dim=1)


def _time_vector(t, n_rows: int, device: torch.device) -> torch.Tensor:
    if isinstance(t, torch.Tensor):
        t = t.reshape(-1).to(device)
        if t.numel() not in (1, n_rows):
            fail("dit_forward_chunk_fused", "t", f"be a scalar or have N={n_rows} entries", shape_str(t))
        return t
    return torch.full((1,), float(t), device=device, dtype=torch.float64)


def dit_forward_chunk_fused(
    model: torch.nn.Module,
    x: torch.Tensor,
    mu: torch.Tensor,
    t,
    spks: Optional[torch.Tensor],
    cond: Optional[torch.Tensor],
    cnn_cache: Optional[torch.Tensor] = None,
    att_cache: Optional[torch.Tensor] = None,
    *,
    valid_lengths: Optional[torch.Tensor] = None,
    cache_lengths: Optional[torch.Tensor] = None,
    precision: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``DiT.forward_chunk`` on the fused body (same arguments and results, docs/design.md §2).

    Weights are packed once per (model, compute dtype, device) and repacked when a parameter
    changes. The modulation table is computed per call from ``t`` (one table when t is a scalar,
    one per row when t has N entries). The compute dtype is the autocast dtype when autocast is
    enabled, else the parameters' dtype.

    Returns:
        velocity (N, 80, T), new_cnn_cache (depth, N, 2C, 2), new_att_cache (depth, N, H, T+L, 2D)
        in the compute dtype.
    """
    dev = x.device
    dtype = model.compute_dtype(dev.type)
    packed = packed_for(model, dtype, dev)
    x_in = stage_input(x, mu, spks, cond, dtype)
    prec = precision if precision in ("tf32", "ieee") else "auto"
    tf = policy.resolve_precision(dtype, prec)
    scope = (policy.tf32_scope(tf == "tf32") if dtype == torch.float32 and dev.type == "cuda"
             else contextlib.nullcontext())
    with torch.autocast(dev.type, enabled=False), torch.no_grad():
        with scope:
            table = modulation_table(packed, _time_vector(t, x.shape[0], dev))
        cnn = None if cnn_cache is None else cnn_cache.to(dtype)
        att = None if att_cache is None else att_cache.to(dtype)
        return torch.ops.torch_cfm.dit_body.default(x_in, packed.body, table, cnn, att,
                                                    valid_lengths, cache_lengths, prec)


__all__ = ["dit_forward_chunk_fused", "stage_input"]
