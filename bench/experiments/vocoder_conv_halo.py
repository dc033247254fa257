"""Issue 43: a dilated convolution that loads its input window once per channel block, not once per tap
(experiment; the shipped kernel is ``torch_cfm.kernels.vocoder_conv``).

Nsight Compute puts the vocoder's plain convolutions at 77-80 % of L2 throughput and 47-54 % of SM
throughput (``vocoder_conv_ncu.md``): the shipped implicit GEMM reloads its shifted (BLOCK_M,
BLOCK_K) input tile from L2 for every tap, TAPS times per output tile. Triton cannot slice a
register tile at a run-time offset, but ``tl.gather`` can pick rows of one: the "halo" kernel loads
rows [o0 - pad, o0 - pad + HALO) once per channel block (HALO = BLOCK_M + (TAPS - 1)·DIL rounded up
to a power of 2) and gathers each tap's BLOCK_M rows out of it (through shared memory), so the input
comes from L2 HALO / (TAPS·BLOCK_M) as often: 0.29 × for k = 7, d = 1 at BLOCK_M = 64; 0.18 × for
k = 11, d = 5. Its reduction runs channel block outer, taps inner (the shipped one: taps outer), so
results agree within float32 accumulation, both batch-invariant.

Both kernels here are the plain stride-1 convolution alone (bias, no epilogue), frame-major (B, L, C),
operands float32 rounded to TF32 (as the shipped "tf32" path: products exact, sums float32) or
float16. Checks and timings:

    TRITON_INTERPRET=1 python3 bench/experiments/vocoder_conv_halo.py --check      # CPU: against float64
    python3 bench/experiments/vocoder_conv_halo.py --out "$OUT" [--quick]           # GPU: the HiFT's shapes

The GPU run checks both against float64 at every shape, then times each (CUDA graph of 10 launches,
median of replays) at 64 streams x 58 frames: the HiFT's ResBlock convolutions (C = 256 / 128 / 64
at 464 / 2,320 / 6,960 frames, k = 3 / 7 / 11, d = 1 / 3 / 5), with both kernels' tiles swept over
a few candidates, and writes ``vocoder_conv_halo.json`` (rows with provenance).
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
def _conv_per_tap(x_ptr, w_ptr, b_ptr, y_ptr, L, C_in, C_out, PAD, DIL,
                  TAPS: tl.constexpr, DOT: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The shipped structure: taps outer, each tap's shifted input tile loaded again."""
    tiles = tl.cdiv(L, BLOCK_M)
    b, t = tl.program_id(0) // tiles, tl.program_id(0) % tiles
    o = t * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    x_row = x_ptr + b.to(tl.int64) * L * C_in
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    kb = tl.cdiv(C_in, BLOCK_K)
    for it in range(TAPS * kb):
        m = it // kb
        ci = (it % kb) * BLOCK_K + tl.arange(0, BLOCK_K)
        idx = o - PAD + m * DIL
        a = tl.load(x_row + idx[:, None] * C_in + ci[None, :],
                    mask=((idx >= 0) & (idx < L))[:, None] & (ci < C_in)[None, :], other=0.0)
        w = _weights(w_ptr, m, n, ci, C_in, C_out)
        acc = tl.dot(a, w, acc, input_precision=DOT)
    _store(acc, b_ptr, y_ptr, b, o, n, L, C_out)


@triton.jit
def _conv_halo(x_ptr, w_ptr, b_ptr, y_ptr, L, C_in, C_out, PAD, DIL,
               TAPS: tl.constexpr, DOT: tl.constexpr, HALO: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Channel blocks outer: the (HALO, BLOCK_K) input window loaded once, each tap's rows gathered from it."""
    tiles = tl.cdiv(L, BLOCK_M)
    b, t = tl.program_id(0) // tiles, tl.program_id(0) % tiles
    o = t * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    h = t * BLOCK_M - PAD + tl.arange(0, HALO)  # the window's input frames
    x_row = x_ptr + b.to(tl.int64) * L * C_in
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    rows = tl.arange(0, BLOCK_M)[:, None] + tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.int32)
    for k0 in range(0, C_in, BLOCK_K):
        ci = k0 + tl.arange(0, BLOCK_K)
        window = tl.load(x_row + h[:, None] * C_in + ci[None, :],
                         mask=((h >= 0) & (h < L))[:, None] & (ci < C_in)[None, :], other=0.0)
        for m in range(TAPS):  # a loop, not unrolled: one tap's weight tile in flight at a time
            a = tl.gather(window, rows + m * DIL, 0)
            w = _weights(w_ptr, m, n, ci, C_in, C_out)
            acc = tl.dot(a, w, acc, input_precision=DOT)
    _store(acc, b_ptr, y_ptr, b, o, n, L, C_out)


def round_tf32(t: torch.Tensor) -> torch.Tensor:
    from torch_cfm.kernels.vocoder_conv import round_tf32 as rt

    return rt(t)


def conv(kind: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, dil: int, tiles: tuple) -> torch.Tensor:
    """Conv1d of x (B, L, C_in) by w packed (taps, C_out, C_in), 'same' padding, stride 1: (B, L, C_out)."""
    batch, frames, c_in = x.shape
    taps, c_out, _ = w.shape
    bm, bn, bk, warps, stages = tiles
    pad = dil * (taps - 1) // 2
    y = torch.empty(batch, frames, c_out, device=x.device, dtype=x.dtype)
    grid = (batch * triton.cdiv(frames, bm), triton.cdiv(c_out, bn))
    dot = "tf32" if x.dtype == torch.float32 else None
    common = dict(TAPS=taps, DOT=dot, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    if kind == "per_tap":
        _conv_per_tap[grid](x, w, bias, y, frames, c_in, c_out, pad, dil, **common)
    else:
        halo = triton.next_power_of_2(bm + (taps - 1) * dil)
        _conv_halo[grid](x, w, bias, y, frames, c_in, c_out, pad, dil, HALO=halo, **common)
    return y


def operands(batch, frames, c, taps, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, frames, c, generator=g)
    w = torch.randn(taps, c, c, generator=g) / (c * taps) ** 0.5
    bias = 0.1 * torch.randn(c, generator=g)
    if dtype == torch.float32:
        x, w = round_tf32(x), round_tf32(w)
    x, w = x.to(dtype), w.to(dtype)
    return x.to(device), w.to(device), bias.to(device)


def reference(x, w, bias, dil):
    """float64 conv1d of the same (rounded) operands: (B, L, C_out)."""
    taps = w.shape[0]
    weight = w.double().permute(1, 2, 0)  # (C_out, C_in, taps)
    y = torch.nn.functional.conv1d(x.double().transpose(1, 2), weight, bias.double(), padding=dil * (taps - 1) // 2,
                                   dilation=dil)
    return y.transpose(1, 2)


def rel(a, b) -> float:
    return float((a.double() - b).norm() / b.norm())


def check() -> int:
    """CPU interpreter: both kernels against float64 at small shapes (odd sizes, masks, halos)."""
    bad = 0
    for (batch, frames, c, taps, dil, tiles) in [(2, 37, 24, 3, 1, (16, 16, 16, 4, 1)), (1, 50, 32, 7, 3, (16, 32, 16, 4, 1)),
                                                 (2, 29, 16, 11, 5, (16, 16, 16, 4, 1)), (1, 64, 48, 5, 2, (32, 16, 32, 4, 1))]:
        for dtype, bound in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
            x, w, bias = operands(batch, frames, c, taps, dtype, "cpu", seed=frames * taps + dil)
            ref = reference(x, w, bias, dil)
            for kind in ("per_tap", "halo"):
                err = rel(conv(kind, x, w, bias, dil, tiles), ref)
                flag = "ok" if err <= bound else "FAIL"
                bad += flag == "FAIL"
                print(f"{kind:8s} B={batch} L={frames} C={c} k={taps} d={dil} {str(dtype)[6:]:8s} err {err:.2e} {flag}")
    return 1 if bad else 0


def timed(fn, repeats: int = 30, calls: int = 10) -> float:
    """µs per call: ``calls`` launches in one CUDA graph, median of ``repeats`` replays."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


CANDIDATES = [(64, 64, 32, 4, 3), (128, 64, 32, 4, 3), (64, 128, 32, 4, 3), (128, 128, 32, 8, 3), (64, 64, 64, 4, 3),
              (128, 64, 64, 8, 3)]


QUICK = [(64, 64, 32, 4, 3), (128, 64, 32, 4, 3), (128, 128, 32, 8, 3)]


def gpu(out: str, streams: int, quick: bool) -> int:
    import _harness as H

    env = H.env_info()
    rows = []
    candidates = QUICK if quick else CANDIDATES
    for c, frames in ((256, 464), (128, 2320), (64, 6960)):
        for taps in (3, 7, 11):
            for dil in (1, 3, 5):
                for dtype in (torch.float32,) if quick else (torch.float32, torch.float16):
                    x, w, bias = operands(streams, frames, c, taps, dtype, "cuda", seed=c + taps + dil)
                    ref = reference(x[:2], w, bias, dil)
                    best = {}
                    for kind in ("per_tap", "halo"):
                        for tiles in candidates:
                            if tiles[1] > max(16, c) or tiles[2] > c:
                                continue
                            try:
                                err = rel(conv(kind, x[:2], w, bias, dil, tiles), ref)
                                us = timed(lambda: conv(kind, x, w, bias, dil, tiles))
                            except Exception as exc:  # noqa: BLE001 (out of shared memory for a large halo, ...)
                                print(f"{kind} {tiles}: {type(exc).__name__}: {str(exc)[:120]}")
                                continue
                            row = dict(env, op="vocoder_conv_halo", kind=kind, tiles=list(tiles), c=c, frames=frames,
                                       taps=taps, dil=dil, streams=streams, dtype=str(dtype)[6:], us=round(us, 2),
                                       rel_err=err)
                            rows.append(row)
                            if kind not in best or us < best[kind][0]:
                                best[kind] = (us, tiles, err)
                    if len(best) == 2:
                        (a, ta, ea), (h, th, eh) = best["per_tap"], best["halo"]
                        print(f"C={c} L={frames} k={taps} d={dil} {str(dtype)[6:]:8s} per_tap {a:8.1f} µs {ta} "
                              f"halo {h:8.1f} µs {th}  ratio {h / a:.2f}  err {ea:.1e} / {eh:.1e}", flush=True)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "vocoder_conv_halo.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="CPU: both kernels against float64 (TRITON_INTERPRET=1)")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="TF32 only, three tile candidates")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    if args.check:
        return check()
    return gpu(args.out, args.streams, args.quick)


if __name__ == "__main__":
    sys.exit(main())
