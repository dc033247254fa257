"""The many-stream vocoder stages of :class:`~torch_cfm.serving.Token2wavServer` on torch_cfm's vocoders.

Every stage has one interface: ``open(stream, seed)``, ``close(stream)``, ``__call__([(stream, mel
(80, T), last), ...]) -> {stream: waveform (samples,)}``, ``stream_bytes()``, ``state_bytes()`` and
``graph_counts()``. Three stages exist:

* :class:`HiFTVocoderStage`: a ``HiFTGenerator`` (stepaudio2-minicpmo, vLLM-Omni) as
  :class:`~torch_cfm.models.vocoder.HiFTVocoder`: the source of every stream of a tick, the decode,
  the inverse STFT and ``Token2wav.stream``'s cross-fade in one captured call per shape; each
  stream draws from its own counter-based random stream (seeded at open), so its waveform is
  bitwise independent of which streams share its tick.
* :class:`CausalVocoderStage`: minicpmo-utils' causal vocoder (``BoundedVocoder`` over a
  ``CausalHiFTGenerator``), the streams of a tick batched by chunk plan
  (:func:`~torch_cfm.models.vocoder.causal.stream_batch`), each equal to ``BoundedVocoder.stream``
  on its own state within the vocoder's rounding; its noise is a fixed table, so streams need no
  random state.
* :class:`~torch_cfm.serving.hift_stage.HiFTStage`: the upstream HiFT modules themselves, the
  source per stream on the global generator (``Token2wavServer(vocoder="upstream")``: the
  upstream per-stream random stream, bitwise).
"""

from __future__ import annotations

from typing import Hashable

import torch
from torch import nn

from ..graphs import GraphedCall
from ..models.hift_capturable import MEL_CACHE_FRAMES, hift_stream_constants
from ..models.vocoder import HiFTVocoder, stream_rng
from ..models.vocoder.causal import CausalVocoderCore, stream_batch
from .hift_stage import PerStreamVocoder, VocoderStreamState


class HiFTVocoderStage(PerStreamVocoder):
    """``Token2wav.stream``'s vocoder per stream, on :class:`~torch_cfm.models.vocoder.HiFTVocoder`.

    Streams whose vocoder input has the same length (and all with, or all without, a previous
    chunk) run as one batch, padded to the bucket sizes with copies of a row (rows never mix).

    Args:
        hift: the upstream ``HiFTGenerator`` (read once).
        mel_channels: the flow's mel width (80).
        padded: a callable giving the batch size ``count`` rows are padded to.
        graphs: replay each shape from a CUDA graph.
        stats: the server's counters (``vocoder_batches`` is incremented).
        precision: the vocoder's precision (:func:`torch_cfm.policy.vocoder_precision`).
    """

    def __init__(self, hift: nn.Module, *, mel_channels: int, padded, graphs: bool, stats: dict, budget: int = 8,
                 precision: str = "auto") -> None:
        self.mel_channels, self._padded, self.stats = mel_channels, padded, stats
        self.samples_per_frame, self.source_cache = hift_stream_constants(hift)
        self.device, self.dtype = next(hift.parameters()).device, torch.float32
        self.vocoder = HiFTVocoder(hift, precision=precision)
        if not self.vocoder.fused_convs:
            # library convolutions may round a row differently with the batch around it: fixed slabs
            self.vocoder.slab_rows = 4 if self.device.type == "cuda" else 1
        self._fade = torch.hamming_window(2 * self.source_cache, periodic=False, dtype=torch.float64,
                                          device=self.device).float()
        self._streams: dict[Hashable, VocoderStreamState] = {}
        self.call = self.vocoder.stream_chunk
        if graphs:
            self.call = GraphedCall(self.vocoder.stream_chunk, name="Token2wavServer.vocoder", max_graphs=budget)

    def open(self, stream_id: Hashable, seed: int) -> None:
        self._streams[stream_id] = VocoderStreamState(rng=stream_rng([seed], self.device))

    def stream_bytes(self) -> int:
        """Bytes of one stream's state at most: 8 mel frames, source and speech caches, its random state."""
        return 4 * (self.mel_channels * MEL_CACHE_FRAMES + 2 * self.source_cache) + 16

    def graph_counts(self) -> dict[str, int]:
        return {"vocoder": getattr(self.call, "graph_count", 0)}

    def _group(self, members, cached: bool) -> dict[Hashable, torch.Tensor]:
        pad = self._padded(len(members)) - len(members)
        rows = members + [members[0]] * pad
        states = [self._streams[sid] for sid, _, _ in rows]
        mel = torch.cat([m for _, m, _ in rows], dim=0)
        rng = torch.cat([st.rng for st in states], dim=0)
        cache = prev = window = None
        if cached:
            cache = torch.cat([st.source for st in states], dim=0)
            prev = torch.cat([st.speech for st in states], dim=0)
            window = self._fade
        speech, source, next_rng = self.call(mel, rng, cache, prev, window)
        n, out = self.source_cache, {}
        # a copy per stream, not row views of one copy: a view would keep its whole (padded)
        # batch alive after the batch's other streams close, past memory_plan()'s per-stream bound
        for b, (sid, m, last) in enumerate(members):
            st = self._streams[sid]
            st.rng = next_rng[b:b + 1].clone()
            st.mel = m[:, :, -MEL_CACHE_FRAMES:].clone()
            st.source = source[b:b + 1, :, -n:].clone()
            st.speech = speech[b:b + 1, -n:].clone()
            out[sid] = speech[b] if last else speech[b, :-n]
        return out


class CausalVocoderStage:
    """minicpmo-utils' ``Token2wav.stream`` vocoder per stream: ``BoundedVocoder.stream`` on each
    stream's own state, the streams of a tick batched by chunk plan (module docstring); a stream's
    first non-empty output not flagged last starts with 8 frames of silence, as upstream.

    Args:
        bounded: the upstream ``BoundedVocoder`` (its model and noise table are read, its own
            ``cache`` is never touched).
        batch_buckets: batch sizes a plan's group is padded to (None: none).
        graphs: replay each plan from a CUDA graph.
        stats: the server's counters.
    """

    def __init__(self, bounded, *, batch_buckets, graphs: bool, stats: dict, budget: int = 8) -> None:
        self.core = CausalVocoderCore(bounded)
        self.device = self.core.device
        self.batch_buckets, self.stats = batch_buckets, stats
        self.silence = MEL_CACHE_FRAMES * self.core.sizes.hop
        self.call = GraphedCall(self.core.run, name="Token2wavServer.causal_vocoder", max_graphs=budget) \
            if graphs else None
        self._streams: dict[Hashable, dict] = {}

    def open(self, stream_id: Hashable, seed: int) -> None:
        self._streams[stream_id] = dict(self.core.new_state(), first=True)

    def close(self, stream_id: Hashable) -> None:
        self._streams.pop(stream_id, None)

    def stream_bytes(self) -> int:
        return self.core.state_bytes()

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for st in self._streams.values() for k, t in st.items()
                   if isinstance(t, torch.Tensor) and t.device.type == self.device.type)

    def graph_counts(self) -> dict[str, int]:
        return {"vocoder": 0 if self.call is None else self.call.graph_count}

    def __call__(self, items) -> dict[Hashable, torch.Tensor]:
        self.stats["vocoder_batches"] += 1
        states = [self._streams[sid] for sid, _, _ in items]
        mels = [mel.to(device=self.device, dtype=torch.float32)[None] for _, mel, _ in items]
        lasts = [bool(last) for _, _, last in items]
        wavs = stream_batch(self.core, states, mels, lasts, call=self.call, batch_buckets=self.batch_buckets)
        out = {}
        for (sid, _, last), state, wav in zip(items, states, wavs):
            if wav.shape[-1] and state["first"]:
                state["first"] = False
                if not last:
                    wav = torch.cat([wav.new_zeros(1, self.silence), wav], dim=1)
            out[sid] = wav[0]
        return out


__all__ = ["HiFTVocoderStage", "CausalVocoderStage"]
