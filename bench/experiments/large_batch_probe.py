"""Probe for the large-batch body (issue 31): where a 32-128-row step's time goes, and what FP8 buys.

Not a shipped benchmark: it answers the questions that choose the plan; docs/performance.md §4 cites
its printed numbers.

1. ``gemm``: the body's GEMMs at M = rows x 50 (conv: rows x 52), per role, on cuBLAS fp16 (as the
   v1 plan calls them) and as FP8 e4m3 ``torch._scaled_mm`` with per-row activation and per-column
   weight scales (fp16 out, bias in the epilogue), plus the quantisation of the activation. µs per
   call inside a CUDA graph of 20 calls, median of 15 replays; TFLOP/s.
2. ``tiles``: the experimental Triton GEMM (``triton_gemm.py`` here) per candidate tile against cuBLAS
   per role shape.
3. ``attn``: ``cfm_attention`` on the server's arena layout (K and V interleaved per frame, one cache
   per Euler step and block) per kernel config, and on K and V held in separate tensors.
4. ``tick``: one CFMServer(graphs=True) steady tick at S streams under torch.profiler: kernel time
   per kernel family, the sum against the tick's wall time (the rest is idle GPU between kernels).

    python3 bench/experiments/large_batch_probe.py --parts gemm,tiles,attn,tick --out "$OUT"
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(1, os.path.dirname(HERE))
sys.path.insert(2, HERE)

import torch  # noqa: E402

from _harness import time_cuda_graph  # noqa: E402
from cutlass_gemm import cublas_call  # noqa: E402

E4M3_MAX = 448.0


def quant_rows(a: torch.Tensor):
    """(a as e4m3, float32 (M, 1) scales): per-row absmax scaling."""
    amax = a.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-12)
    scale = amax / E4M3_MAX
    return (a.float() / scale).to(torch.float8_e4m3fn), scale


def role_operands(rows: int):
    """(role, M, K, N, gelu, a, w, bias or None, out) of every block GEMM of a ``rows``-row body
    (M = rows x 50 tokens, the convs rows x 52 history frames), fresh fp16 operands on the GPU."""
    c, mlp = 512, 2048
    m, mc = rows * 50, rows * 52
    roles = (("qkv", m, c, 3 * c, True, False), ("proj", m, c, c, True, False), ("conv", mc, c, 3 * c, False, False),
             ("fc1", m, c, mlp, True, True), ("fc2", m, mlp, c, True, False))
    for role, mm, k, n, has_bias, gelu in roles:
        a = torch.randn(mm, k, device="cuda", dtype=torch.float16)
        w = torch.randn(n, k, device="cuda", dtype=torch.float16) / k ** 0.5
        b = torch.randn(n, device="cuda", dtype=torch.float16) if has_bias else None
        yield role, mm, k, n, gelu, a, w, b, torch.empty(mm, n, device="cuda", dtype=torch.float16)


def gemm_part(rows_list, out_rows):
    for rows in rows_list:
        for role, mm, k, n, gelu, a, w, b, out in role_operands(rows):
            flop = 2.0 * mm * k * n
            f16 = cublas_call(a, w, b, out, gelu)
            res = {"rows": rows, "role": role, "M": mm, "K": k, "N": n}
            t = time_cuda_graph(f16, calls=20, repeats=15)["us_p50"]
            res["fp16_us"] = t
            res["fp16_tflops"] = round(flop / t / 1e6, 1)
            a8, sa = quant_rows(a)
            w8, sw = quant_rows(w)
            w8t, swt = w8.t(), sw.t().contiguous()
            for fast in (False, True):
                key = "fp8_fast" if fast else "fp8"
                try:
                    f8 = lambda: torch._scaled_mm(a8, w8t, scale_a=sa, scale_b=swt,  # noqa: E731
                                                  bias=b, out_dtype=torch.float16,
                                                  use_fast_accum=fast)
                    ref = a.float() @ w.float().t() + (b.float() if b is not None else 0)
                    got = f8().float()
                    res[key + "_relerr"] = float((got - ref).norm() / ref.norm())
                    t8 = time_cuda_graph(f8, calls=20, repeats=15)["us_p50"]
                    res[key + "_us"] = t8
                    res[key + "_tflops"] = round(flop / t8 / 1e6, 1)
                except Exception as exc:  # noqa: BLE001
                    res[key + "_error"] = f"{type(exc).__name__}: {exc}"[:200]
            tq = time_cuda_graph(lambda: quant_rows(a), calls=20, repeats=15)["us_p50"]
            res["quant_torch_us"] = tq
            print(json.dumps(res), flush=True)
            out_rows.append(res)


def tiles_part(rows_list, out_rows):
    """The Triton GEMM's candidate tiles against cuBLAS at each role shape; fills dense_gemm.TILES with
    the best tile per (M bucket, K, N) and returns the table's text."""
    import triton_gemm as dense_gemm

    buckets = {16: (1, 1200), 32: (1201, 2400), 64: (2401, 4800), 128: (4801, 1 << 40)}
    for rows in rows_list:
        for role, mm, k, n, gelu, a, w, b, out in role_operands(rows):
            ref = a.float() @ w.float().t() + (b.float() if b is not None else 0)
            if gelu:
                ref = torch.nn.functional.gelu(ref, approximate="tanh")
            res = {"part": "tiles", "rows": rows, "role": role, "M": mm, "K": k, "N": n,
                   "cublas_us": time_cuda_graph(cublas_call(a, w, b, out, gelu), calls=20, repeats=15)["us_p50"],
                   "tiles": {}}
            for tile in dense_gemm.CANDIDATES:
                try:
                    fn = lambda: dense_gemm.gemm_into(a, w, b, out, gelu=gelu, tile=tile)  # noqa: E731
                    fn()
                    err = float((out.float() - ref).norm() / ref.norm())
                    res["tiles"][tile.name] = [time_cuda_graph(fn, calls=20, repeats=15)["us_p50"], round(err, 6)]
                except Exception as exc:  # noqa: BLE001
                    res["tiles"][tile.name] = [None, f"{type(exc).__name__}: {exc}"[:120]]
            timed = [(v[0], name) for name, v in res["tiles"].items() if v[0] is not None]
            if not timed:
                print(json.dumps(res), flush=True)
                continue
            best_us, best = min(timed)
            res["best"], res["best_us"] = best, best_us
            tile = next(t for t in dense_gemm.CANDIDATES if t.name == best)
            lo, hi = buckets[rows]
            dense_gemm.TILES[(lo, hi, k, n)] = tile
            print(json.dumps({kk: v for kk, v in res.items() if kk != "tiles"}), flush=True)
            out_rows.append(res)
    text = "\n".join(f"    ({lo}, {hi}, {k}, {n}): GemmTile({t.bm}, {t.bn}, {t.bk}, {t.warps}, {t.stages}),"
                      for (lo, hi, k, n), t in dense_gemm.TILES.items())
    print("TILES = {\n" + text + "\n}", flush=True)
    return text


def attn_part(rows_list, out_rows):
    """cfm_attention on the server's arena layout (one cache per Euler step and block: 160 slices of
    (rows, H, 450, 2D), keys at [..., :D], values at [..., D:], 450 keys per row), each call of a
    20-call graph on a different slice (as a tick runs them: nothing left in L2) against 20 calls on one
    slice (the attention bench's condition), per kernel config."""
    import sys as _sys

    _sys.path.insert(0, os.path.dirname(HERE))
    from attention import sweep_configs

    from torch_cfm.kernels import cfm_attention_cuda as cuda_kernel
    from torch_cfm.kernels.cfm_attention import cfm_attention_triton, choose_config
    from torch_cfm.kernels._launch import sm_count

    dev = torch.device("cuda")
    for rows in rows_list:
        slices, heads, frames, d = 160, 8, 450, 64
        arena = torch.randn(slices, rows, heads, frames, 2 * d, device=dev, dtype=torch.float16)
        q = torch.randn(rows, 50, heads, d, device=dev, dtype=torch.float16).permute(0, 2, 1, 3)
        lengths = torch.full((rows,), frames, device=dev, dtype=torch.int32)
        out = torch.empty(rows, 50, heads, d, device=dev, dtype=torch.float16).transpose(1, 2)
        chosen = choose_config(torch.float16, d, rows * heads, 50, frames, sm_count(dev), None)
        configs = list(dict.fromkeys(sweep_configs(torch.float16, None) + [chosen]))
        configs += list(cuda_kernel.runnable_configs(torch.float16, dev))
        res = {"part": "attn", "rows": rows, "chosen": chosen.name, "configs": {}}
        for cfg in configs:
            def call(i, cfg=cfg):
                kv = arena[i]
                if isinstance(cfg, cuda_kernel.CudaAttentionConfig):
                    return cuda_kernel.cfm_attention_cuda(q, kv[..., :d], kv[..., d:], lengths, None, None, out, cfg)
                return cfm_attention_triton(q, kv[..., :d], kv[..., d:], lengths, None, None, None, out, config=cfg)

            counter = [0]

            def walk():
                counter[0] = (counter[0] + 7) % slices
                return call(counter[0])

            try:
                same = time_cuda_graph(lambda: call(3), calls=20, repeats=15)["us_p50"]
                spread = time_cuda_graph(walk, calls=20, repeats=15)["us_p50"]
                res["configs"][cfg.name] = [same, spread]
            except Exception as exc:  # noqa: BLE001
                res["configs"][cfg.name] = [None, f"{type(exc).__name__}: {exc}"[:120]]
        # K and V in separate (slices, rows, H, frames, D) tensors, the chosen config
        k_sep = arena[..., :d].contiguous()
        v_sep = arena[..., d:].contiguous()
        counter = [0]

        def walk_split():
            counter[0] = (counter[0] + 7) % slices
            return cfm_attention_triton(q, k_sep[counter[0]], v_sep[counter[0]], lengths, None, None, None, out,
                                        config=chosen)

        res["split_kv_chosen_spread_us"] = time_cuda_graph(walk_split, calls=20, repeats=15)["us_p50"]
        gbytes = rows * heads * frames * 2 * d * 2 / 1e9
        res["gb_per_call"] = round(gbytes, 4)
        best = sorted((v[1], k) for k, v in res["configs"].items() if v[0] is not None)[:4]
        print(json.dumps({"part": "attn", "rows": rows, "chosen": chosen.name, "chosen_us": res["configs"].get(chosen.name),
                          "best_spread": best, "split_kv_us": res["split_kv_chosen_spread_us"], "tb_s_chosen_spread": round(gbytes / res["configs"][chosen.name][1] * 1e6 / 1e3, 2)
                          if res["configs"].get(chosen.name, [None])[0] else None}), flush=True)
        out_rows.append(res)


def family(name: str) -> str:
    low = name.lower()
    for key, fam in (("rownorm", "rownorm"), ("qk_cache", "qk_cache"), ("cfm_attention", "attention"),
                     ("attention", "attention"), ("gemm", "gemm"), ("sm90", "gemm"), ("cutlass", "gemm"),
                     ("cublas", "gemm"), ("nvjet", "gemm"), ("xmma", "gemm"), ("trim", "trim"),
                     ("euler", "cfg_euler"), ("copy", "copy"), ("elementwise", "elementwise"),
                     ("index", "index"), ("reduce", "reduce")):
        if key in low:
            return fam
    return name[:60]


def tick_part(streams_list, out_rows):
    from torch.profiler import ProfilerActivity, profile

    from torch_cfm.models import CFMServer, DiT, DiTConfig, StreamingCFM

    dev = torch.device("cuda")
    for streams in streams_list:
        prompt, t_len = 300, 50
        model = DiT(DiTConfig()).random_init_(0).to(dev, torch.float16).eval()
        cfm = StreamingCFM(model, n_timesteps=10, seed=0)
        server = CFMServer(cfm, max_requests=streams, max_prompt_frames=prompt, max_chunk_frames=t_len,
                           chunk_buckets=[t_len], cache_buckets=[prompt + 100], slot_buckets=[1, streams],
                           device=dev, dtype=torch.float16, graphs=True)
        from torch_cfm.kernels import cache_trim
        seen = []
        plain_move = cache_trim.move_frames_into

        def recording_move(dst, src, moves, *a, **k):
            seen.append((tuple(dst.shape), tuple(src.shape), moves, a, k))
            return plain_move(dst, src, moves, *a, **k)

        cache_trim.move_frames_into = recording_move
        server.warmup(progress=False)
        g = torch.Generator(device=dev).manual_seed(1)

        def rand(*size):
            return torch.randn(*size, generator=g, device=dev).half()

        for rid in range(streams):
            server.open_request(rid, rand(80), prompt_mu=rand(80, prompt), prompt_mel=rand(80, prompt))
        for _ in range(5):
            server.solve_chunk({rid: rand(80, t_len) for rid in range(streams)})
        torch.cuda.synchronize()
        ticks = 3
        chunks = [{rid: rand(80, t_len) for rid in range(streams)} for _ in range(ticks)]
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for ch in chunks:
                server.solve_chunk(ch)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e6 / ticks
        fams = collections.defaultdict(lambda: [0.0, 0])
        first, last = None, None
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                d = ev.device_time if hasattr(ev, "device_time") else ev.cuda_time
                f = fams[family(ev.name)]
                f[0] += d / ticks
                f[1] += 1 / ticks
                s = ev.time_range.start
                e = ev.time_range.end
                first = s if first is None else min(first, s)
                last = e if last is None else max(last, e)
        cache_trim.move_frames_into = plain_move
        for dshape, sshape, moves, a, k in seen[-3:]:
            print("move_frames_into", dshape, sshape, tuple(moves.src.shape), "count max/mean",
                  int(moves.count.max()), float(moves.count.float().mean()), "rows args", [None if x is None else tuple(x.shape) for x in a], flush=True)
        total = sum(v[0] for v in fams.values())
        res = {"streams": streams, "wall_us_per_tick": round(wall, 1), "kernel_us_per_tick": round(total, 1),
               "span_us_per_tick": round((last - first) / ticks, 1) if first is not None else None,
               "families": {k: [round(v[0], 1), round(v[1], 1)] for k, v in
                            sorted(fams.items(), key=lambda kv: -kv[1][0])[:25]}}
        print(json.dumps(res), flush=True)
        out_rows.append(res)
        del server, cfm, model
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="gemm,tick")
    ap.add_argument("--rows", default="32,64,128")
    ap.add_argument("--streams", default="16,64")
    ap.add_argument("--tile-rows", default="16,32,64,128")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    rows = []
    parts = args.parts.split(",")
    if "gemm" in parts:
        gemm_part([int(r) for r in args.rows.split(",")], rows)
    if "tiles" in parts:
        tiles_part([int(r) for r in args.tile_rows.split(",")], rows)
    if "attn" in parts:
        attn_part([int(r) for r in args.rows.split(",")], rows)
    if "tick" in parts:
        tick_part([int(s) for s in args.streams.split(",")], rows)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "large_batch_probe.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
