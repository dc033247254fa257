"""The DiT estimator's submodules (docs/design.md §1): names and shapes mirror the upstream checkpoint.

Each block's streaming form (``forward`` with per-block caches and a :class:`ChunkLayout` of the
chunk's ragged rows) reads tensor metadata only, never data: no host synchronisation, so a step
can be captured in a CUDA graph. Attention runs :func:`torch_cfm.cfm_attention` with per-row key
lengths (its reference where a dense mask is needed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..config import (ATTENTION_DTYPES, BLOCK_LN_EPS, CONV_LN_EPS, QK_NORM_EPS, TIME_EMBED_DIM, TIME_EMBED_MAX_PERIOD,
                      TIME_EMBED_SCALE, DiTConfig)
from ..ops import cfm_attention
from ..reference.cfm_attention import cfm_attention_reference




class TimestepEmbedder(nn.Module):
    """``temb = mlp(f(t))``, ``f = [cos(1000 t w_j) | sin(1000 t w_j)]``, ``w_j = 10000^(-j/128)``."""

    def __init__(self, hidden: int, freq_dim: int = TIME_EMBED_DIM) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    @staticmethod
    def features(t: torch.Tensor, dim: int = TIME_EMBED_DIM) -> torch.Tensor:
        """(N,) times -> (N, dim) sinusoidal features, computed in fp32 (fp64 for fp64 t)."""
        work = torch.float64 if t.dtype == torch.float64 else torch.float32
        half = dim // 2
        j = torch.arange(half, device=t.device, dtype=work)
        freqs = torch.exp(-math.log(TIME_EMBED_MAX_PERIOD) * j / half)
        args = TIME_EMBED_SCALE * t.to(work)[:, None] * freqs[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """(N,) -> (N, C) in the first linear's dtype."""
        f = self.features(t, self.freq_dim).to(self.mlp[0].weight.dtype)
        return self.mlp(f)


class Attention(nn.Module):
    """Multi-head attention with per-head q/k LayerNorm and no positions (docs/design.md §1)."""

    def __init__(self, hidden: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(hidden, inner)
        self.to_k = nn.Linear(hidden, inner)
        self.to_v = nn.Linear(hidden, inner)
        self.q_norm = nn.LayerNorm(head_dim, eps=QK_NORM_EPS)
        self.k_norm = nn.LayerNorm(head_dim, eps=QK_NORM_EPS)
        self.proj = nn.Linear(inner, hidden)

    def forward(self, hm: torch.Tensor, att_cache: Optional[torch.Tensor], att_out: torch.Tensor,
                layout: "ChunkLayout") -> torch.Tensor:
        """hm (N, T, C) -> (N, T, C); writes the new K|V cache ``[cur ; old]`` into att_out.

        att_out: (N, H, T+L, 2D) buffer; K goes to ``[..., :D]``, V to ``[..., D:]``, and
        attention reads both halves in place as strided views.
        """
        n_rows, t_len, _ = hm.shape
        heads, head_dim = self.heads, self.head_dim
        q = self.q_norm(self.to_q(hm).view(n_rows, t_len, heads, head_dim))
        k = self.k_norm(self.to_k(hm).view(n_rows, t_len, heads, head_dim))
        v = self.to_v(hm).view(n_rows, t_len, heads, head_dim)
        att_out[:, :, :t_len, :head_dim].copy_(k.transpose(1, 2))
        att_out[:, :, :t_len, head_dim:].copy_(v.transpose(1, 2))
        if att_cache is not None and att_cache.shape[2] > 0:
            if layout.old_index is None:
                att_out[:, :, t_len:].copy_(att_cache)
            else:  # row n's old frames go right after its T_n current ones
                att_out.scatter_(2, layout.old_index, att_cache.to(att_out.dtype))
        q = q.transpose(1, 2).to(att_out.dtype)
        out = _attend(q, att_out[..., :head_dim], att_out[..., head_dim:], layout)
        return self.proj(out.transpose(1, 2).reshape(n_rows, t_len, heads * head_dim))


class Mlp(nn.Module):
    """fc1 -> GELU (tanh approximation) -> fc2."""

    def __init__(self, hidden: int, mlp_hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, mlp_hidden)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(mlp_hidden, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(h)))


class Transpose(nn.Module):
    """Swap time and channel axes (a parameter-free slot of the upstream conv container)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.transpose(1, 2)


class CausalConv1d(nn.Conv1d):
    """Conv1d over (N, C, T) left-padded with ``kernel - 1`` zeros (no cache = zero history)."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__(channels, channels, kernel)
        self.history = kernel - 1

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(h, (self.history, 0)))


class CausalConvBlock(nn.Module):
    """CausalConv1d -> LayerNorm(C) -> Mish -> CausalConv1d on (N, T, C).

    ``block`` mirrors the upstream container so the checkpoint keys ``block.1`` (conv 1),
    ``block.3`` (LayerNorm) and ``block.6`` (conv 2) line up; ``block(h)`` is the cache-free
    forward. :meth:`forward_cached` applies the same layers with conv caches.
    """

    def __init__(self, hidden: int, kernel: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            Transpose(),                          # 0: (N, T, C) -> (N, C, T)
            CausalConv1d(hidden, kernel),         # 1: conv 1
            Transpose(),                          # 2
            nn.LayerNorm(hidden, eps=CONV_LN_EPS),  # 3
            nn.Mish(),                            # 4
            Transpose(),                          # 5
            CausalConv1d(hidden, kernel),         # 6: conv 2
            Transpose(),                          # 7: back to (N, T, C)
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.block(h)

    def forward_cached(self, h: torch.Tensor, cnn_cache: Optional[torch.Tensor], cnn_out: torch.Tensor,
                       layout: "ChunkLayout") -> torch.Tensor:
        """h (N, T, C) -> (N, T, C); writes the new conv cache (N, 2C, K-1) into cnn_out.

        Conv input is ``[cache ; chunk]`` (no padding); the new cache is the last K-1 frames of
        ``[cache ; chunk[:T_n]]`` per row (a gather at T_n, never a host read).
        """
        conv1, norm, act, conv2 = self.block[1], self.block[3], self.block[4], self.block[6]
        n_rows, _, hidden = h.shape
        hist = conv1.history
        if cnn_cache is None:
            c1 = c2 = h.new_zeros((n_rows, hidden, hist))
        else:
            c1, c2 = cnn_cache[:, :hidden], cnn_cache[:, hidden:]
        ext1 = torch.cat([c1.to(h.dtype), h.transpose(1, 2)], dim=2)  # (N, C, hist + T)
        y = F.conv1d(ext1, conv1.weight, conv1.bias)
        z = act(norm(y.transpose(1, 2)))
        ext2 = torch.cat([c2.to(z.dtype), z.transpose(1, 2)], dim=2)
        out = F.conv1d(ext2, conv2.weight, conv2.bias)
        cnn_out[:, :hidden].copy_(_last_frames(ext1, layout.conv_index, hist))
        cnn_out[:, hidden:].copy_(_last_frames(ext2, layout.conv_index, hist))
        return out.transpose(1, 2)


def _last_frames(ext: torch.Tensor, index: Optional[torch.Tensor], hist: int) -> torch.Tensor:
    if index is None:
        return ext[..., ext.shape[-1] - hist:]
    return torch.gather(ext, 2, index)


def modulate(z: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``z * (1 + scale) + shift``."""
    return z * (1 + scale) + shift


class DiTBlock(nn.Module):
    """adaLN-Zero block: attention, then the causal conv block, then the MLP (docs/design.md §1)."""

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        c = config.hidden
        self.norm1 = nn.LayerNorm(c, elementwise_affine=False, eps=BLOCK_LN_EPS)
        self.attn = Attention(c, config.heads, config.head_dim)
        self.norm2 = nn.LayerNorm(c, elementwise_affine=False, eps=BLOCK_LN_EPS)
        self.mlp = Mlp(c, config.mlp_hidden)
        self.norm3 = nn.LayerNorm(c, elementwise_affine=False, eps=BLOCK_LN_EPS)
        self.conv = CausalConvBlock(c, config.conv_kernel)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(c, 9 * c))

    def forward(self, h: torch.Tensor, temb: torch.Tensor, att_cache: Optional[torch.Tensor],
                cnn_cache: Optional[torch.Tensor], att_out: torch.Tensor, cnn_out: torch.Tensor,
                layout: "ChunkLayout") -> torch.Tensor:
        """h (N, T, C), temb (N, 1, C) -> (N, T, C); new caches written into att_out / cnn_out."""
        sa, ca, ga, sm, cm, gm, sc, cc, gc = self.adaLN_modulation(temb).chunk(9, dim=-1)
        h = h + ga * self.attn(modulate(self.norm1(h), sa, ca), att_cache, att_out, layout)
        h = h + gc * self.conv.forward_cached(modulate(self.norm3(h), sc, cc), cnn_cache, cnn_out, layout)
        h = h + gm * self.mlp(modulate(self.norm2(h), sm, cm))
        return h


class FinalLayer(nn.Module):
    """``linear(mod(LN(h), shift, scale))`` with ``(shift, scale) = Linear_2C(SiLU(temb))``."""

    def __init__(self, hidden: int, out_channels: int) -> None:
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden, elementwise_affine=False, eps=BLOCK_LN_EPS)
        self.linear = nn.Linear(hidden, out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))

    def forward(self, h: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(temb).chunk(2, dim=-1)
        return self.linear(modulate(self.norm_final(h), shift, scale))


# --------------------------------------------------------------------------------------------
# Ragged layout helpers (device-side index tensors; no host reads)
# --------------------------------------------------------------------------------------------


@dataclass
class ChunkLayout:
    key_lengths: Optional[torch.Tensor]  # (N,) int32 valid keys per row, or None (all valid)
    key_mask: Optional[torch.Tensor]  # (N, T, K) bool (expanded), full forward only
    old_index: Optional[torch.Tensor]  # (N, H, L, 2D) int64 scatter targets of the old cache
    conv_index: Optional[torch.Tensor]  # (N, C, K-1) int64 gather positions of the new conv cache


def _attend(q, k, v, layout: ChunkLayout) -> torch.Tensor:
    if q.dtype in ATTENTION_DTYPES:
        return cfm_attention(q, k, v, key_lengths=layout.key_lengths, mask=layout.key_mask)
    # float64 (oracle-style runs): the plain reference math, same semantics.
    return cfm_attention_reference(q, k, v, layout.key_lengths, layout.key_mask)


__all__ = ["TimestepEmbedder", "Attention", "Mlp", "CausalConvBlock", "DiTBlock", "FinalLayer", "ChunkLayout", "modulate"]
