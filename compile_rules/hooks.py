"""Putting the composed pass into Inductor's custom-pass slots, on torch 2.11 and 2.13.

On torch 2.13 a slot (``pre_grad_custom_pass``, ``joint_custom_pre_pass``...) holds a
pass or a list of passes; on 2.11 it holds one pass. :func:`add_pass` keeps whatever the user
already put there: a list grows by one on 2.13, and on 2.11 two passes become a
:class:`ChainedPass` whose uuid combines both.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Optional

import torch
import torch.fx
from torch._inductor import custom_graph_pass
from torch._inductor.custom_graph_pass import CustomGraphPass

SLOTS = ("pre_grad_custom_pass", "joint_custom_pre_pass")


def slots_take_lists() -> bool:
    """True when Inductor accepts a list of passes per slot (torch 2.13+)."""
    return hasattr(custom_graph_pass, "get_custom_graph_passes")


def _uuid_of(p: Any) -> Optional[str]:
    uuid = getattr(p, "uuid", None)
    if uuid is None:
        return None
    value = uuid()
    return None if value is None else repr(value)


class ChainedPass(CustomGraphPass):
    """Runs several passes in order (torch 2.11, whose slots take a single pass)."""

    def __init__(self, passes: list[Callable[[torch.fx.Graph], None]]):
        self.passes = list(passes)

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self) -> Optional[str]:
        uuids = [_uuid_of(p) for p in self.passes]
        if any(u is None for u in uuids):
            return None  # a pass without uuid: Inductor must not cache (its own rule)
        return hashlib.sha256("|".join(uuids).encode()).hexdigest()


def passes_in(value: Any) -> list[Any]:
    """The passes held by a slot value (None, one pass, a list/tuple, or a ChainedPass)."""
    if value is None:
        return []
    if isinstance(value, ChainedPass):
        return list(value.passes)
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def slot_value(passes: list[Any]) -> Any:
    """The slot value for ``passes`` on this torch (list on 2.13, one pass on 2.11)."""
    if not passes:
        return None
    if slots_take_lists():
        return list(passes)
    return passes[0] if len(passes) == 1 else ChainedPass(passes)


def add_pass(value: Any, new_pass: Any) -> Any:
    """``value`` with ``new_pass`` appended (no duplicates)."""
    existing = [p for p in passes_in(value) if p is not new_pass]
    return slot_value(existing + [new_pass])


def remove_pass(value: Any, old_pass: Any) -> Any:
    return slot_value([p for p in passes_in(value) if p is not old_pass])


def remove_matching(value: Any, predicate: Callable[[Any], bool]) -> Any:
    return slot_value([p for p in passes_in(value) if not predicate(p)])
