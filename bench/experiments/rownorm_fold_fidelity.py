"""Issue 41's row-norm fold, its accuracy before any kernel: is ``LN(h)`` folded into the next GEMM
as exact as the row-norm boundary it would replace? CPU only (fp16 operands emulated: rounded to
fp16, multiplied in float32 as tensor cores accumulate), each against a float64 reference.

A DiT boundary feeds a GEMM (qkv, conv, fc1) with ``a = LN(h) * (1 + s) + sh`` (h the float32
residual stream, LN without affine, s / sh the step's modulation, the same for every row):

* ``shipped``: the row-norm kernel writes ``a`` in fp16, the GEMM reads it (today's body);
* ``fold_x``: the GEMM reads ``x = fp16(h * (1 + s))`` (the producing GEMM's epilogue would write
  it beside h) and its epilogue computes ``rstd * (x @ W - mu * u) + v`` with per-row mu, rstd
  (the producer's row statistics) and per-column ``u = (1 + s) @ W``, ``v = sh @ W + b``;
* ``fold_w``: the GEMM reads ``fp16(h)`` against ``W' = fp16(diag(1 + s) W)`` (one per step and
  block, the modulation being per step), the same epilogue;
* ``fold_x_centred``: as ``fold_x`` with ``x = fp16((h - m) * (1 + s))``, m the row's mean at the
  previous boundary (known to the producing GEMM; the block's update moves it by a drift, here
  0.25 sigma), the epilogue subtracting ``mu - m`` instead of mu.

The plain folds round the un-centred h: their error grows with ``|mu| / sigma`` of a row, which
random weights keep near 0 and trained DiTs may not. The scenarios sweep it: rows
``sigma * z + mu_row`` with mu_row = k * sigma, and a few outlier channels of offset 20 sigma.

    python3 bench/experiments/rownorm_fold_fidelity.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [os.path.join(ROOT, "tests"), ROOT]

import torch  # noqa: E402

from oracle import err_rel_fro  # noqa: E402

EPS = 1e-6


def _fp16_gemm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp16 operands, float32 products and sums (a: (M, K), w: (N, K))."""
    return a.half().float() @ w.half().float().T


def boundary(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor, s: torch.Tensor, sh: torch.Tensor) -> dict:
    """The three forms of ``(LN(h) * (1 + s) + sh) @ w.T + b`` (output rounded to fp16), each's
    relative Frobenius error against float64."""
    h64, w64, b64, s64, sh64 = (t.double() for t in (h, w, b, s, sh))
    mu64, var64 = h64.mean(-1, keepdim=True), h64.var(-1, unbiased=False, keepdim=True)
    exact = ((h64 - mu64) / torch.sqrt(var64 + EPS) * (1 + s64) + sh64) @ w64.T + b64

    mu, var = h.mean(-1, keepdim=True), h.var(-1, unbiased=False, keepdim=True)  # float32 statistics
    rstd = torch.rsqrt(var + EPS)
    a = (h - mu) * rstd * (1 + s) + sh
    shipped = (_fp16_gemm(a, w) + b).half()
    u = (1 + s) @ w.half().float().T  # (N,): the epilogue's column vector, float32
    v = sh @ w.half().float().T + b
    fold_x = (rstd * (_fp16_gemm(h * (1 + s), w) - mu * u) + v).half()
    w_mod = (w * (1 + s)[None, :])
    u_w = w_mod.half().float().sum(-1)
    fold_w = (rstd * (_fp16_gemm(h, w_mod) - mu * u_w) + v).half()
    prev = mu + 0.25 * torch.sqrt(var) * torch.randn(mu.shape, generator=torch.Generator().manual_seed(1))
    centred = (rstd * (_fp16_gemm((h - prev) * (1 + s), w) - (mu - prev) * u) + v).half()
    return {name: err_rel_fro(out, exact) for name, out in
            (("shipped", shipped), ("fold_x", fold_x), ("fold_w", fold_w), ("fold_x_centred", centred))}


def scenarios(m: int, c: int, gen: torch.Generator):
    """(name, h (m, c) float32): residual rows of growing |mean| / std, and outlier channels."""
    z = torch.randn(m, c, generator=gen)
    sigma = 2.0
    for k in (0.0, 1.0, 4.0, 16.0):
        yield f"mean_{k:g}_sigma", sigma * z + k * sigma * torch.sign(torch.randn(m, 1, generator=gen))
    outliers = torch.zeros(c)
    outliers[torch.randperm(c, generator=gen)[:4]] = 20 * sigma
    yield "4_outlier_channels_20_sigma", sigma * z + outliers


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    c = 512
    rows = []
    for role, n in (("qkv", 1536), ("fc1", 2048)):
        w = torch.randn(n, c, generator=gen) / c ** 0.5
        b = 0.05 * torch.randn(n, generator=gen)
        s, sh = 0.5 * torch.randn(c, generator=gen), 0.5 * torch.randn(c, generator=gen)
        for name, h in scenarios(args.rows, c, gen):
            errs = boundary(h, w, b, s, sh)
            row = dict(op="rownorm_fold_fidelity", role=role, scenario=name, rows=args.rows, **errs,
                       fold_x_over_shipped=errs["fold_x"] / errs["shipped"],
                       fold_w_over_shipped=errs["fold_w"] / errs["shipped"],
                       fold_x_centred_over_shipped=errs["fold_x_centred"] / errs["shipped"])
            rows.append(row)
            print(f"{role:4s} {name:28s} shipped {errs['shipped']:.2e}  fold_x {errs['fold_x']:.2e} "
                  f"({row['fold_x_over_shipped']:.2f}x)  fold_w {errs['fold_w']:.2e} "
                  f"({row['fold_w_over_shipped']:.2f}x)  centred {row['fold_x_centred_over_shipped']:.2f}x", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
