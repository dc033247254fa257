"""Benchmark one DiT estimator step and the whole 10-step CFG chunk solve (docs/design.md §7, issue 4).

op "dit_step", shape {N, T, L}: one estimator evaluation of a chunk of N rows (all rows full,
T new frames, L cached frames), µs per call inside a CUDA graph (and eager), providers:

    torch_cfm             the fused body op (packed weights, precomputed modulation table)
    torch_cfm/arena       variant "arena": the same body on the in-place cache arena (old keys
                          not copied; what every Euler step of the graph runner runs)
    torch_cfm/compiled    variant "compiled": torch.compile(backend="torch_cfm") of the reference
                          step, inside a CUDA graph (the compile rules swap the fused body in;
                          issue 5's target: within 5 % of torch_cfm/hook)
    torch_cfm/hook        variant "forward_chunk": DiT.forward_chunk(fused=True) (stages the input
                          and computes the table per call)
    reference_eager       DiT.forward_chunk(fused=False), eager
    reference_graph       the same inside a CUDA graph
    torch_compile_graph   torch.compile(mode="max-autotune-no-cudagraphs") of the reference step,
                          inside a CUDA graph (slow to compile: skipped with --quick)

op "cfm_solve_chunk", shape {B, N=2B, T, L}: the whole n-step CFG solve of a chunk:

    torch_cfm             GraphedArenaSolver: one graph replay per chunk of the arena solve the
                          server runs (keyed arena, appends in place), without the server's host
                          work
    torch_cfm/server      variant "server": CFMServer(graphs=True) in steady state — one
                          solve_chunk call (staging, graph replay of the whole solve
                          on the keyed arena: appends in place, the trim refills dropped frames,
                          mel copies) over ONE cache arena; ``arena_bytes`` is that arena,
                          ``peak_extra_bytes`` the peak above it. ``--server-variants`` adds
                          "server_copy" (append_in_place=False: rows copied out and back per
                          step)
    reference_eager       the reference module stepped in Python (CFG + Euler), eager
    reference_graph       that whole loop captured in one CUDA graph

Extra fields per row: ``kernels`` (CUDA kernels per step/solve, torch.profiler), ``floor_us`` (max
of the compute floor at docs/design.md §7 ceilings and the weight+cache traffic floor), ``floor_frac``,
``rel_err`` (velocity / mel vs a float64 run of the same module), ``arena_bytes`` and
``graph_pool_bytes`` (solve rows).

    python3 bench/dit_step.py --quick --out "$OUT"
    python3 bench/dit_step.py                      # everything (fp16, bf16, fp32-tf32, fp32-ieee)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import os
import shlex
import sys
import time
import traceback
from typing import Callable, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root (in-place build)
from _harness import (cuda_kernel_times, dry_run_timer, env_info, make_row, markdown_table, percentiles,  # noqa: E402
                      provenance_footer, rel_err, tf32_context, time_cuda_graph, time_eager, upsert_rows)

import torch_cfm.compile_rules  # noqa: E402,F401  registers backend "torch_cfm" (no entry point in an in-place build)
from torch_cfm.config import BODY_BENCH_SHAPES, DiTConfig, cosine_timesteps  # noqa: E402
from torch_cfm.kernels.body_plans import (NAMED, PDL_CAPABLE_KERNELS, PLAN_NAMES, body_plan,  # noqa: E402
                                         choose_variant, family, named_plan, use_plan)
from torch_cfm.models import random_dit  # noqa: E402
from torch_cfm.kernels.dit_body import dit_body_arena_into, dit_body_fused_into  # noqa: E402
from torch_cfm.models.fused_forward import stage_input  # noqa: E402
from torch_cfm.ops.dit_body import body_outputs as _empty_outputs, check_dit_body  # noqa: E402
from torch_cfm.packing import modulation_table, packed_for  # noqa: E402

DTYPES: dict[str, tuple[torch.dtype, Optional[str]]] = {
    "fp16": (torch.float16, None),
    "bf16": (torch.bfloat16, None),
    "fp32-tf32": (torch.float32, "tf32"),
    "fp32-ieee": (torch.float32, "ieee"),
}
PEAK_TFLOPS = {"fp16": 751.0, "bf16": 751.0, "fp32-tf32": 417.0, "fp32-ieee": 51.0}  # docs/design.md §7 ceilings
COPY_TBS = 4.25
PROVIDERS = ("torch_cfm", "torch_cfm/hook", "torch_cfm/compiled", "torch_cfm/server", "reference_eager", "reference_graph", "torch_compile_graph")
QUICK_SHAPES = ((8, 50, 400), (32, 50, 400))
# torch.compile(max-autotune) takes minutes per (shape, dtype): by default only the docs/design.md §7 anchors
COMPILE_SHAPES = ((8, 50, 400), (32, 50, 400))
COMPILE_DTYPES = ("fp16", "fp32-tf32")
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DEVICE = "cuda"
PARTIAL: Optional[str] = None  # jsonl file every row is appended to as soon as it is measured


def _row(env: dict, **fields) -> dict:
    """make_row + append to the partial jsonl (a timeout keeps what was measured)."""
    row = make_row(env, **fields)
    if PARTIAL:
        import json

        with open(PARTIAL, "a") as f:
            f.write(json.dumps(row) + "\n")
    return row


def floor_us(cfg: DiTConfig, n: int, t: int, l_len: int, dname: str, elem: int) -> float:
    """max(compute floor, memory floor) of one step in µs (docs/design.md §7 ceilings)."""
    c, hd, mlp = cfg.hidden, cfg.inner, cfg.mlp_hidden
    per_token = 2 * (3 * c * hd + hd * c + 2 * 3 * c * c + 2 * c * mlp)
    flops = cfg.depth * (n * t * per_token + 4 * n * cfg.heads * t * (t + l_len) * cfg.head_dim)
    flops += 2 * n * t * (cfg.in_channels * c + c * cfg.out_channels)
    weights = cfg.depth * (3 * c * hd + hd * c + 2 * 3 * c * c + 2 * c * mlp) * elem
    cache = cfg.depth * n * cfg.heads * (l_len + (t + l_len)) * 2 * cfg.head_dim * elem
    return max(flops / (PEAK_TFLOPS[dname] * 1e6), (weights + cache) / (COPY_TBS * 1e6))


def count_kernels(fn: Callable[[], object]) -> Optional[int]:
    """CUDA kernels launched by one call of ``fn`` (torch.profiler)."""
    if DEVICE != "cuda":
        return None
    return sum(cnt for name, (cnt, _) in cuda_kernel_times(fn).items() if not name.startswith(("Memcpy", "Memset")))


def kernel_breakdown(fn: Callable[[], object], path: str, top: int = 25) -> None:
    """Write the per-kernel CUDA time of one call of ``fn`` (torch.profiler) to ``path``."""
    if DEVICE != "cuda":
        return
    agg = cuda_kernel_times(fn)
    total = sum(v[1] for v in agg.values())
    lines = [f"total {total:.1f} us (eager, back-to-back kernels; excludes launch gaps)", "count  us_total  name"]
    for name, (cnt, us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"{cnt:5d} {us:9.1f}  {name}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def step_inputs(cfg: DiTConfig, n: int, t: int, l_len: int, dtype: torch.dtype, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(device=DEVICE, dtype=dtype)

    return dict(x=r(n, 80, t), mu=r(n, 80, t), cond=r(n, 80, t), spks=r(n, 80),
                t=torch.full((n,), 0.42, device=DEVICE), cnn=r(cfg.depth, n, 2 * cfg.hidden, 2),
                att=r(cfg.depth, n, cfg.heads, l_len, 2 * cfg.head_dim))


def tf32_ctx(dtype: torch.dtype, precision: Optional[str]):
    return tf32_context(dtype, precision, DEVICE)  # DEVICE: "cpu" in --dry-run


def step_providers(model, model_dtype, inp, dname, precision, variants=PLAN_NAMES):
    """(provider, variant, fn returning the velocity); ``variants``: the non-default bodies timed."""
    dtype = model_dtype
    fns = []
    packed = packed_for(model, dtype, torch.device(DEVICE))
    x_in = stage_input(inp["x"], inp["mu"], inp["spks"], inp["cond"], dtype)
    with tf32_ctx(dtype, precision)():
        table = modulation_table(packed, inp["t"][:1])
    s = check_dit_body(x_in, packed.body, table, inp["cnn"], inp["att"], None, None, precision or "auto")
    outs = _empty_outputs(x_in, s)

    def fused(variant=None):
        return lambda: dit_body_fused_into(x_in, packed.body, table, inp["cnn"], inp["att"], None, None, precision,
                                           outs, variant)[0]

    def hook():
        return model.forward_chunk(inp["x"], inp["mu"], inp["t"], inp["spks"], inp["cond"], inp["cnn"], inp["att"],
                                   fused=True)[0]

    def ref():
        return model.forward_chunk(inp["x"], inp["mu"], inp["t"], inp["spks"], inp["cond"], inp["cnn"], inp["att"],
                                   fused=False)[0]

    default = choose_variant(dtype, precision, x_in.shape[0])
    fns += [("torch_cfm", "", fused())]
    fns += [("torch_cfm", v, fused(v)) for v in NAMED[family(dtype, precision)] if v != default and v in variants]
    if "arena" in variants:  # the in-place cache arena (the runner's form): the old keys are not copied
        from torch_cfm.models.cache import reverse_keys

        n_rows, t_len = x_in.shape[0], x_in.shape[2]
        l_len = 0 if inp["att"] is None else inp["att"].shape[3]
        arena = outs[2].new_zeros(outs[2].shape[:3] + (l_len + t_len, outs[2].shape[4]))
        full = torch.full((n_rows,), l_len, dtype=torch.int32, device=x_in.device)
        if l_len:
            arena[..., :l_len, :] = reverse_keys(inp["att"], full)
        fns += [("torch_cfm", "arena", lambda: dit_body_arena_into(x_in, packed.body, table, inp["cnn"], arena, None,
                                                                   full, precision, outs[:2])[0])]
    def compiled():
        step = torch.compile(lambda *a: model.forward_chunk(*a), backend="torch_cfm")  # rules decide
        args = (inp["x"], inp["mu"], inp["t"], inp["spks"], inp["cond"], inp["cnn"], inp["att"])
        return lambda: step(*args)[0]

    fns += [("torch_cfm", "forward_chunk", hook)]
    if DEVICE == "cuda":
        fns += [("torch_cfm", "compiled", compiled())]
    fns += [("reference_eager", "", ref), ("reference_graph", "", ref)]
    return fns


def _provider_name(provider: str, variant: str) -> str:
    """The --providers name of a (provider, variant) pair."""
    return {"forward_chunk": "torch_cfm/hook", "compiled": "torch_cfm/compiled"}.get(variant, provider)


def run_steps(cfg, shapes, dnames, providers, args, env, base) -> list[dict]:
    rows = []
    for n, t, l_len in shapes:
        ref64 = None
        if DEVICE == "cuda":
            try:
                m64 = copy.deepcopy(base).to(device=DEVICE, dtype=torch.float64)
                i64 = step_inputs(cfg, n, t, l_len, torch.float64)
                with torch.no_grad():
                    ref64 = m64.forward_chunk(i64["x"], i64["mu"], i64["t"], i64["spks"], i64["cond"], i64["cnn"],
                                              i64["att"], fused=False)[0]
                del m64
            except Exception:  # noqa: BLE001
                traceback.print_exc()
        for dname in dnames:
            dtype, precision = DTYPES[dname]
            model = copy.deepcopy(base).to(device=DEVICE, dtype=dtype)
            inp = step_inputs(cfg, n, t, l_len, dtype)
            ctx = tf32_ctx(dtype, precision)
            shape = {"N": n, "T": t, "L": l_len}
            fl = floor_us(cfg, n, t, l_len, dname, torch.finfo(dtype).bits // 8)
            fns = [f for f in step_providers(model, dtype, inp, dname, precision, args.variants)
                   if _provider_name(*f[:2]) in providers]
            if ("torch_compile_graph" in providers and not args.quick
                    and (args.compile_all or ((n, t, l_len) in COMPILE_SHAPES and dname in COMPILE_DTYPES))):
                fns.append(("torch_compile_graph", "", compile_step(model, inp)))
            for prov, variant, fn in fns:
                timing = "eager" if prov == "reference_eager" else "cuda_graph"
                row = dict(op="dit_step", provider=prov, variant=variant, shape=shape, dtype=dname.split("-")[0],
                           precision=precision, timing=timing, floor_us=round(fl, 2))
                try:
                    with torch.no_grad():
                        with ctx():
                            out = fn()
                        if ref64 is not None:
                            row["rel_err"] = rel_err(out.float(), ref64)
                        timer = time_eager if timing == "eager" else time_cuda_graph
                        row.update(timer(lambda: fn(), calls=args.calls, repeats=args.repeats, context=ctx))
                        if prov in ("torch_cfm", "reference_eager") and variant not in ("forward_chunk", "compiled"):
                            with ctx():
                                row["kernels"] = count_kernels(fn)
                                if prov == "torch_cfm":
                                    kernel_breakdown(fn, os.path.join(
                                        args.out, f"dit_step_kernels_{n}x{t}x{l_len}_{dname}_{variant or 'default'}.txt"))
                    if row.get("us_p50"):
                        row["floor_frac"] = round(fl / row["us_p50"], 4)
                except Exception as exc:  # noqa: BLE001
                    traceback.print_exc()
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                rows.append(_row(env, **row))
                print(f"dit_step {shape} {dname} {prov}{('/' + variant) if variant else ''}: "
                      f"p50 {row.get('us_p50')} us, rel_err {row.get('rel_err')}, kernels {row.get('kernels')}",
                      flush=True)
            del model
            torch.cuda.empty_cache() if DEVICE == "cuda" else None
    return rows


# the fused_attention plan's attention + cache kernel (BodyPlan.attention_launch); {} = its defaults
SWEEP_FUSED_ATTENTION = ({}, {"num_warps": 8}, {"num_stages": 2}, {"block_k": 32}, {"block_c": 32}, {"block_c": 64},
                         {"copy_f": 32}, {"copy_f": 128}, {"block_k": 64}, {"block_c": 64, "copy_f": 128})


def _plan(plan_name: str, **changes):
    """Sweep plan factory: the dtype family's plan ``name`` ("table": the table's for the rows) with
    ``changes`` (BodyPlan fields), for :func:`torch_cfm.kernels.body_plans.use_plan`."""
    def make(dtype, precision, n_rows, arena):
        base = body_plan(dtype, precision, n_rows, arena=arena) if plan_name == "table" else \
            named_plan(plan_name, dtype, precision)
        return dataclasses.replace(base, **changes)
    return make


# --sweep-variants pdl: which of the body's own kernels launch with PDL (BodyPlan.pdl)
SWEEP_PDL = {"none": frozenset(), "rownorm": frozenset({"rownorm", "cfg_euler"}),
             "rownorm_qk": frozenset({"rownorm", "cfg_euler", "qk_cache"}),
             "all": PDL_CAPABLE_KERNELS}
# --sweep-variants wgmma: the cublas plan against the wgmma plan (its GEMMs on the wgmma kernel) under these
# PDL sets
SWEEP_WGMMA_PDL = {"none": frozenset(), "linear": frozenset({"linear"}),
                "linear_rownorm": frozenset({"linear", "rownorm", "cfg_euler"}),
                "linear_rownorm_qk": frozenset({"linear", "rownorm", "cfg_euler", "qk_cache"})}

# --sweep-variants cutlass_pdl: PDL sets of the CUTLASS arena plan (shipped: none)
SWEEP_CUTLASS_PDL = {"none": frozenset(), "linear": frozenset({"linear"}),
                     "rownorm": frozenset({"rownorm", "cfg_euler"}),
                     "linear_rownorm": frozenset({"linear", "rownorm", "cfg_euler"}),
                     "linear_rownorm_qk": frozenset({"linear", "rownorm", "cfg_euler", "qk_cache"})}

# --sweep-variants rownorm: (rows per program, num_warps) of the row-norm kernel; (1, 4) is the shipped rule
SWEEP_ROWNORM = ((1, 4), (1, 1), (1, 2), (2, 2), (2, 4), (4, 4), (2, 8), (4, 8))

# --sweep-variants fc2: (splits, BN) of the wgmma plan's split-K fc2 (BodyPlan.fc2_splitk)
SWEEP_FC2_SPLITK = ((4, 128), (8, 128), (4, 64), (8, 64))


def sweep_plans(swept: set) -> list:
    """(provider variant, row tag, plan factory) of each swept plan."""
    plans = []
    if "fused_attention" in swept:
        plans += [("default", "sweep_fused_attention_" + ("_".join(f"{k}{v}" for k, v in over.items()) or "default"),
                   _plan("fused_attention", attention_launch=tuple(over.items()))) for over in SWEEP_FUSED_ATTENTION]
    if "pdl" in swept:
        plans += [("default", f"sweep_{v}_pdl_{name}", _plan(v, pdl=kernels)) for v in ("cublas", "fused_attention")
                  for name, kernels in SWEEP_PDL.items() if name != ("all" if v == "cublas" else "rownorm_qk")]
    if "wgmma" in swept:
        plans += [("default", "sweep_cublas_pdl_none", _plan("cublas", pdl=frozenset()))]
        plans += [("default", f"sweep_wgmma_pdl_{name}", _plan("wgmma", pdl=kernels))
                  for name, kernels in SWEEP_WGMMA_PDL.items()]
    if "fc2" in swept:  # the wgmma plan's MLP GEMMs on cuBLAS or the wgmma kernel (fc2: split-K at each (splits, BN))
        plans += [("default", "sweep_cublas_pdl_none", _plan("cublas", pdl=frozenset())),
                  ("default", "sweep_wgmma_mlp_cublas", _plan("wgmma", fc1="cublas_gelu", fc2="cublas")),
                  ("default", "sweep_wgmma_fc1_cublas", _plan("wgmma", fc1="cublas_gelu"))]
        plans += [("default", f"sweep_wgmma_fc2_s{sp}_bn{bn}", _plan("wgmma", fc2_splitk=(sp, bn)))
                  for sp, bn in SWEEP_FC2_SPLITK]
    if "rownorm" in swept:  # the row-norm kernel's (rows per program, num_warps), on the table's plan
        plans += [(variant, f"sweep_{prefix}rownorm_r{r}_w{w}", _plan("table", rownorm_launch=(r, w)))
                  for variant, prefix in (("default", ""), ("arena", "arena_")) for r, w in SWEEP_ROWNORM]
    if "tf32" in swept:  # fp32-tf32 bodies: wgmma (the GEMM's TF32 form) against cublas, plain and on the arena
        plans += [("default", "sweep_tf32_cublas", _plan("cublas")),
                  ("default", "sweep_tf32_wgmma", _plan("wgmma", fc1="cublas_gelu", fc2="cublas")),
                  ("default", "sweep_tf32_wgmma_mlp", _plan("wgmma")),
                  ("arena", "sweep_tf32_arena_wgmma_mlp", _plan("wgmma")),
                  ("arena", "sweep_tf32_arena_cublas", _plan("cublas"))]
    if "arena_attention" in swept:  # the arena step: the table's arena plan against the fused attention kernel's
        # arena form (16-bit; at >= 32 rows the two differ in the attention role only)
        plans += [("arena", "sweep_arena_attention_table", _plan("table")),
                  ("arena", "sweep_arena_attention_fused_warp_rownorm", _plan("fused_attention_warp_rownorm"))]
    if "cutlass" in swept:  # the arena step: cutlass_warp_rownorm against its GEMMs on cuBLAS (cublas_warp_rownorm)
        plans += [("arena", "sweep_arena_cublas_warp_rownorm",
                   _plan("cutlass_warp_rownorm", name="cublas_warp_rownorm", qkv="cublas", proj="cublas",
                         conv="cublas", fc2="cublas", cutlass=None)),
                  ("arena", "sweep_arena_cutlass_warp_rownorm", _plan("cutlass_warp_rownorm"))]
    if "cutlass_pdl" in swept:  # the arena step on cutlass_warp_rownorm under PDL sets ("linear": its CUTLASS GEMMs)
        plans += [("arena", f"sweep_arena_cutlass_pdl_{name}", _plan("cutlass_warp_rownorm", pdl=kernels))
                  for name, kernels in SWEEP_CUTLASS_PDL.items()]
    if "qkv" in swept:  # the step on the in-place arena: wgmma's QKV GEMM with the q/k-cache epilogue or not; cublas
        plans += [("arena", "sweep_arena_wgmma_qkv_cache_on", _plan("wgmma", arena_qkv="wgmma_qk_cache")),
                  ("arena", "sweep_arena_wgmma_qkv_cache_off", _plan("wgmma", arena_qkv="qk_cache")),
                  ("arena", "sweep_arena_cublas", _plan("cublas"))]
    return plans


def run_sweep(cfg, shapes, dnames, args, env, base) -> list[dict]:
    """Time the body under each plan of :func:`sweep_plans` (run through ``body_plans.use_plan``).

    With ``--sweep-rounds R`` > 1 every plan is captured and timed R times, the plans in a new
    order each round and the graph's buffers at shifted addresses (a random-size allocation
    held across the capture): separate captures of one step differ by a few %, more than the
    changes an A/B looks for. A row's percentiles pool the repeats of all its rounds;
    ``round_p50s`` lists each round's median."""
    import random

    rows = []
    plans = sweep_plans(set(args.sweep_variants.split(",")))
    rng = random.Random(0)
    for n, t, l_len in shapes:
        for dname in dnames:
            dtype, precision = DTYPES[dname]
            model = copy.deepcopy(base).to(device=DEVICE, dtype=dtype)
            inp = step_inputs(cfg, n, t, l_len, dtype)
            providers = step_providers(model, dtype, inp, dname, precision, variants=PLAN_NAMES + ("arena",))
            default = choose_variant(dtype, precision, n)
            todo = []
            for variant, tag, factory in plans:
                # the default plan is listed under "" (fused() with no plan: the table's, or use_plan's)
                found = [f for f in providers if f[0] == "torch_cfm" and f[1] == ("" if variant in (default, "default") else variant)]
                if not found:
                    continue
                try:
                    plan = factory(dtype, precision, n, variant == "arena")
                except ValueError:  # no such plan for this dtype family (wgmma for IEEE fp32)
                    continue
                todo.append((tag, functools.partial(use_plan, plan), found[0][2]))
            pooled = {tag: [] for tag, _, _ in todo}
            p50s = {tag: [] for tag, _, _ in todo}
            errors = {}
            for _ in range(args.sweep_rounds):
                order = todo[:]
                if args.sweep_rounds > 1:
                    rng.shuffle(order)
                for tag, context, fused in order:
                    jitter = torch.empty(rng.randrange(1, 64) << 20, dtype=torch.uint8, device=DEVICE) \
                        if args.sweep_rounds > 1 else None
                    try:
                        with context(), torch.no_grad():
                            got = time_cuda_graph(fused, calls=args.calls, repeats=args.repeats,
                                                  context=tf32_ctx(dtype, precision), samples=pooled[tag])
                        p50s[tag].append(got["us_p50"])
                        if args.sweep_kernels and len(p50s[tag]) == 1:
                            with context(), torch.no_grad(), tf32_ctx(dtype, precision)():
                                kernel_breakdown(fused, os.path.join(
                                    args.out, f"dit_step_kernels_{n}x{t}x{l_len}_{dname}_{tag}.txt"))
                    except Exception as exc:  # noqa: BLE001
                        errors[tag] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    del jitter
            for tag, _, _ in todo:
                row = dict(op="dit_step", provider="torch_cfm", variant=tag, shape={"N": n, "T": t, "L": l_len},
                           dtype=dname.split("-")[0], precision=precision, timing="cuda_graph")
                if pooled[tag]:
                    row.update(percentiles(pooled[tag]))
                    row["round_p50s"] = p50s[tag]
                if tag in errors:
                    row["error"] = errors[tag]
                rows.append(_row(env, **row))
                print(f"sweep {n},{t},{l_len} {dname} {tag}: p50 {row.get('us_p50')} us, rounds {p50s[tag]}",
                      flush=True)
    return rows


def compile_step(model, inp):
    def step(x, mu, t, spks, cond, cnn, att):
        return model.forward_chunk(x, mu, t, spks, cond, cnn, att, fused=False)[0]

    compiled = torch.compile(step, mode="max-autotune-no-cudagraphs", fullgraph=False)
    args = (inp["x"], inp["mu"], inp["t"], inp["spks"], inp["cond"], inp["cnn"], inp["att"])
    return lambda: compiled(*args)


# --------------------------------------------------------------------------------------------
# whole chunk solve
# --------------------------------------------------------------------------------------------

def reference_solve(model, mu2, spks2, cond2, x0, cnn, att, n_steps, cfg_rate=0.7):
    """The reference module stepped in Python: 2B rows, CFG, Euler in float32. Returns mel."""
    ts = [float(v) for v in cosine_timesteps(n_steps, torch.float64)]
    b = x0.shape[0]
    x = x0.float()
    dtype = mu2.dtype
    for i in range(n_steps):
        xi = x.to(dtype).repeat(2, 1, 1)
        tt = torch.full((2 * b,), ts[i], device=x.device)
        v = model.forward_chunk(xi, mu2, tt, spks2, cond2, cnn[i], att[i], fused=False)[0]
        x = x + (ts[i + 1] - ts[i]) * ((1 + cfg_rate) * v[:b].float() - cfg_rate * v[b:].float())
    return x


def run_solve(cfg, b, t, l_len, dnames, args, env, base, n_steps=10) -> list[dict]:
    rows = []
    g = torch.Generator().manual_seed(1)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    mu, cond, spks, noise = r(b, 80, t), r(b, 80, t), r(b, 80), r(1, 80, l_len + t)
    x0 = noise[0, :, l_len:].expand(b, -1, -1)  # every request at cache length L starts here
    att = r(n_steps, cfg.depth, 2 * b, cfg.heads, l_len, 2 * cfg.head_dim)
    cnn = r(n_steps, cfg.depth, 2 * b, 2 * cfg.hidden, 2)

    def rows2(dtype):
        z = torch.zeros_like
        d = lambda v: v.to(device=DEVICE, dtype=dtype)  # noqa: E731
        return (d(torch.cat([mu, z(mu)])), d(torch.cat([spks, z(spks)])), d(torch.cat([cond, z(cond)])),
                d(x0), d(cnn), d(att), noise.to(DEVICE))

    mel64 = None
    if DEVICE == "cuda":
        try:
            m64 = copy.deepcopy(base).to(device=DEVICE, dtype=torch.float64)
            with torch.no_grad():
                mel64 = reference_solve(m64, *rows2(torch.float64)[:6], n_steps)
            del m64
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    shape = {"B": b, "N": 2 * b, "T": t, "L": l_len}
    for dname in dnames:
        dtype, precision = DTYPES[dname]
        model = copy.deepcopy(base).to(device=DEVICE, dtype=dtype)
        ctx = tf32_ctx(dtype, precision)
        fl = n_steps * floor_us(cfg, 2 * b, t, l_len, dname, torch.finfo(dtype).bits // 8)
        mu2, spks2, cond2, x0d, cnnd, attd, noised = rows2(dtype)
        common = dict(op="cfm_solve_chunk", shape=shape, dtype=dname.split("-")[0], precision=precision,
                      floor_us=round(fl, 2))
        if "torch_cfm" in args.provider_set:
            rows.append(_row(env, **solve_fused_row(model, dtype, precision, b, t, l_len, n_steps,
                                                    (mu2, spks2, cond2, noised, cnnd, attd), mel64, common, args)))
        def ref(model=model):  # bound now: the loop deletes ``model`` at its end
            return reference_solve(model, mu2, spks2, cond2, x0d, cnnd, attd, n_steps)

        for prov, timing in (("reference_eager", "eager"), ("reference_graph", "cuda_graph")):
            if prov not in args.provider_set:
                continue
            row = dict(common, provider=prov, variant="", timing=timing)
            try:
                with torch.no_grad():
                    with ctx():
                        out = ref()
                    if mel64 is not None:
                        row["rel_err"] = rel_err(out.float(), mel64)
                    timer = time_eager if timing == "eager" else time_cuda_graph
                    row.update(timer(ref, calls=1, repeats=max(3, args.repeats // 3), context=ctx))
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(_row(env, **row))
            print(f"solve {shape} {dname} {prov}: p50 {row.get('us_p50')} us, rel_err {row.get('rel_err')}", flush=True)
        del model
        torch.cuda.empty_cache() if DEVICE == "cuda" else None
    for row in rows:
        if row.get("us_p50"):
            row["floor_frac"] = round(row["floor_us"] / row["us_p50"], 4)
    return rows


def settled_server(model, dtype, b: int, t: int, l_len: int, n_steps: int, generator: torch.Generator,
                   variant: str = "server"):
    """CFMServer(graphs=True) with ``b`` requests whose caches have settled at ``l_len`` frames
    (prompt P = l_len - 100, the trim keeps P + 100), its steady-state key warmed up and captured.
    ``variant``: "server" (default server), "server_copy" (append_in_place=False).
    Returns (server, chunks): ``server.solve_chunk(chunks)`` is then one graph replay."""
    if variant not in ("server", "server_copy"):
        raise ValueError(f"settled_server: variant must be 'server' or 'server_copy', got {variant!r}")
    from torch_cfm.models.cache import TRIM_KEEP_OLDEST
    from torch_cfm.serving import CFMServer
    from torch_cfm.solve import StreamingCFM

    prompt = max(l_len - TRIM_KEEP_OLDEST, 1)
    server = CFMServer(StreamingCFM(model, n_timesteps=n_steps), max_requests=b, max_prompt_frames=prompt,
                       max_chunk_frames=t, chunk_buckets=(t,), cache_buckets=(l_len,),
                       device=torch.device(DEVICE), dtype=dtype, graphs=True,
                       append_in_place=variant != "server_copy")
    d = lambda *shape: torch.randn(*shape, generator=generator).to(DEVICE, dtype)  # noqa: E731
    for r in range(b):
        server.open_request(r, d(80), prompt_mu=d(80, prompt), prompt_mel=d(80, prompt))
    chunks = {r: d(80, t) for r in range(b)}
    while min(server.cache_length(r) for r in range(b)) < l_len:
        server.solve_chunk(chunks)
    for _ in range(2):  # the steady-state key's eager warm-up, then its capture
        server.solve_chunk(chunks)
    return server, chunks


def host_us_p50(fn: Callable[[], object], repeats: int) -> float:
    """Median host µs of one ``fn()`` call, the GPU synchronised before each (nothing waited for inside)."""
    host = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return round(sorted(host)[len(host) // 2], 1)


def run_server(cfg, b, t, l_len, dnames, args, env, base, n_steps=10) -> list[dict]:
    """The production path: CFMServer(graphs=True) solving a chunk for ``b`` requests whose caches
    have settled at ``l_len`` frames (:func:`settled_server`)."""
    rows = []
    g = torch.Generator().manual_seed(2)
    for dname, variant in ((d, v) for d in dnames for v in args.server_variants.split(",")):
        dtype, precision = DTYPES[dname]
        ctx = tf32_ctx(dtype, precision)
        row = dict(op="cfm_solve_chunk", provider="torch_cfm", variant=variant, timing="cuda_graph",
                   shape={"B": b, "N": 2 * b, "T": t, "L": l_len}, dtype=dname.split("-")[0], precision=precision)
        try:
            model = copy.deepcopy(base).to(device=DEVICE, dtype=dtype)
            with torch.no_grad(), ctx():
                if DEVICE == "cuda":
                    torch.cuda.synchronize()
                    mem0 = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                server, chunks = settled_server(model, dtype, b, t, l_len, n_steps, g, variant)
                row.update(time_replay(lambda: server.solve_chunk(chunks), args))
                row["arena_bytes"] = sum(a.nbytes() for a in server.arenas)
                if DEVICE == "cuda":
                    row["peak_extra_bytes"] = torch.cuda.max_memory_allocated() - mem0 - row["arena_bytes"]
                row["captured"] = any(e.replays for e in server.graph_cache.entries())
                if args.profile_server and DEVICE == "cuda":  # where a served chunk's time goes
                    from torch.profiler import ProfilerActivity, profile

                    row["host_us_p50"] = host_us_p50(lambda: server.solve_chunk(chunks), 5)
                    print(f"server.solve_chunk host time per call (no sync), p50: {row['host_us_p50']} us", flush=True)

                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        for _ in range(2):
                            server.solve_chunk(chunks)
                        torch.cuda.synchronize()
                    for key in ("self_cpu_time_total", "self_cuda_time_total"):
                        print(prof.key_averages().table(sort_by=key, row_limit=20), flush=True)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        rows.append(_row(env, **row))
        print(f"solve {row['shape']} {dname} torch_cfm/{variant}: p50 {row.get('us_p50')} us, arena "
              f"{row.get('arena_bytes')}, peak extra {row.get('peak_extra_bytes')}, captured {row.get('captured')}",
              flush=True)
        torch.cuda.empty_cache() if DEVICE == "cuda" else None
    return rows


def solve_fused_row(model, dtype, precision, b, t, l_len, n_steps, tensors, mel64, common, args) -> dict:
    """One torch_cfm row of the chunk solve: the graph replay of the arena solve over a keyed arena of
    L + T frames per cache holding the B requests' caches (no trim, no host work)."""
    from torch_cfm.graphs import GraphCache
    from torch_cfm.models import CacheArena
    from torch_cfm.solve import ArenaSolver, GraphedArenaSolver

    mu2, spks2, cond2, noise, cnnd, attd = tensors
    row = dict(common, provider="torch_cfm", variant="", timing="cuda_graph")
    try:
        with torch.no_grad():
            mem0 = torch.cuda.memory_allocated() if DEVICE == "cuda" else 0
            arena = CacheArena.allocate(model.config, n_steps, b, l_len + t, t, torch.device(DEVICE), dtype)
            arena.mu[:, :, :t].copy_(mu2[:b])
            arena.cond[:, :, :t].copy_(cond2[:b])
            arena.spks.copy_(spks2[:b])
            arena.att[:, :, :, :, :l_len].copy_(attd)
            arena.cnn.copy_(cnnd)
            arena.valid_lengths.fill_(t)
            arena.prompt_lengths.fill_(l_len + t)  # no trim
            start = {k: v.clone() for k, v in arena.tensors().items()}
            solver = ArenaSolver(model, n_timesteps=n_steps, keep_oldest=l_len + t)
            cache = GraphCache("dit_step", max_graphs=1)
            graphed = GraphedArenaSolver(solver, cache)

            def run(graphs=True):
                (graphed if graphs else solver)(arena, noise, t_len=t, cache_frames=l_len)

            for _ in range(cache.calls_per_capture(torch.device(DEVICE))):  # eager warm-up, then the capture
                for k, v in start.items():
                    getattr(arena, k).copy_(v)
                arena.cache_lengths.fill_(l_len)
                run()
            mel = arena.out_mel[:, :, :t].clone()
            entry = cache.entries()[0]
            row["arena_bytes"] = sum(arena.tensors()[k].numel() * arena.tensors()[k].element_size() for k in ("att", "cnn"))
            row["buffers_bytes"] = arena.nbytes()
            row["graph_pool_bytes"] = entry.pool_bytes
            row["captured"] = entry.graph is not None
            row["capture_error"] = entry.failed
            if DEVICE == "cuda":
                row["allocated_delta_bytes"] = torch.cuda.memory_allocated() - mem0
            if mel64 is not None:
                row["rel_err"] = rel_err(mel.float(), mel64)
            row.update(time_replay(run, args))
            row["kernels"] = count_kernels(lambda: run(graphs=False))
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    print(f"solve {common['shape']} {dtype} torch_cfm: p50 {row.get('us_p50')} us, rel_err "
          f"{row.get('rel_err')}, arena {row.get('arena_bytes')}, pool {row.get('graph_pool_bytes')}", flush=True)
    return row


def time_replay(fn, args) -> dict:
    """µs of one call of ``fn`` (itself a graph replay), p20/p50/p80 over repeats."""
    if DEVICE != "cuda":
        fn()
        return {"us_p20": 0.0, "us_p50": 0.0, "us_p80": 0.0}
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    xs = []
    for _ in range(max(5, args.repeats)):
        start.record()
        fn()
        end.record()
        end.synchronize()
        xs.append(start.elapsed_time(end) * 1000.0)
    xs.sort()
    pick = lambda p: xs[int(round((len(xs) - 1) * p))]  # noqa: E731
    return {"us_p20": round(pick(0.2), 3), "us_p50": round(pick(0.5), 3), "us_p80": round(pick(0.8), 3)}


def write_table(rows: list[dict], out_dir: str, command: str) -> str:
    def row_key(r):
        s = r["shape"]
        prec = f"-{r['precision']}" if r["precision"] else ""
        return f"{r['op']} {','.join(str(v) for v in s.values())} {r['dtype']}{prec}"

    def col_key(r):
        return r["provider"] + (f" ({r['variant']})" if r["variant"] else "") + (" eager" if r["timing"] == "eager" else "")

    def cell(r):
        if r.get("error"):
            return "err"
        p50 = r.get("us_p50")
        return "" if p50 is None else f"{p50 / 1000:.3f}"

    text = ("# DiT step / chunk solve, ms (p50; CUDA graph unless 'eager')\n\n"
            + markdown_table(rows, row_key, col_key, cell, row_title="op shape dtype") + "\n")
    extra = ["| row | kernels | floor ms | floor frac | rel_err vs fp64 | arena MiB | graph pool MiB |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        variant = r.get("variant") or ""
        if r["provider"] == "torch_cfm" and variant not in ("forward_chunk", "compiled") and not variant.startswith("sweep"):
            mib = lambda v: "" if v is None else f"{v / 2**20:.1f}"  # noqa: E731
            extra.append(f"| {row_key(r)} {variant} | {r.get('kernels')} | {r.get('floor_us', 0) / 1000:.3f} | "
                         f"{r.get('floor_frac')} | {r.get('rel_err')} | {mib(r.get('arena_bytes'))} | "
                         f"{mib(r.get('graph_pool_bytes'))} |")
    text += "\n## torch_cfm details\n\n" + "\n".join(extra) + "\n"
    text += provenance_footer(rows, command)
    with open(os.path.join(out_dir, "dit_step.md"), "w") as f:
        f.write(text)
    return text


def _enable_dry_run() -> None:
    global DEVICE, time_cuda_graph, time_eager
    DEVICE = "cpu"
    time_cuda_graph = time_eager = dry_run_timer


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 shapes, fp16 + fp32-tf32, no torch.compile")
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--shapes", default=None, help="N,T,L;N,T,L... (default docs/design.md §7 body shapes)")
    ap.add_argument("--dtypes", default=None, help=f"comma list of {tuple(DTYPES)}")
    ap.add_argument("--providers", default=None, help=f"comma list of {PROVIDERS}")
    ap.add_argument("--solve-dtypes", default=None, help="dtypes of the chunk-solve rows (default = --dtypes)")
    ap.add_argument("--no-solve", action="store_true")
    ap.add_argument("--no-steps", action="store_true")
    ap.add_argument("--compile-all", action="store_true",
                    help="torch_compile_graph at every shape/dtype (default: docs/design.md §7 anchor shapes, fp16/fp32-tf32)")
    ap.add_argument("--sweep", action="store_true",
                    help="also time the plans of --sweep-variants (sweep_plans)")
    ap.add_argument("--sweep-rounds", type=int, default=1,
                    help="captures per sweep plan, interleaved in a new order each round (A/B at the few-%% level)")
    ap.add_argument("--sweep-variants", default="fused_attention,pdl",
                    help="what the sweep covers (comma list: fused_attention: its attention kernel's launch "
                         "overrides; pdl: body PDL kernel sets; wgmma: the wgmma plan against cublas under PDL "
                         "sets; fc2: the wgmma plan's split-K fc2 configs; rownorm: the row-norm kernel's rows "
                         "per program and warps on the table's plan; qkv: the arena step with and without the "
                         "wgmma QKV + cache epilogue; tf32: the wgmma plan's TF32 GEMMs against cublas for "
                         "fp32-tf32 bodies; arena_attention: the arena step on the table's plan and on "
                         "fused_attention_warp_rownorm, the fused attention kernel's arena form; cutlass: "
                         "the arena step on the table's plan and on cutlass_warp_rownorm; cutlass_pdl: "
                         "cutlass_warp_rownorm under PDL sets)")
    ap.add_argument("--sweep-kernels", action="store_true",
                    help="also write each sweep plan's per-kernel table (eager, torch.profiler) under --out")
    ap.add_argument("--variants", default=",".join(PLAN_NAMES + ("arena",)),
                    help="fused-body plans timed besides the table's one (comma list, or 'none'); 'arena': "
                         "the step on the in-place cache arena")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--server-variants", default="server",
                    help="comma list of server, server_copy (torch_cfm/server rows)")
    ap.add_argument("--profile-server", action="store_true",
                    help="print a torch.profiler table of two steady-state CFMServer.solve_chunk calls")
    ap.add_argument("--default-variant", default=None,
                    help="run every body not given a plan on this named plan (kernels.body_plans.use_plan), "
                         "e.g. cublas to time the runner/server on that plan's kernels")
    ap.add_argument("--dry-run", action="store_true", help="CPU smoke test (TRITON_INTERPRET=1, tiny model)")
    args = ap.parse_args(argv)
    with use_plan(args.default_variant) if args.default_variant else contextlib.nullcontext():
        return _run(args, argv)


def _run(args, argv) -> int:
    args.variants = () if args.variants == "none" else tuple(v for v in args.variants.split(",") if v)
    cfg = DiTConfig()
    if args.dry_run:
        _enable_dry_run()
        cfg = DiTConfig(hidden=64, depth=2, heads=4, head_dim=16)
    elif not torch.cuda.is_available():
        print("bench/dit_step.py needs a CUDA device")
        return 2
    os.makedirs(args.out, exist_ok=True)
    global PARTIAL
    PARTIAL = os.path.join(args.out, "dit_step_partial.jsonl")
    shapes = BODY_BENCH_SHAPES
    dnames = list(DTYPES)
    providers = list(PROVIDERS)
    if args.quick:
        shapes, dnames = QUICK_SHAPES, ["fp16", "fp32-tf32"]
        providers = [p for p in providers if p != "torch_compile_graph"]
    if args.dry_run:
        shapes = ((2, 5, 4),)
    if args.shapes:
        shapes = tuple(tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";"))
    if args.dtypes:
        dnames = args.dtypes.split(",")
    if args.providers:
        providers = args.providers.split(",")
    args.provider_set = frozenset(providers)
    env = env_info()
    command = "python3 " + shlex.join([os.path.relpath(__file__)] + list(argv if argv is not None else sys.argv[1:]))
    t0 = time.time()
    base = random_dit(cfg, seed=0)
    rows: list[dict] = []
    if not args.no_solve:  # first: the whole-chunk solve is the headline number
        sdn = args.solve_dtypes.split(",") if args.solve_dtypes else dnames
        b, t, l_len = (1, 5, 4) if args.dry_run else (4, 50, 400)
        if any(p in providers for p in ("torch_cfm", "reference_eager", "reference_graph")):
            rows += run_solve(cfg, b, t, l_len, sdn, args, env, base, n_steps=2 if args.dry_run else 10)
        # Server rows include solve_chunk's host work, which varied 0.7-2.6 ms between processes of one
        # device call: A/B server variants in separate, interleaved processes.
        if "torch_cfm/server" in providers:
            rows += run_server(cfg, b, t, 104 if args.dry_run else l_len, sdn, args, env, base,
                               n_steps=2 if args.dry_run else 10)
    if not args.no_steps:
        rows += run_steps(cfg, shapes, dnames, providers, args, env, base)
    if args.sweep:
        rows += run_sweep(cfg, shapes, dnames, args, env, base)
    all_rows = upsert_rows(os.path.join(args.out, "dit_step.json"), rows)
    print(write_table(rows, args.out, command))
    print(f"{len(rows)} rows in {time.time() - t0:.0f} s; {len(all_rows)} rows in {args.out}/dit_step.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
