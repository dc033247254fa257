"""The voice-prompt cache: a solved prompt's state, reused by every stream that opens with it.

A prompt solve is a pure function of the prompt (its encoder output and mel), the speaker
embedding, the dtype and the decoder's fixed noise (docs/design.md §3), so its result can be
reused exactly: a stream opening with a voice already solved gets a copy of that state in its own
slot (the CFM caches, and the other stages' prompt state its server keeps beside them) instead of
a solve. The copy is bitwise what the solve wrote.

Entries are keyed by an explicit voice key or by the content of the prompt tensors
(:func:`content_key`), kept least recently used first and bounded in bytes.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping, Optional

import torch

from ..errors import fail
from .reports import AdmissionError


def content_key(*parts: Any) -> str:
    """A key naming the content of tensors and python values: their dtypes, shapes and bytes
    (tensors are read back to the host once: one small copy per open).

    Returns:
        a hex digest (sha1), the same for equal content on any device.
    """
    digest = hashlib.sha1()
    for part in parts:
        if isinstance(part, torch.Tensor):
            t = part.detach().to("cpu").contiguous()
            digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
            digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            digest.update(repr(part).encode())
    return digest.hexdigest()


def tensors_nbytes(obj: Any) -> int:
    """Bytes of every tensor in a tree of tuples, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(tensors_nbytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(tensors_nbytes(o) for o in obj.values())
    return 0


@dataclass
class VoiceState:
    """One solved prompt's state of a request slot.

    Attributes:
        att: (n, depth, 2, H, L, 2D) the slot's attention frames [0, L) as the arena holds them.
        cnn: (n, depth, 2, 2C, 2) its conv caches.
        frame_keys: (L,) int32 the keys of those frames.
        prompt_len: P (the trim threshold).
        spks: (80,) the projected speaker embedding the request solves with.
        mel: (80, P) the prompt's solved mel.
        extra: the other stages' prompt state of the server that owns the cache (e.g. conformer caches).
    """

    att: torch.Tensor
    cnn: torch.Tensor
    frame_keys: torch.Tensor
    prompt_len: int
    spks: torch.Tensor
    mel: torch.Tensor
    extra: dict = field(default_factory=dict)

    @classmethod
    def of_slot(cls, arena: Any, slot: int, length: int, prompt_len: int, mel: torch.Tensor,
                extra: Optional[dict] = None) -> "VoiceState":
        """A copy of slot ``slot`` of a :class:`~torch_cfm.models.cache.CacheArena` (its first
        ``length`` cache frames and keys, conv caches, speaker embedding) with ``mel`` and ``extra``."""
        rows = [slot, arena.rows + slot]
        return cls(att=arena.att[:, :, rows, :, :length], cnn=arena.cnn[:, :, rows],  # list indexing copies
                   frame_keys=arena.frame_keys[slot, :length].clone(), prompt_len=prompt_len,
                   spks=arena.spks[slot].clone(), mel=mel.clone(), extra=dict(extra or {}))

    def restore(self, arena: Any, slot: int) -> None:
        """Write this state into slot ``slot`` of ``arena`` (bitwise the slot it was copied from;
        the speaker embedding and P are the slot's own)."""
        length = self.cache_len
        arena.write_slot(slot, self.cnn, self.att)
        arena.frame_keys[slot, :length].copy_(self.frame_keys)
        arena.cache_lengths[slot] = length

    def restore_many(self, arena: Any, index: torch.Tensor) -> None:
        """:meth:`restore` into every slot of ``index`` ((k,) int64 on the arena's device, distinct),
        with this state's speaker embedding and P, in a fixed number of launches whatever k."""
        length, k = self.cache_len, index.numel()
        arena.write_slots(index, self.cnn, self.att)
        arena.frame_keys[:, :length].index_copy_(0, index, self.frame_keys[None].expand(k, length))
        arena.spks.index_copy_(0, index, self.spks[None].expand(k, -1))
        arena.cache_lengths.index_fill_(0, index, length)
        arena.prompt_lengths.index_fill_(0, index, self.prompt_len)

    def mismatch(self, arena: Any, max_prompt_frames: int) -> Optional[str]:
        """Why this state cannot go into a slot of ``arena`` (a server's with ``max_prompt_frames``);
        None when it can."""
        a, c = arena.att, arena.cnn
        same_att = self.att.dim() == a.dim() and self.att.shape[2] == 2 \
            and (*self.att.shape[:2], *self.att.shape[3::2]) == (*a.shape[:2], *a.shape[3::2])
        if not same_att or self.cnn.shape[:2] + self.cnn.shape[3:] != c.shape[:2] + c.shape[3:]:
            return f"caches att {tuple(self.att.shape)}, cnn {tuple(self.cnn.shape)} for an arena of " \
                   f"{tuple(a.shape)}, {tuple(c.shape)}"
        if self.att.dtype != a.dtype or self.att.device != a.device:
            return f"{self.att.dtype} on {self.att.device} for an arena of {a.dtype} on {a.device}"
        if self.prompt_len > max_prompt_frames or self.cache_len > a.shape[4]:
            return f"P = {self.prompt_len}, L = {self.cache_len} for max_prompt_frames = {max_prompt_frames}, " \
                   f"{a.shape[4]} cache frames"
        return None

    @property
    def cache_len(self) -> int:
        return self.att.shape[4]

    @property
    def nbytes(self) -> int:
        return tensors_nbytes((self.att, self.cnn, self.frame_keys, self.spks, self.mel, self.extra))


class VoiceCache:
    """Solved voice prompts by key, least recently used dropped first, at most ``max_bytes``.

    Args:
        max_bytes: the budget (positive int); a state larger than it is not kept.
    Attributes:
        hits, misses, evictions: lookup and eviction counts.
    """

    def __init__(self, max_bytes: int) -> None:
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes <= 0:
            fail("VoiceCache", "max_bytes", "be a positive int (bytes)", repr(max_bytes))
        self.max_bytes = max_bytes
        self._entries: "OrderedDict[Hashable, VoiceState]" = OrderedDict()
        self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        return sum(s.nbytes for s in self._entries.values())

    def get(self, key: Hashable) -> Optional[VoiceState]:
        """The state of ``key`` (now the most recently used), or None; counts a hit or a miss."""
        state = self._entries.get(key)
        if state is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return state

    def peek(self, key: Hashable) -> Optional[VoiceState]:
        """The state of ``key`` or None, without counting or reordering."""
        return self._entries.get(key)

    def put(self, key: Hashable, state: VoiceState) -> bool:
        """Keep ``state`` under ``key`` (replacing an entry of that key), dropping the least
        recently used entries until it fits. Returns False when it alone exceeds the budget."""
        size = state.nbytes
        self._entries.pop(key, None)
        if size > self.max_bytes:
            return False
        while self._entries and self.nbytes + size > self.max_bytes:
            self._entries.popitem(last=False)
            self.evictions += 1
        self._entries[key] = state
        return True

    def stats(self) -> dict:
        """{"voices", "bytes", "max_bytes", "hits", "misses", "evictions"}."""
        return {"voices": len(self._entries), "bytes": self.nbytes, "max_bytes": self.max_bytes, "hits": self.hits,
                "misses": self.misses, "evictions": self.evictions}


def state_mismatch(state: Any, arena: Any, max_prompt_frames: int) -> Optional[str]:
    """:meth:`VoiceState.mismatch`, or why ``state`` is no VoiceState at all; None: it fits."""
    if not isinstance(state, VoiceState):
        return f"a {type(state).__name__}"
    return state.mismatch(arena, max_prompt_frames)


def open_voices(server: Any, requests: Mapping[Hashable, Hashable], new_request: Callable) -> dict[Hashable, torch.Tensor]:
    """:meth:`CFMServer.open_voices <torch_cfm.serving.CFMServer.open_voices>`: every request checked
    first, then slots taken (``new_request(bucket, slot, prompt_len)`` makes the server's record)
    and each (bucket, voice) group restored by one :meth:`VoiceState.restore_many`."""
    op, open_ids = "CFMServer.open_voices", set(server.open_requests)
    for rid, voice in requests.items():
        if rid in open_ids or server.voice_state(voice) is None:
            fail(op, f"requests[{rid!r}]", "name a request not open yet and a cached voice",
                 "an open request" if rid in open_ids else f"voice {voice!r}, not cached")
    if len(requests) > server.free_slots:
        raise AdmissionError(f"{op}: {len(requests)} requests for {server.free_slots} free slots; close requests "
                             "first or build the server with more slots")
    groups: dict[tuple, tuple] = {}
    for rid, voice in requests.items():
        state, bucket = server.voices.get(voice), server._free_bucket(op)  # noqa: SLF001 - the server's own helpers
        req = new_request(bucket, server._free[bucket].pop(0), state.prompt_len)  # noqa: SLF001
        req.cache_len, req.chunks = state.cache_len, 1
        server._requests[rid] = req  # noqa: SLF001
        groups.setdefault((bucket, voice), (state, []))[1].append((rid, req.slot))
    mels = {}
    for (bucket, _), (state, members) in groups.items():
        state.restore_many(server.arenas[bucket], server.device_index([slot for _, slot in members]))
        mels.update(zip([rid for rid, _ in members], state.mel.expand(len(members), *state.mel.shape).clone().unbind(0)))
    return {rid: mels[rid] for rid in requests}


__all__ = ["VoiceCache", "VoiceState", "content_key", "open_voices", "state_mismatch", "tensors_nbytes"]
