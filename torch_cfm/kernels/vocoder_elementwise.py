"""The vocoder's fused elementwise steps (``torch_cfm.models.vocoder.elementwise``) as Triton kernels.

Frame-major (B, L, C) tensors, channels innermost, viewed as (M = B·L, C) rows. One program
handles BLOCK_M rows × all C channels (BLOCK_C = C rounded up to a power of 2, C <= 1024);
float32 math; every pointer's element type is its tensor's (inputs and outputs of any float
dtype but float64).

* ``_vocoder_combine_kernel``: ``v = a[reflected row] (+ b | + (b + c))``, optionally stored,
  and K Snake outputs ``v + inv_k · sin(alpha_k · v)²`` (K <= 4).
* ``_vocoder_accumulate_kernel``: ``s = t (+ r)``, ``(acc +) s``, optionally ``leaky(s / div)``.

And one channel-major kernel, for the models that keep the upstream (B, C, T) layout (the causal
HiFT): ``_snake_channels_kernel``, one Snake ``x + inv_c · sin(alpha_c · x)²`` per element.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._launch import on_device

__all__ = ["combine_triton", "accumulate_triton", "snake_channels_triton", "sin_squared", "store_snakes", "tf32_rne",
           "MAX_SNAKES"]

MAX_SNAKES = 4
_TILE = 4096  # elements per program


@triton.jit
def tf32_rne(x):
    """float32 -> float32 holding the nearest TF32 value (ties to even); inf / NaN unchanged."""
    bits = x.to(tl.int32, bitcast=True)
    finite = (bits & 0x7F800000) != 0x7F800000
    rounded = (bits + 0xFFF + ((bits >> 13) & 1)) & -8192  # clear the 13 low mantissa bits
    return tl.where(finite, rounded, bits).to(tl.float32, bitcast=True)


# pi / 2 in three parts, the first two short enough that j times each is exact for |j| < 2^15: the
# remainder y - j pi / 2 by fused multiply-adds is then within an ulp of the exact one for |y| up to
# about 5e4 (libdevice's sinf reduces the same way up to 105615, then runs a Payne-Hanek reduction:
# code that tripled the fused convolutions' registers and left a stack frame in every one).
_PIO2_HI = tl.constexpr(1.5703125)
_PIO2_MID = tl.constexpr(4.837512969970703125e-4)
_PIO2_LO = tl.constexpr(7.54978995489188216e-8)


@triton.jit
def sin_squared(y):
    """sin(y)² of float32 y: y reduced by the nearest multiple j of pi / 2 (three-part Cody-Waite), then
    Cephes' single-precision sine and cosine polynomials on [-pi / 4, pi / 4] (sin² for even j, cos² for
    odd). Absolute error against float64 at most 2e-7 for |y| < 1e5 (float32 ``torch.sin(y) ** 2``:
    about 1.2e-7; ``tests/test_vocoder_elementwise.py``); NaN for non-finite y, as torch.sin."""
    j = tl.floor(y * 0.6366197723675814 + 0.5)
    r = tl.fma(j, -_PIO2_HI, y)
    r = tl.fma(j, -_PIO2_MID, r)
    r = tl.fma(j, -_PIO2_LO, r)
    z = r * r
    sin_r = ((-1.9515295891e-4 * z + 8.3321608736e-3) * z - 1.6666654611e-1) * z * r + r
    cos_r = ((2.443315711809948e-5 * z - 1.388731625493765e-3) * z + 4.166664568298827e-2) * z * z - 0.5 * z + 1.0
    half = j * 0.5
    return tl.where(half != tl.floor(half), cos_r * cos_r, sin_r * sin_r)


@triton.jit
def store_snakes(v, y_ptr, y_stride, offs, ok, alpha_ptr, inv_ptr, cols, col_ok, C, K: tl.constexpr,
                 ROUND: tl.constexpr):
    """Store ``v + inv_k · sin(alpha_k · v)²`` for k < K at ``y_ptr + k · y_stride + offs``
    (rounded to TF32 first with ``ROUND``); alpha / inv are (K, C) float32."""
    out = y_ptr + offs  # advanced by y_stride per output: no k · y_stride product to overflow int32
    for k in tl.range(K, loop_unroll_factor=1):
        alpha = tl.load(alpha_ptr + k * C + cols, mask=col_ok, other=0.0)[None, :]
        inv = tl.load(inv_ptr + k * C + cols, mask=col_ok, other=0.0)[None, :]
        y = v + inv * sin_squared(v * alpha)
        if ROUND:
            y = tf32_rne(y)
        tl.store(out, y.to(y_ptr.dtype.element_ty), mask=ok)
        out += y_stride


@triton.jit
def _vocoder_combine_kernel(
    a_ptr, b_ptr, c_ptr,        # (M_a, C) first input [reflected rows]; (M, C) addends [N_ADD >= 1, 2]
    v_ptr,                      # (M, C) sum, written [STORE_V]
    y_ptr, y_stride,            # (K, M, C) Snake outputs; elements between two of them
    alpha_ptr, inv_ptr,         # (K, C) float32 Snake parameters
    M, C, L,                    # rows, channels, frames per batch row of the output
    N_ADD: tl.constexpr, REFLECT: tl.constexpr, STORE_V: tl.constexpr, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_C)
    col_ok = cols < C
    ok = (rows < M)[:, None] & col_ok[None, :]
    offs = rows[:, None] * C + cols[None, :]
    if REFLECT:  # output frame l reads input frame l - 1, frame 0 reads input frame 1
        frame = rows % L
        src = (rows // L) * (L - 1) + tl.where(frame == 0, 1, frame - 1)
        a_offs = src[:, None] * C + cols[None, :]
    else:
        a_offs = offs
    v = tl.load(a_ptr + a_offs, mask=ok, other=0.0).to(tl.float32)
    if N_ADD == 1:
        v = v + tl.load(b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if N_ADD == 2:
        v = v + (tl.load(b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
                 + tl.load(c_ptr + offs, mask=ok, other=0.0).to(tl.float32))
    if STORE_V:
        tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=ok)
    store_snakes(v, y_ptr, y_stride, offs, ok, alpha_ptr, inv_ptr, cols, col_ok, C, K, False)


@triton.jit
def _vocoder_accumulate_kernel(
    t_ptr, r_ptr, acc_ptr,      # (M, C) inputs; r [HAS_R], acc [HAS_ACC]
    out_ptr,                    # (M, C) result
    M, C, divisor, slope,       # leaky_relu(s / divisor, slope) [FINAL]
    HAS_R: tl.constexpr, HAS_ACC: tl.constexpr, FINAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_C)
    ok = (rows < M)[:, None] & (cols < C)[None, :]
    offs = rows[:, None] * C + cols[None, :]
    s = tl.load(t_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_R:
        s = s + tl.load(r_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_ACC:
        s = tl.load(acc_ptr + offs, mask=ok, other=0.0).to(tl.float32) + s
    if FINAL:
        s = tl.div_rn(s, divisor)  # IEEE division, as torch (``/`` is approximate on the GPU)
        s = tl.where(s > 0, s, s * slope)
    tl.store(out_ptr + offs, s.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _snake_channels_kernel(
    x_ptr, y_ptr,               # (B, C, T): x with strides (stride_b, stride_c, 1), y contiguous
    alpha_ptr, inv_ptr,         # (C,) float32 Snake parameters
    stride_b, stride_c, C, T,
    BLOCK_T: tl.constexpr,
):
    row = tl.program_id(0)      # b·C + c
    c = row % C
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = t < T
    x = tl.load(x_ptr + ((row // C).to(tl.int64) * stride_b + c.to(tl.int64) * stride_c + t), mask=ok,
                other=0.0).to(tl.float32)
    alpha = tl.load(alpha_ptr + c)
    inv = tl.load(inv_ptr + c)
    tl.store(y_ptr + (row.to(tl.int64) * T + t), (x + inv * sin_squared(x * alpha)).to(y_ptr.dtype.element_ty),
             mask=ok)


def _tiles(rows: int, channels: int) -> tuple[int, int, tuple[int]]:
    block_c = triton.next_power_of_2(channels)
    if block_c > 1024:
        raise NotImplementedError(f"vocoder elementwise kernels: not supported yet: {channels} channels (max 1024)")
    block_m = max(1, _TILE // block_c)
    return block_m, block_c, (triton.cdiv(rows, block_m),)


def _flat(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.contiguous()


def combine_triton(a: torch.Tensor, b: Optional[torch.Tensor], c: Optional[torch.Tensor],
                   alpha: Optional[torch.Tensor], inv: Optional[torch.Tensor], reflect: bool, keep_sum: bool,
                   out_dtype: torch.dtype) -> tuple[Optional[torch.Tensor], list[torch.Tensor]]:
    """Host launcher of ``_vocoder_combine_kernel``; arguments as ``elementwise.combine``."""
    batch, frames_a, channels = a.shape
    frames = frames_a + 1 if reflect else frames_a
    count = 0 if alpha is None else alpha.shape[0]
    if count > MAX_SNAKES:
        raise NotImplementedError(f"combine_triton: not supported yet: {count} Snake outputs (max {MAX_SNAKES})")
    a, b, c = _flat(a), _flat(b), _flat(c)
    rows = batch * frames
    v = torch.empty(batch, frames, channels, device=a.device, dtype=torch.float32) if keep_sum else None
    y = torch.empty(max(count, 1), batch, frames, channels, device=a.device, dtype=out_dtype)
    params = torch.empty(2, 1, channels, device=a.device, dtype=torch.float32) if count == 0 else None
    al = params[0] if count == 0 else alpha.float().contiguous()
    iv = params[1] if count == 0 else inv.float().contiguous()
    block_m, block_c, grid = _tiles(rows, channels)
    n_add = 0 if b is None else (1 if c is None else 2)
    with on_device(a.device):
        _vocoder_combine_kernel[grid](
            a, b if b is not None else a, c if c is not None else a, v if v is not None else y, y,
            rows * channels, al, iv, rows, channels, frames,
            N_ADD=n_add, REFLECT=bool(reflect), STORE_V=keep_sum, K=count,
            BLOCK_M=block_m, BLOCK_C=block_c, num_warps=4)
    return v, [y[k] for k in range(count)]


def accumulate_triton(t: torch.Tensor, r: Optional[torch.Tensor], acc: Optional[torch.Tensor],
                      divisor: Optional[float], slope: Optional[float], out_dtype: torch.dtype) -> torch.Tensor:
    """Host launcher of ``_vocoder_accumulate_kernel``; arguments as ``elementwise.accumulate``."""
    t, r, acc = _flat(t), _flat(r), _flat(acc)
    batch, frames, channels = t.shape
    out = torch.empty(batch, frames, channels, device=t.device, dtype=out_dtype)
    rows = batch * frames
    block_m, block_c, grid = _tiles(rows, channels)
    final = divisor is not None
    with on_device(t.device):
        _vocoder_accumulate_kernel[grid](
            t, r if r is not None else t, acc if acc is not None else t, out, rows, channels,
            float(divisor) if final else 1.0, float(slope) if final and slope is not None else 0.0,
            HAS_R=r is not None, HAS_ACC=acc is not None, FINAL=final,
            BLOCK_M=block_m, BLOCK_C=block_c, num_warps=4)
    return out


def snake_channels_triton(x: torch.Tensor, alpha: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """Host launcher of ``_snake_channels_kernel``; arguments as ``elementwise.snake_channels``. ``x`` may
    be a view with strided batch and channel axes (a slice of a longer convolution output: no copy),
    the output is contiguous."""
    if x.stride(2) != 1:
        x = x.contiguous()
    batch, channels, frames = x.shape
    y = torch.empty((batch, channels, frames), device=x.device, dtype=x.dtype)
    if x.numel() == 0:
        return y
    block_t = min(1024, max(16, triton.next_power_of_2(frames)))
    grid = (batch * channels, triton.cdiv(frames, block_t))
    with on_device(x.device):
        _snake_channels_kernel[grid](x, y, alpha.float().reshape(-1).contiguous(), inv.float().reshape(-1).contiguous(),
                                     x.stride(0), x.stride(1), channels, frames, BLOCK_T=block_t,
                                     num_warps=4 if block_t >= 512 else 1)
    return y
