"""CFMServer(graphs=True) steady-state tick: every open stream solves one chunk per tick.

op "serving_tick", shape {S, P, T, L}: S streams opened with P-frame prompts (seeded random DiT
weights of the shipped size, fp16 by default), each tick one ``solve_chunk`` of a T-frame chunk
for every stream over caches settled at L = P + 100 frames (the trim bound). µs per tick between
CUDA events around the ``solve_chunk`` call (host staging, graph replay and mel copies), the GPU
idle before each tick; fresh random chunks every tick; p20/p50/p80 over the repeats. Extra
fields: ``host_us_p50`` (wall time until solve_chunk returns), ``warmup_s`` and ``graphs`` (where
the tree has ``CFMServer.warmup``), ``arena_bytes``, ``tree`` (the torch_cfm tree timed).

The script uses only the API that older trees have too (``CFMServer(graphs=True)``,
``open_request``, ``solve_chunk``; ``warmup`` only when present), so one device call can time two
checkouts for a no-regression comparison:

    python3 bench/serving_tick.py --label new --out "$OUT"
    python3 bench/serving_tick.py --repo /path/to/old/checkout --label old --out "$OUT"

Each tree needs its extension built in place (``python3 setup.py build_ext --inplace``).
``--dry-run`` runs a tiny config on the CPU (smoke test).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", default="16,64", help="comma list of stream counts S")
    ap.add_argument("--prompt", type=int, default=300, help="prompt frames P")
    ap.add_argument("--chunk", type=int, default=50, help="chunk frames T")
    ap.add_argument("--dtype", default="fp16", choices=("fp16", "bf16", "fp32"))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repo", default=os.path.dirname(HERE), help="torch_cfm tree to import (default: this one)")
    ap.add_argument("--label", default=None, help="row variant naming the tree (default: its git commit)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--no-warmup", action="store_true", help="skip CFMServer.warmup even where the tree has it")
    ap.add_argument("--profile-host", type=int, default=0, metavar="TICKS",
                    help="print a cProfile of the host side of this many ticks (after the timed ones)")
    ap.add_argument("--dry-run", action="store_true", help="tiny config on the CPU")
    return ap.parse_args(argv)


ARGS = _args() if __name__ == "__main__" else None
if ARGS is not None:
    sys.path.insert(0, os.path.abspath(ARGS.repo))  # the tree timed wins over any installed torch_cfm
sys.path.insert(1, HERE)

import torch  # noqa: E402

from _harness import (env_info, fmt_us, git_commit, make_row, markdown_table, percentiles,  # noqa: E402
                      provenance_footer, upsert_rows)

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def measure(streams: int, args, env: dict, tree: str) -> dict:
    import torch_cfm
    from torch_cfm import CFMServer, DiT, DiTConfig, StreamingCFM

    dry = args.dry_run
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else DTYPES[args.dtype]
    cfg = DiTConfig(hidden=64, depth=2, heads=4, head_dim=16) if dry else DiTConfig()
    prompt, t_len, cache = args.prompt, args.chunk, args.prompt + 100
    shape = {"S": streams, "P": prompt, "T": t_len, "L": cache}
    row = dict(op="serving_tick", provider="torch_cfm", variant=args.label or tree, shape=shape,
               dtype=args.dtype if not dry else "fp32", precision=None,
               timing="cpu_wall" if dry else "cuda_events", tree=tree, torch_cfm_path=os.path.dirname(torch_cfm.__file__))
    model = DiT(cfg).random_init_(args.seed).to(device, dtype).eval()
    cfm = StreamingCFM(model, n_timesteps=args.steps, seed=args.seed)
    server = CFMServer(cfm, max_requests=streams, max_prompt_frames=prompt, max_chunk_frames=t_len,
                       chunk_buckets=[t_len], cache_buckets=[cache], slot_buckets=[1, streams],
                       device=device, dtype=dtype, graphs=True)
    row["arena_bytes"] = sum(a.nbytes() for a in server.arenas)
    if hasattr(server, "warmup") and not args.no_warmup:  # else: warmed by the settling ticks below
        start = time.perf_counter()
        report = server.warmup(progress=False)
        row["warmup_s"] = round(time.perf_counter() - start, 3)
        row["graphs"] = report.graphs
        row["graph_pool_bytes"] = report.graph_pool_bytes
    g = torch.Generator(device=device).manual_seed(args.seed + 1)

    def rand(*size):
        return torch.randn(*size, generator=g, device=device, dtype=torch.float32).to(dtype)

    ids = list(range(streams))
    start = time.perf_counter()
    for rid in ids:
        server.open_request(rid, rand(80), prompt_mu=rand(80, prompt), prompt_mel=rand(80, prompt))
    row["open_s"] = round(time.perf_counter() - start, 3)
    settle = -(-100 // t_len) + 3  # caches reach P + 100 (then trim every tick), plus capture and replays
    for _ in range(settle):
        server.solve_chunk({rid: rand(80, t_len) for rid in ids})
    if hasattr(server, "cache_length"):
        row["cache_frames"] = sorted({server.cache_length(rid) for rid in ids})
    pool = [{rid: rand(80, t_len) for rid in ids} for _ in range(min(args.repeats, 8))]
    ticks, host = [], []
    if not dry:
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(args.repeats):
        chunks = pool[i % len(pool)]
        for mu in chunks.values():  # fresh values every tick, made before the tick
            mu.normal_(generator=g)
        if dry:
            t0 = time.perf_counter()
            server.solve_chunk(chunks)
            ticks.append((time.perf_counter() - t0) * 1e6)
            host.append(ticks[-1])
            continue
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        begin.record()
        out = server.solve_chunk(chunks)
        end.record()
        host.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        ticks.append(begin.elapsed_time(end) * 1e3)
        if i == 0 and not all(torch.isfinite(v).all() for v in out.values()):
            row["error"] = "non-finite mel"
    row.update(percentiles(ticks))
    row["host_us_p50"] = percentiles(host)["us_p50"]
    row["repeats"] = args.repeats
    if args.profile_host:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        for i in range(args.profile_host):
            chunks = pool[i % len(pool)]
            if not dry:
                torch.cuda.synchronize()
            profiler.enable()
            server.solve_chunk(chunks)
            profiler.disable()
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("cumulative").print_stats(14)
    print(f"serving_tick S={streams} {row['dtype']} [{row['variant']}]: p50 {row['us_p50']} us/tick, "
          f"host {row['host_us_p50']} us, warmup {row.get('warmup_s')} s", flush=True)
    del server, cfm, model
    if not dry:
        torch.cuda.empty_cache()
    return make_row(env, **row)


def main() -> int:
    args = ARGS
    if not args.dry_run and not torch.cuda.is_available():
        print("bench/serving_tick.py needs a CUDA device (or --dry-run)")
        return 2
    if args.dry_run:
        args.prompt, args.chunk, args.steps, args.repeats = 12, 5, 2, min(args.repeats, 3)
        args.streams = "2"
    env = env_info()
    tree = git_commit(os.path.abspath(args.repo))
    env["commit"] = tree
    rows = []
    for streams in [int(s) for s in args.streams.split(",") if s]:
        try:
            rows.append(measure(streams, args, env, tree))
        except Exception as exc:  # noqa: BLE001 - a failing configuration gets a row with the error
            import traceback

            traceback.print_exc()
            rows.append(make_row(env, op="serving_tick", provider="torch_cfm", variant=args.label or tree,
                                 shape={"S": streams, "P": args.prompt, "T": args.chunk, "L": args.prompt + 100},
                                 dtype=args.dtype, timing="cuda_events", error=f"{type(exc).__name__}: {exc}"[:300]))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "serving_tick.json")
    merged = upsert_rows(path, rows)
    command = "python3 bench/serving_tick.py " + " ".join(sys.argv[1:])
    table = markdown_table([r for r in merged if r.get("op") == "serving_tick"],
                           lambda r: f"S={r['shape']['S']} {r['dtype']}", lambda r: r["variant"], fmt_us,
                           row_title="µs per tick (p50)")
    print(table)
    print(provenance_footer(rows, command))
    return 0 if all(r.get("error") is None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
