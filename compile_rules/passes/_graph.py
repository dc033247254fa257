"""FX helpers shared by the rules: node values, schema-normalised arguments, site records.

The rules run on two kinds of graph:

* the Dynamo graph, before AOT dispatch (our backend, or Inductor's ``pre_grad_custom_pass``):
  torch-level calls; each node's traced value is a fake tensor in ``node.meta["example_value"]``;
* the ATen graph after functionalisation (``joint_custom_pre_pass``): values in
  ``node.meta["val"]``; mutating custom ops appear as ``auto_functionalized(_v2)`` nodes.

Both are read through :func:`node_value`; nothing here reads tensor data.
"""

from __future__ import annotations

import operator as _operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx

DYNAMO = "dynamo"
ATEN = "aten"


@dataclass(frozen=True)
class Site:
    """One candidate site a rule looked at, and what it did.

    Attributes:
        rule: the rule's name ("cfm_attention", "dit_step", "clone_guard").
        node: the FX node name (stable within one graph, for explain output and tests).
        stage: DYNAMO (Dynamo graph) or ATEN (ATen graph).
        action: "fused" (swapped in), "pinned" (kept, arguments fixed at trace time),
            "kept" (left alone) or "guarded" (a clone protected).
        dtype: compute dtype of the site, if known.
        device: device string of the site, if known.
        detail: what runs there, e.g. ``attention=triton precision=tf32``.
        reasons: why the fused path was not taken (empty when it was).
    """

    rule: str
    node: str
    stage: str
    action: str
    dtype: Optional[torch.dtype] = None
    device: Optional[str] = None
    detail: str = ""
    reasons: tuple[str, ...] = field(default_factory=tuple)

    def describe(self) -> str:
        dtype = str(self.dtype).replace("torch.", "") if self.dtype is not None else "?"
        head = f"{self.rule} [{self.node}] {dtype} on {self.device or '?'}: {self.action}"
        return head + (f" ({self.detail})" if self.detail else "")


def node_value(node: Any) -> Any:
    """The traced (fake) value of an FX node, or the argument itself if it is not a node."""
    if not isinstance(node, torch.fx.Node):
        return node
    if "val" in node.meta:
        return node.meta["val"]
    return node.meta.get("example_value")


def graph_stage(graph: torch.fx.Graph) -> str:
    """DYNAMO for a Dynamo graph (``example_value`` metadata), ATEN for an ATen graph."""
    for node in graph.nodes:
        if node.op == "placeholder":
            if "example_value" in node.meta or "grapharg" in node.meta:
                return DYNAMO
            if "val" in node.meta:
                return ATEN
    return DYNAMO


def schema_args(node: torch.fx.Node) -> dict[str, Any]:
    """Arguments of an OpOverload call node by schema name (defaults filled in)."""
    schema = node.target._schema  # type: ignore[union-attr]
    out: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
        else:
            out[arg.name] = None
    return out


def set_schema_arg(node: torch.fx.Node, name: str, value: Any) -> None:
    """Set one argument of an OpOverload call node, positional or keyword as it was given."""
    schema = node.target._schema  # type: ignore[union-attr]
    index = [a.name for a in schema.arguments].index(name)
    if index < len(node.args):
        args = list(node.args)
        args[index] = value
        node.args = tuple(args)
    else:
        kwargs = dict(node.kwargs)
        kwargs[name] = value
        node.kwargs = kwargs


def tensor_meta(value: Any) -> tuple[Optional[torch.dtype], Optional[torch.device]]:
    if isinstance(value, torch.Tensor):
        return value.dtype, value.device
    return None, None


def is_op(node: torch.fx.Node, *targets: Any) -> bool:
    return node.op == "call_function" and node.target in targets


# --------------------------------------------------------------------------------------------
# Mutation-aware liveness (for reporting which sites a swap made dead; never used to delete:
# fx's eliminate_dead_code treats in-place ``call_method`` nodes as pure, so it is unsafe on a
# Dynamo graph, and AOT/Inductor remove the dead region themselves after functionalisation).
# --------------------------------------------------------------------------------------------


_VIEW_METHODS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "expand", "expand_as",
    "narrow", "select", "unsqueeze", "squeeze", "flatten", "unflatten", "t", "contiguous", "to",
    "type", "type_as", "float", "half", "bfloat16", "double", "chunk", "split", "unbind",
    "as_strided", "diagonal", "movedim", "swapaxes", "detach", "__getitem__", "mT", "T"})
_VIEW_FUNCTIONS = frozenset({
    _operator.getitem, torch.transpose, torch.permute, torch.reshape, torch.narrow, torch.select,
    torch.squeeze, torch.unsqueeze, torch.flatten, torch.chunk, torch.split, torch.unbind,
    torch.t, torch.movedim, torch.as_strided, torch.diagonal, torch.swapaxes, torch.detach})
_SETITEM_LIKE = frozenset({_operator.setitem, _operator.iadd, _operator.isub, _operator.imul,
                           _operator.itruediv})


def _is_view_like(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    if node.op == "call_function":
        if node.target in _VIEW_FUNCTIONS:
            return True
        target = node.target
        return isinstance(target, torch._ops.OpOverload) and target.is_view
    return False


def _mutated_args(node: torch.fx.Node) -> list[Any]:
    """The arguments ``node`` writes in place (empty for a functional node)."""
    if node.op == "call_method" and isinstance(node.target, str):
        name = node.target
        if name.endswith("_") and not name.startswith("_") and node.args:
            return [node.args[0]]
        return []
    if node.op != "call_function":
        return []
    if node.target in _SETITEM_LIKE and node.args:
        return [node.args[0]]
    out = []
    if "out" in node.kwargs:
        out.append(node.kwargs["out"])
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        for i, arg in enumerate(target._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                out.append(node.args[i] if i < len(node.args) else node.kwargs.get(arg.name))
    return out


def _base(value: Any) -> Any:
    while isinstance(value, torch.fx.Node) and _is_view_like(value) and value.args:
        value = value.args[0]
    return value


def live_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Nodes that contribute to the graph's outputs or to writes into its inputs.

    A write into a tensor allocated inside the graph is live only if that tensor is live.
    """
    writes_into: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    roots: list[torch.fx.Node] = []
    for node in graph.nodes:
        if node.op == "output":
            roots.append(node)
            continue
        targets = [_base(a) for a in _mutated_args(node)]
        if targets:
            for base in targets:
                if not isinstance(base, torch.fx.Node) or base.op in ("placeholder", "get_attr"):
                    roots.append(node)
                else:
                    writes_into.setdefault(base, []).append(node)
            continue
        if node.op == "call_function" and node.is_impure():
            roots.append(node)
    live: set[torch.fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in live:
            continue
        live.add(node)
        stack.extend(node.all_input_nodes)
        stack.extend(writes_into.get(node, ()))
    return live
