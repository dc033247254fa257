"""Configuration of the compile rules and the per-run context handed to each rule."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from torch_cfm import policy


@dataclass(frozen=True)
class RulesConfig:
    """What the rules may assume, beyond the traced graph.

    Attributes:
        fused: explicit override for every site (None = docs/design.md §5 policy; env TORCH_CFM_FUSED wins).
        tf32: explicit TF32 permission for fp32 sites (None = torch's setting at trace time;
            env TORCH_CFM_TF32 wins).
        capability: pretend the CUDA device has this (major, minor) capability (tests, explain
            for another GPU); None = ask the CUDA runtime.
        env: environment mapping for the policy (tests); None = ``os.environ`` at trace time.
        guard_clones: protect clone-then-mutate arguments of torch_cfm ops (pytorch#198031).
        guard_namespaces: op namespaces whose mutating ops get the clone guard.
        prepack: pack the DiT weights at compile time into buffers of the compiled graph (our
            backend; needs the graph module and the real parameters, otherwise packing is traced).
        assume_device: decide as if the traced tensors lived on this device type (e.g. "cuda"
            with ``capability=(9, 0)``: what an H200 would get). For explain and tests only: the
            rewritten graph still runs on the real device.
    """

    fused: Optional[bool] = None
    tf32: Optional[bool] = None
    capability: Optional[tuple[int, int]] = None
    env: Optional[Mapping[str, str]] = None
    guard_clones: bool = True
    guard_namespaces: tuple[str, ...] = ("torch_cfm",)
    prepack: bool = True
    assume_device: Optional[str] = None

    def key(self) -> str:
        """A stable text of the configuration (part of the cache uuid)."""
        env = None if self.env is None else sorted(
            (k, v) for k, v in self.env.items() if k.startswith("TORCH_CFM_"))
        return (f"fused={self.fused};tf32={self.tf32};capability={self.capability};"
                f"env={env};guard_clones={self.guard_clones};guard_namespaces={self.guard_namespaces};assume_device={self.assume_device};prepack={self.prepack}")


def policy_state(config: RulesConfig) -> str:
    """Everything outside the graph that changes a decision: env, TF32, device capability."""
    env = os.environ if config.env is None else config.env
    flags = ";".join(f"{name}={env.get(name, '')}" for name in (policy.ENV_FUSED, policy.ENV_TF32))
    try:
        tf32 = policy.tf32_allowed(config.tf32, env)
    except (RuntimeError, ValueError) as exc:  # mixed legacy/new TF32 API, bad env value
        tf32 = f"error:{exc}"
    capability = config.capability
    if capability is None and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
    return f"{flags};tf32_allowed={tf32};capability={capability};torch={torch.__version__}"


class RuleContext:
    """Decisions for one pass run: the TF32 state and env are read once, at trace time."""

    def __init__(self, config: RulesConfig, stage: str):
        self.config = config
        self.stage = stage
        self.env = os.environ if config.env is None else dict(config.env)
        self.tf32 = policy.tf32_allowed(config.tf32, self.env)
        self.record_kept = True  # report sites the rules leave unchanged (False: seen already)

    def decide(self, device: torch.device, dtype: torch.dtype,
               fused: Optional[bool] = None) -> policy.Decision:
        """:func:`torch_cfm.policy.decide` for a site; ``fused`` (the call's own override) wins
        over the config's."""
        if self.config.assume_device is not None:
            device = torch.device(self.config.assume_device)
        return policy.decide(device, dtype, tf32=self.tf32,
                             fused=self.config.fused if fused is None else fused,
                             capability=self.config.capability, env=self.env)
