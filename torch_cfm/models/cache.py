"""Cache layouts and the streaming trim (docs/design.md §2-3), plus the per-bucket cache arena.

Layouts (one request = two CFG rows, cond then uncond):
    attention: (n, depth, 2B, H, L, 2D), K in ``[..., :D]``, V in ``[..., D:]``, newest frames FIRST;
    conv:      (n, depth, 2B, 2C, 2), channels [0, C) = conv 1 history, [C, 2C) = conv 2 history.

The server's :class:`CacheArena` is *keyed*: a row's valid frames sit at [0, L) in any order, and
``frame_keys[r, j]`` names the newest-first key (position in the newest-first cache) frame j holds.
Attention does not depend on the order of its keys, so a chunk appends its T current keys behind
the old ones in place, and the trim fills the frames of dropped keys with the kept frames past the
new length (at most as many frames as were dropped, never the whole cache).
:func:`arena_chunk_plan` computes those frame maps on the device.

The trim (the upstream rule, kept exactly): after a chunk, when a request's attention cache holds
more than ``prompt_len + 100`` frames, keep ``cache[:prompt_len]`` followed by ``cache[-100:]``
(its newest prompt_len frames and its oldest 100), for every Euler step's cache; conv caches are
never trimmed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..config import DiTConfig, SolverConfig
from ..errors import fail, shape_str

TRIM_KEEP_OLDEST = SolverConfig().trim_keep_oldest


def trimmed_length(length: int, prompt_len: int, keep_oldest: int = TRIM_KEEP_OLDEST) -> int:
    """Host-side length after the trim: ``prompt_len + keep_oldest`` when longer, else unchanged."""
    return prompt_len + keep_oldest if length > prompt_len + keep_oldest else length


def trim_attention_cache(att_cache: torch.Tensor, prompt_len: int,
                         keep_oldest: int = TRIM_KEEP_OLDEST) -> torch.Tensor:
    """The docs/design.md §3 trim of one request's (or a uniform batch's) cache, frame axis = -2.

    Args:
        att_cache: (..., L, 2D) newest-first attention cache, e.g. (n, depth, 2B, H, L, 2D).
        prompt_len: frames of the prompt (int >= 0).
    Returns:
        ``att_cache`` itself when ``L <= prompt_len + keep_oldest``, else a new tensor
        ``cat(cache[..., :prompt_len, :], cache[..., -keep_oldest:, :])``.
    """
    if not isinstance(prompt_len, int) or prompt_len < 0:
        fail("trim_attention_cache", "prompt_len", "be an int >= 0", repr(prompt_len))
    frames = att_cache.shape[-2]
    if frames <= prompt_len + keep_oldest:
        return att_cache
    return torch.cat([att_cache[..., :prompt_len, :], att_cache[..., frames - keep_oldest:, :]], dim=-2)


def reversed_key_index(lengths: torch.Tensor, frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather index between a newest-first cache and the in-place arena's reversed key order.

    The fused body's in-place arena (:func:`torch_cfm.kernels.dit_body.dit_body_arena_into`) keeps
    row r's ``lengths[r]`` keys at frames [0, lengths[r]) with frame j holding key
    ``lengths[r] - 1 - j``. The map is its own inverse, so one index serves both directions.

    Args:
        lengths: (R,) integer frames per row (clamped to [0, frames]), on the caches' device.
        frames: the frame axis' size.
    Returns:
        (index (R, frames) int64, valid (R, frames) bool): frame j of one layout is frame
        ``index[r, j]`` of the other where ``valid[r, j]``; frames past the length are padding.
    """
    ln = lengths.to(torch.int64).clamp(0, frames)[:, None]
    j = torch.arange(frames, device=lengths.device)[None, :]
    valid = j < ln
    return torch.where(valid, ln - 1 - j, j), valid


def reverse_keys(cache: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``cache`` (..., R, H, F, 2D) with each row's first ``lengths[r]`` frames in reversed order
    and zeros after them (a new tensor): newest-first ↔ the in-place arena's order."""
    return _gather_frames(cache, *reversed_key_index(lengths, cache.shape[-2]))


def _gather_frames(cache: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """A new (..., R, H, W, 2D) tensor: output frame j of row r is ``cache[..., r, :, index[r, j], :]``
    where ``valid[r, j]``, zeros elsewhere. index (R, W) int64 in [0, F), valid (R, W) bool."""
    *lead, rows, heads, _, two_d = cache.shape
    width = index.shape[1]
    shape = (*([1] * len(lead)), rows, 1, width, 1)
    out = torch.gather(cache, -2, index.view(shape).expand(*lead, rows, heads, width, two_d))
    return torch.where(valid.view(shape), out, out.new_zeros(()))


def trim_gather_index(new_lengths: torch.Tensor, prompt_lengths: torch.Tensor, width: int, src_frames: int,
                      keep_oldest: int = TRIM_KEEP_OLDEST) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row trim as a gather, on the device (no host sync).

    Row n of a new cache holds ``new_lengths[n]`` valid frames (newest first). Output frame j of
    row n reads source frame ``index[n, j]``: j itself when no trim is due; when
    ``new_lengths[n] > P_n + keep_oldest``, frames j < P_n read j and frames P_n <= j < P_n + keep
    read ``new_lengths[n] - keep + (j - P_n)`` (its oldest ``keep`` frames). Padding positions
    read a clamped in-range frame (finite values).

    Args:
        new_lengths, prompt_lengths: (R,) integer tensors.
        width: output frames W. src_frames: frames of the source cache (index clamped below it).
    Returns:
        (index (R, W) int64, trimmed lengths (R,) int64).
    """
    new_len = new_lengths.to(torch.int64)
    prompt = prompt_lengths.to(torch.int64)
    j = torch.arange(width, device=new_len.device)[None]
    trim = (new_len > prompt + keep_oldest)[:, None]
    tail = new_len[:, None] - keep_oldest + (j - prompt[:, None])
    index = torch.where(trim & (j >= prompt[:, None]), tail, j).clamp(0, max(src_frames - 1, 0))
    lengths = torch.where(trim[:, 0], prompt + keep_oldest, new_len)
    return index, lengths


@dataclass
class FrameMoves:
    """A compact list of frame copies per row (``kernels.cache_trim.move_frames_into``): row n
    copies frame ``src[n, k]`` to frame ``dst[n, k]`` for k < ``count[n]``; entries past the
    count are padding. src, dst (S, K) int64; count (S,) int64."""

    src: torch.Tensor
    dst: torch.Tensor
    count: torch.Tensor


def _compact_moves(wanted: torch.Tensor, source: torch.Tensor) -> FrameMoves:
    """The frames j where ``wanted[n, j]`` as a move list ``source[n, j] -> j``, in frame order."""
    rows, width = wanted.shape
    j = torch.arange(width, device=wanted.device)[None].expand(rows, -1)
    slot = torch.where(wanted, wanted.cumsum(1) - 1, width)
    dst = torch.zeros((rows, width + 1), dtype=torch.int64, device=wanted.device)
    src = torch.zeros((rows, width + 1), dtype=torch.int64, device=wanted.device)
    dst.scatter_(1, slot, j.clone())
    src.scatter_(1, slot, source)
    return FrameMoves(src=src[:, :width], dst=dst[:, :width], count=wanted.sum(1))


@dataclass
class ArenaChunkPlan:
    """The frame maps of one chunk on a keyed arena (:func:`arena_chunk_plan`); S rows (requests),
    Lb = cache window, W = Lb + T frames of the chunk's cache, Wk = min(W, frames of frame_keys).
    The frame maps are int64 with -1 where nothing is copied (``trim_copy_into`` skips those frames).

    Attributes:
        old_frames: (S, Lb) frame j itself for j < L_r (a gather of the old frames as they lie).
        old_by_key: (S, Lb) the frame holding newest-first key k for k < L_r (the old cache newest first).
        moves: :class:`FrameMoves` after an in-place append: each frame of a dropped key below the
            new length takes the key of a kept frame at or past it (at most the dropped frames).
        write_back: :class:`FrameMoves` from a copied-out, appended cache back into the arena: the
            frames the chunk changes (appended or refilled), old frames left as they are.
        new_cache_keys: (S, Wk) the key in the chunk's newest-first new cache ``[cur T_r ; old L_r]``
            of the key each frame holds afterwards; -1 past the new length.
        new_frame_keys: (S, Wk) int32 ``frame_keys`` after the chunk (renumbered by the trim).
        new_lengths: (S,) int64 cache lengths after the chunk (trimmed).
    """

    old_frames: torch.Tensor
    old_by_key: torch.Tensor
    moves: FrameMoves
    write_back: FrameMoves
    new_cache_keys: torch.Tensor
    new_frame_keys: torch.Tensor
    new_lengths: torch.Tensor


def arena_chunk_plan(frame_keys: torch.Tensor, cache_lengths: torch.Tensor, valid_lengths: torch.Tensor,
                     prompt_lengths: torch.Tensor, cache_frames: int, t_len: int,
                     keep_oldest: int = TRIM_KEEP_OLDEST) -> ArenaChunkPlan:
    """Frame maps of one chunk on a keyed arena, on the device (no host sync, fixed shapes).

    The chunk appends row r's T_r current keys at frames [L_r, L_r + T_r) in reversed chunk order
    (the fused body's in-place form: frame L_r + T_r - 1 - f holds current frame f, i.e. newest-first key f
    of the new cache; old key k becomes key T_r + k). When the new length L_r + T_r exceeds
    ``P_r + keep_oldest`` the docs/design.md §3 trim keeps keys [0, P_r) and the last ``keep_oldest``; each
    frame below the new length that holds a dropped key takes the key of one kept frame at or past
    the new length (k-th such frame ↔ k-th kept frame, in frame order), and the kept keys are
    renumbered to their trimmed positions.

    Args:
        frame_keys: (S, Mk) integer map of the rows (newest-first key of each frame, valid below L_r).
        cache_lengths, valid_lengths, prompt_lengths: (S,) L_r in [0, cache_frames], T_r in
            [0, t_len], P_r (the callers clamp the first two).
        cache_frames, t_len: Lb and T (python ints, static shapes).
    Returns:
        :class:`ArenaChunkPlan`. New lengths are clamped to Mk (the server keeps P_r + keep <= Mk).
    """
    dev = frame_keys.device
    width = cache_frames + t_len
    key_frames = frame_keys.shape[1]
    kept_width = min(width, key_frames)
    cl = cache_lengths.to(torch.int64)[:, None]
    vl = valid_lengths.to(torch.int64)[:, None]
    prompt = prompt_lengths.to(torch.int64)[:, None]
    length = cl + vl
    j = torch.arange(width, device=dev)[None]
    old_keys = frame_keys[:, :min(width, key_frames)].to(torch.int64)
    if width > key_frames:
        old_keys = torch.cat([old_keys, old_keys.new_zeros(old_keys.shape[0], width - key_frames)], 1)
    keys = torch.where(j < cl, old_keys + vl, length - 1 - j)  # after the append; valid below length
    due = length > prompt + keep_oldest
    new_len = torch.where(due, prompt + keep_oldest, length).clamp(max=key_frames)
    dropped = due & (keys >= prompt) & (keys < length - keep_oldest) & (j < length)
    hole = dropped & (j < new_len)
    kept_past = ~dropped & (j >= new_len) & (j < length)
    # k-th hole <- k-th kept frame past the new length (equal counts: both = dropped keys below new_len)
    rank = torch.where(kept_past, kept_past.cumsum(1) - 1, width)
    by_rank = torch.full((keys.shape[0], width + 1), width - 1, device=dev, dtype=torch.int64)
    by_rank.scatter_(1, rank, j.expand_as(rank))
    hole_rank = (hole.cumsum(1) - 1).clamp(min=0)
    source = torch.where(hole, by_rank.gather(1, hole_rank), j)
    cache_keys = keys.gather(1, source)
    renumbered = torch.where(due & (cache_keys >= length - keep_oldest), cache_keys - (length - keep_oldest - prompt),
                             cache_keys)
    live = j < new_len
    kj = j[:, :cache_frames]
    old_live = kj < cl
    by_key = torch.full((keys.shape[0], cache_frames + 1), -1, device=dev, dtype=torch.int64)
    by_key.scatter_(1, torch.where(old_live, old_keys[:, :cache_frames].clamp(0, cache_frames), cache_frames),
                    kj.expand_as(old_live).clone())
    changed = live & (hole | (j >= cl))
    return ArenaChunkPlan(
        old_frames=torch.where(old_live, kj, -1),
        old_by_key=torch.where(old_live, by_key[:, :cache_frames], -1),
        moves=_compact_moves(hole, source),
        write_back=_compact_moves(changed[:, :kept_width], source[:, :kept_width]),
        new_cache_keys=torch.where(live, cache_keys, -1)[:, :kept_width],
        new_frame_keys=torch.where(live, renumbered, j)[:, :kept_width].to(torch.int32),
        new_lengths=new_len[:, 0],
    )


def keyed_to_newest_first(cache: torch.Tensor, frame_keys: torch.Tensor, lengths: torch.Tensor,
                          frames: Optional[int] = None) -> torch.Tensor:
    """A keyed cache (..., R, H, F, 2D) in the upstream layout: a new (..., R, H, frames, 2D) tensor
    with row r's key k at frame k for k < lengths[r] and zeros after (``frames`` default F)."""
    rows, width = cache.shape[-4], cache.shape[-2]
    frames = width if frames is None else frames
    ln = lengths.to(torch.int64).clamp(0, min(frames, frame_keys.shape[1]))[:, None]
    j = torch.arange(frame_keys.shape[1], device=cache.device)[None]
    valid = j < ln
    by_key = torch.zeros((rows, frames + 1), dtype=torch.int64, device=cache.device)
    by_key.scatter_(1, torch.where(valid, frame_keys.to(torch.int64).clamp(0, frames), frames),
                    j.expand(rows, -1).clone())
    kept = torch.arange(frames, device=cache.device)[None] < ln
    return _gather_frames(cache, by_key[:, :frames].clamp(max=width - 1), kept)


@dataclass
class CacheArena:
    """All caches and staging buffers of one batch bucket: allocated once, reused, never resized.

    Request slot r (0 <= r < rows) owns CFG rows r (cond) and rows + r (uncond).

    Two layouts: *keyed* (``frame_keys`` given; what the servers use) and *newest first*
    (``frame_keys`` None: the upstream layout, what ``StreamingCFM.forward_chunk`` solves through).

    Attributes:
        att: (n, depth, 2R, H, M + A, 2D) attention caches, keyed: slot r's ``cache_lengths[r]``
            valid frames sit at [0, L_r) in any order (the same for every step, block and head),
            ``frame_keys`` names their keys. The A extra frames let a chunk append in place
            (``solve_arena_chunk`` copies the rows out when ``Lb + T > M + A``).
        cnn: (n, depth, 2R, 2C, 2) conv caches.
        frame_keys: (R, M) int32 key (position in the newest-first cache) of each valid frame
            (``keyed_to_newest_first``); starts as the identity (frame j = key j). None: the
            arena is newest first (frame j = key j always, the trim writes the caches back).
        cache_lengths: (R,) int32 valid frames of each slot's attention caches (all steps).
        prompt_lengths: (R,) int32 prompt frames of each slot (for the trim).
        valid_lengths: (R,) int32 staged chunk frames T_n of the next solve (0 = idle slot).
        mu, cond: (R, 80, Tmax) staged chunk inputs; spks: (R, 80) per-slot speaker embedding.
        out_mel: (R, 80, Tmax) solved mel of the last chunk (frames >= T_n are padding).
        x_state: (R, 80, Tmax) float32 Euler state of solves spread over several calls
            (``solve_arena_chunk(steps=...)``), or None when the arena was allocated without it.
    Shapes: R rows (requests) of the bucket, M max cache frames, A append frames, Tmax max chunk frames.
    """

    att: torch.Tensor
    cnn: torch.Tensor
    frame_keys: Optional[torch.Tensor]
    cache_lengths: torch.Tensor
    prompt_lengths: torch.Tensor
    valid_lengths: torch.Tensor
    mu: torch.Tensor
    cond: torch.Tensor
    spks: torch.Tensor
    out_mel: torch.Tensor
    x_state: Optional[torch.Tensor] = None

    @classmethod
    def allocate(cls, config: DiTConfig, n_timesteps: int, rows: int, max_cache_frames: int,
                 max_chunk_frames: int, device: torch.device, dtype: torch.dtype,
                 append_frames: int = 0, step_state: bool = False, keyed: bool = True) -> "CacheArena":
        """Zero-filled arena for ``rows`` requests (2*rows CFG rows); ``append_frames`` (A) extra
        attention frames per cache for in-place appends (``max_chunk_frames`` covers every chunk);
        ``step_state``: with the ``x_state`` buffer of solves spread over several calls;
        ``keyed=False``: newest first, without ``frame_keys``."""
        for name, val in (("rows", rows), ("max_cache_frames", max_cache_frames),
                          ("max_chunk_frames", max_chunk_frames), ("n_timesteps", n_timesteps)):
            if not isinstance(val, int) or val <= 0:
                fail("CacheArena.allocate", name, "be a positive int", repr(val))
        if not isinstance(append_frames, int) or append_frames < 0:
            fail("CacheArena.allocate", "append_frames", "be an int >= 0", repr(append_frames))
        c, mel = config.hidden, config.out_channels
        kw = dict(device=device, dtype=dtype)
        i32 = dict(device=device, dtype=torch.int32)
        return cls(
            att=torch.zeros((n_timesteps, config.depth, 2 * rows, config.heads, max_cache_frames + append_frames,
                             2 * config.head_dim), **kw),
            cnn=torch.zeros((n_timesteps, config.depth, 2 * rows, 2 * c, config.conv_cache_frames), **kw),
            frame_keys=torch.arange(max_cache_frames, **i32).repeat(rows, 1) if keyed else None,
            cache_lengths=torch.zeros(rows, **i32),
            prompt_lengths=torch.zeros(rows, **i32),
            valid_lengths=torch.zeros(rows, **i32),
            mu=torch.zeros((rows, mel, max_chunk_frames), **kw),
            cond=torch.zeros((rows, mel, max_chunk_frames), **kw),
            spks=torch.zeros((rows, mel), **kw),
            out_mel=torch.zeros((rows, mel, max_chunk_frames), **kw),
            x_state=torch.zeros((rows, mel, max_chunk_frames), device=device, dtype=torch.float32)
            if step_state else None,
        )

    @property
    def rows(self) -> int:
        return self.mu.shape[0]

    @property
    def max_cache_frames(self) -> int:
        return self.att.shape[4] if self.frame_keys is None else self.frame_keys.shape[1]

    @property
    def append_frames(self) -> int:
        return self.att.shape[4] - self.max_cache_frames

    @property
    def identity(self) -> tuple:
        """The storage and shape of every buffer: what a captured solve of this arena is bound to."""
        return tuple((k, t.data_ptr(), tuple(t.shape), t.dtype) for k, t in self.tensors().items())

    @property
    def max_chunk_frames(self) -> int:
        return self.mu.shape[2]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every buffer the arena holds, by name (``x_state`` only where allocated)."""
        return {k: t for k, t in self.__dict__.items() if isinstance(t, torch.Tensor)}

    def nbytes(self) -> int:
        """Bytes of every tensor of the arena."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def data_ptrs(self) -> dict[str, int]:
        """Storage address of each buffer (tests check they never change)."""
        return {k: t.data_ptr() for k, t in self.tensors().items()}

    def request_caches(self, slot: int, length: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of one slot's caches in the upstream layout: cnn (n, depth, 2, 2C, 2) and att
        (n, depth, 2, H, length, 2D) newest first, row 0 = cond, row 1 = uncond. ``length``: keys
        to return (default M; keys past the slot's ``cache_lengths`` entry are meaningless)."""
        if not 0 <= slot < self.rows:
            fail("CacheArena.request_caches", "slot", f"be in [0, {self.rows})", str(slot))
        rows = [slot, self.rows + slot]
        length = self.max_cache_frames if length is None else length
        if self.frame_keys is None:  # an unkeyed arena holds its frames in order
            return self.cnn[:, :, rows], self.att[:, :, rows, :, :length]  # list indexing copies
        keys = self.frame_keys[[slot, slot]]
        lengths = torch.full((2,), length, device=keys.device)
        return self.cnn[:, :, rows], keyed_to_newest_first(self.att[:, :, rows], keys, lengths, length)

    def load_request_caches(self, slot: int, cnn: torch.Tensor, att: torch.Tensor,
                            op: str = "CacheArena.load_request_caches") -> None:
        """Put caches in the upstream layout into one slot (the inverse of :meth:`request_caches`):
        cnn (n, depth, 2, 2C, 2) and att (n, depth, 2, H, L, 2D) newest first, row 0 = cond,
        row 1 = uncond, L <= ``max_cache_frames``, the arena's dtype and device (ValueError naming
        ``op`` otherwise, nothing written). The slot's frames become its keys in order (frame j =
        key j) and its ``cache_lengths`` entry L."""
        if not 0 <= slot < self.rows:
            fail(op, "slot", f"be in [0, {self.rows})", str(slot))
        want_cnn = (*self.cnn.shape[:2], 2, *self.cnn.shape[3:])
        if not isinstance(cnn, torch.Tensor) or tuple(cnn.shape) != want_cnn:
            fail(op, "cnn", f"be a tensor of shape {want_cnn}", shape_str(cnn) if isinstance(cnn, torch.Tensor)
                 else type(cnn).__name__)
        n, depth, _, heads, _, width = self.att.shape
        if not isinstance(att, torch.Tensor) or att.dim() != 6 or \
                tuple(att.shape[:4]) + (att.shape[5],) != (n, depth, 2, heads, width):
            fail(op, "att", f"be a tensor of shape ({n}, {depth}, 2, {heads}, L, {width})",
                 shape_str(att) if isinstance(att, torch.Tensor) else type(att).__name__)
        if att.shape[4] > self.max_cache_frames:
            fail(op, "att", f"hold at most max_cache_frames={self.max_cache_frames} frames", str(att.shape[4]),
                 "trim the cache first")
        for name, t in (("cnn", cnn), ("att", att)):
            if t.dtype != self.att.dtype or t.device != self.att.device:
                fail(op, name, f"be {self.att.dtype} on {self.att.device}", f"{t.dtype} on {t.device}")
        length = att.shape[4]
        self.write_slot(slot, cnn, att)
        if self.frame_keys is not None:
            self.frame_keys[slot].copy_(torch.arange(self.max_cache_frames, device=self.frame_keys.device,
                                                     dtype=self.frame_keys.dtype))
        self.cache_lengths[slot] = length

    def write_slot(self, slot: int, cnn: torch.Tensor, att: torch.Tensor) -> None:
        """Copy cnn (n, depth, 2, 2C, 2) and att (n, depth, 2, H, L, 2D) (row 0 = cond, 1 = uncond)
        into slot ``slot``'s rows and frames [0, L), bitwise, as they are laid out (no key order)."""
        length = att.shape[4]
        for row, src in ((slot, 0), (self.rows + slot, 1)):
            copy_wide_(self.att[:, :, row, :, :length], att[:, :, src])
            copy_wide_(self.cnn[:, :, row], cnn[:, :, src])

    def write_slots(self, index: torch.Tensor, cnn: torch.Tensor, att: torch.Tensor) -> None:
        """:meth:`write_slot` of the same caches into every slot of ``index`` ((k,) int64, on the
        arena's device, distinct), in one scatter per tensor and row half (the source broadcast, not copied)."""
        length = att.shape[4]
        for offset, src in ((0, 0), (self.rows, 1)):
            rows = index + offset if offset else index
            for dst, one in ((self.att[:, :, :, :, :length], att[:, :, src:src + 1]),
                             (self.cnn, cnn[:, :, src:src + 1])):
                dst, one = as_words(dst, one.expand(*one.shape[:2], rows.numel(), *one.shape[3:]))
                dst.index_copy_(2, rows, one)

    def describe(self) -> str:
        return (f"CacheArena(rows={self.rows}, att={shape_str(self.att)}, cnn={shape_str(self.cnn)}, "
                f"{self.att.dtype}, {self.nbytes() / 2**20:.1f} MiB)")


def copy_wide_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for tensors of one dtype, moved as 8-byte words where both layouts allow.

    A slot of an arena is strided (its rows sit between other slots' rows), and PyTorch's strided
    copy moves one element per thread: 2-byte elements run at a fraction of HBM rate. Viewing both
    sides as int64 (last dimension contiguous and every stride and offset a multiple of the words)
    makes the same bytes move in a quarter of the elements."""
    dst, src = as_words(dst, src)
    dst.copy_(src)


def as_words(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``dst`` and ``src`` viewed as int64 words when they share a dtype narrower than a word and
    both layouts allow it (:func:`copy_wide_`); else as they are."""
    ratio = 8 // dst.element_size()  # 0 for elements wider than a word
    if ratio > 1 and dst.dtype == src.dtype and all(_word_aligned(t, ratio) for t in (dst, src)):
        return dst.view(torch.int64), src.view(torch.int64)
    return dst, src


def _word_aligned(t: torch.Tensor, ratio: int) -> bool:
    return t.dim() > 0 and t.stride(-1) == 1 and t.shape[-1] % ratio == 0 and t.storage_offset() % ratio == 0 \
        and all(st % ratio == 0 for st in t.stride()[:-1])
