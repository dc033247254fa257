"""The upstream conformer's relative-position attention with its key/value cache built in one copy.

``RelPositionMultiHeadedAttention.forward`` (the chunk encoder's attention in both ``stepaudio2``
packages) extends its cache with three concatenations per layer: the key half with the new keys,
the value half with the new values, then both into the returned cache. Its relative-position
scores multiply every batch row by the same positional projection through a broadcasting
``matmul``, which first copies that projection once per row. At 64 streams those copies are most
of the encoder stage's memory traffic (about 8 times the 0.5 GB of attention cache a tick).

:func:`rel_pos_attention` computes the same function with the new cache written once, straight
into the tensor it returns (the old frames, then the new keys and values into their halves), the
keys and values read back as views of it, and the positional scores as one GEMM per head over
all rows. The arithmetic is the upstream's operation for operation (the same products, bias adds
and promotions, the upstream ``forward_attention``); only the layout of the GEMM operands differs,
so results agree within the GEMMs' rounding. The upstream ``rel_shift`` (a zero column
concatenated, then views: a copy of the scores per layer) is taken as the strided view it amounts
to, where a probe per class finds the same indexing. :func:`one_copy_attention` installs it on an
encoder's attention modules for the duration of a call.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Callable, Iterator, Optional

import torch
from torch import nn

_HOLDS = ("forward_qkv", "forward_attention", "rel_shift", "linear_pos", "pos_bias_u", "pos_bias_v", "h", "d_k")


def is_rel_pos_attention(module: nn.Module) -> bool:
    """Whether ``module`` holds what :func:`rel_pos_attention` reads (recognised by what it holds)."""
    return all(hasattr(module, name) for name in _HOLDS)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)


def _shift_view(x: torch.Tensor) -> Optional[torch.Tensor]:
    """Transformer-XL's relative shift of scores x (B, H, T1, P = 2·T2 − 1) as a view,
    out[..., i, j] = x[..., i, j + T1 − 1 − i] for j < T2; None when x's last two dims are not
    row-major (the view needs rows P apart)."""
    b, h, t1, p = x.shape
    if x.stride(3) != 1 or x.stride(2) != p:
        return None
    return x.as_strided((b, h, t1, p // 2 + 1), (x.stride(0), x.stride(1), p - 1, 1), x.storage_offset() + t1 - 1)


@functools.lru_cache(maxsize=None)
def shift_is_a_view(cls: type) -> bool:
    """Whether ``cls.rel_shift`` computes :func:`_shift_view`'s indexing (probed once per class on
    a small tensor; a ``rel_shift`` that reads its module or raises is not replaced)."""
    x = torch.arange(2 * 3 * 9, dtype=torch.float64).view(1, 2, 3, 9)  # T1 = 3, T2 = 5
    try:
        got = cls.rel_shift(None, x)
    except Exception:  # noqa: BLE001 - any failure: keep the module's own
        return False
    return isinstance(got, torch.Tensor) and torch.equal(got, _shift_view(x))


def rel_pos_attention(attn: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      mask: torch.Tensor = torch.ones((0, 0, 0), dtype=torch.bool),
                      pos_emb: torch.Tensor = torch.empty(0),
                      cache: Optional[torch.Tensor] = None, *,
                      into: Optional[Callable[..., torch.Tensor]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``RelPositionMultiHeadedAttention.forward`` of ``attn`` (module docstring).

    Args:
        query, key, value: (B, T1, H·d).
        mask: (B, 1 or T1, T0 + T1) keys to attend, or (0, 0, 0) for none.
        pos_emb: (1 or B, P, H·d) positional encodings, P = 2·(T0 + T1) - 1.
        cache: (B, H, T0, 2·d): the previous keys and values side by side; None or empty for none.
        into: ``into(shape, dtype, device)`` gives the tensor (a view, last dim contiguous) the new
            cache is written to, e.g. its place in a packed buffer; default a new tensor. When
            ``cache`` already is its first T0 frames (the same view), the old frames are not copied.
    Returns:
        (output (B, T1, H·d), new cache (B, H, T0 + T1, 2·d)).
    """
    q, k, v = attn.forward_qkv(query, key, value)  # (B, H, T1, d) each
    batch, heads, t1, d = q.shape
    t0 = 0 if cache is None or cache.size(0) == 0 else cache.shape[2]
    dtype = k.dtype if t0 == 0 else torch.promote_types(cache.dtype, k.dtype)  # as torch.cat promotes
    shape = (batch, heads, t0 + t1, 2 * d)
    new_cache = torch.empty(shape, dtype=dtype, device=k.device) if into is None else into(shape, dtype, k.device)
    if t0 and not _same_view(cache, new_cache[:, :, :t0]):  # a cache already in place is not copied
        new_cache[:, :, :t0].copy_(cache)
    new_cache[:, :, t0:, :d].copy_(k)
    new_cache[:, :, t0:, d:].copy_(v)
    keys, values = new_cache[..., :d], new_cache[..., d:]

    p = attn.linear_pos(pos_emb).view(pos_emb.size(0), -1, heads, d)  # (1 or B, P, H, d)
    q_u = q + attn.pos_bias_u[:, None, :]  # the upstream's (q^T + u)^T: the same sums
    q_v = q + attn.pos_bias_v[:, None, :]
    matrix_ac = torch.matmul(q_u, keys.transpose(-2, -1))
    if p.size(0) == 1:  # one table for every row: one GEMM per head over the B·T1 query rows
        bd = torch.matmul(q_v.transpose(0, 1).reshape(heads, batch * t1, d), p[0].permute(1, 2, 0))
        matrix_bd = bd.view(heads, batch, t1, -1).transpose(0, 1)
    else:
        matrix_bd = torch.matmul(q_v, p.permute(0, 2, 3, 1))
    if matrix_ac.shape != matrix_bd.shape:  # the upstream's shift, without its padded copy where it is one
        shifted = _shift_view(matrix_bd) if shift_is_a_view(type(attn)) else None
        matrix_bd = attn.rel_shift(matrix_bd) if shifted is None else shifted
    scores = (matrix_ac + matrix_bd) / math.sqrt(attn.d_k)
    return attn.forward_attention(values, scores, mask), new_cache


@contextlib.contextmanager
def one_copy_attention(modules, into: Optional[Callable[..., torch.Tensor]] = None) -> Iterator[int]:
    """:func:`rel_pos_attention` as the ``forward`` of every module of ``modules`` that
    :func:`is_rel_pos_attention`, for the duration of the block (yields how many; each module's
    own ``forward`` is back afterwards, also on error). ``into(i, shape, dtype, device)``: where
    ``modules[i]`` writes its new cache (:func:`rel_pos_attention`'s ``into``)."""
    patched = []
    try:
        for i, m in enumerate(modules):
            if is_rel_pos_attention(m) and "forward" not in vars(m):
                dest = None if into is None else functools.partial(into, i)
                m.forward = functools.partial(rel_pos_attention, m, into=dest)
                patched.append(m)
        yield len(patched)
    finally:
        for m in patched:
            del m.forward


def encoder_attention(encoder: nn.Module) -> list[nn.Module]:
    """The attention modules of a chunk encoder's layers (``encoders`` and ``up_encoders``)."""
    layers = [*getattr(encoder, "encoders", ()), *getattr(encoder, "up_encoders", ())]
    return [layer.self_attn for layer in layers if hasattr(layer, "self_attn")]


__all__ = ["encoder_attention", "is_rel_pos_attention", "one_copy_attention", "rel_pos_attention"]
