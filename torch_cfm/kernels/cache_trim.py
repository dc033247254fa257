"""Triton kernel of the server's cache-frame copies: the trimmed write-back of a new attention
cache into its arena slice, and the keyed arena's gathers and in-place moves, each in one pass.

The solve engine's cache layouts (:mod:`torch_cfm.solve.caches`) move attention-cache frames between
the arena and a step's cache with per-row frame maps: output frame j of a row reads source frame
``index[n, j]`` (a trim, ``trim_gather_index``; a keyed arena's plan, ``models.cache.arena_chunk_plan``),
and an index of -1 leaves the output frame as it is. Rows may be renamed on either side (``src_rows`` /
``dst_rows``: compacted solves). In ATen that is a gather + scatter and a strided copy (three
launches, two of them slow index kernels); here one program per (block, row, head, frame tile) reads
the frames its output frames name and writes them in place.

Source and destination may be the same tensor when no frame that is written is also read (the keyed
arena's moves fill dropped frames from frames past the new length). Graph-safe: no allocation, no
host synchronisation. Reference (and the path where the policy runs no Triton kernels):
``torch_cfm.reference.cache_trim.trim_copy_reference``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._launch import on_device


@triton.jit(do_not_specialize=["n_req", "n_rows", "heads", "width", "src_frames"])
def _trim_copy_kernel(
    src_ptr, s_d, s_r, s_h, s_f,  # (depth, rows, H, Fs, 2D) new cache, unit stride on the last dim
    dst_ptr, t_d, t_r, t_h, t_f,  # (depth, R_dst, H, M, 2D) arena slice, unit stride on the last dim
    index_ptr,  # (n_req, width) int64 source frame of each output frame (-1: keep it), row-major
    rows_ptr,  # (rows,) int64 destination row of each row (read when HAS_ROWS)
    src_rows_ptr,  # (rows,) int64 source row of each row (read when HAS_SRC_ROWS)
    n_req, n_rows, heads, width, src_frames,
    TWO_D: tl.constexpr, BLOCK_F: tl.constexpr, HAS_ROWS: tl.constexpr, HAS_SRC_ROWS: tl.constexpr,
):
    pid = tl.program_id(0)  # (block, row, head)
    h = pid % heads
    rest = pid // heads
    r = rest % n_rows
    d = rest // n_rows
    offs_f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    f_ok = offs_f < width
    offs_c = tl.arange(0, TWO_D)
    # CFG rows r and n_req + r (cond / uncond of one request) share the request's index row
    src_f = tl.load(index_ptr + (r % n_req).to(tl.int64) * width + offs_f, mask=f_ok, other=-1)
    f_ok = f_ok & (src_f >= 0)
    src_f = tl.minimum(tl.maximum(src_f, 0), src_frames - 1)
    if HAS_SRC_ROWS:
        src_r = tl.load(src_rows_ptr + r).to(tl.int64)
    else:
        src_r = r.to(tl.int64)
    src = (src_ptr + d.to(tl.int64) * s_d + src_r * s_r + h.to(tl.int64) * s_h
           + src_f[:, None] * s_f + offs_c[None, :])
    vals = tl.load(src, mask=f_ok[:, None], other=0.0)
    if HAS_ROWS:
        dst_r = tl.load(rows_ptr + r).to(tl.int64)
    else:
        dst_r = r.to(tl.int64)
    dst = (dst_ptr + d.to(tl.int64) * t_d + dst_r * t_r + h.to(tl.int64) * t_h
           + offs_f[:, None].to(tl.int64) * t_f + offs_c[None, :])
    tl.store(dst, vals.to(dst_ptr.dtype.element_ty), mask=f_ok[:, None])


def trim_copy_into(dst: torch.Tensor, src: torch.Tensor, index: torch.Tensor,
                   dst_rows: Optional[torch.Tensor] = None, src_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``dst[d, dst_rows[r], h, j] = src[d, src_rows[r], h, index[r % n, j]]`` for ``j < W`` and
    ``index[r % n, j] >= 0``; frames with index -1 are not written. Returns ``dst``.

    Args:
        dst: (depth, R_dst, H, M, 2D) arena slice (any strides, unit stride on the last dim), M >= W.
        src: (depth, R_src, H, Fs, 2D) frames to read, same dtype family, unit stride on the last
            dim; may be ``dst`` itself when no frame that is written is also read.
        index: (n, W) int64 source frame of each output frame, or -1 (``trim_gather_index``,
            ``models.cache.arena_chunk_plan``); ``rows`` must be a multiple of n (CFG: rows = 2n,
            row r and n + r use index row r).
        dst_rows: optional (rows,) int64 destination row of each row (compacted solves); None = r.
        src_rows: optional (rows,) int64 source row of each row (gathers); None = r.
    ``rows`` = the length of ``src_rows``, else of ``dst_rows``, else R_src. Indices at or past Fs are
    clamped (the plans never produce them).
    """
    depth, src_rows_n, heads, src_frames, two_d = src.shape
    n_req, width = index.shape
    n_rows = next((len(t) for t in (src_rows, dst_rows) if t is not None), src_rows_n)
    if dst.stride(-1) != 1 or src.stride(-1) != 1:
        raise ValueError("trim_copy_into: dst and src need unit stride on their last dim")
    if (width > dst.shape[3] or n_rows % max(n_req, 1) or two_d != dst.shape[4] or two_d & (two_d - 1)
            or dst.shape[0] != depth or (dst_rows is not None and src_rows is not None and len(dst_rows) != n_rows)):
        raise ValueError(f"trim_copy_into: incompatible shapes dst {tuple(dst.shape)}, src {tuple(src.shape)}, "
                         f"index {tuple(index.shape)}")
    if width == 0 or n_rows == 0 or src.numel() == 0:
        return dst
    index = index.contiguous()
    block_f = 16
    grid = (depth * n_rows * heads, triton.cdiv(width, block_f))
    with on_device(dst.device):
        _trim_copy_kernel[grid](
            src, *src.stride()[:4], dst, *dst.stride()[:4], index,
            dst_rows if dst_rows is not None else index, src_rows if src_rows is not None else index,
            n_req, n_rows, heads, width, src_frames,
            TWO_D=two_d, BLOCK_F=block_f, HAS_ROWS=dst_rows is not None, HAS_SRC_ROWS=src_rows is not None,
            num_warps=4)
    return dst


@triton.jit(do_not_specialize=["n_req", "n_rows", "heads", "width", "src_frames"])
def _move_frames_kernel(
    src_ptr, s_d, s_r, s_h, s_f,  # (depth, R_src, H, Fs, 2D), unit stride on the last dim
    dst_ptr, t_d, t_r, t_h, t_f,  # (depth, R_dst, H, M, 2D), unit stride on the last dim
    from_ptr, to_ptr,  # (n_req, width) int64 source / destination frame of move k, row-major
    count_ptr,  # (n_req,) int64 moves of each row (entries [0, count) are valid)
    rows_ptr, src_rows_ptr,  # (rows,) int64 destination / source row of each row (HAS_ROWS / HAS_SRC_ROWS)
    n_req, n_rows, heads, width, src_frames,
    TWO_D: tl.constexpr, BLOCK_F: tl.constexpr, HAS_ROWS: tl.constexpr, HAS_SRC_ROWS: tl.constexpr,
):
    pid = tl.program_id(0)  # (block, row, head): one program walks the row's whole move list
    h = pid % heads
    rest = pid // heads
    r = rest % n_rows
    d = rest // n_rows
    req = (r % n_req).to(tl.int64)
    count = tl.load(count_ptr + req)
    count = tl.minimum(tl.maximum(count, 0), width)
    if HAS_SRC_ROWS:
        src_r = tl.load(src_rows_ptr + r).to(tl.int64)
    else:
        src_r = r.to(tl.int64)
    if HAS_ROWS:
        dst_r = tl.load(rows_ptr + r).to(tl.int64)
    else:
        dst_r = r.to(tl.int64)
    src_base = src_ptr + d.to(tl.int64) * s_d + src_r * s_r + h.to(tl.int64) * s_h
    dst_base = dst_ptr + d.to(tl.int64) * t_d + dst_r * t_r + h.to(tl.int64) * t_h
    offs_c = tl.arange(0, TWO_D)
    for k0 in range(0, count, BLOCK_F):
        offs_k = k0 + tl.arange(0, BLOCK_F)
        ok = offs_k < count
        f_from = tl.load(from_ptr + req * width + offs_k, mask=ok, other=0)
        f_from = tl.minimum(tl.maximum(f_from, 0), src_frames - 1)
        f_to = tl.load(to_ptr + req * width + offs_k, mask=ok, other=0)
        vals = tl.load(src_base + f_from[:, None] * s_f + offs_c[None, :], mask=ok[:, None], other=0.0)
        tl.store(dst_base + f_to[:, None] * t_f + offs_c[None, :], vals.to(dst_ptr.dtype.element_ty),
                 mask=ok[:, None])


def move_frames_into(dst: torch.Tensor, src: torch.Tensor, moves, dst_rows: Optional[torch.Tensor] = None,
                     src_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``dst[d, dst_rows[r], h, moves.dst[r % n, k]] = src[d, src_rows[r], h, moves.src[r % n, k]]``
    for ``k < moves.count[r % n]``: a compact list of frame moves per row, so the cost follows the
    frames moved, not the cache length (one program per (block, row, head) walks its list).

    Args:
        dst, src: as :func:`trim_copy_into` (``src`` may be ``dst`` when no destination frame of a
            row is also one of its source frames: the keyed arena's refills).
        moves: a :class:`~torch_cfm.models.cache.FrameMoves` (``src``, ``dst`` (n, K) int64 and
            ``count`` (n,) int64) with K <= dst's frames and destination frames below K (as
            ``arena_chunk_plan`` makes them); source frames at or past Fs are clamped.
        dst_rows, src_rows: as :func:`trim_copy_into`.
    Returns ``dst``.
    """
    depth, src_rows_n, heads, src_frames, two_d = src.shape
    n_req, width = moves.src.shape
    n_rows = next((len(t) for t in (src_rows, dst_rows) if t is not None), src_rows_n)
    if dst.stride(-1) != 1 or src.stride(-1) != 1:
        raise ValueError("move_frames_into: dst and src need unit stride on their last dim")
    if (moves.dst.shape != moves.src.shape or moves.count.shape != (n_req,) or n_rows % max(n_req, 1)
            or width > dst.shape[3] or two_d != dst.shape[4] or two_d & (two_d - 1) or dst.shape[0] != depth):
        raise ValueError(f"move_frames_into: incompatible shapes dst {tuple(dst.shape)}, src {tuple(src.shape)}, "
                         f"moves {tuple(moves.src.shape)}")
    if width == 0 or n_rows == 0 or src.numel() == 0:
        return dst
    with on_device(dst.device):
        _move_frames_kernel[(depth * n_rows * heads,)](
            src, *src.stride()[:4], dst, *dst.stride()[:4], moves.src.contiguous(), moves.dst.contiguous(),
            moves.count, dst_rows if dst_rows is not None else moves.count,
            src_rows if src_rows is not None else moves.count,
            n_req, n_rows, heads, width, src_frames,
            TWO_D=two_d, BLOCK_F=16, HAS_ROWS=dst_rows is not None, HAS_SRC_ROWS=src_rows is not None,
            num_warps=4)
    return dst


__all__ = ["move_frames_into", "trim_copy_into"]
