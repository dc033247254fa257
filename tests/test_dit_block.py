"""The persistent per-block body kernel (variant "v7", :mod:`torch_cfm.kernels.dit_block`).

Its math against the SPEC §6 oracle runs with the other variants in ``test_dit_body.py``
(interpreter cases, ``test_gpu_fused_within_oracle``) and in the interpreter property suite. Here:
what only v7 has — the synchronised launches (grid barriers; launch groups with specialised
kernels; FLOW's per-sequence counters) against one launch per phase, bitwise, with the counters
ending exactly where the tiles put them and no wait giving up (on the GPU; on CPU with a
one-program grid, which the interpreter can run), CUDA-graph replay, and the width rules.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import triton
import triton.language as tl

from shards import run_shards
from strategies import capture_cuda_graph
from test_dit_body import GPU_CFG, make_inputs
from torch_cfm.kernels.dit_block import PHASES, _seq_tiles, launch_groups, phase_mask, v7_unsupported
from torch_cfm.models import random_dit
from torch_cfm.ops.dit_body import _empty_outputs, check_dit_body, dit_body_fused_into, stage_input
from torch_cfm.packing import modulation_table, pack_dit

N, T, L = 4, 50, 64
VALID, CACHED = [50, 37, 1, 0], [64, 10, 0, 64]


def _args(dtype, seed, device="cuda", cfg=GPU_CFG, n=N, t=T, l_len=L, valid=VALID, cached=CACHED):
    model = random_dit(cfg, seed=seed).to(device)
    packed = pack_dit(model, dtype, device)
    x, mu, tt, spks, cond, cnn, att, vl, cl = [
        None if a is None else a.to(device) for a in
        make_inputs(cfg, n, t, l_len, dtype, seed=seed + 1, valid=valid, cached=cached)]
    return stage_input(x, mu, spks, cond, dtype), packed.body, modulation_table(packed, tt[:1]), cnn, att, vl, cl


def _run_v7(args, persistent, bar=None, out=None, config=None, plans=None):
    from torch_cfm.kernels.dit_block import body_v7

    x_in, w, table, cnn, att, valid, cached = args
    shapes = check_dit_body(x_in, w, table, cnn, att, valid, cached, "auto")
    out = tuple(o.fill_(float("nan")) for o in _empty_outputs(x_in, shapes)) if out is None else out
    return body_v7(x_in, w, table, cnn, att, valid.int(), cached.int(), None, out, persistent=persistent, bar=bar,
                   config=config, plans=plans)


def test_v7_width_rule():
    assert v7_unsupported(512, 8, 64, 2048) == []
    assert v7_unsupported(64, 4, 16, 256) == []
    reasons = v7_unsupported(512, 8, 48, 2048)
    assert any("head_dim=48" in r for r in reasons)
    assert any("mlp=100" in r for r in v7_unsupported(512, 8, 64, 100))


def test_split_factors_take_whole_k_steps():
    from torch_cfm.kernels.dit_block import SPLIT_FC2, SPLIT_PROJ, split_factors

    assert split_factors(512, 2048, 64) == (SPLIT_PROJ, SPLIT_FC2)
    assert split_factors(32, 128, 32) == (1, 4)  # one K step of proj cannot be split
    assert split_factors(96, 192, 32) == (1, 3)


def test_launch_groups_and_phase_masks():
    assert launch_groups(0) == [(0, len(PHASES))]
    assert launch_groups(1) == [(0, len(PHASES))]  # phase 0 always starts a launch
    assert launch_groups((1 << 2) | (1 << 8)) == [(0, 2), (2, 8), (8, 11)]
    assert launch_groups((1 << 11) - 2) == [(p, p + 1) for p in range(11)]
    assert phase_mask(0, 11) == (1 << 11) - 1 and phase_mask(2, 8) == 0b11111100 and phase_mask(5, 6) == 1 << 5


def _expected_flow_counts(n, t, c, heads, d, mlp, cfg, depth):
    """Tiles of each phase touching each sequence, counted by enumerating the tiles' row ranges
    (independent of the kernel's closed form); phase 10 signals nothing."""
    from torch_cfm.kernels.dit_block import PHASES, split_factors

    bm, rows, bq = cfg["BM"], cfg["ROWS"], cfg["BQ"]
    s_proj, s_fc2 = split_factors(heads * d, mlp, min(64, d))
    counts = torch.zeros((len(PHASES), n), dtype=torch.int64)

    def add(phase, r0, r1, tp, times):
        for seq in range(r0 // tp, min((r1 - 1) // tp, n - 1) + 1):
            counts[phase, seq] += times

    m, mh = n * t, n * (t + 2)
    for m0 in range(0, m, bm):
        add(0, m0, m0 + bm, t, 3 * heads)
        add(2, m0, m0 + bm, t, (c // d) * s_proj)
        add(8, m0, m0 + bm, t, mlp // d)
        add(9, m0, m0 + bm, t, (c // d) * s_fc2)
    for m0 in range(0, mh, bm):
        add(4, m0, m0 + bm, t + 2, 3 * c // d)
        add(6, m0, m0 + bm, t + 2, 3 * c // d)
    for r0 in range(0, m, rows):
        for phase in (3, 5, 7):
            add(phase, r0, r0 + rows, t, 1)
    for seq in range(n):
        counts[1, seq] += heads * -(-t // bq)
    return counts * depth


def _one_program_child(out_path, shard=0, shards=1):
    """TRITON_INTERPRET=1: v7 with its synchronised paths on a one-program grid (grid barriers,
    then FLOW counters) against one launch per phase; shard ``shard`` of ``shards``."""
    from test_dit_body import TINY
    from torch_cfm.kernels.dit_block import CONFIG

    res = {}
    chunks = (("ragged", 7, [7, 3, 0], [5, 2, 4]), ("two_tiles", 40, [40, 17, 33], [9, 3, 0]))
    for name, t, valid, cached in chunks[shard::shards]:
        args = _args(torch.float32, seed=3, device="cpu", cfg=TINY, n=3, t=t, l_len=9, valid=valid, cached=cached)
        res[name, "split"] = _run_v7(args, persistent=False)
        for mode in ("barrier", "flow"):
            plans: list = []
            cfg = dict(G_MAX=1, MAX_SPIN_=64, FLOW=int(mode == "flow"))
            res[name, mode] = _run_v7(args, persistent=True, config=cfg, plans=plans)
            res[name, mode, "bar"] = plans[0].bar.clone()
            res[name, mode, "deps"] = plans[0].deps.clone()
        res[name, "expected"] = _expected_flow_counts(3, t, TINY.hidden, TINY.heads, TINY.head_dim,
                                                      TINY.mlp_ratio * TINY.hidden, CONFIG, TINY.depth)
    for n, t in ((3, 7), (3, 40), (8, 50)) if shard == 0 else ():  # the wait targets' closed form, shipped widths too
        c, heads, d, mlp = (TINY.hidden, TINY.heads, TINY.head_dim, TINY.mlp_ratio * TINY.hidden) if n == 3 \
            else (512, 8, 64, 2048)
        res["seq_tiles", n, t] = _seq_tiles_table(n, t, c, heads, d, mlp, CONFIG)
        res["seq_tiles_expected", n, t] = _expected_flow_counts(n, t, c, heads, d, mlp, CONFIG, 1)
    torch.save(res, out_path)


@triton.jit
def _seq_tiles_kernel(out_ptr, NR, T, H, C, MLP, D: tl.constexpr, BM: tl.constexpr, BQ: tl.constexpr,
                      ROWS: tl.constexpr, S_PROJ: tl.constexpr, S_FC2: tl.constexpr):
    p = tl.program_id(0)
    for seq in range(NR):
        tl.store(out_ptr + p * NR + seq, _seq_tiles(p, seq, T, H, C, MLP, D, BM, BQ, ROWS, S_PROJ, S_FC2))


def _seq_tiles_table(n, t, c, heads, d, mlp, cfg):
    """The kernel's ``_seq_tiles`` for every (phase, sequence), run by the interpreter."""
    from torch_cfm.kernels.dit_block import split_factors

    s_proj, s_fc2 = split_factors(heads * d, mlp, min(64, d))
    out = torch.zeros((len(PHASES), n), dtype=torch.int32)
    _seq_tiles_kernel[(len(PHASES) - 1,)](out, n, t, heads, c, mlp, D=d, BM=cfg["BM"], BQ=cfg["BQ"], ROWS=cfg["ROWS"],
                                          S_PROJ=s_proj, S_FC2=s_fc2)
    return out


@pytest.fixture(scope="module")
def one_program(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("v7_one")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    here = os.path.dirname(os.path.abspath(__file__))
    procs = run_shards(lambda i, k: [sys.executable, "-c", "import test_dit_block as t; "
                                     f"t._one_program_child({str(tmp / f'out{i}.pt')!r}, {i}, {k})"],
                       env=env, cwd=here, timeout=600)
    res = {}
    for i, proc in enumerate(procs):
        assert proc.returncode == 0, proc.stderr[-3000:]
        res.update(torch.load(tmp / f"out{i}.pt"))
    return res


@pytest.mark.parametrize("case", ["ragged", "two_tiles"])
@pytest.mark.parametrize("mode", ["barrier", "flow"])
def test_v7_synchronised_paths_on_one_program_interpreter(one_program, case, mode):
    """The persistent loop's bookkeeping on CPU: one program runs every tile, so a wait that is
    never satisfied shows as a raised spin flag, and the counters must end exactly where the
    tiles put them (barriers: 10 per block; FLOW: tiles per (phase, sequence), counted
    independently). Results equal one launch per phase, bitwise."""
    from test_dit_body import TINY

    for name, g, w in zip(("velocity", "cnn_cache", "att_cache"), one_program[case, mode], one_program[case, "split"]):
        assert torch.equal(g, w), name
    bar, deps = one_program[case, mode, "bar"], one_program[case, mode, "deps"]
    assert bar[1].item() == 0, "a wait gave up"
    if mode == "barrier":
        assert bar[0].item() == TINY.depth * (len(PHASES) - 1)
    else:
        assert bar[0].item() == 0
        assert torch.equal(deps.long(), one_program[case, "expected"])


@pytest.mark.parametrize("n,t", [(3, 7), (3, 40), (8, 50)])
def test_v7_flow_wait_targets_count_every_tile_interpreter(one_program, n, t):
    """FLOW's wait targets (``_seq_tiles``, a closed form) equal the tiles enumerated per sequence:
    a smaller target would let a tile start before its inputs exist (phase 10 signals nothing and
    is never waited on)."""
    got = one_program["seq_tiles", n, t].long()[:-1]
    assert torch.equal(got, one_program["seq_tiles_expected", n, t][:-1])


def test_v7_rejects_unsupported_widths():
    from torch_cfm.config import DiTConfig

    cfg = DiTConfig(hidden=40, depth=1, heads=2, head_dim=16)
    args = _args(torch.float32, 1, device="cpu", cfg=cfg, n=1, t=2, l_len=1, valid=[2], cached=[1])
    with pytest.raises(ValueError, match="variant 'v7' cannot run this model: hidden=40 is not a multiple"):
        _run_v7(args, persistent=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_v7_persistent_equals_per_phase_bitwise(dtype):
    from torch_cfm.kernels._launch import sm_count
    from torch_cfm.kernels.dit_block import CONFIG, _phase_tiles

    args = _args(dtype, seed=5)
    # the reference: one launch per phase of the same (whole-block) kernel, no barrier executed
    want = _run_v7(args, persistent=True, config=dict(SPLIT_AT=(1 << len(PHASES)) - 2, SPECIALIZE=0))
    for _ in range(3):  # a racy barrier shows up as run-to-run differences
        bar = torch.zeros(2, dtype=torch.int32, device="cuda")
        got = _run_v7(args, persistent=True, bar=bar)
        torch.cuda.synchronize()
        assert bar[1].item() == 0, "a program gave up waiting at a grid barrier"
        tiles = _phase_tiles(N, T, L, GPU_CFG.hidden, GPU_CFG.heads, GPU_CFG.head_dim, GPU_CFG.mlp_ratio *
                             GPU_CFG.hidden, CONFIG)
        grid = min(CONFIG["CTAS"] * sm_count(torch.device("cuda")), max(tiles))
        barriers = sum(hi - lo - 1 for lo, hi in launch_groups(CONFIG["SPLIT_AT"]))
        assert bar[0].item() == GPU_CFG.depth * barriers * grid
        for name, g, w in zip(("velocity", "cnn_cache", "att_cache"), got, want):
            assert torch.equal(g, w), name


@pytest.mark.gpu
def test_gpu_v7_graph_replay_equals_eager_bitwise():
    args = _args(torch.float16, seed=8)
    static = [a.clone() if isinstance(a, torch.Tensor) and i != 1 else a for i, a in enumerate(args)]

    def call():
        return dit_body_fused_into(*static, "auto", _empty_outputs(static[0], check_dit_body(*static, "auto")), "v7")

    graph, outs = capture_cuda_graph(call)
    new = _args(torch.float16, seed=9)
    for i, (dst, src) in enumerate(zip(static, new)):
        if i != 1 and isinstance(dst, torch.Tensor):
            dst.copy_(src)
    for o in outs:
        o.fill_(float("nan"))
    for _ in range(2):  # the barrier counter is re-zeroed inside the graph on every replay
        graph.replay()
        torch.cuda.synchronize()
        want = dit_body_fused_into(*static, "auto", _empty_outputs(static[0], check_dit_body(*static, "auto")), "v7")
        for o, w in zip(outs, want):
            assert torch.equal(o, w)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [dict(SPLIT_AT=(1 << 11) - 2), dict(SPLIT_AT=(1 << 2) | (1 << 8)), dict(FLOW=1),
                                    dict(FLOW=1, SPLIT_AT=(1 << 2) | (1 << 8))],
                         ids=["each-phase", "three-launches", "flow", "flow-three-launches"])
def test_gpu_v7_launch_configs_equal_one_launch_bitwise(config):
    """Kernels compiled with only their phases' code (one per phase, or three groups), and FLOW's
    per-sequence waits instead of grid barriers, compute what the whole-block kernel does, to the
    bit; no wait gives up and FLOW's counters end at the tiles counted per sequence."""
    from torch_cfm.kernels.dit_block import CONFIG

    args = _args(torch.float16, seed=6)
    want = _run_v7(args, persistent=True)
    for _ in range(3 if config.get("FLOW") else 1):  # a racy wait shows up as run-to-run differences
        plans: list = []
        got = _run_v7(args, persistent=True, config=config, plans=plans)
        torch.cuda.synchronize()
        assert plans[0].bar[1].item() == 0, "a wait gave up"
        for name, g, w in zip(("velocity", "cnn_cache", "att_cache"), got, want):
            assert torch.equal(g, w), name
        if config.get("FLOW") and "SPLIT_AT" not in config:
            expected = _expected_flow_counts(N, T, GPU_CFG.hidden, GPU_CFG.heads, GPU_CFG.head_dim,
                                             GPU_CFG.mlp_ratio * GPU_CFG.hidden, CONFIG, GPU_CFG.depth)
            assert torch.equal(plans[0].deps.cpu().long(), expected)
