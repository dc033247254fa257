"""User-facing messages: ``python -m torch_cfm`` without the CUDA extension, unreadable checkpoints,
and demo flags that cannot run. Each is one complete line, never a raw exception or a traceback."""

from __future__ import annotations

import importlib.util
import io
import os
import pickle
import subprocess
import sys

import pytest
import torch

from torch_cfm import demo, load_checkpoint
from torch_cfm.kernels import cfm_attention_cuda

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_EXTENSION_BUILT = cfm_attention_cuda._extension()[0] is not None
needs_no_cuda_extension = pytest.mark.skipif(CUDA_EXTENSION_BUILT, reason="torch_cfm._C_cuda is built here")


def run_python(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


# ------------------------------------------------------------------ python -m torch_cfm


@needs_no_cuda_extension
def test_main_says_plainly_that_the_cuda_extension_is_not_built():
    proc = run_python("-m", "torch_cfm")
    assert proc.returncode == 0, proc.stderr
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.strip().startswith("attention:")]
    assert "CUDA kernel not available: " in line and "the optional CUDA extension torch_cfm._C_cuda" in line
    assert "cannot import name" not in proc.stdout and "Error" not in proc.stdout
    if torch.version.cuda is None:
        assert f"torch {torch.__version__} has no CUDA" in line


@pytest.fixture
def uncached_extension():
    """cfm_attention_cuda._extension() looked up afresh (it is cached), and the cache reset after."""
    def why() -> str:
        cfm_attention_cuda._extension.cache_clear()
        return cfm_attention_cuda._extension()[1]

    yield why
    cfm_attention_cuda._extension.cache_clear()


@needs_no_cuda_extension
def test_extension_reason_names_the_cause(monkeypatch, uncached_extension):
    monkeypatch.setattr(torch.version, "cuda", None)
    why = uncached_extension()
    assert why.startswith(f"torch {torch.__version__} has no CUDA;") and "is built at install only" in why
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    why = uncached_extension()
    assert why.startswith("the optional CUDA extension torch_cfm._C_cuda was not built at install")
    assert "set CUDA_HOME and reinstall: python3 -m pip install --no-build-isolation -e ." in why
    # present on disk but not loadable (e.g. built against another torch): the import error is kept
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "torch_cfm._C_cuda" else real_find_spec(name, *a))
    why = uncached_extension()
    assert why.startswith("torch_cfm._C_cuda is present but does not load (") and "rebuild it" in why


# ------------------------------------------------------------------ unreadable checkpoints


def _zip_checkpoint() -> bytes:
    buf = io.BytesIO()
    torch.save({"in_proj.weight": torch.zeros(4, 4)}, buf)
    return buf.getvalue()


class _NotAllowed:
    pass


@pytest.mark.parametrize("kind,content,needle", [
    ("garbage", b"not a checkpoint " * 8, "(UnpicklingError: torch.load(weights_only=True) refuses it: "),
    ("truncated", _zip_checkpoint()[:300],
     "(RuntimeError: PytorchStreamReader failed reading zip archive: failed finding central directory)"),
    ("empty", b"", "(EOFError: empty or truncated file)"),
    ("pickle", pickle.dumps({"w": _NotAllowed()}, protocol=2), "refuses it: Unsupported global: "),
])
def test_unreadable_checkpoint_message_is_one_whole_line(tmp_path, kind, content, needle):
    path = tmp_path / f"{kind}.pt"
    path.write_bytes(content)
    with pytest.raises(ValueError) as info:
        load_checkpoint(None, path)
    msg = str(info.value)
    assert "path must be a torch checkpoint (torch.save of a state_dict), got an unreadable file" in msg
    assert needle in msg and str(path) in msg
    assert "\n" not in msg and msg.endswith(")") and msg.count("(") == msg.count(")")
    if "refuses it" in needle:  # torch's advice is replaced by ours, whole
        assert msg.endswith("load it with torch.load(path, weights_only=False) and pass the state_dict)")
        assert "Re-running" not in msg


# ------------------------------------------------------------------ demo flags


@pytest.mark.parametrize("argv,needle", [
    (["--steps", "100000"], f"--steps must be at most {demo.MAX_STEPS}, got 100000"),
    (["--steps", str(demo.MAX_STEPS + 1)], f"--steps must be at most {demo.MAX_STEPS}, got {demo.MAX_STEPS + 1}"),
])
def test_too_many_steps_is_one_line(argv, needle, capsys):
    assert demo.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python3 -m torch_cfm.demo: error: ") and needle in err


def test_steps_100000_in_a_subprocess_is_one_line_without_traceback():
    proc = run_python("-m", "torch_cfm.demo", "--tiny", "--steps", "100000")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and "--steps must be at most" in proc.stderr


def test_arena_too_big_for_free_memory_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(demo, "_available_bytes", lambda device: 2**20)  # 1 MiB free
    argv = ["--tiny", "--steps", "7", "--requests", "2", "--chunks", "1", "--chunk-frames", "8", "--prompt-frames", "4"]
    assert demo.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "the server's cache arena for --steps 7 --requests 2 --chunks 1 --chunk-frames 8 --prompt-frames 4 needs " in err
    assert "but cpu has 0.0 GiB free; lower --prompt-frames, --steps, --requests, --chunks or --chunk-frames" in err


def test_available_memory_is_known_on_this_machine():
    free = demo._available_bytes(torch.device("cpu"))
    assert free is None or free > 0


# ------------------------------------------------------------------ packaging


def test_pyproject_lists_every_package_of_the_tree():
    """A package folder missing from pyproject.toml would work in an editable install and be absent
    from a wheel; compile_rules/ ships as torch_cfm.compile_rules."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        tool = tomllib.load(f)["tool"]["setuptools"]
    found = set()
    for top, name in (("torch_cfm", "torch_cfm"), ("compile_rules", "torch_cfm.compile_rules")):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            if "__init__.py" in files:
                rel = os.path.relpath(folder, os.path.join(ROOT, top))
                found.add(name if rel == "." else f"{name}.{rel.replace(os.sep, '.')}")
    assert found == set(tool["packages"])
    assert tool["package-dir"] == {"torch_cfm.compile_rules": "compile_rules",
                                   "torch_cfm.compile_rules.passes": "compile_rules/passes"}


def test_ci_runs_the_readme_test_command_verbatim():
    """.ci/run must run exactly the README's test command (what a new user types)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, ".ci", "run")) as f:
        ci = f.read()
    with open(os.path.join(root, "README.md")) as f:
        readme = f.read()
    body = ci.split("readme_test_command() {", 1)[1].split("}", 1)[0].strip()
    assert body.startswith("python3 -m venv .venv && . .venv/bin/activate && python3 -m pip install") and body.endswith("python3 -m pytest -q"), body
    assert f"```bash\n{body}\n```" in readme
