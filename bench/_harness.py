"""Shared benchmark harness: CUDA-graph and eager timing, provenance, upserted JSON rows, tables.

Timing: the callable is warmed up on a side stream, then ``calls`` back-to-back calls are captured
into one CUDA graph; each repeat replays it between two CUDA events (µs per call; ``us_p20/p50/p80``
over the repeats). Eager timing runs the same calls without a graph (host launch cost included).

Rows carry their provenance (gpu, torch, triton, commit, timestamp) and ``run_id``, one per
process. One data file per benchmark under ``bench/results/`` is upserted by identity key (the
newest row wins); ``<name>.md`` next to it is generated from it. A table line holds one run's rows
and compares torch_cfm with peers of that line only. ``python3 bench/_harness.py --merge "$OUT"``
upserts a device run's files (run ids kept) and lists the torch_cfm rows left without a same-run
peer; ``--tables`` regenerates the tables, ``--unpaired`` lists such rows for the whole folder.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import platform
import secrets
import shutil
import subprocess
from typing import Callable, ContextManager, Iterable, Optional, Sequence

import torch

IDENTITY = ("op", "provider", "variant", "shape", "dtype", "precision", "timing", "gpu")
# Data files whose rows are told apart by other fields (a .jsonl file keeps its own bench's table)
IDENTITIES = {"serving": ("op", "provider", "variant", "stage", "concurrency", "dtype", "gpu"),
              "serving_vllm_omni": ("op", "provider", "variant", "dtype", "concurrency", "gpu", "run"),
              "vocoder": IDENTITY + ("run_id",)}
ROW_FIELDS = ("op", "provider", "variant", "shape", "dtype", "precision", "timing", "us_p20", "us_p50",
              "us_p80", "rel_err", "error", "gpu", "capability", "torch", "triton", "commit", "timestamp", "run_id")


def percentiles(values: Sequence[float]) -> dict[str, float]:
    xs = sorted(values)

    def pct(p: float) -> float:
        if not xs:
            return float("nan")
        pos = (len(xs) - 1) * p
        lo, hi = math.floor(pos), math.ceil(pos)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"us_p20": round(pct(0.2), 3), "us_p50": round(pct(0.5), 3), "us_p80": round(pct(0.8), 3)}


def tf32_context(dtype: torch.dtype, precision: Optional[str], device: str) -> Callable[[], ContextManager]:
    """Factory of the context that sets torch's TF32 flags the way the estimator body does.

    Only CUDA fp32 runs change anything: cuBLAS/cuDNN follow those flags (off by default), so a
    cuBLAS peer timed without them runs IEEE SGEMM, not TF32."""
    if dtype == torch.float32 and device == "cuda":
        from torch_cfm import policy

        return lambda: policy.tf32_scope(precision == "tf32")
    return contextlib.nullcontext


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
                    context: Callable[[], ContextManager] = contextlib.nullcontext, samples: Optional[list] = None,
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
               context: Callable[[], ContextManager] = contextlib.nullcontext) -> dict[str, float]:
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


_RUN_ID: list[str] = []


def run_id() -> str:
    """This process's run id: its UTC start second and 6 random hex digits, e.g.
    ``20261205T101500Z-3fa2c1``. Every row the process writes carries it; rows of different
    processes never share one, even on the same commit and machine (their host work differs)."""
    if not _RUN_ID:
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        _RUN_ID.append(f"{stamp}-{secrets.token_hex(3)}")
    return _RUN_ID[0]


def env_info() -> dict[str, object]:
    """Provenance fields of every row: gpu, capability, torch, triton, commit, timestamp, run_id."""
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
        "run_id": run_id(),
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


def read_rows(path: str, strict: bool = False) -> list[dict]:
    """The rows of a data file: a JSON list (``.json``) or one JSON object per line (``.jsonl``);
    [] when it is missing, or unreadable unless ``strict`` (then the error is raised)."""
    if not os.path.exists(path):
        return []
    try:
        with open(path) as f:
            if path.endswith(".jsonl"):
                return [json.loads(line) for line in f if line.strip()]
            data = json.load(f)
        return data if isinstance(data, list) else []
    except (OSError, ValueError):
        if strict:
            raise
        return []


def _upsert(existing: list[dict], rows: Iterable[dict], identity: Sequence[str], newer_only=False) -> list[dict]:
    """``existing`` with ``rows`` upserted by their ``identity`` key; with ``newer_only`` an incoming
    row replaces only a row whose ``timestamp`` is not newer. Rows are kept whole (``run_id`` too)."""
    index = {_identity(r, identity): i for i, r in enumerate(existing)}
    for row in rows:
        key = _identity(row, identity)
        if key not in index:
            index[key] = len(existing)
            existing.append(row)
        elif not newer_only or str(row.get("timestamp") or "") >= str(existing[index[key]].get("timestamp") or ""):
            existing[index[key]] = row
    return existing


def _write_rows(path: str, rows: Sequence[dict]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        if path.endswith(".jsonl"):
            f.writelines(json.dumps(row) + "\n" for row in rows)
        else:
            json.dump(list(rows), f, indent=1)


def upsert_rows(path: str, rows: Iterable[dict], *, table: bool = True,
                identity: Sequence[str] = IDENTITY) -> list[dict]:
    """Merge ``rows`` into the data file at ``path`` (``.json`` list or ``.jsonl`` lines), replacing
    rows with the same ``identity`` key, then (``table``, ``.json`` files) regenerate the table
    ``<path without .json>.md`` from the whole file."""
    existing = _upsert(read_rows(path), rows, identity)
    _write_rows(path, existing)
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
            f"commit {env.get('commit')}, {env.get('timestamp')}, run {env.get('run_id') or '(no run id)'}.\n\n"
            f"Reproduce: `{command}`\n")


def dry_run_timer(fn: Callable[[], object], *, calls: int = 1, repeats: int = 1, warmup: int = 0,
                  context: Callable[[], ContextManager] = contextlib.nullcontext, samples: Optional[list] = None,
                  ) -> dict[str, float]:
    """Stand-in for the timers in ``--dry-run`` (CPU smoke test of a bench script): one call."""
    with context():
        fn()
    if samples is not None:
        samples.append(0.0)
    return {"us_p20": 0.0, "us_p50": 0.0, "us_p80": 0.0}


# --- runs ---------------------------------------------------------------------------------------------

SUBJECT = "torch_cfm"  #: the provider a table compares with its peers


def run_of(row: dict) -> str:
    """The run a row was measured in: its ``run_id``. Rows from before run ids: one run per (commit,
    timestamp), since every bench took both once per process and no process took under a second;
    a row with no timestamp is never paired."""
    if row.get("run_id"):
        return str(row["run_id"])
    if row.get("timestamp"):
        return f"{row.get('commit') or 'unknown'} {row['timestamp']}"
    return f"unpaired row {id(row)}"


def is_peer(provider: Optional[str]) -> bool:
    """A provider torch_cfm is compared with: not one of torch_cfm's own (``torch_cfm*``, e.g. a
    forced kernel) and not a floor (``*lowerbound``, e.g. attention without its mask)."""
    p = provider or ""
    return bool(p) and not p.startswith(SUBJECT) and "lowerbound" not in p.lower()


def run_labels(rows: Sequence[dict]) -> dict[str, str]:
    """{run: "r1", "r2", ...}, oldest run first (by its earliest timestamp)."""
    first: dict[str, str] = {}
    for r in rows:
        key = run_of(r)
        stamp = str(r.get("timestamp") or "")
        if key not in first or stamp < first[key]:
            first[key] = stamp
    return {key: f"r{i + 1}" for i, key in enumerate(sorted(first, key=lambda k: (first[k], k)))}


def run_legend(rows: Sequence[dict], labels: dict[str, str]) -> str:
    """One markdown line per run: its label, run id (or how it was inferred), commit, time, GPU, versions."""
    first = {run_of(r): r for r in reversed(rows)}
    return "\n".join(
        f"- {labels[k]}: " + (f"run `{r['run_id']}`" if r.get("run_id") else "no run id (one run per commit + "
                              "timestamp)" if r.get("timestamp") else "no run id or timestamp (unpaired)")
        + f"; commit {r.get('commit')}, {r.get('timestamp')}, {r.get('gpu')}, torch {r.get('torch')}, "
          f"triton {r.get('triton')}" for k, r in sorted(first.items(), key=lambda kv: int(labels[kv[0]][1:])))


def _timed(rows: Sequence[dict], field: str, peer: bool) -> list[dict]:
    """The rows with a value: torch_cfm's own (variant "") or, with ``peer``, the peers'."""
    return [r for r in rows if not r.get("error") and r.get(field) is not None and
            (is_peer(r.get("provider")) if peer else r.get("provider") == SUBJECT and not r.get("variant"))]


def same_run_comparison(line: Sequence[dict], field: str = "us_p50", peer_elsewhere: bool = True) -> str:
    """The comparison cell of one table line (rows of one run, one shape and dtype): best peer ÷
    torch_cfm (> 1: torch_cfm is faster) with the peer's name; "no same-run peer" where torch_cfm
    has none in its run but ``peer_elsewhere`` (another run measured a peer at this shape)."""
    ours, peers = (_timed(line, field, False) or [None])[0], _timed(line, field, True)
    if ours and peers and ours[field] > 0:  # 0: a --dry-run row, not a time
        best = min(peers, key=lambda r: r[field])
        name = best["provider"] + (f" ({best['variant']})" if best.get("variant") else "")
        return f"{best[field] / ours[field]:.2f}× vs {name}"
    if ours and peer_elsewhere:
        return "no same-run peer"
    return ""


def _line_key(row: dict) -> str:
    return f"{_shape_text(row.get('shape'))} {_dtype_text(row)}"


def unpaired(rows: Sequence[dict]) -> list[str]:
    """torch_cfm rows (variant "") that have peers at their shape, dtype and timing, none of them
    measured in their run: the comparisons a merge broke, to be re-measured in one run."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if isinstance(r, dict) and r.get("op"):
            groups.setdefault((r.get("op"), r.get("timing"), _line_key(r)), []).append(r)
    out = []
    for (op, timing, line), grp in groups.items():
        if not _timed(grp, "us_p50", True):
            continue
        for ours in (r for r in grp if r.get("provider") == SUBJECT and not r.get("variant")):
            if not _timed([r for r in grp if run_of(r) == run_of(ours)], "us_p50", True):
                out.append(f"{op} {timing} {line}: torch_cfm of {run_of(ours)}")
    return sorted(out)


# --- generated tables -----------------------------------------------------------------------------

#: The command that refreshes each data file (``bash bench/run_device.sh <stage>``: the same, built in place).
COMMANDS = {
    "attention": "python3 bench/attention.py --out bench/results   # run_device.sh stage: attention",
    "attention_sweep": "python3 bench/attention.py --sweep --out bench/results   # stage: sweep",
    "attention_accuracy": "python3 bench/attention_accuracy.py --out bench/results",
    "vocoder_tiles": "python3 bench/vocoder_tiles.py --out bench/results   # then the TABLE entries it prints",
    "cuda_attention_ablation": "python3 bench/cuda_attention_ablation.py --out bench/results   # stage: cuda-ablation",
    "dit_step": "python3 bench/dit_step.py --out bench/results   # stages: dit, dit-full, dit-compile",
    "wgmma_gemm": "python3 bench/wgmma_gemm.py --out bench/results [--parts rownorm]   # stage: wgmma-gemm",
    "sm_ingest": "python3 bench/sm_ingest.py --out bench/results   # stage: sm-ingest",
    "graph_launch": "python3 bench/graph_launch.py --out bench/results --dtype fp16   # stage: graph-launch",
}

#: Data files whose table their bench writes itself (one run's rows, in its own layout): the
#: harness leaves ``<name>.md`` alone, and ``--merge`` copies the run's table from beside its data.
OWN_TABLES = ("stepaudio2_stream", "cutlass_gemm", "minicpmo_stream")

#: Variants shown as columns of the main table; every other variant is a measured alternative
#: (listed best-first under the main table).
MAIN_VARIANTS = {"dit_step": ("", "server", "compiled", "forward_chunk", "arena")}

#: Data files whose cell is another field than p50 µs: name -> (field, what it is).
CELL_FIELDS = {"sm_ingest": ("gb_per_s_per_sm", "GB/s per SM (p50, empty kernel subtracted), one CTA per SM")}

_ALTERNATIVES_SHOWN = 6


def _shape_text(shape) -> str:
    return ",".join(f"{k}={v}" for k, v in shape.items()) if isinstance(shape, dict) else str(shape)


def _order(row: dict) -> tuple:
    shape = row.get("shape")
    values = list(shape.values()) if isinstance(shape, dict) else [shape]
    return (str(row.get("op")), [(0, v, "") if isinstance(v, (int, float)) else (1, 0, str(v)) for v in values],
            _dtype_text(row), str(row.get("timestamp") or ""))


def _dtype_text(row: dict) -> str:
    return f"{row.get('dtype')}" + (f"/{row['precision']}" if row.get("precision") else "")


def _cell(row: dict, field: str = "us_p50") -> str:
    if row.get("error"):
        return "err"
    v = row.get(field)
    return "" if v is None else f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def _scalar_fields(row: dict, limit: int = 6) -> str:
    skip = set(ROW_FIELDS)
    items = [(k, v) for k, v in row.items() if k not in skip and isinstance(v, (int, float, str)) and v is not None]
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in items[:limit])


def _main_table(main: Sequence[dict], labels: dict[str, str], field: str) -> str:
    """One line per (shape dtype, run), providers as columns; the last column compares torch_cfm
    with the best peer of that line only (where the section has peers and torch_cfm rows)."""
    col = lambda r: (r.get("provider") or "") + (f" ({r['variant']})" if r.get("variant") else "")  # noqa: E731
    cols = list(dict.fromkeys(col(r) for r in main))
    lines: dict[tuple[str, str], list[dict]] = {}
    for r in main:
        lines.setdefault((_line_key(r), run_of(r)), []).append(r)
    compare = any(r.get("provider") == SUBJECT for r in main) and bool(_timed(main, field, True)) and field == "us_p50"
    peered = {key for (key, _), rs in lines.items() if _timed(rs, field, True)}
    head = ["shape dtype", "run"] + cols + (["same run: best peer ÷ torch_cfm"] if compare else [])
    text = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (key, run), rs in lines.items():
        cells = {col(r): _cell(r, field) for r in rs}
        extra = [same_run_comparison(rs, field, key in peered)] if compare else []
        text.append("| " + " | ".join([key, labels[run]] + [cells.get(c, "") for c in cols] + extra) + " |")
    return "\n".join(text)


def _alternatives_table(alts: Sequence[dict], labels: dict[str, str], field: str) -> str:
    """Per (shape dtype, run, provider): its measured variants, best first (ranked within one run)."""
    groups: dict[tuple, list[dict]] = {}
    for r in alts:
        groups.setdefault((_line_key(r), run_of(r), r.get("provider")), []).append(r)
    lines = ["| shape dtype | run | provider | variants (value, or fields) | count |", "|---|---|---|---|---|"]
    for (rk, run, prov), grp in groups.items():
        timed = sorted((r for r in grp if r.get(field) is not None), key=lambda r: r[field])
        shown = [f"{r.get('variant') or '-'} {_cell(r, field)}" for r in timed[:_ALTERNATIVES_SHOWN]]
        if not timed:
            shown = [f"{r.get('variant') or '-'}: {_scalar_fields(r)}" for r in grp[:_ALTERNATIVES_SHOWN]]
        lines.append(f"| {rk} | {labels[run]} | {prov} | {'; '.join(shown)} | {len(grp)} |")
    return "\n".join(lines)


def render_table(name: str, rows: Sequence[dict]) -> str:
    """Markdown for the data file ``name`` (its stem): per (op, timing) a table of (shape x dtype,
    run) lines by provider columns with the same-run comparison, the measured alternatives, the runs."""
    rows = sorted((r for r in rows if isinstance(r, dict) and r.get("op")), key=_order)
    labels = run_labels(rows)
    main_variants = MAIN_VARIANTS.get(name, ("",))
    field, what = CELL_FIELDS.get(name, ("us_p50", "p50 µs per call"))
    text = [f"# {name}: {what} where timed (generated from `{name}.json` by `bench/_harness.py`; do not edit)\n",
            "Each line holds the rows of one run (legend below); torch_cfm is compared only with peers of its "
            "own line. Peers: every provider but torch_cfm's own (`torch_cfm*`) and floors (`*lowerbound`).\n"]
    sections: dict[tuple, list[dict]] = {}
    for r in rows:
        sections.setdefault((r.get("op"), r.get("timing") or "none"), []).append(r)
    for (op, timing), part in sorted(sections.items(), key=lambda kv: (kv[0][0], kv[0][1] != "cuda_graph")):
        main = [r for r in part if (r.get("variant") or "") in main_variants
                and (r.get(field) is not None or r.get("error"))]
        if main:
            text.append(f"## {op}, timing {timing}\n")
            text.append(_main_table(main, labels, field) + "\n")
        alts = [r for r in part if r not in main]
        if alts:
            text.append(f"## {op}, timing {timing}: measured alternatives "
                        f"(best {_ALTERNATIVES_SHOWN} per shape, dtype, run and provider)\n")
            text.append(_alternatives_table(alts, labels, field) + "\n")
    text.append(f"{len(rows)} rows in {len(labels)} runs:\n\n{run_legend(rows, labels)}\n")
    text.append(f"Reproduce: `{COMMANDS.get(name, f'python3 bench/{name}.py --out bench/results')}`\n")
    return "\n".join(text)


def write_table(path: str, rows: Optional[Sequence[dict]] = None) -> Optional[str]:
    """Write ``<path without .json>.md`` from the data file at ``path`` (or ``rows``); returns its
    path, or None when the file holds no benchmark rows (rows without an ``op``) or its bench
    writes its own table (``OWN_TABLES``)."""
    name = os.path.splitext(os.path.basename(path))[0]
    if name in OWN_TABLES:
        return None
    rows = read_rows(path, strict=True) if rows is None else rows
    if not any(isinstance(r, dict) and r.get("op") for r in rows):
        return None
    md = os.path.splitext(path)[0] + ".md"
    with open(md, "w") as f:
        f.write(render_table(name, rows))
    return md


def write_tables(results_dir: str) -> list[str]:
    """Regenerate the table of every data file (``*.json``) in ``results_dir``."""
    mds = (write_table(os.path.join(results_dir, f)) for f in sorted(os.listdir(results_dir)) if f.endswith(".json"))
    return [md for md in mds if md]


def merge_results(sources: Sequence[str], results_dir: str) -> dict[str, int]:
    """Upsert the rows of the data files in ``sources`` (files, or folders such as a device run's
    ``$OUT``) into ``results_dir``, the incoming row winning unless older; regenerate the tables
    (an ``OWN_TABLES`` bench's own is copied from beside its data) and print the torch_cfm rows left
    without a same-run peer. Returns {data file: rows merged}."""
    files = []
    for src in sources:
        if os.path.isdir(src):
            files += [os.path.join(src, f) for f in sorted(os.listdir(src)) if f.endswith((".json", ".jsonl"))]
        else:
            files.append(src)
    merged: dict[str, int] = {}
    for path in files:
        incoming = [dict(r, variant=r.get("variant") or "") for r in read_rows(path, strict=True)
                    if isinstance(r, dict) and r.get("op")]
        name, ext = os.path.splitext(os.path.basename(path))
        target = os.path.join(results_dir, name + ext)
        if not incoming or os.path.abspath(target) == os.path.abspath(path):
            continue
        existing = _upsert(read_rows(target, strict=True), incoming, IDENTITIES.get(name, IDENTITY), newer_only=True)
        _write_rows(target, existing)
        own_md = os.path.splitext(path)[0] + ".md"
        if name in OWN_TABLES and os.path.exists(own_md):
            shutil.copyfile(own_md, os.path.splitext(target)[0] + ".md")
        elif ext != ".jsonl":  # a .jsonl file's table is its bench's own (e.g. bench/serving.py --tables)
            write_table(target, existing)
        for line in unpaired(existing):
            print(f"{os.path.basename(target)}: no same-run peer: {line}")
        merged[target] = merged.get(target, 0) + len(incoming)
    return merged


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="bench/results: one data file per benchmark and its generated table")
    ap.add_argument("--tables", action="store_true", help="regenerate every <name>.md from <name>.json")
    ap.add_argument("--merge", nargs="+", metavar="PATH",
                    help="upsert the rows of these data files / folders (e.g. a device run's $OUT) into --dir")
    ap.add_argument("--unpaired", action="store_true",
                    help="list the torch_cfm rows of --dir that have peers, none measured in their run")
    ap.add_argument("--dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    if not (args.tables or args.merge or args.unpaired):
        ap.print_help()
    if args.merge:
        for target, n in merge_results(args.merge, args.dir).items():
            print(f"{n} rows -> {target}")
    if args.tables:
        for md in write_tables(args.dir):
            print(md)
    for fname in sorted(os.listdir(args.dir)) if args.unpaired else []:
        for line in unpaired(read_rows(os.path.join(args.dir, fname))) if fname.endswith((".json", ".jsonl")) else []:
            print(f"{fname}: {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
