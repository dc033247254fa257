"""Issue 43: the vocoder's dilated convolution with its input window in shared memory (experiment; the
shipped kernel is ``torch_cfm.kernels.vocoder_conv``).

The shipped implicit GEMM runs taps outer and reloads its shifted (BLOCK_M, BLOCK_K) input tile from
L2 for every tap; Nsight Compute puts it at 77-80 % of L2 throughput and 47-54 % of SM throughput
(``vocoder_conv_ncu.md``). Holding the window in registers lost 2-5 x (``vocoder_conv_halo.md``).
Four kernels here (results: ``vocoder_conv_smem.md``), all the plain stride-1 "same" convolution with bias, frame-major (B, L, C),
operands float32 rounded to TF32 (products exact, float32 sums) or float16:

- ``per_tap``: the shipped structure (Triton; taps outer, pipelined ``cp.async.cg`` loads that bypass L1).
- ``taps_inner``: Triton, channel blocks outer and taps inner, one stage: each tap's tile is an
  ``ld.global`` through L1 that the previous tap mostly loaded (Triton's pipelined copies of 16
  bytes are always ``.cg``, so L1 reuse needs the unpipelined form).
- ``wgmma``: CUDA (``vocoder_conv_wgmma.cu``): the window in shared memory with a per-row XOR swizzle,
  each tap's A operand ldmatrix-loaded from rows shifted by ``m·DIL`` (one address per lane, so any
  shift stays conflict-free), wgmma with A in registers and the weights through a descriptor.
- ``window``: Gluon, the same plan in Triton's layouts. Per channel block, one (WIN, BLOCK_K) window
  goes to shared memory with ``cp.async`` (double-buffered); each tap's A operand is a view of it
  shifted by ``m·DIL`` rows loaded into wgmma's register layout, B the tap's weight tile in an
  NVMMA-swizzled ring of STAGES slots; wgmma asynchronous, one in flight. Triton 3.6 allows no
  subslice at an offset that is not a multiple of its size (the view is an index reinterpreted) and
  lowers no padded shared layout on NVIDIA, and a swizzle's phase cannot follow a shift that is not a
  multiple of 8 rows: the window is unswizzled, and its ldmatrix reads conflict 8 ways.
  Both shared-memory kernels read the input from L2 WIN / (TAPS·BLOCK_M) as often as ``per_tap``.

    PYTHONPATH=/tmp/tri36 python3 bench/experiments/vocoder_conv_smem.py --compile   # CPU: sm_90 resources
    TRITON_INTERPRET=1 python3 bench/experiments/vocoder_conv_smem.py --check        # CPU: Triton kernels
    python3 bench/experiments/vocoder_conv_smem.py --out "$OUT" [--quick] [--lib libconvw.so]  # GPU: the HiFT's shapes

The GPU run checks every kernel against float64 at every shape (relative Frobenius error; a kernel
over 1e-5 (TF32) / 2e-3 (fp16) is not timed), then times each (``_harness.time_cuda_graph``: a CUDA
graph of 10 launches, median of replays) at 64 streams x 58 frames: the HiFT's ResBlock convolutions (C = 256 / 128 / 64 at 464 /
2,320 / 6,960 frames, k = 3 / 7 / 11, d = 1 / 3 / 5), tiles swept over a few candidates, and
writes ``vocoder_conv_smem.json`` (rows with provenance).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import async_copy, warpgroup_mma, warpgroup_mma_wait
except ImportError:  # a Triton without Gluon: the Triton kernels only
    gluon = None

# ---------------------------------------------------------------------------------------------- Triton


@triton.jit
def _weights(w_ptr, m, n, ci, C_in, C_out):
    """Tap m's (BLOCK_K, BLOCK_N) weight tile, K-major rows loaded (weights packed (taps, C_out, C_in))."""
    return tl.trans(tl.load(w_ptr + (m * C_out + n)[:, None] * C_in + ci[None, :],
                            mask=(n < C_out)[:, None] & (ci < C_in)[None, :], other=0.0))


@triton.jit
def _store(acc, b_ptr, y_ptr, b, o, n, L, C_out):
    """acc + bias into rows o, channels n of batch row b of y (B, L, C_out)."""
    acc += tl.load(b_ptr + n, mask=n < C_out, other=0.0)[None, :]
    ok = (o < L)[:, None] & (n < C_out)[None, :]
    tl.store(y_ptr + b.to(tl.int64) * L * C_out + o[:, None] * C_out + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=ok)


@triton.jit
def _conv_triton(x_ptr, w_ptr, b_ptr, y_ptr, L, C_in, C_out, PAD, DIL,
                 TAPS: tl.constexpr, DOT: tl.constexpr, TAPS_INNER: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """per_tap (TAPS_INNER false: the shipped loop order) or taps_inner."""
    tiles = tl.cdiv(L, BLOCK_M)
    b, t = tl.program_id(0) // tiles, tl.program_id(0) % tiles
    o = t * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    x_row = x_ptr + b.to(tl.int64) * L * C_in
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    kb = tl.cdiv(C_in, BLOCK_K)
    for it in range(TAPS * kb):
        if TAPS_INNER:
            m = it % TAPS
            ci = (it // TAPS) * BLOCK_K + tl.arange(0, BLOCK_K)
        else:
            m = it // kb
            ci = (it % kb) * BLOCK_K + tl.arange(0, BLOCK_K)
        idx = o - PAD + m * DIL
        a = tl.load(x_row + idx[:, None] * C_in + ci[None, :],
                    mask=((idx >= 0) & (idx < L))[:, None] & (ci < C_in)[None, :], other=0.0)
        w = _weights(w_ptr, m, n, ci, C_in, C_out)
        acc = tl.dot(a, w, acc, input_precision=DOT)
    _store(acc, b_ptr, y_ptr, b, o, n, L, C_out)


# ----------------------------------------------------------------------------------------------- Gluon

if gluon is not None:
    @gluon.jit
    def _rows(win, first, ROWS: gl.constexpr):
        """Rows [first, first + ROWS) of the (2·WIN, 1, BLOCK_K) unswizzled window buffers as a (ROWS, BLOCK_K)
        view: a subslice's offset must be a multiple of its size, so the view is row ``first`` (an index,
        any value) reinterpreted with ROWS rows. (Triton 3.6 lowers no padded shared layout on NVIDIA, and
        a swizzle's phase would not follow a shift that is not a multiple of its period.)"""
        return win.index(first)._reinterpret(win.dtype, [ROWS, win.shape[2]], win.type.layout)

    @gluon.jit
    def _issue(x_row, w_ptr, win, wring, step, cb, L, C_in, C_out, frame0, n0, kb,
               TAPS: gl.constexpr, STAGES: gl.constexpr, LOAD_WINDOW: gl.constexpr, WIN_ROWS: gl.constexpr,
               WIN: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, ld: gl.constexpr):
        """One commit group: tap ``step % TAPS`` of channel block ``cb``'s weight tile into ring slot
        ``step % STAGES`` and, with LOAD_WINDOW, block cb's input window into window buffer cb % 2 (rows
        past WIN_ROWS, outside [0, L) or past C_in are zero-filled; nothing past the last block loads)."""
        live = cb < kb
        ci = cb * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, ld))
        ci_ok = (ci < C_in) & live
        if LOAD_WINDOW:
            r = gl.arange(0, WIN, layout=gl.SliceLayout(1, ld))
            h = frame0 + r
            row_ok = (r < WIN_ROWS) & (h >= 0) & (h < L)
            async_copy.async_copy_global_to_shared(_rows(win, (cb % 2) * WIN, WIN),
                                                   x_row + h[:, None] * C_in + ci[None, :],
                                                   mask=row_ok[:, None] & ci_ok[None, :])
        m = step % TAPS
        n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
        async_copy.async_copy_global_to_shared(wring.index(step % STAGES),
                                               w_ptr + (m * C_out + n)[:, None] * C_in + ci[None, :],
                                               mask=(n < C_out)[:, None] & ci_ok[None, :])
        async_copy.commit_group()

    @gluon.jit
    def _conv_window(x_ptr, w_ptr, b_ptr, y_ptr, L, C_in, C_out, PAD,
                     TAPS: gl.constexpr, DIL: gl.constexpr, STAGES: gl.constexpr, WIN: gl.constexpr,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                     num_warps: gl.constexpr):
        """The window kernel (module docstring). Step s = cb·TAPS + m; group s carries step s's weight tile
        (and block cb's window when m = 0); STAGES - 1 groups run ahead of the step being computed."""
        gl.static_assert(STAGES - 1 <= TAPS, "the prologue holds the first block's taps only")
        dtype: gl.constexpr = x_ptr.dtype.element_ty
        WIN_ROWS: gl.constexpr = BLOCK_M + (TAPS - 1) * DIL
        VEC: gl.constexpr = 128 // dtype.primitive_bitwidth
        ld: gl.constexpr = gl.BlockedLayout([1, VEC], [32 * VEC // BLOCK_K, BLOCK_K // VEC], [num_warps, 1], [1, 0])
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, BLOCK_N, 256 // dtype.primitive_bitwidth])
        a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=32 // dtype.primitive_bitwidth)
        win_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], dtype)
        win = gl.allocate_shared_memory(dtype, [2 * WIN, 1, BLOCK_K], win_layout)
        wring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], w_layout)

        tiles = gl.cdiv(L, BLOCK_M)
        b = gl.program_id(0) // tiles
        t = gl.program_id(0) % tiles
        frame0 = t * BLOCK_M - PAD
        n0 = gl.program_id(1) * BLOCK_N
        x_row = x_ptr + b.to(gl.int64) * L * C_in
        kb = gl.cdiv(C_in, BLOCK_K)

        for s in gl.static_range(STAGES - 1):  # prologue: steps 0 .. STAGES - 2 (all of block 0)
            _issue(x_row, w_ptr, win, wring, s, s // TAPS, L, C_in, C_out, frame0, n0, kb, TAPS, STAGES,
                   s % TAPS == 0, WIN_ROWS, WIN, BLOCK_N, BLOCK_K, ld)
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma)
        for cb in range(kb):
            for m in gl.static_range(TAPS):
                step = cb * TAPS + m
                async_copy.wait_group(STAGES - 2)  # step's group has landed
                a = _rows(win, (cb % 2) * WIN + m * DIL, BLOCK_M).load(a_op)
                w = wring.index(step % STAGES).permute((1, 0))
                acc = warpgroup_mma(a, w, acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))  # step - 1's slot is free
                # the step issued now, m + STAGES - 1 taps ahead: in block cb or the next
                _issue(x_row, w_ptr, win, wring, step + STAGES - 1, cb + (m + STAGES - 1) // TAPS, L, C_in, C_out,
                       frame0, n0, kb, TAPS, STAGES, (m + STAGES - 1) % TAPS == 0, WIN_ROWS, WIN, BLOCK_N, BLOCK_K,
                       ld)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        async_copy.wait_group(0)

        o = t * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma))
        n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
        acc = acc + gl.load(b_ptr + n, mask=n < C_out, other=0.0)[None, :]
        ok = (o < L)[:, None] & (n < C_out)[None, :]
        gl.store(y_ptr + b.to(gl.int64) * L * C_out + o[:, None] * C_out + n[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=ok)


# ------------------------------------------------------------------------------------------- launching

KINDS = ("per_tap", "taps_inner", "window", "wgmma")
_LIB = {}


def wgmma_lib(path=None):
    """``vocoder_conv_wgmma.cu`` as a ctypes library: ``path`` (a build carried here) or built with nvcc."""
    if "lib" not in _LIB:
        import ctypes
        import subprocess
        import tempfile

        if path is None:
            path = os.path.join(tempfile.mkdtemp(), "libconvw.so")
            subprocess.run([os.environ.get("NVCC", "nvcc"), "-std=c++17", "-O3", "-gencode", "arch=compute_90a,code=sm_90a",
                            "-shared", "-Xcompiler", "-fPIC", "-o", path, os.path.join(HERE, "vocoder_conv_wgmma.cu")],
                           check=True)
        lib = ctypes.CDLL(path)
        lib.conv_window.restype = ctypes.c_int
        lib.conv_window.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 8 + [ctypes.c_void_p]
        _LIB["lib"] = lib
    return _LIB["lib"]


def window_params(bm: int, taps: int, dil: int, dtype: torch.dtype) -> dict:
    win = triton.next_power_of_2(bm + (taps - 1) * dil)
    return dict(WIN=win)


def conv(kind: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, dil: int, tiles: tuple) -> torch.Tensor:
    """Conv1d of x (B, L, C_in) by w packed (taps, C_out, C_in), 'same' padding, stride 1: (B, L, C_out).
    ``tiles``: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)."""
    batch, frames, c_in = x.shape
    taps, c_out, _ = w.shape
    bm, bn, bk, warps, stages = tiles
    pad = dil * (taps - 1) // 2
    y = torch.empty(batch, frames, c_out, device=x.device, dtype=x.dtype)
    grid = (batch * triton.cdiv(frames, bm), triton.cdiv(c_out, bn))
    if kind == "wgmma":
        rc = wgmma_lib().conv_window(x.data_ptr(), w.data_ptr(), bias.data_ptr(), y.data_ptr(), batch, frames, c_in,
                                     c_out, taps, dil, int(x.dtype == torch.float16), bn,
                                     torch.cuda.current_stream().cuda_stream)
        if rc:
            raise RuntimeError(f"conv_window: rc {rc}")
        return y
    if kind == "window":
        _conv_window[grid](x, w, bias, y, frames, c_in, c_out, pad, TAPS=taps, DIL=dil, STAGES=stages,
                           **window_params(bm, taps, dil, x.dtype), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                           num_warps=warps)
        return y
    dot = "tf32" if x.dtype == torch.float32 else None
    _conv_triton[grid](x, w, bias, y, frames, c_in, c_out, pad, dil, TAPS=taps, DOT=dot,
                       TAPS_INNER=kind == "taps_inner", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                       num_stages=stages)
    return y


def operands(batch, frames, c, taps, dtype, device, seed):
    from torch_cfm.kernels.vocoder_conv import round_tf32

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, frames, c, generator=g)
    w = torch.randn(taps, c, c, generator=g) / (c * taps) ** 0.5
    bias = 0.1 * torch.randn(c, generator=g)
    if dtype == torch.float32:
        x, w = round_tf32(x), round_tf32(w)
    return x.to(dtype).to(device), w.to(dtype).to(device), bias.to(device)


def reference(x, w, bias, dil):
    """float64 conv1d of the same (rounded) operands: (B, L, C_out)."""
    taps = w.shape[0]
    y = torch.nn.functional.conv1d(x.double().transpose(1, 2), w.double().permute(1, 2, 0), bias.double(),
                                   padding=dil * (taps - 1) // 2, dilation=dil)
    return y.transpose(1, 2)


def rel(a, b) -> float:
    return float((a.double() - b).norm() / b.norm())


BOUND = {torch.float32: 1e-5, torch.float16: 2e-3}


def check() -> int:
    """CPU interpreter: the Triton kernels against float64 at small shapes (odd sizes, masks, edges)."""
    bad = 0
    for (batch, frames, c, taps, dil, tiles) in [(2, 37, 24, 3, 1, (16, 16, 16, 4, 1)), (1, 50, 32, 7, 3, (16, 32, 16, 4, 1)),
                                                 (2, 29, 16, 11, 5, (16, 16, 16, 4, 1))]:
        for dtype in (torch.float32, torch.float16):
            x, w, bias = operands(batch, frames, c, taps, dtype, "cpu", seed=frames * taps + dil)
            ref = reference(x, w, bias, dil)
            for kind in ("per_tap", "taps_inner"):
                err = rel(conv(kind, x, w, bias, dil, tiles), ref)
                flag = "ok" if err <= BOUND[dtype] else "FAIL"
                bad += flag == "FAIL"
                print(f"{kind:10s} B={batch} L={frames} C={c} k={taps} d={dil} {str(dtype)[6:]:8s} err {err:.2e} {flag}")
    return 1 if bad else 0


def compile_only() -> int:
    """sm_90 compiles of the window kernel at the HiFT shapes (no GPU): registers, spills, shared memory."""
    sys.path.insert(0, os.path.dirname(HERE))
    from kernel_resources import compile_like_launch, describe

    for dtype, ty, bk in ((torch.float32, "*fp32", 32), (torch.float16, "*fp16", 64)):
        for bm, bn, warps, stages in ((64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 8, 3)):
            for taps, dil in ((3, 1), (7, 5), (11, 5)):
                consts = dict(TAPS=taps, DIL=dil, STAGES=stages, **window_params(bm, taps, dil, dtype),
                              BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
                args = dict(x_ptr=ty, w_ptr=ty, b_ptr="*fp32", y_ptr=ty, L=464 * 64, C_in=256, C_out=256, PAD=7)
                try:
                    compiled = compile_like_launch(_conv_window, args, consts, warps, 1, 90, gluon=True)
                    print(f"window {str(dtype)[6:]} m{bm}n{bn}k{bk}w{warps}s{stages} k={taps} d={dil}: {describe(compiled)}")
                except Exception as exc:  # noqa: BLE001
                    print(f"window {str(dtype)[6:]} m{bm}n{bn} k={taps} d={dil}: {type(exc).__name__}: {str(exc)[:2000]}")
                    return 1
    return 0


def candidates(kind: str, dtype: torch.dtype, quick: bool) -> list[tuple]:
    bk = 32 if dtype == torch.float32 else 64
    if kind == "per_tap":
        extra = [(128, 64, 64, 4, 3)] if dtype == torch.float16 else []
        return [(64, 64, 32, 4, 3), (128, 64, 32, 4, 3), (128, 128, 32, 8, 3)] + extra + ([] if quick else [(64, 64, 64, 4, 3)])
    if kind == "taps_inner":
        return [(64, 64, 32, 4, 1), (128, 64, 32, 4, 1)] + ([] if quick else [(64, 64, 32, 4, 3)])
    if kind == "wgmma":
        bk = 128 // torch.tensor([], dtype=dtype).element_size()  # fixed in the .cu, as are M, warps, stages
        return [(64, 64, bk, 4, 3), (64, 128, bk, 4, 3)]
    return [(64, 64, bk, 4, 3), (64, 128, bk, 4, 3), (128, 64, bk, 8, 3)] + ([] if quick else [(64, 64, bk, 4, 2)])


def gpu(out: str, streams: int, quick: bool, kinds: list) -> int:
    import _harness as H

    env = H.env_info()
    rows = []
    layers = [(taps, dil) for taps in (3, 7, 11) for dil in (1, 3, 5)]
    if quick:
        layers = [(3, 1), (7, 1), (11, 1), (11, 5)]
    for c, frames in ((256, 464), (128, 2320), (64, 6960)):
        for taps, dil in layers:
            for dtype in (torch.float32, torch.float16):
                x, w, bias = operands(streams, frames, c, taps, dtype, "cuda", seed=c + taps + dil)
                ref = reference(x[:2], w, bias, dil)
                best = {}
                for kind in kinds:
                    if kind == "window" and gluon is None:
                        continue
                    for tiles in candidates(kind, dtype, quick):
                        tiles = (tiles[0], min(tiles[1], c), min(tiles[2], c), tiles[3], tiles[4])
                        try:
                            err = rel(conv(kind, x[:2], w, bias, dil, tiles), ref)
                            us = (H.time_cuda_graph(lambda: conv(kind, x, w, bias, dil, tiles), calls=10)["us_p50"]
                                  if err <= BOUND[dtype] else None)
                        except Exception as exc:  # noqa: BLE001 (out of shared memory, a compile error, ...)
                            print(f"{kind} {tiles}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                            continue
                        rows.append(dict(env, op="vocoder_conv_smem", kind=kind, tiles=list(tiles), c=c,
                                         frames=frames, taps=taps, dil=dil, streams=streams,
                                         dtype=str(dtype)[6:], us=None if us is None else round(us, 2),
                                         rel_err=err))
                        if us is None:
                            print(f"{kind} {tiles} C={c} k={taps} d={dil} {str(dtype)[6:]}: error {err:.2e}, not timed")
                        elif kind not in best or us < best[kind][0]:
                            best[kind] = (us, tiles)
                text = "  ".join(f"{k} {v[0]:7.1f} µs {v[1]}" for k, v in best.items())
                base = best.get("per_tap", (None,))[0]
                ratios = " ".join(f"{k}/per_tap {v[0] / base:.2f}" for k, v in best.items() if base and k != "per_tap")
                print(f"C={c} L={frames} k={taps} d={dil} {str(dtype)[6:]:8s} {text}  {ratios}", flush=True)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "vocoder_conv_smem.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="CPU: the Triton kernels against float64 (TRITON_INTERPRET=1)")
    ap.add_argument("--compile", action="store_true", help="CPU: sm_90 compiles of the Gluon kernel")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="k = 3, 7, 11 at d = 1 and k = 11 at d = 5; fewer tiles")
    ap.add_argument("--out", default=".")
    ap.add_argument("--lib", help="a build of vocoder_conv_wgmma.cu (default: nvcc it here)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="the kernels to run, comma-separated")
    args = ap.parse_args()
    if args.lib:
        wgmma_lib(args.lib)
    if args.check:
        return check()
    if args.compile:
        return compile_only()
    return gpu(args.out, args.streams, args.quick, args.kinds.split(","))


if __name__ == "__main__":
    sys.exit(main())
