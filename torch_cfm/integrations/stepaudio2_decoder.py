"""``TorchCFMDecoder``: the torch_cfm solver installed on one upstream ``CausalConditionalCFM``.

The decoder's ``forward_chunk`` and ``forward`` (instance attributes set by
:func:`torch_cfm.integrations.stepaudio2.apply_torch_cfm`) solve with a torch_cfm
:class:`~torch_cfm.models.DiT` holding the upstream estimator's weights, the decoder's own
``rand_noise`` buffer and ``inference_cfg_rate``. Streaming chunks run through a one-slot
:class:`~torch_cfm.serving.CFMServer` (the whole n-step solve replayed from a CUDA graph on CUDA,
shapes rounded by the package's bucket policy); the non-streaming solve (``flow.inference``,
``Token2wav.__call__``) through :meth:`~torch_cfm.solve.StreamingCFM.forward_chunk`.

Cache contract of the accelerated ``forward_chunk`` (what ``inference_chunk`` stores in its cache
dict and ``Token2wav.stream`` trims): conv caches (n, depth, 2, 2C, 2) and attention caches
(n, depth, 2, H, T+L, 2D), newest key first, row 0 = cond, row 1 = uncond, n = ``n_timesteps``,
not trimmed (the caller trims, as upstream). The upstream returns views of its 16-step scratch
buffers, of which the first n are used: it accepts ours and we accept its (any leading size >= n).
The stream's state lives in the server: a call whose caches are exactly the tensors the previous
call returned (the same objects, not modified since) continues from it; other caches (trimmed by
the caller, or made by the upstream module) are loaded into the server first. So any mix of
callers, trims and upstream calls gives the upstream results.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch
from torch import nn

from ..buckets import Buckets, stream_solve_shapes
from ..errors import fail, shape_str
from ..graphs import GraphedCall
from ..models.cache import keyed_to_newest_first
from ..models.upstream import dit_from_decoder, placement
from ..serving import CFMServer, content_key
from ..solve import StreamingCFM
from .hift import GraphedHiFT

_RID = "stream"  # the one request of each server


@dataclass
class _Stream:
    """One-slot server of one n_timesteps and the caches it last returned."""

    server: CFMServer
    no_trim_len: int  # the prompt_len that puts the server's trim threshold at its capacity
    last: Optional[tuple] = None  # (cnn, att, cnn._version, att._version) returned by the last call
    solves: int = 0
    loads: int = 0

    @property
    def capacity(self) -> int:
        return self.server.max_cache_frames

    @property
    def cache_len(self) -> int:
        return self.server.cache_length(_RID)

    def reset(self, spks: torch.Tensor) -> None:
        if _RID in self.server.open_requests:
            self.server.close_request(_RID)
        self.server.open_request(_RID, spks, prompt_len=self.no_trim_len)
        self.last = None

    def holds(self, cnn: torch.Tensor, att: torch.Tensor) -> bool:
        if self.last is None:
            return False
        last_cnn, last_att, v_cnn, v_att = self.last
        return cnn is last_cnn and att is last_att and cnn._version == v_cnn and att._version == v_att

    def remember(self, cnn: torch.Tensor, att: torch.Tensor) -> None:
        self.last = (cnn, att, cnn._version, att._version)

    def caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """New tensors with the slot's caches in the upstream layout: what
        ``CFMServer.request_caches`` returns, gathered from a view of the slot's valid frames
        (not from a copy of its whole arena rows)."""
        arena = self.server.arenas[0]
        length = self.cache_len
        keys = arena.frame_keys[0:1, :length].expand(2, length)
        lengths = torch.full((2,), length, device=keys.device)
        att = keyed_to_newest_first(arena.att[:, :, 0:2, :, :length], keys, lengths, length)
        return arena.cnn[:, :, 0:2].clone(), att

    def load(self, cnn: torch.Tensor, att: torch.Tensor) -> None:
        """Put caches in the upstream layout into the slot (its next chunk continues from them)."""
        self.server.load_request_caches(_RID, cnn, att)
        self.loads += 1


class TorchCFMDecoder:
    """The torch_cfm solver of one upstream ``CausalConditionalCFM`` (installed by
    :func:`apply_torch_cfm`; reach it with :func:`accelerated`). :meth:`warmup` prepares its
    solves alone (no encoder); the module-level :func:`warmup` runs whole streams through a flow.

    Args:
        decoder: the upstream decoder (its estimator's weights are copied, at this call).
        dtype, device: of the torch_cfm estimator and caches (default: the upstream estimator's).
        graphs: replay each chunk's whole solve from a CUDA graph (default: True on CUDA).
        max_prompt_frames: longest prompt P; with ``max_chunk_frames`` T it sizes the stream's
            cache arena, ``P + T + 100`` frames (the caller's trim keeps ``P + 100``).
        max_chunk_frames: longest streaming chunk (frames).
        fused: torch_cfm's fused DiT body (None = the dispatch policy).
        voice_cache_bytes: keep solved prompts (a stream's first chunk) up to this many bytes: a
            prompt already solved (the same mu, cond, speaker embedding and steps, e.g. a second
            ``Token2wav.set_stream_cache`` of one prompt) is a copy, bitwise the solve's result
            (:mod:`torch_cfm.serving.voice_cache`). None or 0: no cache.
    Attributes:
        estimator: the :class:`~torch_cfm.DiT` with the upstream weights.
        noise, cfg_rate: the decoder's ``rand_noise`` buffer and ``inference_cfg_rate``.
        upstream_forward_chunk, upstream_forward: the decoder's own methods (used for fallbacks).
    """

    def __init__(self, decoder: nn.Module, *, dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None, graphs: Optional[bool] = None,
                 max_prompt_frames: int = 500, max_chunk_frames: int = 100, fused: Optional[bool] = None,
                 voice_cache_bytes: Optional[int] = None) -> None:
        op = "apply_torch_cfm"
        for name, val in (("max_prompt_frames", max_prompt_frames), ("max_chunk_frames", max_chunk_frames)):
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                fail(op, name, "be a positive int", repr(val))
        if dtype is not None and dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            fail(op, "dtype", "be torch.float16, bfloat16, float32 or float64", repr(dtype))
        self.device, self.dtype, self.graphs = placement(decoder, device, dtype, graphs)
        self.fused = fused
        self.max_prompt_frames, self.max_chunk_frames = max_prompt_frames, max_chunk_frames
        self.voice_cache_bytes = voice_cache_bytes or None
        self.cfg_rate = float(decoder.inference_cfg_rate)
        self.noise = decoder.rand_noise
        self.upstream_forward_chunk = type(decoder).forward_chunk.__get__(decoder)
        self.upstream_forward = type(decoder).forward.__get__(decoder)
        self.estimator = dit_from_decoder(decoder, self.device, self.dtype, op)
        self._streams: dict[int, _Stream] = {}
        self._solvers: dict[int, StreamingCFM] = {}
        self.encoder_call: Optional[GraphedCall] = None  # the flow encoder's graphed forward_chunk, if any
        self.vocoder: Optional[GraphedHiFT] = None  # a Token2wav's graphed HiFT, if any
        self._encoder: Optional[nn.Module] = None

    # ---------------------------------------------------------------- plumbing
    def _context(self):
        stack = contextlib.ExitStack()
        stack.enter_context(torch.inference_mode(False))  # normal tensors: arenas are updated in place
        stack.enter_context(torch.no_grad())
        stack.enter_context(torch.autocast(self.device.type, enabled=False))  # compute in self.dtype
        return stack

    def _solver(self, n_timesteps: int) -> StreamingCFM:
        if n_timesteps not in self._solvers:
            self._solvers[n_timesteps] = StreamingCFM(self.estimator, n_timesteps=n_timesteps, cfg_rate=self.cfg_rate,
                                                      noise=self.noise)
        return self._solvers[n_timesteps]

    def _stream(self, n_timesteps: int) -> _Stream:
        stream = self._streams.get(n_timesteps)
        if stream is None:
            prompt_cap = self.max_prompt_frames + self.max_chunk_frames  # the server's "prompt" = no-trim length
            buckets = Buckets()
            if self.graphs:
                buckets = Buckets.for_graphs(max_chunk_frames=max(prompt_cap, self.max_chunk_frames),
                                             max_cache_frames=prompt_cap + 100)
            server = CFMServer(self._solver(n_timesteps), max_requests=1, max_prompt_frames=prompt_cap,
                               max_chunk_frames=self.max_chunk_frames, chunk_buckets=buckets.chunks,
                               cache_buckets=buckets.caches, device=self.device, dtype=self.dtype, fused=self.fused,
                               graphs=self.graphs, voice_cache_bytes=self.voice_cache_bytes)
            stream = self._streams[n_timesteps] = _Stream(server, prompt_cap)
        return stream

    @property
    def servers(self) -> dict[int, CFMServer]:
        """The one-slot server of each ``n_timesteps`` used so far (what :meth:`warmup` prepares)."""
        return {n: s.server for n, s in self._streams.items()}

    def close(self) -> None:
        """Drop every server (frees the arenas and graphs)."""
        self._streams.clear()
        self._solvers.clear()

    def _check_caches(self, op: str, n: int, cnn_cache: Optional[torch.Tensor],
                      att_cache: Optional[torch.Tensor]) -> None:
        """Both caches in the upstream layout of this estimator (leading size >= n)."""
        cfg = self.estimator.config
        for name, cache, dims, layout in (
                ("cnn_cache", cnn_cache, (cfg.depth, 2, 2 * cfg.hidden, 2), "(n, depth, 2, 2C, 2)"),
                ("att_cache", att_cache, (cfg.depth, 2, cfg.heads, None, 2 * cfg.head_dim), "(n, depth, 2, H, L, 2D)")):
            if cache is None:
                continue
            ok = (isinstance(cache, torch.Tensor) and cache.dim() == 1 + len(dims) and cache.shape[0] >= n
                  and all(d is None or cache.shape[1 + i] == d for i, d in enumerate(dims)))
            if not ok:
                want = ", ".join("L" if d is None else str(d) for d in dims)
                fail(op, name, f"have the upstream layout {layout} = (>= {n}, {want})",
                     shape_str(cache) if isinstance(cache, torch.Tensor) else type(cache).__name__)

    # ---------------------------------------------------------------- the decoder's methods
    def forward_chunk(self, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor, n_timesteps: int = 10,
                      temperature: float = 1.0, cnn_cache: Optional[torch.Tensor] = None,
                      att_cache: Optional[torch.Tensor] = None):
        """``CausalConditionalCFM.forward_chunk``: one chunk's n-step CFG solve from the caches.

        Args:
            mu, cond: (1, 80, T); spks: (1, 80) (the flow's projected speaker embedding).
            n_timesteps, temperature: as upstream (temperature != 1 runs the upstream method).
            cnn_cache: None or (n', depth, 2, 2C, 2), n' >= n (upstream: n' = 16).
            att_cache: None (a new stream) or (n', depth, 2, H, L, 2D) newest first.
        Returns:
            (mel (1, 80, T) in mu's dtype, cnn (n, depth, 2, 2C, 2), att (n, depth, 2, H, T+L, 2D))
            with the caches in this decoder's dtype, untrimmed.
        Raises:
            ValueError: caches of another layout, a prompt (first chunk) longer than
                ``max_prompt_frames``, or ``L + T`` beyond the arena (trim the cache, as
                ``Token2wav.stream`` does, or apply with a larger ``max_prompt_frames``).
        """
        op = "CausalConditionalCFM.forward_chunk (torch_cfm)"
        if not isinstance(mu, torch.Tensor) or mu.dim() != 3 or mu.shape[0] != 1 or temperature != 1.0 \
                or mu.shape[2] == 0:
            return self.upstream_forward_chunk(mu, spks, cond, n_timesteps=n_timesteps, temperature=temperature,
                                               cnn_cache=cnn_cache, att_cache=att_cache)
        n, t_len = int(n_timesteps), mu.shape[2]
        with self._context():
            stream = self._stream(n)
            voice = None
            if att_cache is None and cnn_cache is None and stream.server.voices is not None:
                voice = content_key(mu, cond, spks, n, self.dtype)
                if stream.server.voice_state(voice) is not None:  # a prompt already solved: a copy
                    return self._open_voice(stream, voice, mu.dtype)
            if att_cache is None:
                if t_len > self.max_prompt_frames:
                    fail(op, "mu", f"have at most max_prompt_frames={self.max_prompt_frames} frames in a stream's "
                         "first chunk (the prompt)", f"{t_len} frames", "apply_torch_cfm(..., max_prompt_frames=...)")
                stream.reset(spks[0].to(self.dtype))
                if cnn_cache is not None:  # conv history without attention history: load it
                    self._check_caches(op, n, cnn_cache, None)
                    stream.server.arenas[0].cnn[:, :, 0:2].copy_(cnn_cache[:n])
            elif not stream.holds(cnn_cache, att_cache):
                if cnn_cache is None:
                    fail(op, "cnn_cache", "be given with att_cache", "None")
                self._check_caches(op, n, cnn_cache, att_cache)
                if att_cache.shape[4] + t_len > stream.capacity:
                    fail(op, "att_cache", f"leave room for the chunk: L + T <= {stream.capacity} frames",
                         f"L={att_cache.shape[4]}, T={t_len}",
                         "trim the cache (as Token2wav.stream does) or apply_torch_cfm(max_prompt_frames=...)")
                if _RID not in stream.server.open_requests:
                    stream.reset(spks[0].to(self.dtype))
                stream.load(cnn_cache[:n], att_cache[:n])
            elif stream.cache_len + t_len > stream.capacity:
                fail(op, "att_cache", f"leave room for the chunk: L + T <= {stream.capacity} frames",
                     f"L={stream.cache_len}, T={t_len}",
                     "trim the cache (as Token2wav.stream does) or apply_torch_cfm(max_prompt_frames=...)")
            server = stream.server
            server.arenas[0].spks[0].copy_(spks[0])  # the call's speaker embedding (constant in a stream)
            mel = server.solve_chunk({_RID: (mu[0], cond[0])})[_RID]
            if voice is not None:
                server.voices.get(voice)  # a counted miss
                server.keep_voice(_RID, voice, mel)
            cnn, att = stream.caches()
            stream.remember(cnn, att)
            stream.solves += 1
        return mel[None].to(mu.dtype), cnn, att

    def _open_voice(self, stream: _Stream, voice, dtype: torch.dtype):
        """The stream opened from a cached prompt solve: (mel, cnn, att) as a fresh solve returns them."""
        if _RID in stream.server.open_requests:
            stream.server.close_request(_RID)
        mel = stream.server.open_request(_RID, voice=voice)
        cnn, att = stream.caches()
        stream.remember(cnn, att)
        return mel[None].to(dtype), cnn, att

    def forward(self, mu: torch.Tensor, mask: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                n_timesteps: int = 10, temperature: float = 1.0) -> torch.Tensor:
        """``CausalConditionalCFM.forward``: the non-streaming solve over the whole utterance
        (``flow.inference``). Batch 1 with an all-valid mask runs torch_cfm (eager: lengths vary
        per utterance); anything else the upstream method."""
        if (not isinstance(mu, torch.Tensor) or mu.dim() != 3 or mu.shape[0] != 1 or temperature != 1.0
                or mu.shape[2] > self.noise.shape[2] or not bool(torch.as_tensor(mask).all())):
            return self.upstream_forward(mu, mask, spks, cond, n_timesteps=n_timesteps, temperature=temperature)
        with self._context():
            mel, _, _ = self._solver(int(n_timesteps)).forward_chunk(
                mu.to(self.dtype), spks.to(self.dtype), cond.to(self.dtype), fused=self.fused)
        return mel.to(mu.dtype)

    # ---------------------------------------------------------------- start-up
    @staticmethod
    def stream_shapes(prompt_frames: Iterable[int] = (300,), chunk_frames: Sequence[int] = (50,),
                      last_chunk_frames: Sequence[int] = (56,), keep_oldest: int = 100) -> list[tuple[int, int]]:
        """(T, L) of every chunk solve a stream meets under ``Token2wav.stream``'s trims
        (:func:`torch_cfm.buckets.stream_solve_shapes`)."""
        return stream_solve_shapes(prompt_frames, chunk_frames, last_chunk_frames, keep_oldest)

    def warmup(self, prompt_frames: Iterable[int] = (300,), chunk_frames: Sequence[int] = (50,),
               last_chunk_frames: Sequence[int] = (56,), n_timesteps: int = 10, keep_oldest: int = 100,
               progress: bool = True) -> dict:
        """Compile the kernels and capture the graphs of every solve a stream meets, now.

        Runs :meth:`CFMServer.warmup <torch_cfm.serving.CFMServer.warmup>` of the stream's
        server over the (T, L) pairs of :meth:`stream_shapes` (each shape until its graph is
        captured, on idle slots), after dropping any stream state (the next call starts a new
        stream). ``progress``: one stderr line per shape.

        Returns:
            {"shapes": [(T, L), ...], "solves": shapes warmed (after bucketing), "graphs": int
            (captured so far, all servers; 0 on CPU), "report": the server's WarmupReport}.
        """
        shapes = self.stream_shapes(prompt_frames, chunk_frames, last_chunk_frames, keep_oldest)
        with self._context():
            stream = self._stream(int(n_timesteps))
            stream.last = None
            if _RID in stream.server.open_requests:
                stream.server.close_request(_RID)
            report = stream.server.warmup(pairs=shapes, progress=progress)
        return {"shapes": shapes, "solves": len(report.shapes), "graphs": self.graph_count(), "report": report}

    def graph_count(self) -> int:
        """CUDA graphs captured by every server so far."""
        return sum(0 if s.server.graph_cache is None else s.server.graph_cache.graph_count
                   for s in self._streams.values())


__all__ = ["TorchCFMDecoder"]
