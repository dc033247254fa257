"""``cfm_attention`` under torch.compile, autocast and CUDA graphs.

CPU: ``torch.compile(fullgraph=True)`` (inductor) around the op, static and dynamic shapes,
with the free ``(N, Q, H·D)`` reshape after it; autocast fp16/bf16 (AutocastCPU), eager and
compiled. CUDA (gpu-marked): autocast (AutocastCUDA); CUDA-graph capture, inputs and lengths
changed in place, replay bitwise equal to a fresh eager call; every call inside
``torch.cuda.set_sync_debug_mode("error")``; ``torch.compile(mode="reduce-overhead")``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import strategies as S
from oracle import assert_within_oracle, naive_attention64
from torch_cfm import cfm_attention


def attend(q, k, v, key_lengths=None, mask=None, kv_rows=None):
    return cfm_attention(q, k, v, key_lengths=key_lengths, mask=mask, kv_rows=kv_rows)


def attend_and_merge_heads(q, k, v, key_lengths):
    out = cfm_attention(q, k, v, key_lengths=key_lengths)
    n, h, q_len, d = out.shape
    return out.transpose(1, 2).reshape(n, q_len, h * d)


COMPILE_SPECS = [
    pytest.param(S.AttnSpec(2, 2, 5, 40, 32, 1, lengths=(40, 7)), id="lengths"),
    pytest.param(S.AttnSpec(3, 2, 9, 65, 64, 2, lengths=(65, 0, 30), kv_interleaved=True,
                            q_transposed=True, mask_mode="expand_n"), id="strided-mask"),
    pytest.param(S.AttnSpec(3, 1, 4, 33, 16, 3, kv_rows=(2, 0, 2), pool=3, mask_mode="expand_q"),
                 id="pool"),
]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield


@pytest.mark.parametrize("spec", COMPILE_SPECS)
def test_compile_fullgraph_cpu_equals_eager(spec):
    case = S.build_attention(spec, "cpu", torch.float32)
    eager = attend(case.q, case.k, case.v, **case.kwargs())
    compiled = torch.compile(attend, fullgraph=True)(case.q, case.k, case.v, **case.kwargs())
    assert compiled.stride() == eager.stride()
    assert torch.equal(compiled, eager)


def test_compile_dynamic_shapes_and_head_merge_cpu():
    """One dynamic graph serves growing caches and changing lengths; the merge stays exact."""
    fn = torch.compile(attend_and_merge_heads, fullgraph=True, dynamic=True)
    for i, (n, q_len, k_len) in enumerate([(2, 5, 40), (3, 7, 65), (1, 1, 129), (4, 3, 0)]):
        spec = S.AttnSpec(n, 2, q_len, k_len, 32, 20 + i, lengths=tuple(range(k_len, k_len - n, -1)),
                          kv_interleaved=True)
        case = S.build_attention(spec, "cpu", torch.float32)
        got = fn(case.q, case.k, case.v, case.key_lengths)
        want = attend_and_merge_heads(case.q, case.k, case.v, case.key_lengths)
        assert got.shape == (n, q_len, 2 * 32)
        assert torch.equal(got, want), spec.describe()


AUTOCAST = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]


def check_autocast(device: str, ambient: torch.dtype, compiled: bool) -> None:
    spec = S.AttnSpec(2, 2, 6, 70, 64, 5, lengths=(70, 21), mask_mode="expand_q", q_transposed=True)
    case = S.build_attention(spec, device, torch.float32)

    def fn(q, k, v, key_lengths, mask):
        with torch.autocast(device, dtype=ambient):
            return cfm_attention(q, k, v, key_lengths=key_lengths, mask=mask)

    if compiled:
        fn = torch.compile(fn, fullgraph=True)
    out = fn(case.q, case.k, case.v, case.key_lengths, case.mask)
    assert out.dtype == ambient
    cast = S.AttnCase(spec, case.q.to(ambient), case.k.to(ambient), case.v.to(ambient),
                      case.key_lengths, case.mask)
    ref64 = naive_attention64(cast.q, cast.k, cast.v, cast.key_lengths, cast.mask)
    assert_within_oracle(out.cpu(), S.attention_same_dtype(cast).cpu(), ref64)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("ambient", AUTOCAST)
def test_autocast_cpu_follows_ambient_dtype(ambient, compiled):
    check_autocast("cpu", ambient, compiled)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("ambient", AUTOCAST)
def test_autocast_cuda_follows_ambient_dtype(ambient, compiled):
    check_autocast("cuda", ambient, compiled)


# --------------------------------------------------------------------------------------------
# CUDA graphs (gpu-marked)
# --------------------------------------------------------------------------------------------

@contextlib.contextmanager
def no_sync():
    """Any host synchronisation inside raises (torch.cuda.set_sync_debug_mode("error"))."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


class StaticAttention:
    """Fixed buffers for one captured call: q, interleaved cache, lengths, mask base, kv_rows."""

    def __init__(self, n, h, q_len, k_len, d, dtype, pool=None, mask=True, seed=0):
        self.gen = torch.Generator().manual_seed(seed)
        self.n, self.k_len, self.d, self.dtype = n, k_len, d, dtype
        rows = n if pool is None else pool
        self.q_buf = torch.empty(n, q_len, h, d, device="cuda", dtype=dtype)  # q = transposed view
        self.cache = torch.empty(rows, h, k_len, 2 * d, device="cuda", dtype=dtype)
        self.lengths = torch.empty(n, device="cuda", dtype=torch.int32)
        self.mask_base = torch.empty(n, 1, k_len, device="cuda", dtype=torch.bool) if mask else None
        self.kv_rows = torch.empty(n, device="cuda", dtype=torch.int32) if pool else None
        self.pool = pool
        self.refill()

    def refill(self) -> None:
        """New values, lengths, mask and rows written in place (no new tensors)."""
        g = self.gen
        self.q_buf.copy_(torch.randn(self.q_buf.shape, generator=g))
        self.cache.copy_(torch.randn(self.cache.shape, generator=g))
        self.lengths.copy_(torch.randint(0, self.k_len + 1, (self.n,), generator=g, dtype=torch.int32))
        if self.mask_base is not None:
            self.mask_base.copy_(torch.rand(self.mask_base.shape, generator=g) < 0.8)
        if self.kv_rows is not None:
            self.kv_rows.copy_(torch.randint(0, self.pool, (self.n,), generator=g, dtype=torch.int32))

    def args(self):
        n, q_len = self.q_buf.shape[:2]
        mask = None if self.mask_base is None else self.mask_base.expand(n, q_len, self.k_len)
        return dict(q=self.q_buf.transpose(1, 2), k=self.cache[..., :self.d], v=self.cache[..., self.d:],
                    key_lengths=self.lengths, mask=mask, kv_rows=self.kv_rows)

    def call(self, precision="auto"):
        a = self.args()
        return cfm_attention(a.pop("q"), a.pop("k"), a.pop("v"), **a, precision=precision)


GRAPH_MODES = [pytest.param(torch.float16, "auto", id="fp16"), pytest.param(torch.bfloat16, "auto", id="bf16"),
               pytest.param(torch.float32, "tf32", id="fp32-tf32"),
               pytest.param(torch.float32, "ieee", id="fp32-ieee")]
GRAPH_SHAPES = [pytest.param((8, 8, 50, 450, 64, None), id="steady-N8"),
                pytest.param((3, 2, 17, 129, 32, 5), id="pool-odd"),
                pytest.param((1, 1, 1, 600, 128, None), id="Q1-K600"),
                pytest.param((32, 8, 50, 450, 64, None), id="steady-N32")]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GRAPH_SHAPES)
@pytest.mark.parametrize("dtype,precision", GRAPH_MODES)
def test_cuda_graph_replay_equals_fresh_eager(shape, dtype, precision):
    n, h, q_len, k_len, d, pool = shape
    static = StaticAttention(n, h, q_len, k_len, d, dtype, pool=pool)

    def call():
        with no_sync():  # the op itself; S.capture_cuda_graph() synchronises on purpose around it
            return static.call(precision)

    graph, out = S.capture_cuda_graph(call)
    for _ in range(5):
        static.refill()
        with no_sync():
            graph.replay()
            fresh = static.call(precision)
        torch.cuda.synchronize()
        assert torch.equal(out, fresh), "replay differs from a fresh eager call"
        assert torch.isfinite(out).all()


@pytest.mark.gpu
def test_compile_reduce_overhead_cuda_equals_eager():
    static = StaticAttention(4, 2, 20, 200, 64, torch.float16, seed=3)
    fn = torch.compile(attend, mode="reduce-overhead", fullgraph=True)
    for _ in range(4):
        static.refill()
        a = static.args()
        got = fn(a["q"], a["k"], a["v"], a["key_lengths"], a["mask"]).clone()
        want = attend(a["q"], a["k"], a["v"], a["key_lengths"], a["mask"])
        assert torch.equal(got, want)
