"""Hypothesis properties of one estimator step (``DiT.forward_chunk``) and the fused body.

Tiny configs (``strategies.tiny_configs``), ragged chunks from ``strategies.chunk_specs``
(N 1..4, T 1..9, L 0..12, lengths 0/1/full/random, caches absent/dense/arena windows, scalar or
per-row t). Three paths: ``reference`` (``forward_chunk(fused=False)``), ``fused``
(``dit_forward_chunk_fused``: the ``torch_cfm::dit_body`` op; CPU kernel = plain reference body,
CUDA = Triton + cuBLAS) and ``policy`` (``forward_chunk()`` as dispatched). Ground truth is the
independent row-by-row oracle ``tests/dit_oracle.py`` in float64; the same-dtype baseline is that
oracle run in the compute dtype. Velocity (valid frames) AND both caches (valid frames) are
checked. Properties:

* docs/design.md §6 oracle bound (fp32/fp16/bf16; on CUDA fp32 with TF32 and IEEE);
* permuting each row's cached frames (valid ones among themselves) changes nothing but the
  order of the copied cache frames;
* inserting padded rows changes no other row beyond the oracle (GEMM tiling may depend on N);
* a row with T_n = 0 copies its caches exactly (conv cache unchanged, old frames first);
* NaN/Inf in one row's inputs or caches leaves every other row bitwise unchanged;
* autocast: outputs follow the ambient dtype (forward_chunk, fused hook, dit_body op);
* explain's ``dit_body`` line is the path that runs (fused hook spied), with the TF32 policy.

``_cpu`` tests run every property on CPU; gpu-marked ``_cuda`` tests add fp16/bf16/TF32 with
``strategies.gpu_settings()`` examples. ``test_triton_body_properties_in_interpreter`` (slow)
runs oracle, empty-row, non-finite and padded-row properties on every variant of the Triton
body driver under ``TRITON_INTERPRET=1`` in a child process (outputs NaN-prefilled).
"""

from __future__ import annotations

import contextlib
import importlib
import math
import re
from typing import Iterator, Optional

import pytest
import torch

from interpreter_child import interpreter_env
from hypothesis import given
from hypothesis import strategies as st

import strategies as S
from oracle import IEEE_REL_BOUND, assert_within_oracle, err_rel_fro
from shards import run_shards

O = pytest.importorskip("dit_oracle")
dit = pytest.importorskip("torch_cfm.models.dit")
body = pytest.importorskip("torch_cfm.ops.dit_body")
fused_forward = pytest.importorskip("torch_cfm.models.fused_forward")
from torch_cfm.diagnostics import machine_report  # noqa: E402

GPU_SETTINGS = S.gpu_settings()
PATHS = ("reference", "fused", "policy")
_MODELS: dict = {}


def model_for(cfg_index: int, device: str, dtype: torch.dtype) -> torch.nn.Module:
    key = (cfg_index, device, dtype)
    if key not in _MODELS:
        _MODELS[key] = dit.random_dit(S.tiny_configs()[cfg_index], seed=cfg_index + 1).to(device, dtype).eval()
    return _MODELS[key]


def run_path(model, a: dict, path: str, precision: Optional[str] = None):
    if path.startswith("triton:"):
        return _triton_body(model, a, path.split(":")[1])
    args = (a["x"], a["mu"], a["t"], a["spks"], a["cond"], a["cnn_cache"], a["att_cache"])
    kw = dict(valid_lengths=a["valid_lengths"], cache_lengths=a["cache_lengths"])
    with torch.no_grad():
        if path == "fused":
            return fused_forward.dit_forward_chunk_fused(model, *args, **kw, precision=precision)
        return model.forward_chunk(*args, **kw, fused=False if path == "reference" else None)


def _time_embedding_in_dtype(sd, t: float, dtype, device):
    """The oracle's time embedding computed like a same-dtype implementation: sinusoid phases in
    float32 for fp32/fp16/bf16 (the oracle itself uses float64; phases up to 1000 rad in fp16
    would be meaningless, and every real implementation takes them in fp32), the MLP in dtype."""
    work = torch.float32
    j = torch.arange(128, dtype=work, device=device)
    w = torch.exp(-math.log(10000.0) * j / 128)
    phase = 1000.0 * torch.tensor(t, dtype=work, device=device) * w
    f = torch.cat([torch.cos(phase), torch.sin(phase)]).to(dtype)
    return O.linear(O.silu(O.linear(f, sd, "t_embedder.mlp.0")), sd, "t_embedder.mlp.2")


@contextlib.contextmanager
def oracle_in_dtype(dtype: torch.dtype) -> Iterator[None]:
    saved = O.time_embedding
    if dtype != torch.float64:
        O.time_embedding = _time_embedding_in_dtype
    try:
        yield
    finally:
        O.time_embedding = saved


def oracle(model, a: dict, dtype: torch.dtype = torch.float64, device: str = "cpu"):
    """Per-row oracle outputs (lists of velocity, cnn, att) in ``dtype`` on ``device``; below
    float64 every step (time features included) runs in ``dtype``: the docs/design.md §6 baseline."""
    with oracle_in_dtype(dtype):
        return _oracle(model, a, dtype, device)


def _oracle(model, a: dict, dtype: torch.dtype, device: str):
    sd = O.to_dtype(model.state_dict(), dtype, device)
    n = a["x"].shape[0]

    def conv(t):
        return None if t is None else t.to(device=device, dtype=dtype)

    x, mu = conv(a["x"]), conv(a["mu"])
    spks = conv(a["spks"]) if a["spks"] is not None else torch.zeros(n, 80, dtype=dtype, device=device)
    cond = conv(a["cond"]) if a["cond"] is not None else torch.zeros_like(x)
    t = a["t"].double().cpu().reshape(-1).expand(n)
    vl = None if a["valid_lengths"] is None else a["valid_lengths"].cpu()
    cl = None if a["cache_lengths"] is None else a["cache_lengths"].cpu()
    return O.batch_chunk(sd, x, mu, t, spks, cond, conv(a["cnn_cache"]), conv(a["att_cache"]), vl, cl)


def valid_parts(outs, spec: S.ChunkSpec, rows: Optional[list[int]] = None):
    """Flattened valid parts (velocity frames < T_n, conv caches, att frames < T_n + L_n)."""
    vel, cnn, att = outs
    lengths = S.chunk_row_lengths(spec)
    rows = range(spec.n) if rows is None else rows
    v = [vel[n, :, :lengths[i][0]].reshape(-1) for i, n in enumerate(rows)]
    c = [cnn[:, n].reshape(-1) for n in rows]
    k = [att[:, n, :, :sum(lengths[i])].reshape(-1) for i, n in enumerate(rows)]
    return tuple(torch.cat(p).cpu() for p in (v, c, k))


def oracle_parts(rows_out):
    vels, cnns, atts = rows_out
    return tuple(torch.cat([t.reshape(-1) for t in p]).cpu() for p in (vels, cnns, atts))


def check_oracle(fast, same, ref, label: str, tf32: bool = False) -> None:
    for name, f, s, r in zip(("velocity", "cnn_cache", "att_cache"), fast, same, ref):
        assert_within_oracle(f, s, r, name=f"{label}: {name}", tf32=tf32)


def compute_modes(device: str) -> st.SearchStrategy:
    """(dtype, fp32 precision) pairs: CPU has no TF32; CUDA adds it."""
    if device == "cpu":
        return st.sampled_from([(torch.float32, "ieee"), (torch.float16, None), (torch.bfloat16, None)])
    return st.sampled_from([(torch.float16, None), (torch.bfloat16, None), (torch.float32, "tf32"),
                            (torch.float32, "ieee")])


@contextlib.contextmanager
def tf32_flag(enabled: bool) -> Iterator[None]:
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# --------------------------------------------------------------------------------------------
# docs/design.md §6 oracle
# --------------------------------------------------------------------------------------------

def check_chunk_within_oracle(device, path, spec, data):
    S.tried(f"model_oracle[{path},{device}]")
    dtype, precision = data.draw(compute_modes(device), label="mode")
    model = model_for(spec.cfg, device, dtype)
    a = S.build_chunk(spec, device, dtype)
    tf32 = precision == "tf32"
    with tf32_flag(tf32):
        fast = valid_parts(run_path(model, a, path, precision), spec)
        same = oracle_parts(oracle(model, a, dtype, device))
    ref = oracle_parts(oracle(model, a))
    check_oracle(fast, same, ref, f"{path} {dtype} {precision} {spec.describe()}", tf32=tf32)
    if dtype == torch.float32 and not tf32:
        for name, f, r in zip(("velocity", "cnn", "att"), fast, ref):
            # IEEE fp32 through a (tiny) multi-block body: 2e-5 relative (attention alone: 1e-5)
            assert err_rel_fro(f, r) <= 2 * IEEE_REL_BOUND, f"{name}: {err_rel_fro(f, r):.2e}"


@pytest.mark.parametrize("path", PATHS)
@given(spec=S.chunk_specs(), data=st.data())
def test_chunk_within_oracle_cpu(path, spec, data):
    check_chunk_within_oracle("cpu", path, spec, data)


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@GPU_SETTINGS
@given(spec=S.chunk_specs(), data=st.data())
def test_chunk_within_oracle_cuda(path, spec, data):
    check_chunk_within_oracle("cuda", path, spec, data)


# --------------------------------------------------------------------------------------------
# cache frame order does not matter
# --------------------------------------------------------------------------------------------

def shuffle_cache(a: dict, spec: S.ChunkSpec, seed: int) -> tuple[dict, list[torch.Tensor]]:
    """Permute each (block, row)'s first L_n frames among themselves (and the padding frames
    among themselves). Returns the new inputs and the per-(block*N + row) permutations."""
    att = a["att_cache"]
    gen = torch.Generator().manual_seed(seed)
    depth, n_rows, _, l_len, _ = att.shape
    perms, out = [], att.clone()
    for b in range(depth):
        for n, (_, ln) in enumerate(S.chunk_row_lengths(spec)):
            perm = torch.cat([torch.randperm(ln, generator=gen), ln + torch.randperm(l_len - ln, generator=gen)])
            out[b, n] = att[b, n][:, perm.to(att.device)]
            perms.append(perm)
    return dict(a, att_cache=out), perms


def reorder_old_frames(att_rows: list, spec: S.ChunkSpec, perms: list) -> list:
    """Oracle per-row caches (depth, H, T_n + L_n, 2D) with their old frames permuted like the input."""
    out = []
    for n, ((tn, ln), att) in enumerate(zip(S.chunk_row_lengths(spec), att_rows)):
        att = att.clone()
        for b in range(att.shape[0]):
            perm = perms[b * spec.n + n][:ln]
            att[b, :, tn:tn + ln] = att[b, :, tn:tn + ln][:, perm]
        out.append(att)
    return out


def check_cache_frame_order_does_not_matter(device, spec, seed, path, data):
    S.tried(f"model_permute_cache[{device}]")
    dtype, precision = data.draw(compute_modes(device), label="mode")
    model = model_for(spec.cfg, device, dtype)
    a = S.build_chunk(spec, device, dtype)
    shuffled, perms = shuffle_cache(a, spec, seed)
    with tf32_flag(precision == "tf32"):
        fast = valid_parts(run_path(model, shuffled, path, precision), spec)
        same = oracle_parts(oracle(model, shuffled, dtype, device))
    vels, cnns, atts = oracle(model, a)  # ground truth of the UNshuffled call
    ref = oracle_parts((vels, cnns, reorder_old_frames(atts, spec, perms)))
    check_oracle(fast, same, ref, f"shuffled {path} {spec.describe()}", tf32=precision == "tf32")


@given(spec=S.chunk_specs().filter(lambda s: s.att != "none" and s.l_len > 1),
       seed=st.integers(0, 2**31 - 1), path=st.sampled_from(PATHS), data=st.data())
def test_cache_frame_order_does_not_matter_cpu(spec, seed, path, data):
    check_cache_frame_order_does_not_matter("cpu", spec, seed, path, data)


@pytest.mark.gpu
@GPU_SETTINGS
@given(spec=S.chunk_specs().filter(lambda s: s.att != "none" and s.l_len > 1),
       seed=st.integers(0, 2**31 - 1), path=st.sampled_from(PATHS), data=st.data())
def test_cache_frame_order_does_not_matter_cuda(spec, seed, path, data):
    check_cache_frame_order_does_not_matter("cuda", spec, seed, path, data)


# --------------------------------------------------------------------------------------------
# padded rows
# --------------------------------------------------------------------------------------------

def grow_batch(a: dict, extra: dict, slots: list[int]) -> dict:
    """Interleave ``extra``'s rows into ``a``; original rows land at ``slots``."""
    n_big = a["x"].shape[0] + extra["x"].shape[0]
    others = [i for i in range(n_big) if i not in slots]
    grown = {}
    for key, val in a.items():
        other = extra[key]
        if val is None:
            grown[key] = None
            continue
        axis = 1 if key in ("cnn_cache", "att_cache") else 0
        if key == "t" and val.dim() == 0:
            grown[key] = val
            continue
        shape = list(val.shape)
        shape[axis] = n_big
        out = val.new_empty(shape)
        out.index_copy_(axis, torch.tensor(slots, device=val.device), val)
        out.index_copy_(axis, torch.tensor(others, device=val.device), other)
        grown[key] = out
    return grown


def check_padded_rows_change_no_other_row(device, spec, path, data):
    S.tried(f"model_padded_rows[{device}]")
    dtype, precision = data.draw(compute_modes(device), label="mode")
    extra_n = data.draw(st.integers(1, 3), label="extra rows")
    n_big = spec.n + extra_n
    slots = sorted(data.draw(st.permutations(range(n_big)), label="order")[:spec.n])
    limits = (spec.t_len, spec.l_len)
    extra_spec = S.ChunkSpec(spec.cfg, extra_n, spec.t_len, spec.l_len, spec.seed ^ 0x5A5A,
                             None if spec.valid is None else tuple(
                                 data.draw(st.lists(st.integers(0, limits[0]), min_size=extra_n, max_size=extra_n))),
                             None if spec.cached is None else tuple(
                                 data.draw(st.lists(st.integers(0, limits[1]), min_size=extra_n, max_size=extra_n))),
                             spec.cnn, spec.att, spec.scalar_t, spec.spks, spec.cond)
    model = model_for(spec.cfg, device, dtype)
    small = S.build_chunk(spec, device, dtype)
    big = grow_batch(small, S.build_chunk(extra_spec, device, dtype), slots)
    with tf32_flag(precision == "tf32"):
        out_small = valid_parts(run_path(model, small, path, precision), spec)
        big_spec = S.ChunkSpec(spec.cfg, n_big, spec.t_len, spec.l_len, 0,
                               None if spec.valid is None else tuple(big["valid_lengths"].tolist()),
                               None if spec.cached is None else tuple(big["cache_lengths"].tolist()))
        out_big = run_path(model, big, path, precision)
        lengths = S.chunk_row_lengths(big_spec)
        picked = S.ChunkSpec(spec.cfg, spec.n, spec.t_len, spec.l_len, 0,
                             tuple(lengths[i][0] for i in slots), tuple(lengths[i][1] for i in slots))
        out_big = valid_parts(out_big, picked, rows=slots)
        same = oracle_parts(oracle(model, small, dtype, device))
    ref = oracle_parts(oracle(model, small))
    check_oracle(out_big, same, ref, f"padded {path} {spec.describe()}", tf32=precision == "tf32")
    check_oracle(out_small, same, ref, f"alone {path} {spec.describe()}", tf32=precision == "tf32")


@given(spec=S.chunk_specs(n_max=3), path=st.sampled_from(PATHS), data=st.data())
def test_padded_rows_change_no_other_row_cpu(spec, path, data):
    check_padded_rows_change_no_other_row("cpu", spec, path, data)


@pytest.mark.gpu
@GPU_SETTINGS
@given(spec=S.chunk_specs(n_max=3), path=st.sampled_from(PATHS), data=st.data())
def test_padded_rows_change_no_other_row_cuda(spec, path, data):
    check_padded_rows_change_no_other_row("cuda", spec, path, data)


# --------------------------------------------------------------------------------------------
# a row with no current frame copies its caches exactly
# --------------------------------------------------------------------------------------------

def check_row_without_frames_copies_its_caches(device, spec, path, data):
    S.tried(f"model_empty_row[{device}]")
    dtype, precision = data.draw(compute_modes(device), label="mode")
    n0 = data.draw(st.integers(0, spec.n - 1), label="row")
    valid = list(spec.valid) if spec.valid is not None else [spec.t_len] * spec.n
    valid[n0] = 0
    spec = S.ChunkSpec(**{**spec.__dict__, "valid": tuple(valid)})
    model = model_for(spec.cfg, device, dtype)
    a = S.build_chunk(spec, device, dtype)
    with tf32_flag(precision == "tf32"):
        vel, cnn, att = run_path(model, a, path, precision)
    ln = S.chunk_row_lengths(spec)[n0][1]
    old_cnn = a["cnn_cache"][:, n0] if a["cnn_cache"] is not None else torch.zeros_like(cnn[:, n0])
    assert torch.equal(cnn[:, n0], old_cnn), "conv cache of a row without frames changed"
    if ln:
        assert torch.equal(att[:, n0, :, :ln], a["att_cache"][:, n0, :, :ln]), "old frames not copied first"
    assert torch.isfinite(vel).all() and torch.isfinite(cnn).all()


@given(spec=S.chunk_specs(), path=st.sampled_from(PATHS), data=st.data())
def test_row_without_frames_copies_its_caches_cpu(spec, path, data):
    check_row_without_frames_copies_its_caches("cpu", spec, path, data)


@pytest.mark.gpu
@GPU_SETTINGS
@given(spec=S.chunk_specs(), path=st.sampled_from(PATHS), data=st.data())
def test_row_without_frames_copies_its_caches_cuda(spec, path, data):
    check_row_without_frames_copies_its_caches("cuda", spec, path, data)


# --------------------------------------------------------------------------------------------
# NaN / Inf stays in its row
# --------------------------------------------------------------------------------------------

def check_nonfinite_in_one_row_stays_there(device, spec, path, data):
    S.tried(f"model_nonfinite[{device}]")
    dtype, precision = data.draw(compute_modes(device), label="mode")
    bad = data.draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]), label="value")
    n0 = data.draw(st.integers(0, spec.n - 1), label="row")
    model = model_for(spec.cfg, device, dtype)
    clean = S.build_chunk(spec, device, dtype)
    poisoned = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in clean.items()}
    tn, ln = S.chunk_row_lengths(spec)[n0]
    targets = ["mu"] + (["x"] if tn else []) + (["spks"] if spec.spks else [])
    targets += (["cnn_cache"] if spec.cnn else []) + (["att_cache"] if spec.att != "none" and ln else [])
    target = data.draw(st.sampled_from(targets), label="target")
    if target in ("x", "mu"):
        frame = data.draw(st.integers(0, max(tn, 1) - 1), label="frame")
        poisoned[target][n0, data.draw(st.integers(0, 79)), frame] = bad
    elif target == "spks":
        poisoned["spks"][n0, data.draw(st.integers(0, 79))] = bad
    elif target == "cnn_cache":
        poisoned["cnn_cache"][:, n0, :, data.draw(st.integers(0, 1))] = bad
    else:
        poisoned["att_cache"][:, n0, :, data.draw(st.integers(0, ln - 1)), 0] = bad
    with tf32_flag(precision == "tf32"):
        out_clean = run_path(model, clean, path, precision)
        out_bad = run_path(model, poisoned, path, precision)
    others = [n for n in range(spec.n) if n != n0]
    for name, c, b in zip(("velocity", "cnn_cache", "att_cache"), out_clean, out_bad):
        axis = 1 if name != "velocity" else 0
        keep = torch.tensor(others, device=c.device)
        assert torch.equal(c.index_select(axis, keep), b.index_select(axis, keep)), (
            f"{bad} in row {n0}'s {target} changed another row's {name} ({path}, {spec.describe()})")


@given(spec=S.chunk_specs(n_max=4).filter(lambda s: s.n > 1), path=st.sampled_from(PATHS), data=st.data())
def test_nonfinite_in_one_row_stays_there_cpu(spec, path, data):
    check_nonfinite_in_one_row_stays_there("cpu", spec, path, data)


@pytest.mark.gpu
@GPU_SETTINGS
@given(spec=S.chunk_specs(n_max=4).filter(lambda s: s.n > 1), path=st.sampled_from(PATHS), data=st.data())
def test_nonfinite_in_one_row_stays_there_cuda(spec, path, data):
    check_nonfinite_in_one_row_stays_there("cuda", spec, path, data)


# --------------------------------------------------------------------------------------------
# autocast
# --------------------------------------------------------------------------------------------

def check_autocast_outputs_follow_ambient_dtype(device, spec, ambient, path):
    S.tried(f"model_autocast[{device}]")
    model = model_for(spec.cfg, device, torch.float32)
    a = S.build_chunk(spec, device, torch.float32)
    with torch.autocast(device, dtype=ambient), torch.no_grad():
        if path == "op":
            from torch_cfm.packing import modulation_table, packed_for

            packed = packed_for(model, torch.float32, device)
            table = modulation_table(packed, a["t"].reshape(-1).to(device))
            x_in = fused_forward.stage_input(a["x"], a["mu"], a["spks"], a["cond"], torch.float32)
            outs = body.dit_body(x_in, packed.body, table, a["cnn_cache"], a["att_cache"],
                                 valid_lengths=a["valid_lengths"], cache_lengths=a["cache_lengths"])
        else:
            outs = run_path(model, a, path)
    for name, o in zip(("velocity", "cnn_cache", "att_cache"), outs):
        assert o.dtype == ambient, f"{path}: {name} is {o.dtype} under autocast({ambient})"
        assert torch.isfinite(o).all(), f"{path}: {name} not finite"
    if path != "op":
        fast = valid_parts(outs, spec)
        same = oracle_parts(oracle(model, a, ambient, device))
        check_oracle(fast, same, oracle_parts(oracle(model, a)), f"autocast {ambient} {path}")


@given(spec=S.chunk_specs(n_max=3), ambient=st.sampled_from([torch.float16, torch.bfloat16]),
       path=st.sampled_from(PATHS + ("op",)))
def test_autocast_outputs_follow_ambient_dtype_cpu(spec, ambient, path):
    check_autocast_outputs_follow_ambient_dtype("cpu", spec, ambient, path)


@pytest.mark.gpu
@GPU_SETTINGS
@given(spec=S.chunk_specs(n_max=3), ambient=st.sampled_from([torch.float16, torch.bfloat16]),
       path=st.sampled_from(PATHS + ("op",)))
def test_autocast_outputs_follow_ambient_dtype_cuda(spec, ambient, path):
    check_autocast_outputs_follow_ambient_dtype("cuda", spec, ambient, path)


# --------------------------------------------------------------------------------------------
# explain reports the path that runs
# --------------------------------------------------------------------------------------------

@contextlib.contextmanager
def spy_fused() -> Iterator[list]:
    """Record calls of the fused hook ``dit_forward_chunk_fused`` (with their precision)."""
    module = importlib.import_module("torch_cfm.models.dit")
    saved = module.dit_forward_chunk_fused
    calls: list = []

    def spy(*args, **kwargs):
        calls.append(kwargs.get("precision"))
        return saved(*args, **kwargs)

    module.dit_forward_chunk_fused = spy
    try:
        yield calls
    finally:
        module.dit_forward_chunk_fused = saved


def explained_body(device: str, dtype: torch.dtype) -> str:
    name = str(dtype).replace("torch.", "")
    text = machine_report(torch.device(device))
    found = re.search(rf"dit_body\s+\[{name}\]: (fused|reference)", text)
    assert found, f"no dit_body line for {name} in:\n{text}"
    return found.group(1)


AUTO_POLICIES = [p for p in S.TF32_POLICIES if p.precision == "auto"]


def check_explain_reports_the_body_path_that_runs(device, spec, dtype, pol):
    S.tried(f"model_explain_matches_run[{device}]")
    if device == "cpu" and dtype != torch.float32:
        dtype = torch.float32  # tiny fp16/bf16 bodies on CPU: only the decision matters here
    model = model_for(spec.cfg, device, dtype)
    a = S.build_chunk(spec, device, dtype)
    with pol.applied():
        verdict = explained_body(device, dtype)
        with spy_fused() as calls:
            outs = run_path(model, a, "policy")
    assert all(torch.isfinite(o).all() for o in outs)
    if verdict == "reference":
        assert calls == [], f"explain says reference, fused hook ran ({pol.name})"
    else:
        assert len(calls) == 1, f"explain says fused, hook ran {len(calls)} times ({pol.name})"
        if dtype == torch.float32:
            assert calls[0] == pol.expected(), f"{pol.name}: fused body ran with {calls[0]}"


@given(spec=S.chunk_specs(n_max=2), dtype=S.dtypes, pol=st.sampled_from(AUTO_POLICIES))
def test_explain_reports_the_body_path_that_runs_cpu(spec, dtype, pol):
    check_explain_reports_the_body_path_that_runs("cpu", spec, dtype, pol)


@pytest.mark.gpu
@GPU_SETTINGS
@given(spec=S.chunk_specs(n_max=2), dtype=S.dtypes, pol=st.sampled_from(AUTO_POLICIES))
def test_explain_reports_the_body_path_that_runs_cuda(spec, dtype, pol):
    check_explain_reports_the_body_path_that_runs("cuda", spec, dtype, pol)


# --------------------------------------------------------------------------------------------
# the Triton body driver itself on CPU (TRITON_INTERPRET=1, child process)
# --------------------------------------------------------------------------------------------

def _triton_body(model, a: dict, variant: str):
    """The fused driver (``dit_body_fused_into``) on CPU tensors, outputs pre-filled with NaN so
    any element it leaves unwritten fails the checks (padding must be finite, docs/design.md §2).
    ``variant`` "arena": the in-place form (``dit_body_arena_into``) on a NaN-poisoned arena of
    T + L frames holding the old keys reversed; its result turned back to newest-first."""
    from torch_cfm.kernels.dit_body import dit_body_arena_into, dit_body_fused_into
    from torch_cfm.models.cache import reverse_keys
    from torch_cfm.packing import modulation_table, packed_for

    cfg = model.config
    dtype, dev = model.in_proj.weight.dtype, a["x"].device
    n_rows, _, t_len = a["x"].shape
    l_len = 0 if a["att_cache"] is None else a["att_cache"].shape[3]
    nan = float("nan")
    out = (torch.full((n_rows, cfg.out_channels, t_len), nan, dtype=dtype, device=dev),
           torch.full((cfg.depth, n_rows, 2 * cfg.hidden, 2), nan, dtype=dtype, device=dev),
           torch.full((cfg.depth, n_rows, cfg.heads, t_len + l_len, 2 * cfg.head_dim), nan, dtype=dtype, device=dev))
    with torch.no_grad():
        packed = packed_for(model, dtype, dev)
        table = modulation_table(packed, a["t"].reshape(-1).to(dev))
        x_in = fused_forward.stage_input(a["x"], a["mu"], a["spks"], a["cond"], dtype)
        if variant == "arena":
            arena, valid, cached = S.poisoned_arena(a["att_cache"], a["valid_lengths"], a["cache_lengths"],
                                                    out[2].shape, t_len, dtype, dev)
            dit_body_arena_into(x_in, packed.body, table, a["cnn_cache"], arena, valid, cached, "ieee", out[:2])
            return out[0], out[1], reverse_keys(arena, valid + cached)
        dit_body_fused_into(x_in, packed.body, table, a["cnn_cache"], a["att_cache"], a["valid_lengths"],
                                 a["cache_lengths"], "ieee", out, variant)
    return out


def interpreter_main(examples: int, shard: int = 0, shards: int = 1) -> None:
    """Entry point of the child process: oracle, empty rows, non-finite containment and padded
    rows on every Triton body plan and the in-place arena form, run by the interpreter (fp32
    and fp16: the interpreter's bf16 dot is wrong, docs/design.md §10; depth-1 tiny configs)."""
    from hypothesis import settings

    from torch_cfm.kernels.body_plans import PLAN_NAMES

    global compute_modes

    def compute_modes(device: str) -> st.SearchStrategy:
        return st.sampled_from([(torch.float32, "ieee"), (torch.float16, None)])

    specs = S.chunk_specs(n_max=3, cfgs=(1, 2))
    several = S.chunk_specs(n_max=3, cfgs=(1, 2)).filter(lambda s: s.n > 1)
    checks = (("oracle", specs, lambda spec, path, data: check_chunk_within_oracle("cpu", path, spec, data)),
              ("empty_row", specs,
               lambda spec, path, data: check_row_without_frames_copies_its_caches("cpu", spec, path, data)),
              ("nonfinite", several,
               lambda spec, path, data: check_nonfinite_in_one_row_stays_there("cpu", spec, path, data)),
              ("padded_rows", specs,
               lambda spec, path, data: check_padded_rows_change_no_other_row("cpu", spec, path, data)))
    # "arena": the in-place form (_triton_body); "wgmma" differs from "cublas" only in its CUDA GEMMs
    # (cublas on CPU)
    for variant in (tuple(v for v in PLAN_NAMES if v != "wgmma") + ("arena",))[shard::shards]:
        for name, strategy, check in checks:
            @settings(max_examples=examples, deadline=None, derandomize=True, database=None)
            @given(spec=strategy, data=st.data())
            def prop(spec, data):
                check(spec, f"triton:{variant}", data)

            S.CASES.clear()
            prop()
            print(f"interpreter-case body_{name}_{variant} {sum(S.CASES.values())}", flush=True)


@pytest.mark.slow
def test_triton_body_properties_in_interpreter():
    """CI coverage of the fused body's Triton driver (every variant) on CPU."""
    import os
    import sys

    pytest.importorskip("triton")
    here = os.path.dirname(os.path.abspath(__file__))
    env = interpreter_env()
    procs = run_shards(lambda i, k: [sys.executable, "-c",
                                     f"import test_properties_model as t; t.interpreter_main(6, {i}, {k})"],
                       env=env, cwd=here, timeout=900)
    for proc in procs:
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
        for name, count in re.findall(r"interpreter-case (\w+) (\d+)", proc.stdout):
            S.CASES[f"{name}[triton-interpreter]"] += int(count)
