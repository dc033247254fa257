"""Reading upstream weights: an estimator state_dict or a whole flow checkpoint.

A flow checkpoint (the token2wav ``flow.pt``) holds the estimator under ``decoder.estimator.``;
an estimator checkpoint holds the DiT keys directly. Both load into a DiT unchanged
(:func:`torch_cfm.models.dit.load_checkpoint`, which sits above this module). Errors list every
missing, unexpected and mis-shaped key (``ValueError``), and the config can be read back from the
shapes alone (:func:`config_from_state_dict`).
"""

from __future__ import annotations

import os
import re
from typing import Mapping, Union

import torch

from ..config import DiTConfig
from ..errors import fail

FLOW_PREFIX = "decoder.estimator."
_WRAPPERS = ("state_dict", "model", "module")

Source = Union[str, os.PathLike, Mapping[str, torch.Tensor]]


def _first_sentence(text: str) -> str:
    """The first sentence of ``text``'s first non-empty line, whole (torch's load errors go on with
    generic advice)."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return re.split(r"\.(?:\s|$)", line, maxsplit=1)[0].strip()


def _load_error(exc: BaseException) -> str:
    """What torch.load(weights_only=True) said, in one complete clause."""
    text = str(exc)
    marker = "WeightsUnpickler error:"
    if marker in text:  # a pickle the weights-only loader refuses (or not a pickle at all)
        detail = _first_sentence(text.split(marker, 1)[1])
        return (f"{type(exc).__name__}: torch.load(weights_only=True) refuses it: {detail}; if it is a pickle "
                "from a source you trust, load it with torch.load(path, weights_only=False) and pass the state_dict")
    detail = _first_sentence(text) or ("empty or truncated file" if isinstance(exc, EOFError) else "")
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__


def _read(source: Source, op: str) -> Mapping[str, torch.Tensor]:
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(path):
            fail(op, "path", "name an existing file", repr(path))
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is the user's input error
            fail(op, "path", "be a torch checkpoint (torch.save of a state_dict)",
                 f"an unreadable file {path!r} ({_load_error(exc)})")
    else:
        obj = source
    if isinstance(obj, Mapping):
        for key in _WRAPPERS:  # {"state_dict": {...}} style wrappers
            inner = obj.get(key)
            if isinstance(inner, Mapping) and not any(isinstance(v, torch.Tensor) for v in obj.values()):
                obj = inner
                break
    if not isinstance(obj, Mapping) or not all(isinstance(k, str) for k in obj):
        fail(op, "checkpoint", "be a state_dict (a mapping of str -> Tensor)", type(obj).__name__)
    return obj


def estimator_state_dict(source: Source) -> dict[str, torch.Tensor]:
    """The estimator's keys of ``source`` (a path or a mapping): ``decoder.estimator.*`` of a
    flow checkpoint with the prefix removed, or the whole mapping when it has no such keys."""
    op = "estimator_state_dict"
    sd = _read(source, op)
    if any(k.startswith(FLOW_PREFIX) for k in sd):
        sd = {k[len(FLOW_PREFIX):]: v for k, v in sd.items() if k.startswith(FLOW_PREFIX)}
    out = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    if not out:
        fail(op, "checkpoint", "contain tensors", "no tensor values")
    return out


def config_from_state_dict(state_dict: Mapping[str, torch.Tensor]) -> DiTConfig:
    """Read a :class:`DiTConfig` back from parameter shapes (depth, C, H, D, MLP, conv, channels)."""
    op = "config_from_state_dict"
    need = ("in_proj.weight", "blocks.0.attn.q_norm.weight", "blocks.0.attn.to_q.weight",
            "blocks.0.mlp.fc1.weight", "blocks.0.conv.block.1.weight", "final_layer.linear.weight")
    missing = [k for k in need if k not in state_dict]
    if missing:
        fail(op, "state_dict", "hold a DiT estimator's keys", f"missing {missing}",
             f"a flow checkpoint keeps them under '{FLOW_PREFIX}'")
    blocks = {int(m.group(1)) for k in state_dict if (m := re.match(r"blocks\.(\d+)\.", k))}
    hidden, in_channels = state_dict["in_proj.weight"].shape
    head_dim = state_dict["blocks.0.attn.q_norm.weight"].shape[0]
    inner = state_dict["blocks.0.attn.to_q.weight"].shape[0]
    return DiTConfig(
        in_channels=int(in_channels), out_channels=int(state_dict["final_layer.linear.weight"].shape[0]),
        hidden=int(hidden), depth=len(blocks), heads=int(inner // head_dim), head_dim=int(head_dim),
        mlp_ratio=int(state_dict["blocks.0.mlp.fc1.weight"].shape[0] // hidden),
        conv_kernel=int(state_dict["blocks.0.conv.block.1.weight"].shape[2]))


def check_state_dict(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], op: str = "load_checkpoint") -> None:
    """Raise one ValueError listing every missing, unexpected and mis-shaped key."""
    expected = model.state_dict()
    missing = sorted(k for k in expected if k not in state_dict)
    unexpected = sorted(k for k in state_dict if k not in expected)
    misshaped = sorted(f"{k}: expected {tuple(expected[k].shape)}, got {tuple(state_dict[k].shape)}"
                       for k in expected if k in state_dict and tuple(state_dict[k].shape) != tuple(expected[k].shape))
    if not (missing or unexpected or misshaped):
        return
    parts = []

    def listing(title: str, items: list[str]) -> None:
        if items:
            more = f" ... (+{len(items) - 6} more)" if len(items) > 6 else ""
            parts.append(f"{len(items)} {title} [{', '.join(items[:6])}{more}]")

    listing("missing", missing)
    listing("unexpected", unexpected)
    listing("mis-shaped", misshaped)
    fail(op, "checkpoint", "match the DiT's keys and shapes "
         f"(hidden={model.config.hidden}, depth={model.config.depth})", "; ".join(parts),
         "check the config, or pass config=None to read it from the checkpoint")
