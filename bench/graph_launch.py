"""Host cost of launching the whole-solve CUDA graphs: the server's arena graph vs the runner's.

A served chunk is serialised as host work (staging, graph key, ``cudaGraphLaunch``) then GPU work;
a profile of the server once showed ~2.5 ms of ``cudaGraphLaunch`` per chunk.
This script captures both graphs of one bucket (B = 4 requests, T = 50, L = 400, random weights)
and reports, per graph: host µs of ``graph.replay()`` (synchronised before, nothing waited for
inside), GPU µs of one replay (events), for the server also the host µs of a whole
``solve_chunk`` and a cProfile of it, and (debug graphs only) nodes by type and the most frequent
kernels from the graph's DOT dump. Run it again with ``TORCH_CFM_PDL=0`` to see what programmatic
dependent launch edges cost at launch.

    python3 bench/graph_launch.py --out bench/results --dtype fp16 [--plain-graphs]

The default captures debug graphs (``keep_graph=True`` + debug mode, for the DOT dump); on torch
2.11 the dump writes no file, so those rows have no node counts. ``--plain-graphs`` captures
ordinary graphs, to check whether debug graphs explain why ``solve_chunk`` took 0.69 ms of host
time here but 2.2-2.7 ms in ``bench/dit_step.py --profile-server``.

Writes ``graph_launch.json`` (one row per graph, with provenance) under ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dit_step import DTYPES, env_info, host_us_p50, random_dit, settled_server, tf32_ctx  # noqa: E402

B, T, L = 4, 50, 400


class _DebugGraph(torch.cuda.CUDAGraph):
    """A CUDAGraph in debug mode (keeps its cudaGraph_t for the DOT dump)."""

    created: list = []

    def __new__(cls, keep_graph: bool = True):
        # the cudaGraph_t (what debug_dump prints) is destroyed at instantiation unless kept
        graph = super().__new__(cls, True)
        graph.enable_debug_mode()
        _DebugGraph.created.append(graph)
        return graph


def graph_nodes(graph: torch.cuda.CUDAGraph) -> dict:
    """Node types, edge count and the 8 most frequent kernel names of a debug-mode graph."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "g.dot")
        graph.debug_dump(path)
        if not os.path.exists(path):
            return {"node_types": None, "edges": None, "top_kernels": None}
        text = open(path).read()
    types = collections.Counter(re.findall(r'label="\{?\s*(\w+)', text))
    names = collections.Counter(m for m in re.findall(r"(nvjet\w+|_\w+_kernel\b|\w*[Kk]ernel\w*)", text)
                                if m not in ("KERNEL", "kernel"))
    return {"node_types": dict(types), "edges": text.count("->"), "top_kernels": names.most_common(8)}


def time_graph(graph: torch.cuda.CUDAGraph, repeats: int) -> dict:
    host, gpu = [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        graph.replay()
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        graph.replay()
        t1 = time.perf_counter()
        end.record()
        end.synchronize()
        host.append((t1 - t0) * 1e6)
        gpu.append(start.elapsed_time(end) * 1e3)
    med = lambda xs: round(sorted(xs)[len(xs) // 2], 1)  # noqa: E731
    return {"host_replay_us_p50": med(host), "gpu_replay_us_p50": med(gpu)}


def build_server(model, dtype):
    server, chunks = settled_server(model, dtype, B, T, L, 10, torch.Generator().manual_seed(2))
    ents = [e for e in server.graph_cache.entries() if e.graph is not None]
    return server, chunks, ents[-1].graph


def server_host_profile(server, chunks, repeats: int) -> dict:
    """Host µs of one ``solve_chunk`` (synchronised before; the GPU runs behind) and a cProfile of
    five calls: which Python/host work precedes the graph launch."""
    import cProfile
    import io
    import pstats

    host = host_us_p50(lambda: server.solve_chunk(chunks), repeats)
    prof = cProfile.Profile()
    for _ in range(5):
        torch.cuda.synchronize()
        prof.enable()
        server.solve_chunk(chunks)
        prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(25)
    print(buf.getvalue(), flush=True)
    return {"solve_chunk_host_us_p50": host}


def launch_probe(graph: torch.cuda.CUDAGraph, server, chunks, repeats: int) -> dict:
    """Where a served chunk's host time goes: host µs of ``graph.replay()`` right after a sync and
    after small async work like solve_chunk's staging (device copies, a pinned host-to-device
    copy), and ``solve_chunk`` split into staging (before the solve call), the solve call (graph
    key + replay) and the output copies after it."""
    med = lambda xs: round(sorted(xs)[len(xs) // 2], 1)  # noqa: E731
    src = torch.randn(80, T, device="cuda", dtype=torch.float16)
    dst = torch.empty_like(src)
    host = torch.zeros(B, dtype=torch.int32).pin_memory()
    dev = torch.zeros(B, dtype=torch.int32, device="cuda")
    preludes = {
        "sync": lambda: None,
        "8_device_copies": lambda: [dst.copy_(src) for _ in range(8)],
        "pinned_h2d": lambda: dev.copy_(host, non_blocking=True),
        "fresh_pinned_h2d": lambda: dev.copy_(torch.tensor([1] * B, dtype=torch.int32).pin_memory(), non_blocking=True),
    }
    row = {}
    for name, prelude in preludes.items():
        xs = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            prelude()
            t0 = time.perf_counter()
            graph.replay()
            xs.append((time.perf_counter() - t0) * 1e6)
        row[f"replay_after_{name}_us_p50"] = med(xs)
    inner, marks = server.solver, []

    def timed(*args, **kwargs):
        marks.append(time.perf_counter())
        inner(*args, **kwargs)
        marks.append(time.perf_counter())

    server.solver = timed
    parts = {"staging": [], "solve_call": [], "outputs": []}
    try:
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            server.solve_chunk(chunks)
            t1 = time.perf_counter()
            parts["staging"].append((marks[-2] - t0) * 1e6)
            parts["solve_call"].append((marks[-1] - marks[-2]) * 1e6)
            parts["outputs"].append((t1 - marks[-1]) * 1e6)
    finally:
        server.solver = inner
    torch.cuda.synchronize()
    row.update({f"solve_chunk_{k}_us_p50": med(v) for k, v in parts.items()})
    return row


def build_runner(model, dtype, precision):
    """The arena solve of B requests at (T, L) replayed from its graph, without a server's host work:
    (solve callable, graph)."""
    from torch_cfm.graphs import GraphCache
    from torch_cfm.models import CacheArena
    from torch_cfm.solve import ArenaSolver, GraphedArenaSolver

    arena = CacheArena.allocate(model.config, 10, B, L + T, T, torch.device("cuda"), dtype)
    for buf in (arena.att, arena.mu, arena.cond, arena.spks):
        buf.normal_()
    noise = torch.randn(1, 80, L + T, device="cuda")
    cache = GraphCache("graph_launch", max_graphs=1)
    graphed = GraphedArenaSolver(ArenaSolver(model, n_timesteps=10, keep_oldest=L + T), cache)

    def run():
        graphed(arena, noise, t_len=T, cache_frames=L)

    for _ in range(cache.calls_per_capture(torch.device("cuda"))):  # eager warm-up, then the capture
        arena.valid_lengths.fill_(T)  # full chunks over settled caches, as in the server row
        arena.cache_lengths.fill_(L)
        run()
    return run, cache.entries()[0].graph


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--plain-graphs", action="store_true",
                    help="ordinary CUDA graphs (default: debug graphs kept for their DOT dump)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/graph_launch.py needs a CUDA device")
        return 2
    from torch_cfm.config import DiTConfig

    dtype, precision = DTYPES[args.dtype]
    env = env_info()
    if not args.plain_graphs:
        torch.cuda.CUDAGraph = _DebugGraph  # every graph built below keeps its DOT
    rows = []
    with torch.no_grad(), tf32_ctx(dtype, precision)():
        model = random_dit(DiTConfig(), seed=0).to("cuda", dtype)
        for name, build in (("runner", lambda: build_runner(model, dtype, precision)),
                            ("server", lambda: build_server(model, dtype))):
            built = build()
            graph = built[-1]
            row = dict(env, op="graph_launch", provider=name, shape={"B": B, "N": 2 * B, "T": T, "L": L},
                       dtype=args.dtype, precision=precision, pdl_env=os.environ.get("TORCH_CFM_PDL"),
                       debug_graphs=not args.plain_graphs)
            row.update(time_graph(graph, args.repeats))
            if name == "server":
                row.update(server_host_profile(built[0], built[1], args.repeats))
                row.update(launch_probe(graph, built[0], built[1], args.repeats))
            if not args.plain_graphs:
                row.update(graph_nodes(graph))
            rows.append(row)
            print(json.dumps({k: row.get(k) for k in ("provider", "pdl_env", "debug_graphs", "host_replay_us_p50",
                                                      "gpu_replay_us_p50",
                                                      "solve_chunk_host_us_p50", "node_types", "edges",
                                                      "top_kernels")} | {k: v for k, v in row.items()
                                                                         if k.startswith(("replay_after", "solve_chunk_"))}),
                  flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "graph_launch.json")
    old = json.load(open(path)) if os.path.exists(path) else []
    json.dump(old + rows, open(path, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
