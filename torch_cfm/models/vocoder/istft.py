"""The HiFT's STFT and inverse STFT on frame-major tensors, as small fixed matrices.

The HiFT analyses its source with ``torch.stft(n_fft, hop, win_length=n_fft, hann window,
center=True, reflect padding)`` and synthesises speech with the matching ``torch.istft``. With
n_fft = 16 both are tiny per-frame matrix products, so here they are written as such, in the
frame-major layout (B, F, channels) the vocoder keeps end to end (a channels-last (B, C, 1, F)
tensor is that memory):

* :func:`stft_frames`: reflect-pad by n_fft/2, cut frames of n_fft at stride hop, multiply by the
  windowed real DFT basis -> (B, F, n_fft + 2) = ``[real bins | imaginary bins]``, the channel
  order of the HiFT's ``torch.cat([real, imag], dim=1)``.
* :func:`istft_frames`: from the HiFT's ``conv_post`` output (B, F, n_fft + 2) = ``[log
  magnitude | phase logits]``: magnitude ``min(exp(.), 1e2)``, phase ``sin(.)``, the windowed
  inverse real DFT (bins 0 and n_fft/2 take their real part only, as ``irfft`` does), overlap-add
  at stride hop, division by the overlap-added squared window, the centre trim -> (B, hop·(F-1)).

The products are batched per row (``bmm``), never one matrix over all rows, so a row's rounding
does not depend on its position in the batch. Both are shape-stable and free of host
synchronisation (``torch.istft`` reads its window envelope back to the host; the envelope here is
a fixed function of F). The products run at IEEE float32 (or float64) precision whatever the
ambient TF32 setting: the caller scopes the matmul flag (``precision.conv_precision_scope``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["analysis_basis", "synthesis_basis", "stft_frames", "istft_frames", "overlap_add"]

MAGNITUDE_CLIP = 1e2


def analysis_basis(window: torch.Tensor, n_fft: int) -> torch.Tensor:
    """(n_fft, n_fft + 2) float64: column k is ``window · cos(2π k n / N)`` (k < N/2 + 1), then
    ``-window · sin(...)``: ``frames @ basis`` = ``[Re X | Im X]`` of the windowed frames."""
    n = torch.arange(n_fft, dtype=torch.float64)
    k = torch.arange(n_fft // 2 + 1, dtype=torch.float64)
    angle = 2 * math.pi * n[:, None] * k[None, :] / n_fft
    w = window.detach().double().cpu()[:, None]
    return torch.cat([w * torch.cos(angle), -w * torch.sin(angle)], dim=1)


def synthesis_basis(window: torch.Tensor, n_fft: int) -> torch.Tensor:
    """(n_fft + 2, n_fft) float64: ``[Re X | Im X] @ basis`` = ``window · irfft(X, n_fft)``."""
    bins = n_fft // 2 + 1
    k = torch.arange(bins, dtype=torch.float64)
    n = torch.arange(n_fft, dtype=torch.float64)
    angle = 2 * math.pi * k[:, None] * n[None, :] / n_fft
    fold = torch.full((bins, 1), 2.0, dtype=torch.float64)
    fold[0] = 1.0
    if n_fft % 2 == 0:
        fold[-1] = 1.0
    imag = -fold * torch.sin(angle)
    imag[0] = 0.0  # irfft ignores the imaginary part of the DC bin (and of the Nyquist bin: sin = 0)
    w = window.detach().double().cpu()[None, :]
    return torch.cat([fold * torch.cos(angle), imag], dim=0) * w / n_fft


def stft_frames(signal: torch.Tensor, basis: torch.Tensor, n_fft: int, hop: int) -> torch.Tensor:
    """``torch.stft`` of the HiFT, frame-major.

    Args:
        signal: (B, L) float32/float64.
        basis: :func:`analysis_basis` in ``signal``'s dtype and device.
    Returns:
        (B, L // hop + 1, n_fft + 2) ``[real | imaginary]`` bins per frame, contiguous.
    """
    padded = F.pad(signal[:, None], (n_fft // 2, n_fft // 2), mode="reflect")[:, 0]
    frames = padded.unfold(-1, n_fft, hop)
    return torch.bmm(frames, basis.expand(frames.shape[0], -1, -1))


def overlap_add(frames: torch.Tensor, hop: int) -> torch.Tensor:
    """(B, F, N) frames, N a multiple of ``hop`` -> (B, hop·(F - 1) + N) summed at stride ``hop``."""
    batch, count, n_fft = frames.shape
    taps = n_fft // hop
    parts = frames.reshape(batch, count, taps, hop)
    out = parts.new_zeros(batch, count + taps - 1, hop)
    for j in range(taps):  # tap j of frame f lands on output block f + j
        out[:, j:j + count] += parts[:, :, j]
    return out.reshape(batch, -1)


def istft_frames(logits: torch.Tensor, basis: torch.Tensor, window: torch.Tensor, n_fft: int, hop: int) -> torch.Tensor:
    """The HiFT's magnitude/phase head and ``torch.istft``, frame-major.

    Args:
        logits: (B, F, n_fft + 2) ``conv_post`` output: log magnitudes then phase logits, any float
            dtype (computed in ``basis``'s dtype).
        basis: :func:`synthesis_basis` (float32 or float64) on ``logits``' device.
        window: (n_fft,) synthesis window, ``basis``' dtype and device.
    Returns:
        (B, hop·(F - 1)) waveform in ``basis``' dtype (not yet clamped to the audio limit).
    """
    bins = n_fft // 2 + 1
    x = logits.to(basis.dtype)
    magnitude = torch.clamp(torch.exp(x[..., :bins]), max=MAGNITUDE_CLIP)
    phase = torch.sin(x[..., bins:])
    spectrum = torch.cat([magnitude * torch.cos(phase), magnitude * torch.sin(phase)], dim=-1)
    frames = torch.bmm(spectrum, basis.expand(spectrum.shape[0], -1, -1))  # (B, F, n_fft), windowed
    count = frames.shape[1]
    envelope = overlap_add((window * window).expand(1, count, n_fft), hop)
    pad = n_fft // 2
    keep = slice(pad, pad + hop * (count - 1))
    return overlap_add(frames, hop)[:, keep] / envelope[:, keep]
