"""Rule for the estimator step: the reference DiT step -> the fused DiT body op.

A site is a ``torch_cfm::_dit_step_marker`` node (see :mod:`torch_cfm.compile_rules.markers`):
it names the reference step's outputs and inputs and the estimator's parameters. The compute
dtype is the traced dtype of the new attention cache, the device that of ``x``. When
:func:`torch_cfm.policy.decide` says fused (the marker's explicit ``fused`` wins over the rules'
config; env ``TORCH_CFM_FUSED`` over both), the rule inserts one call of
:func:`~torch_cfm.compile_rules.markers.fused_dit_step` in front of the marker and rewires every
later use of the three reference outputs to it. The reference region is left in place: after
AOT functionalisation nothing reads it and Inductor drops it. Either way the marker is removed.

A ``torch_cfm::dit_body`` call already in the graph (the model dispatched itself) is reported
as a fused site and left alone.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ..markers import MARKER, fused_dit_step, marker_op
from ._context import RuleContext
from ._graph import Site, is_op, node_value, schema_args, tensor_meta

RULE = "dit_step"
OUTPUTS = ("velocity", "new_cnn_cache", "new_att_cache")
INPUTS = ("x", "mu", "t", "spks", "cond", "cnn_cache", "att_cache", "valid_lengths", "cache_lengths")


def _body_op():
    packet = getattr(torch.ops.torch_cfm, "dit_body", None)
    return None if packet is None else packet.default


def _rewire_after(graph: torch.fx.Graph, marker: torch.fx.Node, old: torch.fx.Node,
                  new: torch.fx.Node) -> None:
    order = {node: i for i, node in enumerate(graph.nodes)}
    here = order[marker]
    for user in list(old.users):
        if user is not new and user is not marker and order[user] > here:
            user.replace_input_with(old, new)


def _swap(graph: torch.fx.Graph, marker: torch.fx.Node, args: dict, dtype: torch.dtype,
          precision: str) -> None:
    call_args = (list(args["params"]), list(args["names"])) + tuple(args[k] for k in INPUTS) + (dtype, precision)
    with graph.inserting_before(marker):
        call = graph.call_function(fused_dit_step, call_args)
        outs = [graph.call_function(operator.getitem, (call, i)) for i in range(3)]
    for name, new in zip(OUTPUTS, outs):
        old = args[name]
        value = node_value(old)
        if isinstance(value, torch.Tensor):  # same shape/dtype/device as the reference output
            new.meta["example_value"] = value
            new.meta["val"] = value
        _rewire_after(graph, marker, old, new)


def apply(graph: torch.fx.Graph, ctx: RuleContext) -> list[Site]:
    """Visit every DiT-step marker (and dit_body call) of ``graph``; one :class:`Site` each."""
    marker = marker_op()
    body = _body_op()
    sites: list[Site] = []
    for node in list(graph.nodes):
        if body is not None and is_op(node, body):
            dtype, device = tensor_meta(node_value(node.args[0]) if node.args else None)
            sites.append(Site(RULE, node.name, ctx.stage, "fused", dtype, str(device),
                              "dit_body already in the graph (dispatched by the model)"))
            continue
        if not is_op(node, marker):
            continue
        args = schema_args(node)
        dtype, _ = tensor_meta(node_value(args["new_att_cache"]))
        _, device = tensor_meta(node_value(args["x"]))
        if dtype is None or device is None:
            graph.erase_node(node)
            sites.append(Site(RULE, node.name, ctx.stage, "kept", reasons=("no traced values",)))
            continue
        explicit = None if args["fused"] in (None, -1) else bool(args["fused"])
        decision = ctx.decide(device, dtype, fused=explicit)
        reasons = decision.reasons
        if decision.fused and body is None:
            reasons = ("torch_cfm::dit_body is not available in this build",)
        if decision.fused and body is not None:
            precision = decision.precision or "auto"
            _swap(graph, node, args, dtype, precision)
            detail = "torch_cfm::dit_body" + (f" precision={precision}" if decision.precision else "")
            detail += f" [{decision.source}]" if decision.source != "policy" else ""
            action, reasons = "fused", ()
        else:
            detail, action = "reference step kept", "kept"
        graph.erase_node(node)
        sites.append(Site(RULE, node.name, ctx.stage, action, dtype, str(device), detail, tuple(reasons)))
    return sites


__all__ = ["apply", "RULE", "MARKER"]
