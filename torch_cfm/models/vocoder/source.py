"""The HiFT's harmonic source for a batch of streams, each on its own counter-based random stream.

:class:`HarmonicSource` computes what ``HiFTGenerator.forward`` gets from
``m_source(f0_upsamp(f0))[0]`` (``SourceModuleHnNSF2`` around ``SineGen2``) for every stream of a
tick in one call. It takes the frame-rate f0 (the HiFT upsamples it by repetition, so the
per-sample f0 is a step function of the frames) and gives, per sample n of frame j = n // S
(S = ``upsample_scale``, 480 at 24 kHz / 50 Hz):

* harmonic h = 1..D (D = ``harmonic_num + 1``) has per-sample phase increment
  ``rad_h[j] = frac(h · f0[j] / sr)`` cycles. As upstream, the increments are decimated to the
  frame rate, summed and linearly interpolated back: the phase at sample n is
  ``2π · lerp(C_h, (n + 0.5) / S - 0.5)`` with ``C_h[j] = S · Σ_{i≤j} rad_h[i]`` (the position
  clamped at 0, as ``F.interpolate(mode="linear")`` does);
* the initial phase: harmonics 2..D draw U[0, 1) cycles, the fundamental none, added to the
  first sample's increment. The decimation reads sample 0 with weight ``max(0, 1 - max(S/2 -
  1/2, 0))``: 1 for S = 1, 1/2 for S = 2, 0 for S >= 3, so at the shipped rates the upstream's
  phase draws never reach its output; they are drawn and applied here all the same;
* ``uv = f0[j] > voiced_threshold``; ``source = tanh(b + uv · Σ_h w_h · sine_amp · sin(phase_h)
  + σ · z)`` with ``(w, b)`` the module's ``l_linear`` and z ~ N(0, 1). The upstream adds
  ``noise_amp · N(0, 1)`` to every harmonic (``noise_amp = noise_std`` where voiced,
  ``sine_amp / 3`` where not) before the linear merge: the merged noise is one Gaussian of std
  ``σ = noise_amp · ||w||₂``, drawn here as one normal per sample (the same distribution).

Accuracy: the frame sums ``C`` are kept in float64 and reduced mod 1 before the per-sample
float32 work, so the phase error stays ~1e-5 rad where the upstream's float32 phases (|phase| up
to ~2e4 rad in a one-second chunk) carry ~1e-3 rad.

Random numbers: stream b's state is ``rng[b] = (seed, calls)`` (int64). Its draws in a call are
Philox-4x32-10 words (:mod:`~torch_cfm.models.vocoder.philox`) under key = seed, counter =
(block, calls low word, calls high word, domain), domain 0 for the noise (block = sample // 4,
four normals per block), 1 for the phases; ``forward`` returns ``rng`` with ``calls + 1``. So a
stream's source depends on its own f0 and state only: bitwise the same alone, in any batch, in
any order. CUDA float32 runs one fused Triton kernel (the same Philox words; its transcendental
functions are the GPU's, so its floats differ from the CPU's in the last bits); elsewhere plain
PyTorch. No host synchronisation, shapes fixed by the inputs: CUDA-graph capturable.

    >>> source = HarmonicSource(hift.m_source, 480)
    >>> rng = stream_rng([11, 12], device)            # two streams, seeds 11 and 12, 0 calls
    >>> s, rng = source(f0, rng)                      # f0 (2, T) -> s (2, 480 T) float32
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import nn

from ...errors import fail, shape_str
from .philox import MASK32, normal_pair_from_words, philox4x32, uniform_from_words

__all__ = ["HarmonicSource", "stream_rng", "NOISE_DOMAIN", "PHASE_DOMAIN"]

NOISE_DOMAIN, PHASE_DOMAIN = 0, 1


def stream_rng(seeds: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """(B, 2) int64 random states ``(seed, calls = 0)`` for streams with the given 64-bit seeds."""
    seeds = [int(s) for s in seeds]
    rows = [[s - (1 << 64) if s >= (1 << 63) else s, 0] for s in seeds]
    return torch.tensor(rows, dtype=torch.int64, device=device).reshape(len(seeds), 2)


def _key_and_calls(rng: torch.Tensor) -> tuple[tuple, tuple]:
    seed, calls = rng[:, 0], rng[:, 1]
    key = (seed & MASK32, (seed >> 32) & MASK32)
    return key, (calls & MASK32, (calls >> 32) & MASK32)


def _lerp_table(scale: int) -> tuple[list[int], list[float]]:
    """Per position r in a frame: (frame offset of the left interpolation node, its weight to the
    right node) of ``F.interpolate(scale_factor=scale, mode="linear", align_corners=False)``."""
    offsets, weights = [], []
    for r in range(scale):
        pos = (r + 0.5) / scale - 0.5
        offsets.append(-1 if pos < 0 else 0)
        weights.append(pos + 1.0 if pos < 0 else pos)
    return offsets, weights


class HarmonicSource(nn.Module):
    """Batched ``SourceModuleHnNSF2`` on per-stream random states (module docstring).

    Args:
        m_source: the upstream source module (``hift.m_source``; its ``l_sin_gen`` is a
            ``SineGen2`` and its ``l_linear`` the harmonic merge). Read once; not kept.
        upsample_scale: samples per f0 frame S (default: ``l_sin_gen.upsample_scale``).
        kernel: "auto" (Triton on CUDA float32, PyTorch elsewhere), "triton" or "torch".
    """

    def __init__(self, m_source: nn.Module, upsample_scale: Optional[int] = None, *, kernel: str = "auto") -> None:
        super().__init__()
        op = "HarmonicSource"
        sine = getattr(m_source, "l_sin_gen", None)
        linear = getattr(m_source, "l_linear", None)
        if sine is None or not isinstance(linear, nn.Linear) or not hasattr(sine, "harmonic_num"):
            fail(op, "m_source", "be a stepaudio2 SourceModuleHnNSF2 (l_sin_gen, l_linear)", type(m_source).__name__)
        if getattr(sine, "flag_for_pulse", False):
            fail(op, "m_source", "have flag_for_pulse=False (the HiFT's setting)", "flag_for_pulse=True")
        if kernel not in ("auto", "triton", "torch"):
            fail(op, "kernel", 'be "auto", "triton" or "torch"', repr(kernel))
        scale = int(upsample_scale if upsample_scale is not None else sine.upsample_scale)
        if scale < 1:
            fail(op, "upsample_scale", "be >= 1", str(scale))
        self.scale, self.kernel = scale, kernel
        self.harmonics = int(sine.harmonic_num) + 1
        self.sampling_rate = float(sine.sampling_rate)
        self.sine_amp, self.noise_std = float(sine.sine_amp), float(sine.noise_std)
        self.voiced_threshold = float(sine.voiced_threshold)
        w = linear.weight.detach().double().reshape(-1)
        if w.numel() != self.harmonics:
            fail(op, "m_source.l_linear", f"map {self.harmonics} harmonics to 1", shape_str(linear.weight))
        norm = float(w.norm())
        self.sigma_voiced, self.sigma_unvoiced = self.noise_std * norm, self.sine_amp / 3 * norm
        self.register_buffer("weight", (w * self.sine_amp).float(), persistent=False)  # (D,) amp-scaled
        self.register_buffer("weight64", w * self.sine_amp, persistent=False)
        self.bias = float(linear.bias.detach().double()) if linear.bias is not None else 0.0
        offsets, weights = _lerp_table(scale)
        self.register_buffer("lerp_offset", torch.tensor(offsets, dtype=torch.int64), persistent=False)
        self.register_buffer("lerp_weight", torch.tensor(weights, dtype=torch.float64), persistent=False)
        self.register_buffer("lerp_weight32", torch.tensor(weights, dtype=torch.float32), persistent=False)
        # weight of sample 0 in the decimated frame 0 (where the initial phases enter)
        self.phase_weight = max(0.0, 1.0 - max(scale / 2 - 0.5, 0.0))

    def extra_repr(self) -> str:
        return (f"harmonics={self.harmonics}, scale={self.scale}, sr={self.sampling_rate:g}, "
                f"sine_amp={self.sine_amp:g}, noise_std={self.noise_std:g}, kernel={self.kernel}")

    # ------------------------------------------------------------------ draws
    def initial_phases(self, rng: torch.Tensor) -> torch.Tensor:
        """(B, D) float32 initial phases in cycles: 0 for the fundamental, U[0, 1) for the others."""
        key, (lo, hi) = _key_and_calls(rng)
        blocks = -(-(self.harmonics - 1) // 4)
        c0 = torch.arange(blocks, device=rng.device, dtype=torch.int64)[None, :]
        words = philox4x32((c0, lo[:, None], hi[:, None], torch.full_like(c0, PHASE_DOMAIN)),
                           (key[0][:, None], key[1][:, None]))
        u = uniform_from_words(torch.stack(words, dim=-1).reshape(rng.shape[0], -1))[:, :self.harmonics - 1]
        return torch.cat([torch.zeros_like(u[:, :1]), u], dim=1)

    def normals(self, rng: torch.Tensor, samples: int) -> torch.Tensor:
        """(B, samples) float32 standard normals of the call with state ``rng`` (the noise draws)."""
        key, (lo, hi) = _key_and_calls(rng)
        c0 = torch.arange(-(-samples // 4), device=rng.device, dtype=torch.int64)[None, :]
        w0, w1, w2, w3 = philox4x32((c0, lo[:, None], hi[:, None], torch.full_like(c0, NOISE_DOMAIN)),
                                    (key[0][:, None], key[1][:, None]))
        z0, z1 = normal_pair_from_words(w0, w1)
        z2, z3 = normal_pair_from_words(w2, w3)
        return torch.stack([z0, z1, z2, z3], dim=-1).reshape(rng.shape[0], -1)[:, :samples]

    # ------------------------------------------------------------------ source
    def phase_tables(self, f0: torch.Tensor, rng: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Frame-rate tables of the phase integral (float64 sums, float32 out unless f0 is float64):
        ``frac(C)`` (B, T, D), the per-frame increment ``S·rad`` (B, T, D) and ``uv`` (B, T)."""
        out = torch.float64 if f0.dtype == torch.float64 else torch.float32
        h = torch.arange(1, self.harmonics + 1, device=f0.device, dtype=torch.float64)
        rad = torch.remainder(f0.double()[..., None] * h / self.sampling_rate, 1.0)  # (B, T, D)
        if self.phase_weight:
            first = rad[:, :1] + self.phase_weight * self.initial_phases(rng).double()[:, None]
            rad = torch.cat([first, rad[:, 1:]], dim=1)
        total = torch.cumsum(rad, dim=1) * self.scale
        uv = (f0 > self.voiced_threshold).to(out)
        return (total - torch.floor(total)).to(out), (rad * self.scale).to(out), uv

    def forward(self, f0: torch.Tensor, rng: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The merged source of every stream.

        Args:
            f0: (B, T) frame-rate f0 in Hz (float32, or float64 for a float64 source).
            rng: (B, 2) int64 per-stream ``(seed, calls)`` (:func:`stream_rng`).
        Returns:
            (source (B, T·S) in f0's float type, next rng (B, 2) = ``rng`` with calls + 1).
        """
        op = "HarmonicSource"
        if not isinstance(f0, torch.Tensor) or f0.dim() != 2 or not f0.is_floating_point():
            fail(op, "f0", "be a floating (B, T) tensor", shape_str(f0) if isinstance(f0, torch.Tensor) else repr(f0))
        if not isinstance(rng, torch.Tensor) or rng.dtype != torch.int64 or tuple(rng.shape) != (f0.shape[0], 2):
            got = f"{rng.dtype} {shape_str(rng)}" if isinstance(rng, torch.Tensor) else repr(rng)
            fail(op, "rng", f"be int64 of shape (B, 2)=({f0.shape[0]}, 2) (seed, calls)", got, "see stream_rng")
        if rng.device != f0.device:
            fail(op, "rng", f"be on f0's device {f0.device}", str(rng.device))
        f0 = f0 if f0.dtype == torch.float64 else f0.float()
        frac, inc, uv = self.phase_tables(f0, rng)
        if self._use_triton(f0):
            from ...kernels.vocoder_source import harmonic_source_triton

            out = harmonic_source_triton(frac, inc, uv, rng, self.weight, self.bias, self.sigma_voiced,
                                         self.sigma_unvoiced, self.scale, self.lerp_offset, self.lerp_weight32)
        else:
            out = self._source_torch(frac, inc, uv, rng)
        step = torch.zeros_like(rng)
        step[:, 1] = 1
        return out, rng + step

    def _use_triton(self, f0: torch.Tensor) -> bool:
        if self.kernel == "torch" or f0.dtype != torch.float32:
            return False
        if self.kernel == "triton":
            return True
        return f0.device.type == "cuda"

    def _source_torch(self, frac: torch.Tensor, inc: torch.Tensor, uv: torch.Tensor, rng: torch.Tensor) -> torch.Tensor:
        batch, frames, _ = frac.shape
        samples = frames * self.scale
        dev, dt = frac.device, frac.dtype
        n = torch.arange(samples, device=dev)
        frame, pos = n // self.scale, n % self.scale
        left = frame + self.lerp_offset.to(dev)[pos]
        weight = torch.where(left < 0, 0.0, self.lerp_weight.to(dev)[pos]).to(dt)
        left = left.clamp(min=0)
        right = (left + 1).clamp(max=frames - 1)
        weight = torch.where(right > left, weight, torch.zeros_like(weight))
        cycles = frac[:, left] + weight[None, :, None] * inc[:, right]  # (B, L, D)
        cycles = cycles - torch.floor(cycles)
        sines = torch.sin((2 * math.pi) * cycles)
        w = (self.weight64 if dt == torch.float64 else self.weight).to(dev)
        voiced = uv[:, frame]
        harmonic = (sines * w).sum(dim=-1) * voiced + self.bias
        sigma = voiced * self.sigma_voiced + (1 - voiced) * self.sigma_unvoiced
        return torch.tanh(harmonic + sigma * self.normals(rng, samples).to(dt))
