"""Reference math of the fused DiT body (``torch_cfm::dit_body``) on packed weights.

Plain PyTorch, any float dtype incl. float64: the CPU kernel of the op and the oracle the Triton
path is checked against. It follows the numerics contract of the fused path: GEMMs run in the
compute dtype, the residual stream, LayerNorm statistics, modulation and tap sums in float32
(float64 for a float64 body). Layouts and packing: :mod:`torch_cfm.packing`.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..config import BLOCK_LN_EPS, CONV_LN_EPS, QK_NORM_EPS
from ..packing import (GATE_A, GATE_C, GATE_M, PER_BLOCK, SCALE_A, SCALE_C, SCALE_M, SHIFT_A,
                       SHIFT_C, SHIFT_M)
from .cfm_attention import cfm_attention_reference


def body_sizes(x_in: torch.Tensor, weights: list[torch.Tensor]) -> dict[str, int]:
    """Sizes implied by the packed weight list (see :mod:`torch_cfm.packing`)."""
    depth = (len(weights) - 4) // PER_BLOCK
    hidden = weights[0].shape[0]
    head_dim = weights[4].shape[0]
    inner = weights[2].shape[0] // 3
    return dict(depth=depth, hidden=hidden, head_dim=head_dim, heads=inner // head_dim,
                inner=inner, in_channels=weights[0].shape[1], out_channels=weights[-2].shape[0],
                mlp_hidden=weights[16].shape[0] if depth else 0)


def block_weights(weights: list[torch.Tensor], i: int) -> list[torch.Tensor]:
    return weights[2 + PER_BLOCK * i: 2 + PER_BLOCK * (i + 1)]


def clamp_lengths(lengths: Optional[torch.Tensor], n_rows: int, limit: int,
                  device: torch.device) -> torch.Tensor:
    """(N,) int32 lengths clamped to [0, limit]; None means ``limit`` for every row."""
    if lengths is None:
        return torch.full((n_rows,), limit, dtype=torch.int32, device=device)
    return lengths.to(device=device, dtype=torch.int32).clamp(0, limit)


def assemble_cache(cur: torch.Tensor, old: Optional[torch.Tensor], valid: torch.Tensor,
                   cached: torch.Tensor) -> torch.Tensor:
    """New attention cache per docs/design.md §2: row n = its first T_n current frames, then its first L_n
    old frames, contiguous from frame 0; frames after T_n + L_n are zero.

    Args:
        cur: (N, H, T, 2D) current keys|values. old: (N, H, L, 2D) or None (L = 0).
        valid, cached: (N,) int32 clamped lengths T_n, L_n.
    Returns:
        (N, H, T + L, 2D) in cur's dtype.
    """
    n_rows, heads, t_len, width = cur.shape
    l_len = 0 if old is None else old.shape[2]
    frames = torch.arange(t_len + l_len, device=cur.device)[None, :]
    tn, ln = valid.long()[:, None], cached.long()[:, None]
    from_cur = frames < tn
    from_old = (frames >= tn) & (frames < tn + ln)
    cur_idx = frames.clamp(max=max(t_len - 1, 0)).expand(n_rows, -1)
    out = torch.zeros(n_rows, heads, t_len + l_len, width, dtype=cur.dtype, device=cur.device)
    if t_len:
        g = torch.gather(cur, 2, cur_idx[:, None, :, None].expand(n_rows, heads, -1, width))
        out = torch.where(from_cur[:, None, :, None], g, out)
    if l_len:
        old_idx = (frames - tn).clamp(0, l_len - 1)
        g = torch.gather(old.to(cur.dtype), 2, old_idx[:, None, :, None].expand(n_rows, heads, -1, width))
        out = torch.where(from_old[:, None, :, None], g, out)
    return out


def _ln(x: torch.Tensor, eps: float) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).square().mean(-1, keepdim=True)
    return (x - mean) * torch.rsqrt(var + eps)


def mish(x: torch.Tensor) -> torch.Tensor:
    return x * torch.tanh(torch.nn.functional.softplus(x))


def _conv_taps(hist: torch.Tensor, w_taps: torch.Tensor, bias: torch.Tensor, t_len: int,
               stat: torch.dtype) -> torch.Tensor:
    """Causal conv over (N, 2+T, Cin) history as one GEMM producing k taps, summed in ``stat``."""
    z = torch.matmul(hist, w_taps.t())  # (N, 2+T, k*C)
    c = bias.shape[0]
    k = w_taps.shape[0] // c
    out = bias.to(stat).expand(hist.shape[0], t_len, c).clone()
    for j in range(k):
        out = out + z[:, j:j + t_len, j * c:(j + 1) * c].to(stat)
    return out


def dit_body_reference(
    x_in: torch.Tensor,
    weights: list[torch.Tensor],
    mod_table: torch.Tensor,
    cnn_cache: Optional[torch.Tensor] = None,
    att_cache: Optional[torch.Tensor] = None,
    valid_lengths: Optional[torch.Tensor] = None,
    cache_lengths: Optional[torch.Tensor] = None,
    residual: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One estimator evaluation of a streaming chunk (docs/design.md §1-2) on packed weights.

    Args:
        x_in: (N, Cin, T) staged input ``concat(x, mu, spks, cond)``, compute dtype.
        weights: the packed body weight list (:mod:`torch_cfm.packing`), compute dtype.
        mod_table: (R, depth+1, 9, C) float32/float64, R in {1, N}.
        cnn_cache: (depth, N, 2C, 2) or None (zeros).
        att_cache: (depth, N, H, L, 2D) or None (L = 0).
        valid_lengths, cache_lengths: optional (N,) int32 (clamped to [0, T], [0, L]).
        residual: a dtype the residual stream is rounded to after each update, to measure a body that
            kept it narrower (None: float32, float64 for a float64 body, as every shipped kernel does).
    Returns:
        velocity (N, Cout, T), new_cnn_cache (depth, N, 2C, 2), new_att_cache
        (depth, N, H, T+L, 2D), all in x_in's dtype.
    """
    s = body_sizes(x_in, weights)
    cd = x_in.dtype
    stat = torch.float64 if cd == torch.float64 else torch.float32
    n_rows, _, t_len = x_in.shape
    c, heads, d, depth = s["hidden"], s["heads"], s["head_dim"], s["depth"]
    l_len = 0 if att_cache is None else att_cache.shape[3]
    dev = x_in.device
    valid = clamp_lengths(valid_lengths, n_rows, t_len, dev)
    cached = clamp_lengths(cache_lengths, n_rows, l_len, dev)
    table = mod_table.to(stat)
    keep = (lambda t: t) if residual is None else (lambda t: t.to(residual).to(stat))  # noqa: E731

    def mod_vec(i: int, j: int) -> torch.Tensor:
        return table[:, i, j][:, None, :]  # (R, 1, C)

    def adaln(h: torch.Tensor, i: int, shift: int, scale: int) -> torch.Tensor:
        return (_ln(h, BLOCK_LN_EPS) * mod_vec(i, scale) + mod_vec(i, shift)).to(cd)

    def last_two(hist: torch.Tensor) -> torch.Tensor:  # (N, 2+T, C) -> (N, C, 2) at frames T_n, T_n+1
        idx = valid.long()[:, None] + torch.arange(2, device=dev)[None, :]
        return torch.gather(hist, 1, idx[:, :, None].expand(-1, -1, hist.shape[2])).transpose(1, 2)

    xt = x_in.transpose(1, 2)
    h = keep((torch.matmul(xt, weights[0].t()) + weights[1]).to(cd).to(stat))
    new_cnn = x_in.new_zeros((depth, n_rows, 2 * c, 2))
    new_att = x_in.new_zeros((depth, n_rows, heads, t_len + l_len, 2 * d))
    for i in range(depth):
        (qkv_w, qkv_b, qn_w, qn_b, kn_w, kn_b, proj_w, proj_b, c1_w, c1_b, cn_w, cn_b,
         c2_w, c2_b, fc1_w, fc1_b, fc2_w, fc2_b) = block_weights(weights, i)
        conv_old = (cnn_cache[i].to(cd) if cnn_cache is not None
                    else x_in.new_zeros((n_rows, 2 * c, 2)))
        # attention
        a = adaln(h, i, SHIFT_A, SCALE_A)
        qkv = (torch.matmul(a, qkv_w.t()) + qkv_b).to(cd).view(n_rows, t_len, 3, heads, d)
        q = (_ln(qkv[:, :, 0].to(stat), QK_NORM_EPS) * qn_w.to(stat) + qn_b.to(stat)).to(cd)
        k = (_ln(qkv[:, :, 1].to(stat), QK_NORM_EPS) * kn_w.to(stat) + kn_b.to(stat)).to(cd)
        v = qkv[:, :, 2]
        cur = torch.cat([k, v], dim=-1).transpose(1, 2)  # (N, H, T, 2D)
        cache_i = assemble_cache(cur, None if att_cache is None else att_cache[i], valid, cached)
        new_att[i] = cache_i
        o = cfm_attention_reference(q.transpose(1, 2), cache_i[..., :d], cache_i[..., d:],
                                    key_lengths=valid + cached)
        y = (torch.matmul(o.transpose(1, 2).reshape(n_rows, t_len, heads * d), proj_w.t()) + proj_b).to(cd)
        h = keep(h + mod_vec(i, GATE_A) * y.to(stat))
        # conv block (before the MLP)
        a = adaln(h, i, SHIFT_C, SCALE_C)
        hist1 = torch.cat([conv_old[:, :c].transpose(1, 2), a], dim=1)
        u = _conv_taps(hist1, c1_w, c1_b, t_len, stat)
        m = mish(_ln(u, CONV_LN_EPS) * cn_w.to(stat) + cn_b.to(stat)).to(cd)
        hist2 = torch.cat([conv_old[:, c:].transpose(1, 2), m], dim=1)
        y = _conv_taps(hist2, c2_w, c2_b, t_len, stat)
        new_cnn[i, :, :c] = last_two(hist1)
        new_cnn[i, :, c:] = last_two(hist2)
        h = keep(h + mod_vec(i, GATE_C) * y)
        # MLP
        a = adaln(h, i, SHIFT_M, SCALE_M)
        f = torch.nn.functional.gelu((torch.matmul(a, fc1_w.t()) + fc1_b).to(cd), approximate="tanh")
        y = (torch.matmul(f, fc2_w.t()) + fc2_b).to(cd)
        h = keep(h + mod_vec(i, GATE_M) * y.to(stat))
    a = adaln(h, depth, 0, 1)
    out = (torch.matmul(a, weights[-2].t()) + weights[-1]).to(cd)
    return out.transpose(1, 2).contiguous(), new_cnn, new_att


__all__ = ["dit_body_reference", "assemble_cache", "body_sizes", "clamp_lengths", "mish"]
