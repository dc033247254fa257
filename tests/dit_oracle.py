"""An independent, deliberately plain implementation of docs/design.md §1-3 (the DiT and the CFM solve).

Written from the SPEC text only: no torch_cfm import, no nn.Module, explicit per-row loops and
explicit formulas (LayerNorm, Mish, GELU-tanh, causal conv as a sum of taps, softmax over the
valid keys only). It works on a plain state dict (upstream key names) in any float dtype
(float64 for the oracle). Slow on purpose; use tiny configs.

Per-row conventions (one row = one sequence):
    x, mu, cond: (80, T); spks: (80,); t: python float.
    cnn: (depth, 2C, 2) conv cache or None; att: (depth, H, L, 2D) attention cache or None.
"""

from __future__ import annotations

import math

import torch

LN_BLOCK_EPS = 1e-6
LN_QK_EPS = 1e-5
LN_CONV_EPS = 1e-5


def to_dtype(sd: dict, dtype=torch.float64, device="cpu") -> dict:
    return {k: v.detach().to(device=device, dtype=dtype) for k, v in sd.items()}


def linear(x, sd, name):
    return x @ sd[name + ".weight"].T + sd[name + ".bias"]


def layer_norm(x, eps, weight=None, bias=None):
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
    y = (x - mean) / torch.sqrt(var + eps)
    if weight is not None:
        y = y * weight + bias
    return y


def silu(x):
    return x / (1 + torch.exp(-x))


def mish(x):
    softplus = torch.logaddexp(x, torch.zeros_like(x))
    return x * torch.tanh(softplus)


def gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def time_embedding(sd, t: float, dtype, device):
    j = torch.arange(128, dtype=torch.float64)
    w = torch.exp(-math.log(10000.0) * j / 128)
    f = torch.cat([torch.cos(1000.0 * t * w), torch.sin(1000.0 * t * w)]).to(device=device, dtype=dtype)
    return linear(silu(linear(f, sd, "t_embedder.mlp.0")), sd, "t_embedder.mlp.2")  # (C,)


def dims(sd):
    depth = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
    c = sd["in_proj.weight"].shape[0]
    d = sd["blocks.0.attn.q_norm.weight"].shape[0]
    h = sd["blocks.0.attn.to_q.weight"].shape[0] // d
    return depth, c, h, d


def modulations(sd, t: float, dtype=torch.float64, device="cpu"):
    """list of depth dicts {slot: (C,)} plus the final (shift, scale)."""
    depth, c, _, _ = dims(sd)
    s = silu(time_embedding(sd, t, dtype, device))
    names = ["shift_a", "scale_a", "gate_a", "shift_m", "scale_m", "gate_m", "shift_c", "scale_c", "gate_c"]
    blocks = []
    for i in range(depth):
        m = linear(s, sd, f"blocks.{i}.adaLN_modulation.1")
        blocks.append({names[j]: m[j * c:(j + 1) * c] for j in range(9)})
    fm = linear(s, sd, "final_layer.adaLN_modulation.1")
    return blocks, (fm[:c], fm[c:])


def causal_conv(ext, weight, bias):
    """ext (hist + T, C) time-major; weight (C, C, k) -> (T, C) = bias + sum_k W_k ext[t + k]."""
    k = weight.shape[2]
    t_len = ext.shape[0] - (k - 1)
    out = bias.expand(t_len, -1).clone()
    for tap in range(k):
        out = out + ext[tap:tap + t_len] @ weight[:, :, tap].T
    return out


def row_forward(sd, x, mu, t, spks, cond, cnn=None, att=None, key_valid=None):
    """One row. Returns (velocity (80, T), new cnn (depth, 2C, 2), new att (depth, H, T+L, 2D)).

    key_valid: optional bool (T+L,) over the keys [current ; cache] (all valid when None).
    """
    depth, c, heads, d = dims(sd)
    dtype, device = x.dtype, x.device
    t_len = x.shape[1]
    mods, (f_shift, f_scale) = modulations(sd, t, dtype, device)
    x_in = torch.cat([x, mu, spks[:, None].expand(-1, t_len), cond], dim=0).T  # (T, 320)
    h = linear(x_in, sd, "in_proj")
    new_cnn, new_att = [], []
    for i in range(depth):
        p = f"blocks.{i}."
        m = mods[i]
        # attention
        a_in = layer_norm(h, LN_BLOCK_EPS) * (1 + m["scale_a"]) + m["shift_a"]
        q = linear(a_in, sd, p + "attn.to_q").view(t_len, heads, d)
        k = linear(a_in, sd, p + "attn.to_k").view(t_len, heads, d)
        v = linear(a_in, sd, p + "attn.to_v").view(t_len, heads, d)
        q = layer_norm(q, LN_QK_EPS, sd[p + "attn.q_norm.weight"], sd[p + "attn.q_norm.bias"])
        k = layer_norm(k, LN_QK_EPS, sd[p + "attn.k_norm.weight"], sd[p + "attn.k_norm.bias"])
        cur = torch.cat([k, v], dim=-1).permute(1, 0, 2)  # (H, T, 2D)
        kv = cur if att is None else torch.cat([cur, att[i]], dim=1)  # current keys first
        new_att.append(kv)
        n_keys = kv.shape[1]
        valid = torch.ones(n_keys, dtype=torch.bool, device=device) if key_valid is None else key_valid
        o = torch.zeros(t_len, heads, d, dtype=dtype, device=device)
        for hh in range(heads):
            keys, vals = kv[hh, valid, :d], kv[hh, valid, d:]
            if keys.shape[0] == 0:
                continue
            scores = q[:, hh] @ keys.T / math.sqrt(d)
            probs = torch.softmax(scores, dim=-1)
            o[:, hh] = probs @ vals
        h = h + m["gate_a"] * linear(o.reshape(t_len, heads * d), sd, p + "attn.proj")
        # causal conv block (before the MLP)
        c_in = layer_norm(h, LN_BLOCK_EPS) * (1 + m["scale_c"]) + m["shift_c"]
        hist1 = torch.zeros(2, c, dtype=dtype, device=device) if cnn is None else cnn[i][:c].mT
        hist2 = torch.zeros(2, c, dtype=dtype, device=device) if cnn is None else cnn[i][c:].mT
        ext1 = torch.cat([hist1, c_in], dim=0)
        y = causal_conv(ext1, sd[p + "conv.block.1.weight"], sd[p + "conv.block.1.bias"])
        y = mish(layer_norm(y, LN_CONV_EPS, sd[p + "conv.block.3.weight"], sd[p + "conv.block.3.bias"]))
        ext2 = torch.cat([hist2, y], dim=0)
        y = causal_conv(ext2, sd[p + "conv.block.6.weight"], sd[p + "conv.block.6.bias"])
        new_cnn.append(torch.cat([ext1[-2:].T, ext2[-2:].T], dim=0))  # (2C, 2)
        h = h + m["gate_c"] * y
        # MLP
        m_in = layer_norm(h, LN_BLOCK_EPS) * (1 + m["scale_m"]) + m["shift_m"]
        y = linear(gelu_tanh(linear(m_in, sd, p + "mlp.fc1")), sd, p + "mlp.fc2")
        h = h + m["gate_m"] * y
    out = linear(layer_norm(h, LN_BLOCK_EPS) * (1 + f_scale) + f_shift, sd, "final_layer.linear")
    return out.T, torch.stack(new_cnn), torch.stack(new_att)


def batch_forward(sd, x, mask, mu, t, spks=None, cond=None):
    """Full forward of docs/design.md §1 with a (N, 1, T) key mask, row by row: (N, 80, T)."""
    outs = []
    for n in range(x.shape[0]):
        s = torch.zeros(x.shape[1], dtype=x.dtype) if spks is None else spks[n]
        cnd = torch.zeros_like(x[n]) if cond is None else cond[n]
        v, _, _ = row_forward(sd, x[n], mu[n], float(t[n]), s, cnd, key_valid=mask[n, 0].bool())
        outs.append(v)
    return torch.stack(outs)


def batch_chunk(sd, x, mu, t, spks, cond, cnn=None, att=None, valid_lengths=None, cache_lengths=None):
    """Ragged chunk forward (docs/design.md §2) row by row on the VALID parts only.

    Returns lists per row: velocity (80, T_n), cnn (depth, 2C, 2), att (depth, H, T_n + L_n, 2D).
    """
    vels, cnns, atts = [], [], []
    for n in range(x.shape[0]):
        tn = x.shape[2] if valid_lengths is None else int(valid_lengths[n])
        ln = (0 if att is None else att.shape[3]) if cache_lengths is None else int(cache_lengths[n])
        a = None if att is None else att[:, n, :, :ln]
        c = None if cnn is None else cnn[:, n]
        v, nc, na = row_forward(sd, x[n, :, :tn], mu[n, :, :tn], float(t[n]), spks[n], cond[n, :, :tn], c, a)
        vels.append(v)
        cnns.append(nc)
        atts.append(na)
    return vels, cnns, atts


def cosine_schedule(n):
    return [1 - math.cos(math.pi / 2 * i / n) for i in range(n + 1)]


def solve_request(sd, mu, spks, cond, noise, n_steps=10, cfg_rate=0.7, cnn=None, att=None):
    """One request's chunk solve (docs/design.md §3), its two CFG rows computed separately.

    mu, cond (80, T); spks (80,); noise (1, 80, F); cnn: (n, depth, 2, 2C, 2) or None; att:
    (n, depth, 2, H, L, 2D) or None, index 0 of the third axis = cond row, 1 = uncond row.
    Returns mel (80, T), cnn (n, depth, 2, 2C, 2), att (n, depth, 2, H, T + L, 2D).
    """
    t_len = mu.shape[1]
    offset = 0 if att is None else att.shape[4]
    x = noise[0, :, offset:offset + t_len].to(mu.dtype).clone()
    ts = cosine_schedule(n_steps)
    zeros_mel, zeros_spk = torch.zeros_like(mu), torch.zeros_like(spks)
    cnn_out, att_out = [], []
    for i in range(n_steps):
        rows = []
        for half, (m, s, c) in enumerate(((mu, spks, cond), (zeros_mel, zeros_spk, zeros_mel))):
            rows.append(row_forward(sd, x, m, ts[i], s, c,
                                    None if cnn is None else cnn[i][:, half],
                                    None if att is None else att[i][:, half]))
        (vc, cc, ac), (vu, cu, au) = rows
        v = (1 + cfg_rate) * vc - cfg_rate * vu
        x = x + (ts[i + 1] - ts[i]) * v
        cnn_out.append(torch.stack([cc, cu], dim=1))
        att_out.append(torch.stack([ac, au], dim=1))
    return x, torch.stack(cnn_out), torch.stack(att_out)


def trim(att, prompt_len, keep_oldest=100):
    """docs/design.md §3 streaming trim on the frame axis (-2) of a newest-first cache."""
    frames = att.shape[-2]
    if frames <= prompt_len + keep_oldest:
        return att
    return torch.cat([att[..., :prompt_len, :], att[..., frames - keep_oldest:, :]], dim=-2)
