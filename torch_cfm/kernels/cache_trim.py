"""Triton kernel of the server's per-step cache write-back: the trimmed copy of a new attention
cache into its arena slice, in one pass.

After each Euler step the server (``torch_cfm.models.solver.solve_arena_chunk``) must store the
step's new attention cache ``[cur T_n ; old L_n]`` (a fresh tensor from the estimator) into the
cache arena, trimmed per row by SPEC §3 (``trim_gather_index``: output frame j reads source frame
``index[n, j]``). In ATen that is a gather + scatter of the trim window and a strided copy (three
launches, the two index kernels at ~55 µs each at B = 4 on the H200); here one program per
(block, row, head, frame tile) reads the source frames its output frames name and writes them
straight into the arena.

Source and destination are different tensors, so the per-row frame permutation needs no
temporary. Graph-safe: no allocation, no host synchronisation. Reference (and the path where the
policy runs no Triton kernels): ``torch_cfm.reference.cache_trim.trim_copy_reference``.
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
    index_ptr,  # (n_req, width) int64 source frame of each output frame, row-major
    rows_ptr,  # (rows,) int64 destination row of each source row (read when HAS_ROWS)
    n_req, n_rows, heads, width, src_frames,
    TWO_D: tl.constexpr, BLOCK_F: tl.constexpr, HAS_ROWS: tl.constexpr,
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
    src_f = tl.load(index_ptr + (r % n_req).to(tl.int64) * width + offs_f, mask=f_ok, other=0)
    src_f = tl.minimum(tl.maximum(src_f, 0), src_frames - 1)
    src = (src_ptr + d.to(tl.int64) * s_d + r.to(tl.int64) * s_r + h.to(tl.int64) * s_h
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
                   dst_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``dst[d, dst_rows[r], h, j] = src[d, r, h, index[r % n, j]]`` for ``j < W``; returns ``dst``.

    Args:
        dst: (depth, R_dst, H, M, 2D) arena slice (any strides, unit stride on the last dim), M >= W.
        src: (depth, rows, H, Fs, 2D) new cache, same dtype family, unit stride on the last dim.
        index: (n, W) int64 source frame of each output frame (``trim_gather_index``); ``rows`` must
            be a multiple of n (CFG: rows = 2n, row r and n + r use index row r).
        dst_rows: optional (rows,) int64 destination row of each source row (compacted solves);
            None = the same row.
    Indices outside [0, Fs) are clamped (the trim index never produces them).
    """
    depth, n_rows, heads, src_frames, two_d = src.shape
    n_req, width = index.shape
    if dst.stride(-1) != 1 or src.stride(-1) != 1:
        raise ValueError("trim_copy_into: dst and src need unit stride on their last dim")
    if width > dst.shape[3] or n_rows % max(n_req, 1) or two_d != dst.shape[4] or two_d & (two_d - 1):
        raise ValueError(f"trim_copy_into: incompatible shapes dst {tuple(dst.shape)}, src {tuple(src.shape)}, "
                         f"index {tuple(index.shape)}")
    if width == 0 or src.numel() == 0:
        return dst
    index = index.contiguous()
    block_f = 16
    grid = (depth * n_rows * heads, triton.cdiv(width, block_f))
    with on_device(dst.device):
        _trim_copy_kernel[grid](
            src, *src.stride()[:4], dst, *dst.stride()[:4], index,
            dst_rows if dst_rows is not None else index,
            n_req, n_rows, heads, width, src_frames,
            TWO_D=two_d, BLOCK_F=block_f, HAS_ROWS=dst_rows is not None, num_warps=4)
    return dst


__all__ = ["trim_copy_into"]
