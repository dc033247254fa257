"""Plain-PyTorch reference of the cache-frame copies (``torch_cfm.kernels.cache_trim``)."""

from __future__ import annotations

from typing import Optional

import torch


def trim_copy_reference(dst: torch.Tensor, src: torch.Tensor, index: torch.Tensor,
                        dst_rows: Optional[torch.Tensor] = None, src_rows: Optional[torch.Tensor] = None
                        ) -> torch.Tensor:
    """``dst[d, dst_rows[r], h, j] = src[d, src_rows[r], h, index[r % n, j]]`` for ``j < W`` and
    ``index[r % n, j] >= 0`` with ATen ops (a full gather into a new tensor, then a masked copy or
    ``index_copy_``, so ``src`` may alias ``dst``): the oracle of ``kernels/cache_trim.py`` and the
    server's frame copies where the policy runs no Triton kernels. Shapes as ``trim_copy_into``."""
    depth, _, heads, src_frames, two_d = src.shape
    n_req, width = index.shape
    if src_rows is not None:
        src = src.index_select(1, src_rows)
    n_rows = src.shape[1]
    if width == 0 or n_rows == 0:
        return dst
    index = index.repeat(n_rows // max(n_req, 1), 1)
    keep = (index < 0).view(1, n_rows, 1, width, 1)
    idx = index.clamp(0, max(src_frames - 1, 0))
    taken = torch.gather(src, 3, idx.view(1, n_rows, 1, width, 1).expand(depth, n_rows, heads, width, two_d))
    target = dst[:, :, :, :width]
    current = target if dst_rows is None else target.index_select(1, dst_rows)
    taken = torch.where(keep, current, taken.to(dst.dtype))
    if dst_rows is None:
        target.copy_(taken)
    else:
        target.index_copy_(1, dst_rows, taken)
    return dst


def move_frames_reference(dst: torch.Tensor, src: torch.Tensor, moves, dst_rows: Optional[torch.Tensor] = None,
                          src_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``dst[d, dst_rows[r], h, moves.dst[r % n, k]] = src[d, src_rows[r], h, moves.src[r % n, k]]``
    for ``k < moves.count[r % n]``, with ATen ops (the moves as a frame index, then
    :func:`trim_copy_reference`): the oracle of ``kernels.cache_trim.move_frames_into``."""
    n_req, width = moves.src.shape
    frames = dst.shape[3]
    k = torch.arange(width, device=moves.src.device)[None]
    ok = k < moves.count[:, None]
    index = torch.full((n_req, frames + 1), -1, dtype=torch.int64, device=moves.src.device)
    index.scatter_(1, torch.where(ok, moves.dst.clamp(0, frames), frames), torch.where(ok, moves.src, -1))
    return trim_copy_reference(dst, src, index[:, :frames], dst_rows, src_rows)


__all__ = ["move_frames_reference", "trim_copy_reference"]
