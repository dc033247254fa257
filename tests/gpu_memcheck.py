"""Exercise the Triton and CUDA kernels at ragged shapes for ``compute-sanitizer --tool memcheck``.

Run on a CUDA machine (SM80+), from the repository root:

    compute-sanitizer --tool memcheck --error-exitcode 97 python3 tests/gpu_memcheck.py [--quick]

It disables PyTorch's caching allocator (``PYTORCH_NO_CUDA_MEMORY_CACHING=1``, set below before
torch is imported) so every tensor is its own allocation and an out-of-bounds access lands outside
it, where memcheck sees it. Every tensor is allocated at its exact size (no slack), views such as
the K/V halves of an interleaved cache end exactly at their buffer's end, and each result is also
compared with the float64 oracle (docs/design.md §6), so the script fails (exit 1) on wrong numbers too.

Covered: ``cfm_attention`` (fp16, bf16, fp32 TF32 and IEEE) with K = 0, 1, block multiples +-1
and >= 600, Q = 1 and odd Q, lengths 0/1/K/out of range, masks (dense and stride 0), kv_rows
pools with out-of-range rows, transposed q, interleaved caches, every tile/split variant on one
case, every config of the hand-written CUDA kernel on that case (where it is built); every variant of the fused DiT body's Triton driver on ragged chunks with and without caches, and its in-place arena form
(an arena of exactly L + T frames, NaN past each row's old keys); the server's keyed-arena frame
copies (``kernels/cache_trim.py``: the in-place refill, the row gather, the compact write-back, the
trimmed write-back) on exactly sized arenas against their ATen references, bitwise.
``--parts`` picks the checks.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import strategies as S  # noqa: E402
from oracle import assert_within_oracle, naive_attention64  # noqa: E402

MODES = [(torch.float16, "auto"), (torch.bfloat16, "auto"), (torch.float32, "tf32"), (torch.float32, "ieee")]


def attention_specs(quick: bool) -> list[S.AttnSpec]:
    specs = [
        S.AttnSpec(3, 2, 50, 450, 64, 1, lengths=(450, 0, 451), kv_interleaved=True, q_transposed=True),
        S.AttnSpec(2, 2, 1, 601, 128, 2, lengths=(601, 1), kv_interleaved=True),
        S.AttnSpec(2, 3, 17, 129, 32, 3, lengths=(129, 64), mask_mode="expand_n", dead_queries=(3,)),
        S.AttnSpec(4, 1, 33, 63, 16, 4, lengths=(-5, 2**31 - 1, 1, 62), kv_rows=(-1, 7, 0, 2), pool=3,
                   mask_mode="expand_q"),
        S.AttnSpec(1, 1, 7, 0, 64, 5),
        S.AttnSpec(2, 2, 65, 17, 64, 6, mask_mode="dense", q_transposed=True),
        S.AttnSpec(8, 8, 50, 450, 64, 7, lengths=tuple(450 - 50 * i for i in range(8)), kv_interleaved=True),
    ]
    if quick:
        return specs[:5]
    specs += [S.AttnSpec(1, 2, q, k, d, 10 + q + k, lengths=(max(k - 1, 0),), kv_interleaved=True)
              for q in (1, 16, 31) for k in (15, 16, 17, 64, 65, 127, 128, 640) for d in (16, 64, 128)]
    return specs


def check_attention(spec: S.AttnSpec, dtype: torch.dtype, precision: str) -> None:
    from torch_cfm import cfm_attention

    case = S.build_attention(spec, "cuda", dtype)
    out = cfm_attention(case.q, case.k, case.v, **case.kwargs(), precision=precision)
    torch.cuda.synchronize()
    ref64 = naive_attention64(case.q, case.k, case.v, case.key_lengths, case.mask, case.kv_rows)
    same = S.attention_same_dtype(case, tf32=precision == "tf32")
    assert_within_oracle(out.cpu(), same.cpu(), ref64, name=f"{spec.describe()} {dtype} {precision}",
                         tf32=precision == "tf32")


def launch_variants(quick: bool) -> list[tuple[int, int, int]]:
    """(block_q, block_k, splits) variants forced on one case."""
    if quick:
        return [(16, 16, 1), (32, 64, 3), (64, 32, 8)]
    return [(bq, bk, sp) for bq in (16, 32, 64) for bk in (16, 32, 64) for sp in (1, 3, 8)]


def check_attention_configs(dtype: torch.dtype, precision: str, quick: bool) -> None:
    from torch_cfm.kernels.cfm_attention import AttentionConfig, cfm_attention_triton
    from torch_cfm.ops.cfm_attention import empty_attention_out

    spec = S.AttnSpec(3, 2, 40, 300, 64, 11, lengths=(300, 129, 0), mask_mode="expand_n",
                      kv_interleaved=True, q_transposed=True)
    case = S.build_attention(spec, "cuda", dtype)
    ref64 = naive_attention64(case.q, case.k, case.v, case.key_lengths, case.mask)
    same = S.attention_same_dtype(case, tf32=precision == "tf32").cpu()
    prec = None if dtype != torch.float32 else precision
    for block_q, block_k, splits in launch_variants(quick):
        for merge in ("kernel", "last") if splits > 1 else ("kernel",):
            out = empty_attention_out(case.q)
            cfm_attention_triton(case.q, case.k, case.v, case.key_lengths, case.mask, None, prec, out,
                                 config=AttentionConfig(block_q, block_k, splits, merge=merge))
            torch.cuda.synchronize()
            assert_within_oracle(out.cpu(), same, ref64, name=f"q{block_q} k{block_k} s{splits} {merge}",
                                 tf32=precision == "tf32")


def check_cuda_attention_configs(dtype: torch.dtype, precision: str) -> int:
    """Every instantiated config of the hand-written CUDA kernel (csrc/cuda/) on the configs case;
    0 when the optional extension is not built or the mode is not covered (fp32 "ieee")."""
    from torch_cfm.kernels import cfm_attention_cuda as cuda_kernel
    from torch_cfm.ops.cfm_attention import empty_attention_out

    if precision == "ieee":
        return 0
    spec = S.AttnSpec(3, 2, 40, 300, 64, 12, lengths=(300, 129, 0), mask_mode="expand_n",
                      kv_interleaved=True, q_transposed=True)
    case = S.build_attention(spec, "cuda", dtype)
    prec = "tf32" if dtype == torch.float32 else None
    if cuda_kernel.not_supported_reasons(case.q, case.k, case.v, prec):
        return 0
    ref64 = naive_attention64(case.q, case.k, case.v, case.key_lengths, case.mask)
    same = S.attention_same_dtype(case, tf32=precision == "tf32").cpu()
    configs = cuda_kernel.runnable_configs(dtype, case.q.device)
    for config in configs:
        out = empty_attention_out(case.q)
        cuda_kernel.cfm_attention_cuda(case.q, case.k, case.v, case.key_lengths, case.mask, None, out, config)
        torch.cuda.synchronize()
        assert_within_oracle(out.cpu(), same, ref64, name=config.name, tf32=precision == "tf32")
    return len(configs)


def body_outputs(model, a: dict) -> tuple:
    cfg = model.config
    dtype = model.in_proj.weight.dtype
    n_rows, _, t_len = a["x"].shape
    l_len = 0 if a["att_cache"] is None else a["att_cache"].shape[3]
    nan = float("nan")
    return (torch.full((n_rows, cfg.out_channels, t_len), nan, dtype=dtype, device="cuda"),
            torch.full((cfg.depth, n_rows, 2 * cfg.hidden, 2), nan, dtype=dtype, device="cuda"),
            torch.full((cfg.depth, n_rows, cfg.heads, t_len + l_len, 2 * cfg.head_dim), nan, dtype=dtype,
                       device="cuda"))


def check_body(dtype: torch.dtype, precision: str, quick: bool) -> int:
    """Every body plan of the dtype family on ragged chunks; outputs NaN-filled first, then checked finite
    and (velocity) against the float64 oracle with a coarse bound."""
    import dit_oracle as O
    from torch_cfm.kernels.body_plans import NAMED, family
    from torch_cfm.models.dit import random_dit
    from torch_cfm.kernels.dit_body import dit_body_fused_into
    from torch_cfm.models.fused_forward import stage_input
    from torch_cfm.packing import modulation_table, packed_for

    specs = [S.ChunkSpec(0, 3, 7, 9, 1, valid=(7, 0, 3), cached=(9, 4, 0)),
             S.ChunkSpec(1, 2, 1, 0, 2, att="none", cnn=False),
             S.ChunkSpec(2, 4, 9, 12, 3, valid=(9, 1, 0, 5), cached=(0, 12, 3, 7), att="arena", scalar_t=True)]
    if quick:
        specs = specs[:1]
    runs = 0
    for spec in specs:
        model = random_dit(S.tiny_configs()[spec.cfg], seed=spec.cfg + 1).to("cuda", dtype).eval()
        a = S.build_chunk(spec, "cuda", dtype)
        prec = precision if dtype == torch.float32 else None
        sd = O.to_dtype(model.state_dict())
        n = spec.n
        x = a["x"].double().cpu()
        vels, _, _ = O.batch_chunk(
            sd, x, a["mu"].double().cpu(), a["t"].double().cpu().reshape(-1).expand(n),
            a["spks"].double().cpu() if a["spks"] is not None else torch.zeros(n, 80, dtype=torch.float64),
            a["cond"].double().cpu() if a["cond"] is not None else torch.zeros_like(x),
            None if a["cnn_cache"] is None else a["cnn_cache"].double().cpu(),
            None if a["att_cache"] is None else a["att_cache"].double().cpu(),
            None if a["valid_lengths"] is None else a["valid_lengths"].cpu(),
            None if a["cache_lengths"] is None else a["cache_lengths"].cpu())
        with torch.no_grad():
            packed = packed_for(model, dtype, "cuda")
            table = modulation_table(packed, a["t"].reshape(-1))
            x_in = stage_input(a["x"], a["mu"], a["spks"], a["cond"], dtype)
        for variant in NAMED[family(dtype, prec)]:
            out = body_outputs(model, a)
            with torch.no_grad():
                dit_body_fused_into(x_in, packed.body, table, a["cnn_cache"], a["att_cache"], a["valid_lengths"],
                                    a["cache_lengths"], prec, out, variant)
            torch.cuda.synchronize()
            runs += 1
            for name, o in zip(("velocity", "cnn_cache", "att_cache"), out):
                if not torch.isfinite(o).all():
                    raise AssertionError(f"body {variant} {spec.describe()} {dtype}: {name} not finite")
            for i, ref in enumerate(vels):
                got = out[0][i, :, :ref.shape[1]].double().cpu()
                rel = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item() if ref.numel() else 0.0
                if rel > 5e-2:  # coarse sanity bound; tests/test_properties_model.py holds the oracle
                    raise AssertionError(f"body {variant} {spec.describe()} {dtype} row {i}: rel err {rel:.2e}")
        runs += check_body_arena(model, packed, table, x_in, a, prec, vels, spec, dtype)
    return runs


def check_body_arena(model, packed, table, x_in, a: dict, prec, vels, spec, dtype: torch.dtype) -> int:
    """The in-place arena form (dit_body_arena_into): an arena of exactly L + T frames per cache,
    the old keys reversed at [0, L_n) and NaN after them; the appended keys and the velocity must
    come out finite, the velocity near the float64 oracle."""
    from torch_cfm.models.cache import reverse_keys
    from torch_cfm.kernels.dit_body import dit_body_arena_into

    n, t_len = spec.n, spec.t_len
    cfg = model.config
    l_len = 0 if a["att_cache"] is None else a["att_cache"].shape[3]
    arena, valid, cached = S.poisoned_arena(a["att_cache"], a["valid_lengths"], a["cache_lengths"],
                                            (cfg.depth, n, cfg.heads, l_len + t_len, 2 * cfg.head_dim), t_len,
                                            dtype, "cuda")
    vel, cnn = body_outputs(model, a)[:2]
    with torch.no_grad():
        dit_body_arena_into(x_in, packed.body, table, a["cnn_cache"], arena, valid, cached, prec, (vel, cnn))
    torch.cuda.synchronize()
    new = reverse_keys(arena, valid + cached)  # frames past T_n + L_n (still NaN) come back as zeros
    for name, o in (("velocity", vel), ("cnn_cache", cnn), ("arena", new)):
        if not torch.isfinite(o).all():
            raise AssertionError(f"body arena {spec.describe()} {dtype}: {name} not finite")
    for i, ref in enumerate(vels):
        got = vel[i, :, :ref.shape[1]].double().cpu()
        rel = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item() if ref.numel() else 0.0
        if rel > 5e-2:
            raise AssertionError(f"body arena {spec.describe()} {dtype} row {i}: rel err {rel:.2e}")
    return 1


def check_frames(dtype: torch.dtype) -> int:
    """The keyed arena's copies on tensors of exactly the frames they need, bitwise vs the references.
    Returns the number of copies checked."""
    from torch_cfm.kernels.cache_trim import move_frames_into, trim_copy_into
    from torch_cfm.models.cache import arena_chunk_plan, trim_gather_index
    from torch_cfm.reference.cache_trim import move_frames_reference, trim_copy_reference

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(5)
    depth, heads, two_d, keep, key_frames, t_len, slots = 3, 2, 64, 7, 40, 13, 5
    lengths = torch.tensor([40, 0, 1, 33, 27])
    valid = torch.tensor([13, 5, 0, 13, 1])
    prompt = torch.tensor([33, 0, 1, 10, 20])
    keys = torch.arange(key_frames).repeat(slots, 1)
    for r, ln in enumerate(lengths.tolist()):
        keys[r, :ln] = torch.randperm(ln, generator=g)
    plan = arena_chunk_plan(keys.to(torch.int32).to(dev), lengths.to(dev), valid.to(dev), prompt.to(dev),
                            key_frames, t_len, keep)
    width = key_frames + t_len
    arena = torch.randn(depth, 2 * slots, heads, width, two_d, generator=g).to(dev, dtype)
    solved = torch.tensor([4, 0, 2], device=dev)
    rows = torch.cat([solved, solved + slots])
    sub = arena_chunk_plan(keys[[4, 0, 2]].to(torch.int32).to(dev), lengths[[4, 0, 2]].to(dev),
                           valid[[4, 0, 2]].to(dev), prompt[[4, 0, 2]].to(dev), key_frames, t_len, keep)
    scratch = torch.randn(depth, 2 * len(solved), heads, width, two_d, generator=g).to(dev, dtype)
    index, _ = trim_gather_index((lengths + valid).to(dev), prompt.to(dev), key_frames, width, keep)
    cases = [
        ("refill in place", move_frames_into, move_frames_reference, arena, None, plan.moves, {}),
        ("gather rows", trim_copy_into, trim_copy_reference, scratch, arena, sub.old_frames, {"src_rows": rows}),
        ("write back rows", move_frames_into, move_frames_reference, arena, scratch, sub.write_back,
         {"dst_rows": rows}),
        ("trimmed write-back", trim_copy_into, trim_copy_reference, arena[:, :, :, :key_frames].contiguous(), arena,
         index, {}),
    ]
    for name, kernel, reference, dst, src, index, kw in cases:
        expected = reference(dst.clone(), dst.clone() if src is None else src, index, **kw)
        got = dst.clone()
        kernel(got, got if src is None else src, index, **kw)
        torch.cuda.synchronize()
        assert torch.equal(got, expected), f"frames {name} {dtype}: kernel != reference"
    return len(cases)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes (for a slow sanitizer run)")
    parser.add_argument("--parts", default="attention,attention_configs,cuda_attention_configs,body,frames",
                        help="which checks run (comma list)")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if not torch.cuda.is_available():
        print("gpu_memcheck: needs a CUDA device")
        return 2
    start = time.time()
    counts = {"attention": 0, "attention_configs": 0, "cuda_attention_configs": 0, "body": 0, "frames": 0}
    failures = []
    for dtype, precision in MODES:
        for spec in attention_specs(args.quick) if "attention" in parts else []:
            try:
                check_attention(spec, dtype, precision)
                counts["attention"] += 1
            except AssertionError as exc:
                failures.append(str(exc))
        try:
            if "attention_configs" in parts:
                check_attention_configs(dtype, precision, args.quick)
                counts["attention_configs"] += 1
        except AssertionError as exc:
            failures.append(str(exc))
        try:
            if "cuda_attention_configs" in parts:
                counts["cuda_attention_configs"] += check_cuda_attention_configs(dtype, precision)
        except AssertionError as exc:
            failures.append(str(exc))
        try:
            if "frames" in parts and precision != "ieee":  # a copy: one run per storage dtype
                counts["frames"] += check_frames(dtype)
        except AssertionError as exc:
            failures.append(str(exc))
        try:
            if "body" in parts:
                counts["body"] += check_body(dtype, precision, args.quick)
        except ImportError as exc:
            print(f"gpu_memcheck: fused body not available ({exc})")
        except AssertionError as exc:
            failures.append(str(exc))
    print(f"gpu_memcheck: {counts} checked in {time.time() - start:.1f} s, {len(failures)} numeric failures")
    for line in failures:
        print("  FAIL", line.splitlines()[0])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
