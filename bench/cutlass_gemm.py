#!/usr/bin/env python3
"""The DiT body's block GEMMs at 32-128 rows on CUTLASS (``libtcfm_cutlass.so``) against cuBLAS, as % of
the GPU's measured dense peak.

Per dtype, rows (M = rows x 50 token rows; the conv taps rows x 52) and role (qkv, proj, conv, fc1 +
GELU, fc2; :func:`torch_cfm.kernels.cutlass_gemm.body_roles`): fresh random operands, cuBLAS called
as the body calls it (``addmm``, ``mm`` for the conv taps, ``_addmm_activation(use_gelu=True)`` for
fc1) and every CUTLASS config with that epilogue. A diagnostic role ``fc1_bias`` (fc1's shape with the
bias-only epilogue: ``addmm`` and every config) makes the cost of the GELU epilogue visible: its rows
sit under fc1's in the same table, and a line under the table gives fc1 - fc1_bias per provider.
Each result is checked against a float64 product
first (relative Frobenius error <= 2 x cuBLAS's own + 1e-6; a failing config is not timed), then timed
as µs per call in a CUDA graph of ``--calls`` calls, median of ``--repeats`` replays, twice: every call
on the same operands (``us_p50``: they stay in L2, as in ``bench/experiments/large_batch_probe.py``)
and each call on the next of several operand sets holding more than L2 together (``us_p50_rotated``:
weights from HBM, as in the body's step). The peak is an 8192^3 GEMM of the same dtype timed the same
way in the same run; ``floor_us`` = FLOPs / peak.

Rows (``op`` "cutlass_gemm", provider "cublas" or "cutlass", variant the config name, shape {role,
rows, M, N, K}) go to ``<out>/cutlass_gemm.json`` with provenance (GPU, torch, commit: env
``BENCH_COMMIT`` on a tree without .git, the run id, the library's path and sha256), and a table per
dtype to ``<out>/cutlass_gemm.md``.

    python3 bench/cutlass_gemm.py --so build_cutlass/libtcfm_cutlass.so --out "$OUT/cutlass" [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import os
import shlex
import sys
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from _harness import env_info, make_row, provenance_footer, rel_err, time_cuda_graph, upsert_rows  # noqa: E402


def _load_front_end():
    """torch_cfm/kernels/cutlass_gemm.py loaded by path: it needs only torch and ctypes, so this bench
    runs on a checkout whose C++ extension is not built."""
    name = "torch_cfm_cutlass_gemm"
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(os.path.dirname(HERE), "torch_cfm", "kernels", "cutlass_gemm.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


cg = _load_front_end()

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
PEAK_SIZE = 8192
ROTATE_BYTES = 120 << 20  # operand sets walked through per timing: more than the 50 MB L2


def measure_peak(dtype: torch.dtype, calls: int, repeats: int) -> float:
    """TFLOP/s of a PEAK_SIZE^3 GEMM (cuBLAS) in a CUDA graph."""
    n = PEAK_SIZE
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(n, n, device="cuda", dtype=dtype, generator=g)
    b = torch.randn(n, n, device="cuda", dtype=dtype, generator=g)
    c = torch.empty(n, n, device="cuda", dtype=dtype)
    t = time_cuda_graph(lambda: torch.mm(a, b, out=c), calls=calls, repeats=repeats)
    return 2.0 * n ** 3 / t["us_p50"] / 1e6


def operands(role: cg.Role, dtype: torch.dtype, seed: int):
    """Fresh (a, w, bias or None) on the GPU: a ~ N(0, 1), w ~ N(0, 1/K) (unit-scale outputs), bias ~ N(0, 0.1)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(role.m, role.k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(role.n, role.k, device="cuda", generator=g) * role.k ** -0.5).to(dtype)
    b = (torch.randn(role.n, device="cuda", generator=g) * 0.1).to(dtype) if role.bias else None
    return a, w, b


def reference(a, w, b, gelu: bool) -> torch.Tensor:
    ref = a.double() @ w.double().t()
    if b is not None:
        ref += b.double()
    return torch.nn.functional.gelu(ref, approximate="tanh") if gelu else ref


def cublas_call(a, w, b, out, gelu: bool):
    """The body's cuBLAS call for one role (dit_body.py: GELU in the cuBLASLt epilogue for fc1)."""
    if gelu:
        return lambda: torch._addmm_activation(b, a, w.t(), use_gelu=True, out=out)
    if b is not None:
        return lambda: torch.addmm(b, a, w.t(), out=out)
    return lambda: torch.mm(a, w.t(), out=out)


def bias_only(role: cg.Role) -> cg.Role:
    """The diagnostic twin of a GELU role: same shape and bias, no GELU (``<name>_bias``)."""
    return dataclasses.replace(role, name=f"{role.name}_bias", gelu=False)


def roles_at(nrows: int, names: list[str]) -> list[cg.Role]:
    """The body's roles at ``nrows`` rows that ``names`` asks for, each GELU role followed by its
    bias-only twin (:func:`bias_only`) where that is asked for too."""
    out = []
    for role in cg.body_roles(nrows):
        out += [role] if role.name in names else []
        if role.gelu and bias_only(role).name in names:
            out.append(bias_only(role))
    return out


def library_info(path: str) -> dict:
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    return {"library": os.path.relpath(path, os.getcwd()), "library_sha256": digest}


def operand_sets(role: cg.Role, dtype: torch.dtype, seed: int, rotate: int):
    """``rotate`` sets of (a, w, bias, out) (0: as many as hold >= ROTATE_BYTES together, at most 16)."""
    if rotate <= 0:
        per_set = (role.m * role.k + role.n * role.k + role.m * role.n) * torch.finfo(dtype).bits // 8
        rotate = min(16, max(2, -(-ROTATE_BYTES // per_set)))
    sets = []
    for i in range(rotate):
        a, w, b = operands(role, dtype, seed + i)
        sets.append((a, w, b, torch.empty(role.m, role.n, device="cuda", dtype=dtype)))
    return sets


def _caller(provider: str, cfg, role: cg.Role, path: str, workspace):
    """fn(a, w, b, out): one call of the provider (cuBLAS as the body calls it, or a CUTLASS config)."""
    if provider == "cublas":
        return lambda a, w, b, out: cublas_call(a, w, b, out, role.gelu)()
    return lambda a, w, b, out: cg.cutlass_linear(a, w, b, config=cfg, gelu=role.gelu, out=out, workspace=workspace,
                                                  path=path)


def _time(call, sets, timing) -> dict:
    """µs per call on set 0 every call ("hot": operands stay in L2) and walking through all sets."""
    hot = time_cuda_graph(lambda: call(*sets[0]), **timing)
    step = [0]

    def walk():
        step[0] = (step[0] + 1) % len(sets)
        return call(*sets[step[0]])

    cold = time_cuda_graph(walk, **timing)
    return {**hot, "us_p50_rotated": cold["us_p50"], "rotated_sets": len(sets)}


def role_rows(role, rows, dname, peak, cfgs, env, timing, prov, path, rotate) -> tuple[list, bool]:
    """cuBLAS and every CUTLASS config with the role's epilogue at one shape: checked on fresh random
    operands against float64, then timed (a config that fails the check is not timed)."""
    dtype = DTYPES[dname]
    seed = zlib.crc32(f"{role.name.removesuffix('_bias')}/{rows}/{dname}".encode())  # a _bias twin: its role's operands
    sets = operand_sets(role, dtype, seed, rotate)
    a, w, b, out = sets[0]
    ref = reference(a, w, b, role.gelu)
    shape = {"role": role.name, "rows": rows, "M": role.m, "N": role.n, "K": role.k}
    floor = role.flop / peak / 1e6
    base = dict(op="cutlass_gemm", shape=shape, dtype=dname, timing="cuda_graph", floor_us=round(floor, 3),
                peak_tflops=round(peak, 1), **prov)
    cublas_call(a, w, b, out, role.gelu)()
    cub_err = rel_err(out, ref)
    bound = 2 * cub_err + 1e-6
    rows_out, ok = [], True
    for provider, cfg in [("cublas", None)] + [("cutlass", c) for c in cfgs if c.gelu or not role.gelu]:
        variant = cfg.name if cfg else ""
        need = cg.workspace_bytes(cfg, role.m, role.n, role.k, dtype, role.gelu, path=path) if cfg else 0
        call = _caller(provider, cfg, role, path, torch.empty(need, dtype=torch.uint8, device="cuda") if need else None)
        out.fill_(float("nan"))
        try:
            call(a, w, b, out)
            torch.cuda.synchronize()
        except (RuntimeError, ValueError) as exc:
            print(f"{dname} rows={rows} {role.name} {variant}: {exc}", flush=True)
            rows_out.append(make_row(env, provider=provider, variant=variant, error=str(exc)[:300], **base))
            ok = False
            continue
        err = rel_err(out, ref)
        passed = bool(torch.isfinite(out).all()) and err <= bound
        ok &= passed
        t = _time(call, sets, timing) if passed else {}
        extra = {}
        if t:
            extra = {"tflops": round(role.flop / t["us_p50"] / 1e6, 1), "pct_peak": round(100 * floor / t["us_p50"], 1),
                     "pct_peak_rotated": round(100 * floor / t["us_p50_rotated"], 1)}
        rows_out.append(make_row(env, provider=provider, variant=variant, rel_err=err, rel_err_cublas=cub_err,
                                 passed=passed, workspace_bytes=need, **base, **t, **extra))
        print(f"{dname} rows={rows:<3d} {role.name:8s} {provider:7s} {variant:18s} "
              + (f"{t['us_p50']:8.2f} us ({extra['pct_peak']:5.1f}% peak), rotated {t['us_p50_rotated']:8.2f} us "
                 f"({extra['pct_peak_rotated']:5.1f}%)" if t else " not timed")
              + f"  err {err:.2e} (bound {bound:.2e}) {'ok' if passed else 'FAIL'}", flush=True)
    return rows_out, ok


def _cell(r) -> str:
    """Table cell: hot and rotated p50 µs with % of peak, or "-"."""
    if not (r and r.get("us_p50")):
        return "-"
    return f"{r['us_p50']:.2f} ({r['pct_peak']:.0f} %); {r['us_p50_rotated']:.2f} ({r['pct_peak_rotated']:.0f} %)"


def summary(rows: list, dname: str) -> str:
    """Markdown: per (role, rows) the floor, cuBLAS and the best CUTLASS config (µs, % of peak)."""
    lines = [f"## {dname}: µs per call (CUDA graph, p50) and % of measured dense peak; operands hot in L2, then "
             "rotated through more than L2 holds\n",
             "| role | rows | M x N x K | floor µs | cuBLAS µs (% peak) | best CUTLASS µs (% peak) | config | "
             "all configs (µs) |", "|---|---|---|---|---|---|---|---|"]
    keys = []
    for r in rows:
        if r["dtype"] == dname and r.get("variant") != "peak":
            key = (r["shape"]["role"], r["shape"]["rows"])
            keys += [key] if key not in keys else []
    for role, nrows in keys:
        group = [r for r in rows if r["dtype"] == dname and r.get("variant") != "peak"
                 and (r["shape"]["role"], r["shape"]["rows"]) == (role, nrows)]
        cub = next((r for r in group if r["provider"] == "cublas"), None)
        cut = sorted((r for r in group if r["provider"] == "cutlass" and r.get("us_p50")), key=lambda r: r["us_p50"])
        s = group[0]["shape"]
        best = cut[0] if cut else None
        others = ", ".join(f"{r['variant']} {r['us_p50']:.2f}" for r in cut)
        failed = [r["variant"] for r in group if r["provider"] == "cutlass" and not r.get("us_p50")]
        lines.append(f"| {role} | {nrows} | {s['M']} x {s['N']} x {s['K']} | {group[0]['floor_us']:.2f} | {_cell(cub)} "
                     f"| {_cell(best)} | {best['variant'] if best else '-'} | {others}"
                     + (f"; FAILED: {', '.join(failed)}" if failed else "") + " |")
    notes = epilogue_costs(rows, dname, keys)
    return "\n".join(lines) + "\n" + ("\n" + "\n".join(notes) + "\n" if notes else "")


def epilogue_costs(rows: list, dname: str, keys: list) -> list:
    """One line per (GELU role, rows) whose ``_bias`` twin was timed too: the GELU epilogue's cost,
    p50 µs with GELU minus without, for cuBLAS and each CUTLASS config timed in both."""
    def times(role, nrows):
        return {(r["provider"], r["variant"]): r["us_p50"] for r in rows
                if r["dtype"] == dname and r.get("us_p50") and r.get("variant") != "peak"
                and (r["shape"]["role"], r["shape"]["rows"]) == (role, nrows)}

    out = []
    for role, nrows in keys:
        if not role.endswith("_bias") or (role[:-len("_bias")], nrows) not in keys:
            continue
        gelu, plain = times(role[:-len("_bias")], nrows), times(role, nrows)
        both = [k for k in gelu if k in plain]
        if both:
            cost = ", ".join(f"{v or p} {gelu[(p, v)] - plain[(p, v)]:+.2f}" for p, v in both)
            out.append(f"GELU epilogue cost, {role[:-len('_bias')]} - {role} at {nrows} rows (µs): {cost}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--so", default=None, help=f"the library (default: ${cg.ENV_VAR}, else {cg.DEFAULT_PATH})")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--quick", action="store_true", help="fp16 only, rows 32 and 128, fewer repeats")
    ap.add_argument("--dtypes", default="fp16,bf16")
    ap.add_argument("--rows", default="32,64,128")
    ap.add_argument("--roles", default="qkv,proj,conv,fc1,fc1_bias,fc2",
                    help="roles to run; fc1_bias: fc1's shape with the bias-only epilogue (the GELU epilogue's cost)")
    ap.add_argument("--configs", default="", help="comma list of config names (default: all)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--rotate", type=int, default=0,
                    help="operand sets the rotated timing walks through (0: enough for 120 MB, at most 16)")
    args = ap.parse_args(argv)
    if args.quick:
        args.dtypes, args.rows, args.repeats, args.calls = "fp16", "32,128", 10, 10
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("bench/cutlass_gemm.py needs an SM90 (Hopper) GPU")
        return 2
    path = cg.library_path(args.so)
    if cg.load_library(path) is None:
        print(f"bench/cutlass_gemm.py: {cg.unavailable_reason(path)}")
        return 2
    cfgs = [c for c in cg.configs(path) if not args.configs or c.name in args.configs.split(",")]
    env = env_info()
    prov = library_info(path)  # env_info() carries the run id
    timing = dict(calls=args.calls, repeats=args.repeats)
    roles = args.roles.split(",")
    rows_all, ok = [], True
    for dname in args.dtypes.split(","):
        peak = measure_peak(DTYPES[dname], calls=5, repeats=max(5, args.repeats // 2))
        print(f"{dname} peak ({PEAK_SIZE}^3 cuBLAS GEMM): {peak:.1f} TFLOP/s", flush=True)
        rows_all.append(make_row(env, op="cutlass_gemm", provider="cublas", variant="peak", dtype=dname,
                                 shape={"role": "peak", "M": PEAK_SIZE, "N": PEAK_SIZE, "K": PEAK_SIZE},
                                 timing="cuda_graph", tflops=round(peak, 1),
                                 **prov))
        for nrows in [int(x) for x in args.rows.split(",")]:
            for role in roles_at(nrows, roles):
                got, good = role_rows(role, nrows, dname, peak, cfgs, env, timing, prov, path, args.rotate)
                rows_all += got
                ok &= good
    os.makedirs(args.out, exist_ok=True)
    upsert_rows(os.path.join(args.out, "cutlass_gemm.json"), rows_all, table=False)
    given = argv if argv is not None else sys.argv[1:]
    command = "python3 bench/cutlass_gemm.py " + " ".join(shlex.quote(a) for a in given)
    text = "# The DiT block GEMMs: CUTLASS configs against cuBLAS\n\n" + (
        "checks: all passed\n\n" if ok else "checks: SOME FAILED (see the log)\n\n")
    text += "\n".join(summary(rows_all, d) for d in args.dtypes.split(","))
    text += provenance_footer([r for r in rows_all if r.get("gpu")], command)
    with open(os.path.join(args.out, "cutlass_gemm.md"), "w") as f:
        f.write(text)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
