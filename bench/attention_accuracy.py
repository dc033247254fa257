#!/usr/bin/env python3
"""docs/design.md §6 error ratios of cfm_attention kernel configs on sharp fp32 softmaxes (an experiment tool).

For each config, every case is run through the Triton kernel and measured against float64
(``tests/oracle.py``'s naive attention): ``ratio = err(fast) / (2 · err(fp32 reference) + 1e-6)``
for the max-abs error (the docs/design.md §6 rule; a case fails when ratio > 1). Cases: the case pinned by
``tests/test_properties.py::test_sharp_fp32_softmax_cases_within_oracle_cuda`` (fp32 "ieee", inputs
×2, K = 233), then ``--cases`` random ones with inputs scaled by each of ``--scales`` and their
keys shuffled (the property that found it), D ∈ {16, 32, 64, 128}, K ∈ [1, 600).

It reuses the test suite's oracle and case builders (``tests/``), so it runs from a checkout.
Rows (``op`` = "cfm_attention_accuracy", one per config) go to ``<out>/attention_accuracy.json``
with the fail count, the max and p99 ratio and provenance. ``--dry-run`` runs two cases on CPU
under the Triton interpreter (a smoke test: the interpreter's dots are exact, so its ratios say
nothing about the GPU).

    python3 bench/attention_accuracy.py --configs default,noslab --cases 300
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import torch  # noqa: E402

from _harness import env_info, make_row, upsert_rows  # noqa: E402

# configs by name: fields replaced on the heuristic's choice for each case
CONFIGS = {"default": {}, "noslab": {"qk_slab": 0}, "slab16": {"qk_slab": 16}, "slab32": {"qk_slab": 32},
           "fma": {"ieee_dot": "ieee"}}


def sharp_cases(n_random: int, scales: list[float], seed: int, device: str):
    """(name, AttnCase) pairs: the pinned case (both copies), then random shuffled sharp cases."""
    import strategies as S
    from test_properties import permute_frames

    rng = random.Random(seed)
    specs = [(S.AttnSpec(n=2, h=1, q_len=1, k_len=233, d=64, seed=0, scale=2.0), 0, "pinned")]
    for i in range(n_random):
        spec = S.AttnSpec(n=rng.choice([1, 2, 4]), h=rng.choice([1, 2]), q_len=rng.choice([1, 3, 17, 50]),
                          k_len=rng.randrange(1, 600), d=rng.choice([16, 32, 64, 128]), seed=rng.randrange(10**6),
                          scale=rng.choice(scales))
        specs.append((spec, rng.randrange(10**6), f"r{i}"))
    for spec, perm_seed, name in specs:
        values = S.logical_values(spec)
        case = S.arrange(spec, values, device, torch.float32)
        yield name, case
        yield name + "-shuffled", S.arrange(spec, permute_frames(case, values, False, perm_seed), device, torch.float32)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="default,noslab", help=f"comma list of {sorted(CONFIGS)}")
    ap.add_argument("--cases", type=int, default=200, help="random cases besides the pinned one")
    ap.add_argument("--scales", default="1,2", help="input scales of the random cases")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--dry-run", action="store_true", help="CPU smoke test (TRITON_INTERPRET=1), 2 cases")
    args = ap.parse_args(argv)
    if args.dry_run:  # before anything imports triton
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import strategies as S
    from oracle import err_max, max_abs_bound, naive_attention64
    from torch_cfm.kernels._launch import sm_count
    from torch_cfm.kernels.cfm_attention import choose_config, cfm_attention_triton

    device = "cpu" if args.dry_run else "cuda"
    names = args.configs.split(",")
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; choose from {sorted(CONFIGS)}")
    ratios: dict[str, list[float]] = {c: [] for c in names}
    worst: dict[str, tuple[float, str]] = {c: (0.0, "") for c in names}
    n_cases = 0 if args.dry_run else args.cases
    for case_name, case in sharp_cases(n_cases, [float(s) for s in args.scales.split(",")], args.seed, device):
        ref64 = naive_attention64(case.q, case.k, case.v, case.key_lengths, case.mask, case.kv_rows)
        bound = max_abs_bound(err_max(S.attention_same_dtype(case).cpu(), ref64))
        n, h, q_len, d = case.q.shape
        base = choose_config(torch.float32, d, n * h, q_len, case.k.shape[2], sm_count(case.q.device), "ieee")
        for name in names:
            out = torch.empty_like(case.q)
            cfm_attention_triton(case.q, case.k, case.v, case.key_lengths, case.mask, case.kv_rows, "ieee", out,
                                 replace(base, **CONFIGS[name]))
            r = err_max(out.cpu(), ref64) / bound
            ratios[name].append(r)
            if r > worst[name][0]:
                worst[name] = (r, f"{case_name} {case.spec.describe()} x{case.spec.scale}")
    env = env_info()
    rows = []
    for name in names:
        rs = sorted(ratios[name])
        row = make_row(env, op="cfm_attention_accuracy", provider="torch_cfm", variant=name, dtype="float32",
                       precision="ieee", timing="none", shape={"cases": len(rs), "scales": args.scales},
                       fails=sum(r > 1 for r in rs), max_ratio=round(rs[-1], 3),
                       p99_ratio=round(rs[min(len(rs) - 1, int(0.99 * len(rs)))], 3), worst_case=worst[name][1])
        rows.append(row)
        print(f"{name:10s} fails {row['fails']}/{len(rs)}  max ratio {row['max_ratio']}  p99 {row['p99_ratio']}  "
              f"worst: {worst[name][1]}")
    os.makedirs(args.out, exist_ok=True)
    upsert_rows(os.path.join(args.out, "attention_accuracy.json"), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
