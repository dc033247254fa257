"""The CUDA attention kernel's instantiated configs, each timed at the bench shapes, next to a floor.

Every config that launches on the device is timed whole (µs per call inside a CUDA graph of 20
calls, bench/_harness.py; bench inputs: ragged lengths, seed 0), with the floor of one small kernel
per call in the same graph (``out.zero_()``, field ``zero_kernel``). The kernel has no switches
that skip its loads or its dots: the production launcher takes no bench-only parameter, so this
bench times configs only (the name is the run_device.sh stage's, ``cuda-ablation``). Rows (``op`` =
"cuda_attention_ablation", ``variant`` = the config, ``us_p50`` = the kernel) are upserted into
``<out>/cuda_attention_ablation.json`` (bench/_harness.py).

    python3 bench/cuda_attention_ablation.py --out "$OUT"
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import env_info, make_row, time_cuda_graph, upsert_rows  # noqa: E402
from attention import DTYPES, HEAD_DIM, HEADS, make_inputs  # noqa: E402

from torch_cfm.kernels import cfm_attention_cuda as cuda_kernel  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="2,50,450;8,50,450;32,50,450")
    ap.add_argument("--dtypes", default="fp16,fp32-tf32")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    env = env_info()
    rows = []
    for shape in args.shapes.split(";"):
        n, q_len, k_len = (int(x) for x in shape.split(","))
        for dname in args.dtypes.split(","):
            dtype, precision = DTYPES[dname]
            inp = make_inputs(n, q_len, k_len, dtype)
            q, k, v, lengths = inp["q"], inp["k"], inp["v"], inp["lengths"]
            out = torch.empty(n, q_len, HEADS, HEAD_DIM, device="cuda", dtype=dtype).transpose(1, 2)
            floor = time_cuda_graph(lambda: out.zero_(), repeats=args.repeats)["us_p50"]
            for cfg in cuda_kernel.runnable_configs(dtype, q.device):
                fn = (lambda cfg=cfg: cuda_kernel.cfm_attention_cuda(q, k, v, lengths, None, None, out, cfg))
                fn()
                full = time_cuda_graph(fn, repeats=args.repeats)["us_p50"]
                row = make_row(env, op="cuda_attention_ablation", provider="torch_cfm_cuda", variant=cfg.name,
                               shape={"N": n, "H": HEADS, "Q": q_len, "K": k_len, "D": HEAD_DIM},
                               dtype=str(dtype).replace("torch.", ""), precision=precision, timing="cuda_graph",
                               us_p50=full, zero_kernel=floor)
                rows.append(row)
                print(f"{shape:>10} {dname:<9} {cfg.name:<22} {full:6.2f} us  (zero_ kernel {floor:.2f})", flush=True)
            # saved per shape and dtype: a run cut short by its time limit keeps what it measured
            upsert_rows(os.path.join(args.out, "cuda_attention_ablation.json"), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
