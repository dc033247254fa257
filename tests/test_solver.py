"""StreamingCFM (SPEC §3) and the arena solve against the oracle's per-request solve."""

from __future__ import annotations

import math

import pytest
import torch

import dit_oracle as O
from oracle import err_rel_fro
from torch_cfm.models import (CacheArena, DiT, DiTConfig, StreamingCFM, euler_timesteps, solve_arena_chunk,
                              trim_attention_cache, trim_gather_index)

TINY = DiTConfig(hidden=64, depth=2, heads=4, head_dim=16)
STEPS = 3
TOL = 3e-5


@pytest.fixture(scope="module")
def cfm():
    return StreamingCFM(DiT(TINY).random_init_(8).eval(), n_timesteps=STEPS, seed=5)


@pytest.fixture(scope="module")
def sd(cfm):
    return O.to_dtype(cfm.estimator.state_dict())


def test_cosine_schedule():
    ts = euler_timesteps(10)
    assert len(ts) == 11 and ts[0] == 0.0 and abs(ts[-1] - 1.0) < 1e-15
    for i, t in enumerate(ts):
        assert abs(t - (1 - math.cos(math.pi / 2 * i / 10))) < 1e-15


def test_noise_buffer_is_seeded_and_fixed():
    est = DiT(TINY)
    a, b, c = StreamingCFM(est, seed=1), StreamingCFM(est, seed=1), StreamingCFM(est, seed=2)
    assert a.noise.shape == (1, 80, 30000) and a.noise.dtype == torch.float32
    assert torch.equal(a.noise, b.noise) and not torch.equal(a.noise, c.noise)
    assert abs(a.noise.std().item() - 1) < 0.01
    given = torch.randn(1, 80, 100)
    assert StreamingCFM(est, noise=given).noise is given
    with pytest.raises(ValueError, match=r"^StreamingCFM: noise must be a tensor of shape \(1, 80, F\)"):
        StreamingCFM(est, noise=torch.randn(80, 100))
    with pytest.raises(ValueError, match="n_timesteps must be a positive int"):
        StreamingCFM(est, n_timesteps=0)


def _solve_oracle(sd, noise, mu, spks, cond, cnn=None, att=None, cfg_rate=0.7):
    """Per request oracle; caches (n, depth, 2B, ...) -> per request (n, depth, 2, ...)."""
    batch = mu.shape[0]
    mels, cnns, atts = [], [], []
    for b in range(batch):
        rows = [b, batch + b]
        mel, c, a = O.solve_request(sd, mu[b].double(), spks[b].double(), cond[b].double(), noise.double(), STEPS,
                                    cfg_rate, None if cnn is None else cnn[:, :, rows].double(),
                                    None if att is None else att[:, :, rows].double())
        mels.append(mel)
        cnns.append(c)
        atts.append(a)
    return mels, cnns, atts


@pytest.mark.parametrize("cfg_rate", [0.7, 0.25])
def test_forward_chunk_matches_oracle_two_chunks(cfm, sd, cfg_rate):
    cfm.cfg_rate = cfg_rate
    try:
        g = torch.Generator().manual_seed(3)
        mu, cond, spks = torch.randn(2, 80, 9, generator=g), torch.randn(2, 80, 9, generator=g), torch.randn(2, 80, generator=g)
        mel, cnn, att = cfm.forward_chunk(mu, spks, cond)
        assert mel.shape == (2, 80, 9) and cnn.shape == (STEPS, 2, 4, 128, 2) and att.shape == (STEPS, 2, 4, 4, 9, 32)
        mels, cnns, atts = _solve_oracle(sd, cfm.noise, mu, spks, cond, cfg_rate=cfg_rate)
        for b in range(2):
            assert err_rel_fro(mel[b], mels[b]) < TOL
            assert err_rel_fro(cnn[:, :, [b, 2 + b]], cnns[b]) < TOL
            assert err_rel_fro(att[:, :, [b, 2 + b]], atts[b]) < TOL
        # second chunk: caches in, noise read at offset L = 9
        mu2 = torch.randn(2, 80, 6, generator=g)
        mel2, cnn2, att2 = cfm.forward_chunk(mu2, spks, torch.zeros_like(mu2), cnn, att)
        assert att2.shape[4] == 15
        mels, cnns, atts = _solve_oracle(sd, cfm.noise, mu2, spks, torch.zeros_like(mu2), cnn, att, cfg_rate=cfg_rate)
        for b in range(2):
            assert err_rel_fro(mel2[b], mels[b]) < TOL
            assert err_rel_fro(att2[:, :, [b, 2 + b]], atts[b]) < TOL
            assert err_rel_fro(cnn2[:, :, [b, 2 + b]], cnns[b]) < TOL
    finally:
        cfm.cfg_rate = 0.7


def test_forward_chunk_errors(cfm):
    mu = torch.randn(1, 80, 5)
    with pytest.raises(ValueError, match=r"^StreamingCFM.forward_chunk: att_cache must have shape"):
        cfm.forward_chunk(mu, torch.randn(1, 80), mu, att_cache=torch.zeros(STEPS, 2, 4, 4, 3, 32))
    short = StreamingCFM(cfm.estimator, n_timesteps=STEPS, noise=torch.randn(1, 80, 10))
    att = torch.zeros(STEPS, 2, 2, 4, 8, 32)
    with pytest.raises(ValueError, match="leave room in the noise buffer"):
        short.forward_chunk(mu, torch.randn(1, 80), mu, torch.zeros(STEPS, 2, 2, 128, 2), att)


def test_trim_rule_exactly():
    att = torch.arange(2 * 130, dtype=torch.float32).view(1, 2, 130, 1).expand(1, 2, 130, 4)
    assert trim_attention_cache(att, 30) is att  # 130 = 30 + 100: not more than the bound
    out = trim_attention_cache(att, 20)
    assert out.shape[-2] == 120
    assert torch.equal(out, torch.cat([att[..., :20, :], att[..., -100:, :]], dim=-2))
    assert torch.equal(out, O.trim(att, 20))


def test_trim_gather_index_matches_per_row_rule():
    g = torch.Generator().manual_seed(0)
    new_len = torch.randint(0, 260, (64,), generator=g)
    prompt = torch.randint(0, 120, (64,), generator=g)
    index, lengths = trim_gather_index(new_len, prompt, 260, 260)
    for n in range(64):
        frames = torch.arange(int(new_len[n]))[:, None].float()  # frame ids, newest first
        expect = O.trim(frames, int(prompt[n]))[:, 0]
        assert int(lengths[n]) == expect.shape[0]
        assert torch.equal(index[n, :expect.shape[0]].float(), expect)


def _arena(cfm, rows, max_cache, max_chunk):
    return CacheArena.allocate(TINY, STEPS, rows, max_cache, max_chunk, torch.device("cpu"), torch.float32)


def _ragged_case(cfm, compact):
    """Solve a 3-slot arena (one slot idle): returns (state before, arena after)."""
    g = torch.Generator().manual_seed(9)
    arena = _arena(cfm, 3, 40, 12)
    # slot 0: cache 7 frames (prompt 4); slot 1: idle with 5 cached frames; slot 2: no cache yet
    for slot, frames in RAGGED_INIT.items():
        arena.att[:, :, [slot, 3 + slot], :, :frames] = torch.randn(STEPS, 2, 2, 4, frames, 32, generator=g)
        arena.cnn[:, :, [slot, 3 + slot]] = torch.randn(STEPS, 2, 2, 128, 2, generator=g)
        arena.cache_lengths[slot] = frames
    arena.prompt_lengths.copy_(torch.tensor([4, 2, 6], dtype=torch.int32))
    arena.spks.copy_(torch.randn(3, 80, generator=g))
    arena.mu.copy_(torch.randn(3, 80, 12, generator=g))
    arena.cond.copy_(torch.randn(3, 80, 12, generator=g))
    arena.valid_lengths.copy_(torch.tensor([10, 0, 6], dtype=torch.int32))
    before = {k: v.clone() for k, v in arena.__dict__.items()}
    ptrs = arena.data_ptrs()
    slots = torch.tensor([0, 2]) if compact else None
    solve_arena_chunk(cfm.estimator, arena.att, arena.cnn, cfm.noise, arena.mu[:, :, :10], arena.spks,
                      arena.cond[:, :, :10], arena.valid_lengths, arena.cache_lengths, arena.prompt_lengths,
                      arena.out_mel[:, :, :10], cache_frames=7, n_timesteps=STEPS, cfg_rate=0.7, slots=slots)
    assert arena.data_ptrs() == ptrs
    return before, arena


RAGGED_INIT = {0: 7, 1: 5, 2: 0}


def _check_ragged_case(cfm, sd, compact, before, arena):
    assert arena.cache_lengths.tolist() == [17, 5, 6]
    for slot, tn in ((0, 10), (2, 6)):
        rows = [slot, 3 + slot]
        ln = RAGGED_INIT[slot]
        mel, c, a = O.solve_request(sd, before["mu"][slot, :, :tn].double(), before["spks"][slot].double(),
                                    before["cond"][slot, :, :tn].double(), cfm.noise.double(), STEPS, 0.7,
                                    before["cnn"][:, :, rows].double(),
                                    before["att"][:, :, rows, :, :ln].double())
        assert err_rel_fro(arena.out_mel[slot, :, :tn], mel) < TOL
        assert err_rel_fro(arena.cnn[:, :, rows], c) < TOL
        assert err_rel_fro(arena.att[:, :, rows, :, :tn + ln], a) < TOL
    # the idle slot: valid cache frames and conv caches bit-identical
    idle = [1, 4]
    assert torch.equal(arena.att[:, :, idle, :, :5], before["att"][:, :, idle, :, :5])
    assert torch.equal(arena.cnn[:, :, idle], before["cnn"][:, :, idle])
    if compact:  # untouched entirely, out_mel included
        assert torch.equal(arena.att[:, :, idle], before["att"][:, :, idle])
        assert torch.equal(arena.out_mel[1], before["out_mel"][1])
    assert torch.isfinite(arena.att).all() and torch.isfinite(arena.out_mel).all()


@pytest.mark.parametrize("compact", [False, True])
def test_solve_arena_chunk_ragged_rows_match_oracle_and_idle_rows_stay(cfm, sd, compact):
    _check_ragged_case(cfm, sd, compact, *_ragged_case(cfm, compact))


def _fused_route_child(out_path: str) -> None:
    """Child (TRITON_INTERPRET=1): the same cases with the fused route forced on CPU (the policy
    never picks it there): schedule tables, the staged input updated by cfg_euler, Triton body."""
    from torch_cfm.models import solver

    calls = []
    solver._fused_route = lambda *args: calls.append(args) or "ieee"
    cfm = StreamingCFM(DiT(TINY).random_init_(8).eval(), n_timesteps=STEPS, seed=5)
    results = {compact: _ragged_case(cfm, compact) for compact in (False, True)}
    assert calls, "the fused route was not taken"
    assert len(solver._SCHEDULE_TABLES) == 1, "the schedule tables were not cached per packed weights"
    torch.save({c: (b, dict(vars(a))) for c, (b, a) in results.items()}, out_path)


@pytest.fixture(scope="module")
def fused_route_results(tmp_path_factory):
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    out_path = str(tmp_path_factory.mktemp("solver_fused") / "out.pt")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([here, os.path.dirname(here), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--fused-route-child", out_path], env=env,
                          cwd=here, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out_path)


@pytest.mark.parametrize("compact", [False, True])
def test_solve_arena_chunk_fused_route_matches_oracle(cfm, sd, compact, fused_route_results):
    before, state = fused_route_results[compact]
    arena = CacheArena(**state)
    _check_ragged_case(cfm, sd, compact, before, arena)


def test_solve_arena_chunk_trims_every_step_cache(cfm):
    g = torch.Generator().manual_seed(4)
    arena = _arena(cfm, 1, 110, 20)  # prompt 8 -> bound 108 frames
    arena.att.copy_(torch.randn(arena.att.shape, generator=g))
    arena.cache_lengths[0] = 100
    arena.prompt_lengths[0] = 8
    arena.valid_lengths[0] = 20
    old = arena.att.clone()
    solve_arena_chunk(cfm.estimator, arena.att, arena.cnn, cfm.noise, arena.mu, arena.spks, arena.cond,
                      arena.valid_lengths, arena.cache_lengths, arena.prompt_lengths, arena.out_mel,
                      cache_frames=100, n_timesteps=STEPS)
    assert arena.cache_lengths.tolist() == [108]
    # new cache = [20 current ; 100 old] = 120 frames > 8 + 100: keep [:8] (newest current frames)
    # then the last 100 frames, i.e. new frames 20..119 = the 100 old frames, for every step.
    assert torch.equal(arena.att[:, :, :, :, 8:108], old[:, :, :, :, :100])


if __name__ == "__main__":
    import os
    import sys

    if len(sys.argv) >= 3 and sys.argv[1] == "--fused-route-child":
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("run the child with TRITON_INTERPRET=1")
        _fused_route_child(sys.argv[2])
