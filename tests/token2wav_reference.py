"""Reference streams for the many-stream front: each stream decoded alone by the upstream modules.

:func:`upstream_stream` drives one stream the way ``Token2wav.stream`` does (``flow.setup_cache``,
then ``flow.inference_chunk`` per chunk with its estimator and conformer trims, through
``upstream_flow.run_stream``) and its vocoder stage the same way: the HiFT called on the 8 cached
mel frames + the chunk with the cached source, the Hamming cross-fade over the 8 * 480 overlap
samples, the tail held back until the last chunk. ``Token2wav`` itself cannot run here (it
hard-codes CUDA and imports the TTS stack); its vocoder steps are reproduced from its behaviour
like ``upstream_flow.trim_stream_cache`` reproduces its trims. The HiFT draws random numbers in
its source module: the reference seeds the global RNG once per stream (``torch.manual_seed``),
as a process decoding that stream alone would.

:func:`build_hift` builds a real upstream ``HiFTGenerator`` (it imports scipy) at a tiny size.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from typing import Optional

import numpy as np
import torch

import upstream_flow as U

# A smaller flow than upstream_flow.TINY for the soak (CPU ticks are launch-bound).
SOAK = dataclasses.replace(U.TINY, hidden=32, depth=1, heads=2, head_dim=16, enc_size=16, enc_heads=2,
                           enc_units=32)
# HiFT at a tiny width; the rates keep 480 samples per mel frame (24 kHz / 50 Hz, as shipped).
TINY_HIFT = dict(base_channels=8, resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1]],
                 source_resblock_kernel_sizes=[3, 3, 3], source_resblock_dilation_sizes=[[1], [1], [1]])
MEL_CACHE = 8


def hift_missing_reason() -> Optional[str]:
    reason = U.missing_reason()
    if reason is None and importlib.util.find_spec("scipy") is None:
        reason = "the upstream HiFTGenerator imports scipy (pip install scipy)"
    return reason


def build_hift(seed: int = 0, **sizes) -> torch.nn.Module:
    """A real upstream ``HiFTGenerator`` with seeded random weights (the module's own init), eval."""
    U.load()
    hifigan = importlib.import_module("stepaudio2.flashcosyvoice.modules.hifigan")
    kw = dict(TINY_HIFT, **sizes)
    torch.manual_seed(seed)
    f0 = hifigan.ConvRNNF0Predictor(cond_channels=16)
    return hifigan.HiFTGenerator(f0_predictor=f0, **kw).eval()


def upstream_vocoder(hift, mels: list[torch.Tensor], seed: int, last: bool = True) -> list[torch.Tensor]:
    """``Token2wav.stream``'s vocoder stage over one stream's chunk mels (1, 80, T): wav per chunk."""
    samples = int(hift.m_source.l_sin_gen.upsample_scale) * MEL_CACHE
    dev = mels[0].device
    window = torch.from_numpy(np.hamming(2 * samples)).to(dev)  # Token2wav.speech_window (float64)
    cache_mel = torch.zeros(1, mels[0].shape[1], 0, device=dev)
    cache_source, cache_speech = torch.zeros(1, 1, 0, device=dev), torch.zeros(1, 0, device=dev)
    torch.manual_seed(seed)  # every device's default generator
    out = []
    for i, chunk in enumerate(mels):
        mel = torch.cat([cache_mel, chunk.float()], dim=2)
        speech, source = hift(mel, cache_source)
        if cache_speech.shape[-1] > 0:
            speech = speech.clone()
            speech[..., :samples] = speech[..., :samples] * window[:samples] + \
                cache_speech[..., -samples:] * window[samples:]
        cache_mel, cache_source = mel[..., -MEL_CACHE:].clone(), source[:, :, -samples:].clone()
        cache_speech = speech[:, -samples:].clone()
        is_last = last and i == len(mels) - 1
        out.append((speech if is_last else speech[:, :-samples])[0])
    return out


class NoNoise:
    """Within: ``torch.randn_like`` returns zeros, so the upstream HiFT source adds no noise (a
    deterministic reference for vocoders that draw their own noise)."""

    def __enter__(self):
        self.saved = torch.randn_like
        torch.randn_like = lambda x, **kw: torch.zeros_like(x, **kw)

    def __exit__(self, *exc):
        torch.randn_like = self.saved


def quiet_vocoder(server) -> None:
    """The additive noise of a Token2wavServer's torch_cfm vocoder switched off (tests only)."""
    source = server.vocoder.vocoder.source
    source.sigma_voiced = source.sigma_unvoiced = 0.0


def upstream_stream(flow, prompt: U.Prompt, chunks: list[torch.Tensor], n_timesteps: int,
                    hift=None, seed: int = 0, last: bool = True):
    """One stream alone through the upstream modules: ([mel (80, T)], [wav] or None, final cache).
    ``last``: the final chunk is flagged ``last_chunk`` (False: a stream left early)."""
    cache = flow.setup_cache(prompt.tokens, prompt.mel, prompt.spk, n_timesteps=n_timesteps)
    mels = []
    for i, tok in enumerate(chunks):
        mel, cache = flow.inference_chunk(tok, prompt.spk, cache, last_chunk=last and i == len(chunks) - 1,
                                          n_timesteps=n_timesteps)
        mels.append(mel.clone())
        cache = U.trim_stream_cache(cache, prompt.frames)
    wavs = upstream_vocoder(hift, mels, seed, last) if hift is not None and mels else None
    return [m[0] for m in mels], wavs, cache
