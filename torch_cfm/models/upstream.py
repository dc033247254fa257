"""The upstream ``stepaudio2`` modules, recognised by what they hold (never by importing them).

The servers and integrations work on modules the user already built (a ``Token2wav``, its flow
``CausalMaskedDiffWithXvec``, its decoder ``CausalConditionalCFM``, its ``HiFTGenerator``).
Importing ``stepaudio2`` would pull in its whole TTS stack, and two packages install that name
(stepaudio2-minicpmo and minicpmo-utils), so each module is recognised by its shape: each
``*_gaps`` function lists what an object lacks (empty: it is one). :func:`dit_from_decoder`
copies a decoder's estimator weights into a torch_cfm :class:`~torch_cfm.models.DiT`, checked key
by key.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..errors import fail, shape_str
from .checkpoint import check_state_dict, config_from_state_dict
from .dit import DiT


def type_name(obj: Any) -> str:
    """``module.QualName`` of ``obj``'s type, for messages."""
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def decoder_gaps(obj: Any) -> list[str]:
    """What ``obj`` lacks to be a ``CausalConditionalCFM``-shaped decoder."""
    if not isinstance(obj, nn.Module):
        return ["not an nn.Module"]
    gaps = []
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


def flow_gaps(flow: Any) -> list[str]:
    """What ``flow`` lacks to be a ``CausalMaskedDiffWithXvec``-shaped flow (token embedding,
    speaker projection, chunk encoder, projection, decoder, lookahead and up-rate)."""
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


def hift_gaps(hift: Any) -> list[str]:
    """What ``hift`` lacks to be a ``stepaudio2`` ``HiFTGenerator`` (f0 predictor, harmonic source,
    ``decode``, inverse-STFT parameters)."""
    if not isinstance(hift, nn.Module):
        return [f"not an nn.Module ({type_name(hift)})"]
    gaps = [f"no '{name}' module" for name in ("f0_predictor", "f0_upsamp", "m_source", "conv_pre")
            if not isinstance(getattr(hift, name, None), nn.Module)]
    if not callable(getattr(hift, "decode", None)):
        gaps.append("no 'decode' method")
    params = getattr(hift, "istft_params", None)
    if not (isinstance(params, dict) and {"n_fft", "hop_len"} <= set(params)):
        gaps.append("no istft_params {'n_fft', 'hop_len'}")
    sine = getattr(getattr(hift, "m_source", None), "l_sin_gen", None)
    if not (isinstance(sine, nn.Module) and callable(getattr(sine, "_f02sine", None))
            and hasattr(sine, "harmonic_num")):
        gaps.append("no m_source.l_sin_gen sine generator (SineGen2)")
    if isinstance(getattr(hift, "conv_pre_look_right", None), int):
        gaps.append("a causal HiFT (minicpmo-utils' CausalHiFTGenerator: its streaming path is the "
                    "Token2wav's bounded_vocoder)")
    return gaps


def encoder_forward_chunk(encoder: nn.Module):
    """The encoder's class ``forward_chunk`` without ``torch.compile`` wrappers, bound to it
    (minicpmo-utils decorates it with ``torch.compile(backend="eager")``: a Dynamo trace per new
    shape and guard checks per call, for the same eager ops). Instance attributes are ignored."""
    fn = type(encoder).forward_chunk
    while hasattr(fn, "_torchdynamo_orig_callable"):
        fn = fn._torchdynamo_orig_callable
    return fn.__get__(encoder)


def estimator_config(decoder: nn.Module, op: str):
    """(DiTConfig, state_dict) of a decoder's estimator, checked against torch_cfm's DiT key by key.

    Raises:
        ValueError: naming every missing, unexpected or mis-shaped key, or a noise buffer of
            another mel width.
    """
    est = decoder.estimator
    sd = est.state_dict()
    try:
        config = config_from_state_dict(sd)
        check_state_dict(DiT(config).to("meta"), sd, op=op)
    except ValueError as exc:
        raise ValueError(f"{op}: the decoder's estimator ({type_name(est)}) does not have torch_cfm's DiT "
                         f"state_dict: {exc}") from None
    noise = decoder.rand_noise
    if noise.shape[1] != config.out_channels:
        fail(op, "decoder.rand_noise", f"have shape (1, {config.out_channels}, F)", shape_str(noise))
    return config, sd


def dit_from_decoder(decoder: nn.Module, device: torch.device, dtype: torch.dtype, op: str) -> DiT:
    """A :class:`~torch_cfm.models.DiT` holding the decoder's estimator weights (copied now), in
    eval mode without grads, on ``device`` in ``dtype``."""
    config, sd = estimator_config(decoder, op)
    with torch.inference_mode(False):
        est = DiT(config)
        est.load_state_dict(sd, strict=True)
        return est.to(device=device, dtype=dtype).eval().requires_grad_(False)


def placement(decoder: nn.Module, device: Optional[torch.device], dtype: Optional[torch.dtype],
              graphs: Optional[bool]) -> tuple[torch.device, torch.dtype, bool]:
    """Where and in what dtype torch_cfm serves ``decoder`` (default: its estimator's), and whether
    with CUDA graphs (default: on CUDA)."""
    param = next(decoder.estimator.parameters())
    device = torch.device(device) if device is not None else param.device
    return device, dtype or param.dtype, device.type == "cuda" if graphs is None else bool(graphs)


__all__ = ["type_name", "encoder_forward_chunk", "decoder_gaps", "flow_gaps", "hift_gaps", "estimator_config",
           "dit_from_decoder", "placement"]
