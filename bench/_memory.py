"""Where a process's CUDA memory is: allocated bytes by the source line that allocated them, and
reserved against allocated bytes per memory pool (a CUDA graph's private pool holds what its
capture allocated; once captured, the intermediates are free blocks of the pool: reserved, not
allocated, yet not available to anything else).

    import _memory as M
    M.start()                      # before building: record each allocation's Python stack
    ...                            # build, warm up, serve
    report = M.attribution(top=20) # {"pools": [...], "top": [...]} from torch.cuda.memory._snapshot()
    M.stop()

:func:`summarize` is the pure part (a snapshot dict in, the report out), tested on the CPU.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Optional

import torch

MIB = 2 ** 20
#: frames from these folders are the allocator's callers, not where the memory is asked for
_SKIP = (os.sep + "torch" + os.sep, os.sep + "contextlib.py", os.sep + "functools.py")


def start(max_entries: int = 200_000) -> bool:
    """Record the Python stack of every CUDA allocation from now on (False without CUDA)."""
    if not torch.cuda.is_available():
        return False
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    return True


def stop() -> None:
    if torch.cuda.is_available():
        torch.cuda.memory._record_memory_history(enabled=None)


def _where(frames: list, roots: tuple[str, ...]) -> str:
    """The innermost frame in one of ``roots`` (the project), else the innermost frame not in torch."""
    outside = None
    for fr in frames or []:
        name = fr.get("filename", "")
        if any(r in name for r in roots):
            return f"{os.path.basename(name)}:{fr.get('line')} {fr.get('name', '')}".strip()
        if outside is None and name and not any(s in name for s in _SKIP):
            outside = f"{os.path.basename(name)}:{fr.get('line')} {fr.get('name', '')}".strip()
    return outside or "(no Python frame)"


ROOTS = tuple(os.sep + name + os.sep for name in ("torch_cfm", "bench", "vllm_omni", "stepaudio2"))


def summarize(snapshot: dict, top: int = 20, roots: tuple[str, ...] = ROOTS) -> dict:
    """A ``torch.cuda.memory._snapshot()`` as {"pools": [{pool, reserved_mib, allocated_mib}],
    "top": [{where, pool, mib, blocks}]}: pools by reserved bytes, allocated blocks grouped by the
    innermost frame of ``roots`` (see :func:`_where`) and pool, largest first."""
    pools: dict = defaultdict(lambda: [0, 0])
    groups: dict = defaultdict(lambda: [0, 0])
    for seg in snapshot.get("segments", []):
        pool = str(tuple(seg.get("segment_pool_id", (0, 0))))
        pools[pool][0] += seg.get("total_size", 0)
        pools[pool][1] += seg.get("allocated_size", 0)
        for blk in seg.get("blocks", []):
            if blk.get("state") != "active_allocated":
                continue
            g = groups[(_where(blk.get("frames"), roots), pool)]
            g[0] += blk.get("size", 0)
            g[1] += 1
    pool_rows = [dict(pool=p, reserved_mib=round(r / MIB, 1), allocated_mib=round(a / MIB, 1))
                 for p, (r, a) in sorted(pools.items(), key=lambda kv: -kv[1][0])]
    top_rows = [dict(where=w, pool=p, mib=round(b / MIB, 1), blocks=n)
                for (w, p), (b, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]]
    return {"pools": pool_rows, "top": top_rows}


def attribution(top: int = 20, device: Optional[int] = None) -> dict:
    """:func:`summarize` of this process's snapshot now (empty without CUDA)."""
    if not torch.cuda.is_available():
        return {"pools": [], "top": []}
    return summarize(torch.cuda.memory._snapshot(device), top)


def lines(report: dict) -> list[str]:
    """The report as printable lines."""
    out = [f"pool {p['pool']}: reserved {p['reserved_mib']} MiB, allocated {p['allocated_mib']} MiB"
           for p in report.get("pools", [])]
    out += [f"{t['mib']:9.1f} MiB in {t['blocks']:5d} blocks  pool {t['pool']}  {t['where']}" for t in report.get("top", [])]
    return out
