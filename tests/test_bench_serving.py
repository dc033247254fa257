"""bench/serving.py on CPU at tiny sizes: the smoke mode runs every stage and provider, writes the
JSONL rows (with provenance), the table and the plot (or says why not); the batched upstream peer
solves what the upstream's own per-stream solver does."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import upstream_flow as U
from oracle import err_rel_fro

pytestmark = [pytest.mark.skipif(U.missing_reason() is not None, reason=str(U.missing_reason())),
              pytest.mark.usefixtures("one_thread")]

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import serving  # noqa: E402


def test_smoke_rows_table_plot(tmp_path, capsys):
    rows = serving.main(["--device", "cpu", "--tiny", "--quick", "--concurrency", "2", "--ticks", "2",
                         "--chunks", "2", "--warm-ticks", "1", "--out", str(tmp_path)])
    got = {(r["stage"], r["provider"]) for r in rows}
    want = {("cfm", "torch_cfm"), ("cfm", "upstream"), ("cfm", "upstream_graph"), ("mel", "torch_cfm"),
            ("mel", "torch_cfm/enc_per_stream"), ("mel", "torch_cfm/enc_ragged"), ("mel", "upstream"),
            ("wav", "torch_cfm"), ("wav", "upstream")} | {(s, "torch_cfm/paced") for s in ("cfm", "mel", "wav")}
    assert got == want
    for r in rows:
        if r["stage"] == "wav" and r.get("error", "").startswith("no HiFT"):
            continue  # scipy missing: the row says so
        assert not r.get("error"), r
        assert r["audio_s_per_s"] > 0 and r["chunk_ms_p50"] > 0 and r["chunk_ms_p99"] >= r["chunk_ms_p50"]
        assert r["chunks"] >= r["ticks"] > 0
        for key in ("gpu", "torch", "triton", "commit", "timestamp"):
            assert key in r
        if r["provider"] != "upstream_graph" and r["streams"] and r["provider"] != "torch_cfm/paced":
            assert r["first_chunk_ms_p50"] > 0
        if r["provider"] == "torch_cfm/paced":  # prompts spread over ceil(2 steps / 2) = 1 tick
            assert r["variant"] == "prompt_steps_2" and r["captures_measured"] == 0
        if r["provider"].startswith("torch_cfm"):
            assert r["bytes_per_stream"] > 0
            if r["stage"] != "cfm":
                assert abs(sum(r[f"share_{k}"] for k in ("encoder", "cfm", "vocoder")) - 1) < 0.01
    lines = (tmp_path / "serving.jsonl").read_text().splitlines()
    assert len(lines) == len(rows) and all(json.loads(line)["op"] == "serving" for line in lines)
    serving.main(["--device", "cpu", "--tiny", "--quick", "--concurrency", "2", "--ticks", "1", "--chunks", "2",
                  "--warm-ticks", "0", "--stages", "cfm", "--providers", "torch_cfm", "--out", str(tmp_path)])
    assert len((tmp_path / "serving.jsonl").read_text().splitlines()) == len(rows)  # upserted, not appended

    mixed = serving.main(["--device", "cpu", "--tiny", "--quick", "--concurrency", "3", "--ticks", "3", "--chunks", "3",
                          "--warm-ticks", "1", "--stages", "mel", "--mixed-prompts", "--out", str(tmp_path),
                          "--providers", "torch_cfm,torch_cfm/enc_ragged,upstream"])
    assert all(not r.get("error") and r["variant"] == "mixed_prompts" and r["audio_s_per_s"] > 0 for r in mixed)
    table = (tmp_path / "serving.md").read_text()
    assert "| cfm | torch_cfm | 2 |" in table and "Reproduce:" in table
    out = capsys.readouterr().out
    assert (tmp_path / "serving.png").exists() or "matplotlib is not installed" in out


def test_fp16_vocoder_provider_serves_waveforms(tmp_path):
    """torch_cfm/voc_fp16: the front with vocoder_precision="fp16" (tokens -> waveform rows only)."""
    rows = serving.main(["--device", "cpu", "--tiny", "--quick", "--concurrency", "2", "--ticks", "1", "--chunks", "2",
                         "--warm-ticks", "0", "--stages", "cfm,wav", "--providers", "torch_cfm/voc_fp16",
                         "--out", str(tmp_path)])
    assert [(r["stage"], r["provider"]) for r in rows] == [("wav", "torch_cfm/voc_fp16")]
    r = rows[0]
    if not r.get("error", "").startswith("no HiFT"):
        assert not r.get("error") and r["audio_s_per_s"] > 0
    prov = serving.TorchCfmVocFp16Provider
    assert prov.vocoder_precision == "fp16" and serving.PROVIDERS[prov.name] is prov


def test_arrival_stages_split_the_step(tmp_path):
    """--arrival-stages: per-stage ms per tick under the row's arrivals, the prompt solves of opens left
    out; the stages are timed inside the step, so what is left of the step is >= 0."""
    rows = serving.main(["--device", "cpu", "--tiny", "--quick", "--concurrency", "3", "--ticks", "3", "--chunks", "2",
                         "--warm-ticks", "1", "--stages", "mel,wav", "--providers", "torch_cfm", "--arrival-stages",
                         "--out", str(tmp_path)])
    for r in rows:
        if r.get("error", "").startswith("no HiFT"):
            continue
        assert not r.get("error"), r
        stages = [r[f"arrival_ms_{k}"] for k in ("encoder", "cfm", "vocoder")]
        assert stages[0] > 0 and stages[1] > 0
        assert stages[2] > stages[1] / 20 if r["stage"] == "wav" else stages[2] < stages[1] / 20  # mel: no vocoder
        assert r["arrival_step_ms_mean"] > 0 and r["arrival_ms_other"] >= 0
        assert abs(r["arrival_step_ms_mean"] - sum(stages) - r["arrival_ms_other"]) < 1e-2
    prov = serving.TorchCfmProvider
    assert "open" not in vars(prov) or callable(prov.open)


def test_upstream_graph_peer_solves_like_the_upstream():
    """The peer's batched loop over the upstream estimator, each row vs the upstream's own
    ``solve_euler_chunk`` of that row alone (its batch-1 solver), fp32."""
    flow = U.build_flow(U.TINY, seed=0)
    wl = serving.Workload(prompt_tokens=10, chunk_tokens=28, chunks=2, n_steps=3, ticks=1, warm_ticks=0)
    peer = serving.UpstreamGraphProvider(flow, None, "cfm", 2, wl, None, "cpu", torch.float32)
    with torch.inference_mode():
        both = peer.fn()
        dec = flow.decoder
        rows = peer.att.shape[2] // 2
        for b in range(rows):
            pick = [b, rows + b]
            ref, _, _ = dec.solve_euler_chunk(peer.x[b:b + 1], peer.t_span, peer.mu[b:b + 1], peer.spks[b:b + 1],
                                              peer.cond[b:b + 1], peer.cnn[:, :, pick], peer.att[:, :, pick])
            assert err_rel_fro(both[b], ref[0]) <= 1e-5


def test_causal_vocoder_rows(tmp_path):
    """``--vocoder causal``: the script re-executes itself with minicpmo-utils' ``stepaudio2`` alone
    and serves the wav stage through the front's causal vocoder stage; the HiFTGenerator's paths
    (the upstream wav rows, the voc stage) are left out."""
    import subprocess

    import upstream_packages as P

    reason = P.missing_reason(serving.CAUSAL_PACKAGE)
    if reason:
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if k not in (P.ACTIVE_ENV, "STEPAUDIO2_PATH")}
    cmd = [sys.executable, os.path.join(os.path.dirname(serving.__file__), "serving.py"), "--device", "cpu", "--tiny",
           "--quick", "--concurrency", "2", "--ticks", "2", "--chunks", "2", "--warm-ticks", "1",
           "--stages", "wav,voc", "--vocoder", "causal", "--providers", "torch_cfm,upstream", "--out", str(tmp_path)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "serving.jsonl").read_text().splitlines()]
    assert [(r["stage"], r["provider"], r["variant"]) for r in rows] == [("wav", "torch_cfm", "causal_vocoder")]
    row = rows[0]
    assert not row.get("error") and row["audio_s_per_s"] > 0 and row["captures_measured"] == 0
    assert abs(sum(row[f"share_{k}"] for k in ("encoder", "cfm", "vocoder")) - 1) < 0.01
