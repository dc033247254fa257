"""The ``stepaudio2`` HiFT vocoder (``HiFTGenerator``) made capturable by CUDA graphs, its math unchanged.

Three things in the upstream forward keep it out of a CUDA graph, and none is part of its math:

* ``SineGen2.forward`` builds the harmonic numbers 1..H+1 as a CPU tensor in every call and copies
  it to the device (a pageable host copy, which a capture refuses);
* ``HiFTGenerator.stft_window`` is a plain CPU attribute (not a buffer), copied to the device by
  every ``stft``/``istft`` call;
* ``torch.istft`` checks its window envelope with a device-to-host read (``.item()``).

:func:`capturable` removes them for the duration of a call: the harmonic numbers come from
``torch.arange`` on the device, the window is a device copy made once, and the inverse STFT is
:func:`istft` (the same transform: per-frame inverse real FFT, window, overlap-add by ``unfold_backward``,
division by the overlap-added squared window, centre trim; no host check: with the HiFT's hann
window and a hop of a quarter of it the envelope is at least 1.25 on every kept sample). Everything
else is the upstream code, called as it is; its random draws (the source's initial harmonic phases
and additive noise) come from the device's default generator in the upstream order.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
from torch import nn

MEL_CACHE_FRAMES = 8  # Token2wav.stream: mel frames carried into the next vocoder call (160 ms)


def istft(magnitude: torch.Tensor, phase: torch.Tensor, n_fft: int, hop: int, window: torch.Tensor) -> torch.Tensor:
    """``HiFTGenerator._istft`` without ``torch.istft``'s host-side envelope check: magnitude
    clipped at 1e2, spectrum ``magnitude·e^{i·phase}``, then ``torch.istft``'s own ops (inverse
    real FFT, window, overlap-add by ``unfold_backward``, division by the overlap-added squared
    window, centre trim), so its result bitwise on the CPU. With the HiFTs' hann window at a
    quarter hop the envelope is >= 1.25 on every kept sample.

    Args:
        magnitude, phase: (B, n_fft/2 + 1, T) float32.
        window: (n_fft,) on their device (the synthesis window).
    Returns:
        (B, hop·(T - 1)) float32.
    """
    magnitude = torch.clip(magnitude, max=1e2)
    spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
    frames = torch.fft.irfft(spec, n=n_fft, dim=1)  # (B, n_fft, T)
    batch, count = frames.shape[0], frames.shape[2]
    length = n_fft + hop * (count - 1)
    wave = torch.ops.aten.unfold_backward((frames * window.view(-1, 1)).transpose(1, 2), [batch, length], 1,
                                          n_fft, hop)
    envelope = torch.ops.aten.unfold_backward(window.pow(2).expand(1, count, n_fft), [1, length], 1, n_fft, hop)
    pad = n_fft // 2
    return wave[:, pad:length - pad] / envelope[:, pad:length - pad]


def _harmonic_source(sine: nn.Module, f0: torch.Tensor):
    """``SineGen2.forward`` with its harmonic numbers made on f0's device: (sine waves, uv, noise),
    each (B, L, H+1) but uv (B, L, 1). The random draws come in the upstream order."""
    harmonics = torch.arange(1, sine.harmonic_num + 2, device=f0.device, dtype=torch.float32)
    waves = sine._f02sine(f0 * harmonics) * sine.sine_amp
    uv = sine._f02uv(f0)
    noise = (uv * sine.noise_std + (1 - uv) * sine.sine_amp / 3) * torch.randn_like(waves)
    return waves * uv + noise, uv, noise


@contextlib.contextmanager
def capturable(hift: nn.Module, window: Optional[torch.Tensor] = None):
    """Within: ``hift``'s forward, ``decode`` and ``m_source`` are capturable (module docstring).

    ``window``: the device copy of ``hift.stft_window`` to use (default: made here). The
    instance attributes set here are removed on exit; the module's state is as before.
    """
    sine = hift.m_source.l_sin_gen
    params = hift.istft_params
    saved_window = hift.stft_window
    device = next(hift.parameters()).device
    if window is None:
        window = saved_window.to(device)
    hift.stft_window = window
    hift._istft = lambda magnitude, phase: istft(magnitude, phase, params["n_fft"], params["hop_len"],
                                                 window.to(magnitude.dtype))
    sine.forward = lambda f0: _harmonic_source(sine, f0)
    try:
        yield hift
    finally:
        hift.stft_window = saved_window
        vars(hift).pop("_istft", None)
        vars(sine).pop("forward", None)


def hift_stream_constants(hift: nn.Module) -> tuple[int, int]:
    """(samples per mel frame, source/speech cache samples) of a HiFTGenerator: 480 and 3840 at
    the shipped 24 kHz / 50 Hz sizes, as ``Token2wav.stream`` hard-codes them."""
    rates = getattr(hift, "m_source", None)
    scale = getattr(getattr(rates, "l_sin_gen", None), "upsample_scale", None)
    if scale is None:
        scale = math.prod(getattr(u, "stride", (1,))[0] for u in hift.ups) * hift.istft_params["hop_len"]
    scale = int(scale)
    return scale, MEL_CACHE_FRAMES * scale


__all__ = ["capturable", "istft", "hift_stream_constants", "MEL_CACHE_FRAMES"]
