"""Shapes and constants of torch_cfm: the one home for every number docs/design.md fixes.

``DiTConfig`` describes the estimator (defaults = the shipped MiniCPM-o 4.5 / Step-Audio2 token2wav
checkpoint); ``SolverConfig`` the CFM solve. Tests build tiny configs from the same classes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# --- cfm_attention capabilities (read by the op checks, policy, explain and tests) -------------
ATTENTION_HEAD_DIMS: tuple[int, ...] = (16, 32, 64, 128)
ATTENTION_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
ATTENTION_PRECISIONS: tuple[str, ...] = ("auto", "tf32", "ieee")
MIN_CAPABILITY: tuple[int, int] = (8, 0)  # Triton kernels and the fused body: NVIDIA SM80+

# --- numerics -----------------------------------------------------------------------------------
BLOCK_LN_EPS = 1e-6  # adaLN LayerNorm (no affine) at every block boundary and the final layer
QK_NORM_EPS = 1e-5  # q/k LayerNorm over D (affine)
CONV_LN_EPS = 1e-5  # LayerNorm between the two causal convs (affine)
TIME_EMBED_DIM = 256  # sinusoidal features: 128 cos | 128 sin
TIME_EMBED_SCALE = 1000.0
TIME_EMBED_MAX_PERIOD = 10000.0


@dataclass(frozen=True)
class DiTConfig:
    """The estimator's sizes. Defaults are the shipped checkpoint (docs/design.md §1).

    Attributes:
        in_channels: channels of ``concat(x, mu, spks, cond)`` (320 = 4 x 80).
        out_channels: mel channels (80).
        hidden: C, the residual width (512).
        depth: number of DiT blocks (16).
        heads: H attention heads (8).
        head_dim: D per head (64); the attention inner width is H*D.
        mlp_ratio: MLP hidden = mlp_ratio * C (4).
        conv_kernel: causal conv taps (3); the conv cache holds ``conv_kernel - 1`` frames.
    """

    in_channels: int = 320
    out_channels: int = 80
    hidden: int = 512
    depth: int = 16
    heads: int = 8
    head_dim: int = 64
    mlp_ratio: int = 4
    conv_kernel: int = 3

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def mlp_hidden(self) -> int:
        return self.mlp_ratio * self.hidden

    @property
    def conv_cache_frames(self) -> int:
        return self.conv_kernel - 1

    def __post_init__(self) -> None:
        for name in ("in_channels", "out_channels", "hidden", "depth", "heads", "head_dim",
                     "mlp_ratio", "conv_kernel"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"DiTConfig: {name} must be a positive int, got {value!r}")
        if self.head_dim not in ATTENTION_HEAD_DIMS:
            raise ValueError(
                f"DiTConfig: head_dim must be one of {ATTENTION_HEAD_DIMS}, got {self.head_dim}")


@dataclass(frozen=True)
class SolverConfig:
    """The streaming CFM solve (docs/design.md §3)."""

    n_timesteps: int = 10
    cfg_rate: float = 0.7
    noise_frames: int = 30000
    mel_channels: int = 80
    chunk_frames: int = 50  # 1 s of audio at 50 mel frames/s
    trim_keep_oldest: int = 100  # the upstream streaming trim keeps the oldest 100 frames


def cosine_timesteps(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``t_i = 1 - cos(pi/2 * i/n)`` for i = 0..n: (n+1,) on CPU."""
    i = torch.arange(n + 1, dtype=torch.float64)
    return (1.0 - torch.cos(0.5 * math.pi * i / n)).to(dtype)


# The benchmark shapes of docs/design.md §7, used by bench/ and the GPU tests.
ATTENTION_BENCH_SHAPES: tuple[tuple[int, int, int], ...] = (
    (2, 50, 450), (8, 50, 450), (16, 50, 450), (32, 50, 450),
    (8, 100, 500), (16, 150, 524), (8, 300, 300),
)
BODY_BENCH_SHAPES: tuple[tuple[int, int, int], ...] = (
    (2, 50, 400), (8, 50, 400), (32, 50, 400), (2, 100, 400), (8, 100, 400), (32, 100, 400),
)
