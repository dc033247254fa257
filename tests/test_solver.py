"""StreamingCFM (docs/design.md §3) and the arena solve against the oracle's per-request solve."""

from __future__ import annotations

import math

import pytest
import torch

from interpreter_child import interpreter_env
from hypothesis import given
from hypothesis import strategies as st

import dit_oracle as O
from oracle import err_rel_fro
from torch_cfm.models import CacheArena, DiT, DiTConfig, trim_attention_cache, trim_gather_index
from torch_cfm.solve import ArenaSolver, StreamingCFM, euler_timesteps
from torch_cfm.models.cache import arena_chunk_plan, keyed_to_newest_first
from torch_cfm.reference.cache_trim import move_frames_reference, trim_copy_reference

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


def _frames_as_cache(tokens: torch.Tensor) -> torch.Tensor:
    """(R, F) token ids as a (1, R, 1, F, 2) cache (depth, rows, heads, frames, 2D) for the frame copies."""
    return tokens.to(torch.float64)[None, :, None, :, None].expand(1, -1, 1, -1, 2).contiguous()


def _drive_keyed_arena(rows: int, keep: int, prompt: list[int], max_chunk: int, chunks: list) -> bool:
    """Drive a keyed arena of token ids chunk by chunk through ``arena_chunk_plan`` and check it
    against python lists that follow docs/design.md §2-3 literally (new cache = [current ; old], then the
    trim): every valid frame holds the token its frame key names, the keys are a permutation, and
    the in-place form (append + ``moves``), the copy-out form (``old_frames`` + append +
    ``write_back``) and the reference form (``old_by_key`` + ``new_cache_keys``) agree.

    ``chunks``: (t_len, per-row valid lengths, extra cache-window frames) per chunk. Returns whether
    some row went through the trim."""
    key_frames = max(prompt) + keep
    frames = key_frames + max_chunk
    prompt_t = torch.tensor(prompt)
    spec = [[] for _ in range(rows)]  # SPEC order: index = key
    arena = torch.full((rows, frames), -1.0, dtype=torch.float64)
    frame_keys = torch.arange(key_frames, dtype=torch.int32).repeat(rows, 1)
    lengths = torch.zeros(rows, dtype=torch.int64)
    next_token, trimmed = 0, False
    for chunk, (t_len, valid_list, slack) in enumerate(chunks):
        valid = torch.tensor(valid_list)
        cache_frames = min(int(lengths.max()) + slack, key_frames)
        plan = arena_chunk_plan(frame_keys, lengths, valid, prompt_t, cache_frames, t_len, keep)
        width = cache_frames + t_len
        scratch_c = _frames_as_cache(torch.full((rows, width), -2.0, dtype=torch.float64))
        trim_copy_reference(scratch_c, _frames_as_cache(arena), plan.old_frames)
        scratch = scratch_c[0, :, 0, :, 0].clone()
        old_c = torch.zeros(1, rows, 1, cache_frames, 2, dtype=torch.float64)
        trim_copy_reference(old_c, _frames_as_cache(arena), plan.old_by_key)
        new_cache = []
        for r in range(rows):
            ln, tn = int(lengths[r]), int(valid[r])
            assert old_c[0, r, 0, :ln, 0].tolist() == spec[r], (chunk, r)
            cur = list(range(next_token, next_token + tn))
            next_token += tn
            for f, tok in enumerate(cur):  # the body's in-place append: frame L + T_r - 1 - f
                arena[r, ln + tn - 1 - f] = tok
                scratch[r, ln + tn - 1 - f] = tok
            new_cache.append(cur + spec[r])
            spec[r] = O.trim(torch.tensor(new_cache[r], dtype=torch.float64)[:, None], prompt[r], keep)[:, 0].tolist()
            trimmed |= len(new_cache[r]) > len(spec[r])
        in_place = _frames_as_cache(arena)
        assert (plan.moves.count <= valid).all()  # a refill never moves more than the chunk's frames
        move_frames_reference(in_place, in_place, plan.moves)
        padded_new = torch.full((rows, width), -5.0, dtype=torch.float64)
        for r in range(rows):
            padded_new[r, :len(new_cache[r])] = torch.tensor(new_cache[r], dtype=torch.float64)
        new_c = torch.full((1, rows, 1, frames, 2), -4.0, dtype=torch.float64)
        trim_copy_reference(new_c, _frames_as_cache(padded_new), plan.new_cache_keys)
        arena = in_place[0, :, 0, :, 0].clone()
        for r in range(rows):
            n = int(plan.new_lengths[r])
            assert n == len(spec[r]), (chunk, r)
            keys = plan.new_frame_keys[r, :n].tolist()
            assert sorted(keys) == list(range(n)), (chunk, r)
            assert arena[r, :n].tolist() == [spec[r][k] for k in keys], (chunk, r)
            assert new_c[0, r, 0, :n, 0].tolist() == arena[r, :n].tolist(), (chunk, r)
            wb = plan.write_back
            count = int(wb.count[r])
            assert count <= int(valid[r])  # only the chunk's frames come back
            changed = wb.dst[r, :count].tolist()
            assert all(j < n for j in changed) and len(set(changed)) == count
            assert all(scratch[r, int(s_j)] == arena[r, j] for s_j, j in zip(wb.src[r, :count], changed)), (chunk, r)
            unchanged = [j for j in range(n) if j not in changed]
            assert all(j < int(lengths[r]) for j in unchanged), (chunk, r)  # old frames, still in place
        frame_keys[:, :plan.new_frame_keys.shape[1]] = plan.new_frame_keys
        lengths = plan.new_lengths.clone()
    return trimmed


def test_arena_chunk_plan_keeps_every_row_equal_to_the_spec_cache():
    """A long seeded stream (12 chunks, 5 rows, ragged, some idle rows) that trims every row."""
    g = torch.Generator().manual_seed(0)
    rows, keep, max_prompt, max_chunk = 5, 4, 6, 9
    prompt = torch.randint(0, max_prompt + 1, (rows,), generator=g).tolist()
    chunks = []
    for chunk in range(12):
        t_len = int(torch.randint(1, max_chunk + 1, (1,), generator=g))
        valid = torch.randint(0, t_len + 1, (rows,), generator=g)
        valid[chunk % rows] = t_len
        chunks.append((t_len, valid.tolist(), int(torch.randint(0, 2, (1,), generator=g))))
    assert _drive_keyed_arena(rows, keep, prompt, max_chunk, chunks)


@st.composite
def keyed_streams(draw):
    """(rows, keep, prompts, max chunk, chunks) with lengths at 0, 1, the chunk and in between."""
    rows = draw(st.integers(1, 4))
    keep = draw(st.integers(1, 5))
    prompt = draw(st.lists(st.integers(0, 6), min_size=rows, max_size=rows))
    max_chunk = draw(st.integers(1, 8))
    chunks = []
    for _ in range(draw(st.integers(1, 8))):
        t_len = draw(st.integers(1, max_chunk))
        valid = draw(st.lists(st.one_of(st.sampled_from([0, 1, t_len]), st.integers(0, t_len)),
                              min_size=rows, max_size=rows))
        chunks.append((t_len, [min(v, t_len) for v in valid], draw(st.integers(0, 2))))
    return rows, keep, prompt, max_chunk, chunks


@given(keyed_streams())
def test_arena_chunk_plan_property(stream):
    """Hypothesis: any stream of ragged chunks (idle rows, one-frame chunks, prompts of 0) keeps
    the keyed arena equal to the SPEC cache (see ``_drive_keyed_arena``)."""
    _drive_keyed_arena(*stream)


def _arena(cfm, rows, max_cache, max_chunk, keyed=False):
    return CacheArena.allocate(TINY, STEPS, rows, max_cache, max_chunk, torch.device("cpu"), torch.float32, keyed=keyed)


def _scramble(arena: CacheArena, g: torch.Generator) -> None:
    """Turn an arena filled in the SPEC layout into a keyed one: each slot's valid frames in a
    random order (the same for every step, block, head), ``frame_keys`` naming their keys."""
    rows = arena.rows
    for slot in range(rows):
        ln = int(arena.cache_lengths[slot])
        perm = torch.randperm(ln, generator=g)  # frame j holds key perm[j]
        cfg_rows = [slot, rows + slot]
        arena.att[:, :, cfg_rows, :, :ln] = arena.att[:, :, cfg_rows, :, :ln][:, :, :, :, perm].clone()
        arena.frame_keys[slot, :ln] = perm.to(torch.int32)


def _ragged_case(cfm, compact, keyed=False):
    """Solve a 3-slot arena (one slot idle): returns (state before in the SPEC layout, arena after).
    ``keyed``: the arena is keyed, scrambled, has append room, and the trim keeps 3 old frames (so
    slot 0 is trimmed: 7 + 10 > 4 + 3); in place without ``compact``, copied out with it."""
    g = torch.Generator().manual_seed(9)
    arena = CacheArena.allocate(TINY, STEPS, 3, 40, 12, torch.device("cpu"), torch.float32, 12 if keyed else 0,
                                keyed=keyed)
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
    before = {k: v.clone() for k, v in arena.tensors().items()}
    if keyed:
        _scramble(arena, g)
        before["keyed_att"] = arena.att.clone()
    ptrs = arena.data_ptrs()
    slots = torch.tensor([0, 2]) if compact else None
    solver = ArenaSolver(cfm.estimator, n_timesteps=STEPS, cfg_rate=0.7, keep_oldest=3 if keyed else 100)
    solver(arena, cfm.noise, t_len=10, cache_frames=7, slots=slots)
    assert arena.data_ptrs() == ptrs
    return before, arena


RAGGED_INIT = {0: 7, 1: 5, 2: 0}


def _check_ragged_case(cfm, sd, compact, before, arena, keyed=False):
    keep = 3 if keyed else 100
    assert arena.cache_lengths.tolist() == ([4 + 3, 5, 6] if keyed else [17, 5, 6])
    att = arena.att
    if keyed:
        rows_keys = torch.cat([arena.frame_keys, arena.frame_keys])
        att = keyed_to_newest_first(arena.att, rows_keys, torch.cat([arena.cache_lengths] * 2))
    for slot, tn in ((0, 10), (2, 6)):
        rows = [slot, 3 + slot]
        ln = RAGGED_INIT[slot]
        mel, c, a = O.solve_request(sd, before["mu"][slot, :, :tn].double(), before["spks"][slot].double(),
                                    before["cond"][slot, :, :tn].double(), cfm.noise.double(), STEPS, 0.7,
                                    before["cnn"][:, :, rows].double(),
                                    before["att"][:, :, rows, :, :ln].double())
        a = O.trim(a, int(before["prompt_lengths"][slot]), keep)
        assert err_rel_fro(arena.out_mel[slot, :, :tn], mel) < TOL
        assert err_rel_fro(arena.cnn[:, :, rows], c) < TOL
        assert err_rel_fro(att[:, :, rows, :, :a.shape[4]], a) < TOL
    # the idle slot: valid cache frames and conv caches bit-identical
    idle = [1, 4]
    raw = before["keyed_att"] if keyed else before["att"]
    assert torch.equal(arena.att[:, :, idle, :, :5], raw[:, :, idle, :, :5])
    assert torch.equal(arena.cnn[:, :, idle], before["cnn"][:, :, idle])
    if compact:  # untouched entirely, out_mel included
        assert torch.equal(arena.att[:, :, idle], raw[:, :, idle])
        assert torch.equal(arena.out_mel[1], before["out_mel"][1])
    assert torch.isfinite(arena.att).all() and torch.isfinite(arena.out_mel).all()


@pytest.mark.parametrize("keyed", [False, True])
@pytest.mark.parametrize("compact", [False, True])
def test_solve_arena_chunk_ragged_rows_match_oracle_and_idle_rows_stay(cfm, sd, compact, keyed):
    _check_ragged_case(cfm, sd, compact, *_ragged_case(cfm, compact, keyed), keyed=keyed)


def _fused_route_child(out_path: str) -> None:
    """Child (TRITON_INTERPRET=1): the same cases with the fused route forced on CPU (the policy
    never picks it there): schedule tables, the staged input updated by cfg_euler, Triton body."""
    from torch_cfm.solve import schedule, steppers

    calls = []
    steppers.fused_precision = lambda *args: calls.append(args) or "ieee"
    cfm = StreamingCFM(DiT(TINY).random_init_(8).eval(), n_timesteps=STEPS, seed=5)
    results = {(compact, keyed): _ragged_case(cfm, compact, keyed) for compact in (False, True)
               for keyed in (False, True)}
    assert calls, "the fused route was not taken"
    assert len(schedule._TABLES) == 1, "the schedule tables were not cached per packed weights"
    torch.save({c: (b, dict(vars(a))) for c, (b, a) in results.items()}, out_path)


@pytest.fixture(scope="module")
def fused_route_results(tmp_path_factory):
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    out_path = str(tmp_path_factory.mktemp("solver_fused") / "out.pt")
    env = interpreter_env()
    env["PYTHONPATH"] = os.pathsep.join([here, os.path.dirname(here), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--fused-route-child", out_path], env=env,
                          cwd=here, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out_path)


@pytest.mark.parametrize("keyed", [False, True])
@pytest.mark.parametrize("compact", [False, True])
def test_solve_arena_chunk_fused_route_matches_oracle(cfm, sd, compact, keyed, fused_route_results):
    """Keyed: in place (every slot) and copied out (compact), both through a trim."""
    before, state = fused_route_results[(compact, keyed)]
    arena = CacheArena(**state)
    _check_ragged_case(cfm, sd, compact, before, arena, keyed=keyed)


def test_solve_arena_chunk_trims_every_step_cache(cfm):
    g = torch.Generator().manual_seed(4)
    arena = _arena(cfm, 1, 110, 20)  # prompt 8 -> bound 108 frames
    arena.att.copy_(torch.randn(arena.att.shape, generator=g))
    arena.cache_lengths[0] = 100
    arena.prompt_lengths[0] = 8
    arena.valid_lengths[0] = 20
    old = arena.att.clone()
    ArenaSolver(cfm.estimator, n_timesteps=STEPS)(arena, cfm.noise, t_len=20, cache_frames=100)
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
