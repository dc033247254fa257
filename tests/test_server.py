"""CFMServer: ragged batches equal solo solves, the docs/design.md §3 trim, arenas that never move."""

from __future__ import annotations

import pytest
import torch

import dit_oracle as O
from oracle import err_rel_fro
from solo import Solo
from torch_cfm.models import DiT, DiTConfig
from torch_cfm.serving import CFMServer
from torch_cfm.solve import ArenaSolver, StreamingCFM

TINY = DiTConfig(hidden=64, depth=2, heads=4, head_dim=16)
STEPS = 2
TOL = 2e-5


@pytest.fixture(scope="module")
def cfm():
    return StreamingCFM(DiT(TINY).random_init_(12).eval(), n_timesteps=STEPS, seed=3)


def close(a, b, tol=TOL):
    return err_rel_fro(a, b) < tol


def test_ragged_batches_equal_solo_requests_through_the_trim(cfm):
    g = torch.Generator().manual_seed(1)
    server = CFMServer(cfm, max_requests=4, max_prompt_frames=12, max_chunk_frames=45)
    ptrs = [a.data_ptrs() for a in server.arenas]
    solos = {}
    for rid, prompt in (("a", 12), ("b", 5), ("c", 8)):
        spks, mu, mel = (torch.randn(80, generator=g), torch.randn(80, prompt, generator=g),
                         torch.randn(80, prompt, generator=g))
        solos[rid] = Solo(cfm, spks, prompt)
        out = server.open_request(rid, spks, prompt_mu=mu, prompt_mel=mel)
        assert close(out, solos[rid].chunk(mu, mel))
    schedule = [{"a": 40, "b": 33, "c": 45}, {"a": 45, "c": 20}, {"b": 41, "a": 7, "c": 45},
                {"a": 38, "b": 45}, {"c": 1, "b": 30}]
    trimmed = set()
    for step, lengths in enumerate(schedule):
        chunks = {}
        for rid, t_len in lengths.items():
            cond = torch.randn(80, t_len, generator=g) if rid == "a" else None
            chunks[rid] = (torch.randn(80, t_len, generator=g), cond)
        outs = server.solve_chunk(chunks)
        assert list(outs) == list(chunks)
        for rid, (mu, cond) in chunks.items():
            solo = solos[rid]
            assert outs[rid].shape == (80, mu.shape[1])
            assert close(outs[rid], solo.chunk(mu, cond)), (step, rid)
            cnn, att = server.request_caches(rid)
            assert server.cache_length(rid) == solo.att.shape[4]
            assert close(cnn, solo.cnn) and close(att, solo.att), (step, rid)
            if server.cache_length(rid) == solo.prompt_len + 100:
                trimmed.add(rid)
    assert trimmed == {"a", "b", "c"}  # every request went through the trim
    assert [a.data_ptrs() for a in server.arenas] == ptrs


def test_server_matches_the_oracle_for_a_short_stream(cfm):
    sd = O.to_dtype(cfm.estimator.state_dict())
    g = torch.Generator().manual_seed(2)
    server = CFMServer(cfm, max_requests=2, max_prompt_frames=4, max_chunk_frames=8)
    spks = torch.randn(80, generator=g)
    server.open_request("x", spks, prompt_len=4)
    server.open_request("y", torch.randn(80, generator=g), prompt_len=2)
    cnn = att = None
    for t_len in (4, 6):
        mu = torch.randn(80, t_len, generator=g)
        out = server.solve_chunk({"x": mu, "y": torch.randn(80, 3, generator=g)})["x"]
        mel, cnn, att = O.solve_request(sd, mu.double(), spks.double(), torch.zeros(80, t_len, dtype=torch.float64),
                                        cfm.noise.double(), STEPS, 0.7, cnn, att)
        assert close(out, mel)
        got_cnn, got_att = server.request_caches("x")
        assert close(got_cnn, cnn) and close(got_att, att)


def test_close_frees_rows_and_reused_rows_start_clean(cfm):
    g = torch.Generator().manual_seed(3)
    server = CFMServer(cfm, max_requests=2, max_prompt_frames=6, max_chunk_frames=10)
    ptrs = server.arenas[0].data_ptrs()
    for rid in ("a", "b"):
        server.open_request(rid, torch.randn(80, generator=g), prompt_mu=torch.randn(80, 6, generator=g))
    server.solve_chunk({"a": torch.randn(80, 10, generator=g), "b": torch.randn(80, 9, generator=g)})
    with pytest.raises(RuntimeError, match="no free request slot"):
        server.open_request("c", torch.randn(80))
    server.close_request("a")
    assert server.open_requests == ["b"]
    spks, mu = torch.randn(80, generator=g), torch.randn(80, 5, generator=g)
    server.open_request("c", spks, prompt_len=3)  # takes a's old rows
    solo = Solo(cfm, spks, 3)
    assert close(server.solve_chunk({"c": mu})["c"], solo.chunk(mu))
    assert server.cache_length("c") == 5
    assert server.arenas[0].data_ptrs() == ptrs
    with pytest.raises(ValueError, match=r"^CFMServer.solve_chunk: request_id must name an open request, got 'a'"):
        server.solve_chunk({"a": mu})


def test_buckets_and_length_buckets_give_the_solo_results(cfm):
    g = torch.Generator().manual_seed(4)
    server = CFMServer(cfm, buckets=(1, 3), max_prompt_frames=6, max_chunk_frames=16,
                       chunk_buckets=(8, 16), cache_buckets=(10, 40), slot_buckets=(2,))
    assert [a.rows for a in server.arenas] == [1, 3]
    solos = {}
    for rid, prompt in (("a", 6), ("b", 3), ("c", 4)):
        spks, mu = torch.randn(80, generator=g), torch.randn(80, prompt, generator=g)
        solos[rid] = Solo(cfm, spks, prompt)
        assert close(server.open_request(rid, spks, prompt_mu=mu), solos[rid].chunk(mu))
    assert {rid: server._requests[rid].bucket for rid in "abc"} == {"a": 0, "b": 1, "c": 1}
    # {"c": 3} alone pads to 2 slots with idle "b" (whose cache is longer than c's)
    for lengths in ({"a": 5, "b": 11, "c": 16}, {"c": 3, "a": 9}, {"c": 4}, {"b": 2, "c": 6}):
        chunks = {rid: torch.randn(80, t, generator=g) for rid, t in lengths.items()}
        outs = server.solve_chunk(chunks)
        for rid, mu in chunks.items():
            assert close(outs[rid], solos[rid].chunk(mu))
            cnn, att = server.request_caches(rid)
            assert close(cnn, solos[rid].cnn) and close(att, solos[rid].att)


def test_idle_padding_slots_keep_their_longer_caches(cfm):
    g = torch.Generator().manual_seed(6)
    server = CFMServer(cfm, max_requests=3, max_prompt_frames=4, max_chunk_frames=20, slot_buckets=(2,))
    solos = {}
    for rid in ("p", "q"):
        spks = torch.randn(80, generator=g)
        solos[rid] = Solo(cfm, spks, 4)
        server.open_request(rid, spks, prompt_len=4)
    for lengths in ({"p": 20}, {"p": 20}, {"q": 3}, {"p": 5, "q": 6}):  # q alone pads with idle p (L=40)
        chunks = {rid: torch.randn(80, t, generator=g) for rid, t in lengths.items()}
        before = server.request_caches("p")
        outs = server.solve_chunk(chunks)
        if "p" not in chunks:
            after = server.request_caches("p")
            assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])
        for rid, mu in chunks.items():
            assert close(outs[rid], solos[rid].chunk(mu)), rid
    assert server.cache_length("p") == 45 and server.cache_length("q") == 9


def test_padding_takes_free_slots_before_settled_ones(cfm):
    """Three prompts solved together in a 4-slot bucket of an 8-slot arena, next to a settled
    request: the padding slot is a free one, so the solve's cache window stays 0 (the settled
    request's 24 frames would widen it); the results are the solo ones either way."""
    g = torch.Generator().manual_seed(8)
    server = CFMServer(cfm, max_requests=8, max_prompt_frames=8, max_chunk_frames=8, slot_buckets=(1, 2, 4, 8),
                       chunk_buckets=(8,), cache_buckets=(0, 8, 16, 24), graphs=True)  # graphs: keys kept on CPU too
    solos = {}
    for rid in ("settled", "a", "b", "c"):
        solos[rid] = Solo(cfm, torch.randn(80, generator=g), 8)
    server.open_request("settled", solos["settled"].spks, prompt_len=8)
    for _ in range(3):
        mu = torch.randn(80, 8, generator=g)
        assert close(server.solve_chunk({"settled": mu})["settled"], solos["settled"].chunk(mu))
    for rid in "abc":
        server.open_request(rid, solos[rid].spks, prompt_len=8)
    prompts = {rid: torch.randn(80, 8, generator=g) for rid in "abc"}
    outs = server.solve_chunk(prompts)
    for rid, mu in prompts.items():
        assert close(outs[rid], solos[rid].chunk(mu)), rid
    last = next(reversed(server.graph_cache.entries()))
    assert (last.label["slots"], last.label["cache_frames"]) == (4, 0), last.label


def test_server_input_errors(cfm):
    server = CFMServer(cfm, max_requests=1, max_prompt_frames=4, max_chunk_frames=6)
    with pytest.raises(ValueError, match=r"^CFMServer.open_request: spks must have shape \(80,\)"):
        server.open_request("a", torch.randn(81))
    with pytest.raises(ValueError, match="prompt_len must be an int in"):
        server.open_request("a", torch.randn(80), prompt_len=5)
    server.open_request("a", torch.randn(80))
    with pytest.raises(ValueError, match="request_id must not be open already"):
        server.open_request("a", torch.randn(80))
    with pytest.raises(ValueError, match=r"chunks\['a'\] mu must have 1..6 frames, got 7"):
        server.solve_chunk({"a": torch.randn(80, 7)})
    with pytest.raises(ValueError, match=r"chunks\['a'\] mu must have shape \(80, T\)"):
        server.solve_chunk({"a": torch.randn(40, 7)})
    with pytest.raises(ValueError, match=r"chunks\['a'\] cond must have mu's shape"):
        server.solve_chunk({"a": (torch.randn(80, 3), torch.randn(80, 4))})
    with pytest.raises(ValueError, match="max_requests must be a positive int"):
        CFMServer(cfm, max_requests=0)


# ------------------------------------------------------------------ GPU

def _fill_arena(arena, g, cache_lengths, prompt_lengths, valid_lengths):
    for t in (arena.att, arena.cnn, arena.mu, arena.cond, arena.spks):
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    arena.cache_lengths.copy_(torch.tensor(cache_lengths, dtype=torch.int32))
    arena.prompt_lengths.copy_(torch.tensor(prompt_lengths, dtype=torch.int32))
    arena.valid_lengths.copy_(torch.tensor(valid_lengths, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("keyed", [False, True])
@pytest.mark.parametrize("fused", [False, None])
def test_solve_arena_chunk_captures_in_one_cuda_graph(fused, keyed):
    """Replay == eager, bitwise; keyed: the in-place form (fused) and the reference form, through
    a trim (keep 30: slot 0 goes 90 -> 60 frames, idle slot 2 64 -> 50)."""
    from torch_cfm.models import CacheArena

    cfg, dev, dtype = DiTConfig(), torch.device("cuda"), torch.float16
    model = DiT(cfg).random_init_(0).to(dev, dtype).eval()
    noise = StreamingCFM(model).noise.to(dev, dtype)
    arena = CacheArena.allocate(cfg, 10, 3, 140, 50, dev, dtype, 50 if keyed else 0, keyed=keyed)
    solver = ArenaSolver(model, n_timesteps=10, keep_oldest=30 if keyed else 100, fused=fused)
    g = torch.Generator().manual_seed(0)
    _fill_arena(arena, g, [40, 0, 64], [30, 10, 20], [50, 20, 0])
    start = {k: v.clone() for k, v in arena.tensors().items()}

    def restore():
        for k, v in start.items():
            getattr(arena, k).copy_(v)

    def run():
        solver(arena, noise, t_len=50, cache_frames=64)

    run()
    eager = {k: v.clone() for k, v in arena.tensors().items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        restore()
        run()  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    restore()
    ptrs = arena.data_ptrs()
    graph.replay()
    torch.cuda.synchronize()
    assert arena.data_ptrs() == ptrs
    assert arena.cache_lengths.tolist() == ([60, 20, 50] if keyed else [90, 20, 64])
    for k, v in eager.items():
        assert torch.equal(getattr(arena, k), v), k  # replay == eager, bitwise
    assert torch.isfinite(arena.out_mel[:2]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("slots", [3, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_server_ragged_batch_equals_solo(dtype, slots):
    """3 slots: every chunk solves the whole bucket (keyed arena, appends in place); 4 slots: the
    three requests are compacted (rows copied out and back)."""
    cfg = DiTConfig()
    model = DiT(cfg).random_init_(0).to("cuda", dtype).eval()
    cfm = StreamingCFM(model, n_timesteps=4)
    server = CFMServer(cfm, max_requests=slots, max_prompt_frames=30, max_chunk_frames=60)
    g = torch.Generator().manual_seed(5)
    solos, chunks = {}, {}
    for rid, (prompt, t_len) in {"a": (30, 50), "b": (12, 56), "c": (20, 17)}.items():
        spks = torch.randn(80, generator=g)
        mu_p = torch.randn(80, prompt, generator=g)
        server.open_request(rid, spks, prompt_mu=mu_p)
        solos[rid] = Solo(cfm, spks.to("cuda", dtype), prompt)
        solos[rid].chunk(mu_p.to("cuda", dtype))
        chunks[rid] = t_len
    bound = 2e-2 if dtype == torch.float16 else 6e-2
    for _ in range(3):  # chunk 2 trims "b" (12 + 100 < 124 frames), chunk 3 trims "a" too
        mus = {rid: torch.randn(80, t_len, generator=g) for rid, t_len in chunks.items()}
        outs = server.solve_chunk(mus)
        for rid, mu in mus.items():
            solo = solos[rid].chunk(mu.to("cuda", dtype))
            assert torch.isfinite(outs[rid]).all()
            assert err_rel_fro(outs[rid].float().cpu(), solo.float().cpu()) < bound, rid
            cnn, att = server.request_caches(rid)
            assert att.shape == solos[rid].att.shape, rid
            assert err_rel_fro(att.float().cpu(), solos[rid].att.float().cpu()) < bound, rid
    assert server.cache_length("a") == 130 and server.cache_length("b") == 112


@pytest.mark.gpu
def test_gpu_steady_state_solve_chunk_never_syncs():
    """A served chunk (graph replay + staging + output copies) must not make the host wait for the
    GPU (a pageable lengths copy would: one stream sync per chunk)."""
    cfm = StreamingCFM(DiT(DiTConfig(hidden=64, depth=2, heads=4, head_dim=16)).random_init_(0).to("cuda", torch.float16),
                       n_timesteps=3)
    server = CFMServer(cfm, max_requests=2, max_prompt_frames=8, max_chunk_frames=16, chunk_buckets=(16,),
                       cache_buckets=(128,), device=torch.device("cuda"), dtype=torch.float16, graphs=True)
    g = torch.Generator().manual_seed(9)
    for rid in ("a", "b"):
        server.open_request(rid, torch.randn(80, generator=g).cuda(), prompt_len=8)
    chunks = {"a": torch.randn(80, 16, generator=g).cuda(), "b": torch.randn(80, 11, generator=g).cuda()}
    for _ in range(3):  # eager warm-up, capture, first replay
        server.solve_chunk(chunks)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = [server.solve_chunk(chunks) for _ in range(2)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.isfinite(o[rid]).all() for o in outs for rid in chunks)


def test_graphs_option_installs_the_graph_solver_and_matches_eager():
    """CFMServer(graphs=True) solves through the graph cache (eager on CPU): same mel, bitwise."""
    from torch_cfm.graphs import GraphCache
    from torch_cfm.solve import GraphedArenaSolver

    cfm = StreamingCFM(DiT(DiTConfig(hidden=64, depth=2, heads=4, head_dim=16)).random_init_(0),
                       n_timesteps=3, seed=0)
    mels = []
    for graphs in (False, True):
        server = CFMServer(cfm, max_requests=2, max_prompt_frames=40, graphs=graphs)
        assert isinstance(server.solver, GraphedArenaSolver) is graphs
        assert isinstance(server.graph_cache, GraphCache) is graphs
        gen = torch.Generator().manual_seed(1)
        server.open_request("a", torch.randn(80, generator=gen), prompt_mu=torch.randn(80, 30, generator=gen),
                            prompt_mel=torch.randn(80, 30, generator=gen))
        mels.append(server.solve_chunk({"a": torch.randn(80, 50, generator=gen)})["a"])
    assert torch.isfinite(mels[0]).all() and mels[0].abs().max() > 0
    assert torch.equal(mels[0], mels[1])
    assert server.graph_cache.misses == 2 and server.graph_cache.captures == 0  # the prompt and the chunk
