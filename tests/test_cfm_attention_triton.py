"""The Triton kernel of cfm_attention itself: CPU interpreter cases (CI) and CUDA cases (gpu marker).

Interpreter cases: Triton reads ``TRITON_INTERPRET`` when a kernel is *decorated* (module import),
so setting it inside this pytest process would either come too late (the kernel module already
imported) or leak into every Triton kernel imported afterwards (GPU runs of other tests). The
cases therefore run in one child process started with ``TRITON_INTERPRET=1``: the parent draws the
inputs (seeded), the child builds the strided views, poisons ``out`` with NaN, calls the launcher
and saves the outputs; the parent checks them against the docs/design.md §6 oracle.

Same-dtype reference (docs/design.md §6, the FlashAttention idiom): ``cfm_attention_reference`` with
``compute_dtype`` = the input dtype, i.e. for fp16 every matmul and the softmax run in fp16. It is
"plain PyTorch math in the same dtype"; the kernel (fp32 accumulation and softmax, P rounded to
fp16 for the second dot) must land within twice its error. For fp32 the reference computes in
fp32 and SPEC's IEEE bound (1e-5 relative) is checked as well. The interpreter ignores
``input_precision``, so TF32 and bf16 are covered by the gpu-marked cases only (docs/design.md §10).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from dataclasses import dataclass, field
from typing import Optional

import pytest
import torch

from interpreter_child import interpreter_env
from oracle import IEEE_REL_BOUND, TF32_REL_BOUND, assert_within_oracle, err_rel_fro, naive_attention64
from torch_cfm.reference.cfm_attention import cfm_attention_reference

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)


@dataclass(frozen=True)
class Case:
    """One launcher call. ``config`` = AttentionConfig(*config), or None for choose_config."""

    name: str
    dtype: torch.dtype
    n: int
    h: int
    q: int
    k: int
    d: int
    lengths: Optional[tuple[int, ...]] = None
    mask: Optional[str] = None  # None | "random" | "expanded" (a (Q, K) mask expanded to (N, Q, K))
    kv_interleaved: bool = False  # k, v = cache[..., :D], cache[..., D:] of an (R, H, K, 2D) cache
    q_transposed: bool = False  # q = (N, Q, H, D) buffer viewed as (N, H, Q, D)
    kv_rows: Optional[tuple[int, ...]] = None  # pool rows (R = pool) incl. out-of-range values
    pool: int = 0
    precision: Optional[str] = None  # fp32: "ieee" | "tf32"
    config: Optional[tuple] = None  # AttentionConfig fields, positional
    nan_padding: bool = False  # K/V frames at or beyond each row's key length hold NaN
    extra: dict = field(default_factory=dict, compare=False, hash=False)


F32, F16 = torch.float32, torch.float16
_B = 16  # BLOCK_K of the explicit configs below: lengths straddle its multiples
_EDGE = (0, 1, _B - 1, _B, _B + 1, 2 * _B + 1, 3 * _B - 1, 40)

CASES: list[Case] = []
for _dt in (F32, F16):
    _p = "ieee" if _dt == F32 else None
    _t = "f32" if _dt == F32 else "f16"
    CASES += [
        Case(f"{_t}-edge-lengths-nosplit", _dt, 8, 2, 5, 40, 16, _EDGE, precision=_p, config=(16, _B, 1)),
        Case(f"{_t}-edge-lengths-split3", _dt, 8, 2, 5, 40, 16, _EDGE, precision=_p, config=(16, _B, 3)),
        Case(f"{_t}-edge-lengths-nopeel-split2", _dt, 8, 2, 5, 40, 16, _EDGE, mask="random", precision=_p,
             config=(16, _B, 2, 4, 2, False)),
        Case(f"{_t}-q1-split2", _dt, 3, 2, 1, 37, 32, (37, 20, 5), precision=_p, config=(16, _B, 2)),
        Case(f"{_t}-k0", _dt, 2, 2, 3, 0, 16, (0, 4), precision=_p, config=(16, _B, 1)),
        Case(f"{_t}-k0-nolengths", _dt, 2, 2, 3, 0, 16, precision=_p),
        Case(f"{_t}-interleaved-transposed-split2", _dt, 2, 2, 20, 50, 32, (50, 23),
             kv_interleaved=True, q_transposed=True, precision=_p, config=(16, _B, 2)),
        Case(f"{_t}-expanded-mask-and-lengths", _dt, 3, 2, 6, 33, 16, (33, 17, 2), mask="expanded",
             precision=_p, config=(16, _B, 2)),
        Case(f"{_t}-random-mask-nolengths", _dt, 2, 2, 7, 30, 16, mask="random", precision=_p,
             config=(16, _B, 1)),
        Case(f"{_t}-pool-rows-clamped", _dt, 4, 2, 5, 24, 16, (24, 9, -3, 1000), kv_interleaved=True,
             kv_rows=(4, 7, 0, -2), pool=5, precision=_p, config=(16, _B, 2)),
        Case(f"{_t}-pool-rows-mask", _dt, 3, 2, 4, 21, 16, (21, 16, 3), mask="random",
             kv_rows=(2, 2, 0), pool=3, precision=_p, config=(16, _B, 1)),
    ]
    # NaN in the padding frames (K/V beyond each row's key length) must never reach the output
    CASES += [
        Case(f"{_t}-edge-lengths-nanpad", _dt, 8, 2, 5, 40, 16, _EDGE, precision=_p, config=(16, _B, 1),
             nan_padding=True),
        Case(f"{_t}-mask-pool-nanpad-split2", _dt, 4, 2, 6, 37, 32, (37, 3, 16, 0), mask="random",
             kv_rows=(1, 3, 0, 2), pool=4, kv_interleaved=True, precision=_p, config=(16, _B, 2), nan_padding=True),
    ]
    # split partials merged by the last-arriving program (one atomic counter per query tile)
    _last = (4, 2, True, "tf32x3", None, "last")
    CASES += [
        Case(f"{_t}-edge-lengths-split3-last", _dt, 8, 2, 5, 40, 16, _EDGE, precision=_p, config=(16, _B, 3) + _last),
        Case(f"{_t}-q1-split2-last", _dt, 3, 2, 1, 37, 32, (37, 20, 5), precision=_p, config=(16, _B, 2) + _last),
        Case(f"{_t}-mask-pool-nanpad-split2-last", _dt, 4, 2, 6, 37, 32, (37, 3, 16, 0), mask="random",
             kv_rows=(1, 3, 0, 2), pool=4, kv_interleaved=True, precision=_p, config=(16, _B, 2) + _last,
             nan_padding=True),
    ]
    # q·k in head-dim slices with accumulators of their own (qk_slab): 4 and 2 slices, whole and split walks
    _slab16 = (4, 2, True, "tf32x3", None, "last", 16)
    CASES += [
        Case(f"{_t}-edge-lengths-qkslab16x4", _dt, 8, 2, 5, 40, 64, _EDGE, mask="random", precision=_p,
             config=(16, _B, 1) + _slab16),
        Case(f"{_t}-mask-pool-nanpad-split2-last-qkslab16x2", _dt, 4, 2, 6, 37, 32, (37, 3, 16, 0), mask="random",
             kv_rows=(1, 3, 0, 2), pool=4, kv_interleaved=True, q_transposed=True, precision=_p,
             config=(16, _B, 2) + _slab16, nan_padding=True),
    ]
    for _d in (16, 32, 64, 128):  # each head dim through the default heuristic
        CASES.append(Case(f"{_t}-d{_d}-default-config", _dt, 2, 2, 9, 70, _d, (70, 31), precision=_p))
CASES.append(Case("f32-tf32-flag-interpreter", F32, 2, 2, 4, 20, 16, (20, 7), precision="tf32",
                  config=(16, _B, 1)))


def _gen(case: Case) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(case.name.encode()))


def make_base(case: Case) -> dict[str, torch.Tensor]:
    """Contiguous base tensors of a case (fresh random values, never zeros)."""
    g = _gen(case)
    rows = case.pool if case.kv_rows is not None else case.n
    base: dict[str, torch.Tensor] = {}
    q_shape = (case.n, case.q, case.h, case.d) if case.q_transposed else (case.n, case.h, case.q, case.d)
    base["q"] = torch.randn(q_shape, generator=g).to(case.dtype)
    if case.kv_interleaved:
        base["kv"] = torch.randn(rows, case.h, case.k, 2 * case.d, generator=g).to(case.dtype)
    else:
        base["k"] = torch.randn(rows, case.h, case.k, case.d, generator=g).to(case.dtype)
        base["v"] = torch.randn(rows, case.h, case.k, case.d, generator=g).to(case.dtype)
    if case.lengths is not None:
        base["key_lengths"] = torch.tensor(case.lengths, dtype=torch.int32)
    if case.kv_rows is not None:
        base["kv_rows"] = torch.tensor(case.kv_rows, dtype=torch.int32)
    if case.nan_padding:  # frames no query may see: each pool row's padding of the rows reading it
        for n in range(case.n):
            r = n if case.kv_rows is None else min(max(case.kv_rows[n], 0), rows - 1)
            readers = [m for m in range(case.n) if (m if case.kv_rows is None else
                                                    min(max(case.kv_rows[m], 0), rows - 1)) == r]
            start = max(min(max(case.lengths[m], 0), case.k) for m in readers)
            for name in ("kv",) if case.kv_interleaved else ("k", "v"):
                base[name][r, :, start:] = float("nan")
    if case.mask == "random":
        base["mask"] = torch.rand(case.n, case.q, case.k, generator=g) > 0.4
        if case.q > 1 and case.k > 0:
            base["mask"][0, 1] = False  # one query with no valid key at all
    elif case.mask == "expanded":
        m = torch.rand(case.q, case.k, generator=g) > 0.3
        m[-1] = False  # last query sees nothing in every row
        base["mask"] = m
    return base


def make_views(case: Case, base: dict[str, torch.Tensor]) -> dict[str, Optional[torch.Tensor]]:
    """The launcher's arguments: strided views of the base tensors, as the case asks."""
    q = base["q"].transpose(1, 2) if case.q_transposed else base["q"]
    if case.kv_interleaved:
        k, v = base["kv"][..., : case.d], base["kv"][..., case.d:]
    else:
        k, v = base["k"], base["v"]
    mask = base.get("mask")
    if case.mask == "expanded":
        mask = mask.expand(case.n, case.q, case.k)
    return dict(q=q, k=k, v=v, key_lengths=base.get("key_lengths"), mask=mask, kv_rows=base.get("kv_rows"))


def _run_child(in_path: str, out_path: str) -> None:
    """Child process body (TRITON_INTERPRET=1): run every case, save outputs or error strings."""
    import traceback

    from torch_cfm.kernels.cfm_attention import AttentionConfig, cfm_attention_triton

    bases = torch.load(in_path)
    results: dict[str, object] = {}
    for case in CASES:
        try:
            a = make_views(case, bases[case.name])
            if case.mask == "expanded":
                assert a["mask"].stride()[0] == 0, "expanded mask lost its stride 0"
            if case.q_transposed:
                assert not a["q"].is_contiguous()
            out = torch.full((case.n, case.q, case.h, case.d), float("nan"), dtype=case.dtype).transpose(1, 2)
            cfg = None if case.config is None else AttentionConfig(*case.config)
            res = cfm_attention_triton(a["q"], a["k"], a["v"], a["key_lengths"], a["mask"], a["kv_rows"],
                                       case.precision, out, config=cfg)
            assert res is out, "launcher must return the out it was given"
            results[case.name] = out.clone()
        except Exception:  # reported per case by the parent
            results[case.name] = traceback.format_exc()
    torch.save(results, out_path)


@pytest.fixture(scope="module")
def interpreter_outputs(tmp_path_factory) -> dict[str, object]:
    tmp = tmp_path_factory.mktemp("triton_interp")
    in_path, out_path = str(tmp / "inputs.pt"), str(tmp / "outputs.pt")
    torch.save({c.name: make_base(c) for c in CASES}, in_path)
    env = interpreter_env()
    env["PYTHONPATH"] = os.pathsep.join([_HERE, _ROOT, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", in_path, out_path],
                          env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"interpreter child failed (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return torch.load(out_path)


def _check(case: Case, out: torch.Tensor, args: dict) -> None:
    ref64 = naive_attention64(args["q"], args["k"], args["v"], args["key_lengths"], args["mask"], args["kv_rows"])
    same = cfm_attention_reference(args["q"], args["k"], args["v"], args["key_lengths"], args["mask"],
                                   args["kv_rows"], compute_dtype=case.dtype)
    assert out.dtype == case.dtype
    assert torch.isfinite(out).all(), f"{case.name}: NaN/inf in output (poison not overwritten?)"
    assert_within_oracle(out, same, ref64, case.name)
    if case.dtype == torch.float32 and case.precision == "ieee":
        assert err_rel_fro(out, ref64) <= IEEE_REL_BOUND
    # queries with no valid key are exactly 0
    empty = ref64.abs().amax(dim=-1) == 0
    assert (out.double().abs().amax(dim=-1)[empty] == 0).all(), f"{case.name}: empty query not exactly 0"


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="CUDA machine: the same cases run compiled in test_gpu_cases_match_oracle "
                           "(Triton 3.6's interpreter mishandles scalar loop bounds of this kernel)")
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_interpreter_matches_oracle(case: Case, interpreter_outputs) -> None:
    res = interpreter_outputs[case.name]
    if isinstance(res, str):
        pytest.fail(f"{case.name} raised in the interpreter:\n{res}")
    _check(case, res, make_views(case, make_base(case)))


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_gpu_cases_match_oracle(case: Case) -> None:
    """The interpreter's edge cases through the compiled kernel (TF32 cases: TF32 bound)."""
    from torch_cfm.kernels.cfm_attention import AttentionConfig, cfm_attention_triton

    a = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in make_views(case, make_base(case)).items()}
    out = torch.full((case.n, case.q, case.h, case.d), float("nan"), dtype=case.dtype, device="cuda").transpose(1, 2)
    cfg = None if case.config is None else AttentionConfig(*case.config)
    cfm_attention_triton(a["q"], a["k"], a["v"], a["key_lengths"], a["mask"], a["kv_rows"], case.precision, out,
                         config=cfg)
    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    if case.precision == "tf32":
        ref64 = naive_attention64(cpu["q"], cpu["k"], cpu["v"], cpu["key_lengths"], cpu["mask"], cpu["kv_rows"])
        same = cfm_attention_reference(cpu["q"], cpu["k"], cpu["v"], cpu["key_lengths"], cpu["mask"],
                                       cpu["kv_rows"], compute_dtype=case.dtype)
        assert_within_oracle(out.cpu(), same, ref64, case.name, tf32=True)
    else:
        _check(case, out.cpu(), cpu)


def test_cases_cover_edges() -> None:
    """The case list keeps its coverage promises (a guard against silent pruning)."""
    assert {c.d for c in CASES} == {16, 32, 64, 128}
    assert {0, 1, _B - 1, _B, _B + 1} <= {x for c in CASES if c.lengths for x in c.lengths}
    assert any(c.k == 0 for c in CASES) and any(c.q == 1 for c in CASES)
    assert any(c.kv_interleaved and c.q_transposed for c in CASES)
    assert any(c.mask == "expanded" and c.lengths for c in CASES)
    assert any(c.kv_rows and (max(c.kv_rows) >= c.pool or min(c.kv_rows) < 0) for c in CASES)
    assert any(c.nan_padding for c in CASES)


def test_choose_config_split_rule() -> None:
    """The measured split decisions (docs/performance.md) and their invariant."""
    import triton

    from torch_cfm.kernels.cfm_attention import choose_config

    for precision in ("tf32", "ieee"):  # fp32, few programs: two key halves, merged in-kernel
        cfg = choose_config(torch.float32, 64, 16, 50, 450, 132, precision)
        assert (cfg.block_q, cfg.splits, cfg.merge) == (16, 2, "last")
    assert choose_config(torch.float32, 64, 64, 50, 450, 132, "tf32").splits == 1  # a full wave already
    assert choose_config(torch.float32, 64, 16, 50, 200, 132, "tf32").splits == 1  # short key range
    for rows_heads in (16, 64, 256):  # fp16 never gained from a split at streaming sizes
        assert choose_config(torch.float16, 64, rows_heads, 50, 450, 132).splits == 1
    long_k = choose_config(torch.float16, 64, 4, 20, 4096, 132)
    assert long_k.splits > 1 and long_k.merge == "last"
    for dtype, precision in ((torch.float16, None), (torch.float32, "tf32"), (torch.float32, "ieee")):
        for rows_heads in (1, 2, 8, 16, 33, 64, 256):
            for q_len in (1, 16, 50, 150):
                for k_len in (0, 64, 256, 450, 2048, 9000):
                    cfg = choose_config(dtype, 64, rows_heads, q_len, k_len, 132, precision)
                    if cfg.merge == "last" and cfg.splits > 1:  # the in-kernel merge is used in one wave only
                        assert rows_heads * triton.cdiv(q_len, cfg.block_q) * cfg.splits <= 132, cfg


def test_choose_config_slices_ieee_scores_only() -> None:
    """fp32 "ieee" scores run in 32-wide head-dim slices for D > 32 (docs/performance.md); other
    dtypes and precisions keep one dot; qk_slabs rejects a width that does not cut D into 2 or 4."""
    from torch_cfm.kernels.cfm_attention import AttentionConfig, choose_config, qk_slabs

    for d, slabs in ((16, 1), (32, 1), (64, 2), (128, 4)):
        cfg = choose_config(torch.float32, d, 8, 50, 450, 132, "ieee")
        assert qk_slabs(cfg, d) == slabs
        assert qk_slabs(choose_config(torch.float32, d, 8, 50, 450, 132, "tf32"), d) == 1
        assert qk_slabs(choose_config(torch.float16, d, 8, 50, 450, 132), d) == 1
    for bad in (48, 8):
        with pytest.raises(ValueError, match="qk_slab"):
            qk_slabs(AttentionConfig(32, 64, qk_slab=bad), 128)


def test_arrival_counters_reserve_disjoint_slices_and_never_reuse_them() -> None:
    """Captured launches get counters of their own from the zeroed pool; a used-up (or missing)
    pool answers None (the launcher then merges with the combine kernel)."""
    from torch_cfm.kernels.cfm_attention import ArrivalCounters

    counters, dev = ArrivalCounters(), torch.device("cuda", 0)
    assert counters.reserve_for_capture(dev, 8) is None  # no eager launch has made a pool yet
    pool = torch.zeros(20, dtype=torch.int32)
    counters._pool[0] = (pool, 0)
    a, b = counters.reserve_for_capture(dev, 8), counters.reserve_for_capture(dev, 8)
    a.fill_(1)
    b.fill_(2)
    assert pool[:16].tolist() == [1] * 8 + [2] * 8 and pool[16:].tolist() == [0] * 4
    assert counters.reserve_for_capture(dev, 8) is None  # 4 left: never hands out a used slot
    assert counters.reserve_for_capture(dev, 4) is not None


# ---------------------------------------------------------------------------------------------
# CUDA (H200): every dtype/precision, the default heuristic at the bench shapes, explicit
# split/no-split variants, graph capture and sync-freedom.

_GPU_DTYPES = [(torch.float16, None), (torch.bfloat16, None), (torch.float32, "tf32"), (torch.float32, "ieee")]


def _gpu_inputs(n, h, q_len, k_len, d, dtype, *, seed=0, mask=False, pool=0, lengths_zero=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = pool or n
    q = torch.randn(n, q_len, h, d, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
    cache = torch.randn(rows, h, k_len, 2 * d, device="cuda", dtype=dtype, generator=g)
    lengths = torch.randint(k_len // 2, k_len + 1, (n,), device="cuda", dtype=torch.int32, generator=g)
    if lengths_zero and n > 1:
        lengths[1] = 0
    m = (torch.rand(n, q_len, k_len, device="cuda", generator=g) > 0.2) if mask else None
    rows_t = (torch.randint(0, rows, (n,), device="cuda", dtype=torch.int32, generator=g) if pool else None)
    return dict(q=q, k=cache[..., :d], v=cache[..., d:], key_lengths=lengths, mask=m, kv_rows=rows_t)


def _gpu_check(a, dtype, precision, config=None, launch=None):
    """Run ``launch`` (default the Triton launcher) into a NaN-poisoned out, check the docs/design.md §6 oracle."""
    from torch_cfm.kernels.cfm_attention import cfm_attention_triton

    n, h, q_len, d = a["q"].shape
    out = torch.full((n, q_len, h, d), float("nan"), device="cuda", dtype=dtype).transpose(1, 2)
    (launch or cfm_attention_triton)(a["q"], a["k"], a["v"], a["key_lengths"], a["mask"], a["kv_rows"], precision, out,
                         config=config)
    torch.cuda.synchronize()
    cpu = {k: (v.cpu() if v is not None else None) for k, v in a.items()}
    ref64 = naive_attention64(cpu["q"], cpu["k"], cpu["v"], cpu["key_lengths"], cpu["mask"], cpu["kv_rows"])
    out_c = out.cpu()
    assert torch.isfinite(out_c).all()
    rel = err_rel_fro(out_c, ref64)
    if dtype == torch.float32:
        assert rel <= (IEEE_REL_BOUND if precision == "ieee" else TF32_REL_BOUND), rel
        if precision == "ieee":
            same = cfm_attention_reference(cpu["q"], cpu["k"], cpu["v"], cpu["key_lengths"], cpu["mask"],
                                           cpu["kv_rows"], compute_dtype=torch.float32)
            assert_within_oracle(out_c, same, ref64)
    else:
        same = cfm_attention_reference(a["q"], a["k"], a["v"], a["key_lengths"], a["mask"], a["kv_rows"],
                                       compute_dtype=dtype).cpu()
        assert_within_oracle(out_c, same, ref64)
    empty = ref64.abs().amax(dim=-1) == 0
    assert (out_c.double().abs().amax(dim=-1)[empty] == 0).all()
    return rel


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,precision", _GPU_DTYPES, ids=["f16", "bf16", "f32-tf32", "f32-ieee"])
@pytest.mark.parametrize("shape", [(2, 8, 50, 450), (8, 8, 50, 450), (16, 8, 150, 524), (2, 2, 300, 300)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gpu_default_config(dtype, precision, shape):
    n, h, q_len, k_len = shape
    small = n * h <= 16  # the small shapes also exercise mask + pool rows through the default config
    a = _gpu_inputs(n, h, q_len, k_len, 64, dtype, mask=small, pool=n + 1 if small else 0)
    _gpu_check(a, dtype, precision)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,precision", _GPU_DTYPES, ids=["f16", "bf16", "f32-tf32", "f32-ieee"])
@pytest.mark.parametrize("d,k_len", [(16, 300), (32, 300), (128, 300), (64, 2100)], ids=["D16", "D32", "D128", "K2100"])
def test_gpu_default_config_head_dims_and_long_keys(dtype, precision, d, k_len):
    """choose_config's other head dims (untimed tiles) and its split-K path for long key ranges."""
    from torch_cfm.kernels.cfm_attention import choose_config

    a = _gpu_inputs(2, 2, 20, k_len, d, dtype, mask=True, pool=3, seed=k_len + d)
    if k_len >= 2048:
        assert choose_config(dtype, d, 4, 20, k_len, 132, precision).splits > 1
    _gpu_check(a, dtype, precision)


# Explicit launch configs (AttentionConfig fields, positional). Every config runs at D = 64 and 128
# (register/shared-memory pressure); the three the heuristic picks (or resembles) at D = 16 and 32
# too: each config × D is a separate compile, the bulk of this file's GPU time.
_VARIANTS = [(16, 64, 1), (32, 32, 3), (64, 64, 4), (16, 128, 2), (64, 32, 8),
             (64, 64, 1, 4, 3, True, "tf32x3", True), (32, 64, 2, 4, 3, True, "tf32x3", False),
             (64, 64, 2, 4, 3, True, "tf32x3", True, "last"), (32, 64, 3, 4, 2, True, "tf32x3", False, "last")]
_ALL_HEAD_DIMS = {_VARIANTS[5], _VARIANTS[6], _VARIANTS[7]}


def _variant_id(c: tuple) -> str:
    return ("q%d_k%d_s%d" % c[:3] + ("" if len(c) < 8 else "_pdl%d" % c[7])
            + ("" if len(c) < 9 else "_" + c[8]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,precision", _GPU_DTYPES, ids=["f16", "bf16", "f32-tf32", "f32-ieee"])
@pytest.mark.parametrize("config,d", [(c, d) for c in _VARIANTS
                                      for d in ((16, 32, 64, 128) if c in _ALL_HEAD_DIMS else (64, 128))],
                         ids=lambda v: _variant_id(v) if isinstance(v, tuple) else f"D{v}")
def test_gpu_variants(dtype, precision, config, d):
    from torch_cfm.kernels.cfm_attention import AttentionConfig

    stages = config[4] if len(config) > 4 else 2
    smem = (2 * config[1] * stages + config[0]) * d * 4  # fp32 K and V tiles per stage, plus q
    if dtype == torch.float32 and (d * config[1] >= 128 * 128 or smem > 216 * 1024):
        # e.g. 64-query, 64-key, 3-stage tiles at D = 128 need 240-256 KiB (H200)
        pytest.skip("fp32 tiles exceed shared memory (choose_config never picks them)")
    a = _gpu_inputs(3, 2, 37, 300, d, dtype, mask=True, pool=5, seed=d)
    _gpu_check(a, dtype, precision, AttentionConfig(*config))


@pytest.mark.gpu
def test_gpu_graph_replay_matches_eager():
    from torch_cfm.kernels.cfm_attention import cfm_attention_triton

    a = _gpu_inputs(8, 8, 50, 450, 64, torch.float16)
    out = torch.empty(8, 50, 8, 64, device="cuda", dtype=torch.float16).transpose(1, 2)
    args = (a["q"], a["k"], a["v"], a["key_lengths"], None, None, None, out)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        cfm_attention_triton(*args)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cfm_attention_triton(*args)
    b = _gpu_inputs(8, 8, 50, 450, 64, torch.float16, seed=7)
    for name in ("q", "k", "v", "key_lengths"):
        a[name].copy_(b[name])
    graph.replay()
    torch.cuda.synchronize()
    fresh = torch.empty_like(out)
    cfm_attention_triton(a["q"], a["k"], a["v"], a["key_lengths"], None, None, None, fresh)
    assert torch.equal(out, fresh)


def _counters_idle() -> bool:
    """Every arrival counter handed out so far is back at zero (launches done)."""
    from torch_cfm.kernels.cfm_attention import COUNTERS

    torch.cuda.synchronize()
    bufs = list(COUNTERS._eager.values()) + [p for p, _ in COUNTERS._pool.values()] + COUNTERS._retired
    return all(int(b.abs().sum()) == 0 for b in bufs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,precision", _GPU_DTYPES[:1] + _GPU_DTYPES[2:3], ids=["f16", "f32-tf32"])
def test_gpu_last_merge_graph_replays_with_new_inputs(dtype, precision):
    """merge="last": two launches captured in one graph (each with counters of its own), replayed
    three times with new inputs and lengths == fresh eager calls, bitwise; counters end at zero."""
    from torch_cfm.kernels.cfm_attention import AttentionConfig, cfm_attention_triton

    cfg = AttentionConfig(64 if dtype != torch.float32 else 32, 64, 2, 4, 3, merge="last")
    a = _gpu_inputs(8, 8, 50, 450, 64, dtype, mask=True)
    outs = [torch.empty(8, 50, 8, 64, device="cuda", dtype=dtype).transpose(1, 2) for _ in range(2)]

    def both(o0, o1):
        cfm_attention_triton(a["q"], a["k"], a["v"], a["key_lengths"], a["mask"], None, precision, o0, config=cfg)
        cfm_attention_triton(a["q"], a["k"], a["v"], a["key_lengths"], None, None, precision, o1, config=cfg)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        both(*outs)  # eager warm-up: compiles, creates the counter pool
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        both(*outs)
    for seed in (3, 4, 5):
        b = _gpu_inputs(8, 8, 50, 450, 64, dtype, mask=True, seed=seed)
        for name in ("q", "k", "v", "key_lengths", "mask"):
            a[name].copy_(b[name])
        graph.replay()
        fresh = [torch.empty_like(o) for o in outs]
        both(*fresh)
        torch.cuda.synchronize()
        assert torch.equal(outs[0], fresh[0]) and torch.equal(outs[1], fresh[1])
    _gpu_check(a, dtype, precision, cfg)
    assert _counters_idle()


@pytest.mark.gpu
def test_gpu_last_merge_two_streams_and_capture_fallback(monkeypatch):
    """Concurrent eager launches on two streams use separate counters; a capture that finds the
    counter pool used up falls back to the combine kernel, with the same result."""
    from torch_cfm.kernels import cfm_attention as mod

    cfg = mod.AttentionConfig(64, 64, 2, 4, 3, merge="last")
    inputs = [_gpu_inputs(8, 8, 50, 450, 64, torch.float16, seed=s) for s in (11, 12)]
    outs = [torch.empty(8, 50, 8, 64, device="cuda", dtype=torch.float16).transpose(1, 2) for _ in range(2)]
    streams = [torch.cuda.Stream() for _ in range(2)]
    for st in streams:
        st.wait_stream(torch.cuda.current_stream())
    for _ in range(20):  # interleaved launches: without per-stream counters tiles would miss merges
        for a, o, st in zip(inputs, outs, streams):
            with torch.cuda.stream(st):
                mod.cfm_attention_triton(a["q"], a["k"], a["v"], a["key_lengths"], None, None, None, o, config=cfg)
    torch.cuda.synchronize()
    for a, o in zip(inputs, outs):
        ref = torch.empty_like(o)
        mod.cfm_attention_triton(a["q"], a["k"], a["v"], a["key_lengths"], None, None, None, ref,
                                 config=mod.AttentionConfig(64, 64, 1, 4, 3))
        torch.testing.assert_close(o, ref, atol=2e-3, rtol=0)
    assert _counters_idle()

    a, out = inputs[0], outs[0]
    mod.cfm_attention_triton(a["q"], a["k"], a["v"], a["key_lengths"], None, None, None, out,
                             config=mod.AttentionConfig(64, 64, 2, 4, 3))  # compiles the combine kernel
    torch.cuda.synchronize()
    monkeypatch.setattr(mod.COUNTERS, "reserve_for_capture", lambda device, n: None)
    combine_launches = []
    real = mod._cfm_attention_combine_kernel
    monkeypatch.setattr(mod, "_cfm_attention_combine_kernel",
                        type("Spy", (), {"__getitem__": lambda self, grid: combine_launches.append(grid) or real[grid]})())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mod.cfm_attention_triton(a["q"], a["k"], a["v"], a["key_lengths"], None, None, None, out, config=cfg)
    graph.replay()
    eager = torch.empty_like(out)
    mod.cfm_attention_triton(a["q"], a["k"], a["v"], a["key_lengths"], None, None, None, eager, config=cfg)
    torch.cuda.synchronize()
    assert len(combine_launches) == 1, "the capture without counters must use the combine kernel"
    torch.testing.assert_close(out, eager, atol=2e-3, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,precision", _GPU_DTYPES[:1] + _GPU_DTYPES[2:3], ids=["f16", "f32-tf32"])
def test_gpu_no_host_sync(dtype, precision):
    from torch_cfm.kernels.cfm_attention import cfm_attention_triton

    a = _gpu_inputs(8, 8, 50, 450, 64, dtype, mask=True)
    out = torch.empty(8, 50, 8, 64, device="cuda", dtype=dtype).transpose(1, 2)
    cfm_attention_triton(a["q"], a["k"], a["v"], a["key_lengths"], a["mask"], None, precision, out)  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cfm_attention_triton(a["q"], a["k"], a["v"], a["key_lengths"], a["mask"], None, precision, out)
    finally:
        torch.cuda.set_sync_debug_mode("default")


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--child":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run the child with TRITON_INTERPRET=1")
    _run_child(sys.argv[2], sys.argv[3])
