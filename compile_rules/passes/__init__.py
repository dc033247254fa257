"""The torch_cfm compile rules, composed into one Inductor custom pass (:class:`TorchCfmPass`).

Rules, in the order they run on a graph:

1. ``dit_step``  (:mod:`.dit_step`): the reference estimator step -> the fused DiT body op,
   when :func:`torch_cfm.policy.decide` says so for the traced dtype/device/TF32 state;
2. ``cfm_attention`` (:mod:`.attention`): every attention site left; fp32 precision pinned;
3. ``clone_guard`` (:mod:`.clone_guard`, ATen graph only): keeps clones that protect a
   torch_cfm op's input from its own in-place writes (pytorch#198031).

One object serves every hook because Inductor's custom-pass slots take one pass on torch 2.11
and a list on 2.13 (docs/design.md §10): the same instance goes into our backend (Dynamo graph, before
AOT dispatch), ``pre_grad_custom_pass`` and ``joint_custom_pre_pass``; each rule matches
only what exists at that stage. ``uuid()`` hashes the rules' source and every input of a
decision (config, env, TF32 state, device capability), so Inductor's caches never return a
graph compiled under another policy.
"""

from __future__ import annotations

import hashlib
import os
from typing import Optional

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import attention, clone_guard, dit_step
from ._context import RuleContext, RulesConfig, policy_state
from ._graph import ATEN, DYNAMO, Site, graph_stage, live_nodes

__all__ = ["TorchCfmPass", "RulesConfig", "Site", "DYNAMO", "ATEN", "source_files"]

_MAX_SITES = 4096


def source_files() -> tuple[str, ...]:
    """Files whose text decides what the rules do (hashed into the cache uuid)."""
    import torch_cfm

    here = os.path.dirname(os.path.abspath(__file__))
    rules = os.path.dirname(here)
    package = os.path.dirname(os.path.abspath(torch_cfm.__file__))
    files = [os.path.join(d, name) for d in (rules, here) for name in sorted(os.listdir(d))
             if name.endswith(".py")]
    # what the swapped-in code traces through
    files += [os.path.join(package, *p) for p in (("policy.py",), ("config.py",), ("packing.py",),
                                                   ("ops", "dit_body.py"))]
    return tuple(os.path.normpath(f) for f in files if os.path.exists(f))


def _hash_files(paths: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(os.path.basename(path).encode())
        with open(path, "rb") as handle:
            digest.update(handle.read())
    return digest.hexdigest()


class TorchCfmPass(CustomGraphPass):
    """All torch_cfm compile rules as one ``CustomGraphPass``.

    Call it on an FX graph (Dynamo or ATen level); it rewrites the graph in place and records a
    :class:`Site` for every candidate it saw in :attr:`last_sites` (this run) and :attr:`sites`
    (every run, most recent last, bounded).

    Args:
        config: :class:`RulesConfig` (overrides for the policy; defaults follow docs/design.md §5).
    """

    def __init__(self, config: Optional[RulesConfig] = None):
        self.config = config or RulesConfig()
        self.sites: list[Site] = []
        self.last_sites: list[Site] = []
        self._saw_dynamo_graph = False

    def __call__(self, graph: torch.fx.Graph) -> None:
        if isinstance(graph, torch.fx.GraphModule):  # tolerate a GraphModule as well
            graph = graph.graph
        ctx = RuleContext(self.config, graph_stage(graph))
        # The same object runs on the Dynamo graph, then on the ATen graph of the same code:
        # sites that only get recorded (not changed) are reported once, from the Dynamo graph.
        self._saw_dynamo_graph |= ctx.stage == DYNAMO
        ctx.record_kept = not (ctx.stage == ATEN and self._saw_dynamo_graph)
        sites = dit_step.apply(graph, ctx)
        dead: set[torch.fx.Node] = set()
        if any(site.rule == dit_step.RULE and site.action == "fused" for site in sites):
            live = live_nodes(graph)
            dead = {node for node in graph.nodes if node not in live}
        sites += attention.apply(graph, ctx, skip=dead)
        if self.config.guard_clones:
            sites += clone_guard.apply(graph, ctx, tuple(self.config.guard_namespaces))
        if any(site.action in ("fused", "guarded") for site in sites):
            graph.lint()
        self.last_sites = sites
        self.sites = (self.sites + sites)[-_MAX_SITES:]

    def uuid(self) -> str:
        """Cache key: rule sources + configuration + policy state (env, TF32, capability)."""
        state = "|".join([_hash_files(source_files()), self.config.key(), policy_state(self.config)])
        return hashlib.sha256(state.encode()).hexdigest()

    def __repr__(self) -> str:
        return f"TorchCfmPass({self.config})"
