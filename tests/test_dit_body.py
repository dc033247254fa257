"""The fused DiT body (``torch_cfm::dit_body``): reference math, op contract, Triton path, GPU oracle.

* CPU: the op's CPU kernel (reference math on packed weights) against the independent SPEC
  oracle ``tests/dit_oracle.py`` in float64 (ragged rows, every cache); fp32 against the
  docs/design.md §6 oracle with the model's reference path as the same-dtype reference; padded row ==
  solo row; autocast; packing/repacking; ValueErrors; fake metadata; opcheck.
* Triton interpreter (child process, ``TRITON_INTERPRET=1``): the fused driver (every kernel
  variant) in fp32/fp16 on tiny shapes against the fp64 reference (docs/design.md §6), incl. no caches,
  T_n = 0, L = 0, T = 1; on the in-place arena, the shipped plan and the fused attention kernel's arena
  form (fp16/bf16), which writes the arena the shipped plan writes.
* GPU (``gpu`` marker, H200): fused vs the model's reference path for fp16 / bf16 / fp32-tf32 /
  fp32-ieee with ragged rows at the shipped widths (C=512, H=8, D=64; 4 blocks), outputs and
  every cache; the model hook; sync-debug mode.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import sys

import pytest
import torch

from interpreter_child import interpreter_env
import dit_oracle as O
from oracle import IEEE_REL_BOUND, assert_within_oracle, err_rel_fro
from shards import run_shards
from torch_cfm.config import DiTConfig
from torch_cfm.models import random_dit
from torch_cfm.models.fused_forward import dit_forward_chunk_fused, stage_input
from torch_cfm.ops.dit_body import check_dit_body, dit_body
from torch_cfm.packing import clear_packed, modulation_table, pack_dit, packed_for
from torch_cfm.reference.dit_body import dit_body_reference

_HERE = os.path.dirname(os.path.abspath(__file__))
TINY = DiTConfig(hidden=64, depth=2, heads=4, head_dim=16)


def make_inputs(cfg: DiTConfig, n: int, t: int, l_len: int, dtype=torch.float32, seed: int = 0,
                valid=None, cached=None, device="cpu"):
    """Seeded chunk inputs (x, mu, t, spks, cond, cnn, att, valid, cached); caches of scale ~1."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)

    x, mu, cond = r(n, 80, t), r(n, 80, t), r(n, 80, t)
    spks = r(n, 80)
    cnn = r(cfg.depth, n, 2 * cfg.hidden, 2)
    att = r(cfg.depth, n, cfg.heads, l_len, 2 * cfg.head_dim) if l_len else None
    tt = torch.full((n,), 0.37, dtype=torch.float64, device=device)
    v = None if valid is None else torch.tensor(valid, dtype=torch.int32, device=device)
    c = None if cached is None else torch.tensor(cached, dtype=torch.int32, device=device)
    return x, mu, tt, spks, cond, cnn, att, v, c


def valid_parts(vel, cnn, att, valid, cached, t, l_len):
    """Concatenate, per row, the valid velocity frames, the conv cache and the valid att frames."""
    n = vel.shape[0]
    vs, cs, as_ = [], [], []
    for i in range(n):
        tn = t if valid is None else int(valid[i])
        ln = l_len if cached is None else int(cached[i])
        vs.append(vel[i, :, :tn].reshape(-1))
        cs.append(cnn[:, i].reshape(-1))
        as_.append(att[:, i, :, :tn + ln].reshape(-1))
    return torch.cat(vs), torch.cat(cs), torch.cat(as_)


def oracle64(model, inputs):
    x, mu, tt, spks, cond, cnn, att, valid, cached = inputs
    sd = O.to_dtype(model.state_dict())
    d = torch.float64
    vels, cnns, atts = O.batch_chunk(sd, x.double().cpu(), mu.double().cpu(), tt.cpu(), spks.double().cpu(),
                                     cond.double().cpu(), cnn.double().cpu(),
                                     None if att is None else att.to(d).cpu(),
                                     None if valid is None else valid.cpu(), None if cached is None else cached.cpu())
    return (torch.cat([v.reshape(-1) for v in vels]), torch.cat([c.reshape(-1) for c in cnns]),
            torch.cat([a.reshape(-1) for a in atts]))


def _att_rows(att, valid, cached, t, l_len):
    """(depth, H, T_n+L_n, 2D) per row, flattened in the oracle's order."""
    out = []
    for i in range(att.shape[1]):
        tn = t if valid is None else int(valid[i])
        ln = l_len if cached is None else int(cached[i])
        out.append(att[:, i, :, :tn + ln].reshape(-1))
    return torch.cat(out)


RAGGED = [
    dict(n=3, t=7, l_len=5, valid=[7, 3, 0], cached=[5, 2, 4]),
    dict(n=2, t=5, l_len=0, valid=None, cached=None),
    dict(n=2, t=1, l_len=3, valid=[1, 1], cached=[3, 0]),
]


@pytest.mark.parametrize("case", RAGGED, ids=["ragged", "no_cache", "t1"])
def test_reference_body_fp64_matches_independent_oracle(case):
    model = random_dit(TINY, seed=1).double()
    inputs = make_inputs(TINY, case["n"], case["t"], case["l_len"], torch.float64, seed=3,
                         valid=case["valid"], cached=case["cached"])
    x, mu, tt, spks, cond, cnn, att, valid, cached = inputs
    vel, ncnn, natt = dit_forward_chunk_fused(model, x, mu, tt, spks, cond, cnn, att,
                                              valid_lengths=valid, cache_lengths=cached)
    assert vel.dtype == torch.float64 and natt.shape == (2, case["n"], 4, case["t"] + case["l_len"], 32)
    ref_v, ref_c, ref_a = oracle64(model, inputs)
    got_v, got_c, _ = valid_parts(vel, ncnn, natt, valid, cached, case["t"], case["l_len"])
    got_a = _att_rows(natt, valid, cached, case["t"], case["l_len"])
    assert ref_v.abs().max() > 0.1  # never compare zeros
    torch.testing.assert_close(got_v, ref_v, rtol=0, atol=1e-10)
    torch.testing.assert_close(got_c, ref_c, rtol=0, atol=1e-10)
    torch.testing.assert_close(got_a, ref_a, rtol=0, atol=1e-10)
    # frames after T_n + L_n are zero padding
    for i in range(case["n"]):
        tn = case["t"] if valid is None else int(valid[i])
        ln = case["l_len"] if cached is None else int(cached[i])
        assert (natt[:, i, :, tn + ln:] == 0).all()


def test_reference_body_residual_rounding():
    """``dit_body_reference(residual=...)`` rounds the residual stream after each update: a float64
    body kept in float64 is the default bitwise, in float32 it moves by float32 rounding (about 1e-7),
    in fp16 by fp16 rounding (about 1e-3), each against the default float64 body."""
    model = random_dit(TINY, seed=1).double()
    x, mu, tt, spks, cond, cnn, att, valid, cached = make_inputs(TINY, 3, 7, 5, torch.float64, seed=3,
                                                                 valid=[7, 3, 0], cached=[5, 2, 4])
    packed = pack_dit(model, torch.float64, "cpu")
    args = (stage_input(x, mu, spks, cond, torch.float64), packed.body, modulation_table(packed, tt[:1]), cnn, att,
            valid, cached)
    exact = dit_body_reference(*args)[0]
    assert torch.equal(dit_body_reference(*args, residual=torch.float64)[0], exact)
    err32 = err_rel_fro(dit_body_reference(*args, residual=torch.float32)[0], exact)
    err16 = err_rel_fro(dit_body_reference(*args, residual=torch.float16)[0], exact)
    assert 1e-9 < err32 < 1e-6 and 1e-5 < err16 < 1e-2, (err32, err16)


def test_fp32_op_within_oracle_vs_model_reference():
    case = RAGGED[0]
    model = random_dit(TINY, seed=2)
    inputs = make_inputs(TINY, case["n"], case["t"], case["l_len"], seed=4, valid=case["valid"],
                         cached=case["cached"])
    x, mu, tt, spks, cond, cnn, att, valid, cached = inputs
    fast = dit_forward_chunk_fused(model, x, mu, tt, spks, cond, cnn, att, valid_lengths=valid, cache_lengths=cached)
    same = model.forward_chunk(x, mu, tt, spks, cond, cnn, att, valid_lengths=valid, cache_lengths=cached, fused=False)
    ref = oracle64(random_dit(TINY, seed=2), inputs)
    f_parts = valid_parts(*fast, valid, cached, case["t"], case["l_len"])[:2] + (_att_rows(fast[2], valid, cached, 7, 5),)
    s_parts = valid_parts(*same, valid, cached, case["t"], case["l_len"])[:2] + (_att_rows(same[2], valid, cached, 7, 5),)
    for name, f, s, r in zip(("velocity", "cnn_cache", "att_cache"), f_parts, s_parts, ref):
        assert_within_oracle(f, s, r, name)
        assert err_rel_fro(f, r) <= IEEE_REL_BOUND, name


def test_padded_row_equals_solo_row_and_leaves_others():
    model = random_dit(TINY, seed=5).double()
    x, mu, tt, spks, cond, cnn, att, valid, cached = make_inputs(TINY, 3, 6, 4, torch.float64, seed=6,
                                                                 valid=[6, 2, 4], cached=[4, 1, 0])
    full = dit_forward_chunk_fused(model, x, mu, tt, spks, cond, cnn, att, valid_lengths=valid, cache_lengths=cached)
    for i in range(3):
        tn, ln = int(valid[i]), int(cached[i])
        solo = dit_forward_chunk_fused(model, x[i:i + 1, :, :tn], mu[i:i + 1, :, :tn], tt[i:i + 1], spks[i:i + 1],
                                       cond[i:i + 1, :, :tn], cnn[:, i:i + 1], att[:, i:i + 1, :, :ln])
        torch.testing.assert_close(full[0][i, :, :tn], solo[0][0], rtol=0, atol=1e-12)
        torch.testing.assert_close(full[1][:, i], solo[1][:, 0], rtol=0, atol=1e-12)
        torch.testing.assert_close(full[2][:, i, :, :tn + ln], solo[2][:, 0], rtol=0, atol=1e-12)
    # changing row 2's inputs (incl. its padding) leaves rows 0 and 1 unchanged
    x2, att2 = x.clone(), att.clone()
    x2[2] += 1.0
    att2[:, 2] = -att2[:, 2]
    other = dit_forward_chunk_fused(model, x2, mu, tt, spks, cond, cnn, att2, valid_lengths=valid, cache_lengths=cached)
    for a, b in zip(full, other):
        rows = (slice(None), slice(0, 2)) if a.dim() >= 4 else (slice(0, 2),)
        torch.testing.assert_close(a[rows], b[rows], rtol=0, atol=1e-12)


def test_autocast_follows_ambient_dtype_cpu():
    model = random_dit(TINY, seed=7)
    x, mu, tt, spks, cond, cnn, att, valid, cached = make_inputs(TINY, 2, 5, 3, seed=8, valid=[5, 2], cached=[3, 1])
    packed = pack_dit(model, torch.float32, "cpu")
    x_in = stage_input(x, mu, spks, cond, torch.float32)
    table = modulation_table(packed, tt[:1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = torch.ops.torch_cfm.dit_body(x_in, packed.body, table, cnn, att, valid, cached, "auto")
    direct = dit_body(x_in.bfloat16(), [w.bfloat16() for w in packed.body], table, cnn.bfloat16(), att.bfloat16(),
                      valid_lengths=valid, cache_lengths=cached)
    for a, b in zip(got, direct):
        assert a.dtype == torch.bfloat16
        assert torch.equal(a, b)


def test_packing_is_cached_and_repacked_on_change():
    clear_packed()
    model = random_dit(TINY, seed=9)
    p1 = packed_for(model, torch.float32, "cpu")
    assert packed_for(model, torch.float32, "cpu") is p1
    p16 = packed_for(model, torch.float16, "cpu")
    assert p16 is not p1 and p16.body[0].dtype == torch.float16
    with torch.no_grad():
        model.blocks[1].mlp.fc2.weight.mul_(2.0)
    p2 = packed_for(model, torch.float32, "cpu")
    assert p2 is not p1
    w = model.blocks[1].mlp.fc2.weight
    assert torch.equal(p2.body[2 + 18 + 16], w)
    # conv taps: row k*C + o of the packed weight is W[o, :, k]
    wc = model.blocks[0].conv.block[1].weight
    assert torch.equal(p2.body[2 + 8][2 * 64 + 5], wc[5, :, 2])
    # the table matches the model's own modulation_table (one row's time)
    table = modulation_table(p2, torch.tensor([0.25]))
    torch.testing.assert_close(table[0], model.modulation_table(0.25), rtol=1e-5, atol=1e-5)


def test_packing_sees_every_kind_of_parameter_change(monkeypatch):
    """The cache hit path reads each parameter slot without walking the module tree; every way of
    changing a weight still gives a fresh pack, and a hit never walks the tree again."""
    from torch_cfm import packing

    clear_packed()
    model = random_dit(TINY, seed=12)
    fc2 = lambda p: p.body[2 + 18 + 16]  # noqa: E731  block 1's fc2 weight in the pack
    p = packed_for(model, torch.float32, "cpu")
    walks = {"n": 0}
    slots = packing._slots
    monkeypatch.setattr(packing, "_slots", lambda m: walks.__setitem__("n", walks["n"] + 1) or slots(m))
    torch.nn.Linear(2, 2)  # registrations elsewhere bump the epoch: one walk, still a hit
    assert packed_for(model, torch.float32, "cpu") is p and walks["n"] == 1
    assert packed_for(model, torch.float32, "cpu") is p and walks["n"] == 1  # a hit: no walk

    def changed(mutate):
        nonlocal p
        with torch.no_grad():
            mutate(model.blocks[1].mlp)
        new = packed_for(model, torch.float32, "cpu")
        assert new is not p
        assert torch.equal(fc2(new), model.blocks[1].mlp.fc2.weight)
        p = new

    changed(lambda mlp: mlp.fc2.weight.add_(1.0))  # in place: version counter
    changed(lambda mlp: setattr(mlp.fc2, "weight", torch.nn.Parameter(torch.randn(64, 256))))
    changed(lambda mlp: mlp.fc2._parameters.__setitem__("weight", torch.nn.Parameter(torch.randn(64, 256))))
    changed(lambda mlp: setattr(mlp.fc2.weight, "data", torch.randn(64, 256)))  # new storage, same Parameter
    changed(lambda mlp: setattr(mlp, "fc2", torch.nn.Linear(256, 64)))  # a new submodule
    p16 = packed_for(model.half(), torch.float16, "cpu")
    assert p16.body[0].dtype == torch.float16 and torch.equal(fc2(p16), model.blocks[1].mlp.fc2.weight)
    assert packed_for(model, torch.float16, "cpu") is p16
    del model.blocks[1].mlp.fc2.weight  # a weight gone: never a stale pack
    with pytest.raises((ValueError, KeyError)):
        packed_for(model, torch.float16, "cpu")


def _sample(dtype=torch.float32, l_len=3):
    model = random_dit(TINY, seed=10)
    packed = pack_dit(model, dtype, "cpu")
    x, mu, tt, spks, cond, cnn, att, valid, cached = make_inputs(TINY, 2, 4, l_len, dtype, seed=11,
                                                                 valid=[4, 2], cached=[l_len, 1] if l_len else None)
    x_in = stage_input(x, mu, spks, cond, dtype)
    table = modulation_table(packed, tt)
    return (x_in, packed.body, table, cnn, att, valid, cached, "auto")


def test_fake_kernel_metadata_matches_real():
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _sample()
    real = torch.ops.torch_cfm.dit_body.default(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fargs = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else
                 ([mode.from_tensor(w) for w in a] if isinstance(a, list) else a) for a in args]
        fake = torch.ops.torch_cfm.dit_body.default(*fargs)
    for r, f in zip(real, fake):
        assert r.shape == f.shape and r.dtype == f.dtype and r.stride() == f.stride()


def test_opcheck_cpu():
    args = _sample()
    torch.library.opcheck(torch.ops.torch_cfm.dit_body.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.parametrize("bad", ["x_rank", "table_shape", "len_dtype", "weight_dtype", "precision", "att_heads"])
def test_value_errors_name_the_argument(bad):
    from torch._subclasses.fake_tensor import FakeTensorMode

    x_in, w, table, cnn, att, valid, cached, prec = _sample()
    if bad == "x_rank":
        x_in, arg = x_in[0], "x_in"
    elif bad == "table_shape":
        table, arg = table[:, :1], "mod_table"
    elif bad == "len_dtype":
        valid, arg = valid.long(), "valid_lengths"
    elif bad == "weight_dtype":
        w, arg = [w[0].double()] + list(w[1:]), "weights[0]"
    elif bad == "precision":
        prec, arg = "fp8", "precision"
    else:
        att, arg = att[:, :, :2], "att_cache"
    with pytest.raises(ValueError, match=re.escape(f"dit_body: {arg} must")):
        dit_body(x_in, w, table, cnn, att, valid_lengths=valid, cache_lengths=cached, precision=prec)
    with FakeTensorMode(allow_non_fake_inputs=True):
        with pytest.raises(ValueError, match="dit_body: "):
            check_dit_body(x_in, w, table, cnn, att, valid, cached, prec)


# --------------------------------------------------------------------------------------------
# Triton interpreter: the fused driver itself (child process)
# --------------------------------------------------------------------------------------------

_INTERP_BASE = [
    dict(name="ragged_f32", dtype=torch.float32, n=3, t=7, l_len=5, valid=[7, 3, 0], cached=[5, 2, 4]),
    dict(name="nocache_f32", dtype=torch.float32, n=2, t=5, l_len=0, valid=None, cached=None, no_cnn=True),
    dict(name="t1_f32", dtype=torch.float32, n=2, t=1, l_len=3, valid=[1, 0], cached=[3, 3]),
    dict(name="ragged_f16", dtype=torch.float16, n=2, t=6, l_len=4, valid=[6, 4], cached=[4, 2]),
    dict(name="rowtable_f32", dtype=torch.float32, n=3, t=5, l_len=3, valid=[5, 2, 4], cached=[3, 0, 2],
         per_row_t=True),
    dict(name="nokeys_row_f32", dtype=torch.float32, n=2, t=4, l_len=3, valid=[4, 0], cached=[3, 0]),
]
# The plans by name (torch_cfm.kernels.body_plans.NAMED); wgmma runs as cublas call for call on CPU (no
# wgmma kernel)
VARIANTS = ("cublas", "fused_attention")
INTERP_CASES = [dict(c, name=f"{c['name']}_{v}", variant=v) for v in VARIANTS for c in _INTERP_BASE]
# The shipped widths (C = 512, H = 8, D = 64), one block: the launch rules of the real model
# (e.g. one row per rownorm program), which the tiny config never reaches.
WIDE = DiTConfig(depth=1)
INTERP_CASES += [dict(name=f"wide_f32_{v}", dtype=torch.float32, n=2, t=3, l_len=2, valid=[3, 2], cached=[2, 1],
                      variant=v, wide=True) for v in ("cublas", "fused_attention")]
# fused_attention at the shipped widths in fp16: a 16-query tile over T = 5, a key walk of two 64-frame tiles
INTERP_CASES += [dict(name=f"wide_f16_{v}", dtype=torch.float16, n=2, t=5, l_len=70, valid=[5, 1], cached=[70, 33],
                      variant=v, wide=True) for v in ("fused_attention",)]
# several query tiles per (row, head): only the first writes the cache, every one attends
INTERP_CASES += [dict(name=f"qtiles_f32_{v}", dtype=torch.float32, n=2, t=40, l_len=9, valid=[40, 17],
                      cached=[9, 3], variant=v) for v in ("cublas", "fused_attention")]

# the in-place arena (dit_body_arena_into): the same oracle on its output turned back to SPEC layout
INTERP_CASES += [dict(c, name=f"{c['name']}_arena", variant="cublas", arena=True)
                 for c in _INTERP_BASE if c["name"] in ("ragged_f32", "nocache_f32", "ragged_f16", "nokeys_row_f32")]
INTERP_CASES += [dict(name="wide_f16_arena", dtype=torch.float16, n=2, t=5, l_len=70, valid=[5, 1], cached=[70, 33],
                      variant="cublas", wide=True, arena=True)]
# the arena at >= 32 rows: the shipped plan (cublas_warp_rownorm: q/k-cache APPEND + cfm_attention) and the
# fused attention kernel's APPEND form (fused_attention_warp_rownorm), given explicitly, on the same arenas: ragged
# T_n < T, L_n = 0, a row without current frames (bf16: on the GPU, test_gpu_arena_plans_within_oracle)
ARENA_PLANS = ("cublas_warp_rownorm", "fused_attention_warp_rownorm")
_ARENA_BASE = [dict(name="arena3_f16", dtype=torch.float16, n=3, t=5, l_len=7, valid=[5, 3, 2], cached=[7, 0, 4]),
               dict(name="arena3_bf16", dtype=torch.bfloat16, n=3, t=5, l_len=7, valid=[2, 5, 0], cached=[0, 7, 3])]
INTERP_CASES += [dict(c, name=f"{c['name']}_{p}", variant=p, arena=True, plan=p) for c in _ARENA_BASE
                 for p in ARENA_PLANS if c["dtype"] != torch.bfloat16]
INTERP_CASES += [dict(name="wide_f16_arena_fused_attention_warp_rownorm", dtype=torch.float16, n=2, t=5, l_len=70,
                      valid=[5, 1], cached=[70, 33], variant=ARENA_PLANS[1], wide=True, arena=True,
                      plan=ARENA_PLANS[1])]

# the CUTLASS plan on the arena: no library kernel runs on the CPU, so its GEMMs fall back to cuBLAS's calls and
# it writes the shipped arena plan's bits (test_cutlass_plan_falls_back_to_the_shipped_arena_bits); on the GPU,
# test_gpu_cutlass_plan_within_oracle
INTERP_CASES += [dict(c, name=f"{c['name']}_cutlass_warp_rownorm", variant="cutlass_warp_rownorm", arena=True,
                      plan="cutlass_warp_rownorm") for c in _ARENA_BASE if c["dtype"] != torch.bfloat16]


def _interp_args(case):
    config = WIDE if case.get("wide") else TINY
    model = random_dit(config, seed=12)
    packed = pack_dit(model, case["dtype"], "cpu")
    x, mu, tt, spks, cond, cnn, att, valid, cached = make_inputs(
        config, case["n"], case["t"], case["l_len"], torch.float32, seed=13, valid=case["valid"], cached=case["cached"])
    dt = case["dtype"]
    x_in = stage_input(x, mu, spks, cond, dt)
    if case.get("per_row_t"):  # one modulation table per row (different times)
        tt = tt * torch.linspace(0.5, 1.5, case["n"], dtype=tt.dtype)
    table = modulation_table(pack_dit(model, torch.float32, "cpu"), tt if case.get("per_row_t") else tt[:1])
    cnn = None if case.get("no_cnn") else cnn.to(dt)
    att = None if att is None else att.to(dt)
    return model, x_in, packed.body, table, cnn, att, valid, cached


def _run_arena(x_in, w, table, cnn, att, valid, cached, out, case):
    """The in-place arena form: old keys reversed into a poisoned arena of T + L frames, the body
    appends (the table's arena plan, or ``case["plan"]``), the result turned back to the newest-first
    layout (zeros past each row's length). Returns (velocity, conv cache, att cache, the arena itself)."""
    from strategies import poisoned_arena
    from torch_cfm.kernels.body_plans import CUBLAS_WARP_ROWNORM_16BIT
    from torch_cfm.models.cache import reverse_keys
    from torch_cfm.kernels.dit_body import dit_body_arena_into

    vel, cnn_out, att_out = out
    shape = att_out.shape[:3] + (case["t"] + case["l_len"], att_out.shape[4])
    arena, vl, cl = poisoned_arena(att, valid, cached, shape, case["t"], att_out.dtype, x_in.device)
    plan = case.get("plan")
    plan = CUBLAS_WARP_ROWNORM_16BIT if plan == "cublas_warp_rownorm" else plan  # not a named plan
    dit_body_arena_into(x_in, w, table, cnn, arena, vl, cl, "ieee", (vel, cnn_out), plan)
    return vel, cnn_out, reverse_keys(arena, vl + cl), arena  # padding frames (still NaN) come back as zeros


def _child(out_path: str, shard: int = 0, shards: int = 1) -> None:
    from torch_cfm.kernels.dit_body import dit_body_fused_into
    from torch_cfm.ops.dit_body import body_outputs as _empty_outputs

    results = {}
    for case in INTERP_CASES[shard::shards]:
        _, x_in, w, table, cnn, att, valid, cached = _interp_args(case)
        s = check_dit_body(x_in, w, table, cnn, att, valid, cached, "ieee")
        out = tuple(o.fill_(float("nan")) for o in _empty_outputs(x_in, s))  # poisoned
        if case.get("arena"):
            vel, cnn_out, att_out, arena = _run_arena(x_in, w, table, cnn, att, valid, cached, out, case)
            results[case["name"]], results[case["name"] + "/arena"] = (vel, cnn_out, att_out), arena
            continue
        dit_body_fused_into(x_in, w, table, cnn, att, valid, cached, "ieee", out, case["variant"])
        results[case["name"]] = out
    torch.save(results, out_path)


@pytest.fixture(scope="module")
def interp_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dit_interp")
    env = interpreter_env()
    procs = run_shards(lambda i, k: [sys.executable, os.path.abspath(__file__), "--child", str(tmp / f"out{i}.pt"),
                                     str(i), str(k)], env=env, cwd=_HERE, timeout=300)
    results = {}
    for i, proc in enumerate(procs):
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.update(torch.load(tmp / f"out{i}.pt"))
    return results


@pytest.mark.parametrize("case", INTERP_CASES, ids=[c["name"] for c in INTERP_CASES])
def test_triton_driver_interpreter_within_oracle(case, interp_results):
    _assert_case_within_oracle(case, interp_results[case["name"]])


def _assert_case_within_oracle(case, fast) -> None:
    """``fast`` (velocity, conv cache, attention cache; CPU) within the §6 oracle of the case's inputs."""
    model, x_in, w, table, cnn, att, valid, cached = _interp_args(case)
    same = dit_body_reference(x_in, w, table, cnn, att, valid, cached)
    w64 = [t.double() for t in pack_dit(model, torch.float64, "cpu").body]
    ref = dit_body_reference(x_in.double(), w64, table.double(), None if cnn is None else cnn.double(),
                             None if att is None else att.double(), valid, cached)
    t, l_len = case["t"], case["l_len"]
    for name, f, s, r in zip(("velocity", "cnn_cache", "att_cache"), valid_parts(*fast, valid, cached, t, l_len),
                             valid_parts(*same, valid, cached, t, l_len), valid_parts(*ref, valid, cached, t, l_len)):
        assert torch.isfinite(f).all(), name
        assert_within_oracle(f, s, r, name)
        if case["dtype"] == torch.float32:
            assert err_rel_fro(f, r) <= IEEE_REL_BOUND, name
    # padding frames of the new attention cache are zero, not poison
    assert torch.isfinite(fast[2]).all()


_ARENA_INTERP = [c for c in _ARENA_BASE if c["dtype"] != torch.bfloat16]


@pytest.mark.parametrize("case", _ARENA_INTERP, ids=[c["name"] for c in _ARENA_INTERP])
def test_fused_attention_arena_form_writes_the_shipped_arena(case, interp_results):
    """fused_attention_warp_rownorm on the arena writes what the shipped arena plan writes: block 0
    (the same input to both) bitwise, every block's frames outside [L_n, L_n + T_n) untouched (old
    frames as given, poison still NaN), bitwise in both; later blocks' current frames follow each
    plan's own attention output (their sums differ in order), checked against the oracle above."""
    shipped, fused = (interp_results[f"{case['name']}_{p}/arena"] for p in ARENA_PLANS)
    bits = shipped.view(torch.int16)
    assert torch.equal(fused[0].view(torch.int16), bits[0])
    for i, (tn, ln) in enumerate(zip(case["valid"], case["cached"])):
        outside = torch.ones(shipped.shape[3], dtype=torch.bool)
        outside[ln:ln + tn] = False
        assert torch.equal(fused[:, i, :, outside].view(torch.int16), bits[:, i, :, outside])
        assert torch.isnan(fused[:, i, :, ln + tn:]).all() and not torch.isnan(fused[:, i, :, :ln + tn]).any()


@pytest.mark.parametrize("case", _ARENA_INTERP, ids=[c["name"] for c in _ARENA_INTERP])
def test_cutlass_plan_falls_back_to_the_shipped_arena_bits(case, interp_results):
    """cutlass_warp_rownorm where its library cannot run (CPU operands): every output and the arena
    bitwise the shipped arena plan's (cublas_warp_rownorm, which it is but for the GEMMs' kernel)."""
    shipped, cut = ((*interp_results[f"{case['name']}_{p}"], interp_results[f"{case['name']}_{p}/arena"])
                    for p in ("cublas_warp_rownorm", "cutlass_warp_rownorm"))
    for name, a, b in zip(("velocity", "cnn_cache", "att_cache", "arena"), shipped, cut):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_cutlass_plan_within_oracle(dtype, monkeypatch):
    """cutlass_warp_rownorm at the shipped widths (4 blocks): within the oracle, with qkv, proj, both
    conv taps and fc2 of every block run on the CUTLASS library (skipped where it is not built)."""
    from torch_cfm.kernels import cutlass_gemm as cg
    from torch_cfm.kernels.body_plans import use_plan

    if cg.unavailable_reason() is not None:
        pytest.skip(cg.unavailable_reason())
    calls, real = [], cg._launch
    monkeypatch.setattr(cg, "_launch", lambda lib, cfg, *a: calls.append(cfg.name) or real(lib, cfg, *a))
    with use_plan("cutlass_warp_rownorm"):
        _assert_fused_within_oracle(dtype, None)
    assert calls == ["pingpong_128x128"] * (5 * GPU_CFG.depth)


@pytest.mark.gpu
@pytest.mark.parametrize("plan", ARENA_PLANS)
@pytest.mark.parametrize("case", _ARENA_BASE + [dict(name="wide_f16", dtype=torch.float16, n=2, t=5, l_len=70,
                                                     valid=[5, 1], cached=[70, 33], wide=True)],
                         ids=lambda c: c["name"])
def test_gpu_arena_plans_within_oracle(case, plan):
    """Both arena plans of >= 32-row 16-bit bodies on the GPU, on the interpreter cases' inputs (bf16
    included): within the oracle, and every frame outside [L_n, L_n + T_n) untouched."""
    from torch_cfm.ops.dit_body import body_outputs

    case = dict(case, variant=plan, arena=True, plan=plan)
    _, *args = _interp_args(case)
    dev = torch.device("cuda")
    x_in, w, table, cnn, att, valid, cached = (
        [t.to(dev) for t in a] if isinstance(a, list) else (None if a is None else a.to(dev)) for a in args)
    s = check_dit_body(x_in, w, table, cnn, att, valid, cached, "ieee")
    out = tuple(o.fill_(float("nan")) for o in body_outputs(x_in, s))
    vel, cnn_out, att_out, arena = _run_arena(x_in, w, table, cnn, att, valid, cached, out, case)
    _assert_case_within_oracle(case, (vel.cpu(), cnn_out.cpu(), att_out.cpu()))
    for i, (tn, ln) in enumerate(zip(case["valid"], case["cached"])):
        assert torch.isnan(arena[:, i, :, ln + tn:]).all() and not torch.isnan(arena[:, i, :, :ln + tn]).any()


# --------------------------------------------------------------------------------------------
# GPU: fused vs the model's reference path (docs/design.md §6), shipped widths, 4 blocks
# --------------------------------------------------------------------------------------------

GPU_CFG = DiTConfig(depth=4)
GPU_PRECISIONS = [(torch.float16, None), (torch.bfloat16, None), (torch.float32, "tf32"), (torch.float32, "ieee")]


_GPU_N, _GPU_T, _GPU_L = 4, 50, 64
_GPU_VALID, _GPU_CACHED = [50, 37, 1, 0], [64, 10, 0, 64]


@functools.lru_cache(maxsize=2)
def _gpu_cpu_model(seed):
    return random_dit(GPU_CFG, seed=seed)


@functools.lru_cache(maxsize=2)
def _gpu_ref64(seed):
    model64 = copy.deepcopy(_gpu_cpu_model(seed)).double()
    inputs = make_inputs(GPU_CFG, _GPU_N, _GPU_T, _GPU_L, torch.float64, seed=seed + 1, valid=_GPU_VALID,
                         cached=_GPU_CACHED)
    ref = model64.forward_chunk(*inputs[:7], valid_lengths=inputs[7], cache_lengths=inputs[8], fused=False)
    return inputs, ref


def _gpu_case(dtype, precision, seed=20):
    dev = torch.device("cuda")
    inputs, ref = _gpu_ref64(seed)
    model = copy.deepcopy(_gpu_cpu_model(seed)).to(device=dev, dtype=dtype)
    dev_in = [None if a is None else a.to(dev) for a in inputs]
    dev_in = [a.to(dtype) if a is not None and a.is_floating_point() and i != 2 else a for i, a in enumerate(dev_in)]
    from torch_cfm import policy
    with policy.tf32_scope(precision == "tf32"):
        same = model.forward_chunk(*dev_in[:7], valid_lengths=dev_in[7], cache_lengths=dev_in[8], fused=False)
    fast = dit_forward_chunk_fused(model, *dev_in[:7], valid_lengths=dev_in[7], cache_lengths=dev_in[8],
                                   precision=precision)
    torch.cuda.synchronize()
    return fast, same, ref, inputs[7], inputs[8], _GPU_T, _GPU_L


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS + ("wgmma",))  # wgmma: cublas call for call on CPU, so GPU-only here
@pytest.mark.parametrize("dtype,precision", GPU_PRECISIONS, ids=["fp16", "bf16", "fp32-tf32", "fp32-ieee"])
def test_gpu_fused_within_oracle(dtype, precision, variant):
    from torch_cfm.kernels.body_plans import NAMED, family, use_plan

    if variant not in NAMED[family(dtype, precision)]:
        pytest.skip(f"no {variant} plan for {family(dtype, precision)} bodies")
    with use_plan(variant):
        _assert_fused_within_oracle(dtype, precision)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_wide_arena_plan_within_oracle(dtype):
    """cublas_warp_rownorm, the plan of 16-bit arena bodies of >= 32 rows (cublas with one-warp row-norm
    programs), at the shipped widths: within the oracle like every named plan."""
    from torch_cfm.kernels.body_plans import CUBLAS_WARP_ROWNORM_16BIT, body_plan, use_plan

    assert body_plan(dtype, None, 32, arena=True) is CUBLAS_WARP_ROWNORM_16BIT
    with use_plan(CUBLAS_WARP_ROWNORM_16BIT):
        _assert_fused_within_oracle(dtype, None)


def _assert_fused_within_oracle(dtype, precision):
    fast, same, ref, valid, cached, t, l_len = _gpu_case(dtype, precision)
    parts = [valid_parts(*(o.cpu() for o in outs), valid, cached, t, l_len) for outs in (fast, same, ref)]
    for k, name in enumerate(("velocity", "cnn_cache", "att_cache")):
        f, s, r = parts[0][k], parts[1][k], parts[2][k]
        assert torch.isfinite(f).all(), name
        print(f"{name}: fused rel {err_rel_fro(f, r):.3e} reference rel {err_rel_fro(s, r):.3e}")
        assert_within_oracle(f, s, r, name)
        if precision == "ieee":
            assert err_rel_fro(f, r) <= IEEE_REL_BOUND, name
    # padding frames of every new attention cache are zero
    for i in range(_GPU_N):
        assert (fast[2][:, i, :, _GPU_VALID[i] + _GPU_CACHED[i]:] == 0).all()


@pytest.mark.gpu
def test_gpu_model_hook_uses_fused_body():
    dev = torch.device("cuda")
    model = random_dit(GPU_CFG, seed=30).to(device=dev, dtype=torch.float16)
    inputs = [None if a is None else a.to(dev) for a in
              make_inputs(GPU_CFG, 2, 50, 32, torch.float16, seed=31, valid=[50, 20], cached=[32, 5])]
    via_model = model.forward_chunk(*inputs[:7], valid_lengths=inputs[7], cache_lengths=inputs[8], fused=True)
    direct = dit_forward_chunk_fused(model, *inputs[:7], valid_lengths=inputs[7], cache_lengths=inputs[8])
    for a, b in zip(via_model, direct):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_no_host_sync():
    dev = torch.device("cuda")
    model = random_dit(GPU_CFG, seed=40).to(device=dev, dtype=torch.bfloat16)
    x, mu, tt, spks, cond, cnn, att, valid, cached = [
        None if a is None else a.to(dev) for a in
        make_inputs(GPU_CFG, 2, 50, 32, torch.bfloat16, seed=41, valid=[50, 20], cached=[32, 5])]
    packed = packed_for(model, torch.bfloat16, dev)
    x_in = stage_input(x, mu, spks, cond, torch.bfloat16)
    table = modulation_table(packed, tt[:1])
    torch.ops.torch_cfm.dit_body(x_in, packed.body, table, cnn, att, valid, cached, "auto")  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = torch.ops.torch_cfm.dit_body(x_in, packed.body, table, cnn, att, valid, cached, "auto")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(out[0].float()).all()


if __name__ == "__main__" and len(sys.argv) >= 3 and sys.argv[1] == "--child":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run the child with TRITON_INTERPRET=1")
    _child(sys.argv[2], *(int(a) for a in sys.argv[3:5]))


def test_arena_form_rejects_a_bad_arena():
    """dit_body_arena_into: ValueError naming att_arena for a wrong rank, row count, too few frames
    or another dtype, before anything is written."""
    from torch_cfm.kernels.dit_body import dit_body_arena_into

    model = random_dit(TINY, seed=3)
    packed = pack_dit(model, torch.float32, "cpu")
    x, mu, tt, spks, cond, cnn, _, _, _ = make_inputs(TINY, 2, 5, 3, torch.float32, seed=4)
    x_in = stage_input(x, mu, spks, cond, torch.float32)
    table = modulation_table(packed, tt[:1])
    out = (torch.empty(2, 80, 5), torch.empty(TINY.depth, 2, 2 * TINY.hidden, 2))
    shape = (TINY.depth, 2, TINY.heads, 8, 2 * TINY.head_dim)
    for arena in (torch.zeros(shape[1:]), torch.zeros(shape[:1] + (3,) + shape[2:]),
                  torch.zeros(shape[:3] + (4,) + shape[4:]), torch.zeros(shape, dtype=torch.float16)):
        with pytest.raises(ValueError, match="dit_body_arena_into: att_arena must"):
            dit_body_arena_into(x_in, packed.body, table, cnn, arena, None, None, "ieee", out)
