"""The causal CosyVoice3 HiFT vocoder's bounded streaming step, capturable and batched over streams.

minicpmo-utils' ``Token2wav.stream`` vocodes through a ``BoundedVocoder`` around a
``CausalHiFTGenerator`` (``stepaudio2.causal_vocoder``). A stream's state is one dict of tensors
(``BoundedVocoder.cache``), kept here in that layout:

* ``mel`` (1, 80, M) float32: the mel frames still needed, from absolute frame ``mel_offset``;
* ``source`` (1, 1, S·hop) float32: the harmonic source, from absolute frame ``source_offset``;
* ``phase`` (1, 1, H) float64: each harmonic's phase (in cycles, in [0, 1)) at ``source_end``;
* CPU int64 (1,) counters ``mel_offset``, ``source_offset``, ``source_end`` (frames with a
  source), ``speech_offset`` (samples emitted) and ``finalized``.

A chunk is taken in blocks of ``block_frames`` (16) frames. After each block the f0 predictor
(float64) runs over the new frames with ``f0_left`` frames of left context, holding back its
``f0_right``-frame lookahead; the source of the new frames is made block by block from the f0
(float32 increments, float64 phase accumulation); then ``decode`` runs over the frames whose
source and ``decoder_right``-frame lookahead are known, with ``history`` frames of left context,
and the samples not yet emitted are returned. A final call flushes the held-back frames. So the
output lags the input by ``f0_right + decoder_right`` = 8 frames, and the state stays bounded.

Random numbers: none are drawn per call. The source's noise is a fixed table drawn when the
model was built (``l_sin_gen.sine_waves``, (1, 300·24000, H) float32), read at the stream's
absolute sample positions modulo its length; the phase starts at zero. So a stream's noise is
a function of its ``source_end`` alone, which its state already holds: streams batched together
need no per-stream generator state.

What this module changes, none of it the math (the state after a chunk is bitwise the
upstream's on the same device; the samples equal its within the convolutions' rounding):

* the per-chunk bookkeeping is done on host integers first (:func:`plan_chunk`), so the tensor
  work of a chunk (:meth:`CausalVocoderCore.run`) has no host reads and no CPU tensors: it can
  be replayed from one CUDA graph per :class:`ChunkPlan` (the plan is a function of the state's
  relative offsets, so a steady stream meets the same plan every chunk);
* the noise table is read from a device copy made once, at positions computed on the device;
* parts of the model are replaced while it runs (:func:`capturable_causal`): the causal
  convolutions pad on the device (the upstream copies a CPU zero tensor) and run on weights
  whose weight norm is folded once (:class:`CausalModelParts`: the same values), each Snake is one
  kernel on CUDA, the STFT window is a device copy, and the inverse STFT is :func:`istft`
  (``torch.istft``'s own ops without its host-side envelope check; bitwise equal to it on CPU);
* a chunk's decoder runs once over its non-final blocks' union, not once per 16-frame block
  with ``history`` frames of context each (:meth:`CausalVocoderCore.run`);
* B streams at the same plan run as one batch (:func:`stream_batch`), equal per stream to
  ``BoundedVocoder.stream`` within the convolutions' rounding.

    >>> core = CausalVocoderCore(token2wav.bounded_vocoder)
    >>> state = core.new_state()                          # the layout of BoundedVocoder.reset()
    >>> wavs = stream_batch(core, [state], [mel], [False])   # mel (1, 80, T); wavs[0] (1, samples)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from ...errors import fail, shape_str
from ..hift_capturable import istft
from ..upstream import type_name
from .causal_decode import FusedCausalDecode, fused_decode_reasons
from .causal_parts import CausalModelParts, capturable_causal

__all__ = ["CausalVocoderSizes", "ChunkPlan", "PlanStep", "CausalVocoderCore", "CausalModelParts",
           "bounded_vocoder_gaps", "causal_hift_gaps", "capturable_causal", "istft", "plan_chunk", "stream_batch",
           "COUNTERS"]

COUNTERS = ("mel_offset", "source_offset", "source_end", "speech_offset", "finalized")


def causal_hift_gaps(model: Any) -> list[str]:
    """What ``model`` lacks to be a ``CausalHiFTGenerator`` (empty: it is one). The causal
    HiFT is recognised by its right-looking ``conv_pre`` (``conv_pre_look_right``) and its
    causal sine generator with a fixed noise table."""
    if not isinstance(model, nn.Module):
        return [f"not an nn.Module ({type_name(model)})"]
    gaps = [f"no '{name}' module" for name in ("f0_predictor", "m_source", "conv_pre")
            if not isinstance(getattr(model, name, None), nn.Module)]
    if not isinstance(getattr(model, "conv_pre_look_right", None), int):
        gaps.append("no int 'conv_pre_look_right' (not a causal HiFT)")
    if not callable(getattr(model, "decode", None)):
        gaps.append("no 'decode' method")
    sine = getattr(getattr(model, "m_source", None), "l_sin_gen", None)
    table = getattr(sine, "sine_waves", None)
    if not (getattr(sine, "causal", False) and isinstance(table, torch.Tensor) and table.dim() == 3):
        gaps.append("no causal m_source.l_sin_gen with a sine_waves noise table")
    params = getattr(model, "istft_params", None)
    if not (isinstance(params, dict) and {"n_fft", "hop_len"} <= set(params)):
        gaps.append("no istft_params {'n_fft', 'hop_len'}")
    return gaps


def bounded_vocoder_gaps(obj: Any) -> list[str]:
    """What ``obj`` lacks to be a ``BoundedVocoder`` (empty: it is one)."""
    gaps = [f"no int '{name}'" for name in ("hop", "block_frames", "f0_left", "f0_right", "history",
                                           "decoder_right") if not isinstance(getattr(obj, name, None), int)]
    if not isinstance(getattr(obj, "cache", None), dict):
        gaps.append("no 'cache' dict")
    model = getattr(obj, "model", None)
    if model is None:
        gaps.append("no 'model'")
    else:
        gaps += [f"model: {g}" for g in causal_hift_gaps(model)]
    return gaps


@dataclass(frozen=True)
class CausalVocoderSizes:
    """The frame counts of a ``BoundedVocoder`` (shipped: hop 480, f0 context 8 left / 3 right,
    decoder history 31 / lookahead 5, blocks of 16 frames, 9 harmonics)."""

    hop: int
    f0_left: int
    f0_right: int
    history: int
    decoder_right: int
    block_frames: int
    harmonics: int

    @classmethod
    def of(cls, bounded: Any) -> "CausalVocoderSizes":
        return cls(hop=bounded.hop, f0_left=bounded.f0_left, f0_right=bounded.f0_right, history=bounded.history,
                   decoder_right=bounded.decoder_right, block_frames=bounded.block_frames,
                   harmonics=int(bounded.model.nb_harmonics) + 1)


# ---------------------------------------------------------------------------- host-side plan
@dataclass(frozen=True)
class PlanStep:
    """One block of a chunk (the upstream ``_process``), as offsets into the state's tensors.

    ``take``: the chunk frames [a, b) appended to the mel cache; ``f0``: None, or (window start in
    the mel cache, first new f0 frame in the predictor's output, ((frames, source frame offset
    from the chunk's start), ...) per source block); ``decode``: None, or (first and end mel
    frame, first source sample, first output sample); ``keep``: (first mel frame, first source
    sample) kept after the step. Indices refer to the tensors as they are at that point.
    """

    take: tuple[int, int]
    finalize: bool
    f0: Optional[tuple[int, int, tuple[tuple[int, int], ...]]]
    decode: Optional[tuple[int, int, int, int]]
    keep: tuple[int, int]


@dataclass(frozen=True)
class ChunkPlan:
    """The tensor work of one chunk: its steps, input frames and the samples it emits. Equal
    plans run the same kernels on the same shapes (the CUDA-graph key)."""

    steps: tuple[PlanStep, ...]
    frames: int
    mel_frames: int      # mel cache frames before the chunk
    source_frames: int   # source cache frames before the chunk
    samples: int         # samples returned


def plan_chunk(sizes: CausalVocoderSizes, counters: dict[str, int], mel_frames: int, source_frames: int,
               frames: int, finalize: bool) -> tuple[ChunkPlan, dict[str, int], dict[str, int]]:
    """Plan one ``BoundedVocoder.stream(mel, finalize)`` call: host integers only.

    Args:
        counters: the state's ``COUNTERS`` as ints (``speech_offset`` in samples).
        mel_frames, source_frames: the state's cache lengths (frames).
        frames: the chunk's mel frames (0: a flush, with ``finalize``).
    Returns:
        (plan, the counters after the chunk, the largest buffer sizes met, keyed as
        ``BoundedVocoder.limits``).
    """
    hop, block = sizes.hop, sizes.block_frames
    mo, so, se = counters["mel_offset"], counters["source_offset"], counters["source_end"]
    em = counters["speech_offset"] // hop
    se0, m, s = se, mel_frames, source_frames
    seen: dict[str, int] = {}

    def observe(**values: int) -> None:
        for key, value in values.items():
            seen[key] = max(seen.get(key, 0), value)

    calls = [((a, min(a + block, frames)), False) for a in range(0, frames, block)]
    if finalize:
        calls.append(((frames, frames), True))
    steps, samples = [], 0
    for take, final in calls:
        m += take[1] - take[0]
        if not final:
            observe(mel_buffer_frames=m)
        available = max(0, mo + m - (0 if final else sizes.f0_right))
        f0 = None
        if available > se:
            start = max(0, se - sizes.f0_left)
            observe(f0_input_frames=mo + m - start)
            pieces = []
            for a in range(se, available, block):
                pieces.append((min(block, available - a), a - se0))
                observe(cumsum_frames=pieces[-1][0])
            f0 = (start - mo, se - start, tuple(pieces))
            s += available - se
            se = available
            observe(source_buffer_frames=s)
        ready = max(0, se - (0 if final else sizes.decoder_right))
        decode = None
        if ready > em:
            start = max(0, em - sizes.history)
            observe(decoder_input_frames=se - start)
            decode = (start - mo, se - mo, (start - so) * hop, (em - start) * hop)
            samples += (ready - em) * hop
            em = ready
        keep_mel = max(0, min(em - sizes.history, se - sizes.f0_left))
        keep_source = max(0, em - sizes.history)
        steps.append(PlanStep(take, final, f0, decode, (keep_mel - mo, (keep_source - so) * hop)))
        m -= keep_mel - mo
        s -= keep_source - so
        mo, so = keep_mel, keep_source
        observe(mel_cache_frames=m, source_cache_frames=s)
    after = dict(counters, mel_offset=mo, source_offset=so, source_end=se, speech_offset=em * hop,
                 finalized=int(bool(finalize) or counters["finalized"]))
    plan = ChunkPlan(tuple(steps), frames, mel_frames, source_frames, samples)
    return plan, after, seen


# ---------------------------------------------------------------------------- the tensor work
def _hold(x: torch.Tensor, hop: int) -> torch.Tensor:
    """(B, n, H) -> (B, n·hop, H), each frame repeated ``hop`` times (``repeat_interleave`` over
    dim 1, written as an expand so that no version computes the output size on the host)."""
    return x.unsqueeze(2).expand(-1, -1, hop, -1).flatten(1, 2)


class CausalVocoderCore:
    """The tensor work of a ``BoundedVocoder``'s chunks, on explicit state tensors, B streams at once.

    Args:
        bounded: the upstream ``BoundedVocoder`` (its model's f0 predictor is float64, as
            ``BoundedVocoder.__init__`` leaves it); its ``cache`` is not touched here.
        device: where the state lives (default: the model's).
        dtype: of the mel, source and decoder (float32 as upstream; float64 for a reference,
            with ``bounded.model`` in float64).
        decoder: "auto" (the default: "fused" on CUDA where :func:`fused_decode_reasons` finds no
            reason against it, i.e. float32 at TF32, PyTorch's default for cuDNN; else "upstream"),
            "upstream" (the model's ``decode``) or "fused" (:class:`FusedCausalDecode`; off CUDA its
            Triton kernels, for tests under Triton's interpreter). A steady chunk of 16-64 streams
            runs 1.6-1.7x faster on the fused decode (``docs/performance.md`` §6).
    Attributes:
        model: the ``CausalHiFTGenerator`` (run as it is, inside :func:`capturable_causal`).
        fused: the :class:`FusedCausalDecode` the decode runs on (None: the model's own).
        sizes: :class:`CausalVocoderSizes`.
        table: the noise table (L, H) float32 on ``device`` (a device copy: 259 MB at the
            shipped 300 s x 9 harmonics, once per core).
        parts: :class:`CausalModelParts` (the folded convolution weights: 83 MB at the shipped
            sizes in float32, once per core).
    Raises:
        TypeError: ``bounded`` is not a BoundedVocoder over a CausalHiFTGenerator (names what it lacks).
    """

    def __init__(self, bounded: Any, device: Optional[torch.device] = None, dtype: torch.dtype = torch.float32,
                 decoder: str = "auto") -> None:
        if decoder not in ("auto", "upstream", "fused"):
            fail("CausalVocoderCore", "decoder", 'be "auto", "upstream" or "fused"', repr(decoder))
        gaps = bounded_vocoder_gaps(bounded)
        if gaps:
            raise TypeError(f"CausalVocoderCore: bounded must be a stepaudio2 BoundedVocoder over a "
                            f"CausalHiFTGenerator, got {type_name(bounded)} ({', '.join(gaps)})")
        self.bounded = bounded
        self.model = model = bounded.model
        self.sizes = CausalVocoderSizes.of(bounded)
        self.device = torch.device(device) if device is not None else model.conv_pre.weight.device
        self.dtype = dtype
        sine = model.m_source.l_sin_gen
        self.sampling_rate = model.sampling_rate
        self.sine_amp, self.noise_std, self.voiced_threshold = sine.sine_amp, sine.noise_std, sine.voiced_threshold
        self.table = sine.sine_waves[0].to(self.device)  # (L, H)
        self.window = model.stft_window.to(self.device)
        self.mels = model.conv_pre.in_channels
        self.parts = CausalModelParts.of(model)
        self.fused = None
        on_cuda = self.device.type == "cuda"
        kernels = "auto" if on_cuda else "triton"
        reasons = [] if decoder == "upstream" else fused_decode_reasons(self.device, dtype, kernels)
        if decoder == "auto":  # off CUDA the Triton kernels run only under the interpreter: tests ask for them
            decoder = "fused" if on_cuda and not reasons else "upstream"
        if decoder == "fused":
            if reasons:
                fail("CausalVocoderCore", "decoder", "be 'fused' only where the fused decode runs", "'fused'",
                     "; ".join(reasons))
            self.fused = FusedCausalDecode(model, self.device, kernels)

    def new_state(self) -> dict[str, torch.Tensor]:
        """A fresh stream state, in the layout of ``BoundedVocoder.reset()``."""
        kw = dict(dtype=self.dtype, device=self.device)
        return {"mel": torch.zeros(1, self.mels, 0, **kw), "source": torch.zeros(1, 1, 0, **kw),
                "phase": torch.zeros(1, 1, self.sizes.harmonics, dtype=torch.float64, device=self.device),
                **{name: torch.zeros(1, dtype=torch.long) for name in COUNTERS}}

    def state_bytes(self) -> int:
        """Device bytes of one stream's state between chunks, at most (the upstream's
        ``limits``: 39 mel frames, 36 source frames and H phases at the shipped sizes, 82 KB)."""
        sz = self.sizes
        mel = max(sz.history, sz.f0_left - sz.decoder_right) + sz.f0_right + sz.decoder_right
        source = sz.history + sz.decoder_right
        item = torch.empty((), dtype=self.dtype).element_size()
        return item * (self.mels * mel + sz.hop * source) + 8 * sz.harmonics

    def _source(self, f0: torch.Tensor, phase: torch.Tensor, positions: torch.Tensor):
        """The merged source of ``f0`` (B, n) float32 from ``phase`` (B, 1, H) float64, with the
        noise at table ``positions`` (B, n·hop): ((B, 1, n·hop) float32, new phase)."""
        hop = self.sizes.hop
        harmonics = torch.arange(1, self.sizes.harmonics + 1, device=f0.device, dtype=f0.dtype)
        steps = (f0[:, :, None] * harmonics / self.sampling_rate).remainder(1)
        cycles = steps.double().cumsum(dim=1) * hop + phase
        phase = cycles[:, -1:].remainder(1)
        sine = _hold((cycles.remainder(1) * (2 * math.pi)).sin().to(f0), hop)
        voiced = _hold((f0[:, :, None] > self.voiced_threshold).to(f0), hop)
        amplitude = voiced * self.noise_std + (1 - voiced) * self.sine_amp / 3
        noise = self.table[positions].to(f0)
        excitation = sine * self.sine_amp * voiced + amplitude * noise
        merge = self.model.m_source
        return merge.l_tanh(merge.l_linear(excitation)).transpose(1, 2), phase

    def _grow(self, step: PlanStep, mel, source, phase, chunk, noise_base, mel_shift: int):
        """A step's new mel frames, f0 and source (``mel_shift``: frames held before the step's
        logical start, see :meth:`run`)."""
        hop = self.sizes.hop
        a, b = step.take
        if b > a:
            mel = torch.cat([mel, chunk[:, :, a:b].to(self.dtype)], dim=2)
        if step.f0 is not None:
            window, first, pieces = step.f0
            features = mel[:, :, mel_shift + window:]
            f0 = self.model.f0_predictor(features.double(), finalize=step.finalize).to(features)[:, first:]
            parts, done = [source], 0
            for frames, offset in pieces:
                ramp = torch.arange(frames * hop, device=mel.device) + offset * hop
                positions = (noise_base[:, None] + ramp).remainder(self.table.shape[0])
                part, phase = self._source(f0[:, done:done + frames], phase, positions)
                parts.append(part)
                done += frames
            source = torch.cat(parts, dim=2)
        return mel, source, phase

    def run(self, plan: ChunkPlan, mel: torch.Tensor, source: torch.Tensor, phase: torch.Tensor,
            chunk: torch.Tensor, noise_base: torch.Tensor):
        """One chunk of B streams at the same ``plan``: no host reads, no CPU tensors
        (capturable; replay it from a CUDA graph per ``plan``).

        The plan's steps run in order for the mel, f0, source and phase (so the state is the
        upstream's, bitwise), but what each step trims is only dropped at the end, and the
        decodes of its non-final steps run as one decode over their union: the decoder is causal
        and ``history`` covers its receptive field, so each sample is the per-block decode's in
        exact arithmetic, for one decoder pass (a window of history + chunk frames, not one
        per 16-frame block) instead of one per block. A final step's decode runs apart. The
        decoder's input is then history + chunk + lookahead frames (86 for a 50-frame chunk,
        where the upstream's per-block bound is 52): a transient activation size; the state and
        the maxima :func:`plan_chunk` reports stay the upstream's.

        Args:
            mel: (B, 80, plan.mel_frames) float32; source: (B, 1, plan.source_frames·hop) float32
            (the core's dtype);
            phase: (B, 1, H) float64; chunk: (B, 80, plan.frames) in the core's dtype
            (:func:`stream_batch` converts);
            noise_base: (B,) int64, each stream's ``source_end·hop`` modulo the table length.
        Returns:
            (speech (B, plan.samples) float32, mel, source, phase): the new state tensors.
        """
        decoding = [i for i, step in enumerate(plan.steps) if step.decode is not None and not step.finalize]
        speeches, pending = [], None
        mel_shift = source_shift = 0  # trimmed by the steps so far, still held
        decode = self.model.decode if self.fused is None else self.fused.decode
        with capturable_causal(self.model, self.window, self.parts), \
                torch.amp.autocast(mel.device.type, enabled=False):
            for i, step in enumerate(plan.steps):
                mel, source, phase = self._grow(step, mel, source, phase, chunk, noise_base, mel_shift)
                if step.decode is not None:
                    start, end, src, out = step.decode
                    if pending is None:
                        pending = (mel_shift + start, source_shift + src, out)
                    if step.finalize or i == decoding[-1]:
                        first, first_src, drop = pending
                        speeches.append(decode(mel[:, :, first:mel_shift + end], source[:, :, first_src:],
                                               finalize=step.finalize)[:, drop:])
                        pending = None
                keep_mel, keep_source = step.keep
                mel_shift, source_shift = mel_shift + keep_mel, source_shift + keep_source
        speech = torch.cat(speeches, dim=1) if speeches else mel.new_zeros(mel.shape[0], 0)
        return speech, mel[:, :, mel_shift:].clone(), source[:, :, source_shift:].clone(), phase


# ---------------------------------------------------------------------------- streams
def _counters(state: dict) -> dict[str, int]:
    return {name: int(state[name].item()) for name in COUNTERS}  # CPU tensors: no device sync


def _noise_bases(core: CausalVocoderCore, counters: Sequence[dict[str, int]]) -> torch.Tensor:
    """(B,) int64 on the core's device without a host sync (a pinned staging copy on CUDA)."""
    values = [(c["source_end"] * core.sizes.hop) % core.table.shape[0] for c in counters]
    staged = torch.tensor(values, dtype=torch.int64, pin_memory=core.device.type == "cuda")
    return staged.to(core.device, non_blocking=True)


def stream_batch(core: CausalVocoderCore, states: Sequence[dict], mels: Sequence[torch.Tensor],
                 finalize: Sequence[bool], *, call: Optional[Callable] = None,
                 batch_buckets: Optional[Sequence[int]] = None, maxima: Optional[list] = None) -> list[torch.Tensor]:
    """``BoundedVocoder.stream(mel, finalize)`` for several streams at once, each on its own state.

    Streams whose chunk has the same :class:`ChunkPlan` run as one batch (padded with copies of
    a row up to the next of ``batch_buckets``), without autograd. Each state dict is updated as
    the upstream updates its ``cache``: new ``mel``/``source``/``phase`` tensors, the CPU
    counters filled in place, other keys left alone.

    Args:
        states: one state per stream (``BoundedVocoder.cache`` layout; :meth:`CausalVocoderCore.new_state`).
        mels: one (1, 80, T) chunk per stream (T may be 0 with ``finalize``).
        finalize: per stream, flush the held-back frames (its last call).
        call: runs :meth:`CausalVocoderCore.run` (e.g. a CUDA-graph wrapper of it; default: it).
        maxima: optional per-stream dicts updated with the largest buffer sizes met.
    Returns:
        per stream, (1, samples) float32 (``mel.new_zeros(1, 0)`` when nothing is emitted).
    Raises:
        ValueError: a chunk that is not (1, 80, T), or a finalized stream given frames or not
            finalizing (``BoundedVocoder.stream``'s rules).
    """
    op = "stream_batch"
    if not len(states) == len(mels) == len(finalize):
        fail(op, "states, mels and finalize", "have one entry per stream",
             f"{len(states)}, {len(mels)} and {len(finalize)}")
    call = core.run if call is None else call
    groups: dict[ChunkPlan, list] = {}
    out: list[Optional[torch.Tensor]] = [None] * len(states)
    for i, (state, mel, last) in enumerate(zip(states, mels, finalize)):
        if mel.dim() != 3 or tuple(mel.shape[:2]) != tuple(state["mel"].shape[:2]):
            fail(op, f"mels[{i}]", f"have shape (1, {core.mels}, T)", shape_str(mel))
        counters = _counters(state)
        if counters["finalized"]:
            if mel.shape[2] or not last:
                fail(op, f"states[{i}]", "not be finalized, or get only an empty final call",
                     "a finalized stream", "start a new state for a new utterance (BoundedVocoder.reset())")
            out[i] = mel.new_zeros(1, 0)
            continue
        hop = core.sizes.hop
        plan, after, seen = plan_chunk(core.sizes, counters, state["mel"].shape[2], state["source"].shape[2] // hop,
                                       mel.shape[2], bool(last))
        if maxima is not None and maxima[i] is not None:
            for key, value in seen.items():
                maxima[i][key] = max(maxima[i].get(key, 0), value)
        if not plan.steps:
            out[i] = mel.new_zeros(1, 0)
            continue
        groups.setdefault(plan, []).append((i, state, mel, counters, after))
    with torch.no_grad():  # streaming inference: a graphed ``call`` replays only without autograd
        for plan, members in groups.items():
            _run_group(core, plan, members, call, batch_buckets, out)
    return out  # type: ignore[return-value]


def _run_group(core, plan: ChunkPlan, members: list, call, batch_buckets, out: list) -> None:
    count = len(members)
    size = next((b for b in (batch_buckets or ()) if b >= count), count)
    rows = members + [members[0]] * (size - count)
    mel = torch.cat([m[1]["mel"] for m in rows], dim=0)
    source = torch.cat([m[1]["source"] for m in rows], dim=0)
    phase = torch.cat([m[1]["phase"] for m in rows], dim=0)
    # in the core's dtype (as _grow appends it), so fp16 and fp32 chunks meet one graph per plan
    chunk = torch.cat([m[2].to(core.device, core.dtype) for m in rows], dim=0)
    speech, mel, source, phase = call(plan, mel, source, phase, chunk, _noise_bases(core, [m[3] for m in rows]))
    for b, (i, state, _, _, after) in enumerate(members):
        state["mel"], state["source"], state["phase"] = mel[b:b + 1], source[b:b + 1], phase[b:b + 1]
        for name in COUNTERS:
            state[name].fill_(after[name])
        out[i] = speech[b:b + 1]
