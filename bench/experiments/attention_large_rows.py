"""``cfm_attention``'s tiles at the server's large batches (experiment; issue 41, lever "attention toward 3.5 TB/s").

The tile rules (``kernels/cfm_attention_config.choose_config`` for Triton, ``kernels/cfm_attention_cuda.choose_config``
for the CUDA kernel) were set from sweeps at N <= 32 rows. At 64 streams the CFM runs N = 128 rows (the guidance
pair), 8 heads, 50 queries over 450 keys, and its attention reads at 2.75 TB/s (``docs/performance.md`` §4: 7.5 ms
of a 41 ms tick). Floor: K and V once through HBM, 0.92 MB a row a call (118 MB at N = 128) at 3.35 TB/s.

1. The sweep (``bench/attention.py``'s candidates, a few more for many programs, and every CUDA config built):
   µs per call in a CUDA graph and error against float64, at N = 32 / 64 / 128, Q = 50, K = 450, fp16.
2. The whole steady tick (``tick_ab.py``) at 16 / 32 / 64 streams, fp16: the shipped rule against the sweep's best
   config at that N (patched into the rule for calls of the tick's row-heads), both servers built and captured in
   this process, timed alternately over rounds; the two servers' mels compared.

    python3 bench/experiments/attention_large_rows.py --out "$OUT"        # GPU (~4 min)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [os.path.dirname(HERE), ROOT]

import torch  # noqa: E402

import attention as A  # noqa: E402
from _harness import env_info  # noqa: E402
from tick_ab import tick_ab  # noqa: E402


def extra_triton_configs():
    """Neighbours of the shipped 16-bit tiles for grids of several waves (not in ``attention.sweep_configs``)."""
    from torch_cfm.kernels.cfm_attention import AttentionConfig as C

    return [C(32, 64, 1, 4, 3, pdl=False), C(32, 128, 1, 4, 2, pdl=False), C(64, 32, 1, 4, 3, pdl=False),
            C(64, 128, 1, 4, 3, pdl=False), C(64, 64, 1, 8, 3, pdl=False), C(64, 64, 1, 4, 4, pdl=False),
            C(64, 128, 1, 8, 3, pdl=False)]


def sweep(n_rows, q_len, k_len, calls, repeats) -> list[dict]:
    """[{config, us, rel_err}] sorted by time, for fp16 at one shape."""
    from torch_cfm.kernels import cfm_attention_cuda as cuda_kernel
    from torch_cfm.kernels.cfm_attention import cfm_attention_triton

    dtype = torch.float16
    inp = A.make_inputs(n_rows, q_len, k_len, dtype)
    q, k, v, lengths = inp["q"], inp["k"], inp["v"], inp["lengths"]
    out = torch.empty(n_rows, q_len, A.HEADS, A.HEAD_DIM, device="cuda", dtype=dtype).transpose(1, 2)
    configs = list(dict.fromkeys(A.sweep_configs(dtype, None) + extra_triton_configs()))
    if not cuda_kernel.not_supported_reasons(q, k, v, None):
        configs += list(cuda_kernel.runnable_configs(dtype, q.device))
    results = []
    for cfg in configs:
        if isinstance(cfg, cuda_kernel.CudaAttentionConfig):
            fn = (lambda cfg=cfg: cuda_kernel.cfm_attention_cuda(q, k, v, lengths, None, None, out, cfg))
        else:
            fn = (lambda cfg=cfg: cfm_attention_triton(q, k, v, lengths, None, None, None, out, config=cfg))
        try:
            out.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            err = A.rel_err(out, inp["ref64"])
            t = A.time_cuda_graph(fn, calls=calls, repeats=repeats)
            results.append({"config": cfg, "name": cfg.name, "us": t["us_p50"], "rel_err": err})
        except Exception as exc:  # noqa: BLE001
            print(f"  {cfg.name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    results.sort(key=lambda r: r["us"])
    return results


def patched_rules(candidate, min_rows_heads: int):
    """Context: the candidate config for 16-bit calls of at least ``min_rows_heads`` (row, head) pairs."""
    import contextlib

    from torch_cfm.kernels import cfm_attention as tri
    from torch_cfm.kernels import cfm_attention_cuda as cuda_kernel

    @contextlib.contextmanager
    def ctx():
        tri_rule, cuda_rule = tri.choose_config, cuda_kernel.choose_config
        is_cuda = isinstance(candidate, cuda_kernel.CudaAttentionConfig)
        big = lambda dtype, rh: dtype != torch.float32 and rh >= min_rows_heads  # noqa: E731

        def tri_new(dtype, head_dim, rows_heads, q_len, k_len, *a, **kw):
            if big(dtype, rows_heads) and not is_cuda:
                return candidate
            return tri_rule(dtype, head_dim, rows_heads, q_len, k_len, *a, **kw)

        def cuda_new(dtype, rows_heads, q_len, k_len, n_sm):
            if big(dtype, rows_heads):
                return candidate if is_cuda else None
            return cuda_rule(dtype, rows_heads, q_len, k_len, n_sm)

        tri.choose_config, cuda_kernel.choose_config = tri_new, cuda_new
        try:
            yield
        finally:
            tri.choose_config, cuda_kernel.choose_config = tri_rule, cuda_rule
    return ctx


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", default="16,32,64")
    ap.add_argument("--k-len", type=int, default=450)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--no-tick", action="store_true", help="the sweep only")
    ap.add_argument("--out", default="/tmp/attention_large_rows")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    os.makedirs(args.out, exist_ok=True)
    env = env_info()
    t0 = time.time()
    result = {"env": {k: env.get(k) for k in ("gpu", "torch", "triton", "commit", "run_id", "timestamp")},
              "sweep": {}, "tick": []}
    streams = [int(s) for s in args.streams.split(",")]
    best = {}
    for c in streams:
        n = 2 * c
        rows = sweep(n, 50, args.k_len, calls=20, repeats=15)
        from torch_cfm.kernels.cfm_attention import choose_config
        from torch_cfm.kernels import cfm_attention_cuda as cuda_kernel
        rule_t = choose_config(torch.float16, 64, n * 8, 50, args.k_len, 132)
        rule_c = cuda_kernel.choose_config(torch.float16, n * 8, 50, args.k_len, 132)
        rule_name = (rule_c or rule_t).name
        # the sweep names Triton configs with their PDL setting; the rule's own is the faster alone
        rule_us = min((r["us"] for r in rows if r["name"] == rule_name or r["name"] in
                       (rule_name + "_pdl", rule_name + "_nopdl")), default=float("nan"))
        ok = [r for r in rows if r["rel_err"] is not None and r["rel_err"] < 5e-3]
        best[c] = ok[0]["config"]
        floor_us = n * 8 * args.k_len * 0.75 * 64 * 2 * 2 / 3.35e6  # ragged lengths average 0.75 K
        print(f"N={n:3d} K={args.k_len}: rule {rule_name} {rule_us:.2f} us; floor {floor_us:.2f} us; best "
              + ", ".join(f"{r['name']} {r['us']:.2f} ({r['rel_err']:.1e})" for r in ok[:6]), flush=True)
        result["sweep"][n] = {"rule": rule_name, "rule_us": rule_us, "floor_us": round(floor_us, 2),
                              "rows": [{k: v for k, v in r.items() if k != "config"} for r in rows]}
        json.dump(result, open(os.path.join(args.out, "attention_large_rows.json"), "w"), indent=1)
    print(f"sweep done in {time.time() - t0:.0f} s", flush=True)
    if not args.no_tick:
        from torch_cfm.config import DiTConfig
        from torch_cfm.models import random_dit

        base = random_dit(DiTConfig(), seed=0)
        for c in streams:
            if best[c].name == result["sweep"][2 * c]["rule"]:
                print(f"{c} streams: the rule's config is the sweep's best; no tick A/B", flush=True)
                continue
            row = tick_ab(c, {"rule": None, "candidate": patched_rules(best[c], 2 * c * 8)}, base,
                          rounds=args.rounds, repeats=args.repeats)
            row.update(candidate_config=best[c].name, ratio=round(row["candidate"] / row["rule"], 4))
            print(f"tick {c} streams: rule {row['rule']} ms, {best[c].name} {row['candidate']} ms "
                  f"(x{row['ratio']}), rel diff {row['max_rel_diff']} {row['rounds_ms']}", flush=True)
            result["tick"].append(row)
            json.dump(result, open(os.path.join(args.out, "attention_large_rows.json"), "w"), indent=1)
    print(f"done in {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
