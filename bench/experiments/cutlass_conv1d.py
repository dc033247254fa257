"""Issue 41: the block's causal convs as CUTLASS implicit-GEMM convs (``cutlass_conv1d.cu``) against what
ships, on the GPU: error against float64, and the conv boundary's time (experiment; ``cutlass_conv1d.md``).

What ships per conv (docs/design.md §4): ONE GEMM over each row's [2 history ; T current] frames against
the tap-stacked weight (3C outputs: ``z`` (N (T + 2), 3C) fp16), then the row-norm kernel's TAPS mode
sums the three shifted taps in float32 (+ bias, LayerNorm, affine, Mish for conv 1). The implicit conv
writes ``y`` (N T, C) once, the taps summed in the GEMM's K loop (K = 3C), and the row-norm reads it in
its plain mode. Per conv at 6,400 rows that is about 27 MB less traffic (z's write and read back).

Checked against float64: the conv (CUTLASS's rounded once, the shipped taps' sum of fp16-rounded
products), and the whole conv-1 boundary (conv, bias, LayerNorm, affine, Mish -> fp16) in both forms.
Timed (CUDA-graph replays of 10 calls, median of repeats, at N = 32 / 64 / 128 CFG rows of T = 50,
C = 512): the shipped conv GEMM (cuBLAS) + the TAPS row-norm, against each CUTLASS config + the plain
row-norm, and each part alone.

    python3 bench/experiments/cutlass_conv1d.py --out "$OUT"          # builds the .so with nvcc (GPU box)
    python3 bench/experiments/cutlass_conv1d.py --check-reference     # CPU: the weight layouts in float64
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [HERE, os.path.dirname(HERE), ROOT]

C, T, HIST = 512, 50, 2
CONFIGS = {0: "ws_128x128_st3", 1: "ws_64x128_st4", 2: "ws_128x128_deep"}
LN_EPS = 1e-5


def build(out: str) -> str:
    """nvcc ``cutlass_conv1d.cu`` into ``out`` (a shared library); returns its path."""
    from cutlass_residual_rowstats import build as build_experiment

    return build_experiment(out, "cutlass_conv1d.cu")


def inputs(n: int, device, seed: int):
    """fp16 hist (N, T + 2, C), weight (C_out, C_in, 3) as nn.Conv1d holds it, bias and LayerNorm affine (C,)."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def r(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g) * scale + shift).to(device, torch.float16)

    return r(n, T + HIST, C), r(C, C, 3, scale=(3 * C) ** -0.5), r(C, scale=0.1), r(C, scale=0.2, shift=1.0), \
        r(C, scale=0.1)


def stacked(w: torch.Tensor) -> torch.Tensor:
    """(3C, C): the shipped conv GEMM's weight, tap s in rows [sC, (s + 1)C) (row-norm TAPS reads z[t + s])."""
    return torch.cat([w[:, :, s] for s in range(3)], dim=0).contiguous()


def ksc(w: torch.Tensor) -> torch.Tensor:
    """(C_out, 3, C_in): the implicit conv's filter (KSC)."""
    return w.permute(0, 2, 1).contiguous()


def conv_reference(hist, w) -> torch.Tensor:
    """float64 causal conv: (N, T, C) from hist (N, T + 2, C) and w (C_out, C_in, 3)."""
    return F.conv1d(hist.double().transpose(1, 2), w.double()).transpose(1, 2)


def shipped_conv(hist, w) -> torch.Tensor:
    """The shipped math in torch: the stacked GEMM rounded per tap, the taps summed in float32."""
    n = hist.shape[0]
    z = (hist.reshape(n * (T + HIST), C) @ stacked(w).t()).view(n, T + HIST, 3 * C)
    acc = torch.float64 if hist.dtype == torch.float64 else torch.float32
    return sum(z[:, s:s + T, s * C:(s + 1) * C].to(acc) for s in range(3))


def boundary_reference(y64, bias, lnw, lnb) -> torch.Tensor:
    """float64 conv-1 boundary: Mish(LayerNorm(y + bias) * lnw + lnb)."""
    x = F.layer_norm(y64 + bias.double(), (C,), lnw.double(), lnb.double(), LN_EPS)
    return F.mish(x)


def rel(got, ref) -> float:
    return float((got.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def check_reference() -> int:
    """CPU, float64: the stacked weight's taps and the KSC filter compute the same conv as F.conv1d."""
    hist, w, *_ = (t.double() for t in inputs(3, "cpu", 0))
    ref = conv_reference(hist, w)
    taps = shipped_conv(hist, w).double()
    flat = torch.cat([hist[:, s:s + T] for s in range(3)], dim=2)  # the im2col of the KSC filter: (N, T, 3C)
    implicit = flat @ ksc(w).reshape(C, 3 * C).t()
    errs = rel(taps, ref), rel(implicit, ref)
    print(f"float64: stacked taps {errs[0]:.1e}, KSC im2col {errs[1]:.1e} against F.conv1d")
    return 0 if max(errs) < 1e-12 else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check-reference", action="store_true")
    ap.add_argument("--lib", default=None, help="a built libconv1d.so (default: build it)")
    ap.add_argument("--rows", default="32,64,128", help="CFG rows N (x T = 50 frames)")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.check_reference:
        return check_reference()
    from _harness import env_info, time_cuda_graph  # bench/: provenance (gpu, versions, BENCH_COMMIT, run id)
    from torch_cfm.kernels.rownorm import rownorm

    env = env_info()
    lib = ctypes.CDLL(args.lib or build(os.path.join(tempfile.mkdtemp(), "libconv1d.so")))
    conv = lib.tcfm_conv1d_f16
    conv.restype = ctypes.c_int
    conv.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 5 + [ctypes.c_void_p, ctypes.c_void_p]
    conv_ws = lib.tcfm_conv1d_f16_workspace
    conv_ws.restype, conv_ws.argtypes = ctypes.c_longlong, [ctypes.c_int] * 5
    dev = torch.device("cuda")
    rows = []
    for n in (int(x) for x in args.rows.split(",")):
        hist, w, bias, lnw, lnb = inputs(n, dev, seed=n)
        w_stacked, w_ksc = stacked(w), ksc(w)
        flat = hist.view(n * (T + HIST), C)
        z = torch.empty(n * (T + HIST), 3 * C, device=dev, dtype=torch.float16)
        y = torch.empty(n * T, C, device=dev, dtype=torch.float16)
        h = torch.empty(n * T, C, device=dev, dtype=torch.float32)  # unused by these boundaries (no residual)
        out = torch.empty(n * (T + HIST), C, device=dev, dtype=torch.float16)
        valid = torch.full((n,), T, device=dev, dtype=torch.int32)
        ref = conv_reference(hist, w)
        ref_b = boundary_reference(ref, bias, lnw, lnb)

        def gemm():
            torch.matmul(flat, w_stacked.t(), out=z)

        def norm(src, taps):
            rownorm(src, h, out, valid, n_rows=n, t_len=T, taps=taps, bias=bias, has_res=False, write_h=False,
                    ln_affine=(lnw, lnb), eps=LN_EPS, out_t=T + HIST, out_off=HIST)

        def boundary_out():
            return out.view(n, T + HIST, C)[:, HIST:]

        gemm()
        norm(z, True)
        torch.cuda.synchronize()
        row = dict(env, op="cutlass_conv1d", rows=n * T, cfg_rows=n, t=T, c=C,
                   err_conv_shipped=rel(shipped_conv(hist, w), ref), err_boundary_shipped=rel(boundary_out(), ref_b),
                   us_gemm=time_cuda_graph(gemm, calls=10, repeats=args.repeats)["us_p50"],
                   us_rownorm_taps=time_cuda_graph(lambda: norm(z, True), calls=10, repeats=args.repeats)["us_p50"])
        row["us_shipped"] = time_cuda_graph(lambda: (gemm(), norm(z, True)), calls=10, repeats=args.repeats)["us_p50"]
        row["us_rownorm_plain"] = time_cuda_graph(lambda: norm(y, False), calls=10, repeats=args.repeats)["us_p50"]
        for cfg, name in CONFIGS.items():
            ws = torch.empty(max(int(conv_ws(n, T + HIST, C, C, cfg)), 1), device=dev, dtype=torch.uint8)

            def implicit(cfg=cfg, ws=ws):
                status = conv(hist.data_ptr(), w_ksc.data_ptr(), y.data_ptr(), n, T + HIST, C, C, cfg, ws.data_ptr(),
                              torch.cuda.current_stream().cuda_stream)  # the capturing stream inside a graph
                if status:
                    raise RuntimeError(f"tcfm_conv1d_f16 config {cfg}: cutlass status {status}")

            try:
                implicit()
            except RuntimeError as e:  # a config the library cannot run here: recorded, the others still run
                row[f"error_{name}"] = str(e)
                continue
            norm(y, False)
            torch.cuda.synchronize()
            row[f"err_conv_{name}"] = rel(y.view(n, T, C), ref)
            row[f"err_boundary_{name}"] = rel(boundary_out(), ref_b)
            row[f"us_conv_{name}"] = time_cuda_graph(implicit, calls=10, repeats=args.repeats)["us_p50"]
            row[f"us_implicit_{name}"] = time_cuda_graph(lambda: (implicit(), norm(y, False)), calls=10,
                                                         repeats=args.repeats)["us_p50"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "cutlass_conv1d.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
