"""``Token2wavServer``: many streams of a ``stepaudio2`` token2wav at once, tokens → mel → waveform.

    >>> from torch_cfm.serving import Token2wavServer
    >>> server = Token2wavServer(flow, hift, max_streams=16, max_prompt_frames=500)
    >>> server.open_stream("a", prompt_tokens, prompt_mel, spk_embedding, seed=0)
    >>> out = server.step({"a": tokens_a, "b": (tokens_b, True)})    # True = the stream's last chunk
    >>> out["a"].mel, out["a"].wav                                  # (80, T), (samples,)
    >>> server.close_stream("a")

One ``step`` is one tick of the serving loop: every stream given a chunk advances by that chunk,
all of them together, through the upstream ``Token2wav.stream`` path's three stages:

* **encoder** (:class:`~torch_cfm.serving.encoder_stage.EncoderStage`): the flow's own embedding,
  conformer chunk encoder and projection, batched across streams (a half-precision flow on CUDA
  under autocast, as ``Token2wav`` runs it); every stream's conformer caches in a slot, the attention
  cache trimmed to its first P and last 100 frames like ``Token2wav.stream`` (P = the prompt's mel frames);
* **CFM**: one :class:`~torch_cfm.serving.CFMServer` over every stream (a torch_cfm DiT holding the
  upstream estimator's weights, the decoder's ``rand_noise`` and ``inference_cfg_rate``): the
  prompt solves of the streams opened together in one ragged solve, then each tick's chunks in one
  ragged solve; with ``prompt_steps_per_tick=k`` a prompt solve is spread over the next ticks
  instead, and with ``voice_cache_bytes`` a voice already solved is copied in instead;
* **vocoder** (:mod:`~torch_cfm.serving.vocoder_stages`): a ``HiFTGenerator`` on torch_cfm's
  many-stream HiFT (each stream on its own counter-based random stream; ``vocoder="upstream"``
  runs the package's own modules with the upstream per-stream random stream instead), or
  minicpmo-utils' causal ``BoundedVocoder`` batched across streams.

Admission: ``max_streams`` slots; with ``max_memory_bytes`` also a byte budget over the per-stream
state of every stage (:meth:`Token2wavServer.memory_plan`); a stream that does not fit raises
:class:`~torch_cfm.serving.AdmissionError` naming the limit. ``close_stream`` drops every tensor of
the stream (its CFM and conformer slots are reused). Rows never mix across streams, so a stream whose prompt holds
NaN/Inf yields NaN for itself only (``check_finite=True`` rejects it at ``open_stream`` instead).
Importing this module never imports ``stepaudio2``: the flow and vocoder are the caller's objects.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Any, Hashable, Mapping, Optional, Sequence

import torch
from torch import nn

from ..buckets import Buckets, padded_count, shared_solve_shapes
from ..errors import fail
from ..models.cache import TRIM_KEEP_OLDEST
from ..models.hift_capturable import MEL_CACHE_FRAMES
from ..models.upstream import dit_from_decoder, flow_gaps, hift_gaps, placement, type_name
from ..models.vocoder.causal import bounded_vocoder_gaps
from ..solve import StreamingCFM
from . import token2wav_streams as _streams
from .cfm_server import CFMServer
from .encoder_stage import EncoderStage
from .hift_stage import HiFTStage
from .vocoder_stages import CausalVocoderStage, HiFTVocoderStage
from .reports import AdmissionError


@dataclass
class StreamPrompt:
    """A stream's prompt as ``Token2wav.set_stream_cache`` hands it to ``flow.setup_cache``:
    tokens (1, P_tok + 3) or (P_tok + 3,) ints (the 3 lookahead tokens last), prompt mel
    (1, P, 80) or (P, 80) with P = 2 * P_tok, the raw speaker embedding (1, E) or (E,). ``seed``
    seeds the stream's vocoder random state; ``waveform=False`` makes a mel-only stream (its
    vocoder stage is skipped); ``voice`` names the voice (a hashable) for the voice cache (default:
    the prompt's content; False: keep this stream out of the cache). Streams that one
    :meth:`Token2wavServer.open_many` opens with the same voice name the same prompt: one is solved
    and the others get copies of its state (without ``prompt_steps_per_tick``; with or without a
    voice cache)."""

    tokens: torch.Tensor
    mel: torch.Tensor
    spk: torch.Tensor
    seed: int = 0
    waveform: bool = True
    voice: Any = None


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
    waveform: bool = True
    chunks: int = 0
    done: bool = False


class Token2wavServer:
    """Many streams of the ``stepaudio2`` token2wav at once: tokens -> mel -> waveform per tick.

    Args:
        flow: the upstream ``CausalMaskedDiffWithXvec`` (its embedding, conformer encoder,
            projections and the CFM decoder whose estimator weights are copied now); or a
            ``Token2wav`` (its ``.flow`` and its vocoder: ``.hift``, or minicpmo-utils'
            ``.bounded_vocoder``).
        hift: the upstream ``HiFTGenerator``, or minicpmo-utils' ``BoundedVocoder`` (None: mel only).
        max_streams: streams open at once (CFM slots).
        max_prompt_frames: longest prompt (mel frames; 500 = 10 s).
        max_chunk_tokens: longest pushed chunk (tokens, lookahead included; 28 = 25 + 3).
        n_timesteps: Euler steps of every solve (the upstream default 10).
        dtype, device: of the CFM (default: the upstream estimator's); the encoder and vocoder run
            in their modules' own dtype and device.
        graphs: capture the CFM solves as CUDA graphs (default: on CUDA).
        encoder_batching: True (default): streams of equal encoder shapes run as one batch;
            ``"ragged"``: also streams whose conformer cache lengths differ; False: every stream alone.
        max_memory_bytes: optional budget for :meth:`memory_plan` ``.total`` x open streams.
        check_finite: reject a prompt mel / speaker embedding holding NaN/Inf at ``open_stream``
            (one host sync per open; default False: such a stream only corrupts itself).
        fused: torch_cfm's fused DiT body (None = the dispatch policy).
        timing: synchronise around each stage and add its seconds to ``stats``.
        batch_buckets: sorted batch sizes an encoder or vocoder batch is padded up to (with
            copies of its first row, dropped after: rows never mix), so that shapes repeat for
            CUDA graphs; default: the CFM's slot buckets when ``graphs``, else no padding.
        stage_graphs: replay the encoder and vocoder stages from checked CUDA graphs, one per
            shape (:class:`~torch_cfm.graphs.GraphedCall`). Default: ``graphs``.
        cfm_options: extra :class:`~torch_cfm.serving.CFMServer` keyword arguments (e.g. ``buckets``).
        prompt_steps_per_tick: None (default): a stream's prompt is solved inside ``open_stream``.
            An int k in [1, n_timesteps]: spread over the next ticks, k Euler steps per ``step``.
        voice_cache_bytes: keep solved voice prompts (CFM and encoder state) up to this many
            bytes and copy them into every stream that opens with the same voice (None: no cache).
        vocoder: for a ``HiFTGenerator``: "auto" / "torch_cfm" (:class:`~torch_cfm.models.vocoder.HiFTVocoder`,
            a random stream per stream) or "upstream" (the package's modules, the upstream draws).
        vocoder_precision: the HiFT vocoder's precision (:func:`torch_cfm.policy.vocoder_precision`).
    Attributes:
        cfm_server: the :class:`~torch_cfm.serving.CFMServer` of every stream's CFM.
        encoder, vocoder: the stages (``vocoder`` None without a HiFT).
        flow, hift: the upstream modules (not modified).
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
                 prompt_steps_per_tick: Optional[int] = None, voice_cache_bytes: Optional[int] = None,
                 vocoder: str = "auto", vocoder_precision: str = "auto") -> None:
        op = "Token2wavServer"
        flow, hift = self._modules(op, flow, hift)
        if vocoder not in ("auto", "torch_cfm", "upstream"):
            fail(op, "vocoder", 'be "auto", "torch_cfm" or "upstream"', repr(vocoder))
        for name, val in (("max_streams", max_streams), ("max_prompt_frames", max_prompt_frames),
                          ("max_chunk_tokens", max_chunk_tokens), ("n_timesteps", n_timesteps)):
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                fail(op, name, "be a positive int", repr(val))
        if max_memory_bytes is not None and (not isinstance(max_memory_bytes, int) or max_memory_bytes <= 0):
            fail(op, "max_memory_bytes", "be a positive int or None", repr(max_memory_bytes))
        if encoder_batching not in (True, False, "ragged"):
            fail(op, "encoder_batching", 'be True, False or "ragged"', repr(encoder_batching))
        self.flow, self.hift = flow, hift
        decoder = flow.decoder
        self.device, self.dtype, self.graphs = placement(decoder, device, dtype, graphs)
        self.n_timesteps, self.max_streams, self.max_prompt_frames = n_timesteps, max_streams, max_prompt_frames
        self.max_chunk_tokens = max_chunk_tokens
        self.up_rate, self.lookahead = int(flow.up_rate), int(flow.pre_lookahead_len)
        self.max_chunk_frames = max_chunk_tokens * self.up_rate
        self.max_memory_bytes, self.check_finite, self.timing = max_memory_bytes, bool(check_finite), bool(timing)
        self.prompt_steps_per_tick = prompt_steps_per_tick
        self.stats = {"encoder": 0.0, "cfm": 0.0, "vocoder": 0.0, "ticks": 0, "chunks": 0, "encoder_batches": 0,
                      "ragged_batches": 0, "vocoder_batches": 0}
        est = dit_from_decoder(decoder, self.device, self.dtype, op)
        self.cfm = StreamingCFM(est, n_timesteps=n_timesteps, cfg_rate=float(decoder.inference_cfg_rate),
                                noise=decoder.rand_noise.detach())
        options = dict(cfm_options or {})
        if self.graphs:
            policy = Buckets.for_graphs(max_chunk_frames=max(max_prompt_frames, self.max_chunk_frames),
                                        max_cache_frames=max_prompt_frames + TRIM_KEEP_OLDEST, max_slots=max_streams)
            options.setdefault("chunk_buckets", policy.chunks)
            options.setdefault("cache_buckets", policy.caches)
            options.setdefault("slot_buckets", policy.slots)
        self.cfm_server = CFMServer(self.cfm, max_requests=max_streams, max_prompt_frames=max_prompt_frames,
                                    max_chunk_frames=self.max_chunk_frames, device=self.device, dtype=self.dtype,
                                    fused=fused, graphs=self.graphs, prompt_steps_per_tick=prompt_steps_per_tick,
                                    voice_cache_bytes=voice_cache_bytes, **options)
        eparam = next(flow.encoder.parameters())
        self.enc_dtype, self.enc_device = eparam.dtype, eparam.device
        if batch_buckets is None and self.graphs:
            batch_buckets = self.cfm_server.slot_buckets or [max_streams]
        self.batch_buckets = sorted(int(b) for b in batch_buckets) if batch_buckets else None
        self.stage_graphs = self.graphs if stage_graphs is None else bool(stage_graphs)
        self.causal = hift is not None and not bounded_vocoder_gaps(hift)
        self.encoder = EncoderStage(flow, batching=encoder_batching, batch_buckets=self.batch_buckets,
                                    graphs=self.stage_graphs, stats=self.stats, max_streams=max_streams,
                                    max_prompt_frames=max_prompt_frames, max_chunk_tokens=max_chunk_tokens,
                                    causal=self.causal)
        self.encoder_batching = encoder_batching
        self.vocoder = self._vocoder_stage(hift, vocoder, vocoder_precision)
        self._streams: dict[Hashable, _Stream] = {}

    def _vocoder_stage(self, hift, kind: str, precision: str):
        if hift is None:
            return None
        budget = 8 * max(len(self.batch_buckets or [1]), 1)
        if self.causal:
            return CausalVocoderStage(hift, batch_buckets=self.batch_buckets, graphs=self.stage_graphs,
                                      stats=self.stats, budget=budget)
        padded = functools.partial(padded_count, buckets=self.batch_buckets)
        common = dict(mel_channels=self.flow.output_size, padded=padded, graphs=self.stage_graphs,
                      stats=self.stats, budget=budget)
        if kind == "upstream":
            return HiFTStage(hift, **common)
        return HiFTVocoderStage(hift, precision=precision, max_streams=self.max_streams,
                                max_chunk_frames=self.max_chunk_frames, **common)

    @staticmethod
    def _modules(op: str, flow: Any, hift: Any) -> tuple[Any, Any]:
        """(flow, vocoder) of the arguments (a Token2wav gives both), checked by shape: the vocoder
        a HiFTGenerator or minicpmo-utils' BoundedVocoder."""
        if flow_gaps(flow) and hasattr(flow, "flow"):
            if hift is None:
                bounded = getattr(flow, "bounded_vocoder", None)
                hift = bounded if bounded is not None and not bounded_vocoder_gaps(bounded) else getattr(flow, "hift", None)
            flow = flow.flow
        gaps = flow_gaps(flow)
        if gaps:
            raise TypeError(f"{op}: flow must be a stepaudio2 CausalMaskedDiffWithXvec (or a Token2wav holding one), "
                            f"got {type_name(flow)} ({', '.join(gaps)})")
        if hift is not None and hift_gaps(hift) and bounded_vocoder_gaps(hift):
            raise TypeError(f"{op}: hift must be a stepaudio2 HiFTGenerator or minicpmo-utils' BoundedVocoder, got "
                            f"{type_name(hift)} ({', '.join(hift_gaps(hift))})")
        return flow, hift

    # ------------------------------------------------------------------ streams
    @property
    def open_streams(self) -> list[Hashable]:
        return list(self._streams)

    def memory_plan(self) -> StreamMemory:
        """Bytes per stream of each stage's state at the configured maxima: the CFM arena slot
        (every arena tensor / slots, in the CFM dtype), the conformer caches (prompt + 100 frames
        after the trim, + one chunk before it, in the encoder's dtype) and the vocoder caches."""
        arenas = self.cfm_server.arenas
        cfm = -(-sum(a.nbytes() for a in arenas) // sum(a.rows for a in arenas))
        enc = self.flow.encoder
        layers = len(enc.encoders) + len(enc.up_encoders)
        attn = enc.encoders[0].self_attn
        frames = self.max_prompt_frames + TRIM_KEEP_OLDEST + self.max_chunk_frames
        item = torch.empty((), dtype=self.enc_dtype).element_size()
        encoder = item * (layers * attn.h * frames * 2 * attn.d_k + enc.output_size() * (2 + 2 * self.up_rate))
        vocoder = 0 if self.vocoder is None else self.vocoder.stream_bytes()
        return StreamMemory(cfm=cfm, encoder=encoder, vocoder=vocoder)

    def state_bytes(self) -> int:
        """Bytes held now: the CFM arenas, the conformer cache slots and every open stream's vocoder tensors."""
        total = sum(a.nbytes() for a in self.cfm_server.arenas) + self.encoder.slots.nbytes()
        return total + (0 if self.vocoder is None else self.vocoder.state_bytes())

    def open_stream(self, stream_id: Hashable, prompt_tokens: torch.Tensor, prompt_mel: torch.Tensor,
                    spk: torch.Tensor, *, seed: int = 0, waveform: bool = True,
                    voice: Optional[Hashable] = None) -> Optional[torch.Tensor]:
        """Open one stream (:meth:`open_many` of one); returns its prompt mel (80, P), or None
        with ``prompt_steps_per_tick`` (the prompt is solved over the next ticks)."""
        prompt = StreamPrompt(prompt_tokens, prompt_mel, spk, seed, waveform, voice)
        return self.open_many({stream_id: prompt}).get(stream_id)

    def ready(self, stream_id: Hashable) -> bool:
        """Whether an open stream takes chunks: False while its prompt solve is spread over ticks."""
        if stream_id not in self._streams:
            fail("Token2wavServer.ready", "stream_id", "name an open stream", repr(stream_id))
        return self.cfm_server.ready(stream_id)

    def open_many(self, prompts: Mapping[Hashable, Any]) -> dict[Hashable, torch.Tensor]:
        """Open streams together: their encoders and prompt solves run batched (voices already in
        the voice cache, and streams sharing a voice with an earlier one of the call, are copied
        instead: :class:`StreamPrompt`).

        Args:
            prompts: ``{stream_id: StreamPrompt}`` or ``{stream_id: (prompt_tokens, prompt_mel,
                spk[, seed[, waveform[, voice]]])}`` (see :class:`StreamPrompt`).
        Returns:
            ``{stream_id: prompt mel (80, P)}`` (the upstream ``setup_cache`` solve); with
            ``prompt_steps_per_tick`` only the streams served from the voice cache (the others'
            prompts are solved over the next ticks: :meth:`ready`).
        Raises:
            ValueError: a duplicate id, bad shapes (the message names the stream and argument).
            AdmissionError: too many streams or bytes (the message names the limit).
        """
        staged = _streams.check_prompts(self, "Token2wavServer.open_many", prompts)
        self._admit(len(staged))
        with self._context():
            return _streams.open_staged(self, staged)

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

    def close_stream(self, stream_id: Hashable) -> None:
        """Drop the stream: its CFM and conformer slots are freed, its vocoder tensors released."""
        if stream_id not in self._streams:
            fail("Token2wavServer.close_stream", "stream_id", "name an open stream", repr(stream_id),
                 f"open streams: {list(self._streams)[:8]}")
        self.cfm_server.close_request(stream_id)
        del self._streams[stream_id]
        self.encoder.close(stream_id)
        if self.vocoder is not None:
            self.vocoder.close(stream_id)

    def stream_caches(self, stream_id: Hashable) -> dict[str, torch.Tensor]:
        """Copies of a stream's flow caches in the upstream ``inference_chunk`` layout (after the
        trims): ``conformer_cnn_cache``, ``conformer_att_cache``, ``estimator_cnn_cache`` (n, depth,
        2, 2C, 2) and ``estimator_att_cache`` (n, depth, 2, H, L, 2D)."""
        if stream_id not in self._streams:
            fail("Token2wavServer.stream_caches", "stream_id", "name an open stream", repr(stream_id))
        cnn, att = self.cfm_server.request_caches(stream_id)
        conf_cnn, conf_att = self.encoder.caches(stream_id)
        return {"conformer_cnn_cache": conf_cnn.clone(), "conformer_att_cache": conf_att.clone(),
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
        staged = _streams.check_chunks(self, "Token2wavServer.step", chunks)
        if self.prompt_steps_per_tick is not None:
            with self._context():
                t0 = self._clock()
                self.cfm_server.advance_prompts()  # the prompt mels are not used (Token2wav.stream drops them)
                self._account(0.0, self._clock() - t0, 0.0)
        if not staged:
            return {}
        with self._context():
            out = self._tick(staged)
        return {sid: out[sid] for sid in chunks}

    def _tick(self, staged) -> dict[Hashable, ChunkOutput]:
        t0 = self._clock()
        run = [s for s in staged if s[1] is not None]  # tokens None: an empty last chunk, a vocoder flush
        mus = self.encoder(run) if run else {}  # the conformer caches updated (trimmed) in their slots
        for sid, tokens, last in staged:
            st = self._streams[sid]
            st.done = last
            st.chunks += tokens is not None
        t1 = self._clock()
        mels = self.cfm_server.solve_chunk({sid: mus[sid] for sid, *_ in run}) if run else {}
        for sid, tokens, _ in staged:
            if tokens is None:
                mels[sid] = torch.zeros(self.flow.output_size, 0, dtype=self.dtype, device=self.device)
        t2 = self._clock()
        out = {sid: ChunkOutput(mels[sid], None, last) for sid, _, last in staged}
        voc = [(sid, mels[sid], last) for sid, _, last in staged if self._streams[sid].waveform]
        if voc:
            for sid, wav in self.vocoder(voc).items():
                out[sid].wav = wav
        t3 = self._clock()
        self._account(t1 - t0, t2 - t1, t3 - t2, ticks=1, chunks=len(run))
        return out

    # ------------------------------------------------------------------ start-up
    def warmup(self, prompt_frames: Sequence[int] = (300,), chunk_tokens: Sequence[int] = (28,),
               last_chunk_tokens: Sequence[int] = (), stream_counts: Optional[Sequence[int]] = None,
               ticks: int = 4, rounds: int = 2, cfm_warmup: Optional[Mapping[str, Any]] = None,
               voices: Optional[Mapping[Hashable, Any]] = None) -> dict:
        """Run every stage at the shapes a workload meets, now (kernels compiled, graphs captured),
        and solve the given voices into the voice cache
        (:func:`torch_cfm.serving.token2wav_streams.warmup`). Returns {"streams", "ticks", "graphs",
        "voices"}."""
        return _streams.warmup(self, prompt_frames, chunk_tokens, last_chunk_tokens, stream_counts, ticks, rounds,
                               cfm_warmup, voices)

    @staticmethod
    def solve_pairs(prompt_frames: Sequence[int], chunk_frames: Sequence[int],
                    last_chunk_frames: Sequence[int]) -> list[tuple[int, int]]:
        """(T, L) of every CFM solve streams of these lengths can produce in one server
        (:func:`torch_cfm.buckets.shared_solve_shapes`)."""
        return shared_solve_shapes(prompt_frames, chunk_frames, last_chunk_frames, TRIM_KEEP_OLDEST)

    def graph_counts(self) -> dict[str, int]:
        """CUDA graphs captured so far per stage (``cfm``: the CFM server's graph cache)."""
        cache = self.cfm_server.graph_cache
        out = {"cfm": 0 if cache is None else cache.graph_count, **self.encoder.graph_counts()}
        out.update(self.vocoder.graph_counts() if self.vocoder is not None else {"vocoder": 0})
        return out

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _context():
        stack = contextlib.ExitStack()
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.no_grad())
        return stack

    def _clock(self) -> float:
        if not self.timing:
            return 0.0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _account(self, enc: float, cfm: float, voc: float, ticks: int = 0, chunks: int = 0) -> None:
        for name, value in (("encoder", enc), ("cfm", cfm), ("vocoder", voc), ("ticks", ticks), ("chunks", chunks)):
            self.stats[name] += value

    def describe(self) -> str:
        plan = self.memory_plan()
        return (f"Token2wavServer({len(self._streams)}/{self.max_streams} streams; bytes/stream cfm={plan.cfm} "
                f"encoder={plan.encoder} vocoder={plan.vocoder}; {self.cfm_server.describe()})")


__all__ = ["Token2wavServer", "StreamPrompt", "ChunkOutput", "StreamMemory", "MEL_CACHE_FRAMES"]
