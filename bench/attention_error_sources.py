#!/usr/bin/env python3
"""Where the fp32 "ieee" attention error comes from on sharp softmaxes (a diagnostic, GPU).

Runs the cases of ``attention_accuracy.py`` (inputs ×1 and ×2, keys shuffled) and reports, per
case, docs/design.md §6 max-abs ratios ``err / (2 · err(fp32 reference) + 1e-6)`` (> 1 fails) of:

- ``--parts``: the kernel (its chosen config, with/without q·k slices, FMA dots, no split), and
  its pieces alone, each followed by exact float64 math: the raw q·k scores from a one-dot
  tf32x3 / FMA Triton kernel or cuBLAS FP32, and P·V (exact probabilities) from a tf32x3 dot with
  the running accumulator chained over key tiles or fresh per tile, or an FMA dot;
- ``--scores``: q·k accumulation schemes only (inputs ×2): one dot over D, D in 32- or 16-wide
  slices with fresh accumulators summed in FP32 (``AttentionConfig.qk_slab``), FMA dots, and a
  hand-split 3xTF32 with the cross terms in their own accumulator.

Finding (H200): the error is the q·k sum's; q·k in 32-wide head-dim slices closes most of it
(docs/performance.md, "fp32 ieee"). JSON per case goes to
``<out>/attention_error_sources_{parts,scores}.json``. ``--dry-run``: two cases on CPU under the
Triton interpreter (a smoke test: its dots are exact, so its ratios say nothing about a GPU).

    python3 bench/attention_error_sources.py --parts --cases 150
    python3 bench/attention_error_sources.py --scores --cases 300
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import torch  # noqa: E402


def build_kernels():
    """The two one-purpose Triton kernels (defined after TRITON_INTERPRET is settled)."""
    import triton
    import triton.language as tl

    @triton.jit
    def scores_kernel(q_ptr, k_ptr, s_ptr, fresh_zero, K, D: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
                      PREC: tl.constexpr, SLAB: tl.constexpr, MANUAL: tl.constexpr):
        # raw q·k of a (BQ, D) query block against key tile program_id(1); D in SLAB-wide slices
        nh = tl.program_id(0)
        oq = tl.arange(0, BQ)
        ok = tl.program_id(1) * BK + tl.arange(0, BK)
        s = tl.zeros([BQ, BK], tl.float32)
        cross = tl.zeros([BQ, BK], tl.float32)
        for j in tl.static_range(0, D // SLAB):
            od = j * SLAB + tl.arange(0, SLAB)
            q = tl.load(q_ptr + nh * BQ * D + oq[:, None] * D + od[None, :])
            kt = tl.load(k_ptr + nh * K * D + ok[None, :] * D + od[:, None], mask=ok[None, :] < K, other=0.0)
            zero = tl.zeros([BQ, BK], tl.float32) + fresh_zero  # a runtime zero is never folded away
            if MANUAL:  # big = round-to-nearest TF32, small = the rest; big·big apart from the cross terms
                qb = ((q.to(tl.int32, bitcast=True) + 0x1000) & -8192).to(tl.float32, bitcast=True)
                kb = ((kt.to(tl.int32, bitcast=True) + 0x1000) & -8192).to(tl.float32, bitcast=True)
                s = s + tl.dot(qb, kb, zero, input_precision="tf32")
                cross = cross + tl.dot(q - qb, kb, tl.dot(qb, kt - kb, zero, input_precision="tf32"),
                                       input_precision="tf32")
            else:
                s = s + tl.dot(q, kt, zero, input_precision=PREC)
        tl.store(s_ptr + nh * BQ * K + oq[:, None] * K + ok[None, :], s + cross, mask=ok[None, :] < K)

    @triton.jit
    def pv_kernel(p_ptr, v_ptr, o_ptr, fresh_zero, K, D: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
                  PREC: tl.constexpr, FRESH: tl.constexpr):
        # sum_k p[q, k] v[k, :] over key tiles, the accumulator chained through the MMA or fresh per tile
        nh = tl.program_id(0)
        oq = tl.arange(0, BQ)
        od = tl.arange(0, D)
        acc = tl.zeros([BQ, D], tl.float32)
        for k0 in range(0, K, BK):
            ok = k0 + tl.arange(0, BK)
            p = tl.load(p_ptr + nh * BQ * K + oq[:, None] * K + ok[None, :], mask=ok[None, :] < K, other=0.0)
            v = tl.load(v_ptr + nh * K * D + ok[:, None] * D + od[None, :], mask=ok[:, None] < K, other=0.0)
            if FRESH:
                acc = acc + tl.dot(p, v, tl.zeros_like(acc) + fresh_zero, input_precision=PREC)
            else:
                acc = tl.dot(p, v, acc, input_precision=PREC)
        tl.store(o_ptr + nh * BQ * D + oq[:, None] * D + od[None, :], acc)

    return triton, scores_kernel, pv_kernel


def dense(case, S):
    """q, k, v with pool rows resolved, and the (N, H, Q, K) valid-key mask."""
    q, k, v = case.q, case.k, case.v
    if case.kv_rows is not None:
        rows = case.kv_rows.long().clamp(0, k.shape[0] - 1)
        k, v = k[rows], v[rows]
    keep = S.valid_keys(case).to(q.device)[:, None]
    return q, k, v, keep.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def attention_from_scores(scaled: torch.Tensor, v64: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """float64 softmax(scaled)·v over the valid keys; 0 for queries without one."""
    any_valid = keep.any(-1, keepdim=True)
    s = torch.where(keep, scaled, float("-inf"))
    return (torch.softmax(torch.where(any_valid, s, 0.0), -1) * any_valid) @ v64


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", action="store_true", help="the kernel and its pieces")
    ap.add_argument("--scores", action="store_true", help="q·k accumulation schemes")
    ap.add_argument("--cases", type=int, default=150, help="random cases (each also shuffled)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--dry-run", action="store_true", help="CPU smoke test (TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    if not (args.parts or args.scores):
        ap.error("pick --parts and/or --scores")
    if args.dry_run:  # before anything imports triton
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import attention_accuracy as A
    import strategies as S
    from oracle import err_max, max_abs_bound, naive_attention64
    from torch_cfm.kernels._launch import sm_count
    from torch_cfm.kernels.cfm_attention import cfm_attention_triton, choose_config

    triton, scores_kernel, pv_kernel = build_kernels()
    device = "cpu" if args.dry_run else "cuda"

    def scores(q, k, prec, slab, manual, bq):
        n, h, q_len, d = q.shape
        k_len = k.shape[2]
        qp = torch.zeros(n * h, bq, d, device=q.device)
        qp[:, :q_len] = q.reshape(n * h, q_len, d)
        s = torch.empty(n * h, bq, k_len, device=q.device)
        scores_kernel[(n * h, triton.cdiv(k_len, 64))](qp, k.reshape(n * h, k_len, d).contiguous(), s, 0.0, k_len,
                                                       d, bq, 64, prec, min(slab, d), manual)
        return s[:, :q_len].reshape(n, h, q_len, k_len)

    def pv(p, v, prec, fresh, bq):
        n, h, q_len, k_len = p.shape
        d = v.shape[-1]
        pp = torch.zeros(n * h, bq, k_len, device=p.device)
        pp[:, :q_len] = p.reshape(n * h, q_len, k_len)
        o = torch.empty(n * h, bq, d, device=p.device)
        pv_kernel[(n * h,)](pp, v.reshape(n * h, k_len, d).contiguous(), o, 0.0, k_len, d, bq, 64, prec, fresh)
        return o[:, :q_len].reshape(n, h, q_len, d)

    score_schemes = [("x3", "tf32x3", 1 << 10, False), ("x3_slab32", "tf32x3", 32, False),
                     ("x3_slab16", "tf32x3", 16, False), ("fma", "ieee", 1 << 10, False),
                     ("fma_slab16", "ieee", 16, False), ("manual", "tf32", 1 << 10, True),
                     ("manual_slab32", "tf32", 32, True)]
    parts_rows, scores_rows = [], []
    n_cases = 0 if args.dry_run else args.cases
    for name, case in A.sharp_cases(n_cases, [1.0, 2.0], 0, device):
        if case.k.shape[2] == 0:
            continue
        ref64 = naive_attention64(case.q, case.k, case.v, case.key_lengths, case.mask, case.kv_rows).to(device)
        bound = max_abs_bound(err_max(S.attention_same_dtype(case), ref64))
        q, k, v, keep = dense(case, S)
        n, h, q_len, d = q.shape
        bq = max(16, triton.next_power_of_2(q_len))
        v64 = v.double()

        def ratio_of_scores(s):
            return err_max(attention_from_scores(s.double() / math.sqrt(d), v64, keep), ref64) / bound

        row = dict(case=name, desc=case.spec.describe(), scale=case.spec.scale)
        if args.parts:
            base = choose_config(torch.float32, d, n * h, q_len, case.k.shape[2], sm_count(case.q.device), "ieee")
            row["config"] = base.name
            configs = (("kernel", base), ("kernel_noslab", replace(base, qk_slab=0)),
                       ("kernel_split1", replace(base, splits=1)), ("kernel_fma", replace(base, ieee_dot="ieee")))
            for cname, cfg in configs:
                out = torch.empty_like(case.q)
                cfm_attention_triton(case.q, case.k, case.v, case.key_lengths, case.mask, case.kv_rows, "ieee",
                                     out, cfg)
                row[cname] = err_max(out, ref64) / bound
            row["scores_x3"] = ratio_of_scores(scores(q, k, "tf32x3", 1 << 10, False, bq))
            row["scores_fma"] = ratio_of_scores(scores(q, k, "ieee", 1 << 10, False, bq))
            row["scores_cublas"] = ratio_of_scores(torch.matmul(q, k.transpose(-1, -2)))
            s64 = torch.where(keep, q.double() @ k.double().transpose(-1, -2) / math.sqrt(d), float("-inf"))
            any_valid = keep.any(-1, keepdim=True)
            p = torch.where(keep, torch.exp(s64 - torch.where(any_valid, s64.amax(-1, keepdim=True), 0.0)), 0.0)
            l_sum = p.sum(-1, keepdim=True).clamp_min(1e-300)
            for pname, prec, fresh in (("pv_x3_chained", "tf32x3", False), ("pv_x3_fresh", "tf32x3", True),
                                       ("pv_fma", "ieee", False)):
                row[pname] = err_max(pv(p.float(), v, prec, fresh, bq).double() / l_sum * any_valid, ref64) / bound
            parts_rows.append(dict(row))
        if args.scores and case.spec.scale >= 2:
            srow = dict(case=name, desc=case.spec.describe())
            for sname, prec, slab, manual in score_schemes:
                srow[sname] = ratio_of_scores(scores(q, k, prec, slab, manual, bq))
            srow["cublas"] = ratio_of_scores(torch.matmul(q, k.transpose(-1, -2)))
            scores_rows.append(srow)

    os.makedirs(args.out, exist_ok=True)
    for label, rows in (("parts", parts_rows), ("scores", scores_rows)):
        if not rows:
            continue
        keys = [key for key in rows[0] if key not in ("case", "desc", "scale", "config")]
        print(f"{label}: {len(rows)} cases; ratios > 1 fail")
        print("  fails:", {key: sum(r[key] > 1 for r in rows) for key in keys})
        print("  max:  ", {key: round(max(r[key] for r in rows), 3) for key in keys})
        for r in sorted(rows, key=lambda r: -r[keys[0]])[:8]:
            print("  ", r["case"], r["desc"], " ".join(f"{key}={r[key]:.2f}" for key in keys))
        with open(os.path.join(args.out, f"attention_error_sources_{label}.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
