"""Counter-based random numbers for the vocoder source: Philox-4x32-10 in plain PyTorch.

A draw is a pure function of (key, counter): key = the stream's 64-bit seed, counter = four 32-bit
words. :class:`~torch_cfm.models.vocoder.source.HarmonicSource` gives every stream its own key and
puts the stream's call count and the sample index into the counter, so a stream's numbers do not
depend on which other streams share a batch, nor on their order.

The words follow Random123's ``philox4x32`` with 10 rounds (multipliers 0xD2511F53 and
0xCD9E8D57, Weyl key increments 0x9E3779B9 and 0xBB67AE85), the same function as Triton's
``tl.randint4x``; the Triton source kernel (``torch_cfm.kernels.vocoder_source``) computes
bitwise the same words. The float conversions are this module's own (the kernel mirrors them):

* uniform: ``(word >> 8) * 2**-24``, exactly representable in float32, in [0, 1);
* normal: Box-Muller on two words, ``sqrt(-2 ln(1 - u1)) * (cos, sin)(2 pi u2)`` (|z| < 5.8).

Everything is int64 tensor arithmetic with every product kept below 2**63 (a 32 x 16-bit split),
so CPU and CUDA give the same words; no host synchronisation, shapes fixed by the inputs.
"""

from __future__ import annotations

import math

import torch

__all__ = ["philox4x32", "uniform_from_words", "normal_pair_from_words", "ROUNDS",
           "MULTIPLIERS", "KEY_STEPS"]

MASK32 = 0xFFFFFFFF
MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
KEY_STEPS = (0x9E3779B9, 0xBB67AE85)
ROUNDS = 10
_TWO_PI = 2.0 * math.pi


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of ``a * m`` for int64 ``a`` in [0, 2**32) and a 32-bit constant."""
    lo_part = a * (m & 0xFFFF)            # < 2**48
    hi_part = a * (m >> 16)               # < 2**48; a*m = hi_part * 2**16 + lo_part
    low = lo_part + ((hi_part & 0xFFFF) << 16)
    return (hi_part >> 16) + (low >> 32), low & MASK32


def philox4x32(counter: tuple[torch.Tensor, ...], key: tuple[torch.Tensor, torch.Tensor],
               rounds: int = ROUNDS) -> tuple[torch.Tensor, ...]:
    """Philox-4x32 words of ``counter`` under ``key``.

    Args:
        counter: four int64 tensors (broadcastable) holding 32-bit words (values in [0, 2**32)).
        key: two int64 tensors (broadcastable to the counter) holding 32-bit words.
    Returns:
        four int64 tensors of the broadcast shape, each a 32-bit word in [0, 2**32).
    """
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(rounds):
        hi0, lo0 = _mulhilo(c0, MULTIPLIERS[0])
        hi1, lo1 = _mulhilo(c2, MULTIPLIERS[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + KEY_STEPS[0]) & MASK32
        k1 = (k1 + KEY_STEPS[1]) & MASK32
    return c0, c1, c2, c3


def uniform_from_words(word: torch.Tensor) -> torch.Tensor:
    """float32 in [0, 1) from int64 32-bit words: the top 24 bits times 2**-24 (exact)."""
    return (word >> 8).to(torch.float32) * (2.0 ** -24)


def normal_pair_from_words(w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent float32 standard normals per pair of words (Box-Muller)."""
    radius = torch.sqrt(-2.0 * torch.log(1.0 - uniform_from_words(w1)))
    angle = _TWO_PI * uniform_from_words(w2)
    return radius * torch.cos(angle), radius * torch.sin(angle)
