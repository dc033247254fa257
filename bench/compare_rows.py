"""Compare two directories of benchmark rows (old tree vs new tree of one device call).

Every ``*.json`` (a list of rows) and ``*.jsonl`` (a row per line) file under each directory is read;
rows are matched on their identity key (``_harness.IDENTITY`` less the GPU), and the table gives the
old and new p50 and their ratio. A ratio above ``1 + tolerance`` is flagged as a regression.

    python3 bench/compare_rows.py OUT/old OUT/new [--tolerance 0.03]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

KEY = ("op", "provider", "variant", "shape", "dtype", "precision", "timing", "stage", "concurrency")


def load_rows(directory: str) -> dict[str, dict]:
    rows: dict[str, dict] = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.json")) + glob.glob(os.path.join(directory, "*.jsonl"))):
        with open(path) as f:
            text = f.read()
        try:
            items = json.loads(text) if path.endswith(".json") else [json.loads(x) for x in text.splitlines() if x]
        except json.JSONDecodeError:
            continue
        for row in items if isinstance(items, list) else []:
            if isinstance(row, dict) and "op" in row:
                rows[json.dumps([row.get(k) for k in KEY], sort_keys=True)] = row
    return rows


def value(row: dict):
    for name in ("us_p50", "step_ms_p50", "tick_ms_p50", "ms_p50"):
        if isinstance(row.get(name), (int, float)):
            return name, float(row[name])
    return None, None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--tolerance", type=float, default=0.03)
    args = ap.parse_args(argv)
    old, new = load_rows(args.old), load_rows(args.new)
    print("| op | provider/variant | shape | dtype | metric | old | new | new/old |")
    print("|---|---|---|---|---|---|---|---|")
    worse = 0
    for key in sorted(set(old) & set(new)):
        o, n = old[key], new[key]
        name, vo = value(o)
        _, vn = value(n)
        if vo is None or vn is None or vo <= 0:
            continue
        ratio = vn / vo
        flag = " **slower**" if ratio > 1 + args.tolerance else ""
        worse += bool(flag)
        label = o.get("provider", "") + (f"/{o['variant']}" if o.get("variant") else "")
        shape = ",".join(f"{k}={v}" for k, v in (o.get("shape") or {}).items()) or \
            " ".join(f"{k}={o[k]}" for k in ("stage", "concurrency") if o.get(k) is not None)
        print(f"| {o['op']} | {label} | {shape} | {o.get('dtype')} {o.get('precision') or ''} | {name} | "
              f"{vo:.1f} | {vn:.1f} | {ratio:.3f}{flag} |")
    only = sorted(set(old) ^ set(new))
    if only:
        print(f"\n{len(only)} rows in one tree only:", file=sys.stderr)
        for key in only:
            print("  ", "old" if key in old else "new", key, file=sys.stderr)
    print(f"\n{worse} row(s) more than {args.tolerance:.0%} slower")
    return 0


if __name__ == "__main__":
    sys.exit(main())
