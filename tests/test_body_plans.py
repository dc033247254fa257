"""The body's tuning table (:mod:`torch_cfm.kernels.body_plans`): the plan each (dtype, dot precision,
rows) gets, written out by hand from the dispatch rule it replaced, with and without the wgmma kernel;
every plan's evidence resolves to rows of bench/results/dit_step.json that support it."""

import dataclasses
import json
import os

import pytest
import torch

from torch_cfm.kernels import body_plans as bp

ROWS = (2, 8, 16, 31, 32, 64, 127, 128, 256, bp.WGMMA_MAX_ROWS, bp.WGMMA_MAX_ROWS + 1)
FAMILIES = {"fp16": (torch.float16, None), "bf16": (torch.bfloat16, None), "tf32": (torch.float32, "tf32"),
            "ieee": (torch.float32, "ieee")}


def _expected(family: str, rows: int, wgmma: bool, arena: bool) -> str:
    """The dispatch of the body before the table: 16-bit bodies fused_attention at >= 32 rows (on the
    arena cublas_warp_rownorm: cublas with a one-warp row-norm launch; from 128 rows cutlass_warp_rownorm,
    its GEMMs but fc1 on the CUTLASS library), wgmma at <= 8 rows, else
    cublas; TF32 bodies wgmma at <= 8 rows, else cublas; IEEE bodies cublas; wgmma is cublas call for
    call where the wgmma kernel cannot run."""
    if family in ("fp16", "bf16"):
        name = "fused_attention" if rows >= 32 else "wgmma" if rows <= 8 else "cublas"
    elif family == "tf32":
        name = "wgmma" if rows <= 8 else "cublas"
    else:
        name = "cublas"
    if arena and name == "fused_attention":
        name = "cutlass_warp_rownorm" if rows >= 128 else "cublas_warp_rownorm"
    if name == "wgmma" and not wgmma:
        name = "cublas"
    return name


def test_wgmma_rows_bound_is_eight():
    assert bp.WGMMA_MAX_ROWS == 8


@pytest.mark.parametrize("arena", [False, True], ids=["functional", "arena"])
@pytest.mark.parametrize("wgmma", [True, False], ids=["wgmma", "no-wgmma"])
@pytest.mark.parametrize("family", FAMILIES)
def test_table_reproduces_the_dispatch(family, wgmma, arena):
    dtype, precision = FAMILIES[family]
    cublas = bp.body_plan(dtype, precision, 9 if family != "ieee" else 2)
    assert cublas.name == "cublas"
    for rows in ROWS:
        plan = bp.resolve_plan(bp.body_plan(dtype, precision, rows, arena=arena), wgmma=wgmma)
        want = _expected(family, rows, wgmma, arena)
        assert plan.name == want, (family, rows, wgmma, arena, plan.name)
        if not arena:
            assert bp.choose_variant(dtype, precision, rows) == _expected(family, rows, True, False)
        if want == "cublas":  # cublas of the dtype family, field for field: wgmma's fallback is exactly cublas
            assert plan == cublas, (family, rows)
        if want == "cublas_warp_rownorm":  # cublas but for the row-norm launch
            assert plan.rownorm_launch == (1, 1)
            assert dataclasses.replace(plan, name="cublas", rownorm_launch=None, evidence=cublas.evidence) == cublas
    # rows unknown: the family's cublas
    assert bp.choose_variant(dtype, precision) == "cublas"
    assert bp.body_plan(dtype, precision) == cublas


def _plans_in_use():
    """Every plan a body call can run: the table's, their arena plans and fallbacks, unknown rows'."""
    plans = {}
    todo = [p for entries in bp.TABLE.values() for _, _, p in entries] + list(bp.UNKNOWN_ROWS.values())
    while todo:
        plan = todo.pop()
        if id(plan) not in plans:
            plans[id(plan)] = plan
            todo += [p for p in (plan.arena_plan, plan.fallback) if p is not None]
    return list(plans.values())


def _same_run(a: dict, b: dict) -> bool:
    if a.get("run_id") or b.get("run_id"):
        return a.get("run_id") == b.get("run_id")
    return (a["commit"], a["timestamp"]) == (b["commit"], b["timestamp"])


def test_evidence_rows_resolve_and_support_each_plan():
    """Each plan a body call can run cites (its row, the alternative's row) pairs: both rows exist
    once in the data file, were measured in one run at one shape and dtype without error, and the
    plan's row is the faster."""
    for plan in _plans_in_use():
        assert plan.evidence, plan.name
        rows = bp.evidence_rows(plan)
        assert len(rows) == 2 * len(plan.evidence)
        for (chosen_id, other_id), chosen, other in zip(plan.evidence, rows[::2], rows[1::2]):
            assert bp.row_id(chosen) == chosen_id and bp.row_id(other) == other_id
            assert chosen is not other
            assert _same_run(chosen, other), (plan.name, chosen_id, other_id)
            for key in ("shape", "dtype", "precision", "timing", "gpu"):
                assert chosen[key] == other[key], (plan.name, key, chosen_id, other_id)
            assert not chosen["error"] and not other["error"]
            assert chosen["us_p50"] < other["us_p50"], (plan.name, chosen_id, chosen["us_p50"], other["us_p50"])


def test_every_named_plans_evidence_resolves():
    for plans in bp.NAMED.values():
        for plan in plans.values():
            assert len(bp.evidence_rows(plan)) == 2 * len(plan.evidence)


def test_row_ids_name_exactly_one_row_or_fail():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, bp.EVIDENCE_DATA)) as f:
        rows = json.load(f)
    row = next(r for r in rows if r["provider"] == "torch_cfm" and r["variant"] == "arena")
    assert bp.find_row(rows, bp.row_id(row)) is row
    assert bp.row_id(dict(row, variant="", run_id="20261205T101500Z-3fa2c1")).startswith("dit_step/table/")
    assert bp.row_id(dict(row, run_id="20261205T101500Z-3fa2c1")).endswith("/20261205T101500Z-3fa2c1")
    with pytest.raises(ValueError, match="names 0 rows"):
        bp.find_row(rows, "dit_step/arena/8x50x400/fp16/20000101T000000Z")
    with pytest.raises(ValueError, match="rid"):
        bp.find_row(rows, "dit_step/arena/8x50x400/fp16/2026-12-01")
    twice = [row, dict(row)]
    with pytest.raises(ValueError, match="names 2 rows"):
        bp.find_row(twice, bp.row_id(row))
    with pytest.raises(ValueError, match="evidence"):
        bp.BodyPlan("x", evidence=("dit_step/a/1x2x3/fp16/20261201T000000Z",))
    with pytest.raises(ValueError, match="evidence"):
        bp.BodyPlan("x", evidence=(("dit_step/a/1x2x3/fp16/commit", "dit_step/b/1x2x3/fp16/20261201T000000Z"),))


def test_plans_name_their_roles():
    for family, entries in bp.TABLE.items():
        for lo, hi, plan in entries:
            assert lo <= hi
            for role in ("qkv", "attention", "proj", "conv", "fc1", "fc2", "rownorm", "arena_qkv"):
                assert getattr(plan, role) in bp.ROLE_KERNELS[role], (plan.name, role)
            assert plan.pdl <= bp.PDL_CAPABLE_KERNELS
        # the buckets cover every row count without overlap
        spans = sorted((lo, hi) for lo, hi, _ in entries)
        assert spans[0][0] == 0 and spans[-1][1] == bp.ANY_ROWS
        assert all(a[1] + 1 == b[0] for a, b in zip(spans, spans[1:]))


def test_wgmma_plans_differ_from_cublas_only_in_gemms_pdl_and_arena_epilogue():
    wgmma, cublas = bp.body_plan(torch.float16, None, 8), bp.body_plan(torch.float16, None, 16)
    assert (wgmma.qkv, wgmma.proj, wgmma.conv, wgmma.fc1, wgmma.fc2, wgmma.arena_qkv) == (
        "wgmma", "wgmma", "wgmma", "wgmma_gelu", "wgmma_splitk", "wgmma_qk_cache")
    assert wgmma.pdl == {"linear", "rownorm", "qk_cache"} and cublas.pdl == frozenset()
    assert dataclasses.replace(wgmma, name="cublas", qkv="cublas", proj="cublas", conv="cublas", fc1="cublas_gelu",
                               fc2="cublas", arena_qkv="qk_cache", pdl=frozenset(), fallback=None,
                               evidence=cublas.evidence) == cublas
    tf = bp.body_plan(torch.float32, "tf32", 8)
    assert tf.arena_qkv == "qk_cache" and tf.fc2 == "wgmma_splitk"
    assert bp.body_plan(torch.float32, "ieee", 8).pdl == {"rownorm", "cfg_euler"}


def test_named_plans_and_bad_names():
    assert bp.PLAN_NAMES == ("cublas", "fused_attention", "wgmma")
    assert bp.named_plan("fused_attention", torch.float32, "ieee").attention == "attention_cache"
    assert bp.named_plan("wgmma", torch.float16, None) == bp.body_plan(torch.float16, None, 8)
    plan = bp.body_plan(torch.float16, None, 64)
    assert bp.named_plan(plan, torch.float16, None) is plan
    with pytest.raises(ValueError, match="plan"):
        bp.named_plan("v5", torch.float16, None)
    with pytest.raises(ValueError, match="plan"):
        bp.named_plan("wgmma", torch.float32, "ieee")


def test_fused_attention_arena_plan_is_named_only():
    """fused_attention_warp_rownorm: cublas_warp_rownorm with the fused attention + cache kernel, which
    has an arena form (its APPEND mode); chosen by name only (16-bit families), never by the table."""
    plan = bp.FUSED_ATTENTION_WARP_ROWNORM_16BIT
    for dtype in (torch.float16, torch.bfloat16):
        assert bp.named_plan("fused_attention_warp_rownorm", dtype, None) is plan
    assert plan.attention == "attention_cache" and plan.arena_plan is None and plan.rownorm_launch == (1, 1)
    assert dataclasses.replace(plan, name="cublas_warp_rownorm", attention="qk_cache+cfm_attention",
                               evidence=bp.CUBLAS_WARP_ROWNORM_16BIT.evidence) == bp.CUBLAS_WARP_ROWNORM_16BIT
    assert dataclasses.replace(plan, name="fused_attention", rownorm_launch=None,
                               arena_plan=bp.CUBLAS_WARP_ROWNORM_16BIT,
                               evidence=bp.FUSED_ATTENTION_16BIT.evidence) == bp.FUSED_ATTENTION_16BIT
    assert all(p is not plan for entries in bp.TABLE.values() for _, _, p in entries)
    assert plan not in _plans_in_use() and "fused_attention_warp_rownorm" not in bp.PLAN_NAMES
    for family in ("tf32", "ieee"):
        with pytest.raises(ValueError, match="plan"):
            bp.named_plan("fused_attention_warp_rownorm", *FAMILIES[family])
    # attention_cache does the arena's q/k-cache work itself: no QKV epilogue doing it too
    with pytest.raises(ValueError, match="arena_qkv"):
        dataclasses.replace(plan, arena_qkv="wgmma_qk_cache")


def test_cutlass_plan_is_the_16bit_arena_plan_from_128_rows():
    """cutlass_warp_rownorm: cublas_warp_rownorm with qkv, proj, the conv taps and fc2 on the CUTLASS
    library's pingpong_128x128 config; the 16-bit arena plan from CUTLASS_MIN_ROWS rows, by name
    elsewhere; the functional (non-arena) plan is fused_attention at every row count from 32."""
    plan = bp.CUTLASS_WARP_ROWNORM_16BIT
    assert bp.CUTLASS_MIN_ROWS == 128
    for dtype in (torch.float16, torch.bfloat16):
        assert bp.named_plan("cutlass_warp_rownorm", dtype, None) is plan
        assert bp.body_plan(dtype, None, 128, arena=True) is plan
        assert bp.body_plan(dtype, None, 127, arena=True) is bp.CUBLAS_WARP_ROWNORM_16BIT
        functional = bp.body_plan(dtype, None, 128)
        assert functional.name == "fused_attention" and functional.arena_plan is plan
        assert dataclasses.replace(functional, name="fused_attention",
                                   arena_plan=bp.CUBLAS_WARP_ROWNORM_16BIT) == bp.FUSED_ATTENTION_16BIT
    assert plan.uses_cutlass and plan.cutlass == "pingpong_128x128" and plan.arena_plan is None
    assert plan.roles() == "qkv=cutlass, proj=cutlass, conv=cutlass, fc2=cutlass"
    assert dataclasses.replace(plan, name="cublas_warp_rownorm", qkv="cublas", proj="cublas", conv="cublas",
                               fc2="cublas", cutlass=None,
                               evidence=bp.CUBLAS_WARP_ROWNORM_16BIT.evidence) == bp.CUBLAS_WARP_ROWNORM_16BIT
    assert [p for p in _plans_in_use() if p.uses_cutlass] == [plan]
    for family in ("tf32", "ieee"):
        with pytest.raises(ValueError, match="plan"):
            bp.named_plan("cutlass_warp_rownorm", *FAMILIES[family])
    # the config is named exactly when a role runs on the library
    with pytest.raises(ValueError, match="cutlass"):
        dataclasses.replace(plan, cutlass=None)
    with pytest.raises(ValueError, match="cutlass"):
        bp.BodyPlan("x", cutlass="pingpong_128x128")
    with pytest.raises(ValueError, match="fc1"):
        bp.BodyPlan("x", fc1="cutlass", cutlass="pingpong_128x128")


def test_pdl_of_a_plan():
    pytest.importorskip("triton")
    from torch_cfm.kernels._launch import plan_pdl

    cublas_32 = bp.body_plan(torch.float32, "tf32", 64)
    assert plan_pdl(cublas_32, "rownorm", torch.device("cpu")) is False  # no PDL on CPU
    with pytest.raises(AssertionError):
        plan_pdl(cublas_32, "rownrom", torch.device("cpu"))


def test_plans_are_checked():
    with pytest.raises(ValueError, match="qkv"):
        bp.BodyPlan("x", qkv="triton")
    with pytest.raises(ValueError, match="pdl"):
        bp.BodyPlan("x", pdl=frozenset({"gemm"}))


def test_plan_for_explicit_scoped_and_arena():
    pytest.importorskip("triton")
    from torch_cfm.kernels.dit_body import plan_for

    x16 = torch.zeros(64, 320, 5, dtype=torch.float16)
    x8 = torch.zeros(8, 320, 5, dtype=torch.float16)
    assert plan_for(x16, None) == bp.FUSED_ATTENTION_16BIT
    assert plan_for(x16, None, arena=True) == bp.CUBLAS_WARP_ROWNORM_16BIT
    assert plan_for(x8, None) == bp.CUBLAS_16BIT  # wgmma without the wgmma kernel (CPU): cublas, call for call
    assert plan_for(x8, None, "fused_attention") == bp.FUSED_ATTENTION_16BIT
    with pytest.raises(ValueError, match="arena"):
        plan_for(x16, None, "fused_attention", arena=True)
    with bp.use_plan("fused_attention"):
        assert plan_for(x8, None) == bp.FUSED_ATTENTION_16BIT
        # a scoped plan without an arena form: its arena plan
        assert plan_for(x8, None, arena=True) == bp.CUBLAS_WARP_ROWNORM_16BIT
        assert plan_for(x8, None, "cublas") == bp.CUBLAS_16BIT  # an explicit plan wins
        with bp.use_plan(bp.CUBLAS_16BIT):
            assert plan_for(x16, None) == bp.CUBLAS_16BIT
        assert plan_for(x16, None) == bp.FUSED_ATTENTION_16BIT
    # a plan with an arena form runs there itself, given or scoped
    fused_arena = bp.FUSED_ATTENTION_WARP_ROWNORM_16BIT
    assert plan_for(x16, None, "fused_attention_warp_rownorm", arena=True) == fused_arena
    with bp.use_plan("fused_attention_warp_rownorm"):
        assert plan_for(x16, None, arena=True) == fused_arena and plan_for(x8, None) == fused_arena
    assert bp.scoped_plan() is None
    with pytest.raises(ValueError, match="plan"):
        plan_for(torch.zeros(2, 320, 5), "ieee", "wgmma")


def test_describe_table_names_each_bucket_and_arena_plan():
    text = bp.describe_table()
    assert ("fp16: 0-8 wgmma, 9-31 cublas, 32-127 fused_attention (arena cublas_warp_rownorm), "
            "128+ fused_attention (arena cutlass_warp_rownorm)") in text
    assert "tf32: 0-8 wgmma, 9+ cublas" in text and "ieee: 0+ cublas" in text
