"""The fused body under torch.compile (CPU, fullgraph) and inside CUDA graphs (gpu marker)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from test_dit_body import GPU_CFG, TINY, make_inputs
from torch_cfm.models import random_dit
from torch_cfm.models.fused_forward import stage_input
from torch_cfm.packing import modulation_table, pack_dit, packed_for


def _op_args(cfg, dtype, device, seed=0, n=2, t=5, l_len=3):
    model = random_dit(cfg, seed=seed).to(device)
    packed = pack_dit(model, dtype, device)
    x, mu, tt, spks, cond, cnn, att, valid, cached = [
        None if a is None else a.to(device) for a in
        make_inputs(cfg, n, t, l_len, dtype, seed=seed + 1, valid=[t] + [max(t - 3 * i, 0) for i in range(1, n)],
                    cached=[l_len] + [min(i, l_len) for i in range(1, n)])]
    x_in = stage_input(x, mu, spks, cond, dtype)
    return x_in, packed.body, modulation_table(packed, tt[:1]), cnn, att, valid, cached


def test_compile_fullgraph_cpu_matches_eager():
    x_in, w, table, cnn, att, valid, cached = _op_args(TINY, torch.float32, "cpu")

    def step(x_in, table, cnn, att, valid, cached):
        vel, ncnn, natt = torch.ops.torch_cfm.dit_body(x_in, w, table, cnn, att, valid, cached, "auto")
        return vel * 2.0, ncnn, natt  # something around the op for the compiler to fuse

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    got = compiled(x_in, table, cnn, att, valid, cached)
    want = step(x_in, table, cnn, att, valid, cached)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_gpu_cuda_graph_replay_bitwise(dtype):
    dev = torch.device("cuda")
    args = _op_args(GPU_CFG, dtype, dev, seed=3, n=4, t=50, l_len=64)
    x_in, w, table, cnn, att, valid, cached = args
    static = [a.clone() if isinstance(a, torch.Tensor) else a for a in (x_in, table, cnn, att, valid, cached)]

    def call():
        return torch.ops.torch_cfm.dit_body(static[0], w, static[1], static[2], static[3], static[4], static[5], "auto")

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = call()
    # new inputs into the static buffers, replay, compare with an eager call on the same inputs
    new = _op_args(GPU_CFG, dtype, dev, seed=7, n=4, t=50, l_len=64)
    for dst, src in zip(static, (new[0], new[2], new[3], new[4], new[5], new[6])):
        dst.copy_(src)
    for o in outs:
        o.fill_(float("nan"))
    g.replay()
    eager = torch.ops.torch_cfm.dit_body(new[0], w, new[2], new[3], new[4], new[5], new[6], "auto")
    torch.cuda.synchronize()
    for a, b in zip(outs, eager):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_model_forward_chunk_fused_in_cuda_graph():
    dev = torch.device("cuda")
    model = random_dit(GPU_CFG, seed=5).to(device=dev, dtype=torch.bfloat16)
    inputs = [None if a is None else a.to(dev) for a in
              make_inputs(GPU_CFG, 2, 50, 16, torch.bfloat16, seed=6, valid=[50, 7], cached=[16, 3])]
    packed_for(model, torch.bfloat16, dev)  # pack outside the capture
    model.forward_chunk(*inputs[:7], valid_lengths=inputs[7], cache_lengths=inputs[8], fused=True)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = model.forward_chunk(*inputs[:7], valid_lengths=inputs[7], cache_lengths=inputs[8], fused=True)
    g.replay()
    eager = model.forward_chunk(*inputs[:7], valid_lengths=inputs[7], cache_lengths=inputs[8], fused=True)
    torch.cuda.synchronize()
    for a, b in zip(outs, eager):
        assert torch.equal(a, b)


def test_body_pdl_rule_off_on_cpu_and_by_plan(monkeypatch):
    import torch_cfm.kernels._launch as launch
    from torch_cfm.kernels.body_plans import PDL_CAPABLE_KERNELS, body_plan

    names = ("rownorm", "qk_cache", "attention_cache", "cfg_euler")
    for name in names:  # the interpreter has no grid dependency control
        for dtype in (torch.float16, torch.float32):
            assert launch.plan_pdl(body_plan(dtype, "tf32", 16), name, torch.device("cpu")) is False
    monkeypatch.setattr(launch, "pdl_supported", lambda device: True)
    cuda = torch.device("cuda")
    # the measured sets: rownorm + CFG-Euler for fp32 only
    assert [launch.plan_pdl(body_plan(torch.float32, "tf32", 16), k, cuda) for k in names] == [True, False, False, True]
    assert [launch.plan_pdl(body_plan(torch.float32, "ieee", 2), k, cuda) for k in names] == [True, False, False, True]
    for dtype in (torch.float16, torch.bfloat16):
        for rows in (16, 64, None):
            assert not any(launch.plan_pdl(body_plan(dtype, None, rows), k, cuda) for k in names)
        wgmma = body_plan(dtype, None, 8)
        assert [launch.plan_pdl(wgmma, k, cuda) for k in names + ("linear",)] == [True, True, False, False, True]
    plan = dataclasses.replace(body_plan(torch.float16, None, 16), pdl=frozenset({"qk_cache"}))
    assert launch.plan_pdl(plan, "qk_cache", cuda) is True
    assert launch.plan_pdl(plan, "rownorm", cuda) is False
    assert body_plan(torch.float16, None, 16).pdl <= PDL_CAPABLE_KERNELS


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["cublas", "fused_attention", "wgmma"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_gpu_body_pdl_replays_equal_no_pdl_eager_bitwise(dtype, variant):
    """The body's own kernels load weights, tables, lengths and old caches before their PDL wait:
    a captured body with PDL, replayed three times on new inputs written just before each replay,
    equals the body without PDL, eager, bitwise."""
    import torch_cfm.kernels.dit_body as kernels
    from torch_cfm.kernels.body_plans import PDL_CAPABLE_KERNELS, named_plan
    from torch_cfm.kernels.dit_body import dit_body_fused_into
    from torch_cfm.ops.dit_body import body_outputs as _empty_outputs, check_dit_body

    dev = torch.device("cuda")
    if not kernels.pdl_supported(dev):
        pytest.skip("PDL not available on this device/Triton")
    cases = [_op_args(GPU_CFG, dtype, dev, seed=s, n=4, t=50, l_len=64) for s in (13, 23, 33)]
    cases = [cases[0]] + [(c[0], cases[0][1]) + tuple(c[2:]) for c in cases[1:]]  # one set of weights

    base = named_plan(variant, dtype, "tf32")
    plan = None

    def run(args, out=None):
        x_in, w, table, cnn, att, valid, cached = args
        shapes = check_dit_body(x_in, w, table, cnn, att, valid, cached, "tf32")
        out = _empty_outputs(x_in, shapes) if out is None else out
        return dit_body_fused_into(x_in, w, table, cnn, att, valid, cached, "tf32", out, plan)

    plan = dataclasses.replace(base, pdl=frozenset())
    want = [run(c) for c in cases]
    plan = dataclasses.replace(base, pdl=PDL_CAPABLE_KERNELS)
    static = [a.clone() if isinstance(a, torch.Tensor) else a for a in cases[0]]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run(static)
    for case, expected in zip(cases[::-1], want[::-1]):
        for dst, src in zip(static, case):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        for o, w_ in zip(outs, expected):
            assert torch.equal(o, w_)
