"""Every open stream's conformer caches in two preallocated tensors, one slot per stream.

The encoder stage of :class:`~torch_cfm.serving.Token2wavServer` reads a tick's caches out of the
slots in one gather and writes the trimmed new caches back in one scatter, instead of a
concatenation, a copy and a trim per stream. A stream's caches are views of its slot in the
upstream ``forward_chunk`` layout:

* ``att``: (depth, 1, H, L, 2·d_k), L = the stream's cached frames (packed: the token-rate layers'
  frames repeated to the mel rate, as ``UpsampleConformerEncoderV2.forward_chunk`` returns them);
* ``cnn``: (1, C, k), the pre-lookahead and up-sampling convolutions' tails.

The slot tensors are allocated up front (``slots`` x ``max_frames``, the trim bound: the longest
prompt + the frames the trim keeps), like the CFM's cache arenas, with one more slot that a
padded batch's padding rows are written to (:attr:`ConformerSlots.dump`).
"""

from __future__ import annotations

from typing import Hashable, Optional, Sequence

import torch

from ..errors import fail
from .slot_table import SlotTable


class ConformerSlots:
    """Slot storage for ``slots`` streams' conformer caches (module docstring).

    Args:
        slots: streams held at once.
        max_frames: the longest att cache a slot holds (frames).
        att_shape: (depth, H, 2·d_k) of one stream's att cache; cnn_shape: (C, k) of its cnn cache.
        dtypes: (cnn, att) dtypes of the caches (under autocast the conv caches stay float32).
        device: of the caches.
    """

    def __init__(self, slots: int, max_frames: int, att_shape: tuple[int, int, int], cnn_shape: tuple[int, int],
                 dtypes: tuple[torch.dtype, torch.dtype], device: torch.device) -> None:
        self.slots, self.max_frames = int(slots), int(max_frames)
        depth, heads, width = att_shape
        self.table = SlotTable(self.slots, "ConformerSlots")
        self.dump = self.table.dump  # the padding rows' slot
        self.att = torch.zeros(depth, self.slots + 1, heads, self.max_frames, width, dtype=dtypes[1], device=device)
        self.cnn = torch.zeros(self.slots + 1, *cnn_shape, dtype=dtypes[0], device=device)
        self._length: dict[Hashable, int] = {}

    def __contains__(self, sid: Hashable) -> bool:
        return sid in self.table

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.att, self.cnn))

    def length(self, sid: Hashable) -> int:
        """Frames of ``sid``'s att cache (0 before its prompt is encoded)."""
        return self._length[sid]

    def open(self, sid: Hashable) -> None:
        """A free slot for ``sid``, empty until :meth:`write`."""
        self.table.open(sid)
        self._length[sid] = 0

    def close(self, sid: Hashable) -> None:
        self.table.close(sid)
        del self._length[sid]

    def caches(self, sid: Hashable) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(cnn (1, C, k), att (depth, 1, H, L, 2·d_k)) views of ``sid``'s slot; (None, None) before
        its first write."""
        if self._length[sid] == 0:
            return None, None
        s, n = self.table.slot(sid), self._length[sid]
        return self.cnn[s:s + 1], self.att[:, s:s + 1, :, :n]

    def set_length(self, sids: Sequence[Hashable], frames: int) -> None:
        for sid in sids:
            self._length[sid] = frames

    def index(self, sids: Sequence[Hashable], rows: Optional[int] = None) -> torch.Tensor:
        """(rows,) int64 slot numbers of ``sids`` on the slots' device (copied from pinned memory),
        padded to ``rows`` with :attr:`dump`."""
        return self.table.index(sids, rows, self.att.device)

    def gather_packed(self, index: torch.Tensor, frames: int, total: int, n1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The caches of slots ``index`` (B,) for a chunk that grows them from ``frames`` to ``total``
        frames: (att, a new (depth, B, H, total, 2·d_k) tensor whose first ``frames`` frames hold the
        caches as ``forward_chunk`` reads them: the token-rate layers (the first ``n1``) their own
        frames / 2, not the packed copy of them, the others all ``frames``; cnn (B, C, k)). The rest
        is left for the chunk to write."""
        depth, _, heads, _, width = self.att.shape
        att = torch.empty(depth, index.numel(), heads, total, width, dtype=self.att.dtype, device=self.att.device)
        torch.index_select(self.att[:n1, :, :, :frames // 2], 1, index, out=att[:n1, :, :, :frames // 2])
        torch.index_select(self.att[n1:, :, :, :frames], 1, index, out=att[n1:, :, :, :frames])
        return att, self.cnn.index_select(0, index)

    def scatter(self, index: torch.Tensor, cnn: torch.Tensor, att: torch.Tensor,
                pieces: Optional[Sequence[tuple[slice, int, int, int]]] = None) -> None:
        """Rows b of ``cnn`` (B, C, k) and ``att`` (depth, B, H, L, 2·d_k) into slot ``index[b]``
        (lengths unchanged: :meth:`set_length`). ``pieces``: (layers, to frame, from frame, frames)
        copies of att's frames (a trim, written without an intermediate tensor); default all of them."""
        for layers, to, src, n in pieces if pieces is not None else [(slice(None), 0, 0, att.shape[3])]:
            if n:
                self.att[layers, :, :, to:to + n].index_copy_(1, index, att[layers, :, :, src:src + n])
        self.cnn.index_copy_(0, index, cnn)

    def write(self, sids: Sequence[Hashable], cnn: torch.Tensor, att: torch.Tensor) -> None:
        """Rows b of ``cnn`` (B, C, k) and ``att`` (depth, B, H, L, 2·d_k) into the slots of
        ``sids[b]``, checked; their length becomes L."""
        want = (self.att.shape[0], len(sids), self.att.shape[2], att.shape[3], self.att.shape[4])
        if tuple(att.shape) != want or att.shape[3] > self.max_frames or att.dtype != self.att.dtype:
            fail("ConformerSlots.write", "att", f"have shape (depth, B, H, L <= {self.max_frames}, 2·d_k) = "
                 f"{want[:3]} + (L, {want[4]}) and dtype {self.att.dtype}", f"{tuple(att.shape)} {att.dtype}")
        if tuple(cnn.shape) != (len(sids), *self.cnn.shape[1:]) or cnn.dtype != self.cnn.dtype:
            fail("ConformerSlots.write", "cnn", f"have shape {(len(sids), *self.cnn.shape[1:])} and dtype "
                 f"{self.cnn.dtype}", f"{tuple(cnn.shape)} {cnn.dtype}")
        if len(sids) == 1:
            s = self.table.slot(sids[0])
            self.att[:, s:s + 1, :, :att.shape[3]].copy_(att)
            self.cnn[s:s + 1].copy_(cnn)
        else:
            self.scatter(self.index(sids), cnn, att)
        self.set_length(sids, att.shape[3])


__all__ = ["ConformerSlots"]
