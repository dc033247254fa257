"""The benchmark scripts run end to end on CPU (``--dry-run``: one call per row, no timing) and
write rows with every field the results format promises. Keeps bench/ from rotting between GPU runs."""

import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
FIELDS = {"op", "provider", "variant", "shape", "dtype", "precision", "timing", "us_p20", "us_p50",
          "us_p80", "rel_err", "error", "gpu", "capability", "torch", "triton", "commit", "timestamp", "run_id"}


@pytest.mark.parametrize("script,result,op", [("attention.py", "attention.json", "cfm_attention"),
                                             ("dit_step.py", "dit_step.json", "dit_step"),
                                             ("vocoder_tiles.py", "vocoder_tiles.json", "vocoder_tiles")])
def test_bench_script_dry_run_writes_complete_rows(tmp_path, script, result, op):
    res = subprocess.run([sys.executable, os.path.join(BENCH, script), "--dry-run", "--quick", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, BENCH_COMMIT="test"))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads((tmp_path / result).read_text())
    assert rows and all(FIELDS <= set(r) for r in rows), [sorted(FIELDS - set(r)) for r in rows][:3]
    assert any(r["op"] == op and r["provider"] == "torch_cfm" and r["error"] is None for r in rows)
    assert all(r["commit"] == "test" for r in rows)
    assert len({r["run_id"] for r in rows}) == 1 and rows[0]["run_id"]  # one id per process
    assert "Reproduce:" in (tmp_path / result.replace(".json", ".md")).read_text()


def test_attention_accuracy_dry_run_rows(tmp_path):
    """bench/attention_accuracy.py on CPU: one row per config, the pinned sharp case included;
    the interpreter's exact fp32 dots keep it inside the docs/design.md §6 bound (the GPU is the question)."""
    res = subprocess.run([sys.executable, os.path.join(BENCH, "attention_accuracy.py"), "--dry-run",
                          "--configs", "default,noslab", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, BENCH_COMMIT="test"))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads((tmp_path / "attention_accuracy.json").read_text())
    assert [r["variant"] for r in rows] == ["default", "noslab"]
    for r in rows:
        assert r["op"] == "cfm_attention_accuracy" and r["commit"] == "test"
        assert r["shape"]["cases"] == 2 and "K233" in r["worst_case"]
        assert r["fails"] == 0 and 0 < r["max_ratio"] < 1, r


def test_attention_error_sources_dry_run(tmp_path):
    """bench/attention_error_sources.py on CPU: both reports, every column a finite ratio per case."""
    res = subprocess.run([sys.executable, os.path.join(BENCH, "attention_error_sources.py"), "--dry-run",
                          "--parts", "--scores", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    for label, column in (("parts", "kernel_noslab"), ("scores", "x3_slab32")):
        rows = json.loads((tmp_path / f"attention_error_sources_{label}.json").read_text())
        assert {r["case"] for r in rows} == {"pinned", "pinned-shuffled"}
        assert all(0 < r[column] < 1 for r in rows), rows


def test_kernel_resources_compiles_for_sm90_without_a_gpu():
    """bench/kernel_resources.py: a kernel specialised like a launch compiles for sm_90 on this
    machine and its resource line parses (registers, spill stack, shared memory, SASS instructions,
    async copies)."""
    import re

    pytest.importorskip("triton")
    sys.path.insert(0, BENCH)
    try:
        import kernel_resources as kr
    finally:
        sys.path.remove(BENCH)
    line = kr.dit_attention_rows(90)[0]
    m = re.search(r"REG:(\d+) STACK:(\d+) smem=(\d+) sass=(\d+) cp\.async=(\d+)", line)
    assert m, line
    regs, _, smem, sass, _ = map(int, m.groups())
    assert 0 < regs <= 255 and smem > 0 and sass > 100, line


def test_ingest_floor_model(tmp_path):
    """bench/ingest_floor.py: one tiling's bytes per SM by hand, the search never worse than the tile the
    wgmma kernel uses, the floor falling as the ingest rate rises, and the script's table written."""
    sys.path.insert(0, BENCH)
    try:
        import ingest_floor as F
    finally:
        sys.path.remove(BENCH)
    # proj at (8, 50, 400) fp16: 400 x 512 x 512 in 64 x 128 tiles split 4 ways = 7 * 4 * 4 = 112 tiles, one
    # wave; each takes 64 + 128 rows of 128 K-columns in fp16, plus 1/132 of the 4 fp32 partial outputs
    got = F.gemm_ingest_bytes(400, 512, 512, 2, F.Tile(64, 128, 4))
    assert got == pytest.approx((64 + 128) * 128 * 2 + 400 * 512 * 4 * 4 / 132)
    # 140 tiles of 64 x 32 (K whole) need two waves on 132 SMs
    assert F.gemm_ingest_bytes(400, 512, 640, 2, F.Tile(64, 32, 1)) == 2 * (64 + 32) * 512 * 2
    us, tile, _ = F.best_gemm(400, 512, 2048, 2, 50.0, 1.0)  # fc1
    assert tile.rows * tile.cols <= F.MAX_ACC
    assert us <= 1.0 + (64 + 128) * 512 * 2 / 50e3  # the shipped kernel's fc1 tile: 64 x 128, whole K
    cfg = F.DiTConfig()
    slow, fast = (F.step_floor_us(cfg, 8, 50, 400, "fp16", r, 1.0) for r in (50.0, 67.0))
    assert fast < slow
    # the row-norm boundaries as phases of their own: 11 phases, each at least one sync
    phased = F.block_phases(cfg, 8, 50, 400, 2, 50.0, 1.0, norm_phases=True)
    assert len(phased) == 11 and all(p[1] >= 1.0 for p in phased)
    assert F.step_floor_us(cfg, 8, 50, 400, "fp16", 50.0, 1.0, norm_phases=True) > slow
    assert F.main(["--rates", "50", "--syncs", "1.0", "--out", str(tmp_path)]) == 0
    assert "| 8, 50, 400 | fp16 |" in (tmp_path / "ingest_floor.md").read_text()


def _harness():
    sys.path.insert(0, BENCH)
    try:
        import _harness as H
    finally:
        sys.path.remove(BENCH)
    return H


def _row(provider, us, run_id=None, n=8, commit="c1", timestamp="2026-12-01T00:00:00+00:00"):
    return {"op": "cfm_attention", "provider": provider, "variant": "", "shape": {"N": n}, "dtype": "float16",
            "precision": None, "timing": "cuda_graph", "us_p50": us, "error": None, "gpu": "G",
            "commit": commit, "timestamp": timestamp, "run_id": run_id}


def test_tables_compare_torch_cfm_only_with_peers_of_its_run(tmp_path):
    """A torch_cfm row upserted by a later run loses its pairing with the older run's peers: the table
    says "no same-run peer" instead of a ratio, merge keeps run ids and lists the lost pair."""
    H = _harness()
    old = [_row("torch_cfm", 6.0, "runA"), _row("sdpa_cudnn_mask", 18.0, "runA"),
           _row("sdpa_flash_NOMASK_lowerbound", 3.0, "runA"), _row("torch_cfm", 9.0, "runA", n=32),
           _row("flex_compiled_blockmask", 27.0, "runA", n=32)]
    H._write_rows(str(tmp_path / "results" / "attention.json"), old)
    out = tmp_path / "out"
    later = [_row("torch_cfm", 5.0, "runB", timestamp="2026-12-02T00:00:00+00:00")]
    H._write_rows(str(out / "attention.json"), later)
    merged = H.merge_results([str(out)], str(tmp_path / "results"))
    assert list(merged.values()) == [1]
    rows = json.loads((tmp_path / "results" / "attention.json").read_text())
    assert sorted((r["provider"], r["shape"]["N"], r["run_id"]) for r in rows) == [
        ("flex_compiled_blockmask", 32, "runA"), ("sdpa_cudnn_mask", 8, "runA"),
        ("sdpa_flash_NOMASK_lowerbound", 8, "runA"), ("torch_cfm", 8, "runB"), ("torch_cfm", 32, "runA")]
    lines = (tmp_path / "results" / "attention.md").read_text().splitlines()
    n8 = [ln for ln in lines if ln.startswith("| N=8 float16")]
    n32 = [ln for ln in lines if ln.startswith("| N=32 float16")]
    assert len(n8) == 2 and n8[1].split(" | ")[1] == "r2" and n8[1].endswith("| no same-run peer |"), n8
    assert "×" not in " ".join(n8)  # 18 µs of run A is never divided by 5 µs of run B
    assert len(n32) == 1 and n32[0].endswith("| 3.00× vs flex_compiled_blockmask |"), n32  # 27 / 9, same run
    assert H.unpaired(rows) == ["cfm_attention cuda_graph N=8 float16: torch_cfm of runB"]
    # the floor is not a peer: with only it left in the run, torch_cfm stays unpaired
    assert H.same_run_comparison([_row("torch_cfm", 6.0), _row("sdpa_flash_NOMASK_lowerbound", 3.0)]) == \
        "no same-run peer"


def test_rows_without_run_id_pair_by_commit_and_timestamp():
    """Rows from before run ids: one run per (commit, timestamp) to the second; none without a timestamp."""
    H = _harness()
    t1, t2 = "2026-12-01T00:00:00+00:00", "2026-12-01T00:00:19+00:00"
    same = [_row("torch_cfm", 6.0, timestamp=t1), _row("sdpa_cudnn_mask", 12.0, timestamp=t1)]
    assert H.run_of(same[0]) == H.run_of(same[1]) and H.same_run_comparison(same) == "2.00× vs sdpa_cudnn_mask"
    apart = [_row("torch_cfm", 6.0, timestamp=t1), _row("sdpa_cudnn_mask", 12.0, timestamp=t2)]
    assert H.run_of(apart[0]) != H.run_of(apart[1])  # same commit, same minute, two processes
    other = [_row("torch_cfm", 6.0, timestamp=t1), _row("sdpa_cudnn_mask", 12.0, commit="c2", timestamp=t1)]
    assert H.run_of(other[0]) != H.run_of(other[1])
    bare = [dict(r, timestamp=None) for r in same]
    assert H.run_of(bare[0]) != H.run_of(bare[1])
    assert H.run_id() == H.env_info()["run_id"] == H.run_id()
