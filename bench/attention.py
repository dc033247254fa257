"""Benchmark ``torch_cfm.cfm_attention`` against its peers at the docs/design.md §7 shapes (H=8, D=64).

µs per call inside a CUDA graph (and eager), ragged key lengths (uniform in [K/2, K], fixed seed),
fresh random inputs, fp16 / bf16 / fp32-tf32 / fp32-ieee, all providers in one run:

    torch_cfm                      the op (variant "" contiguous q/k/v; "kv_cache_view": q a transposed
                                   (N, Q, H, D) view, k/v the halves of an interleaved (N, H, K, 2D) cache)
    sdpa_default_mask              F.scaled_dot_product_attention with a dense bool mask (its own choice)
    sdpa_efficient_mask            ... forced to the memory-efficient backend
    sdpa_cudnn_mask                ... forced to cuDNN (an ``error`` row where it does not run)
    flex_compiled_blockmask        torch.compile(flex_attention) with a block mask from the key lengths
    sdpa_flash_NOMASK_lowerbound   flash backend WITHOUT the mask: a reference floor, not a peer

Rows are upserted into ``<out>/attention.json`` (``<out>/attention_sweep.json`` for ``--sweep``),
which regenerates ``<out>/attention.md`` from the whole file (bench/_harness.py); this run's table
(shape × provider, p50 µs inside a CUDA graph) is printed.

    python3 bench/attention.py                 # everything (the lead's full run)
    python3 bench/attention.py --quick         # torch_cfm + sdpa_cudnn_mask, 2 shapes, fp16
    python3 bench/attention.py --sweep         # time the kernel's tile/split variants per shape
    python3 bench/attention.py --out "$OUT"    # on the device machine: only $OUT comes back
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import time
import traceback
from typing import Callable, ContextManager, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import (dry_run_timer, env_info, fmt_us, make_row, markdown_table, provenance_footer,  # noqa: E402
                      rel_err, time_cuda_graph, time_eager, upsert_rows)

import torch_cfm  # noqa: E402
from torch_cfm import policy  # noqa: E402
from torch_cfm.config import ATTENTION_BENCH_SHAPES  # noqa: E402
from torch_cfm.reference.cfm_attention import cfm_attention_reference  # noqa: E402

OP = "cfm_attention"
HEADS, HEAD_DIM = 8, 64
DTYPES: dict[str, tuple[torch.dtype, Optional[str]]] = {
    "fp16": (torch.float16, None),
    "bf16": (torch.bfloat16, None),
    "fp32-tf32": (torch.float32, "tf32"),
    "fp32-ieee": (torch.float32, "ieee"),
}
PROVIDERS = ("torch_cfm", "torch_cfm_triton", "sdpa_default_mask", "sdpa_efficient_mask", "sdpa_cudnn_mask",
             "flex_compiled_blockmask", "sdpa_flash_NOMASK_lowerbound")
QUICK_SHAPES = ((8, 50, 450), (32, 50, 450))
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DEVICE = "cuda"  # "cpu" only for --dry-run (a CPU smoke test of this script, no timing)


def make_inputs(n: int, q_len: int, k_len: int, dtype: torch.dtype, seed: int = 0) -> dict:
    """Fresh random q/k/v (never zeros), ragged key lengths in [K/2, K], the masks the peers need."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(n, HEADS, q_len, HEAD_DIM, device=DEVICE, dtype=dtype, generator=g)
    k = torch.randn(n, HEADS, k_len, HEAD_DIM, device=DEVICE, dtype=dtype, generator=g)
    v = torch.randn(n, HEADS, k_len, HEAD_DIM, device=DEVICE, dtype=dtype, generator=g)
    lengths = torch.randint(k_len // 2, k_len + 1, (n,), device=DEVICE, dtype=torch.int32, generator=g)
    keep = torch.arange(k_len, device=DEVICE)[None, :] < lengths[:, None]  # (N, K)
    mask4 = keep[:, None, None, :].expand(n, 1, q_len, k_len).contiguous()
    # the DiT's layouts: q a transposed (N, Q, H, D) buffer, k/v halves of one (N, H, K, 2D) cache
    q_nqhd = q.transpose(1, 2).contiguous()
    cache = torch.cat([k, v], dim=-1).contiguous()
    ref64 = cfm_attention_reference(q.double(), k.double(), v.double(), key_lengths=lengths)
    return dict(q=q, k=k, v=v, lengths=lengths, mask4=mask4, q_view=q_nqhd.transpose(1, 2),
                k_view=cache[..., :HEAD_DIM], v_view=cache[..., HEAD_DIM:], ref64=ref64, n=n)


def _sdpa_ctx(backend_name: Optional[str]) -> Callable[[], ContextManager]:
    if backend_name is None:
        return contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    return lambda: sdpa_kernel([backend])


_FLEX_COMPILED = None


def _flex(inp: dict):
    global _FLEX_COMPILED
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _FLEX_COMPILED is None:
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 256)
        _FLEX_COMPILED = torch.compile(flex_attention, dynamic=False)
    lengths = inp["lengths"]

    def key_valid(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]

    n, _, q_len, _ = inp["q"].shape
    block_mask = create_block_mask(key_valid, n, None, q_len, inp["k"].shape[2], device=DEVICE)
    q, k, v = inp["q"], inp["k"], inp["v"]
    return lambda: _FLEX_COMPILED(q, k, v, block_mask=block_mask)


def provider_fns(name: str, inp: dict, precision: Optional[str]) -> list[tuple[str, Callable, Callable]]:
    """(variant, fn, context factory) triples of one provider; raises when it cannot run."""
    q, k, v, lengths, mask4 = inp["q"], inp["k"], inp["v"], inp["lengths"], inp["mask4"]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    prec = precision or "auto"
    if name == "torch_cfm":
        qv, kv, vv = inp["q_view"], inp["k_view"], inp["v_view"]
        return [
            ("", lambda: torch_cfm.cfm_attention(q, k, v, key_lengths=lengths, precision=prec), contextlib.nullcontext),
            ("kv_cache_view", lambda: torch_cfm.cfm_attention(qv, kv, vv, key_lengths=lengths, precision=prec),
             contextlib.nullcontext),
        ]
    if name == "torch_cfm_triton":  # the op forced onto its Triton kernel (TORCH_CFM_ATTENTION_KERNEL=triton)
        return [("", lambda: torch_cfm.cfm_attention(q, k, v, key_lengths=lengths, precision=prec),
                 lambda: _env(policy.ENV_ATTENTION_KERNEL, "triton"))]
    if name == "sdpa_default_mask":
        return [("", lambda: sdpa(q, k, v, attn_mask=mask4), contextlib.nullcontext)]
    if name == "sdpa_efficient_mask":
        return [("", lambda: sdpa(q, k, v, attn_mask=mask4), _sdpa_ctx("EFFICIENT_ATTENTION"))]
    if name == "sdpa_cudnn_mask":
        return [("", lambda: sdpa(q, k, v, attn_mask=mask4), _sdpa_ctx("CUDNN_ATTENTION"))]
    if name == "sdpa_flash_NOMASK_lowerbound":
        return [("", lambda: sdpa(q, k, v), _sdpa_ctx("FLASH_ATTENTION"))]
    if name == "flex_compiled_blockmask":
        return [("", _flex(inp), contextlib.nullcontext)]
    raise ValueError(f"unknown provider {name!r}")


@contextlib.contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@contextlib.contextmanager
def tf32_policy(precision: Optional[str]):
    """Peers follow torch's TF32 switches: on for "tf32", off for "ieee" (restored afterwards)."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    if precision is not None:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = precision == "tf32"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def shape_dict(n: int, q_len: int, k_len: int) -> dict:
    return {"N": n, "H": HEADS, "Q": q_len, "K": k_len, "D": HEAD_DIM}


def run_bench(shapes, dtypes, providers, args, env) -> list[dict]:
    rows: list[dict] = []
    timings = ["cuda_graph"] + ([] if args.no_eager else ["eager"])
    for (n, q_len, k_len) in shapes:
        for dname in dtypes:
            dtype, precision = DTYPES[dname]
            inp = make_inputs(n, q_len, k_len, dtype)
            first = len(rows)
            with tf32_policy(precision):
                for prov in providers:
                    base = dict(op=OP, provider=prov, shape=shape_dict(n, q_len, k_len),
                                dtype=str(dtype).replace("torch.", ""), precision=precision)
                    try:
                        fns = provider_fns(prov, inp, precision)
                    except Exception as exc:  # a provider that cannot even be built gets an error row
                        for timing in timings:
                            rows.append(make_row(env, **base, variant="", timing=timing, error=repr(exc)[:300]))
                        continue
                    for variant, fn, ctx in fns:
                        err = None
                        try:
                            with ctx():
                                out = fn()
                            torch.cuda.synchronize()
                            r_err = None if "NOMASK" in prov else rel_err(out, inp["ref64"])
                        except Exception as exc:
                            err, r_err = repr(exc)[:300], None
                        for timing in timings:
                            row = make_row(env, **base, variant=variant, timing=timing, rel_err=r_err, error=err)
                            if err is None:
                                try:
                                    timer = time_cuda_graph if timing == "cuda_graph" else time_eager
                                    row.update(timer(fn, calls=args.calls, repeats=args.repeats, context=ctx))
                                except Exception as exc:
                                    row["error"] = repr(exc)[:300]
                            rows.append(row)
                        tag = f"{prov}{'/' + variant if variant else ''}"
                        g = next(r for r in rows[::-1] if r["provider"] == prov and r["variant"] == variant
                                 and r["timing"] == "cuda_graph")
                        print(f"  {n:>2},{q_len:>3},{k_len:>3} {dname:<9} {tag:<32} graph p50 {fmt_us(g):>6} µs"
                              f"  rel_err {r_err if r_err is None else f'{r_err:.2e}'}"
                              + (f"  ERROR {err}" if err else ""), flush=True)
            # saved per shape: a run cut short by its time limit keeps what it measured
            upsert_rows(os.path.join(args.out, "attention.json"), rows[first:])
            del inp
            torch.cuda.empty_cache()
    return rows


def sweep_configs(dtype: torch.dtype, precision: Optional[str]):
    """Kernel variants the sweep times (the rule's candidates and their neighbours)."""
    from dataclasses import replace

    from torch_cfm.kernels.cfm_attention import AttentionConfig as C

    if dtype != torch.float32:
        return [C(64, 64, 1, 4, 3, pdl=False), C(64, 64, 1, 4, 3, pdl=True), C(64, 64, 2, 4, 3, pdl=True),
                C(64, 64, 2, 4, 3, pdl=True, merge="last"), C(64, 64, 2, 4, 2, pdl=True, merge="last"),
                C(64, 64, 2, 4, 3, pdl=False, merge="last"), C(64, 64, 3, 4, 3, pdl=True, merge="last"),
                C(64, 64, 1, 8, 3, pdl=True),
                # 128-key steps: half the serial softmax/wgmma round trips per program
                C(64, 128, 1, 4, 2, pdl=True), C(64, 128, 1, 4, 3, pdl=True), C(64, 128, 1, 8, 2, pdl=True),
                C(64, 64, 1, 4, 4, pdl=True)]
    if precision == "tf32":
        return [C(32, 64, 1, 4, 3, pdl=False), C(32, 64, 1, 4, 3, pdl=True), C(32, 64, 1, 4, 2, peel=False),
                C(32, 64, 2, 4, 3, pdl=True), C(32, 64, 2, 4, 3, merge="last"), C(32, 64, 2, 4, 2, merge="last"),
                C(16, 64, 2, 4, 2, merge="last"), C(16, 64, 1, 4, 3),
                C(32, 64, 1, 8, 3, pdl=True), C(32, 64, 1, 8, 2, pdl=True),  # 2 warps per scheduler
                # 64-query tiles: wgmma for both tf32 dots (32-query tiles get mma.sync)
                C(64, 64, 1, 4, 2, pdl=True), C(64, 64, 1, 4, 3, pdl=True), C(64, 32, 1, 4, 3, pdl=True),
                # wgmma tiles split in 2 key halves (the q32 grid's 128 programs, half the walk each)
                C(64, 64, 2, 4, 2, pdl=True, merge="last"), C(64, 64, 2, 4, 3, pdl=True, merge="last"),
                C(64, 32, 2, 4, 3, pdl=True, merge="last"),
                # 128-key steps: half the serial round trips
                C(32, 128, 1, 4, 2, pdl=True), C(64, 128, 1, 8, 2, pdl=True), C(32, 32, 1, 4, 3, pdl=True)]
    ieee = [C(32, 64, 1, 4, 2, pdl=False), C(32, 64, 1, 4, 2, pdl=True), C(16, 64, 1, 4, 2),
            C(16, 64, 2, 4, 2, merge="last"), C(32, 64, 2, 4, 2, merge="last")]
    return ieee + [replace(c, qk_slab=32) for c in ieee]  # q·k in 32-wide head-dim slices


def run_sweep(shapes, dtypes, args, env) -> list[dict]:
    from dataclasses import replace

    from torch_cfm.kernels import cfm_attention_cuda as cuda_kernel
    from torch_cfm.kernels.cfm_attention import choose_config, cfm_attention_triton
    from torch_cfm.kernels._launch import sm_count

    rows: list[dict] = []
    for (n, q_len, k_len) in shapes:
        for dname in dtypes:
            dtype, precision = DTYPES[dname]
            inp = make_inputs(n, q_len, k_len, dtype)
            q, k, v, lengths = inp["q"], inp["k"], inp["v"], inp["lengths"]
            out = torch.empty(n, q_len, HEADS, HEAD_DIM, device=DEVICE, dtype=dtype).transpose(1, 2)
            chosen = choose_config(dtype, HEAD_DIM, n * HEADS, q_len, k_len, sm_count(q.device), precision)
            results = []
            candidates = []
            for cfg in sweep_configs(dtype, precision):
                for splits in sorted({cfg.splits} | set(args.sweep_splits)):
                    if splits > 1 and splits * cfg.block_k > k_len:
                        continue
                    candidates.append(replace(cfg, splits=splits))
            if chosen not in candidates:
                candidates.append(chosen)
            cuda_candidates = []
            if precision != "ieee":  # the CUDA kernel's configs (csrc/cuda/), where it is built
                cuda_candidates = list(cuda_kernel.runnable_configs(dtype, q.device))
                if cuda_kernel.not_supported_reasons(q, k, v, precision):
                    cuda_candidates = []
            cuda_chosen = cuda_kernel.choose_config(dtype, n * HEADS, q_len, k_len, sm_count(q.device))
            for cfg in candidates + cuda_candidates:
                if isinstance(cfg, cuda_kernel.CudaAttentionConfig):
                    fn = (lambda cfg=cfg: cuda_kernel.cfm_attention_cuda(q, k, v, lengths, None, None, out, cfg))
                else:
                    fn = (lambda cfg=cfg: cfm_attention_triton(q, k, v, lengths, None, None, precision, out,
                                                               config=cfg))
                row = make_row(env, op=OP, provider="torch_cfm", variant="sweep:" + cfg.name,
                               shape=shape_dict(n, q_len, k_len), dtype=str(dtype).replace("torch.", ""),
                               precision=precision, timing="cuda_graph")
                try:
                    out.fill_(float("nan"))
                    fn()
                    torch.cuda.synchronize()
                    row["rel_err"] = rel_err(out, inp["ref64"])
                    row.update(time_cuda_graph(fn, calls=args.calls, repeats=args.sweep_repeats))
                except Exception as exc:
                    row["error"] = repr(exc)[:300]
                rows.append(row)
                if row["error"] is None:
                    results.append((row["us_p50"], cfg, row["rel_err"]))
            results.sort(key=lambda t: t[0])
            chosen_us = next((us for us, c, _ in results if c == chosen), float("nan"))
            cuda_us = next((us for us, c, _ in results if c == cuda_chosen), float("nan"))
            best = ", ".join(f"{c.name}={us:.2f}" for us, c, _ in results[:4])
            bad = [c.name for _, c, e in results if not (e is not None and e < 5e-2)]
            cuda_part = f" cuda rule {cuda_chosen.name}={cuda_us:.2f}" if cuda_chosen in cuda_candidates else ""
            line = (f"{n:>2},{q_len:>3},{k_len:>3} {dname:<9} heuristic {chosen.name}={chosen_us:.2f}{cuda_part}"
                    f"  best: {best}"
                    + (f"  BAD rel_err: {bad}" if bad else ""))
            print(line, flush=True)
            del inp
            # saved as it goes: a run cut short by its time limit still leaves its numbers
            upsert_rows(os.path.join(args.out, "attention_sweep.json"), rows[-len(candidates + cuda_candidates):])
    return rows


def write_table(rows: list[dict], out_dir: str, command: str) -> str:
    """This run's table (printed); ``<out_dir>/attention.md`` is generated from the data file."""
    graph_rows = [r for r in rows if r["timing"] == "cuda_graph" and not str(r.get("variant", "")).startswith("sweep")]

    def row_key(r):
        s = r["shape"]
        prec = f"-{r['precision']}" if r["precision"] else ""
        return f"{s['N']},{s['Q']},{s['K']} {r['dtype']}{prec}"

    def col_key(r):
        return r["provider"] + (f" ({r['variant']})" if r["variant"] else "")

    table = markdown_table(graph_rows, row_key, col_key, fmt_us, row_title="N,Q,K dtype")
    eager_rows = [r for r in rows if r["timing"] == "eager"]
    text = (f"# cfm_attention, µs per call (p50) inside a CUDA graph, H={HEADS}, D={HEAD_DIM}, ragged lengths\n\n"
            f"{table}\n")
    if eager_rows:
        text += ("\n## eager (no graph), p50 µs\n\n"
                 + markdown_table(eager_rows, row_key, col_key, fmt_us, row_title="N,Q,K dtype") + "\n")
    text += provenance_footer(rows, command)
    return text


def _enable_dry_run() -> None:
    """Run every code path on CPU: one call instead of timing, synchronize as a no-op."""
    global DEVICE, time_cuda_graph, time_eager

    DEVICE = "cpu"
    time_cuda_graph = time_eager = dry_run_timer
    torch.cuda.synchronize = lambda *a, **k: None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="torch_cfm + sdpa_cudnn_mask at 2 shapes, fp16")
    ap.add_argument("--sweep", action="store_true", help="time the kernel's tile/split variants per shape")
    ap.add_argument("--out", default=DEFAULT_OUT, help="directory of attention.json / attention.md")
    ap.add_argument("--shapes", default=None, help="N,Q,K;N,Q,K... (default: docs/design.md §7 shapes)")
    ap.add_argument("--dtypes", default=None, help=f"comma list of {tuple(DTYPES)}")
    ap.add_argument("--providers", default=None, help=f"comma list of {PROVIDERS}")
    ap.add_argument("--flex-dtypes", default=None,
                    help="dtypes for which flex runs (it compiles per shape and dtype; default: all)")
    ap.add_argument("--calls", type=int, default=20, help="calls per captured graph")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--sweep-repeats", type=int, default=15)
    ap.add_argument("--sweep-splits", default="", help="extra split counts for every swept tile, e.g. 1,2,4")
    ap.add_argument("--no-eager", action="store_true")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU smoke test of this script (needs TRITON_INTERPRET=1; fake timings)")
    args = ap.parse_args(argv)
    args.sweep_splits = [int(x) for x in args.sweep_splits.split(",") if x]
    if args.dry_run:
        _enable_dry_run()
    elif not torch.cuda.is_available():
        print("bench/attention.py needs a CUDA device")
        return 2
    os.makedirs(args.out, exist_ok=True)
    shapes = ATTENTION_BENCH_SHAPES
    if args.shapes:
        shapes = tuple(tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";"))
    dtypes = list(DTYPES)
    providers = list(PROVIDERS)
    if args.quick:
        shapes, dtypes, providers = QUICK_SHAPES, ["fp16"], ["torch_cfm", "sdpa_cudnn_mask"]
    if args.dtypes:
        dtypes = args.dtypes.split(",")
    if args.providers:
        providers = args.providers.split(",")
    env = env_info()
    command = "python3 " + shlex.join([os.path.relpath(__file__)] + list(argv if argv is not None else sys.argv[1:]))
    t0 = time.time()
    if args.sweep:
        # bf16 shares fp16's tiles (same tensor-core path); sweep it only when asked for
        rows = run_sweep(shapes, dtypes if args.dtypes else ["fp16", "fp32-tf32", "fp32-ieee"], args, env)
        print(f"sweep: {len(rows)} rows in {time.time() - t0:.0f} s -> {args.out}/attention_sweep.json")
        return 0
    rows: list[dict] = []
    all_rows: list[dict] = []
    flex_dtypes = set(args.flex_dtypes.split(",")) if args.flex_dtypes else set(dtypes)
    for dname in dtypes:
        provs = [p for p in providers if p != "flex_compiled_blockmask" or dname in flex_dtypes]
        try:
            new = run_bench(shapes, [dname], provs, args, env)
        except Exception:
            traceback.print_exc()
            continue
        rows += new
        # saved per dtype: a run cut short by its time limit still leaves its numbers
        all_rows = upsert_rows(os.path.join(args.out, "attention.json"), new)
    print(write_table(rows, args.out, command))
    print(f"{len(rows)} rows in {time.time() - t0:.0f} s; {len(all_rows)} rows in {args.out}/attention.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
