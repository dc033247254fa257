"""torch_cfm inside the ``stepaudio2`` token2wav (MiniCPM-o 4.5, Step-Audio2): one call, in place.

    >>> from torch_cfm.integrations.stepaudio2 import apply_torch_cfm, undo_torch_cfm, warmup
    >>> token2wav = stepaudio2.Token2wav(model_path, float16=True)
    >>> apply_torch_cfm(token2wav)           # or a CausalMaskedDiffWithXvec (flow), or flow.decoder
    >>> warmup(token2wav, prompt_frames=(300,))   # optional: compile and capture now, not mid-stream
    >>> pcm = token2wav.stream(tokens, prompt_wav, last_chunk=False)    # the caller's code, unchanged
    >>> undo_torch_cfm(token2wav)            # the upstream modules again, bitwise

What changes: the flow's CFM decoder (a ``CausalConditionalCFM``) gets instance-level
``forward_chunk`` and ``forward`` that solve with torch_cfm
(:class:`~torch_cfm.integrations.stepaudio2_decoder.TorchCFMDecoder`). On CUDA the flow's conformer
encoder (the upstream module, unchanged) is replayed from CUDA graphs too, one per input shape, each
checked against its eager call once (:class:`~torch_cfm.graphs.GraphedCall`; ``capture_encoder``),
and a Token2wav's HiFT vocoder from CUDA graphs per input shape, its random draws included
(:class:`~torch_cfm.integrations.hift.GraphedHiFT`; ``capture_vocoder``). Everything else (token
embedding, the trims and fade in ``Token2wav.stream``) runs as it is, so ``flow.setup_cache``,
``flow.inference_chunk``, ``flow.inference``, ``Token2wav.stream`` and ``Token2wav.__call__`` keep
their signatures and return the same mel within the accuracy oracle (docs/design.md §6).

Apply after the weights are loaded and the flow is on its device: the estimator's weights are
copied at this call (apply again after changing them). Batch 1 only, like the upstream streaming
path; other batch sizes, ``temperature != 1`` and non-trivial masks in ``forward`` fall back to
the upstream method (exact upstream behaviour).

Importing this module never imports ``stepaudio2``: the targets are recognised by their shape
(:mod:`torch_cfm.models.upstream`), so any ``CausalConditionalCFM``-shaped decoder whose estimator
has this DiT's ``state_dict`` is accepted (:func:`apply_torch_cfm_to_decoder`).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import torch
from torch import nn

from ..errors import fail
from ..graphs import GraphedCall
from ..models.cache import trim_attention_cache
from ..models.upstream import decoder_gaps, hift_gaps, type_name
from .hift import GraphedHiFT
from .minicpmo import (accelerated_minicpmo, apply_minicpmo, encoder_forward_chunk, is_causal_hift,
                       is_causal_token2wav, undo_minicpmo, warmup_minicpmo)
from .stepaudio2_decoder import TorchCFMDecoder

__all__ = ["apply_torch_cfm", "apply_torch_cfm_to_decoder", "apply_torch_cfm_to_vocoder", "undo_torch_cfm",
           "accelerated", "warmup", "warmup_vocoder", "TorchCFMDecoder"]

_ATTR = "_torch_cfm"  # the accelerated object, on the decoder
_PATCHED = ("forward_chunk", "forward")  # instance attributes shadowing the decoder's class methods


# ---------------------------------------------------------------------------- recognising targets
def _find_decoder(target: Any, op: str) -> nn.Module:
    """The CFM decoder of a Token2wav (``.flow.decoder``), a flow (``.decoder``) or a decoder."""
    if not decoder_gaps(target):
        return target
    for path in (("decoder",), ("flow", "decoder")):
        obj = target
        for name in path:
            obj = getattr(obj, name, None)
        if obj is not None and not decoder_gaps(obj):
            return obj
    found = type_name(target)
    flow = getattr(target, "flow", None)
    if getattr(target, "decoder", None) is not None:
        where = f"its .decoder is {type_name(target.decoder)}: {', '.join(decoder_gaps(target.decoder))}"
    elif flow is not None and getattr(flow, "decoder", None) is not None:
        where = f"its .flow.decoder is {type_name(flow.decoder)}: {', '.join(decoder_gaps(flow.decoder))}"
    elif flow is not None:
        where = f"its .flow is {type_name(flow)}, which has no .decoder"
    else:
        where = ", ".join(decoder_gaps(target)) + ", no .decoder, no .flow"
    raise TypeError(f"{op}: target must be a stepaudio2 Token2wav, CausalMaskedDiffWithXvec (flow) or "
                    f"CausalConditionalCFM (decoder), or an object shaped like one; got {found} ({where})")


def _find_flow(target: Any) -> Optional[nn.Module]:
    """The flow of a Token2wav or a flow (the module holding ``.decoder`` and ``.encoder``), or
    None when ``target`` is a decoder."""
    if not decoder_gaps(target):
        return None
    for cand in (target, getattr(target, "flow", None)):
        dec = getattr(cand, "decoder", None)
        if dec is not None and not decoder_gaps(dec):
            return cand
    return None


def apply_torch_cfm_to_decoder(decoder: nn.Module, **options) -> TorchCFMDecoder:
    """The generic entry: accelerate any ``CausalConditionalCFM``-shaped decoder (an
    ``estimator`` with torch_cfm's DiT ``state_dict``, a ``rand_noise`` (1, 80, F) buffer, an
    ``inference_cfg_rate``, ``forward_chunk``/``forward`` with the upstream signatures) in place.
    Options as :func:`apply_torch_cfm`. Returns the installed :class:`TorchCFMDecoder`."""
    op = "apply_torch_cfm_to_decoder"
    gaps = decoder_gaps(decoder)
    if gaps:
        raise TypeError(f"{op}: decoder must be CausalConditionalCFM-shaped, got {type_name(decoder)} "
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
    """The target's HiFTGenerator for GraphedHiFT (None for minicpmo-utils' causal HiFT: its
    streaming path is ``bounded_vocoder``, see :mod:`~torch_cfm.integrations.minicpmo`)."""
    hift = getattr(target, "hift", None)
    return hift if hift is not None and not hift_gaps(hift) and not is_causal_hift(hift) else None


def apply_torch_cfm(target: Any, *, dtype: Optional[torch.dtype] = None, graphs: Optional[bool] = None,
                    max_prompt_frames: int = 500, max_chunk_frames: int = 100, device: Optional[torch.device] = None,
                    fused: Optional[bool] = None, capture_encoder: Optional[bool] = None,
                    capture_vocoder: Optional[bool] = None, voice_cache_bytes: Optional[int] = 1 << 30) -> Any:
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
            the eager call once (:class:`~torch_cfm.graphs.GraphedCall`; a capture
            that fails or disagrees stays eager). Default: ``graphs``, when ``target`` has a flow.
        voice_cache_bytes: keep solved prompts up to this many bytes (default 1 GiB): a prompt
            already solved (e.g. a second ``set_stream_cache`` of one prompt) is copied, bitwise
            the solve's result; None or 0 turns the cache off.
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
             "(a Token2wav or a flow)", f"{type_name(target)} without one")
    hift = _vocoder_of(target)
    causal = is_causal_token2wav(target)
    if capture_vocoder and hift is None and not causal:
        held = getattr(target, "hift", None)
        fail("apply_torch_cfm", "capture_vocoder", "be set only for a Token2wav whose .hift is a HiFTGenerator",
             f"{type_name(target)} without .hift" if held is None
             else f".hift {type_name(held)} ({', '.join(hift_gaps(held))})")
    accel = apply_torch_cfm_to_decoder(decoder, dtype=dtype, graphs=graphs, max_prompt_frames=max_prompt_frames,
                                       voice_cache_bytes=voice_cache_bytes,
                                       max_chunk_frames=max_chunk_frames, device=device, fused=fused)
    if capture_encoder is None:
        capture_encoder = accel.graphs and encoder is not None
    if capture_encoder:
        call = GraphedCall(encoder_forward_chunk(encoder), name="encoder.forward_chunk")
        encoder.forward_chunk = call
        accel.encoder_call, accel._encoder = call, encoder
    if causal:  # minicpmo-utils: the streaming causal vocoder and __call__'s original HiFT
        apply_minicpmo(target, graphs=accel.graphs if capture_vocoder is None else bool(capture_vocoder),
                       capture_vocoder=capture_vocoder)
        return target
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
        if accel.vocoder is not None:
            _undo_vocoder(accel.vocoder.hift)
            accel.vocoder = None
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
    undo_minicpmo(target)
    return target


def accelerated(target: Any) -> Optional[TorchCFMDecoder]:
    """The :class:`TorchCFMDecoder` installed on ``target``'s decoder, or None."""
    return getattr(_find_decoder(target, "accelerated"), _ATTR, None)


def _trim_like_token2wav(cache: dict, prompt_frames: int) -> dict:
    """The docs/design.md §3 trim ``Token2wav.stream`` applies after each chunk, to the estimator
    attention cache and the conformer attention cache (both have frames on axis -2)."""
    for key in ("estimator_att_cache", "conformer_att_cache"):
        cache[key] = trim_attention_cache(cache[key], prompt_frames)
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
        fail(op, "target", "be accelerated (apply_torch_cfm first)", type_name(target))
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
    vocoder_graphs = 0
    if isinstance(vocoder, GraphedHiFT):
        vocoder_graphs = warmup_vocoder(vocoder, chunk_frames=(up_rate * chunk_tokens,),
                                        last_frames=[up_rate * t for t in last_tokens])
    elif accelerated_minicpmo(target) is not None:  # minicpmo-utils' causal vocoder
        vocoder_graphs = warmup_minicpmo(target, chunk_frames=(up_rate * chunk_tokens,),
                                         last_frames=[up_rate * t for t in last_tokens])["vocoder_graphs"]
    return {"streams": streams, "decoder_graphs": accel.graph_count(),
            "encoder_graphs": 0 if accel.encoder_call is None else accel.encoder_call.graph_count,
            "vocoder_graphs": vocoder_graphs}


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
             type_name(vocoder))
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
