"""CUDA graphs of the arena solve (torch_cfm.graphs): the bucketed runner's buckets and LRU
budget, its solves vs the SPEC oracle, CUDA-graph replay == eager bitwise, capture-failure
fallback (gpu marker), the graph solver in the server.

The CPU solve runs the fused route's Triton kernels under ``TRITON_INTERPRET=1`` in a child
process (see tests/test_cfm_attention_triton.py for why); the parent checks against
``dit_oracle.solve_request``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch

import dit_oracle as O
from oracle import assert_within_oracle
from test_dit_body import GPU_CFG, TINY
from torch_cfm.config import cosine_timesteps
from torch_cfm.graphs import CFMGraphRunner
from torch_cfm.kernels import body_plans
from torch_cfm.models import random_dit

_HERE = os.path.dirname(os.path.abspath(__file__))
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


def test_buckets_and_lru_eviction():
    model = random_dit(TINY, seed=0)
    runner = CFMGraphRunner(model, dtype=torch.float32, device="cpu", n_timesteps=2, batch_buckets=(1, 2, 4),
                            chunk_buckets=(8, 16), cache_buckets=(0, 8), max_graphs=2)
    assert runner.bucket_for(3, 9, 5) == (4, 16, 8)
    assert runner.bucket_for(2, 8, 0) == (2, 8, 0)
    assert runner.bucket_for(5, 8, 0) is None and runner.bucket_for(1, 17, 0) is None
    e1 = runner.entry((1, 8, 0))
    assert e1.arena.att.shape == (2, 2, 2, 4, 8, 32) and e1.arena.mu.shape == (1, 80, 8)  # in place: L + T frames
    assert e1.x0.shape == (1, 80, 8)
    assert e1.arena_bytes() == 4 * (2 * 2 * 2 * 4 * 8 * 32 + 2 * 2 * 2 * 128 * 2)
    runner.entry((2, 8, 0))
    runner.entry((1, 8, 0))  # touch: (2, 8, 0) is now the least recently used
    runner.entry((4, 16, 8))
    assert set(runner.graphs) == {(1, 8, 0), (4, 16, 8)}
    assert any("evicted bucket (2, 8, 0)" in e for e in runner.events)
    with pytest.raises(ValueError, match="max_graphs"):
        CFMGraphRunner(model, dtype=torch.float32, device="cpu", max_graphs=0)


# (B, T, L) requests solved in a (bucket) arena; lengths per request (ragged) or None
RUNNER_CASES = [
    dict(name="bucketed_ragged", b=2, t=6, l_len=4, valid=[6, 3], cached=[4, 2],
         buckets=dict(batch_buckets=(4,), chunk_buckets=(8,), cache_buckets=(6,))),
    dict(name="exact_nocache", b=1, t=5, l_len=0, valid=None, cached=None,
         buckets=dict(batch_buckets=(1,), chunk_buckets=(5,), cache_buckets=(0,))),
]


def _runner_solve(case):
    model = random_dit(TINY, seed=1)
    mu, spks, cond, noise, att, cnn = _solve_inputs(TINY, case["b"], case["t"], case["l_len"], N_STEPS, seed=2)
    runner = CFMGraphRunner(model, dtype=torch.float32, device="cpu", n_timesteps=N_STEPS, precision="ieee",
                            **case["buckets"])
    off = case["l_len"]
    x0 = noise[0, :, off:off + case["t"]].expand(case["b"], -1, -1)
    valid = None if case["valid"] is None else torch.tensor(case["valid"], dtype=torch.int32)
    cached = None if case["cached"] is None else torch.tensor(case["cached"], dtype=torch.int32)
    return model, runner.solve(mu, spks, cond, x0, att if off else None, cnn, valid, cached)


def _child(out_path: str) -> None:
    """The fused route forced on CPU (the policy never picks it there): the Triton body on the
    runner's in-place arena, as on the GPU."""
    from torch_cfm.models import solver

    calls = []
    solver._fused_route = lambda *args: calls.append(args) or "ieee"
    results = {c["name"]: _runner_solve(c)[1] for c in RUNNER_CASES}
    assert calls, "the fused route was not taken"
    torch.save(results, out_path)


@pytest.fixture(scope="module")
def runner_results(tmp_path_factory):
    out_path = str(tmp_path_factory.mktemp("graphs_interp") / "out.pt")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", out_path], env=env, cwd=_HERE,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out_path)


def _oracle_request(sd, case, b, mu, spks, cond, noise, att, cnn, dtype=torch.float64, n_steps=N_STEPS):
    """dit_oracle.solve_request for request b on its valid frames; (mel, cnn, att) in ``dtype``."""
    bsz = case["b"]
    tn = case["t"] if case["valid"] is None else case["valid"][b]
    ln = case["l_len"] if case["cached"] is None else case["cached"][b]
    d = dtype
    sd = O.to_dtype(sd, d)
    a = att[:, :, [b, bsz + b], :, :ln].to(d) if case["l_len"] else None
    c = cnn[:, :, [b, bsz + b]].to(d)
    # the oracle slices noise at the cache length; the runner got noise at the bucket's L offset
    shift = case["l_len"] - ln
    nz = noise[:, :, shift:].to(d)
    return O.solve_request(sd, mu[b, :, :tn].to(d), spks[b].to(d), cond[b, :, :tn].to(d), nz, n_steps, 0.7, c, a), tn, ln


@pytest.mark.parametrize("case", RUNNER_CASES, ids=[c["name"] for c in RUNNER_CASES])
def test_runner_eager_matches_oracle(case, runner_results):
    mel, cnn_out, att_out = runner_results[case["name"]]
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

def _gpu_runner(dtype, **kw):
    model = random_dit(GPU_CFG, seed=11).to(device="cuda", dtype=dtype)
    runner = CFMGraphRunner(model, dtype=dtype, device="cuda", n_timesteps=4, batch_buckets=(2, 4),
                            chunk_buckets=(50,), cache_buckets=(64,), **kw)
    return model, runner


def _fill(ent, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    arena = ent.arena
    for t in (arena.mu, arena.cond, arena.spks, arena.att, arena.cnn, ent.x0):
        t.copy_(torch.randn(t.shape, generator=g, device="cuda", dtype=torch.float32))
    rows, t_len, cache_len = arena.rows, ent.key[1], ent.key[2]
    arena.valid_lengths.copy_(torch.randint(0, t_len + 1, (rows,), generator=g, device="cuda", dtype=torch.int32))
    arena.cache_lengths.copy_(torch.randint(0, cache_len + 1, (rows,), generator=g, device="cuda", dtype=torch.int32))
    arena.prompt_lengths.zero_()
    arena.frame_keys.copy_(torch.arange(arena.max_cache_frames, device="cuda", dtype=torch.int32))


def _state(ent):
    return dict({k: v.clone() for k, v in ent.arena.tensors().items()}, x0=ent.x0.clone())


def _restore(ent, state):
    for k, v in state.items():
        (ent.x0 if k == "x0" else getattr(ent.arena, k)).copy_(v)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,plan", [(torch.float16, None), (torch.bfloat16, None), (torch.float32, None),
                                        (torch.float16, "v1"), (torch.bfloat16, "v1"), (torch.float32, "v1"),
                                        (torch.float16, "v5"), (torch.float32, "v5")],
                         ids=["fp16", "bf16", "fp32", "fp16-v1", "bf16-v1", "fp32-v1", "fp16-v5", "fp32-v5"])
def test_gpu_replay_equals_eager_bitwise(dtype, plan):
    """The table's plan (8 rows: v9 where the wgmma kernel is built), and v1 / v5 forced (their arena forms)."""
    with body_plans.use_plan(plan) if plan else contextlib.nullcontext():
        _replay_equals_eager_bitwise(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,precision", [(torch.float16, None), (torch.float32, "tf32")], ids=["fp16", "tf32"])
def test_gpu_replay_equals_eager_bitwise_tf32(dtype, precision):
    """The fp16 and TF32 bodies of 8 rows (the v9 plans on SM90a, all launched with PDL): replays == eager,
    bitwise."""
    _replay_equals_eager_bitwise(dtype, precision=precision)


def _replay_equals_eager_bitwise(dtype, **kw):
    _, runner = _gpu_runner(dtype, **kw)
    ent = runner.entry((4, 50, 64))
    for _ in range(runner.solver.calls_per_capture(torch.device("cuda"))):  # eager warm-up, then the capture
        _fill(ent, 0)
        runner.run(ent)
    assert runner.graphs[(4, 50, 64)], runner.events
    _fill(ent, 1)
    start = _state(ent)
    # poison the outputs (the in-place arena holds its inputs too: only what lies past each row's old keys)
    arena = ent.arena
    arena.out_mel.fill_(float("nan"))
    frames = torch.arange(arena.att.shape[4], device="cuda")
    old = torch.cat([arena.cache_lengths] * 2).long()
    past = (frames[None, :] >= old[:, None]).view(1, 1, -1, 1, frames.numel(), 1)
    arena.att.masked_fill_(past, float("nan"))
    runner.run(ent)
    replayed = _state(ent)
    _restore(ent, start)
    runner.run(ent)  # a second replay from the same state gives the same outputs
    assert torch.equal(replayed["out_mel"], arena.out_mel)
    _restore(ent, start)
    runner.run_eager(ent)
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
def test_gpu_runner_matches_reference_solver():
    dtype = torch.float16
    model, runner = _gpu_runner(dtype)
    case = dict(b=3, t=50, l_len=64, valid=[50, 31, 2], cached=[64, 10, 0])
    mu, spks, cond, noise, att, cnn = _solve_inputs(GPU_CFG, 3, 50, 64, 4, seed=5)
    x0 = noise[0, :, 64:114].expand(3, -1, -1)
    d = lambda t: t.to(device="cuda", dtype=dtype)  # noqa: E731
    mel, cnn_out, att_out = runner.solve(d(mu), d(spks), d(cond), x0.cuda(), d(att), d(cnn),
                                         torch.tensor(case["valid"], dtype=torch.int32),
                                         torch.tensor(case["cached"], dtype=torch.int32))
    assert runner.graphs[(4, 50, 64)]
    sd = random_dit(GPU_CFG, seed=11).state_dict()
    for b in range(3):
        (r_mel, r_cnn, r_att), tn, ln = _oracle_request(sd, dict(case, name=""), b, mu, spks, cond, noise, att, cnn,
                                                        n_steps=4)
        # same-dtype reference: the model's reference path step by step in fp16 on the GPU
        ts = [float(v) for v in cosine_timesteps(4, torch.float64)]
        xs = noise[0, :, 64:64 + tn][None].float().cuda()
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
def test_gpu_capture_failure_falls_back_with_reason(monkeypatch):
    _, runner = _gpu_runner(torch.float16)

    def broken(*a, **k):
        raise RuntimeError("simulated capture failure")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", broken)
    ent = runner.entry((2, 50, 64))
    for _ in range(runner.solver.calls_per_capture(torch.device("cuda"))):  # eager warm-up, then the capture
        _fill(ent, 3)
        runner.run(ent)
    failed = [e.failed for e in runner.solver.entries()]
    assert not runner.graphs[(2, 50, 64)] and len(failed) == 1 and "simulated capture failure" in failed[0]
    assert any("capture failed, eager instead" in e for e in runner.events)
    assert torch.isfinite(ent.arena.out_mel[ent.arena.valid_lengths.bool()].float()).all()


@pytest.mark.gpu
def test_gpu_arena_graph_solver_in_server_bitwise():
    from torch_cfm.graphs import ArenaGraphSolver
    from torch_cfm.models.solver import StreamingCFM

    model = random_dit(GPU_CFG, seed=50).to(device="cuda", dtype=torch.float16)

    def make():
        cfm = StreamingCFM(model, n_timesteps=4)
        return cfm.server(max_requests=2, max_prompt_frames=60, max_chunk_frames=50, chunk_buckets=[50],
                          cache_buckets=[160], fused=True)

    eager, graphed = make(), make()
    graphed.solve_fn = ArenaGraphSolver()
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
    assert any("captured" in e for e in graphed.solve_fn.events), graphed.solve_fn.events


def test_arena_graph_solver_validates_and_runs_eager_on_cpu():
    from torch_cfm.graphs import ArenaGraphSolver

    with pytest.raises(ValueError, match="max_graphs"):
        ArenaGraphSolver(max_graphs=0)
    calls = []
    solver = ArenaGraphSolver(lambda *a, **k: calls.append(k["cache_frames"]))
    t = torch.zeros(1)
    solver(None, t, t, t, t.view(1, 1, 1), t, t, t, t, t, t, cache_frames=3)
    assert calls == [3]


if __name__ == "__main__" and len(sys.argv) >= 3 and sys.argv[1] == "--child":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run the child with TRITON_INTERPRET=1")
    _child(sys.argv[2])
