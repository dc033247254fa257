"""torch_cfm inside the ``stepaudio2`` token2wav (MiniCPM-o 4.5, Step-Audio2): one call, in place.

    >>> from torch_cfm.integrations.stepaudio2 import apply_torch_cfm, undo_torch_cfm, warmup
    >>> token2wav = stepaudio2.Token2wav(model_path, float16=True)
    >>> apply_torch_cfm(token2wav)           # or a CausalMaskedDiffWithXvec (flow), or flow.decoder
    >>> warmup(token2wav, prompt_frames=(300,))   # optional: compile and capture now, not mid-stream
    >>> pcm = token2wav.stream(tokens, prompt_wav, last_chunk=False)    # the caller's code, unchanged
    >>> undo_torch_cfm(token2wav)            # the upstream modules again, bitwise

What changes: the flow's CFM decoder (a ``CausalConditionalCFM``) gets instance-level
``forward_chunk`` and ``forward`` that solve with torch_cfm: a :class:`~torch_cfm.DiT` holding the
upstream estimator's weights (its ``state_dict``, checked key by key), the decoder's own
``rand_noise`` buffer and ``inference_cfg_rate``. Streaming chunks run through a one-slot
:class:`~torch_cfm.CFMServer` (the whole n-step solve replayed from a CUDA graph on CUDA, eager
on CPU); the non-streaming solve (``flow.inference``, ``Token2wav.__call__``) through
:meth:`~torch_cfm.StreamingCFM.forward_chunk`. On CUDA the flow's conformer encoder (the upstream
module, unchanged) is replayed from CUDA graphs too, one per input shape, each checked against its
eager call once (:class:`~torch_cfm.integrations._graphed.GraphedCall`; ``capture_encoder``),
and a Token2wav's HiFT vocoder from CUDA graphs per input shape, its random draws included
(:class:`~torch_cfm.integrations.hift.GraphedHiFT`; ``capture_vocoder``).
Everything else (token embedding, the trims and fade in ``Token2wav.stream``) runs as it is, so
``flow.setup_cache``, ``flow.inference_chunk``, ``flow.inference``, ``Token2wav.stream`` and
``Token2wav.__call__`` keep their signatures and return the same mel within SPEC §6's oracle.

Cache contract of the accelerated ``decoder.forward_chunk`` (what ``inference_chunk`` stores in
its cache dict and ``Token2wav.stream`` trims): conv caches (n, depth, 2, 2C, 2) and attention
caches (n, depth, 2, H, T+L, 2D), newest key first, row 0 = cond, row 1 = uncond, n =
``n_timesteps``, not trimmed (the caller trims, as upstream). The upstream returns views of its
16-step scratch buffers, of which the first n are used: it accepts ours and we accept its (any
leading size >= n). The stream's state lives in the server: a call whose caches are exactly the
tensors the previous call returned (the same objects, not modified since) continues from it;
other caches (trimmed by the caller, or made by the upstream module) are loaded into the server
first. So any mix of callers, trims and upstream calls gives the upstream results.

Apply after the weights are loaded and the flow is on its device: the estimator's weights are
copied at this call (apply again after changing them). Batch 1 only, like the upstream streaming
path; other batch sizes, ``temperature != 1`` and non-trivial masks in ``forward`` fall back to
the upstream method (exact upstream behaviour).

Importing this module never imports ``stepaudio2``: the targets are recognised by their shape
(duck typing), so any ``CausalConditionalCFM``-shaped decoder whose estimator has this DiT's
``state_dict`` is accepted (:func:`apply_torch_cfm_to_decoder`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

import torch
from torch import nn

from ..models import CFMServer, DiT, StreamingCFM
from ..models.cache import keyed_to_newest_first
from ..models.checkpoint import check_state_dict, config_from_state_dict
from ..ops._checks import fail, shape_str
from ._graphed import GraphedCall
from .hift import GraphedHiFT, hift_gaps

__all__ = ["apply_torch_cfm", "apply_torch_cfm_to_decoder", "apply_torch_cfm_to_vocoder", "undo_torch_cfm",
           "accelerated", "warmup", "warmup_vocoder", "TorchCFMDecoder"]

_ATTR = "_torch_cfm"  # the accelerated object, on the decoder
_PATCHED = ("forward_chunk", "forward")  # instance attributes shadowing the decoder's class methods
_RID = "stream"  # the one request of each server
# Chunk lengths T and cache windows L a captured solve is bucketed to (CUDA graphs only): one
# stream meets the prompt (T = P, L = 0), chunks of 50 frames at L = P, P+50, P+100 (the caller
# trims to P + 100) and a last chunk. Round values keep that to a handful of graphs.
_CHUNK_BUCKETS = (25, 50, 56, 64, 100, 128, 150, 200, 250, 300, 350, 400, 500, 600, 800, 1000)
_CACHE_STEP = 50


# ---------------------------------------------------------------------------- recognising targets
def _type_name(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _decoder_gaps(obj: Any) -> list[str]:
    """What ``obj`` lacks to be a CausalConditionalCFM-shaped decoder (empty = it is one)."""
    gaps = []
    if not isinstance(obj, nn.Module):
        return ["not an nn.Module"]
    if not isinstance(getattr(obj, "estimator", None), nn.Module):
        gaps.append("no 'estimator' module")
    noise = getattr(obj, "rand_noise", None)
    if not isinstance(noise, torch.Tensor) or noise.dim() != 3 or noise.shape[0] != 1:
        gaps.append("no 'rand_noise' buffer of shape (1, 80, F)")
    if not isinstance(getattr(obj, "inference_cfg_rate", None), (int, float)):
        gaps.append("no numeric 'inference_cfg_rate'")
    for name in ("forward_chunk", "solve_euler_chunk"):
        if not callable(getattr(type(obj), name, None)):
            gaps.append(f"no '{name}' method")
    return gaps


def _find_decoder(target: Any, op: str) -> nn.Module:
    """The CFM decoder of a Token2wav (``.flow.decoder``), a flow (``.decoder``) or a decoder."""
    if not _decoder_gaps(target):
        return target
    for path in (("decoder",), ("flow", "decoder")):
        obj = target
        for name in path:
            obj = getattr(obj, name, None)
        if obj is not None and not _decoder_gaps(obj):
            return obj
    found = _type_name(target)
    flow = getattr(target, "flow", None)
    if getattr(target, "decoder", None) is not None:
        where = f"its .decoder is {_type_name(target.decoder)}: {', '.join(_decoder_gaps(target.decoder))}"
    elif flow is not None and getattr(flow, "decoder", None) is not None:
        where = f"its .flow.decoder is {_type_name(flow.decoder)}: {', '.join(_decoder_gaps(flow.decoder))}"
    elif flow is not None:
        where = f"its .flow is {_type_name(flow)}, which has no .decoder"
    else:
        where = ", ".join(_decoder_gaps(target)) + ", no .decoder, no .flow"
    raise TypeError(f"{op}: target must be a stepaudio2 Token2wav, CausalMaskedDiffWithXvec (flow) or "
                    f"CausalConditionalCFM (decoder), or an object shaped like one; got {found} ({where})")


def _find_flow(target: Any) -> Optional[nn.Module]:
    """The flow of a Token2wav or a flow (the module holding ``.decoder`` and ``.encoder``), or
    None when ``target`` is a decoder."""
    if not _decoder_gaps(target):
        return None
    for cand in (target, getattr(target, "flow", None)):
        dec = getattr(cand, "decoder", None)
        if dec is not None and not _decoder_gaps(dec):
            return cand
    return None


def _estimator_config(decoder: nn.Module, op: str):
    """The DiT config of the decoder's estimator, read from its state_dict and checked against
    torch_cfm's DiT key by key (ValueError naming every missing, unexpected or mis-shaped key)."""
    est = decoder.estimator
    sd = est.state_dict()
    try:
        config = config_from_state_dict(sd)
        probe = DiT(config).to("meta")
    except ValueError as exc:
        raise ValueError(f"{op}: the decoder's estimator ({_type_name(est)}) does not have torch_cfm's DiT "
                         f"state_dict: {exc}") from None
    try:
        check_state_dict(probe, sd, op=op)
    except ValueError as exc:
        raise ValueError(f"{op}: the decoder's estimator ({_type_name(est)}) does not have torch_cfm's DiT "
                         f"state_dict: {exc}") from None
    noise = decoder.rand_noise
    if noise.shape[1] != config.out_channels:
        fail(op, "decoder.rand_noise", f"have shape (1, {config.out_channels}, F)", shape_str(noise))
    return config, sd


def _placement(decoder: nn.Module, device: Optional[torch.device], dtype: Optional[torch.dtype],
               graphs: Optional[bool]) -> tuple[torch.device, torch.dtype, bool]:
    """Where and in what dtype torch_cfm serves ``decoder`` (default: its estimator's), and whether
    with CUDA graphs (default: on CUDA)."""
    param = next(decoder.estimator.parameters())
    device = torch.device(device) if device is not None else param.device
    return device, dtype or param.dtype, device.type == "cuda" if graphs is None else bool(graphs)


# ---------------------------------------------------------------------------- the accelerated decoder
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
    Attributes:
        estimator: the :class:`~torch_cfm.DiT` with the upstream weights.
        noise, cfg_rate: the decoder's ``rand_noise`` buffer and ``inference_cfg_rate``.
        upstream_forward_chunk, upstream_forward: the decoder's own methods (used for fallbacks).
    """

    def __init__(self, decoder: nn.Module, *, dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None, graphs: Optional[bool] = None,
                 max_prompt_frames: int = 500, max_chunk_frames: int = 100, fused: Optional[bool] = None) -> None:
        op = "apply_torch_cfm"
        for name, val in (("max_prompt_frames", max_prompt_frames), ("max_chunk_frames", max_chunk_frames)):
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                fail(op, name, "be a positive int", repr(val))
        if dtype is not None and dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            fail(op, "dtype", "be torch.float16, bfloat16, float32 or float64", repr(dtype))
        config, sd = _estimator_config(decoder, op)
        self.device, self.dtype, self.graphs = _placement(decoder, device, dtype, graphs)
        self.fused = fused
        self.max_prompt_frames, self.max_chunk_frames = max_prompt_frames, max_chunk_frames
        self.cfg_rate = float(decoder.inference_cfg_rate)
        self.noise = decoder.rand_noise
        self.upstream_forward_chunk = type(decoder).forward_chunk.__get__(decoder)
        self.upstream_forward = type(decoder).forward.__get__(decoder)
        with torch.inference_mode(False):
            est = DiT(config)
            est.load_state_dict(sd, strict=True)
            self.estimator = est.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
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
            chunk_buckets = cache_buckets = None
            if self.graphs:
                chunk_buckets = [b for b in _CHUNK_BUCKETS if b < prompt_cap] + [prompt_cap]
                cache_buckets = list(range(0, prompt_cap + 100, _CACHE_STEP)) + [prompt_cap + 100]
            server = CFMServer(self._solver(n_timesteps), max_requests=1, max_prompt_frames=prompt_cap,
                               max_chunk_frames=self.max_chunk_frames, chunk_buckets=chunk_buckets,
                               cache_buckets=cache_buckets, device=self.device, dtype=self.dtype, fused=self.fused,
                               graphs=self.graphs)
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
            cnn, att = stream.caches()
            stream.remember(cnn, att)
            stream.solves += 1
        return mel[None].to(mu.dtype), cnn, att

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
        """(T, L) of every chunk solve a stream meets under ``Token2wav.stream``'s trims: the
        prompt (P, 0); each chunk length T at L = P, P + T, ... while the cache fits
        ``P + keep_oldest`` frames (the trim bound), then at that bound; each last-chunk length
        at the bound. In first-met order, without repeats."""
        shapes: list[tuple[int, int]] = []

        def add(shape: tuple[int, int]) -> None:
            if shape not in shapes:
                shapes.append(shape)

        for p_len in prompt_frames:
            bound = p_len + keep_oldest
            add((p_len, 0))
            for t_len in chunk_frames:
                cache = p_len
                while True:
                    add((t_len, cache))
                    if cache == bound:
                        break
                    cache = cache + t_len if cache + t_len <= bound else bound
            for t_len in last_chunk_frames:
                add((t_len, bound))
        return shapes

    def warmup(self, prompt_frames: Iterable[int] = (300,), chunk_frames: Sequence[int] = (50,),
               last_chunk_frames: Sequence[int] = (56,), n_timesteps: int = 10, keep_oldest: int = 100,
               progress: bool = True) -> dict:
        """Compile the kernels and capture the graphs of every solve a stream meets, now.

        Runs :meth:`CFMServer.warmup <torch_cfm.models.server.CFMServer.warmup>` of the stream's
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
        return sum(getattr(stream.server.solve_fn, "graph_count", 0) for stream in self._streams.values())


# ---------------------------------------------------------------------------- public entry points
def apply_torch_cfm_to_decoder(decoder: nn.Module, **options) -> TorchCFMDecoder:
    """The generic entry: accelerate any ``CausalConditionalCFM``-shaped decoder (an
    ``estimator`` with torch_cfm's DiT ``state_dict``, a ``rand_noise`` (1, 80, F) buffer, an
    ``inference_cfg_rate``, ``forward_chunk``/``forward`` with the upstream signatures) in place.
    Options as :func:`apply_torch_cfm`. Returns the installed :class:`TorchCFMDecoder`."""
    op = "apply_torch_cfm_to_decoder"
    gaps = _decoder_gaps(decoder)
    if gaps:
        raise TypeError(f"{op}: decoder must be CausalConditionalCFM-shaped, got {_type_name(decoder)} "
                        f"({', '.join(gaps)})")
    if getattr(decoder, _ATTR, None) is not None:
        _uninstall(decoder)
    accel = TorchCFMDecoder(decoder, **options)
    for name in _PATCHED:
        setattr(decoder, name, getattr(accel, name))
    setattr(decoder, _ATTR, accel)
    return accel


def apply_torch_cfm_to_vocoder(hift: nn.Module, *, max_graphs: int = 16) -> GraphedHiFT:
    """Replay a ``stepaudio2`` ``HiFTGenerator``'s forward from CUDA graphs, in place: ``hift.forward``
    becomes a :class:`~torch_cfm.integrations.hift.GraphedHiFT` (same signature and outputs, the
    random draws from the same default CUDA generator; eager on CPU). Applying again replaces it;
    :func:`undo_torch_cfm` (of the Token2wav, or of ``hift``) removes it. Returns the wrapper.

    Raises:
        TypeError: ``hift`` is not a HiFTGenerator (the message names what it lacks).
    """
    graphed = GraphedHiFT(hift, max_graphs=max_graphs)
    hift.forward = graphed
    return graphed


def _vocoder_of(target: Any) -> Optional[nn.Module]:
    hift = getattr(target, "hift", None)
    return hift if hift is not None and not hift_gaps(hift) else None


def apply_torch_cfm(target: Any, *, dtype: Optional[torch.dtype] = None, graphs: Optional[bool] = None,
                    max_prompt_frames: int = 500, max_chunk_frames: int = 100, device: Optional[torch.device] = None,
                    fused: Optional[bool] = None, capture_encoder: Optional[bool] = None,
                    capture_vocoder: Optional[bool] = None) -> Any:
    """Serve the CFM decoder of a ``stepaudio2`` token2wav with torch_cfm, in place.

    Args:
        target: a ``stepaudio2.Token2wav`` (``.flow.decoder``), a ``CausalMaskedDiffWithXvec``
            flow (``.decoder``) or a ``CausalConditionalCFM`` decoder (or objects shaped so).
            Applying again replaces the previous acceleration (weights are copied again).
        dtype: compute dtype of the torch_cfm estimator and caches (default: the upstream
            estimator's, i.e. float16 after ``Token2wav(float16=True)``).
        graphs: replay each streaming chunk's solve from a CUDA graph (default: on CUDA).
        max_prompt_frames, max_chunk_frames: the longest prompt (mel frames; 500 = 10 s) and
            streaming chunk (100); they size the stream's cache arena (``P + T + 100`` frames).
        device: of the estimator and caches (default: the upstream estimator's).
        fused: torch_cfm's fused DiT body (None = the dispatch policy, ``torch_cfm.explain``).
        capture_encoder: also replay the flow's conformer encoder (``encoder.forward_chunk``, the
            upstream module, batch 1) from CUDA graphs, one per input shape, each checked against
            the eager call once (:class:`~torch_cfm.integrations._graphed.GraphedCall`; a capture
            that fails or disagrees stays eager). Default: ``graphs``, when ``target`` has a flow.
        capture_vocoder: also replay a Token2wav's ``hift`` from CUDA graphs
            (:func:`apply_torch_cfm_to_vocoder`). Default: ``graphs``, when ``target.hift`` is a
            HiFTGenerator on CUDA.
    Returns:
        ``target`` (accelerated in place).
    Raises:
        TypeError: ``target`` is not of this model family (the message names what was found).
        ValueError: the estimator's state_dict is not torch_cfm's DiT's (names the keys), or bad options.
    """
    decoder = _find_decoder(target, "apply_torch_cfm")
    encoder = getattr(_find_flow(target), "encoder", None)
    if encoder is not None and not callable(getattr(type(encoder), "forward_chunk", None)):
        encoder = None
    if capture_encoder and encoder is None:
        fail("apply_torch_cfm", "capture_encoder", "be set only for a target with a flow encoder "
             "(a Token2wav or a flow)", f"{_type_name(target)} without one")
    hift = _vocoder_of(target)
    if capture_vocoder and hift is None:
        held = getattr(target, "hift", None)
        fail("apply_torch_cfm", "capture_vocoder", "be set only for a Token2wav whose .hift is a HiFTGenerator",
             f"{_type_name(target)} without .hift" if held is None
             else f".hift {_type_name(held)} ({', '.join(hift_gaps(held))})")
    accel = apply_torch_cfm_to_decoder(decoder, dtype=dtype, graphs=graphs, max_prompt_frames=max_prompt_frames,
                                       max_chunk_frames=max_chunk_frames, device=device, fused=fused)
    if capture_encoder is None:
        capture_encoder = accel.graphs and encoder is not None
    if capture_encoder:
        call = GraphedCall(type(encoder).forward_chunk.__get__(encoder), name="encoder.forward_chunk")
        encoder.forward_chunk = call
        accel.encoder_call, accel._encoder = call, encoder
    if capture_vocoder is None:
        capture_vocoder = accel.graphs and hift is not None and next(hift.parameters()).is_cuda
    if capture_vocoder:
        accel.vocoder = apply_torch_cfm_to_vocoder(hift)
    return target


def _undo_vocoder(hift: Optional[nn.Module]) -> None:
    if hift is not None and isinstance(vars(hift).get("forward"), GraphedHiFT):
        del vars(hift)["forward"]


def _uninstall(decoder: nn.Module) -> None:
    accel = decoder.__dict__.pop(_ATTR, None)
    for name in _PATCHED:
        decoder.__dict__.pop(name, None)
    if accel is not None:
        encoder = accel._encoder
        if encoder is not None and encoder.__dict__.get("forward_chunk") is accel.encoder_call:
            del encoder.__dict__["forward_chunk"]
        accel.encoder_call = accel._encoder = None
        accel.close()


def undo_torch_cfm(target: Any) -> Any:
    """Restore the upstream methods (the upstream modules' own behaviour, bitwise): the decoder's,
    the encoder's and a Token2wav's vocoder's; ``target`` may also be a HiFTGenerator. A target
    that is not accelerated is left as it is. Returns ``target``.

    Raises:
        TypeError: ``target`` is not of this model family.
    """
    if isinstance(target, nn.Module) and not hift_gaps(target):
        _undo_vocoder(target)
        return target
    _uninstall(_find_decoder(target, "undo_torch_cfm"))
    _undo_vocoder(_vocoder_of(target))
    return target


def accelerated(target: Any) -> Optional[TorchCFMDecoder]:
    """The :class:`TorchCFMDecoder` installed on ``target``'s decoder, or None."""
    return getattr(_find_decoder(target, "accelerated"), _ATTR, None)


def _trim_like_token2wav(cache: dict, prompt_frames: int, keep_oldest: int = 100) -> dict:
    """The SPEC §3 trims ``Token2wav.stream`` applies after each chunk: the estimator attention
    cache (dim 4) and the conformer attention cache (dim 3) to their first ``prompt_frames`` and
    last ``keep_oldest`` frames once longer than ``prompt_frames + keep_oldest``."""
    est, conf = cache["estimator_att_cache"], cache["conformer_att_cache"]
    if est.shape[4] > prompt_frames + keep_oldest:
        cache["estimator_att_cache"] = torch.cat([est[..., :prompt_frames, :], est[..., -keep_oldest:, :]], dim=4)
    if conf.shape[3] > prompt_frames + keep_oldest:
        cache["conformer_att_cache"] = torch.cat([conf[:, :, :, :prompt_frames], conf[:, :, :, -keep_oldest:]], dim=3)
    return cache


def warmup(target: Any, *, prompt_frames: Iterable[int] = (300,), chunk_tokens: int = 25,
           last_tokens: Sequence[int] = (28,), n_timesteps: int = 10,
           autocast_dtype: Optional[torch.dtype] = None) -> dict:
    """Compile and capture, now, everything one stream of these prompt lengths meets.

    With a flow (a Token2wav or a flow target): two streams per prompt length through the
    flow's own ``setup_cache`` / ``inference_chunk`` (seeded random tokens, prompt mel and
    speaker embedding; ``chunk_tokens`` + 3 lookahead tokens per chunk, ``Token2wav.stream``'s
    trims, then one chunk of each ``last_tokens`` length flagged last) — the CFM solves and the
    graphed encoder both see every shape twice (eager, then captured). Chunks run under CUDA
    autocast in ``autocast_dtype`` (default: the flow's dtype when it is float16/bfloat16, as
    ``Token2wav.stream`` does), the setup without (as ``Token2wav.set_stream_cache``). A decoder
    target: :meth:`TorchCFMDecoder.warmup` over the same mel shapes.

    With a graphed vocoder (a Token2wav's, :func:`apply_torch_cfm_to_vocoder`): then
    :func:`warmup_vocoder` at these chunk lengths.

    Args:
        prompt_frames: prompt lengths in mel frames (multiples of the flow's 2 frames per token).
    Returns:
        {"streams": int, "decoder_graphs": int, "encoder_graphs": int, "vocoder_graphs": int}.
    Raises:
        ValueError: ``target`` is not accelerated, or a prompt length that is no whole token count.
    """
    op = "warmup"
    decoder = _find_decoder(target, op)
    accel = getattr(decoder, _ATTR, None)
    if accel is None:
        fail(op, "target", "be accelerated (apply_torch_cfm first)", _type_name(target))
    prompt_frames = tuple(prompt_frames)
    flow = _find_flow(target)
    up_rate = int(getattr(flow, "up_rate", 2))
    if any(not isinstance(p, int) or p <= 0 or p % up_rate for p in prompt_frames):
        fail(op, "prompt_frames", f"hold positive multiples of {up_rate} (mel frames per token)", repr(prompt_frames))
    if flow is None:
        report = accel.warmup(prompt_frames, (2 * chunk_tokens,), tuple(2 * t for t in last_tokens), n_timesteps)
        return {"streams": 0, "decoder_graphs": report["graphs"], "encoder_graphs": 0, "vocoder_graphs": 0}
    param = next(flow.parameters())
    dev, dt = param.device, param.dtype
    if autocast_dtype is None and dt in (torch.float16, torch.bfloat16):
        autocast_dtype = dt
    vocab = flow.input_embedding.num_embeddings
    spk_dim = flow.spk_embed_affine_layer.in_features
    mel_dim = flow.output_size
    lookahead = flow.pre_lookahead_len
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(0, vocab, (1, n), generator=gen).to(device=dev, dtype=torch.int32)

    def chunk(cache, tok, spk, last):
        with torch.amp.autocast(dev.type, dtype=autocast_dtype or dt, enabled=autocast_dtype is not None):
            return flow.inference_chunk(tok, spk, cache, last_chunk=last, n_timesteps=n_timesteps)

    streams = 0
    for p_len in prompt_frames:
        for _ in range(2):
            spk = torch.randn(1, spk_dim, generator=gen).to(device=dev, dtype=dt)
            mel = (0.5 * torch.randn(1, p_len, mel_dim, generator=gen)).to(device=dev, dtype=dt)
            cache = flow.setup_cache(tokens(p_len // up_rate + lookahead), mel, spk, n_timesteps=n_timesteps)
            bound, length = p_len + 100, p_len
            while True:  # chunks until one runs at the trim bound
                at_bound = length == bound
                _, cache = chunk(cache, tokens(chunk_tokens + lookahead), spk, False)
                cache = _trim_like_token2wav(cache, p_len)
                length = cache["estimator_att_cache"].shape[4]
                if at_bound:
                    break
            for n_tok in last_tokens:
                chunk(dict(cache), tokens(n_tok), spk, True)
            streams += 1
    hift = _vocoder_of(target)
    vocoder = vars(hift).get("forward") if hift is not None else None
    if isinstance(vocoder, GraphedHiFT):
        warmup_vocoder(vocoder, chunk_frames=(up_rate * chunk_tokens,), last_frames=[up_rate * t for t in last_tokens])
    return {"streams": streams, "decoder_graphs": accel.graph_count(),
            "encoder_graphs": 0 if accel.encoder_call is None else accel.encoder_call.graph_count,
            "vocoder_graphs": vocoder.graph_count if isinstance(vocoder, GraphedHiFT) else 0}


def warmup_vocoder(vocoder: Any, *, chunk_frames: Sequence[int] = (50,), last_frames: Sequence[int] = (56,),
                   mel_cache_frames: int = 8, rounds: int = 2) -> int:
    """Capture, now, the vocoder graphs ``Token2wav.stream`` meets: a first chunk (``chunk_frames``
    mel frames, no source cache), then chunks and last chunks behind the ``mel_cache_frames``
    cached frames with a source cache of 480 samples per cached frame; each shape ``rounds``
    times (the first call of a shape runs eagerly). Seeded random mel; the calls draw from the
    default CUDA generator as any vocoder call does.

    Args:
        vocoder: a :class:`~torch_cfm.integrations.hift.GraphedHiFT`, or a HiFTGenerator whose
            forward :func:`apply_torch_cfm_to_vocoder` replaced.
    Returns:
        the vocoder's graph count.
    Raises:
        ValueError: ``vocoder`` is neither.
    """
    if isinstance(vocoder, nn.Module) and isinstance(vars(vocoder).get("forward"), GraphedHiFT):
        vocoder = vars(vocoder)["forward"]
    if not isinstance(vocoder, GraphedHiFT):
        fail("warmup_vocoder", "vocoder", "be a GraphedHiFT or a HiFTGenerator after apply_torch_cfm_to_vocoder",
             _type_name(vocoder))
    hift = vocoder.hift
    param = next(hift.parameters())
    mels = hift.conv_pre.in_channels if isinstance(getattr(hift, "conv_pre", None), nn.Conv1d) else 80
    per_frame = 480
    gen = torch.Generator().manual_seed(0)

    def mel(frames: int) -> torch.Tensor:
        return torch.randn(1, mels, frames, generator=gen).to(device=param.device, dtype=param.dtype)

    cache = torch.zeros(1, 1, mel_cache_frames * per_frame, device=param.device, dtype=param.dtype)
    empty = torch.zeros(1, 1, 0, device=param.device, dtype=param.dtype)
    for _ in range(rounds):
        for t in chunk_frames:
            vocoder(mel(t), empty)
        for t in list(chunk_frames) + list(last_frames):
            vocoder(mel(mel_cache_frames + t), cache)
    return vocoder.graph_count
