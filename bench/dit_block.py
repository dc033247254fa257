#!/usr/bin/env python3
"""Where a v7 block's time goes: each phase of the persistent block kernel alone, and the barrier.

v7 (``torch_cfm/kernels/dit_block.py``) runs one DiT block as 11 phases behind grid barriers.
This bench times, in a CUDA graph (µs per launch, p20/p50/p80), at one body shape:

* ``block``: the whole block as the config launches it (``SPLIT_AT``: one persistent launch by
  default), including a reset of the barrier/FLOW counters (a graph replays the same wait
  targets), whose cost alone is the ``zero`` row;
* ``phase/<name>``: that phase alone, run by the whole-block kernel on the persistent grid;
* ``split/<name>``: that phase alone in a kernel compiled with its code only, one program per tile;
* ``barrier``: µs per grid barrier of G programs (a kernel doing nothing but ``--barriers`` syncs);
* with ``--configs "w8:num_warps=8;each:SPLIT_AT=2046"``: ``<name>/block``, ``<name>/phase/*`` per
  launch-config override of ``dit_block.CONFIG`` (the default config is always timed);

plus the compiled kernel's registers / spills / shared memory. Rows (``op`` = "dit_block",
``variant`` = the item above) go to ``<out>/dit_block.json`` and a markdown table.

    python3 bench/dit_block.py --shapes "8,50,400;32,50,400" --dtypes fp16 --configs "w8:num_warps=8"

``--profile-phase fc2`` instead launches that phase (persistent grid, first shape and dtype) five
times eagerly and exits: the target of ``bash bench/run_device.sh ncu-block`` (Nsight Compute).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _harness import (env_info, fmt_us, make_row, markdown_table, provenance_footer, time_cuda_graph,  # noqa: E402
                      upsert_rows)

from torch_cfm.config import DiTConfig  # noqa: E402
from torch_cfm.kernels.dit_block import ALL_PHASES, MAX_SPIN, PHASES, BlockPlan, _grid_sync  # noqa: E402
from torch_cfm.kernels.dit_body import _mod_off, rownorm  # noqa: E402
from torch_cfm.models import random_dit  # noqa: E402
from torch_cfm.ops.dit_body import _empty_outputs, check_dit_body, stage_input  # noqa: E402
from torch_cfm.packing import SCALE_A, SHIFT_A, modulation_table, pack_dit  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@triton.jit
def _barriers_kernel(bar_ptr, n, MAX_SPIN_: tl.constexpr):
    G = tl.num_programs(0)
    for k in range(n):
        _grid_sync(bar_ptr, (k + 1) * G, MAX_SPIN_)


def _parse_configs(text):
    """ "name:k=v,k=v;name2:..." -> [(name, {k: int(v)})]; the default config first, named ""."""
    out = [("", {})]
    for item in filter(None, (text or "").split(";")):
        name, _, kvs = item.partition(":")
        out.append((name, {k: int(v) for k, v in (kv.split("=") for kv in kvs.split(",") if kv)}))
    return out


def _plan(cfg, n, t, l_len, dtype, config=None):
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(device=dev, dtype=dtype)

    packed = pack_dit(random_dit(cfg, seed=0).to(dev), dtype, dev)
    x_in = stage_input(r(n, 80, t), r(n, 80, t), r(n, 80), r(n, 80, t), dtype)
    table = modulation_table(pack_dit(random_dit(cfg, seed=0).to(dev), torch.float32, dev),
                             torch.full((1,), 0.42, device=dev))
    cnn, att = r(cfg.depth, n, 2 * cfg.hidden, 2), r(cfg.depth, n, cfg.heads, l_len, 2 * cfg.head_dim)
    valid = torch.full((n,), t, dtype=torch.int32, device=dev)
    cached = torch.tensor([l_len - (7 * i) % 64 for i in range(n)], dtype=torch.int32, device=dev)  # ragged
    out = _empty_outputs(x_in, check_dit_body(x_in, packed.body, table, cnn, att, valid, cached, "auto"))
    plan = BlockPlan(x_in, packed.body, table, cnn, att, valid, cached, None, out, config=config)
    # real block input (a, h): the in_proj boundary, as the body runs it
    y0 = torch.matmul(x_in.transpose(1, 2), packed.body[0].t()).reshape(n * t, cfg.hidden)
    rownorm(y0, plan.h, plan.a, valid, bias=packed.body[1], has_res=False, table=table,
            shift=_mod_off(0, SHIFT_A, cfg.hidden), scale=_mod_off(0, SCALE_A, cfg.hidden), n_rows=n, t_len=t)
    return plan


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="8,50,400;32,50,400")
    ap.add_argument("--dtypes", default="fp16")
    ap.add_argument("--barriers", type=int, default=100)
    ap.add_argument("--configs", default="", help="launch-config overrides, 'name:key=int,...;...'")
    ap.add_argument("--no-split", action="store_true", help="skip the one-launch-per-phase rows")
    ap.add_argument("--profile-phase", default=None, choices=PHASES + ("block",),
                    help="only launch this phase (or the whole block) 5 times, for a profiler")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/dit_block.py needs a CUDA device")
        return 2
    env = env_info()
    cfg = DiTConfig(depth=1)
    rows = []
    command = "python3 " + shlex.join([os.path.relpath(__file__)] + list(argv if argv is not None else sys.argv[1:]))

    def add(variant, shape, dname, stats, **extra):
        rows.append(make_row(env, op="dit_block", provider="torch_cfm", variant=variant, shape=shape, dtype=dname,
                             precision=None, timing="cuda_graph", **stats, **extra))
        print(f"dit_block {shape} {dname} {variant}: p50 {stats['us_p50']:.2f} us {extra or ''}", flush=True)

    if args.profile_phase:
        n, t, l_len = (int(x) for x in args.shapes.split(";")[0].split(","))
        plan = _plan(cfg, n, t, l_len, DTYPES[args.dtypes.split(",")[0]], _parse_configs(args.configs)[-1][1])
        for _ in range(5):
            if args.profile_phase == "block":
                plan.reset()
                plan.block(0)
            else:  # the block kernel (every phase compiled in) running this one phase
                p = PHASES.index(args.profile_phase)
                plan.launch(0, plan.grid, p, p + 1, mask=ALL_PHASES, sync=True)
        torch.cuda.synchronize()
        print(f"profiled {args.profile_phase}: grid {plan.grid}, tiles {plan.tiles}, groups {plan.groups}")
        return 0
    grid = None
    for spec in args.shapes.split(";"):
        n, t, l_len = (int(x) for x in spec.split(","))
        shape = dict(N=n, T=t, L=l_len)
        for dname in args.dtypes.split(","):
            for cname, override in _parse_configs(args.configs):
                pre = f"{cname}/" if cname else ""
                plan = _plan(cfg, n, t, l_len, DTYPES[dname], override)
                grid = plan.grid
                k = plan.launch(0, grid, 0, len(PHASES))  # the whole-block kernel: compile, resources
                torch.cuda.synchronize()
                info = dict(n_regs=getattr(k, "n_regs", None), n_spills=getattr(k, "n_spills", None),
                            shared=getattr(getattr(k, "metadata", None), "shared", None), grid=grid,
                            groups=plan.groups, config=dict(override) if override else None)
                print(f"compiled {cname or 'default'}: {info}", flush=True)
                timer = dict(calls=args.calls, repeats=args.repeats)

                def block():  # counters zeroed per call: a graph replays the same wait targets
                    plan.reset()
                    plan.block(0)

                add(pre + "block", shape, dname, time_cuda_graph(block, **timer), **info)
                add(pre + "zero", shape, dname, time_cuda_graph(plan.reset, **timer))
                for p, name in enumerate(PHASES):
                    add(f"{pre}phase/{name}", shape, dname,
                        time_cuda_graph(lambda p=p: plan.launch(0, grid, p, p + 1, mask=ALL_PHASES, sync=True),
                                        **timer), tiles=plan.tiles[p])
                assert plan.bar[1].item() == 0, "a grid barrier timed out"
                _save(args, rows, command)  # after each config: a timed-out run keeps what it measured
                if cname or args.no_split:
                    continue
                for p, name in enumerate(PHASES):
                    add(f"split/{name}", shape, dname,
                        time_cuda_graph(lambda p=p: plan.launch(0, plan.tiles[p], p, p + 1), **timer),
                        tiles=plan.tiles[p])
    bar = torch.zeros(2, dtype=torch.int32, device="cuda")

    def barriers():
        bar.zero_()
        _barriers_kernel[(grid,)](bar, args.barriers, MAX_SPIN_=MAX_SPIN, num_warps=4)

    st = time_cuda_graph(barriers, calls=5, repeats=args.repeats)
    per = {k: v / args.barriers for k, v in st.items()}
    add("barrier", dict(G=grid), "none", per, barriers=args.barriers)
    _save(args, rows, command)
    return 0


def _save(args, rows, command):
    os.makedirs(args.out, exist_ok=True)
    upsert_rows(os.path.join(args.out, "dit_block.json"), rows)
    table = markdown_table(rows, lambda r: r["variant"], lambda r: f"{r['shape']} {r['dtype']}", fmt_us, "µs p50")
    with open(os.path.join(args.out, "dit_block.md"), "w") as f:
        f.write(table + "\n" + provenance_footer(rows, command))


if __name__ == "__main__":
    sys.exit(main())
