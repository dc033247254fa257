"""``torch_cfm.compile(model, **options)``: ``torch.compile`` with the torch_cfm rules.

Equivalent to ``torch.compile(model, backend="torch_cfm", ...)`` with the rule options given as
keywords. See :mod:`torch_cfm.compile_rules` for what the rules do.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, TypeVar

import torch

_F = TypeVar("_F", bound=Callable[..., Any])


def compile(  # noqa: A001 - mirrors torch.compile
    model: _F,
    *,
    mode: Optional[str] = None,
    fullgraph: bool = False,
    dynamic: Optional[bool] = None,
    fused: Optional[bool] = None,
    tf32: Optional[bool] = None,
    capability: Optional[tuple[int, int]] = None,
    guard_clones: bool = True,
    options: Optional[Mapping[str, Any]] = None,
) -> _F:
    """Compile ``model`` (a module or function) with the torch_cfm rules, then Inductor.

    The rules swap the fused DiT body in for each reference estimator step and pin the fp32
    precision of every ``cfm_attention`` when :func:`torch_cfm.policy.decide` allows it for the
    traced dtype/device and the TF32 state at trace time (docs/design.md §5); elsewhere the reference
    path is compiled as is. ``torch_cfm.explain(model, example_inputs)`` lists the decisions.

    Args:
        model: an ``nn.Module`` or callable, as for ``torch.compile``.
        mode: Inductor mode ("default", "reduce-overhead", "max-autotune", ...).
        fullgraph, dynamic: as for ``torch.compile``.
        fused: force (True) / forbid (False) the fused body at every site; None = policy
            (env ``TORCH_CFM_FUSED`` still wins).
        tf32: TF32 permission for fp32 sites; None = ``torch.backends.cuda.matmul`` at trace time
            (env ``TORCH_CFM_TF32`` wins).
        capability: decide as if the CUDA device had this (major, minor) capability.
        guard_clones: keep clone-then-mutate copies in front of torch_cfm ops (pytorch#198031).
        options: Inductor config options (as ``torch.compile(options=...)``).
    Returns:
        the compiled module/function (``torch.compile``'s return value).
    Example:
        >>> model = torch_cfm.DiT(torch_cfm.DiTConfig(hidden=64, depth=2, heads=4, head_dim=16))
        >>> step = torch_cfm.compile(model.forward_chunk, mode="reduce-overhead")
    """
    from .compile_rules import RulesConfig, TorchCfmBackend

    if mode is not None and not isinstance(mode, str):
        raise ValueError(f"torch_cfm.compile: mode must be a str or None, got {type(mode).__name__}")
    options = dict(options) if options else None
    if mode is not None and options:  # torch.compile takes one or the other
        from torch._inductor import list_mode_options

        options, mode = {**list_mode_options(mode), **options}, None
    rules = RulesConfig(fused=fused, tf32=tf32, capability=None if capability is None else tuple(capability),
                        guard_clones=guard_clones)
    return torch.compile(model, backend=TorchCfmBackend(rules), mode=mode, fullgraph=fullgraph,
                         dynamic=dynamic, options=options)
