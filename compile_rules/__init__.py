"""torch_cfm compile rules: swap torch_cfm's fused paths in under ``torch.compile``.

Three ways in, one set of rules (:class:`~torch_cfm.compile_rules.passes.TorchCfmPass`):

* ``torch.compile(model, backend="torch_cfm")`` (or :func:`torch_cfm.compile`): the rules run on
  the Dynamo graph before AOT dispatch, then stock Inductor compiles it (``mode=``/``options=``
  as for ``backend="inductor"``);
* :func:`install` / :func:`uninstall`: add / remove the rules in stock Inductor's
  ``pre_grad_custom_pass`` and ``joint_custom_pre_pass`` for plain ``torch.compile``;
* :func:`explain_model` (``torch_cfm.explain(model, inputs)``): every candidate site and why.

A site is a torch_cfm op in the traced graph (``torch.ops.torch_cfm.*``), never a lowered
pattern, so matching does not depend on the device, the dtype or the torch version. Decisions
come from :func:`torch_cfm.policy.decide` with the traced dtype/device and the TF32 state at
trace time. Dynamo guards on the TF32 flag, so flipping it recompiles; env variables
(``TORCH_CFM_FUSED``, ``TORCH_CFM_TF32``) are read at compile time (``torch._dynamo.reset()``
after changing them).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Optional

from torch._inductor import config as _inductor_config

from . import hooks
from .backend import BACKEND_NAME, TorchCfmBackend, default_backend, register, torch_cfm_backend
from .explain import explain_model
from .passes import ATEN, DYNAMO, RulesConfig, Site, TorchCfmPass

__all__ = [
    "ATEN", "DYNAMO", "BACKEND_NAME", "RulesConfig", "Site", "TorchCfmBackend", "TorchCfmPass", "default_backend",
    "explain_model", "install", "installed", "torch_cfm_backend", "uninstall",
]


def install(config: Optional[RulesConfig] = None) -> TorchCfmPass:
    """Add the rules to stock Inductor (``pre_grad_custom_pass`` + ``joint_custom_pre_pass``).

    Passes already in those slots stay (list on torch 2.13, a chain on 2.11). Graphs compiled
    before the call keep their code; a second ``install`` replaces the first.

    Returns:
        the installed pass (its ``sites`` list every site it visited).
    """
    uninstall()
    # No compile-time weight packing here: stock Inductor offers no call wrapper to keep a pack
    # current, so the packing is traced into the graph (see passes.dit_step).
    rules_pass = TorchCfmPass(dataclasses.replace(config or RulesConfig(), prepack=False))
    for slot in hooks.SLOTS:
        setattr(_inductor_config, slot, hooks.add_pass(getattr(_inductor_config, slot), rules_pass))
    return rules_pass


def uninstall() -> None:
    """Remove every torch_cfm pass from stock Inductor's slots (others' passes stay)."""
    for slot in hooks.SLOTS:
        value = hooks.remove_matching(getattr(_inductor_config, slot),
                                      lambda p: isinstance(p, TorchCfmPass))
        setattr(_inductor_config, slot, value)


@contextlib.contextmanager
def installed(config: Optional[RulesConfig] = None) -> Iterator[TorchCfmPass]:
    """``with installed(): ...`` installs the rules for the block only."""
    rules_pass = install(config)
    try:
        yield rules_pass
    finally:
        uninstall()


register()
