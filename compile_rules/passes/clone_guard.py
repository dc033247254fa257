"""Rule that keeps a user's clone alive in front of a torch_cfm op that mutates its source.

pytorch#198031 (open in torch 2.11-2.15): for ``y = x.clone(); op(y, x)`` where a custom op
reads ``y`` and writes ``x``, Inductor's ``remove_noop_ops`` drops the clone (harmless while the
graph is functional) and the reinplacing pass then mutates ``x`` in place, so the op runs as
``op(x, x)`` and reads what it writes: silently wrong results. Reading the old cache while
writing the new one is exactly what a cache-updating op does, so this rule guards every
torch_cfm mutating op in the ATen graph (``joint_custom_pre_pass``, before
``remove_noop_ops``): when a read argument is, through views, a ``clone`` of storage that the
op mutates, the clone becomes ``aten.lift_fresh_copy`` (the same copy, lowered by Inductor, but not in
its no-op list).
Clones of anything else are left alone, so no extra copy appears in the generated code.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
import torch.fx

from ._context import RuleContext
from ._graph import Site, node_value

RULE = "clone_guard"


def _storage(node: Any) -> Optional[int]:
    value = node_value(node) if isinstance(node, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or not torch._C._has_storage(value):
        return None
    return value.untyped_storage()._cdata


def _is_view(node: torch.fx.Node) -> bool:
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and target.is_view)


def _clone_behind_views(node: Any) -> Optional[torch.fx.Node]:
    """The ``aten.clone`` node ``node`` is a (view of a) copy of, if any."""
    while isinstance(node, torch.fx.Node):
        if node.op == "call_function" and node.target is torch.ops.aten.clone.default:
            return node
        if not _is_view(node) or not node.args:
            return None
        node = node.args[0]
    return None


def _flat_nodes(values: Iterable[Any]) -> list[torch.fx.Node]:
    out: list[torch.fx.Node] = []
    for value in values:
        if isinstance(value, torch.fx.Node):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(_flat_nodes(value))
    return out


def _mutating_call(node: torch.fx.Node, namespaces: tuple[str, ...]):
    """(op, mutated nodes, read nodes) of an auto_functionalized(_v2) call of our namespaces."""
    hops = {torch.ops.higher_order.auto_functionalized}
    v2 = getattr(torch.ops.higher_order, "auto_functionalized_v2", None)
    if v2 is not None:
        hops.add(v2)
    if node.op != "call_function" or node.target not in hops or not node.args:
        return None
    op = node.args[0]
    if not isinstance(op, torch._ops.OpOverload) or op.namespace not in namespaces:
        return None
    kwargs = dict(node.kwargs)
    mutated_names = {a.name for a in op._schema.arguments
                     if a.alias_info is not None and a.alias_info.is_write}
    if "_all_bases" in kwargs:  # v2: mutated args are described by their bases
        mutated = _flat_nodes(kwargs.pop("_all_bases"))
        reads = [v for k, v in kwargs.items() if not k.startswith("_") and k not in mutated_names]
    else:
        mutated = _flat_nodes(kwargs[k] for k in mutated_names if k in kwargs)
        reads = [v for k, v in kwargs.items() if k not in mutated_names]
    return op, mutated, _flat_nodes(reads)


def apply(graph: torch.fx.Graph, ctx: RuleContext,
          namespaces: tuple[str, ...] = ("torch_cfm",)) -> list[Site]:
    """Turn hazardous clones into ``aten._to_copy``; one :class:`Site` per protected clone."""
    sites: list[Site] = []
    for node in list(graph.nodes):
        found = _mutating_call(node, namespaces)
        if found is None:
            continue
        op, mutated, reads = found
        written = {s for s in (_storage(m) for m in mutated) if s is not None}
        for read in reads:
            clone = _clone_behind_views(read)
            if clone is None or _storage(clone.args[0]) not in written:
                continue
            value = node_value(clone)
            if clone.kwargs.get("memory_format", torch.preserve_format) != torch.preserve_format:
                continue  # a clone that changes layout is not a no-op: Inductor keeps it
            clone.target = torch.ops.aten.lift_fresh_copy.default
            clone.kwargs = {}
            sites.append(Site(RULE, clone.name, ctx.stage, "guarded",
                              getattr(value, "dtype", None), str(getattr(value, "device", "?")),
                              f"copy kept in front of {op.name()} (pytorch#198031)"))
    return sites
