"""The body's tuning table (:mod:`torch_cfm.kernels.body_plans`): the plan each (dtype, dot precision,
rows) gets, written out by hand from the dispatch rule it replaced, with and without the wgmma kernel."""

import dataclasses
import json
import os
import re

import pytest
import torch

from torch_cfm.kernels import body_plans as bp

ROWS = (2, 8, 16, 31, 32, 64, 128, bp.WGMMA_MAX_ROWS, bp.WGMMA_MAX_ROWS + 1)
FAMILIES = {"fp16": (torch.float16, None), "bf16": (torch.bfloat16, None), "tf32": (torch.float32, "tf32"),
            "ieee": (torch.float32, "ieee")}


def _expected(family: str, rows: int, wgmma: bool, arena: bool) -> str:
    """The dispatch of the body before the table: 16-bit bodies v5 at >= 32 rows (on the arena v1w:
    v1 with a one-warp row-norm launch), v9 at <= 8 rows, else v1; TF32 bodies v9 at <= 8 rows, else
    v1; IEEE bodies v1; v9 is v1 call for call where the wgmma kernel cannot run."""
    if family in ("fp16", "bf16"):
        name = "v5" if rows >= 32 else "v9" if rows <= 8 else "v1"
    elif family == "tf32":
        name = "v9" if rows <= 8 else "v1"
    else:
        name = "v1"
    if arena and name == "v5":
        name = "v1w"
    if name == "v9" and not wgmma:
        name = "v1"
    return name


def test_wgmma_rows_bound_is_eight():
    assert bp.WGMMA_MAX_ROWS == 8


@pytest.mark.parametrize("arena", [False, True], ids=["functional", "arena"])
@pytest.mark.parametrize("wgmma", [True, False], ids=["wgmma", "no-wgmma"])
@pytest.mark.parametrize("family", FAMILIES)
def test_table_reproduces_the_dispatch(family, wgmma, arena):
    dtype, precision = FAMILIES[family]
    v1 = bp.body_plan(dtype, precision, 9 if family != "ieee" else 2)
    assert v1.name == "v1"
    for rows in ROWS:
        plan = bp.resolve_plan(bp.body_plan(dtype, precision, rows, arena=arena), wgmma=wgmma)
        want = _expected(family, rows, wgmma, arena)
        assert plan.name == want, (family, rows, wgmma, arena, plan.name)
        if not arena:
            assert bp.choose_variant(dtype, precision, rows) == _expected(family, rows, True, False)
        if want == "v1":  # v1 of the dtype family, field for field: v9's fallback is exactly v1
            assert plan == v1, (family, rows)
        if want == "v1w":  # v1 but for the row-norm launch
            assert plan.rownorm_launch == (1, 1)
            assert dataclasses.replace(plan, name="v1", rownorm_launch=None, evidence=v1.evidence) == v1
    # rows unknown: the family's v1
    assert bp.choose_variant(dtype, precision) == "v1"
    assert bp.body_plan(dtype, precision) == v1


def _assert_cited_rows_exist(plan):
    """Every (variant, commit) an evidence string cites is a row of the data file it names."""
    path, _, text = plan.evidence.partition(" ")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, path)) as f:
        rows = json.load(f)
    present = {(r.get("variant") or "", str(r.get("commit", ""))[:7]) for r in rows}
    variants = {v for v, _ in present}
    for name in re.findall(r"\b(sweep_[a-z0-9_]+|v\d)\b", text):
        if name.endswith("_") or name.endswith("_*"):
            continue
        assert name in variants or name in ("v1", "v5", "v9"), (plan.name, name)
    for commit in re.findall(r"\(([0-9a-f]{7})\)", text):
        assert any(c == commit for _, c in present), (plan.name, commit)


def test_plans_name_their_roles_and_evidence():
    for family, entries in bp.TABLE.items():
        plans = [p for _, _, p in entries] + [p.arena_plan for _, _, p in entries if p.arena_plan is not None]
        for plan in plans:
            assert plan.evidence.startswith("bench/"), (family, plan.name)
            _assert_cited_rows_exist(plan)
        for lo, hi, plan in entries:
            assert lo <= hi
            for role in ("qkv", "attention", "proj", "conv", "fc1", "fc2", "rownorm", "arena_qkv"):
                assert getattr(plan, role) in bp.ROLE_KERNELS[role], (plan.name, role)
            assert plan.pdl <= bp.PDL_CAPABLE_KERNELS
        # the buckets cover every row count without overlap
        spans = sorted((lo, hi) for lo, hi, _ in entries)
        assert spans[0][0] == 0 and spans[-1][1] == bp.ANY_ROWS
        assert all(a[1] + 1 == b[0] for a, b in zip(spans, spans[1:]))


def test_v9_plans_differ_from_v1_only_in_gemms_pdl_and_arena_epilogue():
    v9, v1 = bp.body_plan(torch.float16, None, 8), bp.body_plan(torch.float16, None, 16)
    assert (v9.qkv, v9.proj, v9.conv, v9.fc1, v9.fc2, v9.arena_qkv) == (
        "wgmma", "wgmma", "wgmma", "wgmma_gelu", "wgmma_splitk", "wgmma_qk_cache")
    assert v9.pdl == {"linear", "rownorm", "qk_cache"} and v1.pdl == frozenset()
    assert dataclasses.replace(v9, name="v1", qkv="cublas", proj="cublas", conv="cublas", fc1="cublas_gelu",
                               fc2="cublas", arena_qkv="qk_cache", pdl=frozenset(), fallback=None,
                               evidence=v1.evidence) == v1
    tf = bp.body_plan(torch.float32, "tf32", 8)
    assert tf.arena_qkv == "qk_cache" and tf.fc2 == "wgmma_splitk"
    assert bp.body_plan(torch.float32, "ieee", 8).pdl == {"rownorm", "cfg_euler"}


def test_named_plans_and_bad_names():
    assert bp.named_plan("v5", torch.float32, "ieee").attention == "attention_cache"
    assert bp.named_plan("v9", torch.float16, None) == bp.body_plan(torch.float16, None, 8)
    plan = bp.body_plan(torch.float16, None, 64)
    assert bp.named_plan(plan, torch.float16, None) is plan
    with pytest.raises(ValueError, match="plan"):
        bp.named_plan("v4", torch.float16, None)
    with pytest.raises(ValueError, match="plan"):
        bp.named_plan("v9", torch.float32, "ieee")


def test_pdl_of_a_plan():
    pytest.importorskip("triton")
    from torch_cfm.kernels._launch import plan_pdl

    v1_32 = bp.body_plan(torch.float32, "tf32", 64)
    assert plan_pdl(v1_32, "rownorm", torch.device("cpu")) is False  # no PDL on CPU
    with pytest.raises(AssertionError):
        plan_pdl(v1_32, "rownrom", torch.device("cpu"))


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
    assert plan_for(x16, None) == bp.V5_16BIT
    assert plan_for(x16, None, arena=True) == bp.V1W_16BIT
    assert plan_for(x8, None) == bp.V1_16BIT  # v9 without the wgmma kernel (CPU): v1, call for call
    assert plan_for(x8, None, "v5") == bp.V5_16BIT
    with pytest.raises(ValueError, match="arena"):
        plan_for(x16, None, "v5", arena=True)
    with bp.use_plan("v5"):
        assert plan_for(x8, None) == bp.V5_16BIT
        assert plan_for(x8, None, arena=True) == bp.V1W_16BIT  # a scoped plan without an arena form: its arena plan
        assert plan_for(x8, None, "v1") == bp.V1_16BIT  # an explicit plan wins
        with bp.use_plan(bp.V1_16BIT):
            assert plan_for(x16, None) == bp.V1_16BIT
        assert plan_for(x16, None) == bp.V5_16BIT
    assert bp.scoped_plan() is None
    with pytest.raises(ValueError, match="plan"):
        plan_for(torch.zeros(2, 320, 5), "ieee", "v9")


def test_describe_table_names_each_bucket_and_arena_plan():
    text = bp.describe_table()
    assert "fp16: 0-8 v9, 9-31 v1, 32+ v5 (arena v1w)" in text
    assert "tf32: 0-8 v9, 9+ v1" in text and "ieee: 0+ v1" in text
