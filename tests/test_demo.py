"""`python3 -m torch_cfm.demo`: runs tiny end to end, labels the CPU's reference path, and answers bad
flags and files with one line naming the flag, exit status 2."""

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
ERROR = "python3 -m torch_cfm.demo: error: "


def run_module(*args):
    return subprocess.run([sys.executable, "-m", "torch_cfm.demo", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def one_line_error(capsys, argv) -> str:
    assert demo.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(ERROR), err
    return err[len(ERROR):]


def test_demo_streams_tiny_requests_in_a_subprocess():
    proc = run_module(*TINY_ARGS)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "dispatch: estimator -> reference" in out
    assert "DiT C=64 depth=2 H=4 D=16" in out and "torch_cfm.explain" in out
    for rid in ("req0", "req1", "req2"):
        assert f"open  {rid}" in out and f"close {rid}" in out
    ticks = [line for line in out.splitlines() if line.startswith("tick ")]
    assert len(ticks) >= 3 and any("3 request(s)" in t for t in ticks)
    assert all("ms (RTF " in t and "NON-FINITE" not in t for t in ticks)
    assert "real-time factor" in out.splitlines()[-1] and "done: 3 requests" in out
    assert "workload: 3 requests of up to 3 chunks of 10 frames\n" in out  # flags given: no default label


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU's labels")
def test_cpu_says_reference_path_and_uses_its_smaller_default_workload(capsys):
    assert demo.main(["--tiny", "--steps", "1", "--chunk-frames", "6", "--prompt-frames", "8"]) == 0
    out = capsys.readouterr().out
    assert "CPU runs the plain-PyTorch reference path" in out and "NVIDIA GPU with SM80+" in out
    assert "--device cuda --dtype float16" in out
    assert "workload: 2 requests of up to 2 chunks of 6 frames (the CPU default" in out
    assert "done: 2 requests" in out
    assert demo.DEFAULT_WORKLOAD["cpu"] == (2, 2) and demo.DEFAULT_WORKLOAD["cuda"] == (3, 3)


def test_cpu_default_model_is_reduced_and_labelled_gpu_and_full_size_are_shipped():
    parse = demo.build_parser().parse_args
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert demo._random_config(parse([]), cpu) == demo.CPU_SMALL != DiTConfig()
    assert demo._random_config(parse(["--full-size"]), cpu) == DiTConfig()
    assert demo._random_config(parse([]), gpu) == DiTConfig()
    assert demo._random_config(parse(["--tiny"]), gpu) == demo.TINY


def test_plan_has_different_lengths_and_start_times():
    plans = demo.plan_requests(4, 3, 50, 300)
    assert [p.start_tick for p in plans] == [0, 1, 2, 3]
    assert len({p.prompt for p in plans}) > 1
    assert len({tuple(p.chunk_lengths) for p in plans}) > 1
    assert plans[0].chunk_lengths == [50, 50, 56]  # the final 56-frame chunk of docs/design.md §3


@pytest.mark.parametrize("argv,needle", [
    (["--requests", "0"], "--requests must be a positive int, got 0"),
    (["--steps", "x"], "--steps must be a positive int, got 'x'"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--dtype", "int8"], "--dtype must be one of float32, float16, bfloat16, got 'int8'"),
    (["--device", "tpu"], "--device must be cpu, cuda or cuda:N, got 'tpu'"),
    (["--prompt-frames", "10000000"], "--prompt-frames must be at most 3000 (60 s of prompt audio), got 10000000"),
    (["--chunk-frames", "5000"], "--chunk-frames must be at most 3000, got 5000"),
])
def test_bad_flags_give_one_line_naming_the_flag(argv, needle, capsys):
    msg = one_line_error(capsys, argv)
    assert msg.startswith(needle), msg
    others = {"--requests", "--steps", "--chunks", "--chunk-frames", "--prompt-frames"} - {argv[0]}
    assert not any(f"{o} " in msg for o in others), msg  # blames only the flag given


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_gpu_names_the_device_asked_for(device, capsys):
    msg = one_line_error(capsys, ["--device", device])
    assert msg.startswith(f"--device {device} needs a CUDA GPU, but torch.cuda.is_available() is False"), msg


def test_cuda_index_past_the_devices_names_it(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    msg = one_line_error(capsys, ["--device", "cuda:1"])
    assert msg.startswith("--device cuda:1: this machine has 1 CUDA device(s), cuda:0 to cuda:0"), msg


def test_non_checkpoint_files_are_named_as_such(tmp_path, capsys):
    memo = tmp_path / "memo.pt"
    memo.write_bytes(b"\x80\x02h\x65.")  # a pickle whose torch.load fails with KeyError: 101
    msg = one_line_error(capsys, ["--checkpoint", str(memo)])
    assert msg.startswith(f"--checkpoint {memo} is not a torch checkpoint (torch.load(weights_only=True) could not "
                          "read it: KeyError: 101); pass the model's flow checkpoint"), msg
    ints = tmp_path / "ints.pt"
    torch.save({101: 1, 102: 2, 103: 3}, ints)
    msg = one_line_error(capsys, ["--checkpoint", str(ints)])
    assert msg.startswith(f"--checkpoint {ints} holds a dict of int -> int (3 entries), not a DiT estimator's "
                          "weights"), msg
    msg = one_line_error(capsys, ["--checkpoint", str(tmp_path / "missing.pt")])
    assert msg.startswith(f"--checkpoint {tmp_path / 'missing.pt'}: no such file"), msg


def test_bad_checkpoints_in_a_subprocess(tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"\x00not a checkpoint")
    proc = run_module("--checkpoint", str(junk), "--steps", "1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and "is not a torch checkpoint" in proc.stderr
    wrong = tmp_path / "wrong.pt"
    torch.save({"decoder.estimator.in_proj.weight": torch.zeros(4, 320)}, wrong)
    proc = run_module("--checkpoint", str(wrong), "--steps", "1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "holds a dict of str -> Tensor (1 entry), not a DiT estimator's weights" in proc.stderr
    assert "blocks.0.attn.to_q.weight" in proc.stderr  # a key it lacks


def test_flow_checkpoint_runs(tmp_path, capsys):
    model = DiT(DiTConfig(hidden=32, depth=1, heads=2, head_dim=16)).random_init_(1)
    path = tmp_path / "flow.pt"
    torch.save({f"decoder.estimator.{k}": v for k, v in model.state_dict().items()}, path)
    assert demo.main(["--checkpoint", str(path), "--requests", "2", "--chunks", "1", "--steps", "1",
                      "--chunk-frames", "6", "--prompt-frames", "11"]) == 0
    out = capsys.readouterr().out
    assert "DiT C=32 depth=1 H=2 D=16" in out and str(path) in out and "done: 2 requests" in out
