"""A many-stream token2wav front over the ``stepaudio2`` flow and HiFT vocoder.

    >>> from torch_cfm.integrations.stepaudio2_server import Token2wavServer
    >>> server = Token2wavServer(flow, hift, max_streams=16, max_prompt_frames=500)
    >>> server.open_stream("a", prompt_tokens, prompt_mel, spk_embedding, seed=0)
    >>> out = server.step({"a": tokens_a, "b": (tokens_b, True)})    # True = the stream's last chunk
    >>> out["a"].mel, out["a"].wav                                  # (80, T), (samples,)
    >>> server.close_stream("a")

One ``step`` is one tick of the serving loop: every stream given a chunk advances by that chunk,
all of them together. The three stages of a chunk (tokens -> mel -> waveform) are the upstream
``Token2wav.stream`` path, per stream:

* **Encoder**: the flow's own ``input_embedding``, ``encoder.forward_chunk`` (the upstream
  ``UpsampleConformerEncoderV2`` with its conformer conv and attention caches) and
  ``encoder_proj`` (a half-precision flow on CUDA under autocast, as ``Token2wav`` runs it); the
  conformer attention cache trimmed to its first P and last 100 frames like ``Token2wav.stream``
  (P = the prompt's mel frames). Batching (``encoder_batching``): ``True`` (default) runs streams
  whose chunk has the same token count, conformer cache length and last flag as one batch through
  the upstream ``forward_chunk`` itself (its chunk path has no padding masks); ``"ragged"`` also
  batches streams whose cache lengths differ (other prompt lengths, or in their first chunks next
  to settled streams): each cache left-padded to a common length and the padding masked out of
  every attention, the upstream modules driven in ``forward_chunk``'s order (a real key's
  distance to each query, hence its relative position, is unchanged by left padding, so each
  stream gets its own result); ``False`` runs every stream alone. On CUDA each batch shape is
  replayed from a CUDA graph (batches padded to buckets with copies of a row).
* **CFM**: one :class:`~torch_cfm.CFMServer` over every stream (a torch_cfm
  :class:`~torch_cfm.DiT` holding the upstream estimator's weights, the decoder's ``rand_noise``
  and ``inference_cfg_rate``): the prompt solves of the streams opened together in one ragged
  solve, then each tick's chunks in one ragged solve (CUDA graphs on CUDA). With
  ``prompt_steps_per_tick=k`` a prompt solve is spread over the next ticks instead, k of its n
  Euler steps per ``step`` (the same result): ``open_stream`` returns at once, and the stream
  takes chunks once :meth:`Token2wavServer.ready` (after n/k ticks). A burst of arrivals then no
  longer lands on one tick: tick times stay near their median, first chunks come n/k ticks later.
* **Vocoder** (when a ``HiFTGenerator`` is given): the upstream streaming scheme, per stream
  8 cached mel frames, the last ``8 * 480`` source samples and speech samples, a Hamming cross-
  fade over the overlap and the tail held back until the last chunk. Streams whose vocoder input
  has the same length run as one batch through the HiFT's f0 predictor and ``decode`` (its
  convolutions and inverse STFT; CUDA graphs per shape, made capturable by
  :func:`~torch_cfm.integrations.hift.capturable`); the source module draws random numbers, so it
  runs per stream (batch 1, a CUDA graph per length) on the stream's own random state (seeded at
  ``open_stream``): a stream's waveform is that of the upstream per-stream call run after
  ``torch.manual_seed(seed)``, whatever the other streams do.

Admission: ``max_streams`` slots; with ``max_memory_bytes`` also a byte budget over the per-stream
state of every stage (:meth:`Token2wavServer.memory_plan`); a stream that does not fit raises
:class:`AdmissionError` naming the limit. ``close_stream`` drops every tensor of the stream (its
CFM slot is reused). Rows never mix across streams, so a stream whose prompt holds NaN/Inf
yields NaN for itself only (``check_finite=True`` rejects it at ``open_stream`` instead).

Importing this module never imports ``stepaudio2``: the flow and vocoder are the caller's objects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Hashable, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..models import CFMServer, DiT, StreamingCFM
from ..models.cache import TRIM_KEEP_OLDEST
from ..ops._checks import fail, shape_str
from .hift import capturable, hift_gaps
from .stepaudio2 import TorchCFMDecoder, _estimator_config, _placement, _type_name

try:  # one admission error for the whole library once CFMServer has its own
    from ..models import AdmissionError as _AdmissionBase  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the server version
    _AdmissionBase = RuntimeError

__all__ = ["Token2wavServer", "StreamPrompt", "ChunkOutput", "AdmissionError", "StreamMemory", "hift_stream_constants"]

MEL_CACHE_FRAMES = 8  # Token2wav.stream: mel frames carried into the next vocoder call (160 ms)
# Slot counts / chunk lengths a captured CFM solve is bucketed to (CUDA graphs only).
_SLOT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
_CHUNK_BUCKETS = (2, 4, 8, 16, 25, 32, 50, 64, 100, 128, 150, 200, 250, 300, 400, 500, 600, 800, 1000)
_CACHE_STEP = 50


class AdmissionError(_AdmissionBase):
    """A stream does not fit: the message names the limit (``max_streams`` or ``max_memory_bytes``)."""


@dataclass
class StreamPrompt:
    """A stream's prompt as ``Token2wav.set_stream_cache`` hands it to ``flow.setup_cache``:
    tokens (1, P_tok + 3) or (P_tok + 3,) ints (the 3 lookahead tokens last), prompt mel
    (1, P, 80) or (P, 80) with P = 2 * P_tok, the raw speaker embedding (1, E) or (E,). ``seed``
    seeds the stream's vocoder random state; ``waveform=False`` makes a mel-only stream (its
    vocoder stage is skipped)."""

    tokens: torch.Tensor
    mel: torch.Tensor
    spk: torch.Tensor
    seed: int = 0
    waveform: bool = True


@dataclass
class ChunkOutput:
    """One stream's result of one tick: the chunk's mel (80, T) in the CFM dtype and, with a
    vocoder, its waveform (samples,) in the vocoder's dtype (the upstream ``Token2wav.stream``
    samples: the overlap tail is held back until the last chunk)."""

    mel: torch.Tensor
    wav: Optional[torch.Tensor] = None
    last: bool = False


@dataclass
class StreamMemory:
    """Bytes per stream of every stage's state (upper bounds at the configured maxima)."""

    cfm: int
    encoder: int
    vocoder: int

    @property
    def total(self) -> int:
        return self.cfm + self.encoder + self.vocoder


@dataclass
class _Stream:
    prompt_frames: int
    seed: int
    conf_cnn: torch.Tensor
    conf_att: torch.Tensor
    rng: Optional[torch.Tensor] = None  # the source module's random state (vocoder only)
    hift_mel: Optional[torch.Tensor] = None
    hift_source: Optional[torch.Tensor] = None
    hift_speech: Optional[torch.Tensor] = None
    waveform: bool = True
    chunks: int = 0
    done: bool = False


def hift_stream_constants(hift: nn.Module) -> tuple[int, int]:
    """(samples per mel frame, source/speech cache samples) of a HiFTGenerator: 480 and 3840 at
    the shipped 24 kHz / 50 Hz sizes, as ``Token2wav.stream`` hard-codes them."""
    rates = getattr(hift, "m_source", None)
    scale = getattr(getattr(rates, "l_sin_gen", None), "upsample_scale", None)
    if scale is None:
        scale = math.prod(getattr(u, "stride", (1,))[0] for u in hift.ups) * hift.istft_params["hop_len"]
    scale = int(scale)
    return scale, MEL_CACHE_FRAMES * scale


def _flow_gaps(flow: Any) -> list[str]:
    gaps = []
    for name in ("input_embedding", "spk_embed_affine_layer", "encoder", "encoder_proj", "decoder"):
        if not isinstance(getattr(flow, name, None), nn.Module):
            gaps.append(f"no '{name}' module")
    enc = getattr(flow, "encoder", None)
    if enc is not None and not callable(getattr(enc, "forward_chunk", None)):
        gaps.append("encoder has no 'forward_chunk'")
    for name in ("pre_lookahead_len", "up_rate"):
        if not isinstance(getattr(flow, name, None), int):
            gaps.append(f"no int '{name}'")
    return gaps


class _RngSlot:
    """Runs a callable on a stream's own random state of ``device``'s default generator."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def initial(self, seed: int) -> torch.Tensor:
        gen = torch.Generator(device=self.device)
        gen.manual_seed(int(seed))
        return gen.get_state()

    def run(self, state: torch.Tensor, fn, *args):
        if self.cuda:
            saved = torch.cuda.get_rng_state(self.device)
            torch.cuda.set_rng_state(state, self.device)
        else:
            saved = torch.get_rng_state()
            torch.set_rng_state(state)
        try:
            out = fn(*args)
            new = torch.cuda.get_rng_state(self.device) if self.cuda else torch.get_rng_state()
        finally:
            if self.cuda:
                torch.cuda.set_rng_state(saved, self.device)
            else:
                torch.set_rng_state(saved)
        return out, new


class Token2wavServer:
    """Many streams of the ``stepaudio2`` token2wav at once: tokens -> mel -> waveform per tick.

    Args:
        flow: the upstream ``CausalMaskedDiffWithXvec`` (its embedding, conformer encoder,
            projections and the CFM decoder whose estimator weights are copied now); or a
            ``Token2wav`` (its ``.flow`` and ``.hift``).
        hift: the upstream ``HiFTGenerator`` (None: mel only).
        max_streams: streams open at once (CFM slots).
        max_prompt_frames: longest prompt (mel frames; 500 = 10 s).
        max_chunk_tokens: longest pushed chunk (tokens, lookahead included; 28 = 25 + 3).
        n_timesteps: Euler steps of every solve (the upstream default 10).
        dtype, device: of the CFM (default: the upstream estimator's); the encoder and vocoder run
            in their modules' own dtype and device.
        graphs: capture the CFM solves as CUDA graphs (default: on CUDA).
        encoder_batching: True (default): streams of equal encoder shapes run as one batch;
            ``"ragged"``: streams whose chunks have the same token count and last flag run as one
            batch whatever their conformer cache lengths (caches left-padded to a common,
            bucketed length and masked: the relative positions of real keys are unchanged); False:
            every stream alone.
        max_memory_bytes: optional budget for :meth:`memory_plan` ``.total`` x open streams.
        check_finite: reject a prompt mel / speaker embedding holding NaN/Inf at ``open_stream``
            (one host sync per open; default False: such a stream only corrupts itself).
        fused: torch_cfm's fused DiT body (None = the dispatch policy).
        timing: synchronise around each stage and add its seconds to ``stats``.
        batch_buckets: sorted batch sizes an encoder or vocoder batch is padded up to (with
            copies of its first row, dropped after: rows never mix), so that shapes repeat for
            CUDA graphs; default: the CFM's slot buckets when ``graphs``, else no padding.
        stage_graphs: replay the encoder group, the HiFT's f0 predictor, its source module (per
            stream, on the stream's random state) and its ``decode`` from CUDA graphs, one per
            shape, each checked once against its eager call
            (:class:`~torch_cfm.integrations._graphed.GraphedCall`; eager on CPU, and where a
            capture fails or mismatches). Default: ``graphs``.
        cfm_options: extra :class:`~torch_cfm.CFMServer` keyword arguments (e.g. ``buckets``).
        prompt_steps_per_tick: None (default): a stream's prompt is solved inside ``open_stream``.
            An int k in [1, n_timesteps]: spread over the next ticks, k Euler steps per ``step``
            (:class:`~torch_cfm.CFMServer`'s option of that name).
    Attributes:
        cfm_server: the :class:`~torch_cfm.CFMServer` of every stream's CFM.
        flow, hift: the upstream modules (not modified, except that the HiFT's ``stft_window``
            attribute is moved to its device: same values, no host copy per call).
        stats: seconds spent per stage (``encoder``, ``cfm``, ``vocoder``) when ``timing=True``;
            counts of ``ticks``, ``chunks``, ``encoder_batches`` (``ragged_batches`` of them) and
            ``vocoder_batches``.
    """

    def __init__(self, flow: Any, hift: Optional[nn.Module] = None, *, max_streams: int = 16,
                 max_prompt_frames: int = 500, max_chunk_tokens: int = 28, n_timesteps: int = 10,
                 dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None,
                 graphs: Optional[bool] = None, encoder_batching: Any = True,
                 max_memory_bytes: Optional[int] = None, check_finite: bool = False,
                 fused: Optional[bool] = None, timing: bool = False,
                 batch_buckets: Optional[Sequence[int]] = None, stage_graphs: Optional[bool] = None,
                 cfm_options: Optional[Mapping[str, Any]] = None,
                 prompt_steps_per_tick: Optional[int] = None) -> None:
        op = "Token2wavServer"
        if _flow_gaps(flow) and hasattr(flow, "flow"):
            hift = getattr(flow, "hift", None) if hift is None else hift
            flow = flow.flow
        gaps = _flow_gaps(flow)
        if gaps:
            raise TypeError(f"{op}: flow must be a stepaudio2 CausalMaskedDiffWithXvec (or a Token2wav holding one), "
                            f"got {_type_name(flow)} ({', '.join(gaps)})")
        if hift is not None and hift_gaps(hift):
            raise TypeError(f"{op}: hift must be a stepaudio2 HiFTGenerator, got {_type_name(hift)} "
                            f"({', '.join(hift_gaps(hift))})")
        for name, val in (("max_streams", max_streams), ("max_prompt_frames", max_prompt_frames),
                          ("max_chunk_tokens", max_chunk_tokens), ("n_timesteps", n_timesteps)):
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                fail(op, name, "be a positive int", repr(val))
        if max_memory_bytes is not None and (not isinstance(max_memory_bytes, int) or max_memory_bytes <= 0):
            fail(op, "max_memory_bytes", "be a positive int or None", repr(max_memory_bytes))
        self.flow, self.hift = flow, hift
        decoder = flow.decoder
        config, sd = _estimator_config(decoder, op)
        self.device, self.dtype, self.graphs = _placement(decoder, device, dtype, graphs)
        self.n_timesteps = n_timesteps
        self.max_streams, self.max_prompt_frames = max_streams, max_prompt_frames
        self.max_chunk_tokens = max_chunk_tokens
        self.up_rate, self.lookahead = int(flow.up_rate), int(flow.pre_lookahead_len)
        self.max_chunk_frames = max_chunk_tokens * self.up_rate
        if encoder_batching not in (True, False, "ragged"):
            fail(op, "encoder_batching", 'be True, False or "ragged"', repr(encoder_batching))
        self.encoder_batching = encoder_batching
        self.max_memory_bytes = max_memory_bytes
        self.check_finite = bool(check_finite)
        self.timing = bool(timing)
        self.stats = {"encoder": 0.0, "cfm": 0.0, "vocoder": 0.0, "ticks": 0, "chunks": 0, "encoder_batches": 0,
                      "ragged_batches": 0, "vocoder_batches": 0}
        with torch.inference_mode(False):
            est = DiT(config)
            est.load_state_dict(sd, strict=True)
            est = est.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        self.cfm = StreamingCFM(est, n_timesteps=n_timesteps, cfg_rate=float(decoder.inference_cfg_rate),
                                noise=decoder.rand_noise.detach())
        options = dict(cfm_options or {})
        if self.graphs:
            top = max_prompt_frames + TRIM_KEEP_OLDEST
            options.setdefault("chunk_buckets", [b for b in _CHUNK_BUCKETS if b < max_prompt_frames]
                               + [max(max_prompt_frames, self.max_chunk_frames)])
            options.setdefault("cache_buckets", list(range(0, top, _CACHE_STEP)) + [top])
            options.setdefault("slot_buckets", [b for b in _SLOT_BUCKETS if b < max_streams] + [max_streams])
        self.cfm_server = CFMServer(self.cfm, max_requests=max_streams, max_prompt_frames=max_prompt_frames,
                                    max_chunk_frames=self.max_chunk_frames, device=self.device, dtype=self.dtype,
                                    fused=fused, graphs=self.graphs, prompt_steps_per_tick=prompt_steps_per_tick,
                                    **options)
        self.prompt_steps_per_tick = prompt_steps_per_tick
        self._rng = _RngSlot(next(hift.parameters()).device) if hift is not None else None
        if hift is not None:
            self.samples_per_frame, self.source_cache = hift_stream_constants(hift)
            hparam = next(hift.parameters())
            self.hift_dtype, self.hift_device = hparam.dtype, hparam.device
            window = getattr(hift, "stft_window", None)
            if isinstance(window, torch.Tensor) and window.device != self.hift_device:
                # A plain attribute (not a buffer): the upstream copies it to the device in every
                # stft/istft call, a host copy a CUDA graph cannot hold. Same values, on the device.
                hift.stft_window = window.to(self.hift_device)
            self._window = torch.hamming_window(2 * self.source_cache, periodic=False, dtype=torch.float64,
                                                device=self.hift_device)
        self._streams: dict[Hashable, _Stream] = {}
        eparam = next(flow.encoder.parameters())
        self.enc_dtype, self.enc_device = eparam.dtype, eparam.device
        if batch_buckets is None and self.graphs:
            batch_buckets = self.cfm_server.slot_buckets or [max_streams]
        self.batch_buckets = sorted(int(b) for b in batch_buckets) if batch_buckets else None
        self.stage_graphs = self.graphs if stage_graphs is None else bool(stage_graphs)
        self._enc_call, self._ragged_call = self._encode_group, self._ragged_group
        self._f0_call, self._source_call, self._decode_call = self._hift_f0, self._hift_source, self._hift_decode
        if self.stage_graphs:
            from ._graphed import GraphedCall

            budget = 8 * max(len(self.batch_buckets or [1]), 1)
            self._enc_call = GraphedCall(self._encode_group, name="Token2wavServer.encoder", max_graphs=budget)
            self._ragged_call = GraphedCall(self._ragged_group, name="Token2wavServer.encoder_ragged",
                                            max_graphs=budget)
            if hift is not None:
                self._f0_call = GraphedCall(self._hift_f0, name="Token2wavServer.hift_f0", max_graphs=budget)
                self._decode_call = GraphedCall(self._hift_decode, name="Token2wavServer.hift_decode",
                                                max_graphs=budget)
                self._source_call = GraphedCall(self._hift_source, name="Token2wavServer.hift_source",
                                                max_graphs=budget, random=True)

    # ------------------------------------------------------------------ streams
    @property
    def open_streams(self) -> list[Hashable]:
        return list(self._streams)

    def memory_plan(self) -> StreamMemory:
        """Bytes per stream of each stage's state at the configured maxima: the CFM arena slot
        (every arena tensor / slots, in the CFM dtype), the conformer caches (prompt + 100 frames
        after the trim, + one chunk before it, in the encoder's dtype) and the vocoder caches."""
        cfm = 0
        for arena in self.cfm_server.arenas:
            cfm += arena.nbytes()
        cfm = -(-cfm // sum(a.rows for a in self.cfm_server.arenas))
        enc = self.flow.encoder
        size = enc.output_size()
        layers = len(enc.encoders) + len(enc.up_encoders)
        heads = enc.encoders[0].self_attn.h
        d_k = enc.encoders[0].self_attn.d_k
        frames = self.max_prompt_frames + TRIM_KEEP_OLDEST + self.max_chunk_frames
        item = torch.empty((), dtype=self.enc_dtype).element_size()
        encoder = item * (layers * heads * frames * 2 * d_k + size * (2 + 2 * self.up_rate))
        vocoder = 0
        if self.hift is not None:
            hitem = torch.empty((), dtype=self.hift_dtype).element_size()
            mel = self.flow.output_size
            vocoder = hitem * (mel * MEL_CACHE_FRAMES + 2 * self.source_cache) + self._rng.initial(0).numel()
        return StreamMemory(cfm=cfm, encoder=encoder, vocoder=vocoder)

    def state_bytes(self) -> int:
        """Bytes held now: the CFM arenas plus every open stream's encoder/vocoder tensors."""
        total = sum(a.nbytes() for a in self.cfm_server.arenas)
        for st in self._streams.values():
            for t in (st.conf_cnn, st.conf_att, st.rng, st.hift_mel, st.hift_source, st.hift_speech):
                if t is not None:
                    total += t.numel() * t.element_size()
        return total

    def _admit(self, new: int) -> None:
        op = "Token2wavServer.open_stream"
        count = len(self._streams) + new
        if count > self.max_streams:
            raise AdmissionError(f"{op}: max_streams={self.max_streams} reached ({len(self._streams)} open, "
                                 f"{new} opening); close a stream or build the server with a larger max_streams")
        if new > self.cfm_server.free_slots:  # slots of streams closed mid-prompt return when their cohort ends
            raise AdmissionError(f"{op}: max_streams={self.max_streams}: {self.cfm_server.free_slots} CFM slots free "
                                 f"for {new} opening (a stream closed while its prompt was solved holds its slot for "
                                 "at most n / prompt_steps_per_tick ticks); retry after the next step")
        if self.max_memory_bytes is not None:
            per = self.memory_plan().total
            if count * per > self.max_memory_bytes:
                raise AdmissionError(f"{op}: max_memory_bytes={self.max_memory_bytes} would be exceeded: "
                                     f"{count} streams x {per} bytes per stream = {count * per}")

    def open_stream(self, stream_id: Hashable, prompt_tokens: torch.Tensor, prompt_mel: torch.Tensor,
                    spk: torch.Tensor, *, seed: int = 0, waveform: bool = True) -> Optional[torch.Tensor]:
        """Open one stream (:meth:`open_many` of one); returns its prompt mel (80, P), or None
        with ``prompt_steps_per_tick`` (the prompt is solved over the next ticks)."""
        return self.open_many({stream_id: StreamPrompt(prompt_tokens, prompt_mel, spk, seed, waveform)}).get(stream_id)

    def ready(self, stream_id: Hashable) -> bool:
        """Whether an open stream takes chunks: False while its prompt solve is spread over ticks
        (``prompt_steps_per_tick``)."""
        if stream_id not in self._streams:
            fail("Token2wavServer.ready", "stream_id", "name an open stream", repr(stream_id))
        return self.cfm_server.ready(stream_id)

    def open_many(self, prompts: Mapping[Hashable, Sequence]) -> dict[Hashable, torch.Tensor]:
        """Open streams together: their encoders and prompt solves run batched.

        Args:
            prompts: ``{stream_id: StreamPrompt}`` or ``{stream_id: (prompt_tokens, prompt_mel,
                spk[, seed[, waveform]])}`` (see :class:`StreamPrompt`).
        Returns:
            ``{stream_id: prompt mel (80, P)}`` (the upstream ``setup_cache`` solve); ``{}`` with
            ``prompt_steps_per_tick``: the prompts are solved over the next ticks (:meth:`ready`).
        Raises:
            ValueError: a duplicate id, bad shapes (the message names the stream and argument).
            AdmissionError: too many streams or bytes (the message names the limit).
        """
        op = "Token2wavServer.open_many"
        staged = []
        for sid, item in prompts.items():
            if sid in self._streams or any(sid == s[0] for s in staged):
                fail(op, "stream_id", "not be open already", repr(sid))
            if isinstance(item, (tuple, list)) and 3 <= len(item) <= 5:
                item = StreamPrompt(*item)
            if not isinstance(item, StreamPrompt):
                fail(op, f"prompts[{sid!r}]",
                     "be a StreamPrompt or (prompt_tokens, prompt_mel, spk[, seed[, waveform]])",
                     type(item).__name__)
            tokens, mel, spk, seed, waveform = item.tokens, item.mel, item.spk, int(item.seed), bool(item.waveform)
            tokens = self._tokens(op, f"prompts[{sid!r}] prompt_tokens", tokens)
            p_tok = tokens.shape[1] - self.lookahead
            mel = self._tensor(op, f"prompts[{sid!r}] prompt_mel", mel, 3)
            if p_tok <= 0 or mel.shape[0] != 1 or mel.shape[1] != p_tok * self.up_rate or \
                    mel.shape[2] != self.flow.output_size:
                fail(op, f"prompts[{sid!r}] prompt_mel",
                     f"have shape (1, {max(p_tok, 0) * self.up_rate}, {self.flow.output_size}) for "
                     f"{tokens.shape[1]} prompt tokens ({self.lookahead} of them lookahead)", shape_str(mel))
            if mel.shape[1] > self.max_prompt_frames:
                fail(op, f"prompts[{sid!r}] prompt_mel", f"have at most max_prompt_frames={self.max_prompt_frames} "
                     "frames", str(mel.shape[1]), "build the server with a larger max_prompt_frames")
            spk = self._tensor(op, f"prompts[{sid!r}] spk", spk, 2)
            if spk.shape[0] != 1:
                fail(op, f"prompts[{sid!r}] spk", "have shape (1, E) or (E,)", shape_str(spk))
            if self.check_finite:
                for name, t in (("prompt_mel", mel), ("spk", spk)):
                    if not bool(torch.isfinite(t).all()):
                        fail(op, f"prompts[{sid!r}] {name}", "hold finite values only", "NaN/Inf")
            staged.append((sid, tokens, mel, spk, seed, waveform))
        self._admit(len(staged))
        with self._context():
            t0 = self._clock()
            with self._autocast():
                spks = {sid: self.flow.spk_embed_affine_layer(F.normalize(spk.to(self.enc_dtype), dim=1))
                        for sid, _, _, spk, _, _ in staged}
            enc_out = self._encode([(sid, tokens, None, None, False) for sid, tokens, *_ in staged])
            t1 = self._clock()
            for sid, tokens, mel, spk, seed, waveform in staged:
                h, cnn, att = enc_out[sid]
                if self.prompt_steps_per_tick is None:
                    self.cfm_server.open_request(sid, spks[sid][0], prompt_len=mel.shape[1])
                st = _Stream(prompt_frames=mel.shape[1], seed=seed, conf_cnn=cnn, conf_att=att,
                             waveform=waveform and self.hift is not None)
                if st.waveform:
                    st.rng = self._rng.initial(seed)
                self._streams[sid] = st
            if self.prompt_steps_per_tick is None:
                mels = self.cfm_server.solve_chunk({sid: (enc_out[sid][0], mel[0].transpose(0, 1))
                                                    for sid, _, mel, *_ in staged})
            else:  # staged now, solved by the next ticks' advance_prompts
                for sid, _, mel, *_ in staged:
                    self.cfm_server.open_request(sid, spks[sid][0], prompt_mu=enc_out[sid][0],
                                                 prompt_mel=mel[0].transpose(0, 1), prompt_len=mel.shape[1])
                mels = {}
            t2 = self._clock()
            self._account(t1 - t0, t2 - t1, 0.0)
        return mels

    def close_stream(self, stream_id: Hashable) -> None:
        """Drop the stream: its CFM slot is freed, every encoder/vocoder tensor of it released."""
        if stream_id not in self._streams:
            fail("Token2wavServer.close_stream", "stream_id", "name an open stream", repr(stream_id),
                 f"open streams: {list(self._streams)[:8]}")
        self.cfm_server.close_request(stream_id)
        del self._streams[stream_id]

    def stream_caches(self, stream_id: Hashable) -> dict[str, torch.Tensor]:
        """Copies of a stream's flow caches in the upstream ``inference_chunk`` layout (after the
        trims): ``conformer_cnn_cache``, ``conformer_att_cache``, ``estimator_cnn_cache`` (n, depth,
        2, 2C, 2) and ``estimator_att_cache`` (n, depth, 2, H, L, 2D)."""
        st = self._streams.get(stream_id)
        if st is None:
            fail("Token2wavServer.stream_caches", "stream_id", "name an open stream", repr(stream_id))
        cnn, att = self.cfm_server.request_caches(stream_id)
        return {"conformer_cnn_cache": st.conf_cnn.clone(), "conformer_att_cache": st.conf_att.clone(),
                "estimator_cnn_cache": cnn, "estimator_att_cache": att}

    # ------------------------------------------------------------------ ticks
    def step(self, chunks: Mapping[Hashable, Any]) -> dict[Hashable, ChunkOutput]:
        """One tick: each given stream advances by one chunk, all streams together.

        Args:
            chunks: ``{stream_id: tokens}`` or ``{stream_id: (tokens, last_chunk)}``; tokens
                (1, n) or (n,) ints as ``Token2wav.stream`` receives them (25 + 3 lookahead; the
                last chunk without lookahead, flagged). A stream ended by a last chunk takes no
                more chunks (close it).
        With ``prompt_steps_per_tick`` every tick (an empty one too) first advances the prompt solves
        under way by that many Euler steps; chunks are taken from :meth:`ready` streams only.

        Returns:
            ``{stream_id: ChunkOutput}`` (mel, and waveform with a vocoder).
        Raises:
            ValueError: an unknown or ended stream, a stream not ready, bad tokens (the message
                names the stream).
        """
        op = "Token2wavServer.step"
        staged = []
        for sid, item in chunks.items():
            st = self._streams.get(sid)
            if st is None:
                fail(op, "chunks", "name open streams only", repr(sid), f"open streams: {list(self._streams)[:8]}")
            if not self.cfm_server.ready(sid):
                fail(op, f"chunks[{sid!r}]", "name a ready stream", "a stream whose prompt solve is under way",
                     "each step advances it; ready(stream_id) says when it takes chunks")
            if st.done:
                fail(op, f"chunks[{sid!r}]", "follow no last chunk", "a chunk after the last one",
                     "close the stream")
            tokens, last = item if isinstance(item, (tuple, list)) else (item, False)
            tokens = self._tokens(op, f"chunks[{sid!r}] tokens", tokens)
            # The conformer's conv caches need 2 new tokens a chunk (its lookahead conv keeps 2 frames);
            # a waveform stream's first chunk needs the vocoder's 8 overlap frames (4 tokens).
            new_tokens = MEL_CACHE_FRAMES // self.up_rate if st.waveform and st.chunks == 0 else 2
            least = new_tokens + (0 if last else self.lookahead)
            if not least <= tokens.shape[1] <= self.max_chunk_tokens:
                fail(op, f"chunks[{sid!r}] tokens", f"have {least}..{self.max_chunk_tokens} tokens "
                     f"(last_chunk={bool(last)}; {self.lookahead} lookahead tokens unless last"
                     + ("; the first chunk of a waveform stream covers the vocoder's 8-frame overlap)"
                        if new_tokens > 2 else ")"), str(tokens.shape[1]))
            staged.append((sid, tokens, st.conf_cnn, st.conf_att, bool(last)))
        if self.prompt_steps_per_tick is not None:
            with self._context():
                t0 = self._clock()
                self.cfm_server.advance_prompts()  # the prompt mels are not used (Token2wav.stream drops them)
                self._account(0.0, self._clock() - t0, 0.0)
        if not staged:
            return {}
        with self._context():
            t0 = self._clock()
            enc_out = self._encode(staged)
            for sid, _, _, _, last in staged:
                st = self._streams[sid]
                _, st.conf_cnn, att = enc_out[sid]
                limit = st.prompt_frames + TRIM_KEEP_OLDEST
                if att.shape[3] > limit:  # Token2wav.stream's conformer trim
                    att = torch.cat([att[:, :, :, :st.prompt_frames], att[:, :, :, -TRIM_KEEP_OLDEST:]], dim=3)
                st.conf_att = att
                st.chunks += 1
                st.done = last
            t1 = self._clock()
            mels = self.cfm_server.solve_chunk({sid: enc_out[sid][0] for sid, *_ in staged})
            t2 = self._clock()
            out = {sid: ChunkOutput(mels[sid], None, last) for sid, _, _, _, last in staged}
            voc = [(sid, mels[sid], last) for sid, _, _, _, last in staged if self._streams[sid].waveform]
            if voc:
                for sid, wav in self._vocode(voc).items():
                    out[sid].wav = wav
            t3 = self._clock()
            self._account(t1 - t0, t2 - t1, t3 - t2, ticks=1, chunks=len(staged))
        return {sid: out[sid] for sid in chunks}

    # ------------------------------------------------------------------ stages
    def _encode(self, items) -> dict[Hashable, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Token embedding + conformer chunk + projection: {sid: (mu (80, T), cnn, att)} with the
        stream's new (untrimmed) conformer caches; equal shapes batched when enabled."""
        groups: dict[tuple, list] = {}
        for i, (sid, tokens, cnn, att, last) in enumerate(items):
            ragged = self.encoder_batching == "ragged" and att is not None
            key = (tokens.shape[1], None if att is None else ("ragged" if ragged else att.shape[3]), last)
            if not self.encoder_batching:
                key = key + (i,)
            groups.setdefault(key, []).append((sid, tokens, cnn, att, last))
        out = {}
        for key, members in groups.items():
            self.stats["encoder_batches"] += 1
            if key[1] == "ragged" and len({m[3].shape[3] for m in members}) > 1:
                self.stats["ragged_batches"] += 1
                out.update(self._encode_ragged(members))
                continue
            last = members[0][4]
            real = len(members)
            rows = members + [members[0]] * (self._padded(real) - real)
            tokens = torch.cat([m[1] for m in rows], dim=0)
            cnn = None if members[0][2] is None else torch.cat([m[2] for m in rows], dim=0)
            att = None if members[0][3] is None else torch.cat([m[3] for m in rows], dim=1)
            with self._autocast():
                h, new_cnn, new_att = self._enc_call(tokens, cnn, att, last)
            whole = len(rows) == 1  # else each stream's caches are copied out of the batch tensors, so
            for b, (sid, *_rest) in enumerate(members):  # that a stream holds its own bytes only
                cnn_b, att_b = new_cnn[b:b + 1], new_att[:, b:b + 1]
                out[sid] = (h[b].transpose(0, 1), cnn_b if whole else cnn_b.clone(),
                            att_b if whole else att_b.clone())
        return out

    def _encode_ragged(self, members) -> dict:
        """One batch of streams whose conformer caches differ in length: each layer's cache
        left-padded to the group's bucketed length Lb (zeros), the padding masked out of every
        attention (``mask`` = keys to attend), the new caches cut back to each stream's own frames
        in the upstream layout. Exactly the per-stream results: a real key's distance to each
        query, hence its relative position encoding, does not change with left padding."""
        enc = self.flow.encoder
        n1 = len(enc.encoders)
        last = members[0][4]
        lengths = [m[3].shape[3] for m in members]
        lb = max(lengths)
        lb = -(-lb // _CACHE_STEP) * _CACHE_STEP if self.batch_buckets else lb
        lb += lb % 2
        pad = self._padded(len(members)) - len(members)
        rows = members + [members[0]] * pad
        lengths = lengths + [lengths[0]] * pad
        first, up = [], []
        for (_, _, _, att, _), length in zip(rows, lengths):
            first.append(F.pad(att[:n1, :, :, :length // 2], (0, 0, lb // 2 - length // 2, 0)))
            up.append(F.pad(att[n1:], (0, 0, lb - length, 0)))
        att1, att2 = torch.cat(first, dim=1), torch.cat(up, dim=1)
        tokens = torch.cat([m[1] for m in rows], dim=0)
        cnn = torch.cat([m[2] for m in rows], dim=0)
        t1 = tokens.shape[1] - (0 if last else self.lookahead)
        t2 = t1 * self.up_rate
        dev = tokens.device
        keys1 = torch.arange(lb // 2 + t1, device=dev)
        keys2 = torch.arange(lb + t2, device=dev)
        half = torch.tensor([lb // 2 - n // 2 for n in lengths], device=dev)
        full = torch.tensor([lb - n for n in lengths], device=dev)
        mask1 = (keys1[None, :] >= half[:, None])[:, None, :].expand(-1, t1, -1)
        mask2 = (keys2[None, :] >= full[:, None])[:, None, :].expand(-1, t2, -1)
        with self._autocast():
            h, cnn_new, new1, new2 = self._ragged_call(tokens, cnn, att1, att2, mask1.contiguous(),
                                                       mask2.contiguous(), last)
        out = {}
        for b, ((sid, *_), length) in enumerate(zip(members, lengths)):
            a1 = new1[:, b:b + 1, :, lb // 2 - length // 2:]
            a2 = new2[:, b:b + 1, :, lb - length:]
            out[sid] = (h[b].transpose(0, 1), cnn_new[b:b + 1].clone(),
                        torch.cat([a1.repeat(1, 1, 1, 2, 1), a2], dim=0))
        return out

    def _ragged_group(self, tokens, cnn, att1, att2, mask1, mask2, last: bool):
        """The flow's chunk encoder over left-padded caches with key masks (the upstream
        modules, driven in ``UpsampleConformerEncoderV2.forward_chunk``'s order)."""
        flow, enc = self.flow, self.flow.encoder
        xs, _, _ = enc.embed(flow.input_embedding(tokens), None)
        if last:
            xs = F.pad(xs, (0, 0, 0, enc.pre_lookahead_layer.pre_lookahead_len))
        xs, cnn1 = enc.pre_lookahead_layer.forward_chunk(xs, cache=cnn[:, :, :2])
        pos = enc.embed.position_encoding(offset=None, size=att1.shape[3] + xs.shape[1])
        new1 = []
        for i, layer in enumerate(enc.encoders):
            xs, _, cache, _ = layer(xs, mask1, pos, att_cache=att1[i])
            new1.append(cache)
        xs, _, cnn2 = enc.up_layer.forward_chunk(xs.transpose(1, 2).contiguous(), None, cache=cnn[:, :, 2:])
        xs, _, _ = enc.up_embed(xs.transpose(1, 2).contiguous(), None)
        pos = enc.embed.position_encoding(offset=None, size=att2.shape[3] + xs.shape[1])
        new2 = []
        for i, layer in enumerate(enc.up_encoders):
            xs, _, cache, _ = layer(xs, mask2, pos, att_cache=att2[i])
            new2.append(cache)
        if enc.normalize_before:
            xs = enc.after_norm(xs)
        return flow.encoder_proj(xs), torch.cat([cnn1, cnn2], dim=2), torch.stack(new1), torch.stack(new2)

    def _encode_group(self, tokens, cnn, att, last: bool):
        """The flow's chunk encoder over one batch: embedding, conformer chunk, projection."""
        flow = self.flow
        h, new_cnn, new_att = flow.encoder.forward_chunk(flow.input_embedding(tokens), last_chunk=last,
                                                         cnn_cache=cnn, att_cache=att)
        return flow.encoder_proj(h), new_cnn, new_att

    def _hift_f0(self, mel):
        """The HiFT's f0 predictor and upsampling (the deterministic half of its source)."""
        return self.hift.f0_upsamp(self.hift.f0_predictor(mel)[:, None]).transpose(1, 2)

    def _hift_source(self, up):
        """The HiFT's source module on one stream's upsampled f0 (B = 1): its merged source."""
        with capturable(self.hift, self.hift.stft_window):
            return self.hift.m_source(up)[0]

    def _hift_decode(self, mel, source):
        with capturable(self.hift, self.hift.stft_window):
            return self.hift.decode(x=mel, s=source)

    def _padded(self, count: int) -> int:
        if not self.batch_buckets:
            return count
        return next((b for b in self.batch_buckets if b >= count), count)

    def _vocode(self, items) -> dict[Hashable, torch.Tensor]:
        """The vocoder of ``Token2wav.stream`` per stream, batched over equal input lengths."""
        groups = {}
        for sid, mel, last in items:
            st = self._streams[sid]
            mel = mel.to(device=self.hift_device, dtype=self.hift_dtype)[None]
            if st.hift_mel is not None:
                mel = torch.cat([st.hift_mel, mel], dim=2)
            cache_len = 0 if st.hift_source is None else st.hift_source.shape[2]
            groups.setdefault((mel.shape[2], cache_len), []).append((sid, mel, last))
        out = {}
        for (_, cache_len), members in groups.items():
            self.stats["vocoder_batches"] += 1
            pad = self._padded(len(members)) - len(members)
            mel = torch.cat([m[1] for m in members] + [members[0][1]] * pad, dim=0)
            up = self._f0_call(mel)
            sources = []
            for b, (sid, _, _) in enumerate(members):
                st = self._streams[sid]
                s, st.rng = self._rng.run(st.rng, self._source_call, up[b:b + 1])
                s = s.transpose(1, 2)
                if cache_len:
                    s[:, :, :cache_len] = st.hift_source
                sources.append(s)
            source = torch.cat(sources + sources[:1] * pad, dim=0)
            speech = self._decode_call(mel, source)
            n = self.source_cache
            for b, (sid, m, last) in enumerate(members):
                st = self._streams[sid]
                wav = speech[b:b + 1]
                if st.hift_speech is not None:
                    wav = wav.clone()
                    head = wav[:, :n] * self._window[:n] + st.hift_speech[:, -n:] * self._window[n:]
                    wav[:, :n] = head
                st.hift_mel = m[:, :, -MEL_CACHE_FRAMES:].clone()
                st.hift_source = source[b:b + 1, :, -n:].clone()
                st.hift_speech = wav[:, -n:].clone()
                out[sid] = (wav if last else wav[:, :-n])[0]
        return out

    # ------------------------------------------------------------------ start-up
    def warmup(self, prompt_frames: Sequence[int] = (300,), chunk_tokens: Sequence[int] = (28,),
               last_chunk_tokens: Sequence[int] = (), stream_counts: Optional[Sequence[int]] = None,
               ticks: int = 4, rounds: int = 2, cfm_warmup: Optional[Mapping[str, Any]] = None) -> dict:
        """Run every stage at the shapes a workload meets, now (kernels compiled, graphs captured).

        For each prompt length and each stream count (default: the CFM's slot buckets), that many
        streams are opened together, run ``ticks`` ticks of each chunk length (the conformer and
        CFM caches grow to the trim bound), then one last chunk of each ``last_chunk_tokens``
        length, and closed; all of it ``rounds`` times (the graph runners run a new shape eagerly
        once, then capture it). First the :class:`~torch_cfm.CFMServer` warms up: with
        ``cfm_warmup`` as its keyword arguments, by default the (T, L) pairs of these streams'
        prompts and chunks (:meth:`TorchCFMDecoder.stream_shapes`) at these stream counts (with
        ``prompt_steps_per_tick``: the chunks' pairs and the prompt cohorts' step spans).
        Returns {"streams", "ticks", "graphs": {stage: count}}.
        """
        counts = list(stream_counts) if stream_counts is not None else sorted(
            set(self.cfm_server.slot_buckets or [1, self.max_streams]) | {1})
        if cfm_warmup is None:  # the (T, L) solves these streams meet, not every bucket's product
            frames = [(n - self.lookahead) * self.up_rate for n in chunk_tokens]
            last = [n * self.up_rate for n in last_chunk_tokens] or frames[:1]
            pairs = self.solve_pairs(prompt_frames, frames, last)
            cfm_warmup = dict(pairs=pairs, slot_counts=counts)
            if self.prompt_steps_per_tick is not None:  # prompts are never solved whole
                chunk_lengths = set(frames) | set(last)
                cfm_warmup.update(pairs=[p for p in pairs if p[0] in chunk_lengths or p[0] not in prompt_frames],
                                  prompt_frames=list(prompt_frames))
        self.cfm_server.warmup(**dict(cfm_warmup))
        opened = done = 0
        vocab = self.flow.input_embedding.num_embeddings
        gen = torch.Generator().manual_seed(0)
        spk_dim = self.flow.spk_embed_affine_layer.in_features

        def tokens(n):
            return torch.randint(0, vocab, (1, n), generator=gen, dtype=torch.int32)

        for _ in range(rounds):
            for p in prompt_frames:
                p_tok = p // self.up_rate
                for count in counts:
                    count = min(count, self.max_streams - len(self._streams))
                    if count <= 0:
                        continue
                    ids = [("__warmup__", p, count, i) for i in range(count)]
                    self.open_many({sid: (tokens(p_tok + self.lookahead),
                                          torch.randn(1, p_tok * self.up_rate, self.flow.output_size, generator=gen),
                                          torch.randn(1, spk_dim, generator=gen)) for sid in ids})
                    done += self._until_ready(ids)
                    opened += count
                    for _ in range(ticks):
                        for n in chunk_tokens:
                            self.step({sid: tokens(n) for sid in ids})
                            done += 1
                    for n in last_chunk_tokens:
                        for sid in ids:
                            self.close_stream(sid)
                        self.open_many({sid: (tokens(p_tok + self.lookahead),
                                              torch.randn(1, p_tok * self.up_rate, self.flow.output_size,
                                                          generator=gen),
                                              torch.randn(1, spk_dim, generator=gen)) for sid in ids})
                        done += self._until_ready(ids)
                        opened += count
                        for _ in range(ticks):
                            self.step({sid: tokens(chunk_tokens[0]) for sid in ids})
                        self.step({sid: (tokens(n), True) for sid in ids})
                        done += ticks + 1
                    for sid in ids:
                        self.close_stream(sid)
        return {"streams": opened, "ticks": done, "graphs": self.graph_counts()}

    def _until_ready(self, ids) -> int:
        """Empty ticks until every stream of ``ids`` is ready; returns their count."""
        ticks = 0
        while not all(self.ready(sid) for sid in ids):
            self.step({})
            ticks += 1
        return ticks

    @staticmethod
    def solve_pairs(prompt_frames: Sequence[int], chunk_frames: Sequence[int],
                    last_chunk_frames: Sequence[int]) -> list[tuple[int, int]]:
        """(T, L) of every CFM solve streams of these lengths can produce in one server: each
        stream's own (:meth:`TorchCFMDecoder.stream_shapes`), and since a solve's cache window
        covers every slot it solves, idle padding included, each prompt and chunk length at every
        window any stream meets (a prompt solve padded with a settled stream's slot, a last chunk
        next to a longer prompt's stream)."""
        own = TorchCFMDecoder.stream_shapes(prompt_frames, chunk_frames, last_chunk_frames)
        windows = sorted({lb for _, lb in own if lb > 0})
        pairs = list(own)
        for t_len in [*prompt_frames, *chunk_frames, *last_chunk_frames]:
            pairs += [(t_len, lb) for lb in windows if (t_len, lb) not in pairs]
        return pairs

    def graph_counts(self) -> dict[str, int]:
        """CUDA graphs captured so far per stage (``cfm``: the CFM server's graph solver)."""
        keys = getattr(self.cfm_server.solve_fn, "_keys", {})
        out = {"cfm": sum(1 for ent in keys.values() if getattr(ent, "graph", None) is not None)}
        for name, call in (("encoder", self._enc_call), ("hift_f0", self._f0_call), ("hift_source", self._source_call),
                           ("hift_decode", self._decode_call)):
            out[name] = getattr(call, "graph_count", 0)
        return out

    # ------------------------------------------------------------------ helpers
    def _context(self):
        import contextlib

        stack = contextlib.ExitStack()
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.no_grad())
        return stack

    def _autocast(self):
        """``Token2wav(float16=True)`` runs the flow (embedding, encoder, projections) under fp16
        autocast: a half-precision flow on CUDA runs the same way here."""
        half = self.enc_dtype in (torch.float16, torch.bfloat16) and self.enc_device.type == "cuda"
        return torch.autocast("cuda", dtype=self.enc_dtype, enabled=half)

    def _clock(self) -> float:
        if not self.timing:
            return 0.0
        import time

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _account(self, enc: float, cfm: float, voc: float, ticks: int = 0, chunks: int = 0) -> None:
        self.stats["encoder"] += enc
        self.stats["cfm"] += cfm
        self.stats["vocoder"] += voc
        self.stats["ticks"] += ticks
        self.stats["chunks"] += chunks

    def _tokens(self, op: str, arg: str, t: Any) -> torch.Tensor:
        if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.is_complex() or t.dtype == torch.bool:
            fail(op, arg, "be an integer torch.Tensor", type(t).__name__ if not isinstance(t, torch.Tensor)
                 else str(t.dtype))
        if t.dim() == 1:
            t = t[None]
        if t.dim() != 2 or t.shape[0] != 1 or t.shape[1] == 0:
            fail(op, arg, "have shape (1, n) or (n,), n >= 1", shape_str(t))
        return t.to(self.enc_device)

    def _tensor(self, op: str, arg: str, t: Any, dims: int) -> torch.Tensor:
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
            fail(op, arg, "be a floating-point torch.Tensor", type(t).__name__ if not isinstance(t, torch.Tensor)
                 else str(t.dtype))
        if t.dim() == dims - 1:
            t = t[None]
        if t.dim() != dims:
            fail(op, arg, f"have {dims} dims (or {dims - 1})", shape_str(t))
        return t.to(self.enc_device)

    def describe(self) -> str:
        plan = self.memory_plan()
        return (f"Token2wavServer({len(self._streams)}/{self.max_streams} streams; bytes/stream cfm={plan.cfm} "
                f"encoder={plan.encoder} vocoder={plan.vocoder}; {self.cfm_server.describe()})")
