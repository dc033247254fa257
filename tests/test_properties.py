"""Hypothesis properties of ``cfm_attention`` (issue 6), on CPU always and on CUDA (gpu-marked).

Every property draws a spec from ``tests/strategies.py`` (shapes incl. N=1, Q=1, K=0..640,
block multiples +-1; interleaved K/V halves, transposed q, expanded masks; lengths 0/1/K/random;
kv_rows pools) and checks one statement of docs/design.md §4/§5/§6 against the fp64 loop oracle of
``tests/oracle.py`` or against the op itself on a related input:

* oracle bound (docs/design.md §6) for fp32/fp16/bf16 (CPU kernel upcasts; CUDA: TF32 and IEEE fp32);
* permuting cache frames, with their validity, leaves outputs unchanged (no positions);
* inserting padded rows (own caches, own lengths, garbage values) leaves other rows bitwise equal;
* a query with no valid key returns exactly 0 (on a NaN-poisoned allocator);
* NaN/Inf in one query row or one key/value frame reaches only the outputs that read it;
* NaN/Inf in cache frames beyond key_lengths (padding) reaches no output;
* autocast output dtype is the ambient autocast dtype;
* the kernel ``explain`` reports is the one that runs (launchers spied);
* TF32 off => IEEE tolerance, TF32 on => TF32 tolerance, following env > explicit > torch flag.

Each property has a ``_cpu`` test (the op's C++ CPU kernel) and a gpu-marked ``_cuda`` test
(Triton on SM80+) running ``strategies.gpu_settings()`` examples (each new shape costs a Triton
compile). ``test_triton_kernel_properties_in_interpreter`` (slow) runs row independence,
non-finite containment and padding frames on the Triton kernel itself under
``TRITON_INTERPRET=1`` in a child process, so CI covers the kernel without a GPU.
"""

from __future__ import annotations

import contextlib
import importlib
import re
from dataclasses import replace
from typing import Iterator

import pytest
import torch

from interpreter_child import interpreter_env
from hypothesis import event, given
from hypothesis import strategies as st

import strategies as S
from oracle import IEEE_REL_BOUND, TF32_REL_BOUND, assert_within_oracle, err_rel_fro, naive_attention64
from torch_cfm import cfm_attention, policy
from torch_cfm.diagnostics import machine_report

GPU_SETTINGS = S.gpu_settings()


def run(case: S.AttnCase, precision: str = "auto", poison: bool = True) -> torch.Tensor:
    """The op under test, on a NaN-poisoned allocator so unwritten outputs show up."""
    if poison:
        S.poison_allocator(case.q.device, S.out_nbytes(case))
    return cfm_attention(case.q, case.k, case.v, **case.kwargs(), precision=precision)


def oracle64(case: S.AttnCase) -> torch.Tensor:
    return naive_attention64(case.q, case.k, case.v, case.key_lengths, case.mask, case.kv_rows)


def check_layout(out: torch.Tensor, case: S.AttnCase) -> None:
    n, h, q_len, d = case.q.shape
    assert out.shape == (n, h, q_len, d) and out.dtype == case.q.dtype
    assert out.device == case.q.device
    assert out.transpose(1, 2).is_contiguous(), f"out strides {out.stride()} are not (N, Q, H, D)"


def fp32_precisions(device: str, dtype: torch.dtype) -> st.SearchStrategy[str]:
    if dtype == torch.float32 and device == "cuda":
        return st.sampled_from(["tf32", "ieee"])
    return st.just("auto")


# --------------------------------------------------------------------------------------------
# docs/design.md §6 oracle
# --------------------------------------------------------------------------------------------

def check_oracle_bound(device, spec, dtype, data):
    precision = data.draw(fp32_precisions(device, dtype), label="precision")
    S.tried(f"oracle_bound[{device}]")
    case = S.build_attention(spec, device, dtype)
    out = run(case, precision)
    check_layout(out, case)
    ref64 = oracle64(case)
    tf32 = precision == "tf32" or (precision == "auto" and dtype == torch.float32
                                   and device == "cuda" and policy.tf32_allowed())
    same = S.attention_same_dtype(case, tf32=tf32)
    assert_within_oracle(out.cpu(), same.cpu(), ref64, name=spec.describe())
    if dtype == torch.float32:
        bound = TF32_REL_BOUND if tf32 else IEEE_REL_BOUND
        assert err_rel_fro(out.cpu(), ref64) <= bound, spec.describe()


@given(spec=S.attention_specs(), dtype=S.dtypes, data=st.data())
def test_oracle_bound_cpu(spec, dtype, data):
    check_oracle_bound("cpu", spec, dtype, data)


@pytest.mark.gpu
@GPU_SETTINGS
@given(spec=S.attention_specs(), dtype=S.dtypes, data=st.data())
def test_oracle_bound_cuda(spec, dtype, data):
    check_oracle_bound("cuda", spec, dtype, data)


# --------------------------------------------------------------------------------------------
# permuting cache frames
# --------------------------------------------------------------------------------------------

def permute_frames(case: S.AttnCase, values: S.Logical, keep_lengths: bool, seed: int) -> S.Logical:
    """Shuffle each cache row's frames, carrying validity along.

    keep_lengths: shuffle inside [0, L_n) and inside [L_n, K) separately so key_lengths still
    describe the valid prefix (needs one cache per query row); otherwise any shuffle, with the
    validity moved into a dense mask and no key_lengths.
    """
    gen = torch.Generator().manual_seed(seed)
    rows, _, k_len, _ = values.k.shape
    valid = S.valid_keys(case)  # (N, Q, K), query-row indexed
    row_of = list(range(rows)) if values.kv_rows is None else [
        min(max(r, 0), rows - 1) for r in values.kv_rows]
    perms = []
    for r in range(rows):
        if keep_lengths:
            length = min(max(values.lengths[r], 0), k_len) if values.lengths is not None else k_len
            perm = torch.cat([torch.randperm(length, generator=gen),
                              length + torch.randperm(k_len - length, generator=gen)])
        else:
            perm = torch.randperm(k_len, generator=gen)
        perms.append(perm)
    k = torch.stack([values.k[r][:, perms[r]] for r in range(rows)]) if rows else values.k
    v = torch.stack([values.v[r][:, perms[r]] for r in range(rows)]) if rows else values.v
    mask = None
    if values.mask_base is not None or not keep_lengths:
        if keep_lengths:  # lengths stay; the mask follows its frames
            mask = torch.stack([values.mask_base.expand(valid.shape)[n][:, perms[row_of[n]]]
                                for n in range(valid.shape[0])])
        else:
            mask = torch.stack([valid[n][:, perms[row_of[n]]] for n in range(valid.shape[0])])
    return S.Logical(values.q, k, v, mask, values.lengths if keep_lengths else None, values.kv_rows)


def check_permuting_cache_frames_keeps_outputs(device, spec, dtype, keep_lengths, seed):
    S.tried(f"permute_frames[{device}]")
    keep_lengths = keep_lengths and spec.kv_rows is None
    values = S.logical_values(spec)
    case = S.arrange(spec, values, device, dtype)
    shuffled = S.arrange(spec, permute_frames(case, values, keep_lengths, seed), device, dtype)
    precision = "ieee" if dtype == torch.float32 else "auto"
    out, out_perm = run(case, precision), run(shuffled, precision)
    ref64 = oracle64(case)  # the math is invariant under the shuffle: one ground truth for both
    assert_within_oracle(out_perm.cpu(), S.attention_same_dtype(shuffled).cpu(), ref64,
                         name="shuffled " + spec.describe())
    assert_within_oracle(out.cpu(), S.attention_same_dtype(case).cpu(), ref64, name=spec.describe())


@given(spec=S.attention_specs(), dtype=S.dtypes, keep_lengths=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_permuting_cache_frames_keeps_outputs_cpu(spec, dtype, keep_lengths, seed):
    check_permuting_cache_frames_keeps_outputs("cpu", spec, dtype, keep_lengths, seed)


@pytest.mark.gpu
@GPU_SETTINGS
@given(spec=S.attention_specs(), dtype=S.dtypes, keep_lengths=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_permuting_cache_frames_keeps_outputs_cuda(spec, dtype, keep_lengths, seed):
    check_permuting_cache_frames_keeps_outputs("cuda", spec, dtype, keep_lengths, seed)


# Sharp fp32 "ieee" softmaxes (inputs x2) that fell outside SPEC 6's max-abs bound on the H200 before
# q.k ran in 32-wide head-dim slices (docs/performance.md): the first was found by the
# GPU profile of the property above (2.83e-6 vs a bound of 2.65e-6), the other two by
# bench/attention_accuracy.py (error 3.2x and 1.2x the bound with one dot over D = 128 / 64).
_SHARP_FP32 = {
    "k233-d64": (S.AttnSpec(n=2, h=1, q_len=1, k_len=233, d=64, seed=0, scale=2.0), 0),
    "k437-d128": (S.AttnSpec(n=1, h=2, q_len=1, k_len=437, d=128, seed=986071, scale=2.0), 264960),
    "k579-d64": (S.AttnSpec(n=2, h=2, q_len=1, k_len=579, d=64, seed=240713, scale=2.0), 232320),
}


# Still outside (H200: 1.05x and 1.02x the bound): at D = 32 the scores are already one
# 32-wide slice, and the rest of the error is P.V's and the scores' own (docs/performance.md run
# 10). Strict: a fix makes these fail until the marker goes.
_SHARP_FP32_OPEN = {
    "k102-d32": (S.AttnSpec(n=1, h=1, q_len=1, k_len=102, d=32, seed=768485, scale=2.0), 260858),
    "k2-d32": (S.AttnSpec(n=4, h=2, q_len=1, k_len=2, d=32, seed=732517, scale=2.0), 167855),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(_SHARP_FP32))
def test_sharp_fp32_softmax_cases_within_oracle_cuda(name):
    spec, seed = _SHARP_FP32[name]
    check_permuting_cache_frames_keeps_outputs("cuda", spec, torch.float32, keep_lengths=False, seed=seed)


@pytest.mark.gpu
@pytest.mark.xfail(strict=True, reason="known: fp32 'ieee' sharp D = 32 softmaxes, 1.02-1.05x the bound")
@pytest.mark.parametrize("name", sorted(_SHARP_FP32_OPEN))
def test_sharp_fp32_softmax_open_cases_cuda(name):
    spec, seed = _SHARP_FP32_OPEN[name]
    check_permuting_cache_frames_keeps_outputs("cuda", spec, torch.float32, keep_lengths=False, seed=seed)


# --------------------------------------------------------------------------------------------
# padded rows never change other rows
# --------------------------------------------------------------------------------------------

def insert_rows(spec: S.AttnSpec, values: S.Logical, extra: S.Logical, slots: list[int],
                pool_slots: list[int], extra_rows: list[int]) -> tuple[S.Logical, list[int]]:
    """Interleave ``extra`` rows into ``values``.

    slots: positions (in the grown batch) of the original query rows, sorted.
    pool_slots: positions of the original pool rows in the grown pool (kv_rows case).
    extra_rows: pool rows (grown numbering) read by the extra query rows (kv_rows case).
    Returns the grown values and ``slots``.
    """
    n_big = values.q.shape[0] + extra.q.shape[0]
    others = [i for i in range(n_big) if i not in slots]

    def interleave(a: torch.Tensor, b: torch.Tensor, at: list[int], total: int) -> torch.Tensor:
        out = torch.empty((total,) + tuple(a.shape[1:]), dtype=a.dtype)
        rest = [i for i in range(total) if i not in at]
        out[at] = a
        out[rest] = b
        return out

    q = interleave(values.q, extra.q, slots, n_big)
    lengths = None
    if values.lengths is not None:
        lengths = [0] * n_big
        for i, x in zip(slots, values.lengths):
            lengths[i] = x
        for i, x in zip(others, extra.lengths):
            lengths[i] = x
    mask = values.mask_base
    if mask is not None and mask.shape[0] != 1:  # per-row masks grow; shared (1, Q, K) ones don't
        mask = interleave(values.mask_base, extra.mask_base, slots, n_big)
    if values.kv_rows is None:
        k = interleave(values.k, extra.k, slots, n_big)
        v = interleave(values.v, extra.v, slots, n_big)
        kv_rows = None
    else:
        r_big = values.k.shape[0] + extra.k.shape[0]
        k = interleave(values.k, extra.k, pool_slots, r_big)
        v = interleave(values.v, extra.v, pool_slots, r_big)
        kv_rows = [0] * n_big
        for i, r in zip(slots, values.kv_rows):
            kv_rows[i] = pool_slots[r]
        for i, r in zip(others, extra_rows):
            kv_rows[i] = r
    return S.Logical(q, k, v, mask, lengths, kv_rows), slots


def check_padded_rows_change_no_other_row(device, spec, dtype, data):
    S.tried(f"padded_rows[{device}]")
    extra_n = data.draw(st.integers(1, 3), label="extra rows")
    n_big = spec.n + extra_n
    slots = sorted(data.draw(st.permutations(range(n_big)), label="order")[:spec.n])
    garbage = data.draw(st.sampled_from([1.0, 30.0]), label="garbage scale")
    extra_spec = S.AttnSpec(extra_n, spec.h, spec.q_len, spec.k_len, spec.d, spec.seed ^ 0x5A5A,
                            spec.scale * garbage, mask_mode=spec.mask_mode, mask_density=0.5)
    extra = S.logical_values(extra_spec)
    if spec.lengths is not None:
        extra.lengths = data.draw(st.lists(st.integers(0, spec.k_len), min_size=extra_n,
                                           max_size=extra_n), label="extra lengths")
    pool_slots, extra_rows = [], []
    if spec.kv_rows is not None:
        r_big = spec.pool + extra_n
        pool_slots = sorted(data.draw(st.permutations(range(r_big)), label="pool order")[:spec.pool])
        extra_rows = data.draw(st.lists(st.integers(0, r_big - 1), min_size=extra_n,
                                        max_size=extra_n), label="extra kv_rows")
    values = S.logical_values(spec)
    big_values, slots = insert_rows(spec, values, extra, slots, pool_slots, extra_rows)
    small, big = S.arrange(spec, values, device, dtype), S.arrange(spec, big_values, device, dtype)
    precision = data.draw(fp32_precisions(device, dtype), label="precision")
    out_small, out_big = run(small, precision), run(big, precision)
    if same_kernel_variant(small, big, policy.resolve_precision(small.q.dtype, precision or "auto")):
        assert torch.equal(out_big[slots], out_small), (
            f"{spec.describe()}: rows changed by padding, max diff "
            f"{(out_big[slots].double() - out_small.double()).abs().max().item():.3e}")
    else:
        # The CUDA heuristic picks tiles/splits from N*H too: another split of the key range
        # rounds differently, so rows agree within the oracle, not bitwise (reported).
        event("padded rows: kernel variant changed with N")
        ref64 = oracle64(small)
        assert_within_oracle(out_big[slots].cpu(), S.attention_same_dtype(small, tf32=precision == "tf32").cpu(),
                             ref64, name="padded " + spec.describe())
        assert_within_oracle(out_small.cpu(), S.attention_same_dtype(small, tf32=precision == "tf32").cpu(),
                             ref64, name="alone " + spec.describe())


@given(spec=S.attention_specs(), dtype=S.dtypes, data=st.data())
def test_padded_rows_change_no_other_row_cpu(spec, dtype, data):
    check_padded_rows_change_no_other_row("cpu", spec, dtype, data)


@pytest.mark.gpu
@GPU_SETTINGS
@given(spec=S.attention_specs(), dtype=S.dtypes, data=st.data())
def test_padded_rows_change_no_other_row_cuda(spec, dtype, data):
    check_padded_rows_change_no_other_row("cuda", spec, dtype, data)


def same_kernel_variant(small: S.AttnCase, big: S.AttnCase, precision=None) -> bool:
    """True unless the op picks different kernels or tiles/splits for the two batch sizes (the
    CUDA kernel's config, else the Triton launcher's)."""
    if small.q.device.type != "cuda":
        return True
    from torch_cfm.kernels._launch import sm_count
    from torch_cfm.kernels.cfm_attention import choose_config
    from torch_cfm.ops.cfm_attention import select_cuda_kernel_config

    def variant(case: S.AttnCase):
        n, h, q_len, d = case.q.shape
        cuda = select_cuda_kernel_config(case.q, case.k, case.v, precision)
        if cuda is not None:
            return cuda
        return choose_config(case.q.dtype, d, n * h, q_len, case.k.shape[2], sm_count(case.q.device))

    return variant(small) == variant(big)


def check_triton_rows_independent(device, spec, dtype, data):
    """With the launch variant pinned, the Triton kernel's rows never see each other."""
    from torch_cfm.kernels.cfm_attention import AttentionConfig, cfm_attention_triton
    from torch_cfm.ops.cfm_attention import empty_attention_out

    S.tried(f"triton_rows_independent[{device}]")
    tiles = [16, 32] if spec.d == 128 else [16, 32, 64]
    cfg = AttentionConfig(data.draw(st.sampled_from(tiles), label="block_q"),
                          data.draw(st.sampled_from(tiles), label="block_k"),
                          data.draw(st.sampled_from([1, 2, 3, 8]), label="splits"),
                          merge=data.draw(st.sampled_from(["kernel", "last"]), label="merge"))
    case = S.build_attention(spec, device, dtype)
    precision = "ieee" if dtype == torch.float32 else None
    full = cfm_attention_triton(case.q, case.k, case.v, case.key_lengths, case.mask, case.kv_rows,
                                precision, empty_attention_out(case.q), config=cfg)
    n0 = data.draw(st.integers(0, spec.n - 1), label="row")

    def row(t):
        return None if t is None else t[n0:n0 + 1]

    pool = case.kv_rows is not None
    alone = cfm_attention_triton(row(case.q), case.k if pool else row(case.k), case.v if pool else row(case.v),
                                 row(case.key_lengths), row(case.mask), row(case.kv_rows), precision,
                                 empty_attention_out(row(case.q)), config=cfg)
    assert torch.equal(full[n0:n0 + 1], alone), f"{cfg.name}: row {n0} differs when run alone"


@pytest.mark.gpu
@GPU_SETTINGS
@given(spec=S.attention_specs(min_k=1), dtype=S.dtypes, data=st.data())
def test_triton_kernel_rows_are_independent_bitwise(spec, dtype, data):
    check_triton_rows_independent("cuda", spec, dtype, data)


# --------------------------------------------------------------------------------------------
# fully masked queries return 0
# --------------------------------------------------------------------------------------------

@st.composite
def specs_with_dead_queries(draw) -> S.AttnSpec:
    spec = draw(S.attention_specs())
    how = draw(st.sampled_from(["length0", "mask", "no_keys"]))
    n0 = draw(st.integers(0, spec.n - 1))
    if how == "no_keys":
        return replace(spec, k_len=0, lengths=None if spec.lengths is None else (0,) * spec.n)
    if how == "length0":
        lengths = list(spec.lengths) if spec.lengths is not None else [spec.k_len] * spec.n
        lengths[n0] = 0
        return replace(spec, lengths=tuple(lengths))
    dead = tuple(sorted(set(spec.dead_queries) | {draw(st.integers(0, spec.q_len - 1))}))
    mode = spec.mask_mode if spec.mask_mode in ("dense", "expand_n") else "dense"
    return replace(spec, mask_mode=mode, dead_queries=dead)


def check_fully_masked_query_returns_zero(device, spec, dtype):
    S.tried(f"fully_masked_zero[{device}]")
    case = S.build_attention(spec, device, dtype)
    out = run(case).cpu()
    live = S.valid_keys(case).any(-1)  # (N, Q)
    dead = (~live)[:, None, :].expand(out.shape[:3])
    assert (~live).any()
    assert (out[dead] == 0).all(), f"{spec.describe()}: dead queries not exactly 0"
    assert torch.isfinite(out).all(), f"{spec.describe()}: non-finite output"


@given(spec=specs_with_dead_queries(), dtype=S.dtypes)
def test_fully_masked_query_returns_zero_cpu(spec, dtype):
    check_fully_masked_query_returns_zero("cpu", spec, dtype)


@pytest.mark.gpu
@GPU_SETTINGS
@given(spec=specs_with_dead_queries(), dtype=S.dtypes)
def test_fully_masked_query_returns_zero_cuda(spec, dtype):
    check_fully_masked_query_returns_zero("cuda", spec, dtype)


# --------------------------------------------------------------------------------------------
# NaN / Inf stays where it was read
# --------------------------------------------------------------------------------------------

def check_nonfinite_stays_in_its_row(device, spec, dtype, data):
    S.tried(f"nonfinite_contained[{device}]")
    bad = data.draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]), label="value")
    target = data.draw(st.sampled_from(["q", "k", "v"]), label="target")
    values = S.logical_values(spec)
    case = S.arrange(spec, values, device, dtype)
    h0 = data.draw(st.integers(0, spec.h - 1), label="head")
    d0 = data.draw(st.integers(0, spec.d - 1), label="channel")
    affected = torch.zeros(spec.n, spec.h, spec.q_len, dtype=torch.bool)
    if target == "q":
        n0 = data.draw(st.integers(0, spec.n - 1), label="row")
        i0 = data.draw(st.integers(0, spec.q_len - 1), label="query")
        values.q[n0, h0, i0, d0] = bad
        affected[n0, h0, i0] = True
    else:
        r0 = data.draw(st.integers(0, spec.kv_count - 1), label="cache row")
        j0 = data.draw(st.integers(0, spec.k_len - 1), label="frame")
        getattr(values, target)[r0, h0, j0, d0] = bad
        row_of = range(spec.n) if spec.kv_rows is None else spec.kv_rows
        for n, r in enumerate(row_of):
            if r == r0:
                affected[n, h0, :] = True
    poisoned = S.arrange(spec, values, device, dtype)
    precision = data.draw(fp32_precisions(device, dtype), label="precision")
    clean_out, bad_out = run(case, precision), run(poisoned, precision)
    keep = (~affected).to(clean_out.device)
    assert torch.equal(bad_out[keep], clean_out[keep]), (
        f"{spec.describe()}: {bad} in {target} leaked to outputs that never read it")


@given(spec=S.attention_specs(min_k=1), dtype=S.dtypes, data=st.data())
def test_nonfinite_stays_in_its_row_cpu(spec, dtype, data):
    check_nonfinite_stays_in_its_row("cpu", spec, dtype, data)


@pytest.mark.gpu
@GPU_SETTINGS
@given(spec=S.attention_specs(min_k=1), dtype=S.dtypes, data=st.data())
def test_nonfinite_stays_in_its_row_cuda(spec, dtype, data):
    check_nonfinite_stays_in_its_row("cuda", spec, dtype, data)


def check_padding_frames_never_leak(device, spec, dtype, data):
    """Non-finite garbage in cache frames at or beyond key_lengths (e.g. an arena from
    torch.empty) must not reach any output: those keys are invalid, not just zero-weighted."""
    S.tried(f"padding_frames_no_leak[{device}]")
    lengths = spec.lengths if spec.lengths is not None else tuple(
        data.draw(st.lists(st.integers(0, spec.k_len), min_size=spec.n, max_size=spec.n), label="lengths"))
    spec = replace(spec, lengths=lengths, mask_mode="none", dead_queries=())
    bad = data.draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]), label="value")
    values = S.logical_values(spec)
    case = S.arrange(spec, values, device, dtype)
    row_of = range(spec.n) if spec.kv_rows is None else [min(max(r, 0), spec.kv_count - 1) for r in spec.kv_rows]
    used = [0] * spec.kv_count
    for n, r in enumerate(row_of):
        used[r] = max(used[r], min(max(lengths[n], 0), spec.k_len))
    for r, first_invalid in enumerate(used):
        values.k[r, :, first_invalid:] = bad
        values.v[r, :, first_invalid:] = bad
    poisoned = S.arrange(spec, values, device, dtype)
    precision = data.draw(fp32_precisions(device, dtype), label="precision")
    clean, dirty = run(case, precision), run(poisoned, precision)
    assert torch.isfinite(dirty).all(), f"{bad} in padding frames reached the output ({spec.describe()})"
    assert torch.equal(clean, dirty), f"padding frames changed the output ({spec.describe()})"


@given(spec=S.attention_specs(min_k=1), dtype=S.dtypes, data=st.data())
def test_padding_frames_never_leak_cpu(spec, dtype, data):
    check_padding_frames_never_leak("cpu", spec, dtype, data)


@pytest.mark.gpu
@GPU_SETTINGS
@given(spec=S.attention_specs(min_k=1), dtype=S.dtypes, data=st.data())
def test_padding_frames_never_leak_cuda(spec, dtype, data):
    check_padding_frames_never_leak("cuda", spec, dtype, data)


# --------------------------------------------------------------------------------------------
# autocast follows the ambient dtype
# --------------------------------------------------------------------------------------------

def check_autocast_output_dtype_follows_ambient(device, spec, in_dtype, ambient):
    S.tried(f"autocast_dtype[{device}]")
    case = S.build_attention(spec, device, in_dtype)
    with torch.autocast(device, dtype=ambient):
        out = cfm_attention(case.q, case.k, case.v, **case.kwargs())
    assert out.dtype == ambient, f"autocast({ambient}) gave {out.dtype}"
    cast = S.AttnCase(spec, case.q.to(ambient), case.k.to(ambient), case.v.to(ambient),
                      case.key_lengths, case.mask, case.kv_rows)
    check_layout(out, cast)
    assert_within_oracle(out.cpu(), S.attention_same_dtype(cast).cpu(), oracle64(cast),
                         name="autocast " + spec.describe())


@given(spec=S.attention_specs(), in_dtype=S.dtypes,
       ambient=st.sampled_from([torch.float16, torch.bfloat16]))
def test_autocast_output_dtype_follows_ambient_cpu(spec, in_dtype, ambient):
    check_autocast_output_dtype_follows_ambient("cpu", spec, in_dtype, ambient)


@pytest.mark.gpu
@GPU_SETTINGS
@given(spec=S.attention_specs(), in_dtype=S.dtypes,
       ambient=st.sampled_from([torch.float16, torch.bfloat16]))
def test_autocast_output_dtype_follows_ambient_cuda(spec, in_dtype, ambient):
    check_autocast_output_dtype_follows_ambient("cuda", spec, in_dtype, ambient)


# --------------------------------------------------------------------------------------------
# explain reports the path that runs
# --------------------------------------------------------------------------------------------

@contextlib.contextmanager
def spy_kernels() -> Iterator[list]:
    """Record which CUDA implementation ``cfm_attention`` reaches: ("triton", precision),
    ("cuda", config) for the hand-written CUDA kernel, or ("sdpa", None). The CPU kernel is C++: no
    record means it ran."""
    op_module = importlib.import_module("torch_cfm.ops.cfm_attention")
    calls: list = []
    saved_sdpa = op_module.cfm_attention_sdpa

    def sdpa_spy(*args, **kwargs):
        calls.append(("sdpa", None))
        return saved_sdpa(*args, **kwargs)

    op_module.cfm_attention_sdpa = sdpa_spy
    try:
        kernels = importlib.import_module("torch_cfm.kernels.cfm_attention")
    except ImportError:
        kernels = None
    saved_triton = getattr(kernels, "cfm_attention_triton", None)
    if saved_triton is not None:
        def triton_spy(*args, **kwargs):
            calls.append(("triton", args[6] if len(args) > 6 else kwargs.get("precision")))
            return saved_triton(*args, **kwargs)

        kernels.cfm_attention_triton = triton_spy
    cuda_module = importlib.import_module("torch_cfm.kernels.cfm_attention_cuda")
    saved_cuda = cuda_module.cfm_attention_cuda

    def cuda_spy(*args, **kwargs):
        calls.append(("cuda", args[7] if len(args) > 7 else kwargs.get("config")))
        return saved_cuda(*args, **kwargs)

    cuda_module.cfm_attention_cuda = cuda_spy  # the op imports it at call time
    try:
        yield calls
    finally:
        op_module.cfm_attention_sdpa = saved_sdpa
        cuda_module.cfm_attention_cuda = saved_cuda
        if saved_triton is not None:
            kernels.cfm_attention_triton = saved_triton


def explained_attention(device: str, dtype: torch.dtype) -> tuple[str, str | None]:
    """(kernel, precision) of the ``cfm_attention [dtype]`` line of ``explain``'s report."""
    name = str(dtype).replace("torch.", "")
    text = machine_report(torch.device(device))
    found = re.search(rf"cfm_attention \[{name}\]: kernel=(\w+)(?: precision=(\w+))?", text)
    assert found, f"explain output has no cfm_attention line for {name}:\n{text}"
    return found.group(1), found.group(2)


AUTO_POLICIES = [p for p in S.TF32_POLICIES if p.precision == "auto"]


def check_explain_reports_the_path_that_runs(device, spec, dtype, pol):
    S.tried(f"explain_matches_run[{device}]")
    case = S.build_attention(spec, device, dtype)
    with pol.applied():
        kernel, precision = explained_attention(device, dtype)
        with spy_kernels() as calls:
            out = run(case)
    assert torch.isfinite(out).all()
    if kernel == "reference":
        assert device == "cpu" and calls == [], f"explain says reference, ran {calls}"
    elif calls and calls[0][0] == "cuda":
        # "triton" is the SM80+ family: the op runs the hand-written CUDA kernel inside it exactly
        # where its own per-call rule picks that kernel (16-bit, or fp32 with TF32).
        from torch_cfm.ops.cfm_attention import select_cuda_kernel_config

        assert kernel == "triton" and len(calls) == 1, f"explain says {kernel}, ran {calls}"
        assert precision == ("tf32" if dtype == torch.float32 else None), f"CUDA kernel ran under {precision}"
        with pol.applied():
            chosen = select_cuda_kernel_config(case.q, case.k, case.v, precision)
        assert calls[0][1] == chosen, f"ran {calls[0][1]}, the op's rule picks {chosen}"
    else:
        assert calls == [(kernel, precision)], f"explain says {kernel}/{precision}, ran {calls}"
    if dtype == torch.float32 and device == "cuda":
        assert precision == pol.expected(), f"{pol.name}: explain says {precision}"


@given(spec=S.attention_specs(min_k=1), dtype=S.dtypes, pol=st.sampled_from(AUTO_POLICIES))
def test_explain_reports_the_path_that_runs_cpu(spec, dtype, pol):
    check_explain_reports_the_path_that_runs("cpu", spec, dtype, pol)


@pytest.mark.gpu
@GPU_SETTINGS
@given(spec=S.attention_specs(min_k=1), dtype=S.dtypes, pol=st.sampled_from(AUTO_POLICIES))
def test_explain_reports_the_path_that_runs_cuda(spec, dtype, pol):
    check_explain_reports_the_path_that_runs("cuda", spec, dtype, pol)


# --------------------------------------------------------------------------------------------
# TF32 policy => tolerance
# --------------------------------------------------------------------------------------------

def check_tf32_policy_sets_fp32_tolerance(device, spec, pol):
    S.tried(f"tf32_policy[{device}]")
    case = S.build_attention(spec, device, torch.float32)
    with pol.applied():
        assert policy.resolve_precision(torch.float32, pol.precision) == pol.expected(), pol.name
        with spy_kernels() as calls:
            out = run(case, pol.precision)
    rel = err_rel_fro(out.cpu(), oracle64(case))
    if device == "cpu":
        # The CPU kernel has no TF32: every policy gives IEEE accuracy.
        assert calls == [] and rel <= IEEE_REL_BOUND, f"{pol.name}: rel err {rel:.2e}"
        return
    expected = pol.expected()
    assert calls == [("triton", expected)], f"{pol.name}: ran {calls}"
    bound = TF32_REL_BOUND if expected == "tf32" else IEEE_REL_BOUND
    assert rel <= bound, f"{pol.name} ({expected}): rel err {rel:.2e} > {bound:.0e}"


@given(spec=S.attention_specs(), pol=S.tf32_policies)
def test_tf32_policy_sets_fp32_tolerance_cpu(spec, pol):
    check_tf32_policy_sets_fp32_tolerance("cpu", spec, pol)


@pytest.mark.gpu
@GPU_SETTINGS
@given(spec=S.attention_specs(), pol=S.tf32_policies)
def test_tf32_policy_sets_fp32_tolerance_cuda(spec, pol):
    check_tf32_policy_sets_fp32_tolerance("cuda", spec, pol)


# --------------------------------------------------------------------------------------------
# the Triton kernel itself on CPU (TRITON_INTERPRET=1, child process)
# --------------------------------------------------------------------------------------------

def _triton_run(case: S.AttnCase, precision: str = "auto", poison: bool = True) -> torch.Tensor:
    """``run`` for the interpreter child: the Triton launcher on CPU tensors, NaN-filled out."""
    from torch_cfm.kernels.cfm_attention import cfm_attention_triton
    from torch_cfm.ops.cfm_attention import empty_attention_out

    out = empty_attention_out(case.q).fill_(float("nan"))
    prec = "ieee" if case.q.dtype == torch.float32 else None
    return cfm_attention_triton(case.q, case.k, case.v, case.key_lengths, case.mask, case.kv_rows, prec, out)


def interpreter_main(examples: int) -> None:
    """Entry point of the child process: row independence, non-finite containment and padding
    frames, on the Triton kernel run by the interpreter (fp32/fp16; its bf16 dot is broken)."""
    from hypothesis import settings

    global run
    run = _triton_run
    small = S.attention_specs(n_max=3, k_values=st.integers(1, 80), d_values=st.sampled_from([16, 32]),
                              min_k=1)
    dtypes = st.sampled_from([torch.float32, torch.float16])
    checks = (("rows_independent", check_triton_rows_independent),
              ("nonfinite_contained", check_nonfinite_stays_in_its_row),
              ("padding_frames_no_leak", check_padding_frames_never_leak))
    for name, check in checks:
        @settings(max_examples=examples, deadline=None, derandomize=True, database=None)
        @given(spec=small, dtype=dtypes, data=st.data())
        def prop(spec, dtype, data):
            check("cpu", spec, dtype, data)

        S.CASES.clear()
        prop()
        print(f"interpreter-case {name} {sum(S.CASES.values())}", flush=True)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="CUDA machine: the compiled kernel runs these properties (triton_rows_independent[cuda]); "
                           "Triton 3.6's interpreter mishandles this kernel's scalar loop bounds")
def test_triton_kernel_properties_in_interpreter():
    """CI coverage of the Triton kernel's row independence and padding handling on CPU."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    here = os.path.dirname(os.path.abspath(__file__))
    env = interpreter_env(hide_gpus=False, OMP_NUM_THREADS="1")
    code = "import test_properties as t; t.interpreter_main(15)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=here, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    for name, count in re.findall(r"interpreter-case (\w+) (\d+)", proc.stdout):
        S.CASES[f"{name}[triton-interpreter]"] += int(count)
