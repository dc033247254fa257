"""Rule for the estimator step: the reference DiT step -> the fused DiT body op.

A site is a ``torch_cfm::_dit_step_marker`` node (see :mod:`torch_cfm.compile_rules.markers`):
it names the reference step's outputs and inputs and the estimator's parameters. The compute
dtype is the traced dtype of the new attention cache, the device that of ``x``. When
:func:`torch_cfm.policy.decide` says fused (the marker's explicit ``fused`` wins over the rules'
config; env ``TORCH_CFM_FUSED`` over both), the rule inserts one call of
:func:`~torch_cfm.compile_rules.markers.fused_dit_step` in front of the marker and rewires every
later use of the three reference outputs to it. The reference region is left in place: after
AOT functionalisation nothing reads it and Inductor drops it. Either way the marker is removed.

With ``RulesConfig.prepack`` (our backend), the parameters' real values (Dynamo graph inputs)
are packed once at compile time into buffers of the graph module (one pack shared by every step
of the graph), and a :class:`PackBinding` (:func:`pack_bindings`) lets the backend repack them
in place when a parameter changes; otherwise (stock Inductor via ``install()``) the packing is traced into the graph.

A ``torch_cfm::dit_body`` call already in the graph (the model dispatched itself) is reported
as a fused site and left alone.
"""

from __future__ import annotations

import operator
import weakref
from typing import Optional

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor

from ..markers import (MARKER, PackBinding, fused_dit_step, fused_dit_step_prepacked, marker_op,
                       packed_tensors)
from ._context import RuleContext
from ._graph import Site, is_op, node_value, schema_args, tensor_meta

RULE = "dit_step"
# Per graph module: {"bindings": [PackBinding], "index": {(params, dtype, device): pack}}. Kept
# outside gm.meta so nothing of it is pickled or hashed with the graph by Inductor's caches.
_PACKS: "weakref.WeakKeyDictionary[torch.fx.GraphModule, dict]" = weakref.WeakKeyDictionary()


def pack_bindings(gm: torch.fx.GraphModule) -> list:
    """The :class:`PackBinding` list of weights packed at compile time for ``gm`` (maybe empty)."""
    entry = _PACKS.get(gm)
    return [] if entry is None else entry["bindings"]
OUTPUTS = ("velocity", "new_cnn_cache", "new_att_cache")
INPUTS = ("x", "mu", "t", "spks", "cond", "cnn_cache", "att_cache", "valid_lengths", "cache_lengths")


def _body_op():
    packet = getattr(torch.ops.torch_cfm, "dit_body", None)
    return None if packet is None else packet.default


def _rewire_after(graph: torch.fx.Graph, marker: torch.fx.Node, old: torch.fx.Node,
                  new: torch.fx.Node) -> None:
    order = {node: i for i, node in enumerate(graph.nodes)}
    here = order[marker]
    marker_target = marker.target
    for user in list(old.users):
        if user is new or user.target is marker_target:  # other markers keep naming the reference
            continue
        if order[user] > here:
            user.replace_input_with(old, new)


def _prepack(graph: torch.fx.Graph, marker: torch.fx.Node, args: dict, dtype: torch.dtype,
             device: torch.device) -> Optional[tuple]:
    """Pack the real parameters now into buffers of the graph's module; None if impossible
    (no module, or a parameter that is not a Dynamo graph input with its real value)."""
    gm = graph.owning_module
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if gm is None or not all(isinstance(p, torch.fx.Node) and p.op == "placeholder" for p in args["params"]):
        return None
    examples = []
    for p in args["params"]:
        grapharg = p.meta.get("grapharg")
        example = getattr(grapharg, "example", None) if grapharg is not None else None
        if not isinstance(example, torch.Tensor) or isinstance(example, FakeTensor):
            return None
        examples.append(example)
    from torch_cfm.packing import pack_dit

    names = list(args["names"])
    # One pack per (parameters, dtype, device) per graph: the 10 steps of a compiled solve share it.
    entry = _PACKS.setdefault(gm, {"bindings": [], "index": {}})
    packs, bindings = entry["index"], entry["bindings"]
    key = (tuple(args["params"]), dtype, device)
    if key not in packs:
        with torch.no_grad():
            packed = pack_dit(dict(zip(names, examples)), dtype, device)
        tensors = packed_tensors(packed)
        prefix = f"_torch_cfm_pack{len(bindings)}_"
        sources = getattr(gm, "_param_name_to_source", None)  # Dynamo graphs: AOT maps buffers to sources
        for j, tensor in enumerate(tensors):
            gm.register_buffer(prefix + str(j), tensor)
            if sources is not None:
                from torch._dynamo.source import ConstantSource

                sources[prefix + str(j)] = ConstantSource(f"{prefix}{j}_{id(gm)}")
        index = [placeholders.index(p) for p in args["params"]]
        bindings.append(PackBinding(index, examples, names, dtype, device, tensors))
        sizes = [packed.depth, packed.hidden, packed.heads, packed.head_dim, packed.in_channels,
                 packed.out_channels]
        packs[key] = (prefix, len(tensors), len(packed.body), sizes)
    prefix, count, n_body, sizes = packs[key]
    with graph.inserting_before(marker):
        nodes = [graph.get_attr(prefix + str(j)) for j in range(count)]
    return nodes[:n_body], nodes[n_body:n_body + 4], nodes[-2], nodes[-1], sizes


def _swap(graph: torch.fx.Graph, marker: torch.fx.Node, args: dict, dtype: torch.dtype,
          device: torch.device, precision: str, prepack: bool) -> bool:
    """Insert the fused step and rewire the outputs; returns True when the pack is prebuilt."""
    inputs = tuple(args[k] for k in INPUTS) + (dtype, precision)
    pre = _prepack(graph, marker, args, dtype, device) if prepack else None
    with graph.inserting_before(marker):
        if pre is not None:
            call = graph.call_function(fused_dit_step_prepacked, pre + inputs)
        else:
            call = graph.call_function(fused_dit_step, (list(args["params"]), list(args["names"])) + inputs)
        outs = [graph.call_function(operator.getitem, (call, i)) for i in range(3)]
    for name, new in zip(OUTPUTS, outs):
        old = args[name]
        value = node_value(old)
        if isinstance(value, torch.Tensor):  # same shape/dtype/device as the reference output
            new.meta["example_value"] = value
            new.meta["val"] = value
        _rewire_after(graph, marker, old, new)
    return pre is not None


def apply(graph: torch.fx.Graph, ctx: RuleContext) -> list[Site]:
    """Visit every DiT-step marker (and dit_body call) of ``graph``; one :class:`Site` each."""
    marker = marker_op()
    body = _body_op()
    sites: list[Site] = []
    seen: set[torch.fx.Node] = set()  # reference velocities already handled by a marker
    for node in list(graph.nodes):
        if body is not None and is_op(node, body):
            if not ctx.record_kept:  # the ATen graph of a step already reported (or swapped)
                continue
            dtype, device = tensor_meta(node_value(node.args[0]) if node.args else None)
            sites.append(Site(RULE, node.name, ctx.stage, "fused", dtype, str(device),
                              "dit_body already in the graph (dispatched by the model)"))
            continue
        if not is_op(node, marker):
            continue
        args = schema_args(node)
        if args["velocity"] in seen:  # the same step marked twice (model hook + caller): once
            graph.erase_node(node)
            continue
        seen.add(args["velocity"])
        dtype, _ = tensor_meta(node_value(args["new_att_cache"]))  # the compute dtype
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
            prepacked = _swap(graph, node, args, dtype, device, precision, ctx.config.prepack)
            detail = "torch_cfm::dit_body" + (f" precision={precision}" if decision.precision else "")
            detail += ", weights packed at compile time" if prepacked else ""
            detail += f" [{decision.source}]" if decision.source != "policy" else ""
            action, reasons = "fused", ()
        else:
            detail, action = "reference step kept", "kept"
        graph.erase_node(node)
        sites.append(Site(RULE, node.name, ctx.stage, action, dtype, str(device), detail, tuple(reasons)))
    return sites


__all__ = ["apply", "RULE", "MARKER"]
