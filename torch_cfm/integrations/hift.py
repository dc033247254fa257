"""The ``stepaudio2`` HiFT vocoder (``HiFTGenerator``) replayed from CUDA graphs.

Three things in the upstream forward keep it out of a CUDA graph, and none is part of its math:

* ``SineGen2.forward`` builds the harmonic numbers 1..H+1 as a CPU tensor in every call and copies
  it to the device (a pageable host copy, which a capture refuses);
* ``HiFTGenerator.stft_window`` is a plain CPU attribute (not a buffer), copied to the device by
  every ``stft``/``istft`` call;
* ``torch.istft`` checks its window envelope with a device-to-host read (``.item()``).

:func:`capturable` removes them for the duration of a call: the harmonic numbers come from
``torch.arange`` on the device, the window is a device copy made once, and the inverse STFT is
:func:`istft` (the same transform: per-frame inverse real FFT, window, overlap-add by ``fold``,
division by the overlap-added squared window, centre trim; no host check: with the HiFT's hann
window and a hop of a quarter of it the envelope is at least 1.25 on every kept sample). Everything
else is the upstream code, called as it is.

Random numbers (the source's initial harmonic phases and its additive noise) are drawn inside the
graph from the device's default CUDA generator. A replay takes its Philox seed and offset from the
generator when it starts and advances it by what the captured kernels draw, exactly as the eager
kernels do, so a replayed call consumes and produces the same random stream as the upstream eager
call from the same generator state (:class:`~torch_cfm.integrations._graphed.GraphedCall` with
``random=True`` checks this on the capturing call).

    >>> vocoder = GraphedHiFT(hift)        # or apply_torch_cfm(token2wav): hift.forward is replaced
    >>> speech, source = vocoder(mel, cache_source)   # HiFTGenerator.forward's signature
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ._graphed import GraphedCall

__all__ = ["GraphedHiFT", "capturable", "istft", "hift_gaps"]


def hift_gaps(hift: Any) -> list[str]:
    """What ``hift`` lacks to be a ``stepaudio2`` HiFTGenerator (empty: it is one)."""
    if not isinstance(hift, nn.Module):
        return [f"not an nn.Module ({type(hift).__module__}.{type(hift).__qualname__})"]
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
    return gaps


def istft(magnitude: torch.Tensor, phase: torch.Tensor, n_fft: int, hop: int, window: torch.Tensor) -> torch.Tensor:
    """``HiFTGenerator._istft`` without the host check: magnitude clipped at 1e2, spectrum
    ``magnitude·e^{i·phase}``, ``torch.istft(center=True, onesided, normalized=False)``.

    Args:
        magnitude, phase: (B, n_fft/2 + 1, T) float32.
        window: (n_fft,) on their device (the synthesis window; hann in the HiFT).
    Returns:
        (B, hop·(T - 1)) float32.
    """
    magnitude = torch.clip(magnitude, max=1e2)
    spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
    frames = torch.fft.irfft(spec, n=n_fft, dim=1) * window[:, None]  # (B, n_fft, T)
    batch, _, count = frames.shape
    length = n_fft + hop * (count - 1)

    def overlap_add(x: torch.Tensor) -> torch.Tensor:
        return F.fold(x, output_size=(1, length), kernel_size=(1, n_fft), stride=(1, hop)).flatten(1)

    envelope = overlap_add((window * window)[None, :, None].expand(1, n_fft, count))
    pad = n_fft // 2
    return overlap_add(frames)[:, pad:length - pad] / envelope[:, pad:length - pad]


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


class GraphedHiFT:
    """``HiFTGenerator.forward(speech_feat, cache_source)`` replayed from one CUDA graph per
    (mel frames, cache samples, batch, dtype); eager (through :func:`capturable`) on CPU.

    Args:
        hift: the upstream ``HiFTGenerator`` (not modified).
        max_graphs: graphs kept (a stream meets three shapes: first chunk, chunk, last chunk).
    Attributes:
        call: the :class:`~torch_cfm.integrations._graphed.GraphedCall` (``events``, ``graph_count``).
    """

    def __init__(self, hift: nn.Module, *, max_graphs: int = 16) -> None:
        gaps = hift_gaps(hift)
        if gaps:
            raise TypeError(f"GraphedHiFT: hift must be a stepaudio2 HiFTGenerator, got "
                            f"{type(hift).__module__}.{type(hift).__qualname__} ({', '.join(gaps)})")
        self.hift = hift
        self.device = next(hift.parameters()).device
        self.window = hift.stft_window.to(self.device)
        self.call = GraphedCall(self._forward, name="hift.forward", random=True, max_graphs=max_graphs)

    def _forward(self, speech_feat: torch.Tensor, cache_source: torch.Tensor):
        with capturable(self.hift, self.window):
            return type(self.hift).forward(self.hift, speech_feat, cache_source)

    @property
    def graph_count(self) -> int:
        return self.call.graph_count

    def __call__(self, speech_feat: torch.Tensor, cache_source: Optional[torch.Tensor] = None):
        """(speech (B, 480·T'), source (B, 1, 480·T')) as the upstream forward returns them."""
        if cache_source is None or (cache_source.numel() == 0 and cache_source.device != speech_feat.device):
            cache_source = torch.zeros(speech_feat.shape[0], 1, 0, device=speech_feat.device)
        with torch.inference_mode():  # the upstream forward's own mode; graphs need grad off
            return self.call(speech_feat, cache_source)
