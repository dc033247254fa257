#!/usr/bin/env python3
"""The wgmma + TMA GEMM (``csrc/cuda/dit_linear_kernel.cuh``, in torch_cfm._C_cuda) against cuBLAS at the
DiT block's K = 512 GEMM shapes (M = N·T = 400 rows): µs per GEMM alone and in dependent chains, where its
PDL form (weights loaded before ``griddepcontrol.wait``) does what cuBLAS cannot.

Three parts (the extension built for sm_90a, as bench/run_device.sh does):
1. check: every (role shape, dtype, block_n) against a float64 product, next to cuBLAS's own error;
   rows with M in {1, 64, 65} check the edges (TMA zero fill, masked stores).
2. repeat: the same GEMM ``--calls`` times in one graph.
3. chain: dependent GEMMs of one role in one graph, each with its own weight matrix (``--chain-mb``
   together, more than L2, as in the step, whose 147 MB of weights stream from HBM), activations
   ping-ponged between two buffers (GEMM i reads the first K columns of GEMM i-1's output); µs per
   GEMM. Plans are captured ``--rounds`` times in a new order each round and the rounds pooled
   (capture-to-capture spread is 3-8 %).

Rows (``op`` = "wgmma_gemm", provider "cublas" or "wgmma", variant "bn<BN>[/c<cluster>][/pdl]", shape
{M, K, N, mode}) go to ``<out>/wgmma_gemm.json`` and a markdown table.

    python3 bench/wgmma_gemm.py --out bench/results          # on the GPU box (bash bench/run_device.sh wgmma-gemm)
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from _harness import (env_info, fmt_us, make_row, markdown_table, percentiles,  # noqa: E402
                      provenance_footer, time_cuda_graph, upsert_rows)

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# (role, M, K, N, GELU) at (N, T) = (8, 50): M = 400 token rows, 416 for the conv GEMMs (T + 2 per row)
ROLES = (("proj", 400, 512, 512, False), ("qkv", 400, 512, 1536, False), ("conv", 416, 512, 1536, False),
         ("fc1", 400, 512, 2048, True))
EDGE_ROWS = (1, 64, 65)
TRIGGER_EARLY, GELU = 1, 2  # csrc/cuda/dit_linear_kernel.cuh flags (GELU: tanh form)


def _module():
    """The library's build of the kernel (torch_cfm._C_cuda, TORCH_CUDA_ARCH_LIST=9.0a):
    ``dit_linear_into(a, w, bias, out, block_n, pdl, flags, cluster)``."""
    from torch_cfm.kernels.dit_linear_cuda import _extension, device_reason

    why = device_reason(torch.device("cuda"))
    if why:
        raise SystemExit(f"bench/wgmma_gemm.py: {why}")
    return _extension()[0]


def _operands(m: int, k: int, n: int, dtype: torch.dtype, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    a = torch.randn(m, k, generator=g).to("cuda", dtype)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to("cuda", dtype)
    b = (torch.randn(n, generator=g) * 0.1).to("cuda", dtype)
    return a, w, b


def _cublas(a, w, b, out, gelu: bool):
    if gelu:
        return torch._addmm_activation(b, a, w.t(), use_gelu=True, out=out)
    return torch.addmm(b, a, w.t(), out=out)


def _plans(block_ns, n: int, clusters):
    """(provider, variant, block_n, pdl, flags, cluster) of every timed plan for an output width n."""
    plans = [("cublas", "", 0, False, 0, 1)]
    for bn in block_ns:
        if n % bn:
            continue
        for c in clusters:
            tag = f"bn{bn}" + (f"/c{c}" if c > 1 else "")
            plans += [("wgmma", tag, bn, False, TRIGGER_EARLY, c), ("wgmma", tag + "/pdl", bn, True, TRIGGER_EARLY, c)]
    return plans


def check(mod, env, dtypes, block_ns, clusters) -> tuple[list, bool]:
    rows, ok = [], True
    shapes = [(role, m, k, n, gelu) for role, m, k, n, gelu in ROLES]
    shapes += [(f"proj_m{m}", m, 512, 512, False) for m in EDGE_ROWS]
    for dname in dtypes:
        dtype = DTYPES[dname]
        for role, m, k, n, gelu in shapes:
            a, w, b = _operands(m, k, n, dtype, seed=m + n)
            ref = a.double() @ w.double().t() + b.double()
            if gelu:
                ref = torch.nn.functional.gelu(ref, approximate="tanh")
            ref_norm = ref.norm().clamp_min(1e-30)
            cub = _cublas(a, w, b, torch.empty(m, n, device="cuda", dtype=dtype), gelu)
            cub_err = ((cub.double() - ref).norm() / ref_norm).item()
            for bn, c in [(bn, c) for bn in block_ns for c in clusters]:
                if n % bn:
                    continue
                out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
                mod.dit_linear_into(a, w, b, out, bn, False, GELU if gelu else 0, c)
                torch.cuda.synchronize()
                err = ((out.double() - ref).norm() / ref_norm).item()
                good = bool(torch.isfinite(out).all()) and err <= 2 * cub_err + 1e-3 * (dtype == torch.bfloat16) + 1e-4
                ok &= good
                print(f"check {dname} {role:9s} M={m:4d} K={k} N={n:4d} bn{bn:<3d} c{c} rel err {err:.2e} "
                      f"(cuBLAS {cub_err:.2e}) {'ok' if good else 'FAIL'}", flush=True)
                rows.append(make_row(env, op="wgmma_gemm", provider="wgmma", variant=f"bn{bn}/c{c}",
                                     shape={"M": m, "K": k, "N": n, "mode": "check", "role": role}, dtype=dname,
                                     rel_err=err, rel_err_cublas=cub_err, passed=good))
    return rows, ok


def _launcher(mod, provider, bn, pdl, flags, cluster, a, w, b, out, gelu):
    if provider == "cublas":
        return lambda: _cublas(a, w, b, out, gelu)
    f = flags | (GELU if gelu else 0)
    return lambda: mod.dit_linear_into(a, w, b, out, bn, pdl, f, cluster)


def repeat_rows(mod, env, dtypes, block_ns, clusters, calls, repeats) -> list:
    rows = []
    for dname in dtypes:
        dtype = DTYPES[dname]
        for role, m, k, n, gelu in ROLES:
            a, w, b = _operands(m, k, n, dtype, seed=1)
            out = torch.empty(m, n, device="cuda", dtype=dtype)
            for provider, variant, bn, pdl, flags, c in _plans(block_ns, n, clusters):
                t = time_cuda_graph(_launcher(mod, provider, bn, pdl, flags, c, a, w, b, out, gelu), calls=calls,
                                    repeats=repeats)
                print(f"repeat {dname} {role:5s} {provider:6s} {variant:14s} {t['us_p50']:.2f} us", flush=True)
                rows.append(make_row(env, op="wgmma_gemm", provider=provider, variant=variant,
                                     shape={"M": m, "K": k, "N": n, "mode": "repeat", "role": role}, dtype=dname,
                                     timing="cuda_graph", **t))
    return rows


def chain_rows(mod, env, dtypes, block_ns, clusters, weight_mb, rounds, repeats) -> list:
    """µs per GEMM of a chain of dependent GEMMs of one role, each with its own weights (together
    ``weight_mb`` MB, more than L2): GEMM i reads the first K columns of GEMM i-1's output."""
    rows = []
    for dname in dtypes:
        dtype = DTYPES[dname]
        for role, m, k, n, gelu in ROLES:
            length = max(32, -(-weight_mb * 2 ** 20 // (n * k * 2)))
            g = torch.Generator(device="cpu").manual_seed(7)
            weights = [(torch.randn(n, k, generator=g) * k ** -0.5).to("cuda", dtype) for _ in range(length)]
            biases = [(torch.randn(n, generator=g) * 0.01).to("cuda", dtype) for _ in range(length)]
            x0 = torch.randn(m, k, generator=g).to("cuda", dtype)
            bufs = [torch.empty(m, n, device="cuda", dtype=dtype) for _ in range(2)]
            plans = _plans(block_ns, n, clusters)
            samples = {p[1] or "cublas": [] for p in plans}
            finals = {}
            for rnd in range(rounds):
                order = plans[:]
                random.Random(rnd).shuffle(order)
                for provider, variant, bn, pdl, flags, c in order:
                    steps = []
                    for i in range(length):
                        src = x0 if i == 0 else bufs[(i - 1) % 2][:, :k]
                        steps.append(_launcher(mod, provider, bn, pdl, flags, c, src, weights[i], biases[i],
                                               bufs[i % 2], gelu))

                    def run_chain(steps=steps):
                        for step in steps:
                            step()

                    key = variant or "cublas"
                    pad = torch.empty(random.Random(rnd * 31 + bn + c).randint(1, 64) << 16, dtype=torch.uint8,
                                      device="cuda")  # shifts the capture's pool addresses between rounds
                    raw = []
                    t = time_cuda_graph(run_chain, calls=1, repeats=repeats, samples=raw)
                    del pad
                    samples[key].extend(v / length for v in raw)
                    finals[key] = bufs[(length - 1) % 2].double().clone()
                    print(f"chain {dname} {role} round {rnd} {provider:6s} {variant:16s} "
                          f"{t['us_p50'] / length:.2f} us/GEMM", flush=True)
            ref = finals["cublas"]
            for provider, variant, bn, pdl, flags, c in plans:
                key = variant or "cublas"
                diff = ((finals[key] - ref).norm() / ref.norm().clamp_min(1e-30)).item()
                p = percentiles(samples[key])
                rows.append(make_row(env, op="wgmma_gemm", provider=provider, variant=variant,
                                     shape={"M": m, "K": k, "N": n, "mode": f"chain{length}", "role": role},
                                     dtype=dname, timing="cuda_graph", rel_err_vs_cublas_chain=diff, **p))
                print(f"chain {dname} {role:5s} {provider:6s} {variant:16s} {p['us_p50']:.2f} us/GEMM "
                      f"(end of chain vs cuBLAS: rel diff {diff:.1e})", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--dtypes", default="fp16")
    ap.add_argument("--block-n", default="32,64,96,128")
    ap.add_argument("--clusters", default="1,7", help="CTAs per cluster sharing a weight tile (1 = no multicast)")
    ap.add_argument("--parts", default="check,repeat,chain", help="comma list of check, repeat, chain")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--chain-mb", type=int, default=80, help="MB of distinct weights per chain (L2: 50 MB)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        print("bench/wgmma_gemm.py needs an SM90 CUDA device (wgmma, TMA)")
        return 2
    mod = _module()
    env = env_info()
    dtypes = args.dtypes.split(",")
    block_ns = [int(x) for x in args.block_n.split(",")]
    clusters = [int(x) for x in args.clusters.split(",")]
    parts = args.parts.split(",")
    rows, ok = [], True
    if "check" in parts:
        r, ok = check(mod, env, dtypes, block_ns, clusters)
        rows += r
    if "repeat" in parts:
        rows += repeat_rows(mod, env, dtypes, block_ns, clusters, args.calls, args.repeats)
    if "chain" in parts:
        rows += chain_rows(mod, env, dtypes, block_ns, clusters, args.chain_mb, args.rounds, args.repeats)
    os.makedirs(args.out, exist_ok=True)
    upsert_rows(os.path.join(args.out, "wgmma_gemm.json"), rows)
    timed = [r for r in rows if r.get("us_p50") is not None]
    table = markdown_table(timed, row_key=lambda r: f"{r['dtype']} {r['shape'].get('role', '')} {r['shape']['mode']} "
                                                    f"M={r['shape']['M']} N={r['shape']['N']}",
                           col_key=lambda r: f"{r['provider']} {r['variant']}".strip(), value=fmt_us,
                           row_title="dtype role mode shape")
    given = argv if argv is not None else sys.argv[1:]
    command = "python3 bench/wgmma_gemm.py " + " ".join(shlex.quote(a) for a in given)
    with open(os.path.join(args.out, "wgmma_gemm.md"), "w") as f:
        f.write("# Stand-alone wgmma + TMA GEMM vs cuBLAS, µs per GEMM (p50, CUDA graph)\n\n"
                + ("checks: all passed\n\n" if ok else "checks: SOME FAILED (see the log)\n\n") + table + "\n"
                + provenance_footer(timed or rows, command))
    print(table)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
