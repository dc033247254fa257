"""Issue 41's producer epilogue (``cutlass_residual_rowstats.cu``) on the GPU: error against float64,
and time against the unfused path and what ships (experiment; results in ``cutlass_residual_rowstats.md``).

The kernel computes, over M rows (the CFG rows x T frames of a solve step):

    y  = x + g * (a @ w.T + b)                     (M, N) fp16, rounded once
    c  = y - m                                     m: (M,) the previous LayerNorm's row means
    xc = c * (1 + s)                               (M, N) fp16: the next GEMM's input
    s1 = sum over each 128-column tile of c        (N / 128, round_up(M, 128)) fp32 partials
    s2 = the same over c^2

Then the consumer (``tcfm_layernorm_consumer_f16``) on the producer's xc and partials finishes the
LayerNorm of y inside the next GEMM (qkv: N = 1536; fc1: N = 2048, + GELU):

    out = rstd * (xc @ w2.T - mu_c * u) + v,  u = (1 + s) @ w2.T,  v = sh @ w2.T + b2

against a float64 ``modulate(LN(y), sh, s) @ w2.T + b2`` and against today's separate kernels
(``F.layer_norm``, the modulation, ``F.linear``).

Checked against a float64 evaluation of the same fp16 inputs: ``y`` and ``xc`` within fp16
rounding, the row sums (partials added) within fp32 accumulation error; then timed (CUDA events,
median of repeats, fresh inputs per shape) against the same work as separate kernels
(``F.linear`` with the bias, the gated add, the centring and scaling, the row sums) and against
``F.linear`` alone (the floor the fusion aims at). The producer runs in five forms (register-direct
aux load and store; TMA; TMA on the ping-pong schedule; the two TMA forms with the body's float32
residual stream, x and y float32), the consumer on the cooperative and the ping-pong schedule.

    python3 bench/experiments/cutlass_residual_rowstats.py --out "$OUT"            # builds the .so with nvcc
    python3 bench/experiments/cutlass_residual_rowstats.py --check-reference       # CPU: the reference alone
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [os.path.dirname(HERE)]

TILE_N, TILE_M = 128, 128


def build(out: str, source: str = "cutlass_residual_rowstats.cu") -> str:
    """nvcc the experiment ``source`` (a file beside this one) into ``out`` (a shared library, sm_90a, the
    CUDA runtime linked statically); returns its path. Headers: ``CUTLASS_INCLUDE``, else the nvidia-cutlass
    wheel's as ``csrc/cutlass/build.sh`` caches them (and their tools/util/include beside them)."""
    inc = os.environ.get("CUTLASS_INCLUDE") or os.path.expanduser(
        "~/.cache/torch_cfm/cutlass-4.2.0.0/cutlass_library/source/include")
    if not os.path.isfile(os.path.join(inc, "cutlass", "version.h")):
        subprocess.run(["bash", os.path.join(ROOT, "csrc", "cutlass", "build.sh"), tempfile.mkdtemp()], check=True,
                       stdout=subprocess.DEVNULL)  # fetches and unpacks the headers into the cache
    util = os.path.join(os.path.dirname(inc), "tools", "util", "include")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    nvcc = os.environ.get("NVCC", "nvcc")
    cmd = [nvcc, "-std=c++17", "-O3", "-DNDEBUG", "-gencode", "arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr",
           "-Xcompiler", "-fPIC", "-shared", "-cudart", "static", f"-I{inc}", f"-I{util}", "-Xptxas", "-v",
           os.path.join(HERE, source), "-o", out]
    log = subprocess.run(cmd, check=True, capture_output=True, text=True)
    print("\n".join(line for line in log.stderr.splitlines() if "registers" in line or "spill" in line))
    return out


def reference(a, w, bias, gate, x, mean, scale):
    """(y, xc (M, N), s1, s2 (M,)) in float64 from the fp16 inputs."""
    a, w, bias, gate, x, mean, scale = (t.double() for t in (a, w, bias, gate, x, mean, scale))
    y = x + gate * (a @ w.T + bias)
    c = y - mean[:, None]
    return y, c * scale, c.sum(-1), (c * c).sum(-1)


def unfused(a, w, bias, gate, x, mean, scale):
    """The same work as separate kernels: the GEMM with its bias, the gated residual add, the
    centring and scaling (rounded to the operand dtype), the row sums in fp32."""
    y = torch.addcmul(x, gate, F.linear(a, w, bias))
    c = y.float() - mean[:, None]
    return y, (c * scale).to(y.dtype), c.sum(-1), (c * c).sum(-1)


def inputs(m: int, n: int, k: int, device, seed: int):
    """fp16 a (M, K), w (N, K), bias, gate (N,), x (M, N); fp32 mean (M,), scale (N,)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    h = torch.float16

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, h)

    a, w, bias = r(m, k), r(n, k, scale=k ** -0.5), r(n, scale=0.1)
    gate, x = r(n, scale=0.5), r(m, n)
    mean = x.float().mean(-1) + 0.01 * torch.randn(m, generator=g).to(device)  # the previous LayerNorm's, roughly
    scale = (1 + 0.2 * torch.randn(n, generator=g)).to(device)
    return a, w, bias, gate, x, mean, scale


def consumer_reference(y64, shift, scale, w2, b2, gelu: bool):
    """float64 ``modulate(LN(y), shift, scale) @ w2.T + b2`` (tanh GELU for fc1)."""
    z = F.layer_norm(y64, y64.shape[-1:], eps=1e-6) * scale.double() + shift.double()
    out = z @ w2.double().T + b2.double()
    return F.gelu(out, approximate="tanh") if gelu else out


def consumer_unfused(y, shift, scale, w2, b2, gelu: bool):
    """Today's kernels: the LayerNorm with its modulation rounded to fp16, then the GEMM."""
    z = (F.layer_norm(y.float(), y.shape[-1:], eps=1e-6) * scale + shift).to(y.dtype)
    out = F.linear(z, w2, b2)
    return F.gelu(out, approximate="tanh") if gelu else out


def rel(got, ref) -> float:
    return float((got.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def check_reference() -> int:
    """CPU: the unfused path against the float64 reference (the bounds the kernel is held to)."""
    a, w, bias, gate, x, mean, scale = (t.float() for t in inputs(100, 512, 512, "cpu", 0))
    ref = reference(a, w, bias, gate, x, mean, scale)
    got = unfused(a, w, bias, gate, x, mean, scale)
    errs = [rel(g, r) for g, r in zip(got, ref)]
    print("unfused fp32 on CPU vs float64: " + ", ".join(f"{k} {e:.2e}" for k, e in zip(("y", "xc", "s1", "s2"), errs)))
    # the consumer's algebra in float64, from the producer's outputs as the kernels pass them
    y64, xc64, s1, s2 = ref
    g = torch.Generator().manual_seed(1)
    shift, w2, b2 = 0.1 * torch.randn(512, generator=g), torch.randn(2048, 512, generator=g) / 512 ** 0.5, \
        0.1 * torch.randn(2048, generator=g)
    u, v = scale.double() @ w2.double().T, shift.double() @ w2.double().T + b2.double()
    mean = s1 / 512
    rstd = (s2 / 512 - mean * mean + 1e-6).rsqrt()
    out = F.gelu(rstd[:, None] * (xc64 @ w2.double().T - mean[:, None] * u) + v, approximate="tanh")
    algebra = rel(out, consumer_reference(y64, shift, scale, w2, b2, True))
    print(f"consumer algebra (float64) vs modulate(LN(y)) @ w2.T + b2: {algebra:.2e}")
    return 0 if max(errs) < 1e-5 and algebra < 1e-12 else 1


def timed(fn, repeats: int, calls: int = 10) -> float:
    """ms per call of ``fn``: ``calls`` calls captured in one CUDA graph (no launch gaps: the Triton
    launcher's host time would otherwise count), replayed ``repeats`` times between CUDA events, the
    median; eager between events where the capture fails."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        run, per = graph.replay, calls
    except Exception:  # noqa: BLE001
        torch.cuda.synchronize()
        run, per = fn, 1
    times = []
    for _ in range(repeats):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        run()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / per)
    return sorted(times)[len(times) // 2]


def shipped_boundary(a, w, bias, x, m: int, n: int, dev, repeats: int) -> dict:
    """What ships at this boundary, timed at the same shapes: the GEMM without bias (cuBLAS), then
    torch_cfm's row-norm kernel (bias, gated update of the float32 residual stream, LayerNorm,
    modulation, the next GEMM's fp16 input), rows as 50-frame chunks. ms_shipped is both, ms_rownorm
    the kernel alone."""
    try:
        from torch_cfm.kernels.rownorm import rownorm
    except Exception as exc:  # noqa: BLE001
        return {"shipped_error": repr(exc)[:200]}
    n_rows, t_len = m // 50, 50
    h, out = x.float().clone(), torch.empty_like(x)
    valid = torch.full((n_rows,), t_len, dtype=torch.int32, device=dev)
    g = torch.Generator(device="cpu").manual_seed(m + n)
    table = (0.1 * torch.randn(1, 2, 9, n, generator=g)).to(dev)
    b32, y0 = bias.float(), F.linear(a, w)

    def norm(y):
        rownorm(y, h, out, valid, n_rows=n_rows, t_len=t_len, bias=b32, table=table, gate=0, shift=n, scale=2 * n)

    return {"ms_shipped": timed(lambda: norm(F.linear(a, w)), repeats), "ms_rownorm": timed(lambda: norm(y0), repeats)}


def consumers(cfn, cws, y, xc, s1, s2, ins, y64, m, dev, props, work, repeats) -> list[dict]:
    """The consumer at qkv (N = 1536) and fc1 (N = 2048, GELU) over the producer's outputs."""
    scale = ins[6]
    g = torch.Generator(device="cpu").manual_seed(m)
    shift = (0.1 * torch.randn(512, generator=g)).to(dev)
    out_rows = []
    for role, n2, gelu in (("qkv", 1536, False), ("fc1", 2048, True)):
        w2 = (torch.randn(n2, 512, generator=g) * 512 ** -0.5).to(dev, torch.float16)
        b2 = (0.1 * torch.randn(n2, generator=g)).to(dev, torch.float16)
        u = (scale[None, :] * w2.float()).sum(-1)           # (1 + s) @ w2.T
        v = (shift[None, :] * w2.float()).sum(-1) + b2.float()  # sh @ w2.T + b2
        d2 = torch.empty(m, n2, device=dev, dtype=torch.float16)
        ref = consumer_reference(y64, shift, scale, w2, b2, gelu)
        row = dict(role=role, rows=m, n=n2, k=512, gelu=gelu, gpu=props.name, torch=torch.__version__,
                   err_unfused=rel(consumer_unfused(y, shift, scale, w2, b2, gelu), ref),
                   ms_unfused=timed(lambda: consumer_unfused(y, shift, scale, w2, b2, gelu), repeats),
                   ms_linear=timed(lambda: F.linear(xc, w2, b2), repeats))
        # the cooperative schedule, then the ping-pong one (flags bit 1), each checked, then timed
        for flags, suffix in ((int(gelu), ""), (int(gelu) | 2, "_pingpong")):
            need = int(cws(m, n2, 512, flags))
            buf = work if work.numel() >= need else torch.empty(need, dtype=torch.uint8, device=dev)

            def fused(flags=flags, buf=buf):
                status = cfn(*(t.data_ptr() for t in (xc, w2, s1, s2, u, v, d2)), m, n2, 512, flags, dev.index or 0,
                             props.multi_processor_count, buf.data_ptr(), torch.cuda.current_stream().cuda_stream)
                if status != 0:
                    raise RuntimeError(f"tcfm_layernorm_consumer_f16 (flags={flags}): status {status}")

            d2.fill_(float("nan"))
            fused()
            torch.cuda.synchronize()
            row["err_fused" + suffix] = rel(d2, ref)
            row["ms_fused" + suffix] = timed(fused, repeats)
        out_rows.append(row)
        print(json.dumps(row))
    return out_rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lib", help="a built .so (default: build one into a temporary folder)")
    ap.add_argument("--rows", default="1600,3200,6400", help="M: 2 x streams x 50 frames (16 / 32 / 64 streams)")
    ap.add_argument("--ks", default="512,2048", help="K: 512 (attention proj), 2048 (fc2)")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", default=".")
    ap.add_argument("--check-reference", action="store_true")
    args = ap.parse_args()
    if args.check_reference:
        return check_reference()
    lib = ctypes.CDLL(args.lib or build(os.path.join(tempfile.mkdtemp(), "librowstats.so")))
    fn = lib.tcfm_residual_rowstats_f16
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 11 + [ctypes.c_int] * 6 + [ctypes.c_void_p, ctypes.c_void_p]
    ws = lib.tcfm_residual_rowstats_f16_workspace
    ws.restype, ws.argtypes = ctypes.c_longlong, [ctypes.c_int] * 4
    cfn = lib.tcfm_layernorm_consumer_f16
    cfn.restype = ctypes.c_int
    cfn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int] * 6 + [ctypes.c_void_p, ctypes.c_void_p]
    cws = lib.tcfm_layernorm_consumer_f16_workspace
    cws.restype, cws.argtypes = ctypes.c_longlong, [ctypes.c_int] * 4
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    from _harness import env_info  # bench/: provenance (gpu, versions, BENCH_COMMIT, run id) on every row

    env = env_info()
    rows = []
    for m in (int(v) for v in args.rows.split(",")):
        for k in (int(v) for v in args.ks.split(",")):
            n = 512
            ins = inputs(m, n, k, dev, seed=m * 7 + k)
            a, w, bias, gate, x, mean, scale = ins
            d, xc = torch.empty_like(x), torch.empty_like(x)
            x32, d32 = x.float(), torch.empty(m, n, device=dev)  # forms 5, 7: the body's float32 residual
            s1 = torch.zeros(n // TILE_N, -(-m // TILE_M) * TILE_M, device=dev)
            s2 = torch.zeros_like(s1)
            work = torch.empty(max(max(int(ws(m, n, k, f)) for f in (0, 1, 3, 5, 7)), 1), dtype=torch.uint8, device=dev)
            ref = reference(*ins)
            timing = {}
            # the register-direct form (x and xc through the epilogue threads), the TMA form (x as the
            # source C, xc through shared memory), the TMA form on the ping-pong schedule, and the two TMA
            # forms on a float32 residual (x read and y written in float32, as the body's h): each checked
            # against float64, then timed
            for form, suffix in ((0, ""), (1, "_tma"), (3, "_tma_pingpong"), (5, "_tma_f32res"),
                                 (7, "_tma_pingpong_f32res")):
                xf, df = (x32, d32) if form & 4 else (x, d)

                def fused(form=form, xf=xf, df=df):
                    status = fn(*(t.data_ptr() for t in (a, w, bias, gate, xf, mean, scale, df, xc, s1, s2)), m, n,
                                k, form, dev.index or 0, props.multi_processor_count, work.data_ptr(),
                                torch.cuda.current_stream().cuda_stream)
                    if status != 0:
                        raise RuntimeError(f"tcfm_residual_rowstats_f16 (form={form}): status {status}")

                for t in (df, xc, s1, s2):
                    t.fill_(float("nan"))  # nothing left over from the other form
                s1.zero_(), s2.zero_()
                fused()
                torch.cuda.synchronize()
                got = (df, xc, s1.sum(0)[:m], s2.sum(0)[:m])
                timing["err_fused" + suffix] = [rel(g, r) for g, r in zip(got, ref)]
                timing["ms_fused" + suffix] = timed(fused, args.repeats)
            timing.update(shipped_boundary(a, w, bias, x, m, n, dev, args.repeats))
            base = unfused(*ins)
            row = dict(rows=m, n=n, k=k, gpu=props.name, torch=torch.__version__, **timing,
                       err_unfused=[rel(g, r) for g, r in zip(base, ref)],
                       ms_unfused=timed(lambda: unfused(*ins), args.repeats),
                       ms_linear=timed(lambda: F.linear(a, w, bias), args.repeats))
            rows.append(row)
            print(json.dumps(row))
            if k == 512:
                rows += consumers(cfn, cws, d, xc, s1, s2, ins, ref[0], m, dev, props, work, args.repeats)
    rows = [dict(env, **row) for row in rows]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cutlass_residual_rowstats.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
