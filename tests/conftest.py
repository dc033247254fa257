"""Shared fixtures, the gpu-marker skip and hypothesis profiles (markers are declared in pytest.ini).

Profiles: ``ci`` (derandomized, bounded, no deadline; the default and what .ci/run uses),
``gpu`` (more examples, for the H200 run), ``dev`` (quick). Pick with HYPOTHESIS_PROFILE.
"""

from __future__ import annotations

import collections
import os

import pytest
import torch

try:
    from hypothesis import HealthCheck, settings

    _common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    settings.register_profile("ci", max_examples=50, derandomize=True, print_blob=True, **_common)
    settings.register_profile("gpu", max_examples=200, derandomize=False, print_blob=True, **_common)
    settings.register_profile("dev", max_examples=8, derandomize=True, **_common)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # pragma: no cover
    pass


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _case_counts() -> dict:
    import sys

    strategies = sys.modules.get("strategies")
    return dict(getattr(strategies, "CASES", None) or {})


def pytest_configure(config):
    # Under pytest-xdist the properties run in workers: each worker sends its counts back through
    # workeroutput, and the controller sums them in pytest_testnodedown.
    config._cfm_cases = collections.Counter()


def pytest_sessionfinish(session, exitstatus):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["cfm_cases"] = _case_counts()


@pytest.hookimpl(optionalhook=True)  # an xdist hook: absent without pytest-xdist
def pytest_testnodedown(node, error):
    node.config._cfm_cases.update(getattr(node, "workeroutput", {}).get("cfm_cases", {}))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Print how many hypothesis examples each property ran (counted by tests/strategies.py)."""
    counts = collections.Counter(_case_counts())
    counts.update(config._cfm_cases)
    if not counts:
        return
    profile = os.environ.get("HYPOTHESIS_PROFILE", "ci")
    terminalreporter.section(f"property cases tried (hypothesis profile {profile})")
    for name, count in sorted(counts.items()):
        terminalreporter.write_line(f"{name:48s} {count:6d}")
    terminalreporter.write_line(f"{'total':48s} {sum(counts.values()):6d}")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op CPU thread for a module's tests (tiny tensors: several OpenMP threads on a busy
    2-core box cost far more than they give); torch's previous setting is restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
