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

from ..errors import fail, shape_str
from ..graphs import GraphedCall
from ..models.hift_capturable import MEL_CACHE_FRAMES, hift_stream_constants
from ..models.vocoder import HiFTVocoder, stream_rng
from ..models.vocoder.causal import CausalVocoderCore, stream_batch
from .slot_table import SlotTable


class HiFTVocoderStage:
    """``Token2wav.stream``'s vocoder per stream, on :class:`~torch_cfm.models.vocoder.HiFTVocoder`.

    Every open stream's state between chunks (its last 8 mel frames, source and speech overlap tails
    and counter-based random state) is a slot of preallocated tensors (:class:`SlotTable`). Streams
    whose chunk has the same length (and all with, or all without, a previous chunk) run as one
    batch, padded to the bucket sizes with copies of the first stream's row (rows never mix): one
    call gathers their state, runs the vocoder, the inverse STFT and the cross-fade, and writes the
    new state and the waveform in place (one in-place CUDA graph per shape), so a tick launches a
    few kernels around the graph whatever its stream count.

    Args:
        hift: the upstream ``HiFTGenerator`` (read once).
        mel_channels: the flow's mel width (80).
        padded: a callable giving the batch size ``count`` rows are padded to.
        graphs: replay each shape from a CUDA graph.
        stats: the server's counters (``vocoder_batches`` is incremented).
        max_streams: streams open at once (slots).
        max_chunk_frames: the most mel frames a chunk brings.
        precision: the vocoder's precision (:func:`torch_cfm.policy.vocoder_precision`).
    """

    def __init__(self, hift: nn.Module, *, mel_channels: int, padded, graphs: bool, stats: dict, max_streams: int,
                 max_chunk_frames: int, budget: int = 8, precision: str = "auto") -> None:
        self.mel_channels, self._padded, self.stats = mel_channels, padded, stats
        self.max_chunk_frames = int(max_chunk_frames)
        self.samples_per_frame, self.source_cache = hift_stream_constants(hift)
        self.device, self.dtype = next(hift.parameters()).device, torch.float32
        self.vocoder = HiFTVocoder(hift, precision=precision)
        if not self.vocoder.fused_convs:
            # library convolutions may round a row differently with the batch around it: fixed slabs
            self.vocoder.slab_rows = 4 if self.device.type == "cuda" else 1
        self._fade = torch.hamming_window(2 * self.source_cache, periodic=False, dtype=torch.float64,
                                          device=self.device).float()
        self.table = SlotTable(max_streams, "HiFTVocoderStage")
        rows, n, dev = max_streams + 1, self.source_cache, self.device
        self._mel = torch.zeros(rows, mel_channels, MEL_CACHE_FRAMES, device=dev)  # the last frames, right-aligned
        self._source = torch.zeros(rows, 1, n, device=dev)  # overlap tails, right-aligned
        self._speech = torch.zeros(rows, n, device=dev)
        self._rng = torch.zeros(rows, 2, dtype=torch.int64, device=dev)
        self._out = torch.zeros(padded(max_streams), (MEL_CACHE_FRAMES + self.max_chunk_frames) * self.samples_per_frame,
                                device=dev)  # a tick's waveforms, copied out per group
        self._history: dict[Hashable, int] = {}  # mel frames held per stream (0 before its first chunk)
        self.call = self._chunk
        if graphs:
            self.call = GraphedCall(self._chunk, name="Token2wavServer.vocoder", max_graphs=budget, in_place=True)

    def open(self, stream_id: Hashable, seed: int) -> None:
        slot = self.table.open(stream_id)
        self._rng[slot].copy_(stream_rng([seed], self.device)[0])
        self._history[stream_id] = 0

    def close(self, stream_id: Hashable) -> None:
        if stream_id in self.table:
            self.table.close(stream_id)
            del self._history[stream_id]

    def stream_bytes(self) -> int:
        """Bytes of one stream's state: 8 mel frames, source and speech caches, its random state."""
        return 4 * (self.mel_channels * MEL_CACHE_FRAMES + 2 * self.source_cache) + 16

    def state_bytes(self) -> int:
        """Bytes held: every slot (open or not) and the waveform buffer, allocated once."""
        return sum(t.numel() * t.element_size() for t in (self._mel, self._source, self._speech, self._rng, self._out))

    def graph_counts(self) -> dict[str, int]:
        return {"vocoder": getattr(self.call, "graph_count", 0)}

    def __call__(self, items) -> dict[Hashable, torch.Tensor]:
        """``items``: (stream id, mel (80, T), last chunk). Returns {stream id: waveform (samples,)}
        as ``Token2wav.stream`` yields it (the overlap tail held back unless last)."""
        op, groups = "HiFTVocoderStage", {}
        for sid, mel, last in items:
            held = self._history[sid]
            if mel.dim() != 2 or mel.shape[0] != self.mel_channels or mel.shape[1] > self.max_chunk_frames:
                fail(op, "mel", f"be ({self.mel_channels}, T <= {self.max_chunk_frames})", shape_str(mel))
            if 0 < held < MEL_CACHE_FRAMES:
                fail(op, "mel", f"follow a first chunk of at least {MEL_CACHE_FRAMES} frames (the cross-fade's "
                     "overlap)", f"a stream holding {held}")
            groups.setdefault((mel.shape[1], held), []).append((sid, mel, last))
        out = {}
        for (frames, held), members in groups.items():
            self.stats["vocoder_batches"] += 1
            out.update(self._group(members, frames, held))
        return out

    def _group(self, members, frames: int, held: int) -> dict[Hashable, torch.Tensor]:
        sids = [sid for sid, _, _ in members]
        rows = self._padded(len(sids))
        # one copy to the device: the rows' slots to read (padding: the first stream's), then to
        # write (padding: the dump slot, the table's padding past the end)
        index = self.table.index(sids + sids[:1] * (rows - len(sids)) + sids, 2 * rows, self.device).view(2, rows)
        mel = torch.stack([m for _, m, _ in members] + [members[0][1]] * (rows - len(sids))).to(self.device)
        self.call(index, mel, held)
        total = held + frames
        for sid in sids:
            self._history[sid] = min(total, MEL_CACHE_FRAMES)
        speech = self._out[:len(sids), :total * self.samples_per_frame].clone()
        n = self.source_cache
        return {sid: speech[b] if last else speech[b, :-n] for b, (sid, _, last) in enumerate(members)}

    def _chunk(self, index: torch.Tensor, mel: torch.Tensor, held: int) -> None:
        """One group's step in place: ``index`` (2, B) int64 slots read / written, ``mel`` (B, 80, T)
        this chunk's frames (any float dtype), ``held`` mel frames already in the slots (0 or 8)."""
        read, write = index[0], index[1]
        mel = mel.float()
        cache = previous = window = None
        if held:
            mel = torch.cat([self._mel.index_select(0, read), mel], dim=2)
            cache, previous, window = self._source.index_select(0, read), self._speech.index_select(0, read), self._fade
        speech, source, next_rng = self.vocoder.stream_chunk(mel, self._rng.index_select(0, read), cache, previous,
                                                             window)
        self._out[:speech.shape[0], :speech.shape[1]].copy_(speech)
        keep, tail = min(mel.shape[2], MEL_CACHE_FRAMES), min(speech.shape[1], self.source_cache)
        self._rng.index_copy_(0, write, next_rng)
        self._mel[:, :, MEL_CACHE_FRAMES - keep:].index_copy_(0, write, mel[:, :, -keep:])
        self._source[:, :, self.source_cache - tail:].index_copy_(0, write, source[:, :, -tail:])
        self._speech[:, self.source_cache - tail:].index_copy_(0, write, speech[:, -tail:])


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
