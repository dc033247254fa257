"""Shared benchmark harness: CUDA-graph and eager timing, provenance, upserted JSON rows, tables.

Used by ``bench/attention.py`` and the DiT-step benchmarks. Nothing here knows about an op.

Timing (SPEC §7 "inside a CUDA graph"): the callable is warmed up on a side stream (compiles,
allocator pools), then ``calls`` back-to-back calls are captured into one CUDA graph; each repeat
replays the graph once between two CUDA events and yields µs per call. ``us_p20/p50/p80`` are
percentiles over the repeats. Eager timing runs the same ``calls`` back to back without a graph
(host launch overhead included).

Results: one data file per benchmark under ``bench/results/`` (``attention.json``, ``dit_step.json``,
...), a JSON list of rows upserted by their identity key (op, provider, variant, shape, dtype,
precision, timing, gpu): a rerun replaces the row, the newest row wins. Next to each data file,
``<name>.md`` is its table, generated from the whole file by :func:`write_table` (``upsert_rows``
regenerates it; ``python3 bench/_harness.py --tables`` regenerates every one). A device run
writes its own data files under ``$OUT``; ``python3 bench/_harness.py --merge "$OUT"`` upserts
them into ``bench/results/`` (the newest row of each identity wins).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import platform
import subprocess
from typing import Callable, ContextManager, Iterable, Optional, Sequence

import torch

IDENTITY = ("op", "provider", "variant", "shape", "dtype", "precision", "timing", "gpu")
# Data files whose rows are told apart by other fields (a .jsonl file keeps its own bench's table)
IDENTITIES = {"serving": ("op", "provider", "variant", "stage", "concurrency", "dtype", "gpu")}
ROW_FIELDS = ("op", "provider", "variant", "shape", "dtype", "precision", "timing", "us_p20", "us_p50",
              "us_p80", "rel_err", "error", "gpu", "capability", "torch", "triton", "commit", "timestamp")


def percentiles(values: Sequence[float]) -> dict[str, float]:
    xs = sorted(values)

    def pct(p: float) -> float:
        if not xs:
            return float("nan")
        pos = (len(xs) - 1) * p
        lo, hi = math.floor(pos), math.ceil(pos)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"us_p20": round(pct(0.2), 3), "us_p50": round(pct(0.5), 3), "us_p80": round(pct(0.8), 3)}


def _null_context() -> ContextManager:
    return contextlib.nullcontext()


def tf32_context(dtype: torch.dtype, precision: Optional[str], device: str) -> Callable[[], ContextManager]:
    """Factory of the context that sets torch's TF32 flags the way the estimator body does.

    Only CUDA fp32 runs change anything: cuBLAS/cuDNN follow those flags (off by default), so a
    cuBLAS peer timed without them runs IEEE SGEMM, not TF32."""
    if dtype == torch.float32 and device == "cuda":
        from torch_cfm import policy

        return lambda: policy.tf32_scope(precision == "tf32")
    return _null_context


def capture_cuda_graph(capture: Callable[[], object], *, warm: Optional[Callable[[], object]] = None,
                       warmup: int = 2) -> tuple:
    """``warm`` (default: ``capture``) run ``warmup`` times on a side stream, then ``capture``
    captured into a CUDA graph. Returns (graph, what the captured call returned)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            (warm or capture)()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = capture()
    return graph, out


def time_cuda_graph(fn: Callable[[], object], *, calls: int = 20, repeats: int = 30, warmup: int = 3,
                    context: Callable[[], ContextManager] = _null_context, samples: Optional[list] = None,
                    ) -> dict[str, float]:
    """µs per call of ``fn`` replayed from one CUDA graph of ``calls`` calls (p20/p50/p80 over repeats).

    ``context`` is entered around warm-up and capture (e.g. an SDPA backend selection). The
    per-repeat µs are appended to ``samples`` when given (pooling several captures).
    """
    with context():
        graph, _ = capture_cuda_graph(lambda: [fn() for _ in range(calls)], warm=fn, warmup=warmup)
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    del graph
    if samples is not None:
        samples.extend(times)
    return percentiles(times)


def time_eager(fn: Callable[[], object], *, calls: int = 20, repeats: int = 30, warmup: int = 3,
               context: Callable[[], ContextManager] = _null_context) -> dict[str, float]:
    """µs per call of ``calls`` back-to-back eager calls (host launch overhead included)."""
    with context():
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(repeats):
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1000.0 / calls)
    return percentiles(samples)


def cuda_kernel_times(fn: Callable[[], object], name_len: int = 90) -> dict[str, list]:
    """{kernel name (first ``name_len`` characters): [launches, device µs]} over one call of ``fn``,
    after one warm-up call (torch.profiler, eager: back-to-back kernels, launch gaps excluded)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    agg: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            rec = agg.setdefault(e.name[:name_len], [0, 0.0])
            rec[0] += 1
            rec[1] += e.device_time if hasattr(e, "device_time") else e.cuda_time
    return agg


def git_commit(repo: Optional[str] = None) -> str:
    """``git rev-parse HEAD`` of the repository; env ``BENCH_COMMIT`` where the tree has no .git
    (the device machine gets a copy without it: pass ``BENCH_COMMIT=<hash>`` in the command)."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    repo = repo or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def env_info() -> dict[str, object]:
    """Provenance fields of every row: gpu, capability, torch, triton, commit, timestamp."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover
        triton_version = None
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name()
        capability = list(torch.cuda.get_device_capability())
    else:
        gpu, capability = f"cpu ({platform.processor() or platform.machine()})", None
    return {
        "gpu": gpu,
        "capability": capability,
        "torch": torch.__version__,
        "triton": triton_version,
        "commit": git_commit(),
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def make_row(env: dict, **fields) -> dict:
    """A result row with every ROW_FIELDS key (missing ones None) plus any extra fields."""
    row = {k: None for k in ROW_FIELDS}
    row.update(env)
    row.update(fields)
    row.setdefault("variant", "")
    if row["variant"] is None:
        row["variant"] = ""
    return row


def _identity(row: dict, identity: Sequence[str] = IDENTITY) -> str:
    return json.dumps([row.get(k) for k in identity], sort_keys=True)


def read_rows(path: str) -> list[dict]:
    """The rows of a data file: a JSON list (``.json``) or one JSON object per line (``.jsonl``);
    [] when it is missing or unreadable."""
    if not os.path.exists(path):
        return []
    try:
        with open(path) as f:
            if path.endswith(".jsonl"):
                return [json.loads(line) for line in f if line.strip()]
            return json.load(f)
    except (OSError, ValueError):
        return []


def upsert_rows(path: str, rows: Iterable[dict], *, table: bool = True,
                identity: Sequence[str] = IDENTITY) -> list[dict]:
    """Merge ``rows`` into the data file at ``path`` (``.json`` list or ``.jsonl`` lines), replacing
    rows with the same ``identity`` key, then (``table``, ``.json`` files) regenerate the table
    ``<path without .json>.md`` from the whole file."""
    existing = read_rows(path)
    index = {_identity(r, identity): i for i, r in enumerate(existing)}
    for row in rows:
        key = _identity(row, identity)
        if key in index:
            existing[index[key]] = row
        else:
            index[key] = len(existing)
            existing.append(row)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        if path.endswith(".jsonl"):
            f.writelines(json.dumps(row) + "\n" for row in existing)
        else:
            json.dump(existing, f, indent=1)
    if table and not path.endswith(".jsonl"):
        write_table(path, existing)
    return existing


def rel_err(out: torch.Tensor, ref64: torch.Tensor) -> float:
    """Relative Frobenius error of ``out`` against a float64 reference."""
    diff = (out.double() - ref64.double()).norm().item()
    return diff / max(ref64.double().norm().item(), 1e-30)


def markdown_table(rows: Sequence[dict], row_key: Callable[[dict], str], col_key: Callable[[dict], str],
                   value: Callable[[dict], str], row_title: str = "", columns: Optional[Sequence[str]] = None) -> str:
    """A markdown table: one line per distinct ``row_key``, one column per ``col_key``."""
    row_names: list[str] = []
    cols: list[str] = list(columns) if columns else []
    cells: dict[tuple[str, str], str] = {}
    for r in rows:
        rk, ck = row_key(r), col_key(r)
        if rk not in row_names:
            row_names.append(rk)
        if ck not in cols:
            cols.append(ck)
        cells[(rk, ck)] = value(r)
    lines = ["| " + " | ".join([row_title] + cols) + " |", "|" + "---|" * (len(cols) + 1)]
    for rk in row_names:
        lines.append("| " + " | ".join([rk] + [cells.get((rk, c), "") for c in cols]) + " |")
    return "\n".join(lines)


def fmt_us(row: dict) -> str:
    """Cell text: p50 µs, or a short error tag."""
    if row.get("error"):
        return "err"
    p50 = row.get("us_p50")
    return "" if p50 is None else f"{p50:.1f}"


def provenance_footer(rows: Sequence[dict], command: str) -> str:
    """The closing lines of a results markdown file: where it ran and how to reproduce it."""
    env = rows[0] if rows else {}
    return (f"\nGPU {env.get('gpu')}, torch {env.get('torch')}, triton {env.get('triton')}, "
            f"commit {env.get('commit')}, {env.get('timestamp')}.\n\nReproduce: `{command}`\n")


def dry_run_timer(fn: Callable[[], object], *, calls: int = 1, repeats: int = 1, warmup: int = 0,
                  context: Callable[[], ContextManager] = _null_context, samples: Optional[list] = None,
                  ) -> dict[str, float]:
    """Stand-in for the timers in ``--dry-run`` (CPU smoke test of a bench script): one call."""
    with context():
        fn()
    if samples is not None:
        samples.append(0.0)
    return {"us_p20": 0.0, "us_p50": 0.0, "us_p80": 0.0}


# --- generated tables -----------------------------------------------------------------------------

#: The command that refreshes each data file (a GPU machine; ``bash bench/run_device.sh <stage>``
#: runs the same with the extension built in place).
COMMANDS = {
    "attention": "python3 bench/attention.py --out bench/results   # run_device.sh stage: attention",
    "attention_sweep": "python3 bench/attention.py --sweep --out bench/results   # stage: sweep",
    "attention_accuracy": "python3 bench/attention_accuracy.py --out bench/results",
    "cuda_attention_ablation": "python3 bench/cuda_attention_ablation.py --out bench/results   # stage: cuda-ablation",
    "dit_step": "python3 bench/dit_step.py --out bench/results   # stages: dit, dit-full, dit-compile",
    "wgmma_gemm": "python3 bench/wgmma_gemm.py --out bench/results   # stage: wgmma-gemm",
    "sm_ingest": "python3 bench/sm_ingest.py --out bench/results   # stage: sm-ingest",
    "graph_launch": "python3 bench/graph_launch.py --out bench/results --dtype fp16   # stage: graph-launch",
}

#: Variants shown as columns of the main table; every other variant is a measured alternative
#: (listed best-first under the main table).
MAIN_VARIANTS = {
    "dit_step": ("", "server", "compiled", "forward_chunk", "arena"),
}

#: Data files whose cell is another field than p50 µs: name -> (field, what it is).
CELL_FIELDS = {
    "sm_ingest": ("gb_per_s_per_sm", "GB/s per SM (p50, empty kernel subtracted), one CTA per SM"),
}

_ALTERNATIVES_SHOWN = 6


def _shape_text(shape) -> str:
    if isinstance(shape, dict):
        return ",".join(f"{k}={v}" for k, v in shape.items())
    return str(shape)


def _order(row: dict) -> tuple:
    shape = row.get("shape")
    values = list(shape.values()) if isinstance(shape, dict) else [shape]
    return (str(row.get("op")), [(0, v, "") if isinstance(v, (int, float)) else (1, 0, str(v)) for v in values],
            _dtype_text(row))


def _dtype_text(row: dict) -> str:
    return f"{row.get('dtype')}" + (f"/{row['precision']}" if row.get("precision") else "")


def _cell(row: dict, field: str = "us_p50") -> str:
    if row.get("error"):
        return "err"
    p50 = row.get(field)
    if p50 is None:
        return ""
    return f"{p50:.1f}" if p50 < 1000 else f"{p50:.0f}"


def _scalar_fields(row: dict, limit: int = 6) -> str:
    skip = set(ROW_FIELDS)
    items = [(k, v) for k, v in row.items() if k not in skip and isinstance(v, (int, float, str)) and v is not None]
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in items[:limit])


def render_table(name: str, rows: Sequence[dict]) -> str:
    """Markdown for the data file ``name`` (its stem): per (op, timing) a table of shape x dtype
    rows by provider columns (p50 µs), the measured alternatives best-first, and the provenance."""
    rows = sorted((r for r in rows if isinstance(r, dict) and r.get("op")), key=_order)
    main_variants = MAIN_VARIANTS.get(name, ("",))
    field, what = CELL_FIELDS.get(name, ("us_p50", "p50 µs per call"))
    cell = lambda r: _cell(r, field)  # noqa: E731
    text = [f"# {name}: {what} where timed (generated from `{name}.json` by `bench/_harness.py`; do not edit)\n"]
    sections: dict[tuple, list[dict]] = {}
    for r in rows:
        sections.setdefault((r.get("op"), r.get("timing") or "none"), []).append(r)
    for (op, timing), part in sorted(sections.items(), key=lambda kv: (kv[0][0], kv[0][1] != "cuda_graph")):
        def row_key(r):
            return f"{_shape_text(r.get('shape'))} {_dtype_text(r)}"

        def col_key(r):
            return (r.get("provider") or "") + (f" ({r['variant']})" if r.get("variant") else "")

        main = [r for r in part if (r.get("variant") or "") in main_variants
                and (r.get(field) is not None or r.get("error"))]
        if main:
            text.append(f"## {op}, timing {timing}\n")
            text.append(markdown_table(main, row_key, col_key, cell, row_title="shape dtype") + "\n")
        alts = [r for r in part if r not in main]
        if alts:
            text.append(f"## {op}, timing {timing}: measured alternatives "
                        f"(best {_ALTERNATIVES_SHOWN} per shape, dtype and provider)\n")
            groups: dict[tuple, list[dict]] = {}
            for r in alts:
                groups.setdefault((row_key(r), r.get("provider")), []).append(r)
            lines = ["| shape dtype | provider | variants (value, or fields) | count |", "|---|---|---|---|"]
            for (rk, prov), grp in groups.items():
                timed = sorted((r for r in grp if r.get(field) is not None), key=lambda r: r[field])
                shown = [f"{r.get('variant') or '-'} {cell(r)}" for r in timed[:_ALTERNATIVES_SHOWN]]
                if not timed:
                    shown = [f"{r.get('variant') or '-'}: {_scalar_fields(r)}" for r in grp[:_ALTERNATIVES_SHOWN]]
                lines.append(f"| {rk} | {prov} | {'; '.join(shown)} | {len(grp)} |")
            text.append("\n".join(lines) + "\n")
    gpus = sorted({str(r.get("gpu")) for r in rows})
    commits = sorted({str(r.get("commit")) for r in rows if r.get("commit")})
    stamps = sorted(str(r.get("timestamp")) for r in rows if r.get("timestamp"))
    text.append(f"{len(rows)} rows; GPU {', '.join(gpus) or '?'}; torch "
                f"{', '.join(sorted({str(r.get('torch')) for r in rows if r.get('torch')})) or '?'}; "
                f"{len(commits)} commits" + (f", {stamps[0][:10]} to {stamps[-1][:10]}" if stamps else "")
                + ". Each row carries its own commit and timestamp.\n")
    text.append(f"Reproduce: `{COMMANDS.get(name, f'python3 bench/{name}.py --out bench/results')}`\n")
    return "\n".join(text)


def write_table(path: str, rows: Optional[Sequence[dict]] = None) -> Optional[str]:
    """Write ``<path without .json>.md`` from the data file at ``path`` (or ``rows``); returns its
    path, or None when the file holds no benchmark rows (rows without an ``op``)."""
    if rows is None:
        with open(path) as f:
            rows = json.load(f)
    if not any(isinstance(r, dict) and r.get("op") for r in rows):
        return None
    name = os.path.splitext(os.path.basename(path))[0]
    md = os.path.splitext(path)[0] + ".md"
    with open(md, "w") as f:
        f.write(render_table(name, rows))
    return md


def write_tables(results_dir: str) -> list[str]:
    """Regenerate the table of every data file (``*.json``) in ``results_dir``."""
    written = []
    for fname in sorted(os.listdir(results_dir)):
        if fname.endswith(".json"):
            md = write_table(os.path.join(results_dir, fname))
            if md:
                written.append(md)
    return written


def _read_rows(path: str) -> list[dict]:
    with open(path) as f:
        if path.endswith(".jsonl"):
            return [json.loads(line) for line in f if line.strip()]
        data = json.load(f)
    return data if isinstance(data, list) else []


def merge_results(sources: Sequence[str], results_dir: str) -> dict[str, int]:
    """Upsert the rows of every data file in ``sources`` (files, or folders such as a device run's
    ``$OUT``) into ``results_dir/<same name>.json``: rows with the same identity key are replaced
    when the incoming row is at least as new (``timestamp``). Tables are regenerated. Returns
    {data file: rows merged}."""
    files = []
    for src in sources:
        if os.path.isdir(src):
            files += [os.path.join(src, f) for f in sorted(os.listdir(src)) if f.endswith((".json", ".jsonl"))]
        else:
            files.append(src)
    merged: dict[str, int] = {}
    for path in files:
        rows = [r for r in _read_rows(path) if isinstance(r, dict) and r.get("op")]
        if not rows:
            continue
        name, ext = os.path.splitext(os.path.basename(path))
        target = os.path.join(results_dir, name + ext)
        if os.path.abspath(target) == os.path.abspath(path):
            continue
        identity = IDENTITIES.get(name, IDENTITY)
        existing = _read_rows(target) if os.path.exists(target) else []
        index = {_identity(r, identity): i for i, r in enumerate(existing)}
        for row in rows:
            row.setdefault("variant", "")
            key = _identity(row, identity)
            if key not in index:
                index[key] = len(existing)
                existing.append(row)
            elif str(row.get("timestamp") or "") >= str(existing[index[key]].get("timestamp") or ""):
                existing[index[key]] = row
        os.makedirs(results_dir, exist_ok=True)
        with open(target, "w") as f:
            if ext == ".jsonl":
                f.writelines(json.dumps(row) + "\n" for row in existing)
            else:
                json.dump(existing, f, indent=1)
        if ext != ".jsonl":  # a .jsonl file's table is its bench's own (e.g. bench/serving.py --tables)
            write_table(target, existing)
        merged[target] = merged.get(target, 0) + len(rows)
    return merged


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="bench/results: one data file per benchmark and its generated table")
    ap.add_argument("--tables", action="store_true", help="regenerate every <name>.md from <name>.json")
    ap.add_argument("--merge", nargs="+", metavar="PATH",
                    help="upsert the rows of these data files / folders (e.g. a device run's $OUT) into --dir")
    ap.add_argument("--dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    if not (args.tables or args.merge):
        ap.print_help()
        return 0
    if args.merge:
        for target, n in merge_results(args.merge, args.dir).items():
            print(f"{n} rows -> {target}")
    if args.tables:
        for md in write_tables(args.dir):
            print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
