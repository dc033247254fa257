"""A ring layout of the keyed cache arena whose trim moves no frame (experiment; issue 41, lever "the trim's copy").

Today's keyed arena (``torch_cfm/models/cache.py``: ``arena_chunk_plan``) appends a chunk's keys at frames
[L_r, L_r + T_r) and, after the solve, refills the frames of the keys the trim dropped with kept frames past the
new length (``ArenaChunkPlan.moves``): ~T frames per row, Euler step and block every chunk. Here every key gets a
fixed frame for its whole life instead, so the trim is only a change of bookkeeping.

Key index g (per row): the number of keys appended before the key, counting each chunk's frames (and the prompt's)
newest first, i.e. current frame f of a chunk of T_valid frames appended at ``tau`` has g = tau + T_valid - 1 - f
(the order the in-place append already writes: frame L + T - 1 - f). In g the upstream trim (docs/design.md §3,
``cache[:P] + cache[-100:]`` of the newest-first cache) keeps exactly g < K (K = 100, kept forever) and
g >= tau - P (the newest P), so the live keys during a solve are [0, K) and one contiguous range of g. Frames:

    frame(g) = g                       for g < K
    frame(g) = K + ((g - K) mod R_r)   for g >= K,   R_r = P_r + T_nom_r

The new keys go to the frames of the keys the previous trim dropped; nothing moves. The attention's key walk
j in [0, walk_len) reads frame j + hole_len * [j >= hole_start] (one hole at most: the dead frames of a ring
whose live arc is shorter than R_r, i.e. after a chunk shorter than T_nom). In plain time order (chunk frame f at
tau + f, the prompt oldest first) the trim's kept set is not two ranges: P = 300 keeps prompt frames [200, 300)
forever, not [0, 100), and P not a multiple of T keeps the oldest frames of a chunk; appends would overwrite live keys.

Variant 2, ring with keyed fallback (``ring_fallback_chunk_plan``): a ring row takes a chunk on its ring only when
the live keys then fill frames [0, L + T_valid) (``ring_fits``: no hole); any other chunk with frames (short, longer
than T_nom) turns the row keyed for good: its kept frames are compacted into [0, L) before the solve, then it is a
row of ``arena_chunk_plan``. The attention always walks [0, L + T_valid), today's key_lengths; only fallback rows move.

    python3 bench/experiments/ring_arena.py --check    # CPU, < 1 min: both variants against the upstream trim
    python3 bench/experiments/ring_arena.py --bench    # CPU: the plan's time per call next to arena_chunk_plan's
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import torch  # noqa: E402

from torch_cfm.models.cache import (TRIM_KEEP_OLDEST, FrameMoves, arena_chunk_plan,  # noqa: E402
                                    keyed_to_newest_first, trim_attention_cache)
from torch_cfm.models.cache import _compact_moves  # noqa: E402  (the move-list compaction arena_chunk_plan uses)

KEEP = TRIM_KEEP_OLDEST  # K = 100
DEAD_KEY = torch.iinfo(torch.int32).max  # frame_keys of a dead frame: keyed_to_newest_first's clamp drops it


def ring_frames(t: torch.Tensor, prompt, t_nom, keep: int = KEEP) -> torch.Tensor:
    """Frame of the key with key index ``t`` (module docstring: chunk frames counted newest first).

    Args:
        t: integer tensor of key indices (any shape); prompt, t_nom: P_r and T_nom_r, tensors or ints
            broadcastable to ``t``.
    Returns:
        int64 tensor of ``t``'s shape: t for t < keep, else keep + (t - keep) mod (P + T_nom).
    """
    t = torch.as_tensor(t).to(torch.int64)
    ring = torch.as_tensor(prompt, device=t.device).to(torch.int64) + torch.as_tensor(t_nom, device=t.device)
    return torch.where(t < keep, t, keep + torch.remainder(t - keep, ring))


@dataclass
class RingChunkPlan:
    """One chunk on a ring arena (:func:`ring_chunk_plan`); S rows, Tmax chunk frames, F = max_frames.

    Attributes:
        append_frames: (S, Tmax) int64 frame of current (chunk) frame f, in chunk time order; -1 past T_valid.
        walk_len, hole_start, hole_len: (S,) int64 key walk over the live keys of this chunk's solve (the keys
            the previous trim kept and the new ones): walk index j < walk_len reads frame
            ``j + hole_len * (j >= hole_start)``; hole_len 0 means no hole (then hole_start = walk_len).
        old_walk_len, old_hole_start, old_hole_len: (S,) int64 the same walk over the kept keys only (the fused
            attention kernel attends the new keys from registers and must not read the frames being appended).
        new_tau: (S,) int64 keys ever appended after the chunk (tau + T_valid).
        new_lengths: (S,) int64 cache length after the trim, min(new_tau, P + K).
        frame_keys: (S, F) int32 each frame's key (position in the upstream newest-first cache after the
            chunk's trim); ``DEAD_KEY`` on frames holding no live key. None without ``with_frame_keys``.
    """

    append_frames: torch.Tensor
    walk_len: torch.Tensor
    hole_start: torch.Tensor
    hole_len: torch.Tensor
    old_walk_len: torch.Tensor
    old_hole_start: torch.Tensor
    old_hole_len: torch.Tensor
    new_tau: torch.Tensor
    new_lengths: torch.Tensor
    frame_keys: Optional[torch.Tensor]


def _check_rows(prompt: torch.Tensor, t_valid: torch.Tensor, t_nom: torch.Tensor, max_frames: int, keep: int,
                width: int) -> None:
    """ValueError naming the argument when a row's ring does not fit in max_frames or its chunk exceeds T_nom
    (or the plan's ``width`` append columns); one host sync."""
    need = keep + prompt + t_nom
    bad_fit = need > max_frames
    bad_chunk = (t_valid > t_nom) | (t_valid < 0) | (t_nom < 1) | (t_valid > width)
    if bool(bad_fit.any()):
        r = int(bad_fit.nonzero()[0, 0])
        raise ValueError(f"ring_chunk_plan: max_frames must hold keep + prompt + t_nom = {int(need[r])} frames "
                         f"(row {r}: P={int(prompt[r])}, T_nom={int(t_nom[r])}), got {max_frames}")
    if bool(bad_chunk.any()):
        r = int(bad_chunk.nonzero()[0, 0])
        raise ValueError(f"ring_chunk_plan: t_valid must be in [0, min(t_nom, t_max={width})] with t_nom >= 1, "
                         f"got t_valid={int(t_valid[r])}, t_nom={int(t_nom[r])} (row {r})")


def _key_walk(lo: torch.Tensor, hi: torch.Tensor, ring: torch.Tensor, keep: int):
    """Walk over the keys g < min(keep, hi) and g in [max(lo, keep), hi): (walk_len, hole_start, hole_len),
    (S,) int64. The ring part is one arc of the ring; its dead complement is the hole (inside the walk
    when the arc wraps past the ring's end, at the ring's start otherwise; a dead tail needs no skip)."""
    start = torch.maximum(lo, torch.full_like(lo, keep))
    n_ring = (hi - start).clamp(min=0)
    arc = torch.remainder(start - keep, ring)  # ring slot of the arc's first key
    wraps = arc + n_ring > ring
    hole_len = torch.where(wraps, ring - n_ring, arc)
    hole_len = torch.where(n_ring > 0, hole_len, 0)
    walk_len = hi.clamp(max=keep).clamp(min=0) + n_ring
    hole_start = torch.where(hole_len > 0, torch.where(wraps, keep + arc + n_ring - ring, keep), walk_len)
    return walk_len, hole_start, hole_len


def _frame_keys(tau: torch.Tensor, lengths: torch.Tensor, prompt: torch.Tensor, ring: torch.Tensor,
                max_frames: int, keep: int) -> torch.Tensor:
    """(S, max_frames) int32: the newest-first key (after the trim) of each frame, DEAD_KEY where none.
    Frame j < keep holds g = j; ring frame j holds the newest g < tau with g = j (mod ring)."""
    j = torch.arange(max_frames, device=tau.device)[None]
    tau, lengths, prompt, ring = tau[:, None], lengths[:, None], prompt[:, None], ring[:, None]
    in_ring = (j >= keep) & (j < keep + ring)
    g = torch.where(in_ring, tau - 1 - torch.remainder(tau - 1 - j, ring), j)
    newest = g >= tau - prompt  # the newest-P part (keys [0, P)), else the oldest-K part (keys [P, P + K))
    live = torch.where(in_ring, (g >= keep) & newest, (j < keep) & (j < tau))
    key = torch.where(newest, tau - 1 - g, lengths - 1 - g)
    return torch.where(live, key, DEAD_KEY).to(torch.int32)


def ring_chunk_plan(tau: torch.Tensor, prompt: torch.Tensor, t_valid: torch.Tensor, t_nom: torch.Tensor,
                    max_frames: int, keep: int = KEEP, *, t_max: Optional[int] = None,
                    validate: bool = True, with_frame_keys: bool = True) -> RingChunkPlan:
    """Frame plan of one chunk of T_valid[r] <= T_nom[r] frames per row on a ring arena (no frame moves).

    Args:
        tau, prompt, t_valid, t_nom: (S,) integer tensors on one device: keys appended so far (the prompt's P
            included; tau = P after the prompt solve), P_r, this chunk's frames, the row's nominal chunk frames.
        max_frames: frames of the arena (python int); every row needs keep + P_r + T_nom_r of them.
        keep: K, the oldest keys the trim keeps.
        t_max: width of ``append_frames`` (the arena's max chunk frames); None reads ``t_nom.max()`` (a sync).
        validate: check the rows (:func:`_check_rows`, one host sync); False for a captured hot path.
        with_frame_keys: False leaves ``frame_keys`` None (a function of new_tau, P and T_nom alone: only a
            conversion to the upstream layout needs it, not the solve).
    Returns:
        :class:`RingChunkPlan`, computed without a host sync or a loop over rows (besides the two above).
    """
    tau, prompt, t_valid, t_nom = (x.to(torch.int64) for x in (tau, prompt, t_valid, t_nom))
    width = int(t_nom.max()) if t_max is None else t_max
    if validate:
        _check_rows(prompt, t_valid, t_nom, max_frames, keep, width)
    ring = prompt + t_nom
    hi = tau + t_valid
    f = torch.arange(width, device=tau.device)[None]
    g_new = hi[:, None] - 1 - f  # current frame f is key index tau + T_valid - 1 - f
    append = torch.where(f < t_valid[:, None], ring_frames(g_new, prompt[:, None], t_nom[:, None], keep), -1)
    lo = (tau - prompt).clamp(min=0)  # oldest key index of the newest-P window the previous trim kept
    walk = _key_walk(lo, hi, ring, keep)
    old_walk = _key_walk(lo, tau, ring, keep)
    lengths = torch.minimum(hi, prompt + keep)
    keys = _frame_keys(hi, lengths, prompt, ring, max_frames, keep) if with_frame_keys else None
    return RingChunkPlan(append, *walk, *old_walk, new_tau=hi, new_lengths=lengths, frame_keys=keys)


def walk_frames(walk_len: int, hole_start: int, hole_len: int) -> torch.Tensor:
    """(walk_len,) int64 frames one row's key walk reads: j + hole_len * (j >= hole_start)."""
    j = torch.arange(walk_len)
    return j + hole_len * (j >= hole_start).to(torch.int64)


# ------------------------------------------------------------------------- variant 2: ring with keyed fallback


@dataclass
class FallbackChunkPlan:
    """One chunk on a ring arena whose rows fall back to the keyed layout (:func:`ring_fallback_chunk_plan`);
    S rows, Tmax = ``t_max`` chunk frames, F = max_frames. Every row's solve walks the frames [0, walk_len).

    Attributes:
        keyed: (S,) bool mode after the chunk (False = ring, True = keyed, for good).
        switched: (S,) bool rows that fell back with this chunk.
        pre_moves: :class:`FrameMoves` before the solve: a switching row's kept frames past its length L fill
            its dead frames below L (at most those dead frames); count 0 on every other row.
        append_frames: (S, Tmax) int64 frame of current (chunk) frame f; -1 past T_valid. Ring rows
            ``ring_frames(tau + T_valid - 1 - f)``, keyed rows L + T_valid - 1 - f (today's in-place append).
        walk_len: (S,) int64 L + T_valid: the live keys of the solve fill [0, walk_len) (today's key_lengths).
        post_moves: :class:`FrameMoves` after the solve: ``arena_chunk_plan``'s trim moves on keyed rows, count 0
            on ring rows.
        new_tau: (S,) int64 tau + T_valid; new_lengths: (S,) int64 min(new_tau, P + K).
        frame_keys: (S, F) int32 newest-first key (after the trim) of each frame, ``DEAD_KEY`` on dead frames:
            the next call's ``frame_keys`` and ``keyed_to_newest_first``'s map.
    """

    keyed: torch.Tensor
    switched: torch.Tensor
    pre_moves: FrameMoves
    append_frames: torch.Tensor
    walk_len: torch.Tensor
    post_moves: FrameMoves
    new_tau: torch.Tensor
    new_lengths: torch.Tensor
    frame_keys: torch.Tensor


def ring_fits(tau: torch.Tensor, prompt: torch.Tensor, t_valid: torch.Tensor, t_nom: torch.Tensor,
              keep: int = KEEP) -> torch.Tensor:
    """(S,) bool: a ring row's chunk leaves its live keys (kept + new) on one frame range [0, L + T_valid).

    The live keys are g < min(K, hi) (frames [0, min(K, hi))) and the arc g in [start, hi) with hi = tau + T_valid,
    start = max(tau - P, K): n = hi - start keys on ring slots from a = (start - K) mod R on. They fill
    [K, K + n) exactly when n <= R and (a = 0 or n = R) (n = 0, i.e. hi <= K, fits too). While tau - P <= K (the
    ring not yet full) a = 0: any chunk with tau + T_valid <= K + R fits (longer than T_nom included); after it
    n = P + T_valid, so T_valid = T_nom, or any T_valid <= T_nom when the kept arc happens to start at slot 0."""
    ring = prompt + t_nom
    hi = tau + t_valid
    start = torch.clamp((tau - prompt).clamp(min=0), min=keep)
    n = (hi - start).clamp(min=0)
    arc = torch.remainder(start - keep, ring)
    return (n == 0) | ((n <= ring) & ((arc == 0) | (n == ring)))


def _compaction(live: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor):
    """Per row of ``rows``: each dead frame below lengths[r] takes a live frame at or past it (k-th dead frame <-
    k-th such live frame, in frame order; equal counts when a row holds exactly lengths[r] live frames).
    Returns (FrameMoves, source (S, F) int64: the frame each frame's content comes from)."""
    width = live.shape[1]
    j = torch.arange(width, device=live.device)[None]
    below = j < lengths[:, None]
    hole = rows[:, None] & ~live & below
    past = rows[:, None] & live & ~below
    rank = torch.where(past, past.cumsum(1) - 1, width)
    by_rank = torch.full((live.shape[0], width + 1), width - 1, device=live.device, dtype=torch.int64)
    by_rank.scatter_(1, rank, j.expand_as(rank))
    source = torch.where(hole, by_rank.gather(1, (hole.cumsum(1) - 1).clamp(min=0)), j)
    return _compact_moves(hole, source), source


def _check_fallback_rows(prompt: torch.Tensor, t_valid: torch.Tensor, t_nom: torch.Tensor, frame_keys: torch.Tensor,
                         max_frames: int, keep: int, width: int) -> None:
    """ValueError naming the argument when a row's ring or keyed extent does not fit max_frames, a chunk is
    negative or wider than t_max, or frame_keys is not (S, max_frames); one host sync."""
    if tuple(frame_keys.shape) != (prompt.shape[0], max_frames):
        raise ValueError(f"ring_fallback_chunk_plan: frame_keys must be (S={prompt.shape[0]}, "
                         f"max_frames={max_frames}), got {tuple(frame_keys.shape)}")
    need = keep + prompt + torch.clamp(t_nom, min=width)
    bad_fit = need > max_frames
    bad_chunk = (t_valid < 0) | (t_valid > width) | (t_nom < 1)
    if bool(bad_fit.any()):
        r = int(bad_fit.nonzero()[0, 0])
        raise ValueError(f"ring_fallback_chunk_plan: max_frames must hold keep + prompt + max(t_nom, t_max) = "
                         f"{int(need[r])} frames (row {r}: P={int(prompt[r])}, T_nom={int(t_nom[r])}, "
                         f"t_max={width}), got {max_frames}")
    if bool(bad_chunk.any()):
        r = int(bad_chunk.nonzero()[0, 0])
        raise ValueError(f"ring_fallback_chunk_plan: t_valid must be in [0, t_max={width}] with t_nom >= 1, "
                         f"got t_valid={int(t_valid[r])}, t_nom={int(t_nom[r])} (row {r})")


def ring_fallback_chunk_plan(keyed: torch.Tensor, tau: torch.Tensor, frame_keys: torch.Tensor,
                             prompt: torch.Tensor, t_valid: torch.Tensor, t_nom: torch.Tensor, max_frames: int,
                             keep: int = KEEP, *, t_max: int, validate: bool = True) -> FallbackChunkPlan:
    """Frame plan of one chunk on a ring arena with a per-row keyed fallback: the walk never has a hole.

    A ring row whose chunk fits (:func:`ring_fits`) appends at its ring frames and moves nothing. A ring row
    whose chunk does not (T_valid > 0) falls back to keyed for good: its kept frames are compacted into [0, L)
    before the solve (``pre_moves``), then it is a row of ``arena_chunk_plan`` (append at [L, L + T), the trim's
    moves after the solve), as keyed rows are. An idle row (T_valid = 0) changes nothing and keeps its mode
    (no query reads its walk).

    Args:
        keyed: (S,) bool mode before the chunk (all False after the prompts).
        tau, prompt, t_valid, t_nom: (S,) integer tensors on one device: keys appended so far (tau = P after the
            prompt), P_r, this chunk's frames (<= t_max), the row's nominal chunk frames (R_r = P_r + T_nom_r).
        frame_keys: (S, max_frames) integer newest-first key of each frame of the keyed rows, live iff below
            L = min(tau, P + K) (``DEAD_KEY`` or any key >= L on dead frames): the previous call's
            ``frame_keys``. Ring rows' entries are not read (their keys follow from tau, P and T_nom).
        max_frames: F, frames of the arena; every row needs K + P_r + max(T_nom_r, t_max) <= F.
        t_max: width of ``append_frames`` (the arena's max chunk frames, a python int).
        validate: check the rows (:func:`_check_fallback_rows`, one host sync); False for a captured hot path.
    Returns:
        :class:`FallbackChunkPlan`, computed without a host sync or a loop over rows (besides ``validate``).
    """
    tau, prompt, t_valid, t_nom = (x.to(torch.int64) for x in (tau, prompt, t_valid, t_nom))
    keyed = keyed.to(torch.bool)
    if validate:
        _check_fallback_rows(prompt, t_valid, t_nom, frame_keys, max_frames, keep, t_max)
    dev = tau.device
    ring = prompt + t_nom
    lengths = torch.minimum(tau, prompt + keep)
    hi = tau + t_valid
    new_lengths = torch.minimum(hi, prompt + keep)
    switched = ~keyed & (t_valid > 0) & ~ring_fits(tau, prompt, t_valid, t_nom, keep)
    keyed_after = keyed | switched
    keys = torch.where(keyed[:, None], frame_keys.to(torch.int64),
                       _frame_keys(tau, lengths, prompt, ring, max_frames, keep).to(torch.int64))
    pre_moves, source = _compaction(keys < lengths[:, None], lengths, switched)
    keys = torch.where(switched[:, None], keys.gather(1, source), keys)
    plan = arena_chunk_plan(torch.where(keyed_after[:, None], keys, 0), torch.where(keyed_after, lengths, 0),
                            torch.where(keyed_after, t_valid, 0), prompt, max_frames - t_max, t_max, keep)
    f = torch.arange(t_max, device=dev)[None]
    ring_pos = ring_frames(hi[:, None] - 1 - f, prompt[:, None], t_nom[:, None], keep)
    keyed_pos = lengths[:, None] + t_valid[:, None] - 1 - f
    append = torch.where(f < t_valid[:, None], torch.where(keyed_after[:, None], keyed_pos, ring_pos), -1)
    j = torch.arange(max_frames, device=dev)[None]
    keyed_keys = torch.where(j < new_lengths[:, None], plan.new_frame_keys.to(torch.int64), DEAD_KEY)
    ring_keys = _frame_keys(hi, new_lengths, prompt, ring, max_frames, keep).to(torch.int64)
    post = plan.moves
    return FallbackChunkPlan(
        keyed=keyed_after, switched=switched, pre_moves=pre_moves, append_frames=append, walk_len=lengths + t_valid,
        post_moves=FrameMoves(post.src, post.dst, torch.where(keyed_after, post.count, 0)),
        new_tau=hi, new_lengths=new_lengths,
        frame_keys=torch.where(keyed_after[:, None], keyed_keys, ring_keys).to(torch.int32))


# ----------------------------------------------------------------------------------------------- the check

HEADS, HEAD_DIM, QUERIES = 2, 8, 3
MAX_PROMPT = 400


@dataclass
class Stream:
    """One simulated request: prompt frames, nominal chunk frames, each chunk's frames, its class."""

    prompt: int
    t_nom: int
    chunks: list
    kind: str


def make_streams(g: torch.Generator) -> list:
    """Random streams: 'regular' (every chunk T_nom but a shorter last one, 0 and 1 frames included),
    'long' (T_nom 1 and 25 with enough chunks to trim and wrap), 'mixed' (any chunk <= T_nom, idle
    chunks included, and stepaudio2's P = 300 with T_nom = 56: 50-frame chunks and a 56-frame last one)."""
    def rint(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    special = [0, 1, 49, 50, 51, 99, 100, 101, 150, 175, 300, 399, 400]
    streams = []
    for i in range(520):
        prompt = special[i % len(special)] if i < 4 * len(special) else rint(0, MAX_PROMPT)
        t_nom = (50, 40, 25, 1)[i % 4]
        last = [0, 1, t_nom, rint(0, t_nom), rint(0, t_nom)][rint(0, 4)]
        streams.append(Stream(prompt, t_nom, [t_nom] * (rint(1, 20) - 1) + [min(last, t_nom)], "regular"))
    for i in range(24):
        prompt, t_nom = [0, 1, 30, 99, 100, 300, rint(0, MAX_PROMPT)][i % 7], (1, 25)[i % 2]
        n = rint(1, 60) + (2 * (prompt + KEEP) if t_nom == 1 else 20)
        streams.append(Stream(prompt, t_nom, [t_nom] * (n - 1) + [rint(0, t_nom)], "long"))
    for i in range(48):
        prompt, t_nom = (300, 56) if i < 8 else (rint(0, MAX_PROMPT), (50, 40, 25, 3)[i % 4])
        if i < 8:
            chunks = [50] * rint(1, 19) + [56]
        else:
            chunks = [[0, 1, t_nom, rint(0, t_nom)][rint(0, 3)] for _ in range(rint(1, 30))]
        streams.append(Stream(prompt, t_nom, chunks, "mixed"))
    return streams


def attend(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Softmax attention in float64: q (H, Q, D), keys (H, N, 2D) with K | V; zeros when N = 0."""
    if keys.shape[1] == 0:
        return torch.zeros_like(q)
    k, v = keys[..., :q.shape[-1]], keys[..., q.shape[-1]:]
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v


@dataclass
class Tally:
    """What the check counts, per stream class."""

    chunks: int = 0  # row-chunks simulated (a stream's chunk, idle 0-frame chunks included)
    trims: int = 0  # row-chunks whose trim dropped keys
    holes: int = 0  # live-key walks needing the skip (hole_len > 0)
    wrapping: int = 0  # ... whose hole lies inside an arc wrapped past the ring's end
    old_holes: int = 0  # kept-key walks (the fused kernel's) needing the skip
    keyed_moves: int = 0  # frames arena_chunk_plan's moves copy for the same chunks
    max_err: float = 0.0  # |ring attention - upstream attention|, max


def _init_streams(batch, streams: list, g: torch.Generator, frames) -> int:
    """The state both simulations share: the streams' prompts, T_nom and T_max, one random float64 (H, 2D)
    key per time index, and a NaN arena of ``frames`` frames (None: K + P_max + T_max). Returns the rows."""
    batch.streams, batch.g = streams, g
    rows = len(streams)
    batch.prompt = torch.tensor([s.prompt for s in streams])
    batch.t_nom = torch.tensor([s.t_nom for s in streams])
    batch.t_max = max(max(s.t_nom for s in streams), max(max(s.chunks) for s in streams))
    batch.frames = KEEP + MAX_PROMPT + batch.t_max if frames is None else frames
    batch.kv = [torch.randn(s.prompt + sum(s.chunks), HEADS, 2 * HEAD_DIM, generator=g, dtype=torch.float64)
                for s in streams]
    batch.arena = torch.full((rows, HEADS, batch.frames, 2 * HEAD_DIM), float("nan"), dtype=torch.float64)
    return rows


class RingBatch:
    """S simulated streams side by side: the upstream newest-first caches (``trim_attention_cache``), the ring
    arena driven by :func:`ring_chunk_plan`, and today's keyed arena's frame plan (``arena_chunk_plan``) on the
    same lengths. Every key is a random float64 (H, 2D) vector named by its time index."""

    def __init__(self, streams: list, g: torch.Generator) -> None:
        rows = _init_streams(self, streams, g, KEEP + MAX_PROMPT + max(s.t_nom for s in streams))
        self.frame_of = [torch.full((kv.shape[0],), -1, dtype=torch.int64) for kv in self.kv]
        self.cache, self.times = [], []
        for r, s in enumerate(streams):  # the prompt solve: time t has key index P - 1 - t (frame P - 1 - t)
            t = torch.arange(s.prompt)
            frames = ring_frames(s.prompt - 1 - t, s.prompt, s.t_nom)
            self.arena[r][:, frames] = self.kv[r][t].transpose(0, 1)
            self.frame_of[r][t] = frames
            self.cache.append(self.kv[r][t].transpose(0, 1))  # upstream: (H, P, 2D), the prompt in time order
            self.times.append(t)
        self.tau = self.prompt.clone()
        keyed = arena_chunk_plan(torch.arange(MAX_PROMPT + KEEP, dtype=torch.int32).repeat(rows, 1),
                                 torch.zeros(rows, dtype=torch.int64), self.prompt, self.prompt, 0, MAX_PROMPT)
        self.keyed_keys = torch.arange(MAX_PROMPT + KEEP, dtype=torch.int32).repeat(rows, 1)
        self.keyed_keys[:, :keyed.new_frame_keys.shape[1]] = keyed.new_frame_keys
        self.keyed_len = keyed.new_lengths

    def run(self, tallies: dict) -> None:
        """Every chunk of every stream (rows past their last chunk idle), checking a-e."""
        for c in range(max(len(s.chunks) for s in self.streams)):
            active = [r for r, s in enumerate(self.streams) if c < len(s.chunks)]
            t_valid = torch.tensor([s.chunks[c] if c < len(s.chunks) else 0 for s in self.streams])
            plan = ring_chunk_plan(self.tau, self.prompt, t_valid, self.t_nom, self.frames, t_max=self.t_max)
            keyed = arena_chunk_plan(self.keyed_keys, self.keyed_len, t_valid, self.prompt, MAX_PROMPT + KEEP,
                                     self.t_max)
            assert torch.equal(keyed.new_lengths, plan.new_lengths), c
            for r in active:
                tally = tallies[self.streams[r].kind]
                tally.keyed_moves += int(keyed.moves.count[r])
                self.row_chunk(r, plan, int(t_valid[r]), tally)
            self.check_newest_first(plan, active)
            self.tau = plan.new_tau
            self.keyed_keys[:, :keyed.new_frame_keys.shape[1]] = keyed.new_frame_keys
            self.keyed_len = keyed.new_lengths

    def row_chunk(self, r: int, plan: RingChunkPlan, t_valid: int, tally: Tally) -> None:
        """Checks a-c for one row's chunk, then the upstream append and trim."""
        s, tau, row = self.streams[r], int(self.tau[r]), self.arena[r]
        new_times = torch.arange(tau, tau + t_valid)
        old_times = self.times[r]
        old_frames, app = self.frame_of[r][old_times], plan.append_frames[r, :t_valid]
        live = torch.cat([app, old_frames])  # a. distinct, inside the row's K + R frames
        assert (live >= 0).all() and (live < KEEP + s.prompt + s.t_nom).all(), (s, tau)
        assert live.unique().numel() == live.numel(), (s, tau)
        row[:, app] = self.kv[r][new_times].transpose(0, 1)
        self.frame_of[r][new_times] = app
        live_times = torch.cat([new_times, old_times])
        assert torch.equal(row[:, live], self.kv[r][live_times].transpose(0, 1)), (s, tau)  # nothing overwritten
        walk = walk_frames(int(plan.walk_len[r]), int(plan.hole_start[r]), int(plan.hole_len[r]))
        old_walk = walk_frames(int(plan.old_walk_len[r]), int(plan.old_hole_start[r]), int(plan.old_hole_len[r]))
        assert torch.equal(walk.sort().values, live.sort().values), (s, tau)  # b. each live frame once
        assert torch.equal(old_walk.sort().values, old_frames.sort().values), (s, tau)
        new_cache = torch.cat([self.kv[r][new_times].transpose(0, 1), self.cache[r]], dim=1)  # upstream append
        q = torch.randn(HEADS, QUERIES, HEAD_DIM, generator=self.g, dtype=torch.float64)
        err = float((attend(q, new_cache) - attend(q, row[:, walk])).abs().max()) if live.numel() else 0.0
        assert err <= 1e-12, (s, tau, err)  # c. the oracle
        self.cache[r] = trim_attention_cache(new_cache, s.prompt)
        self.times[r] = trim_attention_cache(torch.cat([new_times, old_times])[:, None], s.prompt)[:, 0]
        tally.chunks += 1
        tally.trims += int(new_cache.shape[1] > self.cache[r].shape[1])
        tally.holes += int(plan.hole_len[r] > 0)
        tally.wrapping += int(plan.hole_len[r] > 0 and plan.hole_start[r] > KEEP)
        tally.old_holes += int(plan.old_hole_len[r] > 0)
        tally.max_err = max(tally.max_err, err)

    def check_newest_first(self, plan: RingChunkPlan, active: list) -> None:
        """d. keyed_to_newest_first of the ring arena with the plan's frame keys = the upstream trimmed cache."""
        rows = self.arena.shape[0]
        out = keyed_to_newest_first(self.arena, plan.frame_keys, torch.full((rows,), self.frames))
        for r in active:
            length = int(plan.new_lengths[r])
            keys = plan.frame_keys[r]
            assert torch.equal(keys[keys != DEAD_KEY].sort().values, torch.arange(length, dtype=torch.int32))
            assert self.cache[r].shape[1] == length and torch.equal(out[r, :, :length], self.cache[r]), r


def make_sa2_streams(g: torch.Generator, count: int = 64) -> list:
    """'stepaudio2' streams for the fallback variant: P = 300, T_nom = 50, 1-30 chunks of 50 frames, then a
    last one of 56 frames (half the streams) or of 1-49."""
    def rint(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    return [Stream(300, 50, [50] * rint(1, 30) + [56 if i % 2 == 0 else rint(1, 49)], "stepaudio2")
            for i in range(count)]


@dataclass
class FallbackTally:
    """What the fallback variant's check counts, per stream class."""

    chunks: int = 0  # row-chunks (idle 0-frame chunks included)
    ring_chunks: int = 0  # row-chunks with frames solved in ring mode
    fallbacks: int = 0  # rows that switched to keyed
    pre_moved: int = 0  # frames pre_moves copies
    post_moved: int = 0  # frames post_moves copies
    early_moved: int = 0  # ... of both, in chunks before a stream's last one
    early_fallbacks: int = 0  # fallbacks in chunks before a stream's last one
    keyed_moves: int = 0  # frames today's arena_chunk_plan's moves copy for the same chunks
    kept_holes: int = 0  # ring row-chunks whose kept keys are not frames [0, L) (the fused APPEND kernel's walk)
    idle_holes: int = 0  # idle ring row-chunks (no query) whose kept keys are not frames [0, L)
    max_err: float = 0.0


class FallbackBatch:
    """S simulated streams on a ring arena with keyed fallback (:func:`ring_fallback_chunk_plan`), next to the
    upstream newest-first caches and today's keyed arena's plan on the same streams (:class:`RingBatch`'s keys).
    ``time_at[r, j]``: the time index of the key frame j holds (-1: none); ``frame_of[r][t]``: key t's frame."""

    def __init__(self, streams: list, g: torch.Generator) -> None:
        rows = _init_streams(self, streams, g, None)  # K + P + T_max frames
        self.time_at = torch.full((rows, self.frames), -1, dtype=torch.int64)
        self.frame_of = [torch.full((kv.shape[0],), -1, dtype=torch.int64) for kv in self.kv]
        self.cache, self.times = [], []
        for r, s in enumerate(streams):  # the prompt solve: time t at frame P - 1 - t (= its key, both layouts)
            t = torch.arange(s.prompt)
            self.arena[r][:, s.prompt - 1 - t] = self.kv[r][t].transpose(0, 1)
            self.time_at[r, s.prompt - 1 - t] = t
            self.frame_of[r][t] = s.prompt - 1 - t
            self.cache.append(self.kv[r][t].transpose(0, 1))
            self.times.append(t)
        self.tau = self.prompt.clone()
        self.keyed = torch.zeros(rows, dtype=torch.bool)
        j = torch.arange(self.frames)[None]  # after the prompt's in-place append frame j holds key P - 1 - j
        self.frame_keys = torch.where(j < self.prompt[:, None], self.prompt[:, None] - 1 - j, j).to(torch.int32)
        self.today_keys = self.frame_keys.clone()
        self.today_len = self.prompt.clone()

    def move(self, moves: FrameMoves, rows: list) -> None:
        """Apply a move list to the arena and the frame maps (sources and destinations are disjoint)."""
        for r in rows:
            c = int(moves.count[r])
            if c:
                src, dst = moves.src[r, :c], moves.dst[r, :c]
                assert not bool((src[:, None] == dst[None]).any()), r
                self.arena[r][:, dst] = self.arena[r][:, src]
                t = self.time_at[r, src]
                assert (t >= 0).all(), r
                self.time_at[r, dst], self.time_at[r, src] = t, -1
                self.frame_of[r][t] = dst

    def run(self, tallies: dict) -> None:
        """Every chunk of every stream (rows past their last chunk idle), checking a-d."""
        for c in range(max(len(s.chunks) for s in self.streams)):
            active = [r for r, s in enumerate(self.streams) if c < len(s.chunks)]
            t_valid = torch.tensor([s.chunks[c] if c < len(s.chunks) else 0 for s in self.streams])
            plan = ring_fallback_chunk_plan(self.keyed, self.tau, self.frame_keys, self.prompt, t_valid, self.t_nom,
                                            self.frames, t_max=self.t_max)
            today = arena_chunk_plan(self.today_keys, self.today_len, t_valid, self.prompt, self.frames - self.t_max,
                                     self.t_max)
            lengths = torch.minimum(self.tau, self.prompt + KEEP)
            assert torch.equal(today.new_lengths, plan.new_lengths), c
            assert torch.equal(plan.walk_len, lengths + t_valid), c  # today's key_lengths = valid + cached
            assert not bool((self.keyed & ~plan.keyed).any()), c  # keyed for good
            self.move(plan.pre_moves, active)
            for r in active:
                s = self.streams[r]
                tally = tallies[s.kind]
                tally.keyed_moves += int(today.moves.count[r])
                moved = int(plan.pre_moves.count[r]) + int(plan.post_moves.count[r])
                tally.pre_moved += int(plan.pre_moves.count[r])
                tally.post_moved += int(plan.post_moves.count[r])
                tally.early_moved += moved if c < len(s.chunks) - 1 else 0
                tally.fallbacks += int(plan.switched[r])
                tally.early_fallbacks += int(plan.switched[r]) if c < len(s.chunks) - 1 else 0
                self.row_chunk(r, plan, int(t_valid[r]), int(lengths[r]), tally)
            self.move(plan.post_moves, active)
            self.check_newest_first(plan, active)
            self.keyed, self.tau, self.frame_keys = plan.keyed, plan.new_tau, plan.frame_keys
            self.today_keys, self.today_len = today.new_frame_keys, today.new_lengths

    def row_chunk(self, r: int, plan: FallbackChunkPlan, t_valid: int, length: int, tally: FallbackTally) -> None:
        """Checks a-c for one row's chunk (after the pre-solve moves), then the upstream append and trim."""
        s, tau, row = self.streams[r], int(self.tau[r]), self.arena[r]
        keyed = bool(plan.keyed[r])
        new_times, old_times = torch.arange(tau, tau + t_valid), self.times[r]
        old_frames, app = self.frame_of[r][old_times], plan.append_frames[r, :t_valid]
        assert (plan.append_frames[r, t_valid:] == -1).all()
        live = torch.cat([app, old_frames])  # a. distinct, inside the arena (and the ring rows' K + R frames)
        bound = KEEP + s.prompt + (self.t_max if keyed else s.t_nom)
        assert (live >= 0).all() and (live < min(bound, self.frames)).all(), (s, tau)
        assert live.unique().numel() == live.numel(), (s, tau)
        assert torch.equal(self.time_at[r, old_frames], old_times), (s, tau)  # the kept keys where the maps say
        row[:, app] = self.kv[r][new_times].transpose(0, 1)
        self.time_at[r, app] = new_times
        self.frame_of[r][new_times] = app
        live_times = torch.cat([new_times, old_times])
        assert torch.equal(row[:, live], self.kv[r][live_times].transpose(0, 1)), (s, tau)  # nothing overwritten
        walk_len = int(plan.walk_len[r])
        kept_prefix = torch.equal(old_frames.sort().values, torch.arange(length))
        new_cache = torch.cat([self.kv[r][new_times].transpose(0, 1), self.cache[r]], dim=1)  # upstream append
        if t_valid == 0 and not kept_prefix:  # an idle ring row whose kept arc wraps: no query reads its walk
            assert not keyed, (s, tau)
            tally.idle_holes += 1
        else:
            assert torch.equal(live.sort().values, torch.arange(walk_len)), (s, tau)  # b. no hole
            q = torch.randn(HEADS, QUERIES, HEAD_DIM, generator=self.g, dtype=torch.float64)
            err = float((attend(q, new_cache) - attend(q, row[:, :walk_len])).abs().max()) if walk_len else 0.0
            assert err <= 1e-12, (s, tau, err)  # c. the oracle
            tally.max_err = max(tally.max_err, err)
        if t_valid:
            assert kept_prefix or not keyed, (s, tau)  # keyed rows: kept [0, L), new [L, L + T)
            tally.kept_holes += int(not kept_prefix)
            tally.ring_chunks += int(not keyed)
        self.cache[r] = trim_attention_cache(new_cache, s.prompt)
        self.times[r] = trim_attention_cache(live_times[:, None], s.prompt)[:, 0]
        tally.chunks += 1

    def check_newest_first(self, plan: FallbackChunkPlan, active: list) -> None:
        """d. keyed_to_newest_first of the arena (after the post-solve moves) with the plan's frame keys =
        the upstream trimmed cache; the frame keys name exactly the live frames."""
        rows = self.arena.shape[0]
        out = keyed_to_newest_first(self.arena, plan.frame_keys, torch.full((rows,), self.frames))
        for r in active:
            length = int(plan.new_lengths[r])
            keys = plan.frame_keys[r]
            live = keys != DEAD_KEY
            assert torch.equal(keys[live].sort().values, torch.arange(length, dtype=torch.int32)), r
            assert torch.equal(self.frame_of[r][self.times[r]].sort().values, live.nonzero()[:, 0]), r
            assert self.cache[r].shape[1] == length and torch.equal(out[r, :, :length], self.cache[r]), r


def check_errors() -> None:
    """The plan's ValueErrors: a ring past max_frames names max_frames, a chunk past T_nom names t_valid."""
    one = torch.tensor([1])
    for args, name in (((torch.tensor([300]), torch.tensor([300]), one, torch.tensor([50]), 449), "max_frames"),
                       ((torch.tensor([300]), torch.tensor([300]), torch.tensor([51]), torch.tensor([50]), 450),
                        "t_valid")):
        try:
            ring_chunk_plan(*args)
        except ValueError as e:
            assert name in str(e), e
        else:
            raise AssertionError(f"no ValueError naming {name}")
    none, keys = torch.tensor([False]), torch.arange(456, dtype=torch.int32)[None]
    for args, name in (((torch.tensor([300]), torch.tensor([56]), torch.tensor([50]), 455), "max_frames"),
                       ((torch.tensor([300]), torch.tensor([57]), torch.tensor([50]), 456), "t_valid")):
        try:
            ring_fallback_chunk_plan(none, args[0], keys[:, :args[3]], *args, t_max=56)
        except ValueError as e:
            assert name in str(e), e
        else:
            raise AssertionError(f"no ValueError naming {name}")


def _run_batches(streams: list, tallies: dict, batch_cls, g: torch.Generator) -> None:
    """Every stream of each class in ``tallies`` through ``batch_cls``, 128 streams a batch."""
    for kind in tallies:
        group = [s for s in streams if s.kind == kind]
        for i in range(0, len(group), 128):
            batch_cls(group[i:i + 128], g).run(tallies)


def _simulate(title: str, streams: list, kinds: tuple, tally_cls, batch_cls, g: torch.Generator, claims: tuple,
              cols: tuple) -> dict:
    """Run every stream of ``kinds`` through ``batch_cls``; print the title, what was checked and the table's
    header. Returns {kind: tally}."""
    tallies = {kind: tally_cls() for kind in kinds}
    start = time.perf_counter()
    _run_batches(streams, tallies, batch_cls, g)
    print(f"{title}: {len(streams)} streams, {time.perf_counter() - start:.1f} s; a-d hold for every chunk of every stream")
    for claim in claims:
        print("  " + claim)
    print("  " + " ".join(f"{c:>{max(len(c), 7)}}" for c in cols))
    return tallies


def check(seed: int = 0) -> None:
    """Simulate the streams of :func:`make_streams` in batches and print what a-e found."""
    check_errors()
    g = torch.Generator().manual_seed(seed)
    streams = make_streams(g)
    cols = ("class", "streams", "row-chunks", "trims", "holes", "wrapping", "old-walk holes", "moved: ring",
            "keyed", "keyed/trim", "max err")
    tallies = _simulate("ring arena check", streams, ("regular", "long", "mixed"), Tally, RingBatch, g, (
        "a. live keys' frames distinct, inside [0, K + R_r); appends never overwrite a live key",
        "b. key walk (walk_len, hole_start, hole_len) = the live frames, each once (and the kept-key walk)",
        "c. ring attention = upstream newest-first + trim_attention_cache, float64, tol 1e-12",
        "d. keyed_to_newest_first(ring arena, frame_keys) = upstream trimmed cache, exactly"), cols)
    total = Tally()
    for kind, t in tallies.items():
        vals = (kind, sum(s.kind == kind for s in streams), t.chunks, t.trims, t.holes, t.wrapping, t.old_holes, 0,
                t.keyed_moves, f"{t.keyed_moves / max(t.trims, 1):.1f}", f"{t.max_err:.1e}")
        print("  " + " ".join(f"{v:>{max(len(c), 7)}}" for c, v in zip(cols, vals)))
        for field in ("chunks", "trims", "holes", "wrapping", "keyed_moves"):
            setattr(total, field, getattr(total, field) + getattr(t, field))
    print(f"  e. frames moved: ring 0, keyed arena {total.keyed_moves} ({total.keyed_moves / max(total.trims, 1):.1f} "
          f"per trimmed row-chunk); holes {total.holes} (wrapping {total.wrapping}) in {total.chunks} row-chunks")
    check_fallback(streams + make_sa2_streams(torch.Generator().manual_seed(seed + 1)), seed)


def check_fallback(streams: list, seed: int) -> None:
    """Variant 2 (ring with keyed fallback) over the same streams plus the stepaudio2 class; prints the counts."""
    g = torch.Generator().manual_seed(seed + 2)
    cols = ("class", "streams", "row-chunks", "ring solves", "fallbacks", "moved: pre", "post", "before last",
            "today", "kept-walk holes", "idle holes", "max err")
    tallies = _simulate("ring + keyed fallback check", streams, ("regular", "long", "mixed", "stepaudio2"),
                        FallbackTally, FallbackBatch, g, (
        "a. live keys' frames distinct, inside [0, K + P + T_max) (ring rows [0, K + R)); the maps agree",
        "b. the walk [0, walk_len = L + T_valid) = the live frames, each once: no hole (idle rows: see idle)",
        "c. attention over the walk = upstream newest-first + trim_attention_cache, float64, tol 1e-12",
        "d. keyed_to_newest_first(arena, frame_keys) = upstream trimmed cache, exactly"), cols)
    for kind, t in tallies.items():
        vals = (kind, sum(s.kind == kind for s in streams), t.chunks, t.ring_chunks, t.fallbacks, t.pre_moved,
                t.post_moved, t.early_moved, t.keyed_moves, t.kept_holes, t.idle_holes, f"{t.max_err:.1e}")
        print("  " + " ".join(f"{v:>{max(len(c), 7)}}" for c, v in zip(cols, vals)))
    sa2 = tallies["stepaudio2"]
    assert sa2.early_moved == 0 and sa2.early_fallbacks == 0, sa2
    print("  stepaudio2: no fallback and no frame moved before a stream's last chunk (asserted); fallbacks before "
          "a last chunk: " + ", ".join(f"{k} {t.early_fallbacks}" for k, t in tallies.items()))


def bench(rows: int = 128, t_max: int = 50, max_frames: int = 550, calls: int = 50) -> None:
    """Median time per call (CPU) of ring_chunk_plan and arena_chunk_plan at a steady bucket."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, MAX_PROMPT + 1, (rows,), generator=g)
    t_nom = torch.full((rows,), t_max)
    tau = prompt + torch.randint(0, 2000, (rows,), generator=g)
    t_valid = torch.where(torch.rand(rows, generator=g) < 0.9, t_nom, torch.randint(0, t_max + 1, (rows,)))
    cache_lengths = torch.minimum(tau, prompt + KEEP)
    keys = torch.stack([torch.randperm(max_frames - t_max, generator=g) for _ in range(rows)]).to(torch.int32)
    keyed = torch.rand(rows, generator=g) < 0.1  # 10 % keyed rows, their keys reversed at [0, L)
    j = torch.arange(max_frames)[None]
    fb_keys = torch.where(keyed[:, None], torch.where(j < cache_lengths[:, None], cache_lengths[:, None] - 1 - j,
                                                      DEAD_KEY),
                          _frame_keys(tau, cache_lengths, prompt, prompt + t_nom, max_frames, KEEP)).to(torch.int32)
    cases = {
        "ring_chunk_plan": lambda: ring_chunk_plan(tau, prompt, t_valid, t_nom, max_frames, t_max=t_max,
                                                   validate=False),
        "ring_chunk_plan, validate=True": lambda: ring_chunk_plan(tau, prompt, t_valid, t_nom, max_frames,
                                                                  t_max=t_max),
        "ring_chunk_plan, no frame_keys": lambda: ring_chunk_plan(tau, prompt, t_valid, t_nom, max_frames,
                                                                  t_max=t_max, validate=False,
                                                                  with_frame_keys=False),
        "arena_chunk_plan": lambda: arena_chunk_plan(keys, cache_lengths, t_valid, prompt, max_frames - t_max, t_max),
        "ring_fallback_chunk_plan": lambda: ring_fallback_chunk_plan(keyed, tau, fb_keys, prompt, t_valid, t_nom,
                                                                     max_frames, t_max=t_max, validate=False),
    }
    times = {name: [] for name in cases}
    for _ in range(5):
        for fn in cases.values():
            fn()
    for _ in range(calls):  # round-robin, so drift of a shared machine hits every case alike
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    print(f"plan time per call, CPU ({torch.get_num_threads()} threads), S={rows}, Tmax={t_max}, "
          f"max_frames={max_frames}, median of {calls} (interleaved):")
    for name, ts in times.items():
        print(f"  {name:<32} {statistics.median(ts) * 1e6:8.1f} us")

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="simulate streams against the upstream trim")
    parser.add_argument("--bench", action="store_true", help="time the plan next to arena_chunk_plan (CPU)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not (args.check or args.bench):
        parser.error("give --check and/or --bench")
    if args.check:
        check(args.seed)
    if args.bench:
        bench()


if __name__ == "__main__":
    main()
