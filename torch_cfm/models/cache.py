"""Cache layouts and the streaming trim (SPEC §2-3), plus the per-bucket cache arena.

Layouts (one request = two CFG rows, cond then uncond):
    attention: (n, depth, 2B, H, L, 2D), K in ``[..., :D]``, V in ``[..., D:]``, newest frames FIRST;
    conv:      (n, depth, 2B, 2C, 2), channels [0, C) = conv 1 history, [C, 2C) = conv 2 history.

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
from ..ops._checks import fail, shape_str

TRIM_KEEP_OLDEST = SolverConfig().trim_keep_oldest


def trimmed_length(length: int, prompt_len: int, keep_oldest: int = TRIM_KEEP_OLDEST) -> int:
    """Host-side length after the trim: ``prompt_len + keep_oldest`` when longer, else unchanged."""
    return prompt_len + keep_oldest if length > prompt_len + keep_oldest else length


def trim_attention_cache(att_cache: torch.Tensor, prompt_len: int,
                         keep_oldest: int = TRIM_KEEP_OLDEST) -> torch.Tensor:
    """The SPEC §3 trim of one request's (or a uniform batch's) cache, frame axis = -2.

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

    The arena (graphs.SolveBuffers.att, :func:`torch_cfm.kernels.dit_body.dit_body_triton` with
    ``arena=True``) keeps row r's ``lengths[r]`` keys at frames [0, lengths[r]) with frame j holding
    key ``lengths[r] - 1 - j``. The map is its own inverse, so one index serves both directions.

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
    *lead, rows, heads, frames, width = cache.shape
    index, valid = reversed_key_index(lengths, frames)
    idx = index.view(*([1] * len(lead)), rows, 1, frames, 1).expand(*lead, rows, heads, frames, width)
    out = torch.gather(cache, -2, idx)
    return torch.where(valid.view(*([1] * len(lead)), rows, 1, frames, 1), out, out.new_zeros(()))


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
class CacheArena:
    """All caches and staging buffers of one batch bucket: allocated once, reused, never resized.

    Request slot r (0 <= r < rows) owns CFG rows r (cond) and rows + r (uncond).

    Attributes:
        att: (n, depth, 2R, H, M, 2D) attention caches, newest frames first per row.
        cnn: (n, depth, 2R, 2C, 2) conv caches.
        cache_lengths: (R,) int32 valid frames of each slot's attention caches (all steps).
        prompt_lengths: (R,) int32 prompt frames of each slot (for the trim).
        valid_lengths: (R,) int32 staged chunk frames T_n of the next solve (0 = idle slot).
        mu, cond: (R, 80, Tmax) staged chunk inputs; spks: (R, 80) per-slot speaker embedding.
        out_mel: (R, 80, Tmax) solved mel of the last chunk (frames >= T_n are padding).
    Shapes: R rows (requests) of the bucket, M max cache frames, Tmax max chunk frames.
    """

    att: torch.Tensor
    cnn: torch.Tensor
    cache_lengths: torch.Tensor
    prompt_lengths: torch.Tensor
    valid_lengths: torch.Tensor
    mu: torch.Tensor
    cond: torch.Tensor
    spks: torch.Tensor
    out_mel: torch.Tensor

    @classmethod
    def allocate(cls, config: DiTConfig, n_timesteps: int, rows: int, max_cache_frames: int,
                 max_chunk_frames: int, device: torch.device, dtype: torch.dtype) -> "CacheArena":
        """Zero-filled arena for ``rows`` requests (2*rows CFG rows)."""
        for name, val in (("rows", rows), ("max_cache_frames", max_cache_frames),
                          ("max_chunk_frames", max_chunk_frames), ("n_timesteps", n_timesteps)):
            if not isinstance(val, int) or val <= 0:
                fail("CacheArena.allocate", name, "be a positive int", repr(val))
        c, mel = config.hidden, config.out_channels
        kw = dict(device=device, dtype=dtype)
        i32 = dict(device=device, dtype=torch.int32)
        return cls(
            att=torch.zeros((n_timesteps, config.depth, 2 * rows, config.heads, max_cache_frames,
                             2 * config.head_dim), **kw),
            cnn=torch.zeros((n_timesteps, config.depth, 2 * rows, 2 * c, config.conv_cache_frames), **kw),
            cache_lengths=torch.zeros(rows, **i32),
            prompt_lengths=torch.zeros(rows, **i32),
            valid_lengths=torch.zeros(rows, **i32),
            mu=torch.zeros((rows, mel, max_chunk_frames), **kw),
            cond=torch.zeros((rows, mel, max_chunk_frames), **kw),
            spks=torch.zeros((rows, mel), **kw),
            out_mel=torch.zeros((rows, mel, max_chunk_frames), **kw),
        )

    @property
    def rows(self) -> int:
        return self.mu.shape[0]

    @property
    def max_cache_frames(self) -> int:
        return self.att.shape[4]

    @property
    def max_chunk_frames(self) -> int:
        return self.mu.shape[2]

    def nbytes(self) -> int:
        """Bytes of every tensor of the arena."""
        return sum(t.numel() * t.element_size() for t in self.__dict__.values() if isinstance(t, torch.Tensor))

    def data_ptrs(self) -> dict[str, int]:
        """Storage address of each buffer (tests check they never change)."""
        return {k: t.data_ptr() for k, t in self.__dict__.items() if isinstance(t, torch.Tensor)}

    def request_caches(self, slot: int, length: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of one slot's caches in the SPEC layout: cnn (n, depth, 2, 2C, 2) and att
        (n, depth, 2, H, length, 2D), row 0 = cond, row 1 = uncond."""
        if not 0 <= slot < self.rows:
            fail("CacheArena.request_caches", "slot", f"be in [0, {self.rows})", str(slot))
        rows = [slot, self.rows + slot]
        length = self.max_cache_frames if length is None else length
        return self.cnn[:, :, rows].clone(), self.att[:, :, rows, :, :length].clone()

    def describe(self) -> str:
        return (f"CacheArena(rows={self.rows}, att={shape_str(self.att)}, cnn={shape_str(self.cnn)}, "
                f"{self.att.dtype}, {self.nbytes() / 2**20:.1f} MiB)")
