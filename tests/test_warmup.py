"""CFMServer start-up: warm-up covers every solve shape the buckets can produce (no later solve
creates a graph-solver key, so on CUDA none compiles or captures), the memory plan, and admission
errors that name the limit. CPU tests drive the graph solver's keys (kept on CPU too); the GPU
test checks that no capture happens after the warm-up."""

from __future__ import annotations

import pytest
import torch

from torch_cfm.graphs import GraphCache
from torch_cfm.models import DiT, DiTConfig
from torch_cfm.models.cache import CacheArena, _word_aligned, copy_wide_
from torch_cfm.serving import AdmissionError, CFMServer
from torch_cfm.solve import StreamingCFM

TINY = DiTConfig(hidden=64, depth=2, heads=4, head_dim=16)
STEPS = 2


@pytest.fixture(scope="module")
def cfm():
    return StreamingCFM(DiT(TINY).random_init_(4).eval(), n_timesteps=STEPS, seed=1)


def _server(cfm, **kw):
    args = dict(buckets=(1, 3), max_prompt_frames=12, max_chunk_frames=10, chunk_buckets=(4, 10),
                cache_buckets=(0, 16), slot_buckets=(2,), graphs=True)
    args.update(kw)
    return CFMServer(cfm, **args)


def _labels(solver: GraphCache) -> set:
    return {tuple(sorted(e.label.items())) for e in solver.entries()}


def test_warmup_shapes_are_the_reachable_buckets(cfm):
    server = _server(cfm)
    # staging holds max(P, chunk) = 12 frames, caches P + 100 = 112: T in {4, 10, 12}, Lb in {0, 16, 112}
    assert server.arenas[0].max_chunk_frames == 12 and server.arenas[0].max_cache_frames == 112
    shapes = server.warmup_shapes()
    bucket1 = {(s, t, lb) for b, s, t, lb in shapes if b == 1}
    assert bucket1 == {(s, t, lb) for s in (2, 3) for t in (4, 10, 12) for lb in (0, 16, 112)}
    assert {(s, t, lb) for b, s, t, lb in shapes if b == 0} == {(1, t, lb) for t in (4, 10, 12) for lb in (0, 16, 112)}
    assert len(shapes) == 27
    assert server.warmup_shapes(chunk_frames=[10], cache_frames=[16, 500], slot_counts=[3]) == [
        (0, 1, 10, 16), (0, 1, 10, 112), (1, 3, 10, 16), (1, 3, 10, 112)]


def test_warmup_pairs_are_rounded_like_a_solve(cfm):
    server = _server(cfm)
    # a workload's (T, L) pairs: 3 -> chunk bucket 4, 7 -> 10, 11 -> the staging length 12; L 5 -> 16, 20 -> 112
    shapes = server.warmup_shapes(pairs=[(3, 0), (7, 5), (4, 16), (11, 20)], slot_counts=[1])
    assert shapes == [(0, 1, 4, 0), (0, 1, 4, 16), (0, 1, 10, 16), (0, 1, 12, 112),
                      (1, 2, 4, 0), (1, 2, 4, 16), (1, 2, 10, 16), (1, 2, 12, 112)]
    with pytest.raises(ValueError, match="pairs"):
        server.warmup_shapes(pairs=[(0, 4)])
    report = server.warmup(pairs=[(3, 0), (7, 5)], slot_counts=[1], progress=False)
    assert len(report.shapes) == 4 and server.graph_cache.misses == 4


def test_load_request_caches_round_trips_and_checks(cfm):
    server = _server(cfm, graphs=False)
    g = torch.Generator().manual_seed(3)
    server.open_request("a", torch.randn(80, generator=g), prompt_mu=torch.randn(80, 8, generator=g),
                        prompt_mel=torch.randn(80, 8, generator=g))
    cnn0, att0 = server.request_caches("a")
    att = torch.randn(STEPS, TINY.depth, 2, TINY.heads, 13, 2 * TINY.head_dim, generator=g)
    cnn = torch.randn_like(cnn0)
    server.load_request_caches("a", cnn, att)
    assert server.cache_length("a") == 13
    cnn1, att1 = server.request_caches("a")
    assert torch.equal(cnn1, cnn) and torch.equal(att1, att)
    # the next chunk attends over the loaded frames and appends to them
    out = server.solve_chunk({"a": torch.randn(80, 4, generator=g)})["a"]
    assert out.shape == (80, 4) and torch.isfinite(out).all() and server.cache_length("a") == 17
    with pytest.raises(ValueError, match="att must hold at most max_cache_frames"):
        server.load_request_caches("a", cnn, torch.zeros(STEPS, TINY.depth, 2, TINY.heads, 113, 2 * TINY.head_dim))
    with pytest.raises(ValueError, match="cnn must be a tensor of shape"):
        server.load_request_caches("a", cnn[:, :1], att)
    with pytest.raises(ValueError, match="att must be torch.float32"):
        server.load_request_caches("a", cnn, att.double())
    with pytest.raises(ValueError, match="'b'"):
        server.load_request_caches("b", cnn, att)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.float64])
def test_copy_wide_is_a_bitwise_strided_copy(dtype):
    """A slot's rows of an arena-like buffer (words where the strides allow, elements where they do
    not: odd last dimension, odd offset) equal an element-wise copy bit for bit; neighbours untouched."""
    g = torch.Generator().manual_seed(5)
    bits = lambda *shape: torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)  # noqa: E731
    size = torch.empty((), dtype=dtype).element_size()
    for last, start, width, wide in ((16, 0, 16, True), (5, 0, 5, False), (17, 1, 16, False)):
        buf = bits(3, 4, 5, 9, last * size).view(dtype)
        before = buf.clone()
        src = bits(3, 2, 5, 7, width * size).view(dtype)
        dst = buf[:, 1:3, :, 2:9, start:start + width]
        assert size == 8 or _word_aligned(dst, 8 // size) == wide  # which path the case takes
        copy_wide_(dst, src)
        want = before.clone()
        want[:, 1:3, :, 2:9, start:start + width] = src
        assert torch.equal(buf.view(torch.int8), want.view(torch.int8))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_write_slots_equals_write_slot_per_slot_bitwise(dtype):
    """One state scattered into several slots at once (att as words, cnn as words or elements by
    dtype) equals ``write_slot`` into each, bit for bit; the other slots are untouched."""
    g = torch.Generator().manual_seed(6)
    arenas = [CacheArena.allocate(TINY, 2, 5, 24, 8, torch.device("cpu"), dtype) for _ in range(2)]
    for a in arenas:  # the same random bytes in both, so untouched slots can be compared
        for t in (a.att, a.cnn):
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(7)).to(dtype))
    one, many = arenas
    att = torch.randn(*one.att.shape[:2], 2, one.att.shape[3], 17, one.att.shape[5], generator=g).to(dtype)
    cnn = torch.randn(*one.cnn.shape[:2], 2, *one.cnn.shape[3:], generator=g).to(dtype)
    slots = [3, 0, 4]
    for s in slots:
        one.write_slot(s, cnn, att)
    many.write_slots(torch.tensor(slots), cnn, att)
    assert torch.equal(one.att, many.att) and torch.equal(one.cnn, many.cnn)


def test_warmup_covers_every_later_prompt_and_tick(cfm, capsys):
    server = _server(cfm)
    solver = server.graph_cache
    report = server.warmup()
    err = capsys.readouterr().err
    assert err.count("CFMServer.warmup [") == 27 and "[27/27]" in err and "27 shapes" in err
    assert len(report.shapes) == 27 and solver.misses == 27 and solver.hits == 0 and solver.captures == 0
    assert report.graphs == 0 and report.graph_pool_bytes == 0  # CPU: eager, no graphs
    assert report.arena_bytes == sum(a.nbytes() for a in server.arenas) and report.seconds > 0
    warmed = _labels(solver)
    assert len(warmed) == 27
    assert solver.max_graphs >= 27  # the budget holds every warmed shape
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    # prompts of several lengths (the staging length too), then ticks of every slot count,
    # chunk lengths below and at the buckets, caches growing through the trim
    for rid, prompt in (("a", 12), ("b", 3), ("c", 7), ("d", 12)):
        server.open_request(rid, r(80), prompt_mu=r(80, prompt), prompt_mel=r(80, prompt))
    for lengths in ({"b": 2}, {"b": 10, "c": 4, "d": 1}, {"c": 9, "d": 10}, {"a": 10}, {"b": 3, "c": 3, "d": 3}):
        for _ in range(3):
            server.solve_chunk({rid: r(80, t) for rid, t in lengths.items()})
    assert solver.misses == 27 and solver.hits == 4 + 5 * 3, "a solve after the warm-up created a new key"
    assert _labels(solver) == warmed
    assert solver.captures == 0


def test_warmup_leaves_results_unchanged(cfm):
    g = torch.Generator().manual_seed(5)
    spks, prompt, chunks = torch.randn(80, generator=g), torch.randn(80, 9, generator=g), \
        [torch.randn(80, 10, generator=g) for _ in range(2)]
    outs = []
    for warm in (False, True):
        server = _server(cfm)
        if warm:  # the shapes this stream solves and a few others, every slot count
            server.warmup(progress=False, chunk_frames=[4, 9, 10], cache_frames=[0, 16, 112])
        mels = [server.open_request("x", spks, prompt_mu=prompt)]
        mels += [server.solve_chunk({"x": c})["x"] for c in chunks]
        outs.append(mels)
    for a, b in zip(*outs):
        assert torch.isfinite(a).all() and a.abs().max() > 0
        assert torch.equal(a, b)


def test_warmup_needs_buckets_and_no_open_request(cfm):
    with pytest.raises(ValueError, match=r"^CFMServer.warmup: chunk_frames must be given when the server has no "
                                         r"chunk_buckets"):
        CFMServer(cfm, max_requests=2, cache_buckets=(0, 50)).warmup(progress=False)
    with pytest.raises(ValueError, match="cache_frames must be given"):
        CFMServer(cfm, max_requests=2, chunk_buckets=(50,)).warmup(progress=False)
    server = _server(cfm)
    with pytest.raises(ValueError, match="slot_counts must be a non-empty list of ints >= 1"):
        server.warmup(slot_counts=[0], progress=False)
    server.open_request("a", torch.randn(80), prompt_len=3)
    with pytest.raises(RuntimeError, match="warm up before opening requests"):
        server.warmup(progress=False)
    # without slot buckets every slot count is a shape; eager servers warm up too
    eager = CFMServer(cfm, max_requests=3, max_prompt_frames=4, max_chunk_frames=4, chunk_buckets=(4,),
                      cache_buckets=(104,))
    report = eager.warmup(progress=False)
    assert [(s["slots"], s["t_len"], s["cache_frames"]) for s in report.shapes] == [(1, 4, 104), (2, 4, 104),
                                                                                     (3, 4, 104)]
    assert report.graphs == 0


@pytest.mark.parametrize("dtype,elem", [(torch.float32, 4), (torch.float16, 2)])
def test_memory_plan_bytes_per_stream(cfm, dtype, elem):
    n, c = STEPS, TINY
    server = CFMServer(cfm, buckets=(2, 3), max_prompt_frames=20, max_chunk_frames=30, dtype=dtype)
    m, a, tmax = 20 + 100, 30, 30  # cache frames P + 100, append frames = max_chunk_frames, staging max(P, chunk)
    att = n * c.depth * 2 * c.heads * (m + a) * 2 * c.head_dim
    cnn = n * c.depth * 2 * 2 * c.hidden * c.conv_cache_frames
    staging = 3 * 80 * tmax + 80
    expect = (att + cnn + staging) * elem + 4 * (m + 3)
    plan = server.memory_plan()
    assert plan.bytes_per_stream == server.bytes_per_stream == expect
    assert plan.slots == 5 and plan.arena_bytes == 5 * expect == sum(x.nbytes() for x in server.arenas)
    assert plan.dtype == dtype and plan.graph_pool_bytes == 0 and plan.total_bytes == plan.arena_bytes
    assert all(x.att.dtype == dtype for x in server.arenas)


def test_admission_errors_name_the_limit(cfm):
    need = CFMServer(cfm, max_requests=1, max_prompt_frames=8, max_chunk_frames=8).bytes_per_stream
    fits = CFMServer(cfm, max_requests=3, max_prompt_frames=8, max_chunk_frames=8, max_memory_bytes=3 * need)
    assert fits.memory_plan().max_memory_bytes == 3 * need
    with pytest.raises(AdmissionError, match=rf"4 request slots need {4 * need} bytes of arenas \({need} bytes per "
                                             rf"stream in float32\) > max_memory_bytes={4 * need - 1}; 3 streams fit"):
        CFMServer(cfm, max_requests=4, max_prompt_frames=8, max_chunk_frames=8, max_memory_bytes=4 * need - 1)
    with pytest.raises(ValueError, match="max_memory_bytes must be a positive int"):
        CFMServer(cfm, max_requests=1, max_memory_bytes=0)
    for rid in "abc":
        fits.open_request(rid, torch.randn(80), prompt_len=2)
    with pytest.raises(CFMServer.AdmissionError, match=rf"no free request slot: all 3 slots \(max_requests/buckets\) "
                                                       rf"are open, {need} bytes per stream"):
        fits.open_request("d", torch.randn(80))
    assert issubclass(AdmissionError, RuntimeError)
    fits.close_request("b")
    fits.open_request("d", torch.randn(80), prompt_len=2)


# ------------------------------------------------------------------ GPU

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_no_capture_after_warmup_and_graphs_match_eager(dtype):
    """After warmup() every prompt solve and tick replays an existing graph (no capture, no new
    key), and the graphed server's mel equals the eager server's, bitwise."""
    model = DiT(DiTConfig()).random_init_(0).to("cuda", dtype).eval()
    cfm = StreamingCFM(model, n_timesteps=4)
    kw = dict(max_requests=4, max_prompt_frames=60, max_chunk_frames=50, chunk_buckets=(25, 50),
              cache_buckets=(0, 100, 160), slot_buckets=(1, 4), device=torch.device("cuda"), dtype=dtype)
    graphed, eager = CFMServer(cfm, graphs=True, **kw), CFMServer(cfm, **kw)
    report = graphed.warmup(progress=False)
    solver = graphed.graph_cache
    assert report.graphs == len(report.shapes) == solver.captures == 2 * 3 * 3, solver.events
    assert report.graph_pool_bytes > 0 and graphed.memory_plan().graph_pool_bytes == report.graph_pool_bytes
    captures, misses = solver.captures, solver.misses
    g = torch.Generator().manual_seed(3)
    h = lambda *shape: torch.randn(*shape, generator=g).to("cuda", dtype)  # noqa: E731
    for rid, prompt in (("a", 60), ("b", 17), ("c", 40)):
        spks, mu = h(80), h(80, prompt)
        want, got = (srv.open_request(rid, spks, prompt_mu=mu, prompt_mel=mu) for srv in (eager, graphed))
        assert torch.isfinite(want.float()).all() and torch.equal(want, got), rid
    for lengths in ({"a": 50, "b": 50, "c": 50}, {"a": 25}, {"b": 50, "c": 12}, {"a": 50, "b": 50, "c": 50}):
        chunk = {rid: h(80, t) for rid, t in lengths.items()}
        want, got = eager.solve_chunk(chunk), graphed.solve_chunk(chunk)
        for rid in chunk:
            assert torch.isfinite(want[rid].float()).all()
            assert torch.equal(want[rid], got[rid]), rid
    assert solver.captures == captures and solver.misses == misses, solver.events
    assert all(e.graph is not None for e in solver.entries())
