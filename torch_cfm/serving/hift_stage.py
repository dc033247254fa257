"""The vocoder stage of :class:`~torch_cfm.serving.Token2wavServer` over a ``stepaudio2`` HiFT.

The upstream streaming scheme of ``Token2wav.stream``, per stream: 8 cached mel frames, the last
``8 * 480`` source and speech samples, a Hamming cross-fade over the overlap and the tail held
back until the last chunk. Streams whose vocoder input has the same length run as one batch
through the HiFT's f0 predictor and ``decode`` (its convolutions and inverse STFT; CUDA graphs per
shape, made capturable by :func:`~torch_cfm.models.hift_capturable.capturable`). The source module
draws random numbers, so it runs per stream (batch 1, a CUDA graph per length) on the stream's own
random state (seeded at open): a stream's waveform is that of the upstream per-stream call run
after ``torch.manual_seed(seed)``, whatever the other streams do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Optional

import torch
from torch import nn

from ..graphs import GraphedCall
from ..models.hift_capturable import MEL_CACHE_FRAMES, capturable, hift_stream_constants


class RngSlot:
    """Runs a callable on a stream's own random state of ``device``'s default generator."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def initial(self, seed: int) -> torch.Tensor:
        gen = torch.Generator(device=self.device)
        gen.manual_seed(int(seed))
        return gen.get_state()

    def run(self, state: torch.Tensor, fn, *args):
        """``fn(*args)`` drawing from ``state``; returns (its result, the advanced state)."""
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


@dataclass
class VocoderStreamState:
    """One stream's vocoder state between chunks (:class:`HiFTStage`): its generator state, the last
    mel frames, the source and speech overlap tails."""

    rng: torch.Tensor
    mel: Optional[torch.Tensor] = None
    source: Optional[torch.Tensor] = None
    speech: Optional[torch.Tensor] = None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.rng, self.mel, self.source, self.speech) if t is not None]


class PerStreamVocoder:
    """A stage holding ``self._streams`` ({stream: VocoderStreamState}): its tick (each stream's
    cached mel frames, then this chunk's; streams grouped by that length and by whether they have
    a previous chunk; one ``_group(members, cached)`` call per group), ``close`` and ``state_bytes``."""

    _streams: dict
    device: torch.device
    dtype: torch.dtype  # of the vocoder's mel input
    stats: dict

    def __call__(self, items) -> dict[Hashable, torch.Tensor]:
        """``items``: (stream id, mel (80, T), last chunk). Returns {stream id: waveform (samples,)}
        as ``Token2wav.stream`` yields it (the overlap tail held back unless last)."""
        groups: dict[tuple, list] = {}
        for sid, mel, last in items:
            st = self._streams[sid]
            mel = mel.to(device=self.device, dtype=self.dtype)[None]
            if st.mel is not None:
                mel = torch.cat([st.mel, mel], dim=2)
            groups.setdefault((mel.shape[2], st.source is not None), []).append((sid, mel, last))
        out = {}
        for (_, cached), members in groups.items():
            self.stats["vocoder_batches"] += 1
            out.update(self._group(members, cached))
        return out

    def _group(self, members: list, cached: bool) -> dict[Hashable, torch.Tensor]:
        raise NotImplementedError

    def close(self, stream_id: Hashable) -> None:
        self._streams.pop(stream_id, None)

    def state_bytes(self) -> int:
        """Bytes held now by every open stream."""
        return sum(t.numel() * t.element_size() for st in self._streams.values() for t in st.tensors())


class HiFTStage(PerStreamVocoder):
    """Per-stream HiFT vocoding, batched over equal input lengths (module docstring).

    Args:
        hift: the upstream ``HiFTGenerator`` (not modified: its ``stft_window`` is swapped for
            :attr:`window` only inside each call, by :func:`capturable`).
        mel_channels: the flow's mel width (80).
        padded: a callable giving the batch size ``count`` rows are padded to.
        graphs: replay each shape from a CUDA graph.
        stats: the server's counters (``vocoder_batches`` is incremented).
    Attributes:
        window: the HiFT's ``stft_window`` on its device (a plain attribute, not a buffer: the
            upstream copies it to the device in every stft/istft call, a host copy a CUDA graph
            cannot hold).
    """

    def __init__(self, hift: nn.Module, *, mel_channels: int, padded, graphs: bool, stats: dict,
                 budget: int = 8) -> None:
        self.hift, self.mel_channels, self._padded, self.stats = hift, mel_channels, padded, stats
        self.samples_per_frame, self.source_cache = hift_stream_constants(hift)
        param = next(hift.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.window = hift.stft_window.to(self.device)
        self._fade = torch.hamming_window(2 * self.source_cache, periodic=False, dtype=torch.float64,
                                          device=self.device)
        self._rng = RngSlot(self.device)
        self._streams: dict[Hashable, VocoderStreamState] = {}
        self.f0_call, self.source_call, self.decode_call = self._f0, self._source, self._decode
        if graphs:
            self.f0_call = GraphedCall(self._f0, name="Token2wavServer.hift_f0", max_graphs=budget)
            self.decode_call = GraphedCall(self._decode, name="Token2wavServer.hift_decode", max_graphs=budget)
            self.source_call = GraphedCall(self._source, name="Token2wavServer.hift_source", max_graphs=budget,
                                           random=True)

    # ------------------------------------------------------------------ streams
    def open(self, stream_id: Hashable, seed: int) -> None:
        self._streams[stream_id] = VocoderStreamState(rng=self._rng.initial(seed))

    def stream_bytes(self) -> int:
        """Bytes of one stream's state at most: 8 mel frames, source and speech caches, its random state."""
        item = torch.empty((), dtype=self.dtype).element_size()
        return item * (self.mel_channels * MEL_CACHE_FRAMES + 2 * self.source_cache) + self._rng.initial(0).numel()

    def graph_counts(self) -> dict[str, int]:
        return {name: getattr(call, "graph_count", 0) for name, call in
                (("hift_f0", self.f0_call), ("hift_source", self.source_call), ("hift_decode", self.decode_call))}

    # ------------------------------------------------------------------ a tick
    def _group(self, members, cached: bool) -> dict[Hashable, torch.Tensor]:
        pad = self._padded(len(members)) - len(members)
        mel = torch.cat([m[1] for m in members] + [members[0][1]] * pad, dim=0)
        up = self.f0_call(mel)
        sources = []
        for b, (sid, _, _) in enumerate(members):
            st = self._streams[sid]
            s, st.rng = self._rng.run(st.rng, self.source_call, up[b:b + 1])
            s = s.transpose(1, 2)
            if cached:
                s[:, :, :st.source.shape[2]] = st.source
            sources.append(s)
        source = torch.cat(sources + sources[:1] * pad, dim=0)
        speech = self.decode_call(mel, source)
        n, out = self.source_cache, {}
        for b, (sid, m, last) in enumerate(members):
            st = self._streams[sid]
            wav = speech[b:b + 1]
            if st.speech is not None:
                wav = wav.clone()
                wav[:, :n] = wav[:, :n] * self._fade[:n] + st.speech[:, -n:] * self._fade[n:]
            st.mel = m[:, :, -MEL_CACHE_FRAMES:].clone()
            st.source = source[b:b + 1, :, -n:].clone()
            st.speech = wav[:, -n:].clone()
            out[sid] = (wav if last else wav[:, :-n])[0]
        return out

    # ------------------------------------------------------------------ the upstream modules
    def _f0(self, mel):
        """The HiFT's f0 predictor and upsampling (the deterministic half of its source)."""
        return self.hift.f0_upsamp(self.hift.f0_predictor(mel)[:, None]).transpose(1, 2)

    def _source(self, up):
        """The HiFT's source module on one stream's upsampled f0 (B = 1): its merged source."""
        with capturable(self.hift, self.window):
            return self.hift.m_source(up)[0]

    def _decode(self, mel, source):
        with capturable(self.hift, self.window):
            return self.hift.decode(x=mel, s=source)


__all__ = ["HiFTStage", "RngSlot"]
