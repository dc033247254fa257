"""Rule for ``torch_cfm::cfm_attention`` sites: record the kernel choice, pin the fp32 precision.

``cfm_attention`` is already torch_cfm's own op on every path (the model calls it on the
reference path too), so there is no lowered pattern to recognise: the site is the op node,
identical in the Dynamo graph, the ATen graph and on every device and torch version.

What the rule does at a site:

* fp32 with ``precision="auto"``: replaces "auto" by the precision the policy gives at trace
  time ("tf32" or "ieee"). The compiled graph then never consults a global flag at run time, and
  a stale kernel cannot be reused after TF32 is flipped: Dynamo guards on the TF32 flag and
  recompiles, and this rule pins the new value (action "pinned").
* everything else is left as it is (action "kept"); the op's own CUDA kernel picks Triton on
  SM80+ and SDPA below, and the site records that choice and the policy's reasons.
"""

from __future__ import annotations

from typing import Collection

import torch
import torch.fx

from ._context import RuleContext
from ._graph import Site, is_op, node_value, schema_args, set_schema_arg, tensor_meta

RULE = "cfm_attention"


def _target():
    return torch.ops.torch_cfm.cfm_attention.default


def apply(graph: torch.fx.Graph, ctx: RuleContext, skip: Collection[torch.fx.Node] = ()) -> list[Site]:
    """Visit every cfm_attention node of ``graph`` except ``skip`` (inside a swapped step);
    returns one :class:`Site` per node."""
    target = _target()
    sites: list[Site] = []
    for node in graph.nodes:
        if not is_op(node, target) or node in skip:
            continue
        args = schema_args(node)
        dtype, device = tensor_meta(node_value(args["q"]))
        if dtype is None:
            sites.append(Site(RULE, node.name, ctx.stage, "kept",
                              reasons=("no traced value for q",)))
            continue
        decision = ctx.decide(device, dtype)
        detail = f"attention={decision.attention_kernel}"
        action = "kept"
        if dtype == torch.float32:
            requested = args["precision"]
            if requested == "auto":
                set_schema_arg(node, "precision", decision.precision)
                action = "pinned"
                requested = decision.precision
            detail += f" precision={requested}"
        reasons = () if decision.backend == "sm80" else tuple(
            r for r in decision.reasons if r != "fp32 with TF32 off")
        if action == "kept" and not ctx.record_kept:
            continue  # recorded already on the Dynamo graph
        sites.append(Site(RULE, node.name, ctx.stage, action, dtype, str(device), detail, reasons))
    return sites
