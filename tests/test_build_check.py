"""The build refuses an extension without the shared C++ runtime (setup.py + torch_cfm/_build_check.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

import torch_cfm
from torch_cfm._build_check import elf_needed, loads_cxx_runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF check runs on Linux only")


@linux_only
def test_the_built_extension_loads_the_shared_cxx_runtime():
    needed = elf_needed(torch_cfm._C.__file__)
    assert "libc10.so" in needed and "libtorch_cpu.so" in needed, needed
    assert loads_cxx_runtime(needed), needed


def test_elf_needed_and_runtime_rule_on_plain_inputs(tmp_path):
    text = tmp_path / "not_elf.so"
    text.write_bytes(b"#!/bin/sh\n")
    assert elf_needed(str(text)) == []
    assert not loads_cxx_runtime(["libc10.so", "libm.so.6", "libgcc_s.so.1", "libc.so.6"])
    assert loads_cxx_runtime(["libstdc++.so.6"]) and loads_cxx_runtime(["libc++.so.1"])


@linux_only
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_a_statically_linked_cxx_runtime_stops_the_build(tmp_path):
    wrapper = tmp_path / "g++-static-runtime"
    wrapper.write_text('#!/bin/sh\nexec g++ "$@" -static-libstdc++\n')
    wrapper.chmod(0o755)
    env = dict(os.environ, CXX=str(wrapper))
    env.pop("TORCH_CFM_ALLOW_STATIC_LIBSTDCXX", None)
    res = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path / "lib"),
                          "--build-temp", str(tmp_path / "tmp")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode != 0
    assert "does not load libstdc++ dynamically" in res.stderr and "CXX=g++" in res.stderr, res.stderr[-2000:]
    assert not list((tmp_path / "lib").rglob("_C*.so"))  # nothing half-built left to import
