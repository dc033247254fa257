"""The DiT-step marker: how the reference estimator step shows up as one site in a traced graph.

:mod:`torch_cfm.ops.dit_step_marker` defines the op (``torch.ops.torch_cfm._dit_step_marker``:
one side-effectful node per traced reference step, with the step's outputs, inputs and the
estimator's parameters as arguments). This module holds what the rules do with it: the
``dit_step`` rule always removes it, either rewiring the outputs to :func:`fused_dit_step` (policy
says fused) or just dropping the marker (reference stays).

Eager code never needs the marker (``mark_dit_step`` is a no-op outside ``torch.compile``).
"""

from __future__ import annotations

import weakref
from typing import Optional, Sequence

import torch

from torch_cfm.models.fused_forward import stage_input
from torch_cfm.packing import PackedDiT, modulation_table, pack_dit

# The marker op and mark_dit_step live below the models (the model marks its own step); the rules
# below read them.
from torch_cfm.ops.dit_step_marker import MARKER, mark_dit_step, marker_op  # noqa: F401


def fused_dit_step(params: Sequence[torch.Tensor], names: Sequence[str], x: torch.Tensor,
                   mu: torch.Tensor, t: torch.Tensor, spks: Optional[torch.Tensor],
                   cond: Optional[torch.Tensor], cnn_cache: Optional[torch.Tensor],
                   att_cache: Optional[torch.Tensor], valid_lengths: Optional[torch.Tensor],
                   cache_lengths: Optional[torch.Tensor], dtype: torch.dtype,
                   precision: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused estimator step from the marker's arguments (what the ``dit_step`` rule calls).

    Traceable (no host reads, no caches): packs the weights from the parameters
    (:func:`torch_cfm.packing.pack_dit`), builds the staged input and the modulation table, then
    calls ``torch_cfm::dit_body``. Under Inductor with ``freezing`` the packing is folded into
    constants at compile time; without it the packing runs in the compiled graph.

    Returns:
        velocity (N, 80, T), new_cnn_cache (depth, N, 2C, 2), new_att_cache (depth, N, H, T+L, 2D)
        in ``dtype``.
    """
    packed = pack_dit(dict(zip(names, params)), dtype, x.device)
    x_in = stage_input(x, mu, spks, cond, dtype)
    table = modulation_table(packed, t.reshape(-1))
    cnn = None if cnn_cache is None else cnn_cache.to(dtype)
    att = None if att_cache is None else att_cache.to(dtype)
    return torch.ops.torch_cfm.dit_body.default(x_in, packed.body, table, cnn, att, valid_lengths,
                                                cache_lengths, precision)


def fused_dit_step_prepacked(body: Sequence[torch.Tensor], temb: Sequence[torch.Tensor],
                             ada_w: torch.Tensor, ada_b: torch.Tensor, sizes: Sequence[int],
                             x: torch.Tensor, mu: torch.Tensor, t: torch.Tensor,
                             spks: Optional[torch.Tensor], cond: Optional[torch.Tensor],
                             cnn_cache: Optional[torch.Tensor], att_cache: Optional[torch.Tensor],
                             valid_lengths: Optional[torch.Tensor], cache_lengths: Optional[torch.Tensor],
                             dtype: torch.dtype, precision: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`fused_dit_step` on weights packed at compile time (buffers of the compiled graph,
    kept current by :class:`PackBinding`): no weight copies in the compiled step.

    Args:
        sizes: (depth, hidden, heads, head_dim, in_channels, out_channels) of the pack.
    """
    depth, hidden, heads, head_dim, in_channels, out_channels = sizes
    packed = PackedDiT(body=list(body), temb=tuple(temb), ada_w=ada_w, ada_b=ada_b, depth=depth,  # type: ignore[arg-type]
                       hidden=hidden, heads=heads, head_dim=head_dim, in_channels=in_channels,
                       out_channels=out_channels, dtype=dtype, device=x.device)
    x_in = stage_input(x, mu, spks, cond, dtype)
    table = modulation_table(packed, t.reshape(-1))
    cnn = None if cnn_cache is None else cnn_cache.to(dtype)
    att = None if att_cache is None else att_cache.to(dtype)
    return torch.ops.torch_cfm.dit_body.default(x_in, list(body), table, cnn, att, valid_lengths,
                                                cache_lengths, precision)


def packed_tensors(packed) -> list[torch.Tensor]:
    """Every tensor of a :class:`torch_cfm.packing.PackedDiT`, in a fixed order."""
    return list(packed.body) + list(packed.temb) + [packed.ada_w, packed.ada_b]


class PackBinding:
    """Keeps weights packed at compile time equal to the parameters they came from.

    The compiled graph reads the pack as buffers (static inputs, so CUDA graphs never copy
    them). Before each call the backend's wrapper calls :meth:`refresh` with the call's
    arguments: if any parameter argument is another tensor or its version counter moved
    (``load_state_dict``, an optimiser step, ``copy_``), the weights are packed again and copied
    into the same buffers in place. The check is host-only (no device synchronisation).

    Args:
        arg_index: position of each parameter in the compiled graph's arguments.
        params: the parameters at compile time; names: their docs/design.md §1 names.
        dtype, device: of the pack. buffers: the pack's tensors (``packed_tensors`` order).
    """

    def __init__(self, arg_index: Sequence[int], params: Sequence[torch.Tensor], names: Sequence[str],
                 dtype: torch.dtype, device: torch.device, buffers: Sequence[torch.Tensor]):
        self.arg_index = list(arg_index)
        self.names = list(names)
        self.dtype, self.device = dtype, device
        self.buffers = list(buffers)
        self._params = [weakref.ref(p) for p in params]
        self._versions = [p._version for p in params]

    def stale(self, args: Sequence[object]) -> bool:
        for i, ref, version in zip(self.arg_index, self._params, self._versions):
            p = args[i]
            if p is not ref() or p._version != version:  # type: ignore[attr-defined]
                return True
        return False

    def refresh(self, args: Sequence[object]) -> bool:
        """Repack into the buffers if the parameters changed; returns True when it did."""
        if not self.stale(args):
            return False
        params = [args[i] for i in self.arg_index]
        with torch.no_grad():
            fresh = packed_tensors(pack_dit(dict(zip(self.names, params)), self.dtype, self.device))
            for buf, new in zip(self.buffers, fresh):
                buf.copy_(new)
        self._params = [weakref.ref(p) for p in params]  # type: ignore[arg-type]
        self._versions = [p._version for p in params]  # type: ignore[attr-defined]
        return True
