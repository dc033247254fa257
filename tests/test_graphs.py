"""CUDA graphs of the arena solve (torch_cfm.graphs.GraphCache, torch_cfm.solve.GraphedArenaSolver):
the cache's keys, LRU budget and counters, the bucket policy, arena solves of bucketed shapes vs
the float64 oracle, CUDA-graph replay == eager bitwise, capture-failure fallback (gpu marker),
the graphed solver in the server.

The CPU solve runs the fused route's Triton kernels under ``TRITON_INTERPRET=1`` in a child
process (see tests/test_cfm_attention_triton.py for why); the parent checks against
``dit_oracle.solve_request``.
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch

from interpreter_child import run_child_file
import dit_oracle as O
from oracle import assert_within_oracle
from test_dit_body import GPU_CFG, TINY
from torch_cfm.buckets import Buckets, padded_count, round_up
from torch_cfm.config import cosine_timesteps
from torch_cfm.graphs import GraphCache
from torch_cfm import policy
from torch_cfm.kernels import body_plans
from torch_cfm.models import CacheArena, random_dit
from torch_cfm.models.cache import keyed_to_newest_first
from torch_cfm.solve import ArenaSolver, GraphedArenaSolver

N_STEPS = 3


def _solve_inputs(cfg, b, t, l_len, n_steps, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)

    mu, cond, spks = r(b, 80, t), r(b, 80, t), r(b, 80)
    noise = r(1, 80, 200)
    att = r(n_steps, cfg.depth, 2 * b, cfg.heads, l_len, 2 * cfg.head_dim)
    cnn = r(n_steps, cfg.depth, 2 * b, 2 * cfg.hidden, 2)
    return mu, spks, cond, noise, att, cnn


def test_graph_cache_keys_lru_and_counters():
    cache = GraphCache("t", max_graphs=2)
    calls = []
    for key in ("a", "b", "a", "c"):  # "b" is the least recently used when "c" arrives
        cache.run(key, lambda k=key: calls.append(k), device=torch.device("cpu"), label=key)
    assert calls == ["a", "b", "a", "c"]  # off CUDA every call runs eagerly
    assert [e.label for e in cache.entries()] == ["a", "c"]
    assert (cache.hits, cache.misses, cache.captures, cache.graph_count) == (1, 3, 0, 0)
    assert any("evicted a graph (LRU, budget 2)" in e for e in cache.events)
    assert cache.calls_per_capture(torch.device("cpu")) == 1
    assert cache.calls_per_capture(torch.device("cuda")) == 2
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_graphs"):
            GraphCache("t", max_graphs=bad)
        with pytest.raises(ValueError, match="warmup"):
            GraphCache("t", warmup=bad)


def test_bucket_policy():
    b = Buckets.of(chunks=(16, 8), caches=(0, 8), slots=(4, 1, 2))
    assert (b.chunks, b.caches, b.slots) == ((8, 16), (0, 8), (1, 2, 4))
    assert (b.chunk(9, 100), b.cache(5, 100), b.slot_count(3, 100)) == (16, 8, 4)
    assert b.chunk(17, 20) == 20 and b.slot_count(5, 4) == 4  # past the last bucket: the limit
    assert Buckets().chunk(7, 100) == 7 and round_up(7, None, 100) == 7  # no table: exact
    assert [padded_count(n, (1, 2, 4)) for n in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, 5]  # past the last: itself
    assert padded_count(3, None) == padded_count(3, ()) == 3
    g = Buckets.for_graphs(max_chunk_frames=300, max_cache_frames=400, max_slots=20)
    assert g.chunks[-1] == 300 and 56 in g.chunks and 50 in g.chunks
    assert g.caches == tuple(range(0, 400, 50)) + (400,)
    assert g.slots == (1, 2, 4, 8, 12, 16, 20)


# (B, T, L) requests solved in a bucketed arena: B slots, T chunk frames, L cache frames; lengths
# per request (ragged) or None
ARENA_CASES = [
    dict(name="bucketed_ragged", b=2, t=6, l_len=4, valid=[6, 3], cached=[4, 2], bucket=(4, 8, 6)),
    dict(name="exact_nocache", b=1, t=5, l_len=0, valid=None, cached=None, bucket=(1, 5, 0)),
]


def bucket_arena(model, bucket, n_steps, dtype, device) -> CacheArena:
    """A keyed arena of one (B, T, L) bucket: B slots of L + T frames (no append room)."""
    batch, t_len, cache_len = bucket
    return CacheArena.allocate(model.config, n_steps, batch, cache_len + t_len, t_len, torch.device(device), dtype)


def stage(arena: CacheArena, mu, spks, cond, att, cnn, valid=None, cached=None) -> None:
    """B requests' inputs and newest-first caches (rows [cond x B | uncond x B]) into the first B
    slots of ``arena`` (frame j = key j); the other slots idle."""
    b, _, t_len = mu.shape
    dev, dtype, rows = arena.att.device, arena.att.dtype, arena.rows
    cache_len = 0 if att is None else att.shape[4]
    for t in (arena.mu, arena.cond, arena.spks, arena.cnn, arena.valid_lengths, arena.cache_lengths,
              arena.prompt_lengths):
        t.zero_()
    arena.mu[:b, :, :t_len] = mu.to(dev, dtype)
    arena.cond[:b, :, :t_len] = cond.to(dev, dtype)
    arena.spks[:b] = spks.to(dev, dtype)
    arena.valid_lengths[:b] = torch.full((b,), t_len, dtype=torch.int32) if valid is None else valid
    arena.cache_lengths[:b] = torch.full((b,), cache_len, dtype=torch.int32) if cached is None else cached
    arena.prompt_lengths.fill_(arena.max_cache_frames)  # no trim
    arena.frame_keys.copy_(torch.arange(arena.max_cache_frames, device=dev, dtype=torch.int32))
    slots = torch.cat([torch.arange(b), rows + torch.arange(b)]).to(dev)
    if att is not None and cache_len:
        arena.att[:, :, slots, :, :cache_len] = att.to(dev, dtype)
    arena.cnn[:, :, slots] = cnn.to(dev, dtype)


def solved(arena: CacheArena, b: int, t_len: int, width: int):
    """(mel (B, 80, T), cnn, att newest first (n, depth, 2B, H, width, 2D)) of the first B slots."""
    dev, rows = arena.att.device, arena.rows
    slots = torch.cat([torch.arange(b), rows + torch.arange(b)]).to(dev)
    keys = arena.frame_keys[torch.cat([torch.arange(b), torch.arange(b)]).to(dev)]
    lengths = torch.cat([arena.cache_lengths[:b]] * 2)
    att = keyed_to_newest_first(arena.att[:, :, slots], keys, lengths, width)
    return arena.out_mel[:b, :, :t_len].clone(), arena.cnn[:, :, slots].clone(), att


def _arena_solve(case):
    model = random_dit(TINY, seed=1)
    mu, spks, cond, noise, att, cnn = _solve_inputs(TINY, case["b"], case["t"], case["l_len"], N_STEPS, seed=2)
    arena = bucket_arena(model, case["bucket"], N_STEPS, torch.float32, "cpu")
    valid = None if case["valid"] is None else torch.tensor(case["valid"], dtype=torch.int32)
    cached = None if case["cached"] is None else torch.tensor(case["cached"], dtype=torch.int32)
    stage(arena, mu, spks, cond, att if case["l_len"] else None, cnn, valid, cached)
    _, t_bucket, l_bucket = case["bucket"]
    ArenaSolver(model, n_timesteps=N_STEPS)(arena, noise, t_len=t_bucket, cache_frames=l_bucket)
    return model, solved(arena, case["b"], case["t"], case["t"] + case["l_len"])


def _child(out_path: str) -> None:
    """The fused route forced on CPU (the policy never picks it there): the Triton body on the
    bucket's in-place arena, as on the GPU."""
    from torch_cfm.solve import steppers

    calls = []
    steppers.fused_precision = lambda *args: calls.append(args) or "ieee"
    results = {c["name"]: _arena_solve(c)[1] for c in ARENA_CASES}
    assert calls, "the fused route was not taken"
    torch.save(results, out_path)


@pytest.fixture(scope="module")
def arena_results(tmp_path_factory):
    out_path = str(tmp_path_factory.mktemp("graphs_interp") / "out.pt")
    return run_child_file(__file__, out_path)


def _oracle_request(sd, case, b, mu, spks, cond, noise, att, cnn, dtype=torch.float64, n_steps=N_STEPS):
    """dit_oracle.solve_request for request b on its valid frames; (mel, cnn, att) in ``dtype``.
    Each request starts from the noise at its own cache length (docs/design.md §3)."""
    bsz = case["b"]
    tn = case["t"] if case["valid"] is None else case["valid"][b]
    ln = case["l_len"] if case["cached"] is None else case["cached"][b]
    d = dtype
    sd = O.to_dtype(sd, d)
    a = att[:, :, [b, bsz + b], :, :ln].to(d) if case["l_len"] else None
    c = cnn[:, :, [b, bsz + b]].to(d)
    return O.solve_request(sd, mu[b, :, :tn].to(d), spks[b].to(d), cond[b, :, :tn].to(d), noise.to(d), n_steps, 0.7,
                           c, a), tn, ln


@pytest.mark.parametrize("case", ARENA_CASES, ids=[c["name"] for c in ARENA_CASES])
def test_bucketed_arena_solve_matches_oracle(case, arena_results):
    mel, cnn_out, att_out = arena_results[case["name"]]
    model = random_dit(TINY, seed=1)
    mu, spks, cond, noise, att, cnn = _solve_inputs(TINY, case["b"], case["t"], case["l_len"], N_STEPS, seed=2)
    sd = model.state_dict()
    bsz = case["b"]
    assert mel.shape == (bsz, 80, case["t"])
    assert att_out.shape[:3] == (N_STEPS, TINY.depth, 2 * bsz)
    for b in range(bsz):
        (r_mel, r_cnn, r_att), tn, ln = _oracle_request(sd, case, b, mu, spks, cond, noise, att, cnn)
        (s_mel, s_cnn, s_att), _, _ = _oracle_request(sd, case, b, mu, spks, cond, noise, att, cnn, torch.float32)
        rows = [b, bsz + b]
        assert r_mel.abs().max() > 0.1
        assert_within_oracle(mel[b, :, :tn], s_mel, r_mel, "mel")
        assert_within_oracle(cnn_out[:, :, rows], s_cnn, r_cnn, "cnn")
        assert_within_oracle(att_out[:, :, rows, :, :tn + ln], s_att, r_att, "att")


# --------------------------------------------------------------------------------------------
# GPU: graphs
# --------------------------------------------------------------------------------------------

class _GpuBucket:
    """One (B=4, T=50, L=64) bucket arena of the GPU model, solved eagerly or through a graph cache
    (no trim: the threshold lies past L + T)."""

    def __init__(self, dtype, precision=None):
        self.model = random_dit(GPU_CFG, seed=11).to(device="cuda", dtype=dtype)
        self.arena = bucket_arena(self.model, (4, 50, 64), 4, dtype, "cuda")
        self.noise = torch.randn(1, 80, 200, generator=torch.Generator().manual_seed(3)).cuda()
        self.solver = ArenaSolver(self.model, n_timesteps=4, keep_oldest=114)
        self.cache = GraphCache("test", max_graphs=4)
        self.graphed = GraphedArenaSolver(self.solver, self.cache)
        self.tf32 = None if dtype != torch.float32 or precision is None else precision == "tf32"

    def run(self, graphs: bool = True) -> None:
        scope = contextlib.nullcontext() if self.tf32 is None else policy.tf32_scope(self.tf32)
        with scope, torch.no_grad():
            (self.graphed if graphs else self.solver)(self.arena, self.noise, t_len=50, cache_frames=64)

    def captured(self) -> bool:
        return self.cache.graph_count == 1


def _fill(arena, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    for t in (arena.mu, arena.cond, arena.spks, arena.att, arena.cnn):
        t.copy_(torch.randn(t.shape, generator=g, device="cuda", dtype=torch.float32))
    rows = arena.rows
    arena.valid_lengths.copy_(torch.randint(0, 51, (rows,), generator=g, device="cuda", dtype=torch.int32))
    arena.cache_lengths.copy_(torch.randint(0, 65, (rows,), generator=g, device="cuda", dtype=torch.int32))
    arena.prompt_lengths.zero_()
    arena.frame_keys.copy_(torch.arange(arena.max_cache_frames, device="cuda", dtype=torch.int32))


def _state(arena):
    return {k: v.clone() for k, v in arena.tensors().items()}


def _restore(arena, state):
    for k, v in state.items():
        getattr(arena, k).copy_(v)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,plan", [(torch.float16, None), (torch.bfloat16, None), (torch.float32, None),
                                        (torch.float16, "cublas"), (torch.bfloat16, "cublas"),
                                        (torch.float32, "cublas"), (torch.float16, "fused_attention"),
                                        (torch.float32, "fused_attention")],
                         ids=["fp16", "bf16", "fp32", "fp16-cublas", "bf16-cublas", "fp32-cublas",
                              "fp16-fused_attention", "fp32-fused_attention"])
def test_gpu_replay_equals_eager_bitwise(dtype, plan):
    """The table's plan (8 rows: the wgmma plan where its kernel is built), and cublas / fused_attention
    forced (their arena forms)."""
    with body_plans.use_plan(plan) if plan else contextlib.nullcontext():
        _replay_equals_eager_bitwise(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,precision", [(torch.float16, None), (torch.float32, "tf32")], ids=["fp16", "tf32"])
def test_gpu_replay_equals_eager_bitwise_tf32(dtype, precision):
    """The fp16 and TF32 bodies of 8 rows (the wgmma plans on SM90a, all launched with PDL): replays == eager,
    bitwise."""
    _replay_equals_eager_bitwise(dtype, precision=precision)


def _replay_equals_eager_bitwise(dtype, **kw):
    bucket = _GpuBucket(dtype, **kw)
    arena = bucket.arena
    for _ in range(bucket.cache.calls_per_capture(torch.device("cuda"))):  # eager warm-up, then the capture
        _fill(arena, 0)
        bucket.run()
    assert bucket.captured(), bucket.cache.events
    _fill(arena, 1)
    start = _state(arena)
    # poison the outputs (the in-place arena holds its inputs too: only what lies past each row's old keys)
    arena.out_mel.fill_(float("nan"))
    frames = torch.arange(arena.att.shape[4], device="cuda")
    old = torch.cat([arena.cache_lengths] * 2).long()
    past = (frames[None, :] >= old[:, None]).view(1, 1, -1, 1, frames.numel(), 1)
    arena.att.masked_fill_(past, float("nan"))
    bucket.run()
    replayed = _state(arena)
    _restore(arena, start)
    bucket.run()  # a second replay from the same state gives the same outputs
    assert torch.equal(replayed["out_mel"], arena.out_mel)
    _restore(arena, start)
    bucket.run(graphs=False)
    torch.cuda.synchronize()
    assert torch.equal(replayed["cache_lengths"], arena.cache_lengths)
    assert torch.equal(replayed["frame_keys"], arena.frame_keys)
    # frames past a row's new cache length are never written: compare the rest
    new = torch.cat([arena.cache_lengths] * 2).long()
    written = (frames[None, :] < new[:, None]).view(1, 1, -1, 1, frames.numel(), 1)
    assert torch.equal(torch.where(written, replayed["att"], 0), torch.where(written, arena.att, 0))
    valid = arena.valid_lengths.bool()
    for k in ("out_mel", "cnn"):
        assert torch.equal(replayed[k], getattr(arena, k)), k
    assert torch.isfinite(replayed["out_mel"][valid].float()).all()


@pytest.mark.gpu
def test_gpu_bucket_solve_matches_reference_solver():
    dtype = torch.float16
    bucket = _GpuBucket(dtype)
    case = dict(b=3, t=50, l_len=64, valid=[50, 31, 2], cached=[64, 10, 0])
    mu, spks, cond, noise, att, cnn = _solve_inputs(GPU_CFG, 3, 50, 64, 4, seed=5)
    bucket.noise = noise[0].float().cuda()[None]
    valid, cached = torch.tensor(case["valid"], dtype=torch.int32), torch.tensor(case["cached"], dtype=torch.int32)
    for _ in range(bucket.cache.calls_per_capture(torch.device("cuda"))):  # staged again until its graph exists
        stage(bucket.arena, mu, spks, cond, att, cnn, valid, cached)
        bucket.run()
    assert bucket.captured(), bucket.cache.events
    mel, cnn_out, att_out = solved(bucket.arena, 3, 50, 114)
    model = bucket.model
    d = lambda t: t.to(device="cuda", dtype=dtype)  # noqa: E731
    sd = random_dit(GPU_CFG, seed=11).state_dict()
    for b in range(3):
        (r_mel, r_cnn, r_att), tn, ln = _oracle_request(sd, dict(case, name=""), b, mu, spks, cond, noise, att, cnn,
                                                        n_steps=4)
        # same-dtype reference: the model's reference path step by step in fp16 on the GPU
        ts = [float(v) for v in cosine_timesteps(4, torch.float64)]
        xs = noise[0, :, ln:ln + tn][None].float().cuda()
        rows_c = d(cnn[:, :, [b, 3 + b]])
        rows_a = d(att[:, :, [b, 3 + b], :, :ln])
        zeros = torch.zeros_like(d(mu[b:b + 1, :, :tn]))
        mu2 = torch.cat([d(mu[b:b + 1, :, :tn]), zeros])
        sp2 = torch.cat([d(spks[b:b + 1]), torch.zeros_like(d(spks[b:b + 1]))])
        co2 = torch.cat([d(cond[b:b + 1, :, :tn]), zeros])
        s_cnn, s_att = [], []
        for i in range(4):
            xi = xs.to(dtype).expand(2, -1, -1)
            v, c_i, a_i = model.forward_chunk(xi, mu2, torch.full((2,), ts[i], device="cuda"), sp2, co2,
                                              rows_c[i], rows_a[i], fused=False)
            xs = xs + (ts[i + 1] - ts[i]) * (1.7 * v[0:1].float() - 0.7 * v[1:2].float())
            s_cnn.append(c_i)
            s_att.append(a_i)
        rows = [b, 3 + b]
        assert_within_oracle(mel[b, :, :tn].cpu(), xs[0].to(dtype).cpu(), r_mel, "mel")
        assert_within_oracle(cnn_out[:, :, rows].cpu(), torch.stack(s_cnn).cpu(), r_cnn, "cnn")
        assert_within_oracle(att_out[:, :, rows, :, :tn + ln].cpu(), torch.stack(s_att).cpu(), r_att, "att")


@pytest.mark.gpu
def test_gpu_graphs_of_one_cache_share_a_pool_and_replay_in_any_order():
    """Keys captured after the first reuse its scratch (one pool per cache), and replays interleaved
    in another order than the captures still equal eager calls bitwise: no capture's scratch
    overwrites a result another replay returns."""
    from torch_cfm.graphs import GraphedCall

    def fn(x):
        h = (torch.sin(x) * 3 + 1).exp().sqrt()  # intermediates the size of x, freed inside the capture
        return (h * x).sum(-1), h[..., :4].clone()

    call = GraphedCall(fn, name="shared_pool")
    shapes = [(512, 4096), (256, 4096), (512, 2048)]
    fresh = _fresh_cuda()
    with torch.no_grad():
        _capture_every_shape(call, shapes, lambda shape: (fresh(shape),))
        assert call.graph_count == len(shapes), call.events
        first, *later = [e.pool_bytes for e in call.cache.entries()]
        assert first >= 2 * 512 * 4096 * 4 and sum(later) <= first // 2, (first, later)
        for order in ([2, 0, 1], [1, 2, 0], [0, 2, 1, 0]):
            xs = [fresh(shapes[i]) for i in order]
            got = [call(x) for x in xs]
            for x, (total, head) in zip(xs, got):
                want_total, want_head = fn(x)
                assert torch.equal(total, want_total) and torch.equal(head, want_head)


@pytest.mark.gpu
def test_gpu_capture_failure_falls_back_with_reason(monkeypatch):
    bucket = _GpuBucket(torch.float16)

    def broken(*a, **k):
        raise RuntimeError("simulated capture failure")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", broken)
    for _ in range(bucket.cache.calls_per_capture(torch.device("cuda"))):  # eager warm-up, then the capture
        _fill(bucket.arena, 3)
        bucket.run()
    failed = [e.failed for e in bucket.cache.entries()]
    assert not bucket.captured() and len(failed) == 1 and "simulated capture failure" in failed[0]
    assert any("capture failed" in e for e in bucket.cache.events)
    arena = bucket.arena
    assert torch.isfinite(arena.out_mel[arena.valid_lengths.bool()].float()).all()


@pytest.mark.gpu
def test_gpu_graphed_server_equals_eager_server_bitwise():
    from torch_cfm.serving import CFMServer
    from torch_cfm.solve import StreamingCFM

    model = random_dit(GPU_CFG, seed=50).to(device="cuda", dtype=torch.float16)

    def make(graphs):
        cfm = StreamingCFM(model, n_timesteps=4)
        return CFMServer(cfm, max_requests=2, max_prompt_frames=60, max_chunk_frames=50, chunk_buckets=[50],
                         cache_buckets=[160], fused=True, graphs=graphs)

    eager, graphed = make(False), make(True)
    g = torch.Generator().manual_seed(0)
    h = lambda *shape: torch.randn(*shape, generator=g).to(device="cuda", dtype=torch.float16)  # noqa: E731
    spk = {r: h(80) for r in "xy"}
    prompts = {"x": h(80, 40), "y": h(80, 50)}
    for srv in (eager, graphed):
        for r in "xy":
            srv.open_request(r, spk[r], prompt_mu=prompts[r], prompt_mel=prompts[r])
    for _ in range(4):
        chunk = {"x": h(80, 50), "y": h(80, 30)}
        want, got = eager.solve_chunk(chunk), graphed.solve_chunk(chunk)
        for r in "xy":
            assert torch.isfinite(want[r].float()).all()
            assert torch.equal(want[r], got[r]), r
    assert any("captured" in e for e in graphed.graph_cache.events), graphed.graph_cache.events


if __name__ == "__main__" and len(sys.argv) >= 3 and sys.argv[1] == "--child":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run the child with TRITON_INTERPRET=1")
    _child(sys.argv[2])


def test_shared_static_carves_aligned_views_of_one_buffer_and_grows():
    """``SharedStatic.carve``: contiguous views of the shapes and dtypes asked, 256-byte aligned, one
    after the other in one buffer; a larger request gets a buffer at least twice the old one while
    the earlier views keep theirs."""
    from torch_cfm.graphs import SharedStatic

    shared = SharedStatic()
    asked = [torch.zeros(3, 5, dtype=torch.float16), torch.zeros(7, dtype=torch.int64), torch.zeros(0, 4),
             torch.zeros(2, dtype=torch.bool)]
    views = shared.carve(asked)
    base = shared.buffer.data_ptr()
    assert [(v.shape, v.dtype) for v in views] == [(a.shape, a.dtype) for a in asked]
    assert all(v.is_contiguous() for v in views)
    assert [v.data_ptr() - base for v in views if v.numel()] == [0, 256, 512]  # an empty tensor has no address
    assert shared.nbytes == 768
    views[0].fill_(1.5)
    views[1].copy_(torch.arange(7))
    again = shared.carve(asked[:2])  # a second key: the same storage, from the start
    assert again[0].data_ptr() == base and torch.equal(again[1], torch.arange(7))
    big = shared.carve([torch.zeros(1000, dtype=torch.float32)])
    assert shared.nbytes == 4096 and big[0].data_ptr() == shared.buffer.data_ptr() != base
    assert torch.all(views[0] == 1.5)  # the old views keep the old buffer


def test_shared_io_needs_the_checked_form():
    from torch_cfm.graphs import GraphCache

    with pytest.raises(ValueError, match="shared_io needs check=True"):
        GraphCache("x", shared_io=True)
    assert GraphCache("y", check=True, shared_io=True).shared_bytes == 0


@pytest.mark.gpu
def test_gpu_shared_io_keys_share_their_buffers_and_replay_in_any_order():
    """``shared_io``: the keys' static inputs (and outputs) lie in one buffer each, and replays of
    keys in another order than the captures equal eager calls bitwise (each replay copies its
    inputs in and its outputs out)."""
    from torch_cfm.graphs import GraphedCall

    def fn(x, bias):
        h = (torch.sin(x) * 3 + 1).exp().sqrt()
        return (h * x).sum(-1) + bias, {"head": h[..., :4] * 2}

    call = GraphedCall(fn, name="shared_io", shared_io=True)
    shapes = [(64, 512), (256, 512), (128, 1024)]
    fresh = _fresh_cuda()
    with torch.no_grad():
        _capture_every_shape(call, shapes, lambda shape: (fresh(shape), fresh(shape[:1])))
        entries = call.cache.entries()
        assert call.graph_count == len(shapes), call.events
        inputs, outputs = call.cache.shared
        last = entries[-1]
        assert last.static_args[0].untyped_storage().data_ptr() == inputs.buffer.data_ptr()
        assert _first_tensor(last.static_out).untyped_storage().data_ptr() == outputs.buffer.data_ptr()
        for order in ([2, 0, 1], [1, 2, 0], [0, 2, 1, 0]):
            xs = [(fresh(shapes[i]), fresh(shapes[i][:1])) for i in order]
            got = [call(*x) for x in xs]
            for x, (total, head) in zip(xs, got):
                want_total, want_head = fn(*x)
                assert torch.equal(total, want_total) and torch.equal(head["head"], want_head["head"])


def _fresh_cuda(seed: int = 0):
    """shape -> a fresh standard normal CUDA tensor (one seeded generator)."""
    gen = torch.Generator("cuda").manual_seed(seed)
    return lambda shape: torch.randn(shape, device="cuda", generator=gen)


def _capture_every_shape(call, shapes, args_of) -> None:
    """Call ``call`` with ``args_of(shape)`` until each shape's graph is captured."""
    for shape in shapes:
        for _ in range(call.cache.calls_per_capture(torch.device("cuda"))):
            call(*args_of(shape))


def _first_tensor(obj):
    from torch_cfm.graphs import tree_tensors

    return tree_tensors(obj)[0]


@pytest.mark.gpu
def test_gpu_in_place_graphed_call_writes_its_buffers_once_per_call():
    """``GraphedCall(in_place=True)``: a function that updates a buffer it keeps (gather, compute,
    scatter back, as the encoder stage's slots) runs eagerly, then is captured and replayed; every
    call, replayed or not, does the work exactly once (x += row sums, rows chosen per call), equal
    to the same calls eagerly, and returns None without output copies."""
    from torch_cfm.graphs import GraphedCall

    g = torch.Generator().manual_seed(3)
    start = torch.randn(6, 32, generator=g).cuda()
    state, out = start.clone(), torch.empty(3, 32, device="cuda")

    def fn(rows, scale: float):
        picked = state.index_select(0, rows)
        out.copy_(picked * scale)
        state.index_copy_(0, rows, picked + picked.sum(-1, keepdim=True))

    call = GraphedCall(fn, name="in_place", in_place=True)
    want = start.clone()
    with torch.no_grad():  # a call with grad enabled runs eagerly
        for k, rows in enumerate(([0, 2, 4], [1, 3, 5], [5, 0, 2], [3, 1, 0])):
            index = torch.tensor(rows, device="cuda")
            assert call(index, 0.5) is None
            picked = want.index_select(0, index)
            torch.testing.assert_close(out, picked * 0.5, rtol=0, atol=0)
            want.index_copy_(0, index, picked + picked.sum(-1, keepdim=True))
            torch.testing.assert_close(state, want, rtol=0, atol=0, msg=f"call {k}")
    assert call.graph_count == 1 and sum(e.replays for e in call.cache.entries()) == 3
