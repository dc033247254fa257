"""``explain_model``: every candidate site of the compile rules in a model, with its decision.

Traces the model with Dynamo (a throw-away backend that runs the model eagerly), runs the
composed pass on a copy of each captured graph and prints what it would do: for each site its
rule, dtype, device, action (fused / pinned / kept / guarded) and the policy's reasons.
"""

from __future__ import annotations

import itertools
import os
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.fx

from torch_cfm import policy

from .passes import RulesConfig, Site, TorchCfmPass

_COUNTER = itertools.count()


def _describe_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).replace("torch.", "")
        return f"{tuple(value.shape)} {dtype} {value.device}"
    if value is None:
        return "None"
    return type(value).__name__


def _fresh_entry() -> Callable[..., Any]:
    """A function with its own code object, so Dynamo's cache entries for this trace stay
    on it instead of piling up on the model's code (no ``torch._dynamo.reset()`` needed)."""
    namespace: dict[str, Any] = {}
    source = "def _entry(fn, args, kwargs):\n    return fn(*args, **kwargs)\n"
    exec(compile(source, f"<torch_cfm.explain#{next(_COUNTER)}>", "exec"), namespace)
    return namespace["_entry"]


def _copy_graph(gm: torch.fx.GraphModule) -> torch.fx.Graph:
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return graph


def trace_sites(fn: Callable[..., Any], args: Sequence[Any] = (),
                kwargs: Optional[Mapping[str, Any]] = None,
                config: Optional[RulesConfig] = None) -> tuple[list[Site], int, Any]:
    """Run ``fn(*args, **kwargs)`` under Dynamo; returns (sites, number of graphs, result)."""
    rules_pass = TorchCfmPass(config)
    graphs = 0

    def capture(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **_: Any):
        nonlocal graphs
        graphs += 1
        rules_pass(_copy_graph(gm))
        return gm.forward

    compiled = torch.compile(_fresh_entry(), backend=capture, dynamic=False)
    result = compiled(fn, tuple(args), dict(kwargs or {}))
    return list(rules_pass.sites), graphs, result


def format_report(name: str, inputs: Sequence[str], sites: Sequence[Site], graphs: int,
                  config: RulesConfig) -> str:
    env = os.environ if config.env is None else config.env
    lines = ["torch_cfm.compile_rules.explain", "inputs:", f"  model:      {name}"]
    lines += [f"  input {i}:    {text}" for i, text in enumerate(inputs)]
    lines.append(f"  tf32:       allowed={policy.tf32_allowed(config.tf32, env)} "
                 f"(torch matmul={policy.torch_tf32_enabled()}, "
                 f"{policy.ENV_TF32}={env.get(policy.ENV_TF32, '<unset>')})")
    lines.append(f"  override:   fused={config.fused}, "
                 f"{policy.ENV_FUSED}={env.get(policy.ENV_FUSED, '<unset>')}"
                 + (f", capability=SM{config.capability[0]}{config.capability[1]}"
                    if config.capability else ""))
    breaks = f" ({graphs - 1} graph break{'s' if graphs != 2 else ''})" if graphs > 1 else ""
    lines.append(f"graphs: {graphs}{breaks}")
    counts = {a: sum(s.action == a for s in sites) for a in ("fused", "pinned", "kept", "guarded")}
    summary = ", ".join(f"{a} {n}" for a, n in counts.items() if n)
    lines.append(f"sites: {len(sites)}" + (f" ({summary})" if summary else ""))
    if not sites:
        lines.append("  none: the traced code calls no torch_cfm op the rules know "
                     "(cfm_attention, the DiT reference step)")
    for site in sites:
        lines.append("  " + site.describe())
        lines += [f"      - {reason}" for reason in site.reasons]
    return "\n".join(lines)


def explain_model(model: Callable[..., Any], example_inputs: Any = (), *,
                  config: Optional[RulesConfig] = None, fused: Optional[bool] = None,
                  tf32: Optional[bool] = None,
                  capability: Optional[tuple[int, int]] = None) -> str:
    """List every compile-rule candidate site of ``model(*example_inputs)`` with its decision.

    The model runs once (eagerly, under Dynamo tracing); nothing is compiled for it and its
    Dynamo cache is left alone.

    Args:
        model: an ``nn.Module`` or any callable (e.g. ``dit.forward_chunk``).
        example_inputs: a tuple/list of positional inputs, a dict of keyword inputs, or one
            tensor.
        config: a :class:`RulesConfig`; or give ``fused``/``tf32``/``capability`` directly.
    Returns:
        the report text (an inputs block, then each site with its reasons, indented).
    """
    if config is None:
        config = RulesConfig(fused=fused, tf32=tf32, capability=capability)
    if isinstance(example_inputs, Mapping):
        args, kwargs = (), dict(example_inputs)
    elif isinstance(example_inputs, (tuple, list)):
        args, kwargs = tuple(example_inputs), {}
    else:
        args, kwargs = (example_inputs,), {}
    sites, graphs, _ = trace_sites(model, args, kwargs, config)
    name = getattr(model, "__qualname__", None) or type(model).__name__
    inputs = [_describe_value(a) for a in args] + [f"{k}={_describe_value(v)}" for k, v in kwargs.items()]
    return format_report(name, inputs, sites, graphs, config)
