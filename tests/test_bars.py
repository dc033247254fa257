"""The house rules, checked on the source tree (docs/design.md §9): small modules and functions, one
module that captures CUDA graphs, layers that import only to their left, no work-log traces."""

from __future__ import annotations

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("torch_cfm", "compile_rules")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 100
# docs/design.md §9: a module imports only from layers to its left (same layer allowed)
LAYERS = [
    {"config", "errors", "buckets", "_build_check"},
    {"policy", "packing"},
    {"reference", "kernels"},
    {"ops"},
    {"models"},
    {"solve", "graphs"},
    {"serving"},
    {"integrations"},
]


def _sources():
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    yield os.path.relpath(path, ROOT), open(path, encoding="utf-8").read()


def _is_kernel(node: ast.AST) -> bool:
    """A Triton kernel body (decorated ``@triton.jit`` or ``@triton.autotune``)."""
    return any("triton" in ast.unparse(d) for d in getattr(node, "decorator_list", []))


def test_no_module_over_600_lines():
    long = {path: len(text.splitlines()) for path, text in _sources() if len(text.splitlines()) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_over_100_lines_outside_kernel_bodies():
    long = []
    for path, text in _sources():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_kernel(node):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "functions over 100 lines: " + "; ".join(long)


def test_one_module_captures_cuda_graphs():
    capturing = sorted(path for path, text in _sources()
                       if re.search(r"torch\.cuda\.graph\(|CUDAGraph\(\)", text))
    assert capturing == [os.path.join("torch_cfm", "graphs.py")], capturing


# a commit hash: 7-12 hex characters with a digit and a letter (or a full 40-character one)
_HASH = re.compile(r"(?<![0-9A-Za-z_.x])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])([0-9a-f]{7,12}|[0-9a-f]{40})(?![0-9A-Za-z_])")


@pytest.mark.parametrize("pattern,what", [(re.compile(r"SPEC §"), "a citation of the retired SPEC (cite docs/design.md)"),
                                          (_HASH, "a commit hash (history belongs in git)")])
def test_no_work_log_traces(pattern, what):
    found = [f"{path}:{i + 1}: {line.strip()[:100]}" for path, text in _sources()
             for i, line in enumerate(text.splitlines()) if pattern.search(line)]
    assert not found, f"{what}: " + "; ".join(found[:10])


def test_performance_doc_is_at_most_300_lines():
    with open(os.path.join(ROOT, "docs", "performance.md"), encoding="utf-8") as f:
        assert len(f.read().splitlines()) <= 300


def _layer(module: str) -> int:
    part = module.split(".")[1] if module.startswith("torch_cfm.") else module
    for i, names in enumerate(LAYERS):
        if part in names:
            return i
    return -1  # the package's __init__, diagnostics, demo, compile: the top, may import anything


def test_layers_import_only_to_their_left():
    upward = []
    for path, text in _sources():
        if not path.startswith("torch_cfm" + os.sep):
            continue
        parts = path[:-3].split(os.sep)
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        here = _layer(module)
        if here < 0:
            continue
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.ImportFrom) or node.level == 0:
                continue
            base = parts[:len(parts) - node.level] if parts[-1] != "__init__" else parts[:len(parts) - node.level]
            target = ".".join(base + ([node.module] if node.module else []))
            names = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            for name in names:
                there = _layer(name)
                if there > here:
                    upward.append(f"{path}:{node.lineno} imports {name} (layer {there} > {here})")
    assert not upward, "; ".join(upward)
