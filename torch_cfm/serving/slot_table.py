"""Which slot of a stage's preallocated per-stream tensors each open stream owns.

The serving stages keep every open stream's state in tensors allocated once with one row (slot)
per stream and one more, :attr:`SlotTable.dump`, that a padded batch's padding rows are written
to. A tick gathers its streams' rows by slot number and scatters the new state back, inside its
CUDA graph: a few launches per tick instead of a few per stream.
"""

from __future__ import annotations

from typing import Hashable, Optional, Sequence

import torch

from ..errors import fail


class SlotTable:
    """Stream ids to slot numbers ``0 .. slots - 1``, a freed slot reused (module docstring).

    Args:
        slots: streams held at once.
        owner: the class named in errors.
    """

    def __init__(self, slots: int, owner: str) -> None:
        self.slots, self.owner = int(slots), owner
        self.dump = self.slots  # the padding rows' slot
        self._slot: dict[Hashable, int] = {}
        self._free = list(range(self.slots - 1, -1, -1))

    def __contains__(self, sid: Hashable) -> bool:
        return sid in self._slot

    def __len__(self) -> int:
        return len(self._slot)

    def open(self, sid: Hashable) -> int:
        """A free slot for ``sid`` (ValueError naming ``sid`` when it is open or none is free)."""
        if sid in self._slot:
            fail(f"{self.owner}.open", "sid", "name a stream not open here", repr(sid))
        if not self._free:
            fail(f"{self.owner}.open", "sid", f"find a free slot of {self.slots}", "all taken")
        self._slot[sid] = self._free.pop()
        return self._slot[sid]

    def close(self, sid: Hashable) -> None:
        self._free.append(self._slot.pop(sid))

    def slot(self, sid: Hashable) -> int:
        return self._slot[sid]

    def index(self, sids: Sequence[Hashable], rows: Optional[int], device: torch.device) -> torch.Tensor:
        """(rows,) int64 slot numbers of ``sids`` on ``device`` (copied from pinned memory), padded
        to ``rows`` with :attr:`dump`."""
        slots = [self._slot[s] for s in sids] + [self.dump] * ((rows or len(sids)) - len(sids))
        cuda = torch.device(device).type == "cuda"
        return torch.tensor(slots, dtype=torch.int64, pin_memory=cuda).to(device, non_blocking=True)


__all__ = ["SlotTable"]
