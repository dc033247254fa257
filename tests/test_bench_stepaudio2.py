"""bench/stepaudio2_stream.py end to end on CPU at the tiny size (``--quick --device cpu --tiny``):
rows for both providers with every results field, provenance, the mel within docs/design.md §6 of the fp64
flow, the waveform rows present with their reason (``Token2wav.stream`` needs CUDA)."""

import json
import os
import subprocess
import sys

import pytest

import upstream_flow as U

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
FIELDS = {"op", "provider", "variant", "shape", "dtype", "precision", "timing", "us_p20", "us_p50",
          "us_p80", "rel_err", "error", "gpu", "capability", "torch", "triton", "commit", "timestamp",
          "setup_ms", "chunk_ms_p50", "chunk_ms_p99", "chunk_ms_max", "max_over_median"}


@pytest.mark.skipif(U.missing_reason() is not None, reason=str(U.missing_reason()))
def test_stepaudio2_stream_bench_smoke(tmp_path):
    env = dict(os.environ, BENCH_COMMIT="test", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, os.path.join(BENCH, "stepaudio2_stream.py"), "--quick", "--device", "cpu",
                          "--tiny", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads((tmp_path / "stepaudio2_stream.json").read_text())
    mel = {r["provider"]: r for r in rows if r["variant"] == "mel"}
    assert set(mel) == {"upstream", "torch_cfm"}
    for r in mel.values():
        assert FIELDS <= set(r), sorted(FIELDS - set(r))
        assert r["error"] is None and r["commit"] == "test" and r["shape"]["chunks"] == 6
        assert 0 < r["chunk_ms_p50"] <= r["chunk_ms_max"] and r["setup_ms"] > 0
    assert mel["torch_cfm"]["rel_err"] <= 2 * mel["upstream"]["rel_err"] + 1e-6
    assert mel["torch_cfm"]["captures_during_timing"] == 0
    wave = [r for r in rows if r["variant"] == "waveform"]
    assert len(wave) == 2 and all("cuda" in r["error"] for r in wave)
    md = (tmp_path / "stepaudio2_stream.md").read_text()
    assert "| torch_cfm | mel |" in md and "Reproduce:" in md
