"""The steady CFM tick on the table's body plan against named plans (experiment; issue 41).

Each side's server is built and captured inside ``use_plan`` (``tick_ab.py``); a named plan on the CUTLASS
library (``cutlass_warp_rownorm``, the table's arena plan from 128 rows) needs it built (``bash csrc/cutlass/build.sh``,
or ``$TORCH_CFM_CUTLASS_SO``). Its first run: ``cutlass_body_plan.md``.

    python3 bench/experiments/plan_tick_ab.py --plans cutlass_warp_rownorm --streams 16,32,64 --out "$OUT"
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]

import torch  # noqa: E402

from _harness import env_info  # noqa: E402
from tick_ab import tick_ab  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plans", default="cutlass_warp_rownorm", help="comma list of body_plans.NAMED fp16 plans")
    ap.add_argument("--streams", default="16,32,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default="/tmp/plan_tick_ab")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    from torch_cfm.config import DiTConfig
    from torch_cfm.kernels import cutlass_gemm as cg
    from torch_cfm.kernels.body_plans import body_plan, use_plan
    from torch_cfm.models import random_dit

    print(f"CUTLASS library: {cg.unavailable_reason() or cg.library_path()}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    env = env_info()
    result = {"env": {k: env.get(k) for k in ("gpu", "torch", "triton", "commit", "run_id", "timestamp")},
              "library": cg.unavailable_reason() or cg.library_path(), "ticks": []}
    base = random_dit(DiTConfig(), seed=0)
    plans = args.plans.split(",")
    for c in (int(s) for s in args.streams.split(",")):
        sides = {"table": None, **{p: functools.partial(use_plan, p) for p in plans}}
        row = tick_ab(c, sides, base, rounds=args.rounds, repeats=args.repeats)
        row["table_plan"] = body_plan(torch.float16, None, 2 * c, arena=True).name
        print(f"tick {c} streams ({row['table_plan']}): " + ", ".join(f"{s} {row[s]} ms" for s in sides)
              + f"; rel diff {row['max_rel_diff']}; rounds {row['rounds_ms']}", flush=True)
        result["ticks"].append(row)
        json.dump(result, open(os.path.join(args.out, "plan_tick_ab.json"), "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
