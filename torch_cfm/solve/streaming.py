"""``StreamingCFM``: the estimator with its fixed noise and schedule, and the upstream chunk call.

:meth:`StreamingCFM.forward_chunk` is the drop-in equivalent of the upstream decoder's chunk solve
(docs/design.md §3): B requests that share T and L, caches in and out in the upstream layout. It
solves through the one engine (:class:`~torch_cfm.solve.engine.ArenaSolver`) over a temporary
newest-first arena holding the given caches. The servers (:mod:`torch_cfm.serving`) keep their
streams in keyed arenas and call the engine directly.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..config import SolverConfig
from ..errors import fail, shape_str
from ..models.cache import CacheArena
from .engine import ArenaSolver
from .schedule import euler_timesteps

_SOLVER = SolverConfig()


class StreamingCFM(nn.Module):
    """Streaming conditional flow matching: the estimator plus the fixed noise (docs/design.md §3).

    Args:
        estimator: a :class:`~torch_cfm.models.DiT` (anything with its ``forward_chunk`` and a
            :class:`~torch_cfm.DiTConfig` ``config``).
        n_timesteps: Euler steps n (10).
        cfg_rate: classifier-free guidance r (0.7).
        noise: optional (1, 80, F) noise buffer; default drawn once, on CPU in fp32, from
            ``torch.Generator().manual_seed(seed)`` with F = 30000.
        seed: seed of the default noise.
    Attributes:
        noise: the (1, 80, F) buffer (a non-persistent module buffer: moves with ``.to()``).
    Example:
        >>> cfm = StreamingCFM(DiT(DiTConfig(hidden=64, depth=2, heads=4, head_dim=16)).random_init_())
        >>> mel, cnn, att = cfm.forward_chunk(torch.randn(1, 80, 20), torch.randn(1, 80), torch.zeros(1, 80, 20))
        >>> mel.shape, att.shape
        (torch.Size([1, 80, 20]), torch.Size([10, 2, 2, 4, 20, 32]))
    """

    def __init__(self, estimator: nn.Module, n_timesteps: int = _SOLVER.n_timesteps,
                 cfg_rate: float = _SOLVER.cfg_rate, noise: Optional[torch.Tensor] = None, seed: int = 0) -> None:
        super().__init__()
        op = "StreamingCFM"
        if not isinstance(n_timesteps, int) or n_timesteps <= 0:
            fail(op, "n_timesteps", "be a positive int", repr(n_timesteps))
        config = getattr(estimator, "config", None)
        if not all(hasattr(config, name) for name in ("out_channels", "depth", "heads", "head_dim", "hidden")):
            fail(op, "estimator", "be a torch_cfm DiT (or a module with its forward_chunk and a DiTConfig .config)",
                 type(estimator).__name__)
        mel = config.out_channels
        if noise is None:
            gen = torch.Generator().manual_seed(int(seed))
            noise = torch.randn((1, mel, _SOLVER.noise_frames), generator=gen)
        elif not isinstance(noise, torch.Tensor) or noise.dim() != 3 or noise.shape[:2] != (1, mel):
            fail(op, "noise", f"be a tensor of shape (1, {mel}, F)",
                 shape_str(noise) if isinstance(noise, torch.Tensor) else type(noise).__name__)
        self.estimator = estimator
        self.n_timesteps = n_timesteps
        self.cfg_rate = float(cfg_rate)
        self.register_buffer("noise", noise, persistent=False)

    def timesteps(self) -> list[float]:
        """The cosine schedule t_0..t_n as python floats."""
        return euler_timesteps(self.n_timesteps)

    def solver(self, fused: Optional[bool] = None, keep_oldest: int = _SOLVER.trim_keep_oldest) -> ArenaSolver:
        """An :class:`~torch_cfm.solve.engine.ArenaSolver` of this estimator and schedule."""
        return ArenaSolver(self.estimator, n_timesteps=self.n_timesteps, cfg_rate=self.cfg_rate,
                           keep_oldest=keep_oldest, fused=fused)

    def _check_caches(self, op: str, batch: int, cnn_cache, att_cache) -> None:
        for name, cache in (("cnn_cache", cnn_cache), ("att_cache", att_cache)):
            if cache is None:
                continue
            if not isinstance(cache, torch.Tensor) or cache.dim() not in (5, 6) or cache.shape[0] != self.n_timesteps \
                    or cache.shape[2] != 2 * batch:
                layout = "(n, depth, 2B, 2C, 2)" if name == "cnn_cache" else "(n, depth, 2B, H, L, 2D)"
                fail(op, name, f"have shape {layout} with n={self.n_timesteps}, 2B={2 * batch}",
                     shape_str(cache) if isinstance(cache, torch.Tensor) else type(cache).__name__)

    @torch.no_grad()
    def forward_chunk(self, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                      cnn_cache: Optional[torch.Tensor] = None, att_cache: Optional[torch.Tensor] = None,
                      fused: Optional[bool] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Solve one chunk for B requests that share T and L (the upstream call).

        Rows ``[cond × B | uncond × B]``; the first state is ``noise[:, :, L:L+T]`` (L = the
        attention cache length) for every request; n Euler steps with CFG; step i reads
        ``cnn_cache[i]`` / ``att_cache[i]`` and returns its new caches. No trim here (the caller
        applies :func:`~torch_cfm.models.cache.trim_attention_cache`, or uses a server).

        Args:
            mu: (B, 80, T); spks: (B, 80); cond: (B, 80, T).
            cnn_cache: (n, depth, 2B, 2C, 2) or None (zero history).
            att_cache: (n, depth, 2B, H, L, 2D) or None (L = 0).
            fused: force (True) / forbid (False) the fused body (None = policy).
        Returns:
            mel (B, 80, T) in mu's dtype, cnn caches (n, depth, 2B, 2C, 2), attention caches
            (n, depth, 2B, H, T+L, 2D) (compute dtype).
        Raises:
            ValueError: bad shapes, or ``L + T`` beyond the noise buffer.
        """
        op = "StreamingCFM.forward_chunk"
        if not isinstance(mu, torch.Tensor) or mu.dim() != 3:
            fail(op, "mu", "be a tensor of shape (B, 80, T)",
                 shape_str(mu) if isinstance(mu, torch.Tensor) else type(mu).__name__)
        batch, _, t_len = mu.shape
        self._check_caches(op, batch, cnn_cache, att_cache)
        offset = 0 if att_cache is None else att_cache.shape[4]
        if offset + t_len > self.noise.shape[2]:
            fail(op, "att_cache", f"leave room in the noise buffer: L + T <= {self.noise.shape[2]}",
                 f"L={offset}, T={t_len}", "trim the cache (trim_attention_cache)")
        arena = self._arena(mu, spks, cond, cnn_cache, att_cache)
        # the trim threshold lies past every length: nothing is trimmed
        noise = self.noise[:, :, :offset + t_len].to(mu.device)
        self.solver(fused, keep_oldest=offset + t_len)(arena, noise, t_len=t_len, cache_frames=offset)
        return arena.out_mel, arena.cnn, arena.att

    def _arena(self, mu, spks, cond, cnn_cache, att_cache) -> CacheArena:
        """A newest-first arena of T + L frames per cache holding the given caches; every request
        solves T frames from a cache of L."""
        cfg, dev = self.estimator.config, mu.device
        batch, _, t_len = mu.shape
        offset = 0 if att_cache is None else att_cache.shape[4]
        cdt = self.estimator.compute_dtype(dev.type) if hasattr(self.estimator, "compute_dtype") else mu.dtype
        rows, n = 2 * batch, self.n_timesteps
        att = torch.empty((n, cfg.depth, rows, cfg.heads, offset + t_len, 2 * cfg.head_dim), device=dev, dtype=cdt)
        if offset:
            att[..., :offset, :].copy_(att_cache)
        cnn = torch.zeros((n, cfg.depth, rows, 2 * cfg.hidden, cfg.conv_cache_frames), device=dev, dtype=cdt)
        if cnn_cache is not None:
            cnn.copy_(cnn_cache)
        lengths = dict(device=dev, dtype=torch.int32)
        return CacheArena(att=att, cnn=cnn, frame_keys=None, cache_lengths=torch.full((batch,), offset, **lengths),
                          prompt_lengths=torch.zeros((batch,), **lengths),
                          valid_lengths=torch.full((batch,), t_len, **lengths), mu=mu,
                          cond=torch.zeros_like(mu) if cond is None else cond.to(mu.dtype), spks=spks.to(mu.dtype),
                          out_mel=torch.empty_like(mu))


__all__ = ["StreamingCFM"]
