"""The DiT estimator of docs/design.md §1-2: checkpoint-compatible, streaming (cached) and ragged.

Submodule names and parameter shapes follow the upstream token2wav flow estimator (docs/design.md §1 table),
so ``load_state_dict`` of an upstream estimator works unchanged (:func:`load_checkpoint` and
``DiT.from_checkpoint`` read whole flow checkpoints too, through :mod:`torch_cfm.models.checkpoint`).
Two entry points:

* ``forward(x, mask, mu, t, spks, cond)``: the full (non-streaming) forward; ``mask`` only masks
  attention keys, as upstream.
* ``forward_chunk(x, mu, t, spks, cond, cnn_cache, att_cache, *, valid_lengths, cache_lengths)``:
  one streaming chunk with per-block attention and conv caches (docs/design.md §2 layouts), optionally ragged.

The reference path (plain PyTorch + :func:`torch_cfm.cfm_attention`) reads tensor metadata only,
never data: no host synchronisation, so it can be captured in a CUDA graph. When
:func:`torch_cfm.policy.decide` says "fused", ``forward_chunk`` hands over to
:func:`torch_cfm.models.fused_forward.dit_forward_chunk_fused`.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from .. import policy
from ..config import DiTConfig
from ..errors import dtype_str, fail, shape_str
from ..ops.dit_step_marker import mark_dit_step
from .checkpoint import Source, check_state_dict, config_from_state_dict, estimator_state_dict
from .dit_blocks import ChunkLayout, DiTBlock, FinalLayer, TimestepEmbedder
from .fused_forward import dit_forward_chunk_fused

# Modulation slots of a block, in the order the adaLN linear produces them (docs/design.md §1).
MOD_SLOTS = ("shift_a", "scale_a", "gate_a", "shift_m", "scale_m", "gate_m",
             "shift_c", "scale_c", "gate_c")
SCALE_SLOTS = (1, 4, 7)

TimeLike = Union[float, torch.Tensor]


def _exporting() -> bool:
    """True while torch.export traces. ``torch.compiler.is_exporting()`` itself is folded to True
    by Dynamo under every torch.compile before torch 2.13 (pytorch/pytorch#164721; on torch 2.11
    the model would never mark its step), so the flag it reads is read directly."""
    return bool(getattr(torch.compiler, "_is_exporting_flag", False))


def _as_time_vector(t: TimeLike, n_rows: int, device: torch.device, op: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        if isinstance(t, (int, float)):
            return torch.full((n_rows,), float(t), device=device)
        fail(op, "t", "be a float or a tensor of shape () or (N,)", type(t).__name__)
    if t.dim() == 0 or (t.dim() == 1 and t.shape[0] == 1):
        return t.reshape(1).expand(n_rows)
    if t.dim() == 1 and t.shape[0] == n_rows:
        return t
    fail(op, "t", f"have shape () or (N,)=({n_rows},)", shape_str(t))
    raise AssertionError  # unreachable


# --------------------------------------------------------------------------------------------
# The estimator
# --------------------------------------------------------------------------------------------


class DiT(nn.Module):
    """The CFM velocity estimator (docs/design.md §1): 16 adaLN-Zero blocks of attention, causal conv, MLP.

    Parameter names/shapes equal the upstream checkpoint's (``t_embedder.mlp.{0,2}``, ``in_proj``,
    ``blocks.i.{attn,mlp,conv.block.{1,3,6},adaLN_modulation.1}``, ``final_layer.{linear,
    adaLN_modulation.1}``), so upstream ``load_state_dict`` works unchanged.

    Args:
        config: sizes (default: the shipped checkpoint, see :class:`torch_cfm.config.DiTConfig`).
    Shapes: N rows, T frames, L cached frames, C hidden, H heads, D head dim, M = out_channels (80).
    Example:
        >>> model = DiT(DiTConfig(hidden=64, depth=2, heads=4, head_dim=16)).random_init_(0)
        >>> x = torch.randn(2, 80, 10)
        >>> v, cnn, att = model.forward_chunk(x, x, torch.rand(2), torch.randn(2, 80), x)
        >>> v.shape, cnn.shape, att.shape
        (torch.Size([2, 80, 10]), torch.Size([2, 2, 128, 2]), torch.Size([2, 2, 4, 10, 32]))
    """

    def __init__(self, config: Optional[DiTConfig] = None) -> None:
        super().__init__()
        config = DiTConfig() if config is None else config
        if config.in_channels != 4 * config.out_channels:
            fail("DiT", "config.in_channels", f"be 4 x out_channels = {4 * config.out_channels} "
                 "(concat of x, mu, spks, cond)", str(config.in_channels))
        self.config = config
        c = config.hidden
        self.t_embedder = TimestepEmbedder(c)
        self.in_proj = nn.Linear(config.in_channels, c)
        self.blocks = nn.ModuleList([DiTBlock(config) for _ in range(config.depth)])
        self.final_layer = FinalLayer(c, config.out_channels)

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_checkpoint(cls, source, config: Optional[DiTConfig] = None) -> "DiT":
        """A DiT with upstream weights from a path or mapping (estimator state_dict or flow
        checkpoint); the config is read from the shapes unless given. See
        :func:`load_checkpoint` (ValueError lists bad keys)."""
        sd = estimator_state_dict(source)
        return load_checkpoint(cls(config_from_state_dict(sd) if config is None else config), sd)

    @torch.no_grad()
    def random_init_(self, seed: int = 0) -> "DiT":
        """Seeded random weights of realistic scale (not the adaLN-Zero zero init); returns self.

        Linear/conv weights ~ U(±1/√fan_in) (PyTorch's default scale), biases ~ 0.02·N(0,1);
        LayerNorm weights 1 + 0.1·N(0,1), biases 0.1·N(0,1); adaLN weights ~ N(0, 0.5/√C) and
        biases 0.1·N(0,1), so every gate is nonzero and the output depends on every parameter.
        Drawn on CPU in fp32 from ``torch.Generator().manual_seed(seed)``: the same weights on
        every device and dtype.
        """
        gen = torch.Generator().manual_seed(int(seed))
        c = self.config.hidden
        for name, p in self.named_parameters():
            if "adaLN_modulation" in name:
                val = (torch.randn(p.shape, generator=gen) * (0.5 / math.sqrt(c)) if name.endswith("weight")
                       else torch.randn(p.shape, generator=gen) * 0.1)
            elif name.endswith("norm.weight") or ".block.3." in name and name.endswith("weight"):
                val = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            elif name.endswith("norm.bias") or ".block.3." in name:
                val = 0.1 * torch.randn(p.shape, generator=gen)
            elif name.endswith("weight"):
                fan_in = p[0].numel()
                val = (torch.rand(p.shape, generator=gen) * 2 - 1) / math.sqrt(fan_in)
            else:
                val = 0.02 * torch.randn(p.shape, generator=gen)
            p.copy_(val)
        return self

    # ---------------------------------------------------------------- modulation
    def compute_dtype(self, device_type: str) -> torch.dtype:
        """The dtype the estimator computes in: the autocast dtype when autocast is on, else
        the parameters' dtype."""
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
        return self.in_proj.weight.dtype

    @torch.no_grad()
    def modulation_table(self, t_or_temb: TimeLike, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The per-step modulation table (depth+1, 9, C), computed from ONE row's time.

        Row i < depth holds block i's 9 vectors in the contract's order (shift_a, scale_a, gate_a, shift_m,
        scale_m, gate_m, shift_c, scale_c, gate_c) with ``1 + scale`` stored in the scale slots
        (1, 4, 7). Row ``depth`` is the final layer: slot 0 = shift, slot 1 = 1 + scale, slots
        2..8 = 0. All rows of a solve share t, so one table serves a whole Euler step.

        Args:
            t_or_temb: a time (python float, () or (1,) tensor) or a time embedding (C,), (1, C)
                or (1, 1, C) (the output of ``t_embedder``).
            dtype: dtype of the math and of the result (default float32: parameters are upcast).
        Returns:
            (depth+1, 9, C) tensor in ``dtype`` on the parameters' device.
        """
        cfg = self.config
        dev = self.in_proj.weight.device
        if isinstance(t_or_temb, torch.Tensor) and t_or_temb.numel() == cfg.hidden and cfg.hidden > 1:
            temb = t_or_temb.reshape(1, cfg.hidden).to(device=dev, dtype=dtype)
        else:
            if isinstance(t_or_temb, torch.Tensor) and t_or_temb.numel() != 1:
                fail("DiT.modulation_table", "t_or_temb", f"be a scalar time or a ({cfg.hidden},) "
                     "time embedding", shape_str(t_or_temb))
            t_vec = _as_time_vector(t_or_temb, 1, dev, "DiT.modulation_table").to(dev)
            mlp = self.t_embedder.mlp
            f = TimestepEmbedder.features(t_vec).to(dtype)
            temb = F.linear(F.silu(F.linear(f, mlp[0].weight.to(dtype), mlp[0].bias.to(dtype))),
                            mlp[2].weight.to(dtype), mlp[2].bias.to(dtype))
        s = F.silu(temb)
        table = torch.zeros(cfg.depth + 1, 9, cfg.hidden, device=dev, dtype=dtype)
        for i, blk in enumerate(self.blocks):
            lin = blk.adaLN_modulation[1]
            table[i] = F.linear(s, lin.weight.to(dtype), lin.bias.to(dtype)).view(9, cfg.hidden)
        lin = self.final_layer.adaLN_modulation[1]
        table[cfg.depth, :2] = F.linear(s, lin.weight.to(dtype), lin.bias.to(dtype)).view(2, cfg.hidden)
        table[:cfg.depth, list(SCALE_SLOTS)] += 1
        table[cfg.depth, 1] += 1
        return table

    # ---------------------------------------------------------------- forwards
    def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: TimeLike,
                spks: Optional[torch.Tensor] = None, cond: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Full (non-streaming) forward: the velocity estimate for every frame.

        ``mask`` marks valid frames; as upstream it only masks attention KEYS (a query of a
        padded frame is still computed, from the valid keys). Convs see zero history.

        Args:
            x, mu: (N, 80, T) float.
            mask: (N, 1, T) bool or 0/1 float/int: valid frames (any pattern, not only prefixes).
            t: (N,) or () times in [0, 1], or a python float.
            spks: optional (N, 80) speaker embedding (None = zeros).
            cond: optional (N, 80, T) prompt mel (None = zeros).
        Returns:
            (N, 80, T) velocity in the compute dtype.
        Raises:
            ValueError: bad shapes (the message names the argument).
        """
        op = "DiT.forward"
        x, mu, spks, cond = self._check_inputs(op, x, mu, spks, cond)
        n_rows, _, t_len = x.shape
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) not in ((n_rows, 1, t_len), (n_rows, t_len)):
            fail(op, "mask", f"have shape (N, 1, T)=({n_rows}, 1, {t_len})",
                 shape_str(mask) if isinstance(mask, torch.Tensor) else type(mask).__name__)
        key_mask = mask.reshape(n_rows, 1, t_len).to(device=x.device, dtype=torch.bool).expand(n_rows, t_len, t_len)
        layout = ChunkLayout(None, key_mask, None, None)
        velocity, _, _ = self._reference(x, mu, t, spks, cond, None, None, layout)
        return velocity

    def forward_chunk(
        self,
        x: torch.Tensor,
        mu: torch.Tensor,
        t: TimeLike,
        spks: Optional[torch.Tensor],
        cond: Optional[torch.Tensor],
        cnn_cache: Optional[torch.Tensor] = None,
        att_cache: Optional[torch.Tensor] = None,
        *,
        valid_lengths: Optional[torch.Tensor] = None,
        cache_lengths: Optional[torch.Tensor] = None,
        fused: Optional[bool] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One streaming chunk with caches (docs/design.md §2), the upstream ``forward_chunk`` signature.

        Attention of block i sees ``K = [k_cur ; k_cache]`` (current keys FIRST; no causal mask
        inside the chunk) and the new cache is that concatenation. Conv input is
        ``[cache ; chunk]``; the new conv cache is its last 2 frames. Ragged rows: row n uses its
        first ``T_n = valid_lengths[n]`` frames and first ``L_n = cache_lengths[n]`` cache frames
        (others masked); its new attention cache is its T_n current frames then its L_n old
        frames, contiguous from frame 0 (padding after ``T_n + L_n``); its new conv cache is the
        last 2 frames of ``[cache ; chunk[:T_n]]``. Outputs at frames >= T_n are padding (finite).
        Lengths are clamped to [0, T] / [0, L] on the device (never read on the host).

        Args:
            x, mu: (N, 80, T) float.
            t: (N,) or () times, or a python float.
            spks: (N, 80) or None (zeros). cond: (N, 80, T) or None (zeros).
            cnn_cache: (depth, N, 2C, 2) or None (zero history). Channels [0, C) feed conv 1,
                [C, 2C) conv 2.
            att_cache: (depth, N, H, L, 2D) or None (L = 0); K in ``[..., :D]``, V in ``[..., D:]``;
                any strides (e.g. a window of a larger arena).
            valid_lengths: optional (N,) int32 T_n (default T for every row).
            cache_lengths: optional (N,) int32 L_n (default L for every row).
            fused: force (True) / forbid (False) the fused body; None = policy (docs/design.md §5).
        Returns:
            velocity (N, 80, T), new_cnn_cache (depth, N, 2C, 2), new_att_cache
            (depth, N, H, T+L, 2D), all in the compute dtype (freshly allocated).
        Raises:
            ValueError: bad shapes/dtypes/devices (the message names the argument).
        Graph safety: reference path has no host sync (CUDA-graph capturable).
        """
        op = "DiT.forward_chunk"
        x, mu, spks, cond = self._check_inputs(op, x, mu, spks, cond)
        self._check_caches(op, x, cnn_cache, att_cache, valid_lengths, cache_lengths)
        _as_time_vector(t, x.shape[0], x.device, op)  # validates t's shape (metadata only)
        cdt = self.compute_dtype(x.device.type)
        decision = policy.decide(x.device, cdt, fused=fused)
        compiling = torch.compiler.is_compiling()
        # Under torch.compile the compile rules decide (they swap the marked step below).
        if decision.fused and not compiling:
            return dit_forward_chunk_fused(self, x, mu, t, spks, cond, cnn_cache, att_cache,
                                           valid_lengths=valid_lengths, cache_lengths=cache_lengths,
                                           precision=decision.precision)
        n_rows, _, t_len = x.shape
        layout = self._chunk_layout(n_rows, t_len, x.device, att_cache, valid_lengths, cache_lengths)
        scope = (policy.tf32_scope(decision.tf32) if x.device.type == "cuda" and cdt == torch.float32
                 else contextlib.nullcontext())
        with scope:
            out = self._reference(x, mu, t, spks, cond, cnn_cache, att_cache, layout)
        # One site for torch_cfm.compile_rules (swapped for dit_body when allowed). Not under
        # torch.export: an exported program must run from the C++ schemas alone (AOTInductor).
        if compiling and not _exporting():
            mark_dit_step(self, out, x, mu, t, spks, cond, cnn_cache, att_cache,
                          valid_lengths=valid_lengths, cache_lengths=cache_lengths, fused=fused)
        return out

    # ---------------------------------------------------------------- internals
    def _chunk_layout(self, n_rows: int, t_len: int, device: torch.device, att_cache: Optional[torch.Tensor],
                      valid_lengths: Optional[torch.Tensor], cache_lengths: Optional[torch.Tensor]) -> ChunkLayout:
        cfg = self.config
        cache_len = 0 if att_cache is None else att_cache.shape[3]
        if valid_lengths is None and cache_lengths is None:
            return ChunkLayout(None, None, None, None)
        if valid_lengths is None:
            vl = torch.full((n_rows,), t_len, dtype=torch.int64, device=device)
        else:
            vl = valid_lengths.to(torch.int64).clamp(0, t_len)
        if cache_lengths is None:
            cl = torch.full((n_rows,), cache_len, dtype=torch.int64, device=device)
        else:
            cl = cache_lengths.to(torch.int64).clamp(0, cache_len)
        key_lengths = (vl + cl).to(torch.int32)
        old_index = conv_index = None
        if valid_lengths is not None:
            if cache_len > 0:
                frames = torch.arange(cache_len, device=device)
                old_index = (vl[:, None] + frames[None]).view(n_rows, 1, cache_len, 1).expand(
                    n_rows, cfg.heads, cache_len, 2 * cfg.head_dim)
            hist = torch.arange(cfg.conv_cache_frames, device=device)
            conv_index = (vl[:, None] + hist[None]).view(n_rows, 1, -1).expand(
                n_rows, cfg.hidden, cfg.conv_cache_frames)
        return ChunkLayout(key_lengths, None, old_index, conv_index)

    def _reference(self, x, mu, t, spks, cond, cnn_cache, att_cache, layout: ChunkLayout):
        cfg = self.config
        n_rows, _, t_len = x.shape
        cdt = self.compute_dtype(x.device.type)
        t_vec = _as_time_vector(t, n_rows, x.device, "DiT.forward_chunk").to(x.device)
        temb = self.t_embedder(t_vec).unsqueeze(1)  # (N, 1, C)
        x_in = torch.cat([x, mu, spks[:, :, None].expand(-1, -1, t_len).to(x.dtype), cond], dim=1)
        h = self.in_proj(x_in.transpose(1, 2).to(self.in_proj.weight.dtype))  # (N, T, C)
        cache_len = 0 if att_cache is None else att_cache.shape[3]
        # Ragged rows leave frames [T_n + L, T + L) unwritten: zero them so padding stays finite
        # (a masked key still meets its value in the dot: NaN garbage would leak through 0 * NaN).
        alloc = torch.empty if layout.old_index is None else torch.zeros
        new_att = alloc((cfg.depth, n_rows, cfg.heads, t_len + cache_len, 2 * cfg.head_dim),
                        device=x.device, dtype=cdt)
        new_cnn = torch.empty((cfg.depth, n_rows, 2 * cfg.hidden, cfg.conv_cache_frames),
                              device=x.device, dtype=cdt)
        for i, blk in enumerate(self.blocks):
            h = blk(h, temb, None if att_cache is None else att_cache[i],
                    None if cnn_cache is None else cnn_cache[i], new_att[i], new_cnn[i], layout)
        out = self.final_layer(h, temb)  # (N, T, 80)
        return out.transpose(1, 2), new_cnn, new_att

    def _check_inputs(self, op, x, mu, spks, cond):
        cfg = self.config
        mel = cfg.out_channels
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[1] != mel:
            fail(op, "x", f"be a tensor of shape (N, {mel}, T)",
                 shape_str(x) if isinstance(x, torch.Tensor) else type(x).__name__)
        if not x.is_floating_point():
            fail(op, "x", "be a floating-point tensor", dtype_str(x.dtype))
        n_rows, _, t_len = x.shape
        for name, val in (("mu", mu), ("cond", cond)):
            if val is None and name == "cond":
                continue
            if not isinstance(val, torch.Tensor) or tuple(val.shape) != (n_rows, mel, t_len):
                fail(op, name, f"have x's shape (N, {mel}, T)=({n_rows}, {mel}, {t_len})",
                     shape_str(val) if isinstance(val, torch.Tensor) else type(val).__name__)
            if val.device != x.device:
                fail(op, name, f"be on x's device {x.device}", str(val.device))
        if spks is not None:
            if not isinstance(spks, torch.Tensor) or tuple(spks.shape) != (n_rows, mel):
                fail(op, "spks", f"have shape (N, {mel})=({n_rows}, {mel})",
                     shape_str(spks) if isinstance(spks, torch.Tensor) else type(spks).__name__)
            if spks.device != x.device:
                fail(op, "spks", f"be on x's device {x.device}", str(spks.device))
        else:
            spks = x.new_zeros((n_rows, mel))
        if cond is None:
            cond = torch.zeros_like(x)
        return x, mu.to(x.dtype), spks.to(x.dtype), cond.to(x.dtype)

    def _check_caches(self, op, x, cnn_cache, att_cache, valid_lengths, cache_lengths):
        cfg = self.config
        n_rows = x.shape[0]
        if cnn_cache is not None:
            expect = (cfg.depth, n_rows, 2 * cfg.hidden, cfg.conv_cache_frames)
            if not isinstance(cnn_cache, torch.Tensor) or tuple(cnn_cache.shape) != expect:
                fail(op, "cnn_cache", f"have shape (depth, N, 2C, {cfg.conv_cache_frames})={expect}",
                     shape_str(cnn_cache) if isinstance(cnn_cache, torch.Tensor) else type(cnn_cache).__name__)
            if cnn_cache.device != x.device:
                fail(op, "cnn_cache", f"be on x's device {x.device}", str(cnn_cache.device))
        if att_cache is not None:
            expect = (cfg.depth, n_rows, cfg.heads, "L", 2 * cfg.head_dim)
            ok = (isinstance(att_cache, torch.Tensor) and att_cache.dim() == 5
                  and tuple(att_cache.shape[:3]) == expect[:3] and att_cache.shape[4] == expect[4])
            if not ok:
                fail(op, "att_cache", "have shape (depth, N, H, L, 2D)="
                     f"({cfg.depth}, {n_rows}, {cfg.heads}, L, {2 * cfg.head_dim})",
                     shape_str(att_cache) if isinstance(att_cache, torch.Tensor) else type(att_cache).__name__)
            if att_cache.device != x.device:
                fail(op, "att_cache", f"be on x's device {x.device}", str(att_cache.device))
        for name, val in (("valid_lengths", valid_lengths), ("cache_lengths", cache_lengths)):
            if val is None:
                continue
            if not isinstance(val, torch.Tensor) or val.dtype != torch.int32 or tuple(val.shape) != (n_rows,):
                got = (f"{dtype_str(val.dtype)} {shape_str(val)}" if isinstance(val, torch.Tensor)
                       else type(val).__name__)
                fail(op, name, f"be int32 of shape (N,)=({n_rows},)", got)
            if val.device != x.device:
                fail(op, name, f"be on x's device {x.device}", str(val.device))


def load_checkpoint(model: Optional[DiT], source: Source, *, config: Optional[DiTConfig] = None) -> DiT:
    """Load upstream weights (estimator state_dict or flow checkpoint) into a DiT.

    Args:
        model: a :class:`DiT` to load into, or None to build one (from ``config``, else from the
            checkpoint's shapes).
        source: a path (``torch.save`` file, loaded with ``weights_only=True``) or a mapping.
        config: used only when ``model`` is None.
    Returns:
        the model with the weights (parameters keep the model's dtype/device).
    Raises:
        ValueError: unreadable file, not a state_dict, or keys/shapes that do not match (every
            missing, unexpected and mis-shaped key is listed).
    """
    sd = estimator_state_dict(source)
    if model is None:
        model = DiT(config_from_state_dict(sd) if config is None else config)
    check_state_dict(model, sd)
    model.load_state_dict(sd, strict=True)
    return model


def random_dit(config: Optional[DiTConfig] = None, seed: int = 0) -> DiT:
    """``DiT(config).random_init_(seed)``: seeded random weights of realistic scale."""
    return DiT(config).random_init_(seed)
