"""AOTInductor: one estimator step with torch_cfm ops, exported, compiled, packaged and run.

The CPU package is compiled once per module (~25 s on 2 cores) and run twice: in this process,
and in a fresh one that loads only the C++ extension (op schemas + CPU kernels), never the
torch_cfm Python package, so the package is runnable without the Python op definitions.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import torch_cfm
from torch_cfm.config import DiTConfig
from torch_cfm.models.dit import random_dit

import dit_oracle
from oracle import assert_within_oracle

TINY = DiTConfig(hidden=32, depth=1, heads=2, head_dim=16)


class EstimatorStep(torch.nn.Module):
    """One streaming estimator evaluation (reference path: in_proj, blocks with cfm_attention)."""

    def __init__(self, dit: torch.nn.Module):
        super().__init__()
        self.dit = dit

    def forward(self, x, mu, t, spks, cond, cnn_cache, att_cache, valid_lengths, cache_lengths):
        return self.dit.forward_chunk(x, mu, t, spks, cond, cnn_cache, att_cache, valid_lengths=valid_lengths,
                                      cache_lengths=cache_lengths, fused=False)


def step_inputs(device="cpu", dtype=torch.float32, n_rows=2, t_len=4, cache_len=3):
    g = torch.Generator().manual_seed(3)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    c = TINY
    return (rnd(n_rows, 80, t_len), rnd(n_rows, 80, t_len), torch.rand(n_rows, generator=g).to(device),
            rnd(n_rows, 80), rnd(n_rows, 80, t_len), rnd(c.depth, n_rows, 2 * c.hidden, 2),
            rnd(c.depth, n_rows, c.heads, cache_len, 2 * c.head_dim),
            torch.tensor([t_len, t_len - 1], dtype=torch.int32, device=device),
            torch.tensor([cache_len, 1], dtype=torch.int32, device=device))


def check_against_oracle(model, args, out, same_dtype):
    """docs/design.md §6 on each row's valid frames: velocity, conv cache and attention cache."""
    x, mu, t, spks, cond, cnn, att, valid, cached = (a.cpu() for a in args)
    sd = dit_oracle.to_dtype(model.state_dict())
    vels, cnns, atts = dit_oracle.batch_chunk(sd, x.double(), mu.double(), t.double(), spks.double(),
                                              cond.double(), cnn.double(), att.double(), valid, cached)
    for n in range(x.shape[0]):
        tn, ln = int(valid[n]), int(cached[n])
        assert_within_oracle(out[0][n, :, :tn].float().cpu(), same_dtype[0][n, :, :tn].float().cpu(), vels[n],
                             f"velocity[{n}]")
        assert_within_oracle(out[1][:, n].float().cpu(), same_dtype[1][:, n].float().cpu(), cnns[n],
                             f"cnn_cache[{n}]")
        assert_within_oracle(out[2][:, n, :, :tn + ln].float().cpu(), same_dtype[2][:, n, :, :tn + ln].float().cpu(),
                             atts[n], f"att_cache[{n}]")


def export_and_package(model, args, path):
    ep = torch.export.export(EstimatorStep(model).eval(), args)
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "torch_cfm.cfm_attention.default" in targets  # the op is kept, not decomposed
    return torch._inductor.aoti_compile_and_package(ep, package_path=str(path))


@pytest.fixture(scope="module")
def cpu_package(tmp_path_factory):
    model = random_dit(TINY, 0).eval()
    args = step_inputs()
    path = export_and_package(model, args, tmp_path_factory.mktemp("aoti") / "step.pt2")
    return model, args, path


def test_cpu_package_runs_and_matches_the_oracle(cpu_package):
    model, args, path = cpu_package
    loaded = torch._inductor.aoti_load_package(path)
    out = loaded(*args)
    same_dtype = EstimatorStep(model)(*args)
    check_against_oracle(model, args, out, same_dtype)


def test_cpu_package_runs_without_the_python_op_definitions(cpu_package, tmp_path):
    model, args, path = cpu_package
    expected = EstimatorStep(model)(*args)
    torch.save({"args": args, "expected": expected}, tmp_path / "io.pt")
    extension = torch_cfm._C.__file__
    script = textwrap.dedent(f"""
        import sys, torch
        torch.ops.load_library({extension!r})   # schemas + CPU kernels only
        assert not any(m == "torch_cfm" or m.startswith("torch_cfm.") for m in sys.modules)
        io = torch.load({str(tmp_path / "io.pt")!r})
        out = torch._inductor.aoti_load_package({str(path)!r})(*io["args"])
        assert not any(m == "torch_cfm" or m.startswith("torch_cfm.") for m in sys.modules)
        for o, e in zip(out, io["expected"]):
            assert o.shape == e.shape, (o.shape, e.shape)
            err = (o - e).abs().max().item()
            assert err < 1e-4, err
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(path))
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_cuda_package_runs_and_matches_the_oracle(tmp_path, dtype):
    model = random_dit(TINY, 0).to("cuda", dtype).eval()
    args = step_inputs("cuda", dtype)
    path = export_and_package(model, args, tmp_path / "step_cuda.pt2")
    out = torch._inductor.aoti_load_package(path)(*args)
    same_dtype = EstimatorStep(model)(*args)
    check_against_oracle(model, args, out, same_dtype)
