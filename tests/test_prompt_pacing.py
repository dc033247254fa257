"""Prompt solves spread over ticks (``CFMServer(prompt_steps_per_tick=k)``): every stream's prompt and
chunks equal that stream solved alone with whole solves (``StreamingCFM.forward_chunk`` + the trim,
the upstream loop), whatever the arrivals, closes and chunk ticks in between; the step-span
contract of the arena solver; the warm-up covers every cohort shape."""

from __future__ import annotations

import random

import pytest
import torch

from oracle import err_rel_fro
from solo import Solo
from torch_cfm.graphs import GraphCache
from torch_cfm.models import DiT, DiTConfig
from torch_cfm.models.cache import CacheArena
from torch_cfm.serving import CFMServer
from torch_cfm.solve import ArenaSolver, StreamingCFM

TINY = DiTConfig(hidden=64, depth=2, heads=4, head_dim=16)
STEPS = 5
TOL = 2e-5


@pytest.fixture(scope="module")
def cfm():
    return StreamingCFM(DiT(TINY).random_init_(21).eval(), n_timesteps=STEPS, seed=5)


def _close(a, b):
    return err_rel_fro(a, b) < TOL


@pytest.mark.parametrize("k,buckets", [(1, None), (2, None), (STEPS, None), (2, (1, 2, 3))])
def test_paced_streams_equal_solo_streams(cfm, k, buckets):
    """Arrivals on several ticks (cohorts at different steps), chunk ticks of ready streams in
    between, closes mid-prompt, one arena or several: each prompt mel, chunk mel and cache equals
    the solo stream's."""
    g = torch.Generator().manual_seed(k)
    rng = random.Random(k)
    server = CFMServer(cfm, max_requests=6, buckets=buckets, max_prompt_frames=14, max_chunk_frames=9,
                       slot_buckets=(1, 2, 4), prompt_steps_per_tick=k)
    ptrs = [a.data_ptrs() for a in server.arenas]
    solos, prompt_out, checked, next_id = {}, {}, 0, 0
    for tick in range(14):
        for _ in range(rng.choice([0, 1, 1, 2, 3]) if tick < 9 else 0):
            if len(server.open_requests) == 6:
                break
            rid, prompt = f"r{next_id}", rng.choice([5, 9, 14])
            next_id += 1
            spks, mu, mel = (torch.randn(80, generator=g), torch.randn(80, prompt, generator=g),
                             torch.randn(80, prompt, generator=g))
            assert server.open_request(rid, spks, prompt_mu=mu, prompt_mel=mel) is None
            assert not server.ready(rid) and rid in server.pending_prompts
            solos[rid] = Solo(cfm, spks, prompt)
            prompt_out[rid] = solos[rid].chunk(mu, mel)
        done = server.advance_prompts()
        for rid, mel in done.items():
            assert server.ready(rid) and _close(mel, prompt_out.pop(rid)), (tick, rid)
            checked += 1
        if tick == 3 and server.pending_prompts:  # a close while its cohort is mid-solve
            gone = server.pending_prompts[0]
            server.close_request(gone)
            del solos[gone], prompt_out[gone]
        ready = [rid for rid in server.open_requests if server.ready(rid)]
        chunks = {rid: torch.randn(80, rng.choice([1, 4, 9]), generator=g) for rid in ready}
        outs = server.solve_chunk(chunks)
        for rid, mu in chunks.items():
            assert _close(outs[rid], solos[rid].chunk(mu)), (tick, rid)
            cnn, att = server.request_caches(rid)
            assert server.cache_length(rid) == solos[rid].att.shape[4]
            assert _close(cnn, solos[rid].cnn) and _close(att, solos[rid].att), (tick, rid)
            checked += 1
        if tick % 4 == 3 and ready:
            server.close_request(ready[0])
            del solos[ready[0]]
    assert not prompt_out and not server.pending_prompts
    assert checked > 30
    assert [a.data_ptrs() for a in server.arenas] == ptrs


def test_a_prompt_takes_ceil_n_over_k_ticks_and_chunks_wait(cfm):
    server = CFMServer(cfm, max_requests=2, max_prompt_frames=8, max_chunk_frames=4, prompt_steps_per_tick=2)
    g = torch.Generator().manual_seed(0)
    server.open_request("a", torch.randn(80, generator=g), prompt_mu=torch.randn(80, 8, generator=g))
    with pytest.raises(ValueError, match=r"chunks\['a'\].*ready"):
        server.solve_chunk({"a": torch.randn(80, 4, generator=g)})
    ticks = 0
    while not server.ready("a"):
        assert ticks < STEPS
        out = server.advance_prompts()
        ticks += 1
    assert ticks == 3 and list(out) == ["a"] and out["a"].shape == (80, 8)  # spans (0,2) (2,4) (4,5)
    assert server.advance_prompts() == {}
    assert server.solve_chunk({"a": torch.randn(80, 4, generator=g)})["a"].shape == (80, 4)


def test_a_slot_closed_mid_prompt_returns_when_its_cohort_ends(cfm):
    server = CFMServer(cfm, max_requests=2, max_prompt_frames=8, max_chunk_frames=4, prompt_steps_per_tick=1)
    g = torch.Generator().manual_seed(1)
    for rid in "ab":
        server.open_request(rid, torch.randn(80, generator=g), prompt_mu=torch.randn(80, 8, generator=g))
    server.advance_prompts()
    server.close_request("a")
    with pytest.raises(server.AdmissionError, match="no free request slot"):
        server.open_request("c", torch.randn(80, generator=g))
    done = {}
    for _ in range(STEPS - 1):
        done.update(server.advance_prompts())
    assert list(done) == ["b"]
    server.open_request("c", torch.randn(80, generator=g))  # a's slot is free again
    # a request closed before its first tick simply leaves the queue
    server.close_request("c")
    server.open_request("d", torch.randn(80, generator=g), prompt_mu=torch.randn(80, 8, generator=g))
    server.close_request("d")
    assert server.advance_prompts() == {} and server.pending_prompts == []


def test_pacing_argument_errors(cfm):
    for bad in (0, STEPS + 1, 1.5, True):
        with pytest.raises(ValueError, match="prompt_steps_per_tick"):
            CFMServer(cfm, max_requests=1, max_prompt_frames=4, prompt_steps_per_tick=bad)
    assert CFMServer(cfm, max_requests=1, max_prompt_frames=4).advance_prompts() == {}
    for k in (None, 2):  # a refused open changes nothing: no slot taken, nothing queued
        server = CFMServer(cfm, max_requests=1, max_prompt_frames=4, prompt_steps_per_tick=k)
        with pytest.raises(ValueError, match="prompt_mel"):
            server.open_request("a", torch.randn(80), prompt_mu=torch.randn(80, 4), prompt_mel=torch.randn(80, 3))
        with pytest.raises(ValueError, match="max_prompt_frames"):
            server.open_request("a", torch.randn(80), prompt_mu=torch.randn(80, 5))
        assert server.open_requests == [] and server.free_slots == 1 and server.pending_prompts == []


def test_step_spans_equal_one_whole_solve_and_commit_only_at_the_end(cfm):
    """ArenaSolver(steps=...) called span by span = one call, bitwise on CPU; before the last span
    out_mel, lengths and keys are untouched and an idle row keeps its state; only the spans' steps' caches
    are written."""
    g = torch.Generator().manual_seed(3)
    cfg = cfm.estimator.config

    def arena():
        a = CacheArena.allocate(cfg, STEPS, 3, 20, 10, torch.device("cpu"), torch.float32, step_state=True)
        a.mu.normal_(generator=g)
        a.cond.normal_(generator=g)
        a.spks.normal_(generator=g)
        a.x_state.normal_(generator=g)
        return a

    whole, spread = arena(), arena()
    for name in ("mu", "cond", "spks", "x_state"):
        getattr(spread, name).copy_(getattr(whole, name))
    lengths = torch.tensor([7, 0, 10], dtype=torch.int32)

    def run(a, steps=None, slots=None):
        a.valid_lengths.copy_(lengths)
        ArenaSolver(cfm.estimator, n_timesteps=STEPS)(a, cfm.noise, t_len=10, cache_frames=0, slots=slots, steps=steps)

    run(whole)
    idle_state = spread.x_state[1].clone()
    before = {k: v.clone() for k, v in spread.tensors().items()}
    run(spread, (0, 2))
    for name in ("out_mel", "cache_lengths", "frame_keys"):
        assert torch.equal(getattr(spread, name), before[name]), name
    assert not torch.equal(spread.att[0], before["att"][0]) and torch.equal(spread.att[2:], before["att"][2:])
    run(spread, (2, 4))
    run(spread, (4, STEPS))
    assert torch.equal(spread.x_state[1], idle_state)
    for name in ("att", "cnn", "cache_lengths", "frame_keys"):
        assert torch.equal(getattr(spread, name), getattr(whole, name)), name
    assert torch.equal(spread.out_mel[[0, 2]], whole.out_mel[[0, 2]])  # an idle row's out_mel is padding


def test_step_span_errors(cfm):
    cfg = cfm.estimator.config
    a = CacheArena.allocate(cfg, STEPS, 1, 8, 4, torch.device("cpu"), torch.float32)
    solver = ArenaSolver(cfm.estimator, n_timesteps=STEPS)
    for bad in ((2, 2), (0, STEPS + 1), (-1, 2), [0, 2], (0.0, 2)):
        with pytest.raises(ValueError, match="steps"):
            solver(a, cfm.noise, t_len=4, cache_frames=0, steps=bad)
    with pytest.raises(ValueError, match="x_state"):
        solver(a, cfm.noise, t_len=4, cache_frames=0, steps=(0, 2))
    solver(a, cfm.noise, t_len=4, cache_frames=0, steps=(0, STEPS))  # the whole span needs no state


def test_warmup_covers_every_cohort_shape(cfm):
    """After warmup(prompt_frames=...), a paced workload creates no graph-solver key (on CUDA: no
    compile or capture)."""
    server = CFMServer(cfm, max_requests=5, max_prompt_frames=12, max_chunk_frames=6, chunk_buckets=(6,),
                       cache_buckets=(0, 16, 112), slot_buckets=(1, 2, 4), graphs=True, prompt_steps_per_tick=2)
    solver = server.graph_cache
    assert isinstance(solver, GraphCache)
    shapes = server.prompt_shapes([9, 12])
    # cohort sizes 1, 2, 4 and 5 - 4 = 1; T 9 -> 12 (the staging length); spans (0,2) (2,4) (4,5)
    assert {(s, t, span) for _, s, t, span in shapes} == {(s, 12, span) for s in (1, 2, 4) for span in
                                                          ((0, 2), (2, 4), (4, 5))}
    with pytest.raises(ValueError, match="prompt_frames"):
        server.prompt_shapes([0])
    server.warmup(pairs=[(6, lb) for lb in (0, 16, 112)], prompt_frames=[12], progress=False)
    misses = solver.misses
    g = torch.Generator().manual_seed(4)
    rng = random.Random(4)
    for tick in range(16):
        for _ in range(rng.choice([0, 1, 3])):
            if len(server.open_requests) < 5:
                rid = f"{tick}-{rng.random()}"
                server.open_request(rid, torch.randn(80, generator=g), prompt_mu=torch.randn(80, 12, generator=g))
        server.advance_prompts()
        ready = [rid for rid in server.open_requests if server.ready(rid)]
        server.solve_chunk({rid: torch.randn(80, 6, generator=g) for rid in ready})
        if ready and rng.random() < 0.4:
            server.close_request(rng.choice(ready))
    assert solver.misses == misses, "a paced tick after the warm-up created a new solve key"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_paced_prompts_equal_whole_solves_under_graphs(dtype):
    """On CUDA (fused body, CUDA graphs): a paced prompt + chunks equals the same stream with whole
    prompt solves (bitwise: the same kernels run the same steps)."""
    dev = torch.device("cuda")
    est = DiT(DiTConfig(hidden=128, depth=2, heads=4, head_dim=32)).random_init_(6).eval().to(dev, dtype)
    cfm = StreamingCFM(est, n_timesteps=10, seed=2).to(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    mus = [torch.randn(80, 40, device=dev, generator=g, dtype=dtype) for _ in range(4)]
    spks = torch.randn(80, device=dev, generator=g, dtype=dtype)
    outs = []
    for k in (None, 3):
        server = CFMServer(cfm, max_requests=2, max_prompt_frames=40, max_chunk_frames=10, graphs=True,
                           prompt_steps_per_tick=k)
        got = [server.open_request("s", spks, prompt_mu=mus[0], prompt_mel=mus[0])]
        while not server.ready("s"):
            got += list(server.advance_prompts().values())
        for mu in mus[1:]:
            got.append(server.solve_chunk({"s": mu[:, :10]})["s"])
        outs.append([t for t in got if t is not None])
    for a, b in zip(*outs):
        assert torch.equal(a, b)
