"""Failure behaviour: bad input never crashes, and the GPU paths never sync, allocate or drift.

CPU (hypothesis): a valid call is mutated at random (rank, dtype, device, head dim, mismatched
k/v/caches, lengths/mask/kv_rows of the wrong kind, precision) and must raise ``ValueError``
naming the argument; or mutated in a way docs/design.md §4 defines (last-dim / index-vector strides,
negative or huge lengths and pool rows, N=0, H=0, Q=0, K=0) and must give the documented result:

* any strides are accepted: the result equals the same values laid out contiguously;
* key_lengths clamp to [0, K] and kv_rows to [0, R): the result equals the clamped call;
* empty N/H/Q give an empty (N, H, Q, D) output; K = 0 gives exact zeros.

Any other exception (RuntimeError, IndexError, a crash) fails. The same holds for
``DiT.forward_chunk`` with mismatched caches and lengths (tiny config).

GPU (gpu-marked): no host sync inside the op or ``forward_chunk`` (sync debug mode "error"); no
allocation during graph replay; 1000 replays with changing lengths equal fresh eager calls; two
streams with separate buffers run concurrently and correctly; compute-sanitizer memcheck on
``tests/gpu_memcheck.py`` (slow, needs the sanitizer on PATH or in CUDA_HOME).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import strategies as S
from oracle import assert_within_oracle, naive_attention64
from torch_cfm import cfm_attention
from torch_cfm.config import DiTConfig

OP = torch.ops.torch_cfm.cfm_attention.default
BAD_FLOAT_DTYPES = (torch.float64, torch.int32, torch.int64, torch.bool, torch.uint8, torch.complex64)
BAD_INDEX_DTYPES = (torch.int64, torch.int16, torch.uint8, torch.float32, torch.bool)

small_specs = S.attention_specs(n_max=3, k_values=st.integers(0, 70), d_values=st.sampled_from([16, 32]))

ERROR_MUTATIONS = ("rank", "dtype", "kv_dtype", "device", "head_dim", "mismatch", "lengths_kind",
                   "mask_kind", "rows_kind", "precision")
DOC_MUTATIONS = ("last_dim_stride", "index_stride", "wild_lengths", "wild_rows", "empty_n", "empty_h",
                 "empty_q", "empty_k")


def call(a: dict, path: str):
    if path == "op":
        return OP(a["q"], a["k"], a["v"], a["key_lengths"], a["mask"], a["kv_rows"], a["precision"])
    return cfm_attention(a["q"], a["k"], a["v"], key_lengths=a["key_lengths"], mask=a["mask"],
                         kv_rows=a["kv_rows"], precision=a["precision"])


def as_args(case: S.AttnCase, precision: str = "auto") -> dict:
    return dict(q=case.q, k=case.k, v=case.v, key_lengths=case.key_lengths, mask=case.mask,
                kv_rows=case.kv_rows, precision=precision)


def reshape_rank(t: torch.Tensor, rank: int) -> torch.Tensor:
    """Same elements (or a prefix) with ``rank`` dims."""
    flat = t.reshape(-1)
    if rank == 0:
        return flat[0] if flat.numel() else torch.zeros((), dtype=t.dtype)
    return flat.reshape((1,) * (rank - 1) + (-1,))


def mutate_error(draw, case: S.AttnCase, kind: str) -> tuple[dict, str]:
    """A call that must raise ValueError naming the returned argument."""
    a = as_args(case)
    dev = case.q.device
    n, h, q_len, d = case.q.shape
    if kind == "rank":
        name = draw(st.sampled_from(["q", "k", "v"] + [x for x in ("key_lengths", "mask", "kv_rows")
                                                        if a[x] is not None]))
        wanted = {"key_lengths": 1, "kv_rows": 1, "mask": 3}.get(name, 4)
        a[name] = reshape_rank(a[name], draw(st.sampled_from([r for r in range(7) if r != wanted])))
        return a, name
    if kind == "dtype":
        dtype = draw(st.sampled_from(BAD_FLOAT_DTYPES))
        a["q"], a["k"], a["v"] = (a[x].to(dtype) for x in ("q", "k", "v"))
        return a, "q"
    if kind == "kv_dtype":
        name = draw(st.sampled_from(["k", "v"]))
        a[name] = a[name].to(draw(st.sampled_from([x for x in S.DTYPES + (torch.float64,)
                                                   if x != case.q.dtype])))
        return a, name
    if kind == "device":
        name = draw(st.sampled_from(["k", "v"] + [x for x in ("key_lengths", "mask", "kv_rows")
                                                  if a[x] is not None]))
        a[name] = a[name].to("meta")
        return a, name
    if kind == "head_dim":
        new_d = draw(st.integers(1, 300).filter(lambda x: x not in (16, 32, 64, 128)))
        a["q"] = torch.randn(n, h, q_len, new_d, dtype=case.q.dtype, device=dev)
        a["k"] = torch.randn(case.k.shape[:3] + (new_d,), dtype=case.q.dtype, device=dev)
        a["v"] = torch.randn(case.k.shape[:3] + (new_d,), dtype=case.q.dtype, device=dev)
        return a, "q"
    if kind == "mismatch":
        which = draw(st.sampled_from(["rows", "heads", "dim", "keys_v"]))
        rows, _, k_len, _ = case.k.shape
        if which == "keys_v":
            a["v"] = torch.randn(rows, h, k_len + draw(st.integers(1, 5)), d, dtype=case.q.dtype, device=dev)
            return a, "k"
        shape = {"rows": (n + draw(st.sampled_from([-1, 1, 2])) if n > 1 else n + 1, h, k_len, d),
                 "heads": (rows, h + draw(st.integers(1, 3)), k_len, d),
                 "dim": (rows, h, k_len, 2 * d)}[which]
        if which == "rows":
            a["kv_rows"] = None
        a["k"] = torch.randn(shape, dtype=case.q.dtype, device=dev)
        a["v"] = torch.randn(shape, dtype=case.q.dtype, device=dev)
        return a, "k"
    if kind == "lengths_kind":
        choice = draw(st.sampled_from(["dtype", "size", "list"]))
        lengths = torch.full((n,), 3, dtype=torch.int32, device=dev)
        if choice == "dtype":
            a["key_lengths"] = lengths.to(draw(st.sampled_from(BAD_INDEX_DTYPES)))
        elif choice == "size":
            a["key_lengths"] = torch.zeros(n + draw(st.sampled_from([-1, 1, 5])), dtype=torch.int32)
        else:
            a["key_lengths"] = [3] * n
        return a, "key_lengths"
    if kind == "mask_kind":
        k_len = case.k.shape[2]
        choice = draw(st.sampled_from(["dtype", "shape"]))
        if choice == "dtype":
            a["mask"] = torch.ones(n, q_len, k_len, dtype=draw(st.sampled_from(BAD_INDEX_DTYPES[:-1])), device=dev)
        else:
            shape = draw(st.sampled_from([(n, q_len, k_len + 1), (1, q_len, k_len), (n, 1, k_len),
                                          (n, q_len + 1, k_len), (n + 1, q_len, k_len)]))
            if shape == (1, q_len, k_len) and n == 1 or shape == (n, 1, k_len) and q_len == 1:
                shape = (n, q_len, k_len + 2)
            a["mask"] = torch.ones(shape, dtype=torch.bool, device=dev)
        return a, "mask"
    if kind == "rows_kind":
        a["k"], a["v"] = case.k, case.v
        if draw(st.booleans()):
            a["kv_rows"] = torch.zeros(n, dtype=draw(st.sampled_from(BAD_INDEX_DTYPES)), device=dev)
        else:
            a["kv_rows"] = torch.zeros(n + draw(st.sampled_from([-1, 2])), dtype=torch.int32)
        return a, "kv_rows"
    a["precision"] = draw(st.sampled_from(["", "TF32", "fp16", "highest", "bf16", "none"]))
    return a, "precision"


def contiguous_args(a: dict) -> dict:
    return {k: (v.contiguous() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}


def check_documented(draw, spec: S.AttnSpec, dtype: torch.dtype, kind: str, path: str,
                     dev: str = "cpu") -> None:
    """Mutations with a defined meaning: run them and compare with what docs/design.md §4 says."""
    if kind in ("empty_n", "empty_h", "empty_q", "empty_k"):
        field = {"empty_n": "n", "empty_h": "h", "empty_q": "q_len", "empty_k": "k_len"}[kind]
        spec = replace(spec, **{field: 0})
        if kind == "empty_n":
            spec = replace(spec, lengths=None if spec.lengths is None else (),
                           kv_rows=None if spec.kv_rows is None else (), dead_queries=())
        if kind == "empty_q":
            spec = replace(spec, dead_queries=())
        case = S.build_attention(spec, dev, dtype)
        out = call(as_args(case), path)
        assert out.shape == case.q.shape and out.dtype == dtype
        if kind == "empty_k":
            assert (out == 0).all(), "K = 0 must give exact zeros"
        return
    if kind in ("index_stride", "wild_lengths") and spec.lengths is None:
        spec = replace(spec, lengths=(spec.k_len,) * spec.n)
    if kind == "wild_rows" and spec.kv_rows is None:
        spec = replace(spec, kv_rows=tuple(range(spec.n))[::-1], pool=spec.n)
    case = S.build_attention(spec, dev, dtype)
    a = as_args(case)
    if kind == "last_dim_stride":
        name = draw(st.sampled_from(["q", "k", "v"]))
        t = a[name]
        if draw(st.booleans()):  # stride 2: every other element of a wider buffer
            wide = torch.empty(t.shape[:3] + (2 * t.shape[3],), dtype=t.dtype, device=dev)
            wide[..., ::2] = t
            a[name] = wide[..., ::2]
        else:  # stride 0: one value broadcast over D
            a[name] = t[..., :1].expand(t.shape)
        expect = call(contiguous_args(a), path)
    elif kind == "index_stride":
        present = [x for x in ("key_lengths", "kv_rows") if a[x] is not None]
        name = draw(st.sampled_from(present))
        t = a[name]
        wide = torch.full((2 * t.shape[0],), -1, dtype=t.dtype, device=dev)
        wide[::2] = t
        a[name] = wide[::2]
        expect = call(contiguous_args(a), path)
    elif kind == "wild_lengths":
        k_len = case.k.shape[2]
        wild = draw(st.lists(S.wild_lengths(k_len), min_size=spec.n, max_size=spec.n))
        a["key_lengths"] = torch.tensor(wild, dtype=torch.int32, device=dev)
        clamped = torch.tensor(wild, dtype=torch.int64, device=dev).clamp(0, k_len).int()
        expect = call(dict(a, key_lengths=clamped), path)
    else:  # wild_rows: pool rows out of [0, R) clamp
        rows = draw(st.lists(st.sampled_from([-(2**31), -1, spec.pool, spec.pool + 7, 2**31 - 1]),
                             min_size=spec.n, max_size=spec.n))
        a["kv_rows"] = torch.tensor(rows, dtype=torch.int32, device=dev)
        clamped = torch.tensor(rows, dtype=torch.int64, device=dev).clamp(0, spec.pool - 1).int()
        expect = call(dict(a, kv_rows=clamped), path)
    out = call(a, path)
    assert out.shape == expect.shape and out.dtype == expect.dtype
    assert_within_oracle(out.cpu(), expect.cpu(), naive_attention64(a["q"], a["k"], a["v"], a["key_lengths"], a["mask"],
                                                        a["kv_rows"]), name=f"{kind}: {spec.describe()}")


GPU_SETTINGS = S.gpu_settings()


def check_bad_input(path, kind, device, spec, dtype, data):
    S.tried(f"bad_input_error[{path},{device}]")
    args, name = mutate_error(data.draw, S.build_attention(spec, device, dtype), kind)
    if path == "op" and not all(isinstance(args[x], torch.Tensor) or args[x] is None
                                for x in ("key_lengths", "mask", "kv_rows")):
        return  # the schema itself rejects non-tensors (TypeError from the dispatcher)
    with pytest.raises(ValueError) as info:
        call(args, path)
    assert re.search(rf"cfm_attention: {name}\b", str(info.value)), (
        f"{kind}: message does not name {name!r}: {info.value}")


@pytest.mark.parametrize("kind", ERROR_MUTATIONS)
@pytest.mark.parametrize("path", ["public", "op"])
@given(spec=small_specs, dtype=S.dtypes, data=st.data())
def test_bad_input_raises_value_error_naming_argument_cpu(path, kind, spec, dtype, data):
    check_bad_input(path, kind, "cpu", spec, dtype, data)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ERROR_MUTATIONS)
@pytest.mark.parametrize("path", ["public", "op"])
@GPU_SETTINGS
@given(spec=small_specs, dtype=S.dtypes, data=st.data())
def test_bad_input_raises_value_error_naming_argument_cuda(path, kind, spec, dtype, data):
    check_bad_input(path, kind, "cuda", spec, dtype, data)


@pytest.mark.parametrize("kind", DOC_MUTATIONS)
@pytest.mark.parametrize("path", ["public", "op"])
@given(spec=small_specs, dtype=S.dtypes, data=st.data())
def test_odd_but_valid_input_gives_documented_result_cpu(path, kind, spec, dtype, data):
    S.tried(f"documented_input[{path},cpu]")
    check_documented(data.draw, spec, dtype, kind, path, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", DOC_MUTATIONS)
@GPU_SETTINGS
@given(spec=small_specs, dtype=S.dtypes, data=st.data())
def test_odd_but_valid_input_gives_documented_result_cuda(kind, spec, dtype, data):
    S.tried("documented_input[public,cuda]")
    check_documented(data.draw, spec, dtype, kind, "public", "cuda")


# --------------------------------------------------------------------------------------------
# DiT.forward_chunk with mismatched caches (tiny config)
# --------------------------------------------------------------------------------------------

TINY = DiTConfig(hidden=32, depth=2, heads=2, head_dim=16)


@pytest.fixture(scope="module")
def tiny_model():
    dit = pytest.importorskip("torch_cfm.models.dit")
    return dit.random_dit(TINY, seed=1).eval()


def chunk_inputs(n: int, t_len: int, l_len: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    c, h, d = TINY.hidden, TINY.heads, TINY.head_dim
    return dict(x=torch.randn(n, 80, t_len, generator=g), mu=torch.randn(n, 80, t_len, generator=g),
                t=torch.rand(n, generator=g), spks=torch.randn(n, 80, generator=g),
                cond=torch.randn(n, 80, t_len, generator=g),
                cnn_cache=torch.randn(TINY.depth, n, 2 * c, 2, generator=g),
                att_cache=torch.randn(TINY.depth, n, h, l_len, 2 * d, generator=g),
                valid_lengths=torch.full((n,), t_len, dtype=torch.int32),
                cache_lengths=torch.full((n,), l_len, dtype=torch.int32))


def forward_chunk(model, a: dict):
    return model.forward_chunk(a["x"], a["mu"], a["t"], a["spks"], a["cond"], a["cnn_cache"], a["att_cache"],
                               valid_lengths=a["valid_lengths"], cache_lengths=a["cache_lengths"])


CHUNK_BAD = [
    ("x", lambda a: dict(a, x=a["x"][:, :40])),
    ("x", lambda a: dict(a, x=a["x"][0])),
    ("mu", lambda a: dict(a, mu=a["mu"][:, :, :-1])),
    ("cond", lambda a: dict(a, cond=a["cond"][:1])),
    ("spks", lambda a: dict(a, spks=a["spks"][:, :40])),
    ("att_cache", lambda a: dict(a, att_cache=a["att_cache"][:1])),  # wrong depth
    ("att_cache", lambda a: dict(a, att_cache=a["att_cache"][:, :1])),  # wrong N
    ("att_cache", lambda a: dict(a, att_cache=a["att_cache"][..., :16])),  # wrong 2D
    ("att_cache", lambda a: dict(a, att_cache=a["att_cache"][:, :, :1])),  # wrong H
    ("att_cache", lambda a: dict(a, att_cache=a["att_cache"][0])),  # rank 4
    ("att_cache", lambda a: dict(a, att_cache=a["att_cache"].to("meta"))),
    ("cnn_cache", lambda a: dict(a, cnn_cache=a["cnn_cache"][..., :1])),
    ("cnn_cache", lambda a: dict(a, cnn_cache=a["cnn_cache"][:, :, :32])),
    ("cnn_cache", lambda a: dict(a, cnn_cache=a["cnn_cache"][:, :1])),
    ("valid_lengths", lambda a: dict(a, valid_lengths=a["valid_lengths"].long())),
    ("valid_lengths", lambda a: dict(a, valid_lengths=a["valid_lengths"][:1])),
    ("cache_lengths", lambda a: dict(a, cache_lengths=a["cache_lengths"].float())),
    ("cache_lengths", lambda a: dict(a, cache_lengths=a["cache_lengths"][None])),
]


@pytest.mark.parametrize("name,mutate", CHUNK_BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(CHUNK_BAD)])
def test_forward_chunk_bad_input_names_argument(tiny_model, name, mutate):
    a = mutate(chunk_inputs(2, 6, 5))
    with pytest.raises(ValueError) as info:
        forward_chunk(tiny_model, a)
    assert re.search(rf"^\S+: {name}\b", str(info.value)), f"does not name {name!r}: {info.value}"


@given(valid=st.lists(st.sampled_from([-(2**31), -3, 0, 2, 6, 7, 2**31 - 1]), min_size=3, max_size=3),
       cached=st.lists(st.sampled_from([-(2**31), -1, 0, 3, 5, 6, 2**31 - 1]), min_size=3, max_size=3))
def test_forward_chunk_wild_lengths_are_clamped(tiny_model, valid, cached):
    """Out-of-range valid/cache lengths clamp to [0, T] / [0, L] (documented in forward_chunk)."""
    S.tried("forward_chunk_clamped_lengths")
    model = tiny_model
    a = chunk_inputs(3, 6, 5, seed=2)
    wild = dict(a, valid_lengths=torch.tensor(valid, dtype=torch.int32),
                cache_lengths=torch.tensor(cached, dtype=torch.int32))
    clamped = dict(a, valid_lengths=torch.tensor(valid, dtype=torch.int64).clamp(0, 6).int(),
                   cache_lengths=torch.tensor(cached, dtype=torch.int64).clamp(0, 5).int())
    with torch.no_grad():
        got, want = forward_chunk(model, wild), forward_chunk(model, clamped)
    for g, w, what in zip(got, want, ("velocity", "cnn_cache", "att_cache")):
        assert g.shape == w.shape
        assert torch.equal(g, w), f"{what} differs from the clamped call"


# --------------------------------------------------------------------------------------------
# GPU: sync, allocation, drift, streams, sanitizer
# --------------------------------------------------------------------------------------------

GPU_DTYPES = [pytest.param(torch.float16, "auto", id="fp16"), pytest.param(torch.bfloat16, "auto", id="bf16"),
              pytest.param(torch.float32, "tf32", id="fp32-tf32"),
              pytest.param(torch.float32, "ieee", id="fp32-ieee")]


class no_sync:
    def __enter__(self):
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(0)


def ragged_case(dtype, n=8, q_len=50, k_len=450, seed=0, pool=None):
    spec = S.AttnSpec(n, 8, q_len, k_len, 64, seed, lengths=tuple((k_len - 37 * i) % (k_len + 1) for i in range(n)),
                      kv_rows=None if pool is None else tuple(i % pool for i in range(n)), pool=pool,
                      mask_mode="expand_q", mask_density=0.9, kv_interleaved=True, q_transposed=True)
    return S.build_attention(spec, "cuda", dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,precision", GPU_DTYPES)
def test_op_never_syncs(dtype, precision):
    for pool in (None, 3):
        case = ragged_case(dtype, pool=pool)
        cfm_attention(case.q, case.k, case.v, **case.kwargs(), precision=precision)  # compile first
        with no_sync():
            for _ in range(3):
                cfm_attention(case.q, case.k, case.v, **case.kwargs(), precision=precision)
        torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_forward_chunk_never_syncs(dtype):
    dit = pytest.importorskip("torch_cfm.models.dit")
    model = dit.random_dit(TINY, seed=1).to("cuda", dtype).eval()
    a = {k: (v.to("cuda", dtype) if v.is_floating_point() else v.to("cuda"))
         for k, v in chunk_inputs(3, 10, 12).items()}
    a["valid_lengths"] = torch.tensor([10, 4, 0], dtype=torch.int32, device="cuda")
    a["cache_lengths"] = torch.tensor([12, 0, 7], dtype=torch.int32, device="cuda")
    with torch.no_grad():
        forward_chunk(model, a)
        with no_sync():
            out = forward_chunk(model, a)
    torch.cuda.synchronize()
    assert all(torch.isfinite(o).all() for o in out)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,precision", GPU_DTYPES)
def test_replay_never_allocates_and_1000_replays_do_not_drift(dtype, precision):
    case = ragged_case(dtype, n=8)
    n, k_len = case.q.shape[0], case.k.shape[2]
    gen = torch.Generator().manual_seed(5)
    table = torch.randint(-5, k_len + 6, (1000, n), generator=gen, dtype=torch.int32).cuda()
    graph, out = S.capture_cuda_graph(lambda: cfm_attention(case.q, case.k, case.v, **case.kwargs(), precision=precision))
    torch.cuda.synchronize()
    worst = torch.zeros((), device="cuda")
    mismatches = torch.zeros((), device="cuda", dtype=torch.int64)
    with no_sync():
        for i in range(1000):
            case.key_lengths.copy_(table[i])  # device-to-device, no host
            graph.replay()
            if i % 10 == 0 or i >= 990:
                fresh = cfm_attention(case.q, case.k, case.v, **case.kwargs(), precision=precision)
                diff = (out.float() - fresh.float()).abs().nan_to_num(float("inf")).amax()
                worst = torch.maximum(worst, diff)
                mismatches += (out != fresh).sum()
    torch.cuda.synchronize()
    assert worst.item() == 0 and mismatches.item() == 0, f"replay drifted from eager: max diff {worst.item()}"
    # the eager checks above allocate; replay alone must not: measure it separately
    base = torch.cuda.memory_stats()["allocation.all.allocated"]
    with no_sync():
        for i in range(100):
            case.key_lengths.copy_(table[i])
            graph.replay()
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == base, "graph replay allocated"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,precision", GPU_DTYPES[:1] + GPU_DTYPES[2:3])
def test_two_streams_with_separate_buffers(dtype, precision):
    cases = [ragged_case(dtype, n=8, seed=1), ragged_case(dtype, n=4, q_len=30, k_len=300, seed=2, pool=3)]
    expect = [cfm_attention(c.q, c.k, c.v, **c.kwargs(), precision=precision) for c in cases]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs: list = [[], []]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    with no_sync():
        for _ in range(20):  # interleave launches so both streams have work in flight
            for i, (s, c) in enumerate(zip(streams, cases)):
                with torch.cuda.stream(s):
                    outs[i].append(cfm_attention(c.q, c.k, c.v, **c.kwargs(), precision=precision))
    torch.cuda.synchronize()
    for i in range(2):
        for o in outs[i]:
            assert torch.equal(o, expect[i]), f"stream {i} result differs"
    # and as two graphs replayed concurrently on their own streams
    graphs = [S.capture_cuda_graph(lambda c=c: cfm_attention(c.q, c.k, c.v, **c.kwargs(), precision=precision))
              for c in cases]
    for c in cases:
        c.key_lengths.copy_(c.key_lengths.flip(0))
    fresh = [cfm_attention(c.q, c.k, c.v, **c.kwargs(), precision=precision) for c in cases]
    torch.cuda.synchronize()
    with no_sync():
        for _ in range(20):
            for s, (g, _) in zip(streams, graphs):
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    g.replay()
    torch.cuda.synchronize()
    for (g, out), want in zip(graphs, fresh):
        assert torch.equal(out, want)


def _sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    path = os.path.join(home, "bin", "compute-sanitizer")
    return path if os.path.exists(path) else None


@pytest.mark.gpu
@pytest.mark.slow
def test_compute_sanitizer_memcheck_triton_kernels():
    tool = _sanitizer()
    if tool is None:
        pytest.skip("compute-sanitizer not found")
    script = os.path.join(os.path.dirname(__file__), "gpu_memcheck.py")
    proc = subprocess.run([tool, "--tool", "memcheck", "--error-exitcode", "97", sys.executable, script, "--quick"],
                          capture_output=True, text=True, timeout=540)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    assert "ERROR SUMMARY: 0 errors" in proc.stdout + proc.stderr, tail
