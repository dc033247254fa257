"""Plain-PyTorch reference of the trimmed cache write-back (``torch_cfm.kernels.cache_trim``)."""

from __future__ import annotations

from typing import Optional

import torch


def trim_copy_reference(dst: torch.Tensor, src: torch.Tensor, index: torch.Tensor,
                        dst_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``dst[d, dst_rows[r], h, j] = src[d, r, h, index[r % n, j]]`` for ``j < W`` with ATen ops (a
    full gather, then a copy or ``index_copy_``): the oracle of ``kernels/cache_trim.py`` and the
    server's write-back where the policy runs no Triton kernels. Shapes as ``trim_copy_into``."""
    depth, n_rows, heads, src_frames, two_d = src.shape
    n_req, width = index.shape
    idx = index.clamp(0, max(src_frames - 1, 0)).repeat(n_rows // max(n_req, 1), 1)
    taken = torch.gather(src, 3, idx.view(1, n_rows, 1, width, 1).expand(depth, n_rows, heads, width, two_d))
    if dst_rows is None:
        dst[:, :, :, :width].copy_(taken)
    else:
        dst[:, :, :, :width].index_copy_(1, dst_rows, taken.to(dst.dtype))
    return dst


__all__ = ["trim_copy_reference"]
