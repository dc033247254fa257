"""`python -m torch_cfm.demo`: runs tiny end to end; bad flags/checkpoints give one line, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from torch_cfm import demo
from torch_cfm.models import DiT, DiTConfig

TINY_ARGS = ["--tiny", "--requests", "3", "--chunks", "3", "--steps", "2", "--chunk-frames", "10",
             "--prompt-frames", "12", "--explain"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_module(*args):
    return subprocess.run([sys.executable, "-m", "torch_cfm.demo", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def test_demo_streams_tiny_requests_in_a_subprocess():
    proc = run_module(*TINY_ARGS)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "dispatch: estimator -> reference" in out and "needs a CUDA device, found cpu" in out
    assert "DiT C=64 depth=2 H=4 D=16" in out and "torch_cfm.explain" in out
    for rid in ("req0", "req1", "req2"):
        assert f"open  {rid}" in out and f"close {rid}" in out
    ticks = [line for line in out.splitlines() if line.startswith("tick ")]
    assert len(ticks) >= 3 and any("3 request(s)" in t for t in ticks)
    assert all("ms (RTF " in t and "NON-FINITE" not in t for t in ticks)
    assert "real-time factor" in out.splitlines()[-1] and "done: 3 requests" in out


def test_plan_has_different_lengths_and_start_times():
    plans = demo.plan_requests(4, 3, 50, 300)
    assert [p.start_tick for p in plans] == [0, 1, 2, 3]
    assert len({p.prompt for p in plans}) > 1
    assert len({tuple(p.chunk_lengths) for p in plans}) > 1
    assert plans[0].chunk_lengths == [50, 50, 56]  # the final 56-frame chunk of SPEC §3


@pytest.mark.parametrize("argv,needle", [
    (["--requests", "0"], "--requests must be a positive int, got 0"),
    (["--steps", "x"], "--steps must be a positive int, got 'x'"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--dtype", "int8"], "--dtype must be one of float32, float16, bfloat16, got 'int8'"),
    (["--device", "tpu"], "--device must be cpu, cuda or cuda:N, got 'tpu'"),
])
def test_bad_flags_give_one_line_and_exit_2(argv, needle, capsys):
    assert demo.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m torch_cfm.demo: error: ") and needle in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_gpu_is_one_line(capsys):
    assert demo.main(["--device", "cuda"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bad_checkpoints_in_a_subprocess(tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"\x00not a checkpoint")
    proc = run_module("--checkpoint", str(junk), "--steps", "1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and "must be a torch checkpoint" in proc.stderr
    wrong = tmp_path / "wrong.pt"
    torch.save({"decoder.estimator.in_proj.weight": torch.zeros(4, 320)}, wrong)
    proc = run_module("--checkpoint", str(wrong), "--steps", "1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "hold a DiT estimator's keys" in proc.stderr


def test_flow_checkpoint_runs(tmp_path, capsys):
    model = DiT(DiTConfig(hidden=32, depth=1, heads=2, head_dim=16)).random_init_(1)
    path = tmp_path / "flow.pt"
    torch.save({f"decoder.estimator.{k}": v for k, v in model.state_dict().items()}, path)
    assert demo.main(["--checkpoint", str(path), "--requests", "2", "--chunks", "1", "--steps", "1",
                      "--chunk-frames", "6", "--prompt-frames", "11"]) == 0
    out = capsys.readouterr().out
    assert "DiT C=32 depth=1 H=2 D=16" in out and str(path) in out and "done: 2 requests" in out
