#!/usr/bin/env python3
"""Each GEMM role of one DiT block alone: v3's fused Triton GEMM vs the cuBLAS GEMM v1 runs.

The question it answers (bench/NOTES.md, "Next version"): how far is a Triton GEMM from cuBLAS at
M = N·T = 400 rows, per role, before any fusion is worth building on it. v3's
``_dit_fused_gemm_kernel`` (``kernels/dit_gemm.py``) averaged ~38 µs per launch at (8,50,400)
fp16 against cuBLAS's 4-6 µs, and the profile lumps its seven roles under one name.

Roles (C = 512, H·D = 512, MLP = 2048), each timed in a CUDA graph of ``--calls`` launches:

| role | v3 launch (A_MODE, EPI) | cuBLAS peer (v1's GEMM) |
|---|---|---|
| qkv | adaLN(h) prologue, q/k norm + cache epilogue (1, 2) | (M, C) × (C, 3·H·D) + bias |
| proj | plain A, residual + gate + row stats (0, 3) | (M, H·D) × (H·D, C) + bias |
| conv1 | implicit causal conv over adaLN(h) history (2, 4) | (N·(T+2), C) × (C, 3C) |
| conv2 | implicit conv over Mish(LN(u)) history (3, 3) | (N·(T+2), C) × (C, 3C) |
| fc1 | adaLN(h) prologue, GELU epilogue (1, 1) | (M, C) × (C, MLP) + bias, GELU epilogue |
| fc2 | plain A, residual + gate + row stats (0, 3) | (M, MLP) × (MLP, C) + bias |

Also ``plain_*`` rows: the same kernel as a plain GEMM (A_MODE 0, EPI 0) at each peer's shape,
which separates "Triton's main loop vs cuBLAS" from "the cost of the fused prologue/epilogue".
``--tiles "64,4,3;128,8,3"`` repeats the Triton rows per (BLOCK_M, num_warps, num_stages) override.
Rows (``op`` = "dit_gemm", ``variant`` = role[/tiles]) go to ``<out>/dit_gemm.json`` plus a
markdown table. ``--dry-run``: CPU, Triton interpreter, tiny sizes, no timing (smoke test).

    python3 bench/dit_gemm.py --shapes "8,50;32,50" --dtypes fp16,fp32-tf32
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from _harness import (dry_run_timer, env_info, fmt_us, make_row, markdown_table, provenance_footer,  # noqa: E402
                      tf32_context, time_cuda_graph, upsert_rows)

DTYPES = {"fp16": (torch.float16, "tf32"), "bf16": (torch.bfloat16, "tf32"), "fp32-tf32": (torch.float32, "tf32"),
          "fp32-ieee": (torch.float32, "ieee")}


def block_tensors(n: int, t: int, c: int, heads: int, head_dim: int, mlp: int, dtype: torch.dtype, device: str):
    """Inputs of one block's GEMMs with realistic values (row statistics consistent with h and u)."""
    from torch_cfm.kernels.dit_gemm import STAT_BN, stat_tiles

    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, scale=1.0, dt=torch.float32):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dt)

    m, inner, nt = n * t, heads * head_dim, stat_tiles(c)

    def stats(x: torch.Tensor) -> torch.Tensor:  # per-tile (sum, M2) partials, as EPI 3/4 write them
        tiles = x.view(m, nt, STAT_BN)
        s = tiles.sum(-1)
        return torch.stack([s, ((tiles - (s / STAT_BN)[..., None]) ** 2).sum(-1)], -1).contiguous()

    h, u = rnd(m, c), rnd(m, c)
    table = torch.cat([rnd(1, c, scale=0.1), 1 + rnd(1, c, scale=0.1), rnd(1, c, scale=0.5)], 1)  # shift|1+scale|gate
    return dict(
        m=m, inner=inner, h=h, hstats=stats(h), u=u, ustats=stats(u), table=table,
        ln=(1 + rnd(c, scale=0.1), rnd(c, scale=0.1)),
        qn=(1 + rnd(head_dim, scale=0.1, dt=dtype), rnd(head_dim, scale=0.1, dt=dtype)),
        kn=(1 + rnd(head_dim, scale=0.1, dt=dtype), rnd(head_dim, scale=0.1, dt=dtype)),
        w_qkv=rnd(3 * inner, c, scale=c ** -0.5, dt=dtype), b_qkv=rnd(3 * inner, scale=0.1, dt=dtype),
        w_proj=rnd(c, inner, scale=inner ** -0.5, dt=dtype), b_proj=rnd(c, scale=0.1, dt=dtype),
        w_c1=rnd(3 * c, c, scale=(3 * c) ** -0.5, dt=dtype), b_c1=rnd(c, scale=0.1, dt=dtype),
        w_c2=rnd(3 * c, c, scale=(3 * c) ** -0.5, dt=dtype), b_c2=rnd(c, scale=0.1, dt=dtype),
        w_fc1=rnd(mlp, c, scale=c ** -0.5, dt=dtype), b_fc1=rnd(mlp, scale=0.1, dt=dtype),
        w_fc2=rnd(c, mlp, scale=mlp ** -0.5, dt=dtype), b_fc2=rnd(c, scale=0.1, dt=dtype),
        attn_out=rnd(n, t, inner, dt=dtype), act=rnd(m, mlp, dt=dtype),
        conv_cache=rnd(n, 2 * c, 2, dt=dtype), new_conv=torch.empty(n, 2 * c, 2, device=device, dtype=dtype),
        q_out=torch.empty(n, t, heads, head_dim, device=device, dtype=dtype),
        valid=torch.full((n,), t, dtype=torch.int32, device=device),
    )


def triton_roles(x: dict, n: int, t: int, l_len: int, c: int, heads: int, head_dim: int, mlp: int, precision: str):
    """(role, zero-argument launch, None) of v3's six per-block GEMMs on the tensors of ``block_tensors``
    (their numerics are the test suite's: tests/test_dit_body.py, variant v3)."""
    from torch_cfm.kernels.dit_gemm import fused_gemm, linear_strides, tap_strides

    dtype, dev, m, inner = x["w_qkv"].dtype, x["h"].device, x["m"], x["inner"]
    new_att = torch.empty(n, heads, t + l_len, 2 * head_dim, device=dev, dtype=dtype)
    h_out, u_out = x["h"].clone(), torch.empty_like(x["u"])  # h_out is also the residual read (EPI 3)
    out_stats = torch.empty_like(x["hstats"])
    fbuf = torch.empty(m, mlp, device=dev, dtype=dtype)
    common = dict(m=m, t_len=t, c=c, valid=x["valid"], precision=precision)

    lin = linear_strides

    def taps(w):
        return tap_strides(w, c)

    tab = dict(table=x["table"])
    o3 = x["attn_out"]
    roles = [
        ("qkv", lambda: fused_gemm(w=x["w_qkv"], w_strides=lin(x["w_qkv"]), bias=x["b_qkv"], out=x["q_out"],
                                   nout=3 * inner, k=c, a_mode=1, epi=2, src=x["h"], sstats=x["hstats"], shift=0,
                                   scale=c, qk=(*x["qn"], *x["kn"], new_att), heads=heads, block_n=head_dim,
                                   **tab, **common)),
        ("proj", lambda: fused_gemm(w=x["w_proj"], w_strides=lin(x["w_proj"]), bias=x["b_proj"], out=h_out,
                                    nout=c, k=inner, a_mode=0, epi=3, a=o3, a_strides=o3.stride(), gate=2 * c,
                                    has_res=True, ostats=out_stats, **tab, **common)),
        ("conv1", lambda: fused_gemm(w=x["w_c1"], w_strides=taps(x["w_c1"]), bias=x["b_c1"], out=u_out, nout=c,
                                     k=3 * c, a_mode=2, epi=4, src=x["h"], sstats=x["hstats"], shift=0, scale=c,
                                     cnn=x["conv_cache"], emit=x["new_conv"], cnn_base=0, ostats=out_stats,
                                     **tab, **common)),
        ("conv2", lambda: fused_gemm(w=x["w_c2"], w_strides=taps(x["w_c2"]), bias=x["b_c2"], out=h_out, nout=c,
                                     k=3 * c, a_mode=3, epi=3, src=x["u"], sstats=x["ustats"], ln=x["ln"],
                                     cnn=x["conv_cache"], emit=x["new_conv"], cnn_base=c, gate=2 * c,
                                     has_res=True, ostats=out_stats, **tab, **common)),
        ("fc1", lambda: fused_gemm(w=x["w_fc1"], w_strides=lin(x["w_fc1"]), bias=x["b_fc1"], out=fbuf,
                                   out_strides=(t * mlp, mlp, 1), nout=mlp, k=c, a_mode=1, epi=1, src=x["h"],
                                   sstats=x["hstats"], shift=0, scale=c, **tab, **common)),
        ("fc2", lambda: fused_gemm(w=x["w_fc2"], w_strides=lin(x["w_fc2"]), bias=x["b_fc2"], out=h_out, nout=c,
                                   k=mlp, a_mode=0, epi=3, a=x["act"], a_strides=(t * mlp, mlp, 1), gate=2 * c,
                                   has_res=True, ostats=out_stats, **tab, **common)),
    ]
    return [(role, fn, None) for role, fn in roles]


def gemm_shapes(n: int, t: int, c: int, inner: int, mlp: int) -> dict[str, tuple[int, int, int, bool]]:
    """(M, K, N_out, GELU) of v1's cuBLAS GEMM for each role."""
    m, m_hist = n * t, n * (t + 2)
    return {"qkv": (m, c, 3 * inner, False), "proj": (m, inner, c, False), "conv1": (m_hist, c, 3 * c, False),
            "conv2": (m_hist, c, 3 * c, False), "fc1": (m, c, mlp, True), "fc2": (m, mlp, c, False)}


def plain_launches(shapes: dict, dtype: torch.dtype, device: str, precision: str, use_cublas: bool):
    """(role, launch, out) of a plain GEMM ``out = a @ w.T + bias`` (GELU for fc1) at each role's shape.

    The same seed gives both providers the same operands, so their outputs can be compared."""
    from torch_cfm.kernels.dit_gemm import fused_gemm, linear_strides

    g = torch.Generator(device="cpu").manual_seed(1)
    valid = torch.zeros(1, dtype=torch.int32, device=device)  # not read by A_MODE 0 / EPI 0-1
    launches = []
    for role, (m, k, nout, gelu) in shapes.items():
        a = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
        w = (torch.randn(nout, k, generator=g) * k ** -0.5).to(device=device, dtype=dtype)
        bias = (torch.randn(nout, generator=g) * 0.1).to(device=device, dtype=dtype)
        out = torch.empty(m, nout, device=device, dtype=dtype)
        if use_cublas:
            if gelu:
                launches.append((role, lambda a=a, w=w, b=bias, o=out: torch._addmm_activation(b, a, w.t(),
                                                                                               use_gelu=True, out=o),
                                 out))
            else:
                launches.append((role, lambda a=a, w=w, b=bias, o=out: torch.addmm(b, a, w.t(), out=o), out))
        else:
            # one "sequence" of m frames with row-major strides: the kernel's row-major fast paths
            launches.append((role, lambda a=a, w=w, b=bias, o=out, m=m, k=k, nout=nout, gelu=gelu: fused_gemm(
                w=w, w_strides=linear_strides(w), bias=b, out=o, out_strides=(m * nout, nout, 1), m=m,
                nout=nout, k=k, t_len=m, c=k, valid=valid, a_mode=0, epi=1 if gelu else 0, precision=precision,
                a=a, a_strides=(m * k, k, 1)), out))
    return launches


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="8,50;32,50", help="N,T pairs separated by ';' (L = --cache)")
    ap.add_argument("--cache", type=int, default=400, help="L, the attention cache frames (qkv writes T+L)")
    ap.add_argument("--dtypes", default="fp16,fp32-tf32", help=f"comma list of {sorted(DTYPES)}")
    ap.add_argument("--tiles", default="", help="Triton overrides 'BLOCK_M,num_warps,num_stages;...' (also timed)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--dry-run", action="store_true", help="CPU smoke test (TRITON_INTERPRET=1, tiny sizes)")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from torch_cfm.kernels import dit_gemm

    timer = dry_run_timer if args.dry_run else time_cuda_graph
    device = "cpu" if args.dry_run else "cuda"
    c, heads, head_dim, mlp = (64, 2, 32, 128) if args.dry_run else (512, 8, 64, 2048)
    shapes = [(1, 5)] if args.dry_run else [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";")]
    l_len = 4 if args.dry_run else args.cache
    tiles = [None] + [tuple(int(v) for v in s.split(",")) for s in args.tiles.split(";") if s]
    env = env_info()
    rows = []
    for n, t in shapes:
        for dname in args.dtypes.split(","):
            dtype, precision = DTYPES[dname]
            with tf32_context(dtype, precision, device)():  # cuBLAS follows torch's TF32 flag
                x = block_tensors(n, t, c, heads, head_dim, mlp, dtype, device)
                gshapes = gemm_shapes(n, t, c, x["inner"], mlp)
                timed = [("cublas", None, plain_launches(gshapes, dtype, device, precision, use_cublas=True))]
                for tile in tiles:
                    fused = triton_roles(x, n, t, l_len, c, heads, head_dim, mlp, precision)
                    timed.append(("triton_fused", tile, fused))
                    timed.append(("triton_plain", tile, plain_launches(gshapes, dtype, device, precision, False)))
                cublas_out = {role: out for role, _, out in timed[0][2]}
                for provider, tile, launches in timed:
                    for role, fn, out in launches:
                        dit_gemm.TILE_OVERRIDE.clear()
                        if tile:
                            dit_gemm.TILE_OVERRIDE.update(block_m=tile[0], num_warps=tile[1], num_stages=tile[2])
                        m, k, nout, _ = gshapes[role]
                        if provider == "triton_fused" and role.startswith("conv"):  # implicit conv: 3 taps in K
                            m, k, nout = n * t, 3 * c, c
                        variant = role + ("" if tile is None else "/m%d_w%d_s%d" % tile)
                        try:
                            timing = timer(fn, calls=args.calls, repeats=args.repeats)
                            error = None
                        except Exception as exc:  # a config that does not compile/launch: a row that says so
                            timing, error = {}, f"{type(exc).__name__}: {str(exc)[:160]}"
                        finally:
                            dit_gemm.TILE_OVERRIDE.clear()
                        err = None
                        if error is None and out is not None and provider != "cublas":  # plain Triton vs cuBLAS
                            ref = cublas_out[role].double()
                            err = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
                        rows.append(make_row(env, op="dit_gemm", provider=provider, variant=variant,
                                             shape={"N": n, "T": t, "M": m, "K": k, "N_out": nout}, dtype=dname,
                                             precision=precision if dtype == torch.float32 else None,
                                             timing="cuda_graph", error=error, rel_err_vs_cublas=err, **timing))
                        if not args.dry_run:
                            print(f"{n},{t} {dname} {provider:12s} {variant:18s} "
                                  + (f"{timing['us_p50']:.2f} us" if error is None else error)
                                  + ("" if err is None else f"  rel err vs cuBLAS {err:.1e}"), flush=True)
    os.makedirs(args.out, exist_ok=True)
    upsert_rows(os.path.join(args.out, "dit_gemm.json"), rows)
    table = markdown_table(rows, row_key=lambda r: f"{r['shape']['N']},{r['shape']['T']} {r['dtype']} {r['variant']}",
                           col_key=lambda r: r["provider"], value=fmt_us, row_title="N,T dtype role")
    given = argv if argv is not None else sys.argv[1:]
    command = "python3 bench/dit_gemm.py " + " ".join(shlex.quote(a) for a in given)
    with open(os.path.join(args.out, "dit_gemm.md"), "w") as f:
        f.write("# One DiT block's GEMMs alone, µs per launch (p50, CUDA graph)\n\n" + table + "\n"
                + provenance_footer(rows, command))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
