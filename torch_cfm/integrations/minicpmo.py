"""What :func:`~torch_cfm.integrations.stepaudio2.apply_torch_cfm` adds for minicpmo-utils' ``Token2wav``.

minicpmo-utils (the ``stepaudio2`` package MiniCPM-o 4.5 requires) keeps stepaudio2-minicpmo's
flow, DiT and CFM decoder, so the decoder is accelerated the same way. Its ``Token2wav`` differs
around them, and the functions here handle those differences, chosen by what the object holds
(no version checks):

* ``Token2wav.stream`` vocodes through ``token2wav.bounded_vocoder`` (a ``BoundedVocoder`` over
  the causal ``CausalHiFTGenerator`` in ``token2wav.hift``): :func:`apply_minicpmo` replaces that
  object's ``stream`` with :class:`CausalVocoderStream`, which runs the same chunk step on the same
  state dict (``token2wav.hift_cache_dict``, the ``BoundedVocoder.cache`` layout, restorable as
  before) from one CUDA graph per chunk plan (:mod:`torch_cfm.models.vocoder.causal`). Its state
  after each chunk is bitwise the upstream's on the same device; the samples differ from the
  upstream's only by rounding (its decoder runs once per chunk, not once per 16-frame block, and
  the replayed kernels).
* ``Token2wav.__call__`` vocodes whole utterances through the original ``HiFTGenerator``, loaded
  lazily by ``_get_original_vocoder``: that method is wrapped so the HiFT it returns is replayed
  from CUDA graphs by :class:`~torch_cfm.integrations.hift.GraphedHiFT` (random draws included).
  ``token2wav.hift`` itself is never called through ``forward`` (its ``forward(batch, device)`` is
  a training entry), so it must not get ``GraphedHiFT``.
* The flow encoder's ``forward_chunk`` is wrapped in ``torch.compile(backend="eager")``: a Dynamo
  trace per new shape and guard checks per call, for the same eager ops. :func:`encoder_forward_chunk`
  is the function underneath, bound to the encoder; :func:`apply_minicpmo` installs it as the
  encoder's ``forward_chunk`` (unless something else is installed there already, e.g. the
  integration's graphed encoder, which should wrap this function too).

:func:`undo_minicpmo` removes all of it (the upstream objects' own methods again).
:func:`warmup_minicpmo` captures the vocoder graphs a stream meets. Importing this module never
imports ``stepaudio2``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from ..errors import fail
from ..graphs import GraphedCall
from ..models.upstream import encoder_forward_chunk, hift_gaps, type_name
from ..models.vocoder.causal import CausalVocoderCore, bounded_vocoder_gaps, causal_hift_gaps, stream_batch
from .hift import GraphedHiFT

__all__ = ["CausalVocoderStream", "MinicpmoAcceleration", "apply_minicpmo", "undo_minicpmo", "warmup_minicpmo",
           "accelerated_minicpmo", "causal_token2wav_gaps", "is_causal_token2wav", "is_causal_hift",
           "encoder_forward_chunk"]

_ATTR = "_torch_cfm_minicpmo"  # the MinicpmoAcceleration, on the Token2wav


def is_causal_hift(hift: Any) -> bool:
    """True for a ``CausalHiFTGenerator``-shaped module (which ``GraphedHiFT`` must not wrap)."""
    return isinstance(hift, nn.Module) and not causal_hift_gaps(hift)


def causal_token2wav_gaps(target: Any) -> list[str]:
    """What ``target`` lacks to be minicpmo-utils' ``Token2wav`` (empty: it is one): a
    ``bounded_vocoder`` (BoundedVocoder over a causal HiFT) whose model is ``target.hift``."""
    bounded = getattr(target, "bounded_vocoder", None)
    if bounded is None:
        return ["no 'bounded_vocoder'"]
    gaps = [f"bounded_vocoder: {g}" for g in bounded_vocoder_gaps(bounded)]
    if not gaps and getattr(target, "hift", None) is not bounded.model:
        gaps.append("bounded_vocoder.model is not its .hift")
    return gaps


def is_causal_token2wav(target: Any) -> bool:
    return not causal_token2wav_gaps(target)


class CausalVocoderStream:
    """``BoundedVocoder.stream(mel, finalize=False)`` of one ``BoundedVocoder``, on its own
    ``cache`` dict, each chunk's tensor work replayed from a CUDA graph per chunk plan.

    Args:
        bounded: the upstream ``BoundedVocoder`` (its ``cache`` is read at every call, so a
            caller may replace or restore it between calls, as ``Token2wav`` does).
        graphs: replay from CUDA graphs (:class:`~torch_cfm.graphs.GraphedCall`,
            each plan's capture checked against its eager call); False: the same step eagerly.
        max_graphs: plans kept (a stream meets three: its first chunk, a steady chunk, its last).
        decoder: the core's (:class:`~torch_cfm.models.vocoder.causal.CausalVocoderCore`).
    Attributes:
        core: the :class:`~torch_cfm.models.vocoder.causal.CausalVocoderCore`.
        call: the ``GraphedCall`` (None without graphs).
    """

    def __init__(self, bounded: Any, *, graphs: bool, max_graphs: int = 16, decoder: str = "auto") -> None:
        self.bounded = bounded
        self.core = CausalVocoderCore(bounded, decoder=decoder)
        self.call = GraphedCall(self.core.run, name="bounded_vocoder.stream", max_graphs=max_graphs) \
            if graphs else None

    @property
    def graph_count(self) -> int:
        return 0 if self.call is None else self.call.graph_count

    def stream(self, mel: torch.Tensor, finalize: bool = False, state: Optional[dict] = None) -> torch.Tensor:
        """The upstream method's contract: fresh mel (1, 80, T) in, (1, samples) float32 out,
        the state (``bounded.cache``, or ``state``) advanced. ``finalize``: flush (last call).

        Raises:
            ValueError: as ``BoundedVocoder.stream`` (a bad shape, a finalized stream).
            RuntimeError: a buffer beyond ``bounded.limits`` (as upstream; never at the shipped sizes).
        """
        own = state is None
        state = self.bounded.cache if own else state
        maxima = getattr(self.bounded, "maxima", None) if own else None
        seen: dict = {}
        with torch.inference_mode():
            out = stream_batch(self.core, [state], [mel], [finalize], call=self.call, maxima=[seen])[0]
        limits = getattr(self.bounded, "limits", None)
        for key, value in seen.items():
            if isinstance(limits, dict) and key in limits and value > limits[key]:
                raise RuntimeError(f"Bounded vocoder exceeded {key}: {value} > {limits[key]}")
            if isinstance(maxima, dict):
                maxima[key] = max(maxima.get(key, 0), value)
        return out

    __call__ = stream


@dataclass
class MinicpmoAcceleration:
    """What :func:`apply_minicpmo` installed on a Token2wav (``token2wav._torch_cfm_minicpmo``)."""

    vocoder: CausalVocoderStream
    capture_original: bool
    get_original: Optional[Callable] = None  # the wrapper installed as _get_original_vocoder
    original: Optional[GraphedHiFT] = None  # the original HiFT's graphed forward, once loaded
    encoder: Optional[nn.Module] = None  # the encoder whose compiled forward_chunk was replaced
    encoder_call: Optional[Callable] = None


def _graph_original(acc: MinicpmoAcceleration, hift: nn.Module) -> nn.Module:
    if acc.capture_original and not hift_gaps(hift) and not isinstance(vars(hift).get("forward"), GraphedHiFT):
        acc.original = GraphedHiFT(hift)
        hift.forward = acc.original
    return hift


def apply_minicpmo(token2wav: Any, *, graphs: bool, capture_vocoder: Optional[bool] = None,
                   strip_encoder_compile: bool = True) -> MinicpmoAcceleration:
    """Install the minicpmo-utils parts on ``token2wav`` (after the decoder is accelerated).

    Args:
        graphs: CUDA graphs for the streaming vocoder (False: the same step eagerly).
        capture_vocoder: also replay the original HiFT of ``__call__`` from CUDA graphs
            (default: ``graphs``, when the causal HiFT is on CUDA).
        strip_encoder_compile: install :func:`encoder_forward_chunk` as the flow encoder's
            ``forward_chunk`` when its class method is a ``torch.compile`` wrapper and nothing
            is installed there yet.
    Returns:
        the :class:`MinicpmoAcceleration` (also kept on ``token2wav``).
    Raises:
        TypeError: ``token2wav`` is not minicpmo-utils' Token2wav (the message names what it lacks).
    """
    gaps = causal_token2wav_gaps(token2wav)
    if gaps:
        raise TypeError(f"apply_minicpmo: token2wav must be minicpmo-utils' Token2wav (a bounded_vocoder over a "
                        f"CausalHiFTGenerator), got {type_name(token2wav)} ({', '.join(gaps)})")
    undo_minicpmo(token2wav)
    bounded = token2wav.bounded_vocoder
    on_cuda = bounded.model.conv_pre.weight.is_cuda
    if capture_vocoder is None:
        capture_vocoder = graphs and on_cuda
    acc = MinicpmoAcceleration(CausalVocoderStream(bounded, graphs=graphs and on_cuda), bool(capture_vocoder))
    bounded.stream = acc.vocoder.stream
    if callable(getattr(type(token2wav), "_get_original_vocoder", None)):
        original = type(token2wav)._get_original_vocoder

        def get_original():
            return _graph_original(acc, original(token2wav))

        acc.get_original = token2wav._get_original_vocoder = get_original
        if isinstance(getattr(token2wav, "original_hift", None), nn.Module):
            _graph_original(acc, token2wav.original_hift)
    encoder = getattr(getattr(token2wav, "flow", None), "encoder", None)
    if strip_encoder_compile and isinstance(encoder, nn.Module) and "forward_chunk" not in vars(encoder) \
            and hasattr(getattr(type(encoder), "forward_chunk", None), "_torchdynamo_orig_callable"):
        acc.encoder, acc.encoder_call = encoder, encoder_forward_chunk(encoder)
        encoder.forward_chunk = acc.encoder_call
    setattr(token2wav, _ATTR, acc)
    return acc


def undo_minicpmo(token2wav: Any) -> Any:
    """Remove what :func:`apply_minicpmo` installed (nothing installed: nothing done). Returns ``token2wav``."""
    acc = vars(token2wav).pop(_ATTR, None) if hasattr(token2wav, "__dict__") else None
    if acc is None:
        return token2wav
    bounded = token2wav.bounded_vocoder
    if vars(bounded).get("stream") == acc.vocoder.stream:
        del vars(bounded)["stream"]
    if acc.get_original is not None and vars(token2wav).get("_get_original_vocoder") is acc.get_original:
        del vars(token2wav)["_get_original_vocoder"]
    original = getattr(token2wav, "original_hift", None)
    if isinstance(original, nn.Module) and acc.original is not None and vars(original).get("forward") is acc.original:
        del vars(original)["forward"]
    if acc.encoder is not None and vars(acc.encoder).get("forward_chunk") is acc.encoder_call:
        del vars(acc.encoder)["forward_chunk"]
    return token2wav


def accelerated_minicpmo(token2wav: Any) -> Optional[MinicpmoAcceleration]:
    """The :class:`MinicpmoAcceleration` installed on ``token2wav``, or None."""
    return vars(token2wav).get(_ATTR) if hasattr(token2wav, "__dict__") else None


def warmup_minicpmo(token2wav: Any, *, chunk_frames: Sequence[int] = (50,), last_frames: Sequence[int] = (56,),
                    steady_chunks: int = 3, flush: bool = True, rounds: int = 2) -> dict:
    """Capture, now, the streaming-vocoder graphs ``Token2wav.stream`` meets, on private states
    (the Token2wav's own ``hift_cache_dict`` is not touched): per round and chunk length, a new
    stream of ``steady_chunks`` chunks (its first chunk, then steady ones), then from that state
    each ``last_frames`` length flagged last, and (``flush``) a steady chunk then the empty
    final call ``Token2wav.stream`` makes without tokens. Seeded random mel.

    Returns:
        {"vocoder_graphs": int (captured so far), "vocoder_plans": int (chunk plans met so far;
        0 without graphs)}.
    Raises:
        ValueError: ``token2wav`` has no :func:`apply_minicpmo` installed.
    """
    acc = accelerated_minicpmo(token2wav)
    if acc is None:
        fail("warmup_minicpmo", "token2wav", "be accelerated (apply_torch_cfm first)", type_name(token2wav))
    voc = acc.vocoder
    core = voc.core
    gen = torch.Generator().manual_seed(0)

    def mel(frames: int) -> torch.Tensor:
        return (2 * torch.randn(1, core.mels, frames, generator=gen) - 4).to(core.device)

    def copy(state: dict) -> dict:
        return {k: v.clone() for k, v in state.items()}

    def run(state: dict, frames: int, last: bool) -> None:
        voc.stream(mel(frames), last, state=state)

    for _ in range(rounds):
        for frames in chunk_frames:
            state = core.new_state()
            for _ in range(steady_chunks):
                run(state, frames, False)
            for last in last_frames:
                run(copy(state), last, True)
            if flush:
                run(state, frames, False)
                run(state, 0, True)
    plans = 0 if voc.call is None else len(voc.call.cache.entries())
    return {"vocoder_graphs": voc.graph_count, "vocoder_plans": plans}
