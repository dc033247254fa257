"""How one solve reads and writes each Euler step's caches in an arena: the cache layouts.

The step loop (:func:`torch_cfm.solve.engine.run_steps`) asks a layout for step i's caches
(:meth:`read`), hands them to the stepper, and gives the layout the step's new caches
(:meth:`write`); the solve's last call ends with :meth:`commit`. A stepper takes its attention
caches in one of two forms (:data:`DENSE`, :data:`IN_PLACE`); the arena in one of two layouts
(docs/design.md §2, §8):

* **newest first** (an arena without ``frame_keys``: the upstream layout, :class:`NewestFirst`):
  each step reads the window newest first and its new cache ``[cur T_r ; old L_r]`` is written
  back through the trim;
* **keyed** (``frame_keys``): a slot's valid frames lie at [0, L_r) in any order and
  ``frame_keys`` names their keys. Three forms share one frame plan
  (:func:`~torch_cfm.models.cache.arena_chunk_plan`): :class:`KeyedInPlace` (the fused body
  appends each step's keys into the arena itself; after the last step one copy refills the frames
  of dropped keys in every step's cache), :class:`KeyedScratch` (the same body on the solved rows
  copied out into one scratch cache; only changed frames go back) and :class:`KeyedDense` (a
  stepper that reads and writes newest-first caches: old frames gathered by key, new keys written
  back).

Frame copies run on the Triton kernels of :mod:`torch_cfm.kernels.cache_trim` where the policy
runs Triton (NVIDIA SM80+), else on their ATen references.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import policy
from ..models.cache import arena_chunk_plan, trim_gather_index
from ..reference.cache_trim import move_frames_reference, trim_copy_reference
from .rows import SolvedRows

DENSE = "dense"  # the stepper reads (depth, 2S, H, Lb, 2D) newest first and returns the new cache
IN_PLACE = "in_place"  # the stepper appends its keys behind the old ones in the attention cache it is given


def frame_copies(att: torch.Tensor):
    """(frame-map copy, move-list copy) for this arena: the Triton kernels where the policy runs
    Triton kernels, else their ATen references."""
    if policy.decide(att.device, att.dtype).backend == "sm80" and att.stride(-1) == 1:
        from ..kernels.cache_trim import move_frames_into, trim_copy_into  # Triton is optional

        return trim_copy_into, move_frames_into
    return trim_copy_reference, move_frames_reference


class _Layout:
    """What every layout shares: the arena's caches, the solved rows, conv-cache write-back."""

    def __init__(self, arena, solved: SolvedRows) -> None:
        self.att, self.cnn, self.solved = arena.att, arena.cnn, solved
        self.rows = solved.rows
        self.window = solved.shape.cache_frames

    def conv(self, i: int) -> torch.Tensor:
        """Step i's conv caches of the solved rows (a view, or a gather of them)."""
        return self.cnn[i] if self.rows is None else self.cnn[i].index_select(1, self.rows)

    def write_conv(self, i: int, new_cnn: torch.Tensor) -> None:
        if self.rows is None:
            self.cnn[i].copy_(new_cnn)
        else:
            self.cnn[i].index_copy_(1, self.rows, new_cnn.to(self.cnn.dtype))

    def commit(self) -> None:
        """The solve's last call, after its last step."""


class NewestFirst(_Layout):
    """An arena in the upstream layout: step i reads its window newest first; its new cache is
    trimmed on the way back (docs/design.md §3). :data:`DENSE` steppers only."""

    def __init__(self, arena, solved: SolvedRows) -> None:
        super().__init__(arena, solved)
        shape = solved.shape
        width = min(self.att.shape[4], shape.t_len + self.window)
        self.index, self.new_lengths = trim_gather_index(solved.vl + solved.cl, solved.prompt, width,
                                                         shape.t_len + self.window, shape.keep_oldest)
        self._copy = frame_copies(self.att)[0]

    def read(self, i: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        att = self.att[i][:, :, :, :self.window]
        if self.rows is not None:
            att = att.index_select(1, self.rows)
        return self.conv(i), (att if self.window else None)  # no old keys: no attention cache

    def write(self, i: int, new_cnn: torch.Tensor, new_att: torch.Tensor) -> None:
        self.write_conv(i, new_cnn)
        self._copy(self.att[i], new_att.contiguous(), self.index, self.rows)


class _Keyed(_Layout):
    """A keyed arena: the chunk's frame plan, and the frame keys committed at the end."""

    def __init__(self, arena, solved: SolvedRows) -> None:
        super().__init__(arena, solved)
        shape = solved.shape
        self.frame_keys, self.slots = arena.frame_keys, solved.slots
        keys = self.frame_keys if self.slots is None else self.frame_keys.index_select(0, self.slots)
        self.plan = arena_chunk_plan(keys, solved.cl, solved.vl, solved.prompt, self.window, shape.t_len,
                                     shape.keep_oldest)
        self.new_lengths = self.plan.new_lengths
        self.width = self.window + shape.t_len
        self._copy, self._move = frame_copies(self.att)

    def commit(self) -> None:
        kept = self.plan.new_frame_keys.shape[1]
        if self.slots is None:
            self.frame_keys[:, :kept].copy_(self.plan.new_frame_keys)
        else:
            self.frame_keys[:, :kept].index_copy_(0, self.slots, self.plan.new_frame_keys)


class KeyedInPlace(_Keyed):
    """Every slot solved and room for ``Lb + T`` frames: the stepper appends into the arena itself."""

    def read(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cnn[i], self.att[i][:, :, :, :self.width]

    def write(self, i: int, new_cnn: torch.Tensor, new_att: None) -> None:
        self.write_conv(i, new_cnn)

    def commit(self) -> None:
        flat = self.att.flatten(0, 1)  # the trim: every step's cache at once
        self._move(flat, flat, self.plan.moves)
        super().commit()


class KeyedScratch(_Keyed):
    """Some slots, or no room to append: the solved rows' old frames copied into one scratch cache,
    appended there, and only the frames the chunk changes copied back."""

    def __init__(self, arena, solved: SolvedRows) -> None:
        super().__init__(arena, solved)
        att = self.att
        self.scratch = att.new_empty(att.shape[1], 2 * solved.vl.shape[0], att.shape[3], self.width, att.shape[5])

    def read(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv(i), self._copy(self.scratch, self.att[i], self.plan.old_frames, None, self.rows)

    def write(self, i: int, new_cnn: torch.Tensor, new_att: None) -> None:
        self.write_conv(i, new_cnn)
        self._move(self.att[i], self.scratch, self.plan.write_back, self.rows)


class KeyedDense(_Keyed):
    """A :data:`DENSE` stepper on a keyed arena: old frames gathered newest first by key, the new
    cache's keys written back to the frames the plan gives them."""

    def __init__(self, arena, solved: SolvedRows) -> None:
        super().__init__(arena, solved)
        att = self.att
        self.old = att.new_zeros(att.shape[1], 2 * solved.vl.shape[0], att.shape[3], self.window, att.shape[5])

    def read(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv(i), self._copy(self.old, self.att[i], self.plan.old_by_key, None, self.rows)

    def write(self, i: int, new_cnn: torch.Tensor, new_att: torch.Tensor) -> None:
        self.write_conv(i, new_cnn)
        self._copy(self.att[i], new_att.contiguous(), self.plan.new_cache_keys, self.rows)


def layout_for(arena, solved: SolvedRows, form: str) -> _Layout:
    """The layout of ``arena`` for a stepper taking ``form`` caches."""
    if arena.frame_keys is None:
        if form != DENSE:
            raise ValueError(f"a newest-first arena needs a {DENSE!r} stepper, got {form!r}")
        return NewestFirst(arena, solved)
    if form == DENSE:
        return KeyedDense(arena, solved)
    width = solved.shape.cache_frames + solved.shape.t_len
    if solved.slots is None and width <= arena.att.shape[4]:
        return KeyedInPlace(arena, solved)
    return KeyedScratch(arena, solved)


__all__ = ["DENSE", "IN_PLACE", "NewestFirst", "KeyedInPlace", "KeyedScratch", "KeyedDense", "layout_for",
           "frame_copies"]
