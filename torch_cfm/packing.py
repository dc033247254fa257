"""Weights of the DiT estimator packed for the fused body, and the per-step modulation table.

The fused body (``torch_cfm::dit_body``) never reads ``nn.Module`` attributes: it takes a flat
list of tensors laid out for its GEMMs (:class:`PackedDiT`). Packing reads parameters by their
docs/design.md §1 state_dict names only, so it works for any module (or plain state_dict) that uses the
upstream checkpoint's names. A pack is built once per (module, dtype, device) and rebuilt when a
parameter changes (new storage, in-place update, or dtype/device move): the staleness key is each
parameter's ``(data_ptr, _version, dtype, shape)``, a host-side read that never synchronises.

Body weight list (the op's ``weights`` argument), in this order::

    in_w (C, Cin), in_b (C,)
    per block (18 tensors):
        qkv_w (3*H*D, C), qkv_b (3*H*D,)              to_q | to_k | to_v stacked
        qn_w (D,), qn_b (D,), kn_w (D,), kn_b (D,)    q/k LayerNorm affine
        proj_w (C, H*D), proj_b (C,)
        c1_w (3*C, C), c1_b (C,)                      conv 1 taps stacked: row k*C+o = W[o, :, k]
        cn_w (C,), cn_b (C,)                          LayerNorm between the convs
        c2_w (3*C, C), c2_b (C,)                      conv 2 taps
        fc1_w (4C, C), fc1_b (4C,), fc2_w (C, 4C), fc2_b (C,)
    out_w (Cout, C), out_b (Cout,)

Modulation table (the op's ``mod_table``): (R, depth+1, 9, C) float32 (float64 for a float64
body), R = 1 (every row shares t) or N. Row i < depth holds block i's 9 vectors in the contract's
order shift_a, scale_a, gate_a, shift_m, scale_m, gate_m, shift_c, scale_c, gate_c with every
scale stored as ``1 + scale``; row ``depth`` holds the final layer's (shift, 1 + scale) then zeros.
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass
from typing import Mapping, Optional, Union

import torch

from .config import TIME_EMBED_DIM, TIME_EMBED_MAX_PERIOD, TIME_EMBED_SCALE

PER_BLOCK = 18
MOD_VECTORS = 9
SCALE_SLOTS = (1, 4, 7)  # scale_a, scale_m, scale_c within a block's 9 vectors
# index of each modulation vector in a table row
SHIFT_A, SCALE_A, GATE_A, SHIFT_M, SCALE_M, GATE_M, SHIFT_C, SCALE_C, GATE_C = range(9)

ParamSource = Union[torch.nn.Module, Mapping[str, torch.Tensor]]


@dataclass
class PackedDiT:
    """The estimator's weights laid out for the fused body.

    Attributes:
        body: the op's weight list (see module docstring), in ``dtype`` on ``device``.
        temb: (w1 (C,256), b1, w2 (C,C), b2) float32 (float64 for a float64 pack).
        ada_w: (depth*9*C + 2*C, C) every adaLN projection stacked, in ``dtype``.
        ada_b: (depth*9*C + 2*C,) float32 (float64 for a float64 pack).
        depth, hidden, heads, head_dim, in_channels, out_channels: sizes read from the shapes.
        dtype, device: of ``body``.
    """

    body: list[torch.Tensor]
    temb: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    ada_w: torch.Tensor
    ada_b: torch.Tensor
    depth: int
    hidden: int
    heads: int
    head_dim: int
    in_channels: int
    out_channels: int
    dtype: torch.dtype
    device: torch.device

    def nbytes(self) -> int:
        tensors = list(self.body) + list(self.temb) + [self.ada_w, self.ada_b]
        return sum(t.numel() * t.element_size() for t in tensors)


def _params(source: ParamSource) -> dict[str, torch.Tensor]:
    if isinstance(source, torch.nn.Module):
        named = dict(source.named_parameters())
        named.update(dict(source.named_buffers()))
        return named
    return dict(source)


def _depth_of(params: Mapping[str, torch.Tensor]) -> int:
    depth = 0
    while f"blocks.{depth}.attn.to_q.weight" in params:
        depth += 1
    if depth == 0:
        raise ValueError("pack_dit: model must have docs/design.md §1 parameters blocks.<i>.attn.to_q.weight, "
                         "found none; pass the DiT estimator (or its state_dict)")
    return depth


def pack_dit(source: ParamSource, dtype: torch.dtype, device: torch.device | str) -> PackedDiT:
    """Pack a DiT's parameters (docs/design.md §1 names) for the fused body, without caching.

    Args:
        source: the estimator module or its state_dict (names exactly as docs/design.md §1).
        dtype: compute dtype of the body weights (float16 | bfloat16 | float32 | float64).
        device: where the packed tensors live.
    Returns:
        a :class:`PackedDiT`.
    Raises:
        ValueError: a required parameter is missing (the message names it).
    """
    p = _params(source)
    device = torch.device(device)
    stat = torch.float64 if dtype == torch.float64 else torch.float32
    depth = _depth_of(p)

    def get(name: str) -> torch.Tensor:
        if name not in p:
            raise ValueError(f"pack_dit: model must have parameter {name!r} (docs/design.md §1), got none")
        return p[name].detach()

    def cast(t: torch.Tensor, dt: torch.dtype = dtype) -> torch.Tensor:
        return t.to(device=device, dtype=dt).contiguous()

    def taps(w: torch.Tensor) -> torch.Tensor:  # (Cout, Cin, k) -> (k*Cout, Cin)
        return w.permute(2, 0, 1).reshape(w.shape[2] * w.shape[0], w.shape[1])

    in_w = get("in_proj.weight")
    body = [cast(in_w), cast(get("in_proj.bias"))]
    ada_w, ada_b = [], []
    for i in range(depth):
        b = f"blocks.{i}."
        qkv_w = torch.cat([get(b + f"attn.to_{n}.weight") for n in "qkv"], 0)
        qkv_b = torch.cat([get(b + f"attn.to_{n}.bias") for n in "qkv"], 0)
        body += [cast(qkv_w), cast(qkv_b),
                 cast(get(b + "attn.q_norm.weight")), cast(get(b + "attn.q_norm.bias")),
                 cast(get(b + "attn.k_norm.weight")), cast(get(b + "attn.k_norm.bias")),
                 cast(get(b + "attn.proj.weight")), cast(get(b + "attn.proj.bias")),
                 cast(taps(get(b + "conv.block.1.weight"))), cast(get(b + "conv.block.1.bias")),
                 cast(get(b + "conv.block.3.weight")), cast(get(b + "conv.block.3.bias")),
                 cast(taps(get(b + "conv.block.6.weight"))), cast(get(b + "conv.block.6.bias")),
                 cast(get(b + "mlp.fc1.weight")), cast(get(b + "mlp.fc1.bias")),
                 cast(get(b + "mlp.fc2.weight")), cast(get(b + "mlp.fc2.bias"))]
        ada_w.append(get(b + "adaLN_modulation.1.weight"))
        ada_b.append(get(b + "adaLN_modulation.1.bias"))
    ada_w.append(get("final_layer.adaLN_modulation.1.weight"))
    ada_b.append(get("final_layer.adaLN_modulation.1.bias"))
    body += [cast(get("final_layer.linear.weight")), cast(get("final_layer.linear.bias"))]
    temb = tuple(cast(get(n), stat) for n in ("t_embedder.mlp.0.weight", "t_embedder.mlp.0.bias",
                                               "t_embedder.mlp.2.weight", "t_embedder.mlp.2.bias"))
    hidden = in_w.shape[0]
    head_dim = p["blocks.0.attn.q_norm.weight"].shape[0] if "blocks.0.attn.q_norm.weight" in p else 0
    if head_dim <= 0:
        get("blocks.0.attn.q_norm.weight")
    inner = p["blocks.0.attn.to_q.weight"].shape[0]
    return PackedDiT(
        body=body, temb=temb,  # type: ignore[arg-type]
        ada_w=cast(torch.cat(ada_w, 0)), ada_b=cast(torch.cat(ada_b, 0), stat),
        depth=depth, hidden=hidden, heads=inner // head_dim, head_dim=head_dim,
        in_channels=in_w.shape[1], out_channels=body[-2].shape[0], dtype=dtype, device=device)


# Bumped whenever any module registers a parameter, buffer or submodule (torch's global
# registration hooks): a module's parameter slots are re-discovered only after such a change, so
# the per-call staleness check reads each slot's tensor instead of walking the module tree.
# For the shipped DiT (394 tensors) this makes a cache hit a read of each slot (no tree walk),
# which the server pays on the host for every served chunk (its graph key) and every eager step.
_STRUCTURE_EPOCH = [0]


def _structure_changed(*_args) -> None:
    _STRUCTURE_EPOCH[0] += 1
    return None  # keep the registered object


_REGISTRATION_HOOKS = ("register_module_parameter_registration_hook", "register_module_buffer_registration_hook",
                       "register_module_module_registration_hook")
# Without all three hooks (not expected on torch >= 2.0) every call walks the tree, as before.
_HOOKED = all(hasattr(torch.nn.modules.module, name) for name in _REGISTRATION_HOOKS)
if _HOOKED:
    for _register in _REGISTRATION_HOOKS:
        getattr(torch.nn.modules.module, _register)(_structure_changed)


def _slots(module: torch.nn.Module) -> list[tuple[dict, str]]:
    """(the owning module's ``_parameters``/``_buffers`` dict, attribute) of every tensor, read
    per call: replacing a Parameter object (``setattr``, ``module.to`` with parameter swapping, a
    direct dict write) is seen without a new walk; adding or removing one bumps the epoch."""
    slots = []
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            slots += [(table, name) for name, t in table.items() if t is not None]
    return slots


def _signature(slots: list[tuple[dict, str]]) -> tuple:
    """Host-side staleness key: each tensor's storage address and in-place version counter.

    A new dtype, shape or device means new storage (``module.half()``, ``.to()``, ``param.data =``,
    ``load_state_dict`` into a resized tensor), so the address covers them; reading ``dtype`` and
    ``shape`` too would triple the cost of this check, which the server pays on the host every tick."""
    tensors = [table[name] for table, name in slots]
    return tuple([(t.data_ptr(), t._version) for t in tensors])


_CACHE: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def packed_for(module: torch.nn.Module, dtype: torch.dtype, device: torch.device | str) -> PackedDiT:
    """The cached pack of ``module`` for (dtype, device); repacked when any parameter changed.

    The cache lives as long as the module (weak reference). Staleness is checked on the host from
    each parameter's data pointer, version counter, dtype and shape (no device synchronisation);
    the module tree is walked again only after a parameter, buffer or submodule was registered
    somewhere (or one disappeared).
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _LOCK:
        per_module = _CACHE.setdefault(module, {})
        walked = per_module.get("slots")
    sig = None
    if _HOOKED and walked is not None and walked[0] == _STRUCTURE_EPOCH[0]:
        try:
            sig = _signature(walked[1])
        except KeyError:  # a tensor was deleted from its module: walk again
            sig = None
    if sig is None:
        walked = (_STRUCTURE_EPOCH[0], _slots(module))
        sig = _signature(walked[1])
        with _LOCK:
            per_module["slots"] = walked
    with _LOCK:
        hit = per_module.get((dtype, device))
        if hit is not None and hit[0] == sig:
            return hit[1]
    packed = pack_dit(_params(module), dtype, device)
    with _LOCK:
        per_module[(dtype, device)] = (sig, packed)
    return packed


def clear_packed(module: Optional[torch.nn.Module] = None) -> None:
    """Drop cached packs (of one module, or all)."""
    with _LOCK:
        if module is None:
            _CACHE.clear()
        else:
            _CACHE.pop(module, None)


def timestep_features(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """docs/design.md §1 sinusoidal features ``[cos(1000 t w_j) | sin(1000 t w_j)]``: (R,) -> (R, 256)."""
    half = TIME_EMBED_DIM // 2
    j = torch.arange(half, device=t.device, dtype=dtype)
    freqs = torch.exp(-math.log(TIME_EMBED_MAX_PERIOD) * j / half)
    args = TIME_EMBED_SCALE * t.to(dtype)[:, None] * freqs[None, :]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def modulation_table(packed: PackedDiT, t: torch.Tensor) -> torch.Tensor:
    """The per-step modulation table for time(s) ``t`` (see module docstring).

    Args:
        packed: a :class:`PackedDiT`.
        t: () or (R,) times in [0, 1], any float dtype, on ``packed.device``.
    Returns:
        (R, depth+1, 9, C) float32 (float64 for a float64 pack); scales stored as 1 + scale.
    Graph safety: no host sync; a handful of small kernels plus one GEMM over the stacked adaLN
        weights (the largest weight read of a step: precompute it per step when t is known).
    """
    stat = packed.ada_b.dtype
    t = t.reshape(-1).to(device=packed.device, dtype=stat)
    w1, b1, w2, b2 = packed.temb
    f = timestep_features(t, stat)
    temb = torch.nn.functional.linear(torch.nn.functional.silu(torch.nn.functional.linear(f, w1, b1)), w2, b2)
    act = torch.nn.functional.silu(temb).to(packed.dtype)
    mods = torch.matmul(act, packed.ada_w.t()).to(stat) + packed.ada_b  # (R, depth*9C + 2C)
    r, c, depth = t.shape[0], packed.hidden, packed.depth
    table = mods.new_zeros((r, depth + 1, MOD_VECTORS, c))
    table[:, :depth] = mods[:, : depth * MOD_VECTORS * c].view(r, depth, MOD_VECTORS, c)
    table[:, depth, :2] = mods[:, depth * MOD_VECTORS * c:].view(r, 2, c)
    for slot in SCALE_SLOTS:  # basic slicing only: no host->device index copy (graph-capturable)
        table[:, :depth, slot] += 1.0
    table[:, depth, 1] += 1.0
    return table
