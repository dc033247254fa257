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


__all__ = ["trim_copy_reference"]
