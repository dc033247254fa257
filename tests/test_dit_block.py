"""The persistent per-block body kernel (variant "v7", :mod:`torch_cfm.kernels.dit_block`).

Its math against the SPEC §6 oracle runs with the other variants in ``test_dit_body.py``
(interpreter cases and ``test_gpu_fused_within_oracle``). Here: what only v7 has — the grid
barrier (persistent launch == one launch per phase, bitwise; the counter ends where it should and
the spin guard never trips), CUDA-graph replay, and the width rule.
"""

from __future__ import annotations

import pytest
import torch

from test_dit_body import GPU_CFG, make_inputs
from torch_cfm.kernels.dit_block import PHASES, launch_groups, phase_mask, v7_unsupported
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


def _run_v7(args, persistent, bar=None, out=None, config=None):
    from torch_cfm.kernels.dit_block import body_v7

    x_in, w, table, cnn, att, valid, cached = args
    shapes = check_dit_body(x_in, w, table, cnn, att, valid, cached, "auto")
    out = tuple(o.fill_(float("nan")) for o in _empty_outputs(x_in, shapes)) if out is None else out
    return body_v7(x_in, w, table, cnn, att, valid.int(), cached.int(), None, out, persistent=persistent, bar=bar,
                   config=config)


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
    from torch_cfm.kernels.dit_block import CONFIG, _phase_tiles, launch_groups

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

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = call()
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
@pytest.mark.parametrize("split_at", [(1 << 11) - 2, (1 << 2) | (1 << 8)], ids=["each-phase", "three-launches"])
def test_gpu_v7_launch_groups_equal_one_launch_bitwise(split_at):
    """Kernels compiled with only their phases' code (one per phase, or three groups behind
    barriers) compute what the whole-block kernel does, to the bit."""
    args = _args(torch.float16, seed=6)
    want = _run_v7(args, persistent=True)
    got = _run_v7(args, persistent=True, config=dict(SPLIT_AT=split_at))
    for name, g, w in zip(("velocity", "cnn_cache", "att_cache"), got, want):
        assert torch.equal(g, w), name
