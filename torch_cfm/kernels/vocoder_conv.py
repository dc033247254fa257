"""The vocoder's convolutions as one Triton implicit-GEMM kernel with the elementwise work fused after it.

Tensors are frame-major (B, L, C), channels innermost. A ``Conv1d`` (any stride, padding, left
and right apart as a causal convolution has them, dilation) or a ``ConvTranspose1d`` (any stride,
padding or crop on either side, output padding; dilation 1) is a GEMM
over taps: output frame o of a plain convolution reads input frame ``o·stride - pad + m·dil``
through tap m. A transposed convolution is split into ``stride`` phases (the output frames
``o = q·stride + ph``): within a phase it is a plain convolution over q whose tap m reads input
frame ``q + c0(ph) - m`` with weight tap ``j0(ph) + m·stride``, ``j0 = (ph + pad) mod stride``.
The weights are packed once, on the host, as (phases, taps, C_out, C_in) (a transposed
convolution's missing taps are zeros and their loads are masked).

One program computes BLOCK_M output frames of one batch row × BLOCK_N output channels, reducing
over taps × C_in in a fixed order: a row's result does not depend on the batch around it
(bitwise batch invariance by construction; the tile shapes depend only on the layer).

The epilogue applies, in this order and each optional (``elementwise.combine`` / ``accumulate``
semantics, float32 math on the float32 accumulator):
``s = conv + bias``; ``s = s + r``; ``s = acc + s``; ``s = a[o or reflected o] + s``;
``s = act(s / divisor)`` (leaky-ReLU or ELU); store ``s``; store K Snake outputs
``s + inv_k · sin(alpha_k · s)²``.

Operand precision (``dot``): "ieee" / "tf32" for float32 operands; 16-bit operands (float16 or
bfloat16 weights; the input cast to them) always multiply exactly with float32 accumulation.
With "tf32" every operand is rounded to TF32 (round to nearest even) before the tensor cores see
it (they would truncate): the weights when packed, the input as it is loaded or, cheaper, by the
epilogue that produced it (``round_out``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ._launch import on_device
from .vocoder_elementwise import MAX_SNAKES, store_snakes, tf32_rne
from .vocoder_tiles import ConvTiles, conv_tiles, family, layer_key

__all__ = ["pack_conv_weight", "PackedConv", "conv_fused_triton", "launch_key", "round_tf32"]

ACT_NONE, ACT_LEAKY, ACT_ELU = 0, 1, 2


@triton.jit
def _vocoder_conv_kernel(
    x_ptr, w_ptr, bias_ptr,          # (B, L_in, C_in); (PHASES, TAPS, C_out, C_in); (C_out,) float32
    r_ptr, acc_ptr, a_ptr,           # (B, L_out, C_out) addends; a: (B, L_a, C_out)
    s_ptr, y_ptr, y_stride,          # (B, L_out, C_out) sum [STORE_S]; (K, B, L_out, C_out) Snakes
    alpha_ptr, inv_ptr,              # (K, C_out) float32
    L_in, L_out, L_a, C_in, C_out, Q,  # Q: output frames per phase
    STRIDE, PAD, DIL, KSIZE, divisor, slope,
    PHASES: tl.constexpr, TAPS: tl.constexpr, TRANSPOSED: tl.constexpr, DOT: tl.constexpr,
    ROUND_A: tl.constexpr, ROUND_OUT: tl.constexpr, HAS_BIAS: tl.constexpr, ADD_R: tl.constexpr, ADD_ACC: tl.constexpr,
    ADD_A: tl.constexpr, REFLECT: tl.constexpr, ACT: tl.constexpr, DIVIDE: tl.constexpr,
    STORE_S: tl.constexpr, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tiles_q = tl.cdiv(Q, BLOCK_M)
    pid = tl.program_id(0)
    b = pid // (PHASES * tiles_q)
    rem = pid % (PHASES * tiles_q)
    ph = rem // tiles_q
    q = (rem % tiles_q) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < C_out
    if TRANSPOSED:
        j0 = (ph + PAD) % STRIDE
        base = q + (ph + PAD - j0) // STRIDE
    else:
        j0 = 0
        base = q * STRIDE - PAD
    x_row = x_ptr + b.to(tl.int64) * L_in * C_in
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    kb = tl.cdiv(C_in, BLOCK_K)
    for it in range(TAPS * kb):
        m = it // kb
        ci = (it % kb) * BLOCK_K + tl.arange(0, BLOCK_K)
        if TRANSPOSED:
            idx = base - m
            row_ok = (idx >= 0) & (idx < L_in) & (idx * 0 + j0 + m * STRIDE < KSIZE)
        else:
            idx = base + m * DIL
            row_ok = (idx >= 0) & (idx < L_in)
        ci_ok = ci < C_in
        a = tl.load(x_row + idx[:, None] * C_in + ci[None, :], mask=row_ok[:, None] & ci_ok[None, :], other=0.0)
        # K-major weight rows: 16-byte copies, and the layout TF32 tensor-core operands need
        w = tl.trans(tl.load(w_ptr + ((ph * TAPS + m) * C_out + n)[:, None] * C_in + ci[None, :],
                             mask=n_ok[:, None] & ci_ok[None, :], other=0.0))
        if ROUND_A:
            a = tf32_rne(a.to(tl.float32))
        a = a.to(w.dtype)
        acc = tl.dot(a, w, acc, input_precision=DOT)
    # ---- epilogue on output frames o
    o = q * PHASES + ph if TRANSPOSED else q
    ok = (o < L_out)[:, None] & n_ok[None, :]
    # a 64-bit base per batch row and 32-bit offsets within it: a 2-D tensor of 64-bit offsets
    # costs two registers per element and spilled the epilogue
    row = b.to(tl.int64) * L_out * C_out
    offs = o[:, None] * C_out + n[None, :]
    s = acc
    if HAS_BIAS:
        s = s + tl.load(bias_ptr + n, mask=n_ok, other=0.0)[None, :]
    if ADD_R:
        s = s + tl.load(r_ptr + row + offs, mask=ok, other=0.0).to(tl.float32)
    if ADD_ACC:
        s = tl.load(acc_ptr + row + offs, mask=ok, other=0.0).to(tl.float32) + s
    if ADD_A:
        if REFLECT:  # output frame o reads frame o - 1 of a, frame 0 reads frame 1
            src = tl.where(o == 0, 1, o - 1)
        else:
            src = o
        a_row = a_ptr + b.to(tl.int64) * L_a * C_out
        s = tl.load(a_row + src[:, None] * C_out + n[None, :], mask=ok, other=0.0).to(tl.float32) + s
    if DIVIDE:
        s = tl.div_rn(s, divisor)  # IEEE division, as torch (``/`` is approximate on the GPU)
    if ACT == 1:
        s = tl.where(s > 0, s, s * slope)
    if ACT == 2:
        s = tl.where(s > 0, s, slope * (tl.exp(s) - 1.0))
    if STORE_S:
        if ROUND_OUT and ACT != 0:  # an activation feeds the next convolution only
            tl.store(s_ptr + row + offs, tf32_rne(s).to(s_ptr.dtype.element_ty), mask=ok)
        else:
            tl.store(s_ptr + row + offs, s.to(s_ptr.dtype.element_ty), mask=ok)
    store_snakes(s, y_ptr + row, y_stride, offs, ok, alpha_ptr, inv_ptr, n, n_ok, C_out, K, ROUND_OUT)


def round_tf32(t: torch.Tensor) -> torch.Tensor:
    """float32 values rounded to the nearest TF32 (ties to even), as float32 (host or device)."""
    bits = t.float().contiguous().view(torch.int32)
    finite = (bits & 0x7F800000) != 0x7F800000
    rounded = (bits + 0xFFF + ((bits >> 13) & 1)) & -8192
    return torch.where(finite, rounded, bits).view(torch.float32)


@dataclass
class PackedConv:
    """A convolution's geometry and its weights packed for the kernel (see the module docstring)."""

    weight: torch.Tensor  # (phases, taps, C_out, C_in)
    bias: Optional[torch.Tensor]  # (C_out,) float32
    c_in: int
    c_out: int
    ksize: int
    stride: int
    padding: int
    dilation: int
    output_padding: int
    transposed: bool
    padding_right: Optional[int] = None  # None: ``padding`` on both sides (a causal convolution: 0)

    def out_frames(self, frames: int) -> int:
        pads = self.padding + (self.padding if self.padding_right is None else self.padding_right)
        if self.transposed:
            return (frames - 1) * self.stride - pads + self.dilation * (self.ksize - 1) + self.output_padding + 1
        return (frames + pads - self.dilation * (self.ksize - 1) - 1) // self.stride + 1


def pack_conv_weight(weight: torch.Tensor, bias: Optional[torch.Tensor], *, transposed: bool, stride: int,
                     padding: int, dilation: int, output_padding: int, dtype: torch.dtype,
                     tf32: bool, padding_right: Optional[int] = None) -> PackedConv:
    """Pack a Conv1d weight (C_out, C_in, k) or a ConvTranspose1d weight (C_in, C_out, k).

    ``dtype`` is the operand dtype (float32, float16, bfloat16); with ``tf32`` float32 weights
    are rounded to TF32 once here. Groups are not supported (the HiFT uses none). ``padding`` is
    the left one (the frames a transposed convolution crops on the left), ``padding_right`` the
    right one (default: ``padding``): a left-causal convolution has (dilation · (k - 1), 0).
    """
    w = weight.detach().double()
    if transposed:
        if dilation != 1:
            raise NotImplementedError("vocoder_conv: not supported yet: a dilated transposed convolution")
        c_in, c_out, k = w.shape
        taps = -(-k // stride)
        packed = w.new_zeros(stride, taps, c_out, c_in)
        for ph in range(stride):
            j0 = (ph + padding) % stride
            for m in range(taps):
                if j0 + m * stride < k:
                    packed[ph, m] = w[:, :, j0 + m * stride].t()
    else:
        c_out, c_in, k = w.shape
        packed = w.permute(2, 0, 1)[None]  # (1, k, C_out, C_in)
    packed = packed.to(weight.dtype).to(dtype).contiguous()
    if tf32 and dtype == torch.float32:
        packed = round_tf32(packed)
    b = None if bias is None else bias.detach().float().contiguous()
    return PackedConv(packed, b, c_in, c_out, k, stride, padding, dilation, output_padding, transposed, padding_right)


def launch_key(conv: PackedConv, q: int, dot: str) -> tuple:
    """The :mod:`.vocoder_tiles` key of a launch of ``conv`` with ``q`` output frames per phase."""
    return layer_key(family(conv.weight.dtype, dot), conv.c_in, conv.c_out, conv.weight.shape[1],
                     conv.weight.shape[0], q)


def conv_fused_triton(conv: PackedConv, x: torch.Tensor, *, dot: str, r=None, acc=None, a=None, reflect=False,
                      divisor=None, act: int = ACT_NONE, slope: float = 0.0, store_s: bool = False,
                      s_dtype: torch.dtype = torch.float32, alpha=None, inv=None,
                      y_dtype: torch.dtype = torch.float32, round_input: bool = True,
                      round_out: bool = False, tiles: Optional[ConvTiles] = None,
                      ) -> tuple[Optional[torch.Tensor], list[torch.Tensor]]:
    """The fused convolution (module docstring) on x (B, L_in, C_in).

    Returns (s (B, L_out, C_out) in ``s_dtype`` or None, [K Snake outputs (B, L_out, C_out) in
    ``y_dtype``]). ``dot``: "ieee" or "tf32" (float32 weights), ignored for 16-bit weights. With
    "tf32", ``round_input`` rounds x to TF32 as it is loaded (not needed where x's producer
    rounded it) and ``round_out`` rounds the outputs meant for the next convolution (the Snake
    outputs and an activated ``s``) when they are float32. ``tiles``: launch parameters in place of
    the tuning table's (:func:`~torch_cfm.kernels.vocoder_tiles.conv_tiles`; benches and tests).
    """
    x = x.contiguous()
    batch, frames, c_in = x.shape
    if c_in != conv.c_in:
        raise ValueError(f"conv_fused_triton: x has {c_in} channels, the convolution {conv.c_in}")
    l_out = conv.out_frames(frames)
    phases = conv.stride if conv.transposed else 1
    q = -(-l_out // phases)
    count = 0 if alpha is None else alpha.shape[0]
    if count > MAX_SNAKES:
        raise NotImplementedError(f"vocoder_conv: not supported yet: {count} Snake outputs (max {MAX_SNAKES})")
    dev = x.device
    s = torch.empty(batch, l_out, conv.c_out, device=dev, dtype=s_dtype) if store_s else None
    y = torch.empty(max(count, 1), batch, l_out, conv.c_out, device=dev, dtype=y_dtype) if count else None
    al = alpha.float().contiguous() if count else conv.weight
    iv = inv.float().contiguous() if count else conv.weight
    for name, t in (("r", r), ("acc", acc)):
        if t is not None and tuple(t.shape) != (batch, l_out, conv.c_out):
            raise ValueError(f"conv_fused_triton: {name} must be {(batch, l_out, conv.c_out)}, got {tuple(t.shape)}")
    if a is not None:
        want = (batch, l_out - 1 if reflect else l_out, conv.c_out)
        if tuple(a.shape) != want or (reflect and l_out < 3):
            raise ValueError(f"conv_fused_triton: a must be {want} (reflect: at least 2 frames), got {tuple(a.shape)}")
    r, acc, a = [None if t is None else t.contiguous() for t in (r, acc, a)]
    tiles = tiles if tiles is not None else conv_tiles(launch_key(conv, q, dot))
    grid = (batch * phases * triton.cdiv(q, tiles.block_m), triton.cdiv(conv.c_out, tiles.block_n))
    is32 = conv.weight.dtype == torch.float32
    dummy = x
    with on_device(dev):
        _vocoder_conv_kernel[grid](
            x, conv.weight, conv.bias if conv.bias is not None else dummy,
            r if r is not None else dummy, acc if acc is not None else dummy, a if a is not None else dummy,
            s if s is not None else dummy, y if y is not None else dummy, batch * l_out * conv.c_out,
            al, iv, frames, l_out, a.shape[1] if a is not None else l_out, c_in, conv.c_out, q,
            conv.stride, conv.padding, conv.dilation, conv.ksize,
            float(divisor) if divisor is not None else 1.0, float(slope),
            PHASES=phases, TAPS=conv.weight.shape[1], TRANSPOSED=conv.transposed,
            DOT=dot if is32 else None, ROUND_A=is32 and dot == "tf32" and round_input,
            ROUND_OUT=is32 and dot == "tf32" and round_out, HAS_BIAS=conv.bias is not None,
            ADD_R=r is not None, ADD_ACC=acc is not None, ADD_A=a is not None, REFLECT=bool(reflect),
            ACT=int(act), DIVIDE=divisor is not None, STORE_S=store_s, K=count,
            BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, num_warps=tiles.warps,
            num_stages=tiles.stages)
    return s, ([] if y is None else [y[k] for k in range(count)])
