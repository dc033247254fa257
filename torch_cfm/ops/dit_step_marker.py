"""The DiT-step marker op: one node that says "this is one estimator step" in a traced graph.

``DiT.forward_chunk`` runs its reference path as ~30 ops per block; nothing in that graph says
"this is one estimator step, these are its inputs and outputs". :func:`mark_dit_step` says it:
called under ``torch.compile`` right after a reference step, it records ONE node,
``torch.ops.torch_cfm._dit_step_marker``, whose arguments are the step's outputs (velocity, new
caches), its inputs (x, mu, t, spks, cond, caches, lengths) and the estimator's parameters with
their docs/design.md §1 names. The node has no outputs and no effect; it is registered as side-effectful so
Dynamo keeps it. The op lives here, below the models, so the model can mark its step without
knowing the compile rules; the rules (``torch_cfm.compile_rules.markers`` and its ``dit_step``
pass) always remove it: they rewire the outputs to the fused step or just drop the marker.

Eager code never needs the marker (``mark_dit_step`` is a no-op outside ``torch.compile``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.fx

MARKER = "_dit_step_marker"

_lib = torch.library.Library("torch_cfm", "FRAGMENT")  # noqa: TOR901
_lib.define(
    f"{MARKER}(Tensor velocity, Tensor new_cnn_cache, Tensor new_att_cache, Tensor x, Tensor mu, "
    "Tensor t, Tensor? spks, Tensor? cond, Tensor? cnn_cache, Tensor? att_cache, "
    "Tensor? valid_lengths, Tensor? cache_lengths, Tensor[] params, str[] names, int fused=-1) -> ()")


def _marker_noop(*args, **kwargs) -> None:
    return None


_lib.impl(MARKER, _marker_noop, "CompositeExplicitAutograd")
_lib.impl(MARKER, _marker_noop, "Meta")


def marker_op() -> torch._ops.OpOverload:
    return getattr(torch.ops.torch_cfm, MARKER).default


torch.fx.node.has_side_effect(marker_op())


def mark_dit_step(model: torch.nn.Module, outputs: Sequence[torch.Tensor], x: torch.Tensor,
                  mu: torch.Tensor, t: torch.Tensor, spks: Optional[torch.Tensor],
                  cond: Optional[torch.Tensor], cnn_cache: Optional[torch.Tensor] = None,
                  att_cache: Optional[torch.Tensor] = None, *,
                  valid_lengths: Optional[torch.Tensor] = None,
                  cache_lengths: Optional[torch.Tensor] = None,
                  fused: Optional[bool] = None) -> None:
    """Mark ``outputs = model.forward_chunk(x, mu, t, spks, cond, ...)`` (reference path) as one
    estimator step for the compile rules. No-op outside ``torch.compile``.

    Args:
        model: the estimator (parameters named as docs/design.md §1).
        outputs: (velocity (N, 80, T), new_cnn_cache (depth, N, 2C, 2), new_att_cache
            (depth, N, H, T+L, 2D)) of the reference step.
        x, mu: (N, 80, T); t: (N,) or () times; spks: (N, 80) or None; cond: (N, 80, T) or None.
        cnn_cache, att_cache, valid_lengths, cache_lengths: as given to ``forward_chunk``.
        fused: the caller's explicit override (None = policy).
    """
    if not torch.compiler.is_compiling():
        return
    names, params = zip(*model.named_parameters())
    velocity, new_cnn, new_att = outputs
    t = t if isinstance(t, torch.Tensor) else torch.full((x.shape[0],), float(t), device=x.device)
    marker_op()(velocity, new_cnn, new_att, x, mu, t.reshape(-1), spks, cond, cnn_cache, att_cache,
                valid_lengths, cache_lengths, list(params), list(names),
                -1 if fused is None else int(bool(fused)))


__all__ = ["MARKER", "mark_dit_step", "marker_op"]
