"""The vocoder's harmonic source (``torch_cfm.models.vocoder.source``) as one Triton kernel.

Per program: one stream (row) and BLOCK samples. For each group of four samples it computes the
Philox-4x32-10 words of counter (sample // 4, calls low, calls high, 0) under key = the stream's
seed (bitwise the words of ``models.vocoder.philox``), turns them into four normals by
Box-Muller, evaluates the D harmonics' phases from the frame tables (float64 sums reduced mod 1,
then float32 interpolation), merges them with the amplitude-scaled linear weights, adds the
voiced/unvoiced noise and applies tanh. Reads the (B, T, D) tables and writes (B, T·S) float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import on_device

__all__ = ["harmonic_source_triton", "philox_words_triton"]

_BLOCK = 1024  # samples per program (a multiple of 4)


@triton.jit
def _philox4x32(c0, c1, c2, c3, k0, k1):
    """Ten Philox-4x32 rounds on uint32 blocks (Random123 constants)."""
    for _ in tl.static_range(10):
        h0 = tl.umulhi(c0, 0xD2511F53)
        h1 = tl.umulhi(c2, 0xCD9E8D57)
        l0 = c0 * 0xD2511F53
        l1 = c2 * 0xCD9E8D57
        c0, c1, c2, c3 = h1 ^ c1 ^ k0, l1, h0 ^ c3 ^ k1, l0
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def _uniform(word):
    return (word >> 8).to(tl.float32) * 5.9604644775390625e-08  # top 24 bits * 2**-24


@triton.jit
def _tanh(x):
    """tanh with float32 relative accuracy near 0 (odd series) and saturation at +-1."""
    ax = tl.abs(x)
    t = tl.exp(-2.0 * ax)
    far = (1.0 - t) / (1.0 + t)
    x2 = x * x
    near = ax * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
        -0.05396825396825397 + x2 * 0.021869488536155203))))
    y = tl.where(ax < 0.125, near, far)
    return tl.where(x < 0, -y, y)


@triton.jit
def _keys(rng_ptr, row):
    seed = tl.load(rng_ptr + row * 2)
    calls = tl.load(rng_ptr + row * 2 + 1)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    lo = (calls & 0xFFFFFFFF).to(tl.uint32)
    hi = ((calls >> 32) & 0xFFFFFFFF).to(tl.uint32)
    return k0, k1, lo, hi


@triton.jit
def _vocoder_source_kernel(
    frac_ptr, inc_ptr,          # (B, T, D) float32: frac of the frame phase sums, per-frame increment
    uv_ptr,                     # (B, T) float32 voiced flags
    rng_ptr,                    # (B, 2) int64 (seed, calls)
    w_ptr,                      # (D,) float32 merge weights times sine_amp
    off_ptr, lam_ptr,           # (S,) int64 left-node frame offset, float32 weight of the right node
    out_ptr,                    # (B, T*S) float32
    T, S, bias, sigma_v, sigma_u,
    D: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(1).to(tl.int64)
    quads = tl.program_id(0) * (BLOCK // 4) + tl.arange(0, BLOCK // 4)
    k0, k1, lo, hi = _keys(rng_ptr, row)
    zero = quads.to(tl.uint32) * 0
    w0, w1, w2, w3 = _philox4x32(quads.to(tl.uint32), zero + lo, zero + hi, zero, k0, k1)
    r01 = tl.sqrt_rn(-2.0 * tl.log(1.0 - _uniform(w0)))
    a01 = 6.283185307179586 * _uniform(w1)
    r23 = tl.sqrt_rn(-2.0 * tl.log(1.0 - _uniform(w2)))
    a23 = 6.283185307179586 * _uniform(w3)
    lane = tl.arange(0, 4)[None, :]
    z = tl.where(lane == 0, (r01 * tl.cos(a01))[:, None],
                 tl.where(lane == 1, (r01 * tl.sin(a01))[:, None],
                          tl.where(lane == 2, (r23 * tl.cos(a23))[:, None], (r23 * tl.sin(a23))[:, None])))

    n = quads[:, None] * 4 + lane                     # (BLOCK/4, 4) sample index
    samples = T * S
    ok = n < samples
    frame = n // S
    pos = n % S
    left = frame + tl.load(off_ptr + pos, mask=ok, other=0)
    lam = tl.where(left < 0, 0.0, tl.load(lam_ptr + pos, mask=ok, other=0.0))
    left = tl.maximum(left, 0)
    right = tl.minimum(left + 1, T - 1)
    lam = tl.where(right > left, lam, 0.0)
    base = row * T
    acc = tl.zeros((BLOCK // 4, 4), dtype=tl.float32)
    for h in tl.static_range(D):
        f = tl.load(frac_ptr + (base + left) * D + h, mask=ok, other=0.0)
        g = tl.load(inc_ptr + (base + right) * D + h, mask=ok, other=0.0)
        cyc = f + lam * g
        cyc = cyc - tl.floor(cyc)
        acc += tl.load(w_ptr + h) * tl.sin(6.283185307179586 * cyc)
    voiced = tl.load(uv_ptr + base + frame, mask=ok, other=0.0)
    sigma = voiced * sigma_v + (1.0 - voiced) * sigma_u
    x = acc * voiced + bias + sigma * z
    tl.store(out_ptr + row * samples + n, _tanh(x), mask=ok)


@triton.jit
def _philox_words_kernel(rng_ptr, out_ptr, count, DOMAIN: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(1).to(tl.int64)
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    k0, k1, lo, hi = _keys(rng_ptr, row)
    zero = idx.to(tl.uint32) * 0
    w0, w1, w2, w3 = _philox4x32(idx.to(tl.uint32), zero + lo, zero + hi, zero + DOMAIN, k0, k1)
    ok = idx < count
    dst = out_ptr + (row * count + idx) * 4
    tl.store(dst, w0.to(tl.int64), mask=ok)
    tl.store(dst + 1, w1.to(tl.int64), mask=ok)
    tl.store(dst + 2, w2.to(tl.int64), mask=ok)
    tl.store(dst + 3, w3.to(tl.int64), mask=ok)


def philox_words_triton(rng: torch.Tensor, count: int, domain: int = 0) -> torch.Tensor:
    """(B, count, 4) int64 Philox words of blocks 0..count-1 of each row's ``rng`` (tests)."""
    out = torch.empty(rng.shape[0], count, 4, dtype=torch.int64, device=rng.device)
    block = 128
    with on_device(rng.device):
        _philox_words_kernel[(triton.cdiv(count, block), rng.shape[0])](
            rng.contiguous(), out, count, DOMAIN=domain, BLOCK=block)
    return out


def harmonic_source_triton(frac: torch.Tensor, inc: torch.Tensor, uv: torch.Tensor, rng: torch.Tensor,
                           weight: torch.Tensor, bias: float, sigma_voiced: float, sigma_unvoiced: float,
                           scale: int, lerp_offset: torch.Tensor, lerp_weight: torch.Tensor) -> torch.Tensor:
    """Host launcher: tables (B, T, D) float32, uv (B, T), rng (B, 2) int64, weight (D,) float32,
    lerp_offset (scale,) int64, lerp_weight (scale,) float32 -> source (B, T·scale) float32."""
    batch, frames, harmonics = frac.shape
    out = torch.empty(batch, frames * scale, device=frac.device, dtype=torch.float32)
    grid = (triton.cdiv(frames * scale, _BLOCK), batch)
    with on_device(frac.device):
        _vocoder_source_kernel[grid](
            frac.contiguous(), inc.contiguous(), uv.float().contiguous(), rng.contiguous(),
            weight.contiguous(), lerp_offset.contiguous(), lerp_weight.contiguous(), out,
            frames, scale, float(bias), float(sigma_voiced), float(sigma_unvoiced),
            D=harmonics, BLOCK=_BLOCK, num_warps=4)
    return out
