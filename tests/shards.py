"""Run a test file's interpreter child process as parallel shards.

The Triton interpreter is single-threaded Python, so on CI's 2 cores one child walking every case
leaves a core idle for minutes (the body's interpreter cases and its property suite were 121 s and
157 s of a 12-minute run). ``run_shards`` starts one child per shard at once; each child takes
the cases ``cases[shard::shards]`` and the parent merges what they report.
"""

from __future__ import annotations

import os
import subprocess
from typing import Callable, Sequence


def shard_count(limit: int = 2) -> int:
    """Children to run at once: one per CPU core this process may use, at most ``limit``."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(limit, cores))


def run_shards(argv: Callable[[int, int], Sequence[str]], *, env: dict, cwd: str, timeout: float,
               shards: int | None = None) -> list[subprocess.CompletedProcess]:
    """Start ``argv(shard, shards)`` for every shard at once and wait for all of them.

    Each child gets ``OMP_NUM_THREADS=1`` (the shards already fill the cores). Returns one
    ``CompletedProcess`` (text stdout/stderr) per shard, in shard order; a child still running
    after ``timeout`` seconds is killed and reported with return code -9.
    """
    shards = shard_count() if shards is None else shards
    env = dict(env, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(list(argv(i, shards)), cwd=cwd, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(shards)]
    done = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            err += f"\n[shards] killed after {timeout} s"
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done
