"""bench/_memory.py: a CUDA memory snapshot summarised by pool and by the source line that
allocated each block (a synthetic snapshot in torch.cuda.memory._snapshot()'s layout)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import _memory as M  # noqa: E402

MIB = 2 ** 20


def _frame(path: str, line: int, name: str) -> dict:
    return {"filename": path, "line": line, "name": name}


TORCH = _frame("/venv/lib/python3.12/site-packages/torch/nn/functional.py", 10, "linear")
ARENA = _frame("/repo/torch_cfm/models/cache.py", 120, "__init__")
SCRATCH = _frame("/repo/torch_cfm/solve/caches.py", 139, "__init__")
USER = _frame("/home/me/serve.py", 7, "main")


def _block(mib: int, state: str, *frames) -> dict:
    return {"size": mib * MIB, "requested_size": mib * MIB, "address": 0, "state": state, "frames": list(frames)}


SNAPSHOT = {"segments": [
    {"segment_pool_id": (0, 0), "total_size": 100 * MIB, "allocated_size": 90 * MIB, "blocks": [
        _block(60, "active_allocated", TORCH, ARENA, USER), _block(30, "active_allocated", TORCH, ARENA, USER),
        _block(10, "inactive", TORCH, ARENA)]},
    {"segment_pool_id": (1, 3), "total_size": 400 * MIB, "allocated_size": 8 * MIB, "blocks": [
        _block(8, "active_allocated", TORCH, USER), _block(250, "inactive", SCRATCH),
        _block(142, "inactive", TORCH)]},
]}


def test_pools_reserved_against_allocated_largest_first():
    report = M.summarize(SNAPSHOT)
    assert report["pools"] == [dict(pool="(1, 3)", reserved_mib=400.0, allocated_mib=8.0),
                               dict(pool="(0, 0)", reserved_mib=100.0, allocated_mib=90.0)]


def test_allocated_blocks_by_the_innermost_project_frame():
    report = M.summarize(SNAPSHOT, roots=(os.sep + "torch_cfm" + os.sep,))
    assert report["top"] == [dict(where="cache.py:120 __init__", pool="(0, 0)", mib=90.0, blocks=2),
                             dict(where="serve.py:7 main", pool="(1, 3)", mib=8.0, blocks=1)]
    assert M.summarize(SNAPSHOT, top=1)["top"][0]["mib"] == 90.0
    assert any("reserved 400.0 MiB, allocated 8.0 MiB" in line for line in M.lines(report))
