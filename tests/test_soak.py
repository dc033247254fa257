"""Soak: many thousand ticks of Token2wavServer with random arrivals, departures, prompt and chunk
lengths and last chunks; every output compared with its stream decoded alone by the upstream.

Each arriving stream follows a script drawn at random from a pool of scripts (random prompt
length, speaker, chunk count, chunk lengths and last-chunk length, tokens), and pushes its chunks on
random ticks; it may leave early (closed before its last chunk) or be refused when the server is
full (``AdmissionError``, counted, not lost). A stream's output depends only on its script, not on
when its chunks come or what the other streams do: so each script is decoded alone once, by the
upstream modules (``token2wav_reference.upstream_stream``: ``flow.setup_cache``/``inference_chunk``
with ``Token2wav.stream``'s trims, its HiFT stage for the waveform scripts), and every chunk of every
stream is compared with that reference (prefix for streams that left early), fp32, 1e-5 relative.
A few scripts are waveform streams (HiFT: slow on CPU), the rest mel-only; the server runs its
default vocoder (torch_cfm's, a random stream per stream) and both sources run without their
additive noise, so the upstream HiFT is the reference there too. The encoder batches
ragged (``encoder_batching="ragged"``: equal cache lengths through the upstream ``forward_chunk``,
mixed ones left-padded and masked), so both of its batched paths run.

Checked: no chunk lost (each pushed chunk answered once), every stream accounted for (completed,
left early, or refused), memory flat (the server's bytes equal the empty server's whenever no
stream is open, never above the empty server + the memory plan x max_streams, and the live tensor
count back to its start at the end). The counts are printed. CI size: 10,000 ticks at the
smallest flow, n_timesteps 2 (``SOAK_TICKS`` / ``SOAK_STEPS`` override): 47 s on a 2-core box shared
with other jobs (110 s at load 3.5), most of it the CFM solves; the ``slow`` variant (``SOAK_LONG=1``) runs 100,000
(n_timesteps 3, 6 streams: 11 min here).
"""

from __future__ import annotations

import gc
import math
import os
import random
import time
import warnings
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

import token2wav_reference as R
import upstream_flow as U
from oracle import err_rel_fro

pytestmark = pytest.mark.skipif(U.missing_reason() is not None, reason=str(U.missing_reason()))

from torch_cfm.serving import AdmissionError, StreamPrompt, Token2wavServer  # noqa: E402

REL = 1e-5
SIZE = R.SOAK


@dataclass
class Script:
    prompt: U.Prompt
    chunks: list  # token tensors; the last one is flagged last_chunk
    waveform: bool
    mels: list = None
    wavs: list = None


def _live_tensors() -> int:
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())


def _poisson(rng: random.Random, lam: float) -> int:
    limit, k, p = math.exp(-lam), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


def _scripts(rng: random.Random, count: int, waveform_every: int) -> list[Script]:
    scripts = []
    for i in range(count):
        p_tok = rng.choice((3, 5, 8, 12))
        prompt = U.make_prompt(SIZE, p_tok, seed=1000 + i)
        n = rng.randint(1, 7)
        gen = torch.Generator().manual_seed(2000 + i)
        lengths = [rng.choice((5, 8, 16, 28)) for _ in range(n - 1)] + [rng.randint(2, 9)]
        waveform = i % waveform_every == 0
        if waveform:  # the vocoder's 8-frame overlap: a first chunk of >= 4 new tokens (upstream too)
            lengths[0] = max(lengths[0], 4 if n == 1 else 8)
        chunks = [torch.randint(0, SIZE.vocab, (1, t), generator=gen, dtype=torch.int32) for t in lengths]
        scripts.append(Script(prompt, chunks, waveform=waveform))
    return scripts


def run_soak(ticks: int, seed: int = 0, n_timesteps: int = 2, max_streams: int = 4,
             prompt_steps: Optional[int] = None) -> dict:
    torch.set_num_threads(1)
    rng = random.Random(seed)
    flow = U.build_flow(SIZE, seed=seed)
    hift = R.build_hift(seed=seed) if R.hift_missing_reason() is None else None
    scripts = _scripts(rng, 24, waveform_every=12)
    for i, sc in enumerate(scripts):
        sc.waveform = sc.waveform and hift is not None
        with R.NoNoise():
            sc.mels, sc.wavs, _ = R.upstream_stream(flow, sc.prompt, sc.chunks, n_timesteps,
                                                    hift=hift if sc.waveform else None, seed=i)
    server = Token2wavServer(flow, hift, max_streams=max_streams, max_prompt_frames=24,
                             max_chunk_tokens=28, n_timesteps=n_timesteps, encoder_batching="ragged",
                             prompt_steps_per_tick=prompt_steps)
    if hift is not None:
        R.quiet_vocoder(server)
    empty = server.state_bytes()
    bound = empty + max_streams * (server.memory_plan().encoder + server.memory_plan().vocoder)
    census, next_census = [], max(ticks // 20, 1)
    live: dict[int, list] = {}  # stream id -> [script index, chunks answered, leaves after]
    counts = dict(ticks=0, opened=0, completed=0, left_early=0, refused=0, chunks=0, wav_chunks=0,
                  max_open=0, empty_checks=0, census=census)
    worst = 0.0
    next_id = 0
    start = time.perf_counter()
    for tick in range(ticks):
        # arrivals (Poisson), opened together
        arrivals = {}
        for _ in range(min(3, _poisson(rng, 0.15))):
            k = rng.randrange(len(scripts))
            if rng.random() < 0.9 and scripts[k].waveform:  # waveform streams are rare (HiFT is slow on CPU)
                k = (k + 1) % len(scripts)
            arrivals[next_id] = k
            next_id += 1
        if arrivals:
            prompts = {sid: StreamPrompt(scripts[k].prompt.tokens, scripts[k].prompt.mel, scripts[k].prompt.spk,
                                         seed=k, waveform=scripts[k].waveform) for sid, k in arrivals.items()}
            try:
                server.open_many(prompts)
            except AdmissionError as exc:
                assert "max_streams" in str(exc)
                counts["refused"] += len(arrivals)
            else:
                for sid, k in arrivals.items():
                    n = len(scripts[k].chunks)
                    stop = n if rng.random() < 0.85 else rng.randint(0, n - 1)  # leave early after `stop`
                    live[sid] = [k, 0, stop]
                counts["opened"] += len(arrivals)
        counts["max_open"] = max(counts["max_open"], len(live))
        # chunks of a random subset of the open streams
        batch = {}
        for sid, (k, done, stop) in live.items():
            if done < stop and rng.random() < 0.5 and server.ready(sid):
                sc = scripts[k]
                batch[sid] = (sc.chunks[done], done == len(sc.chunks) - 1)
        out = server.step(batch)
        assert sorted(out) == sorted(batch), "a chunk was lost or answered twice"
        for sid, o in out.items():
            k, done, stop = live[sid]
            sc = scripts[k]
            err = err_rel_fro(o.mel, sc.mels[done])
            assert o.mel.shape == sc.mels[done].shape and err <= REL, \
                f"tick {tick} stream {sid} (script {k}) chunk {done}: mel rel err {err:.2e}"
            worst = max(worst, err)
            if sc.waveform:
                err = err_rel_fro(o.wav, sc.wavs[done])
                assert o.wav.shape == sc.wavs[done].shape and err <= REL, \
                    f"tick {tick} stream {sid} (script {k}) chunk {done}: wav rel err {err:.2e}"
                worst = max(worst, err)
                counts["wav_chunks"] += 1
            else:
                assert o.wav is None
            live[sid][1] += 1
            counts["chunks"] += 1
        out = o = None  # this tick's outputs are the caller's: dropped before the memory checks
        # departures: finished streams, and those leaving early
        for sid in list(live):
            k, done, stop = live[sid]
            if done == stop:
                server.close_stream(sid)
                del live[sid]
                counts["completed" if stop == len(scripts[k].chunks) else "left_early"] += 1
        assert server.state_bytes() <= bound
        if not live:
            assert server.state_bytes() == empty, "state left behind by closed streams"
            counts["empty_checks"] += 1
            if tick >= next_census:  # the live tensor count at a few empty points: flat
                census.append(_live_tensors())
                next_census += max(ticks // 2, 1)
        counts["ticks"] += 1
    for sid in list(live):
        server.close_stream(sid)
        counts["left_early"] += 1
    assert server.state_bytes() == empty
    assert counts["opened"] == counts["completed"] + counts["left_early"]
    del live, batch
    census.append(_live_tensors())
    assert len(census) >= 2 and max(census) <= census[0], f"live tensors grew: {census}"
    counts.update(seconds=round(time.perf_counter() - start, 1), worst_rel_err=worst, streams=next_id,
                  **{k: server.stats[k] for k in ("encoder_batches", "ragged_batches", "vocoder_batches")})
    return counts


def _report(counts: dict) -> None:
    print(f"\nsoak: {counts['ticks']} ticks, {counts['streams']} streams arrived ({counts['opened']} opened: "
          f"{counts['completed']} completed, {counts['left_early']} left early; {counts['refused']} refused), "
          f"{counts['chunks']} chunks ({counts['wav_chunks']} with waveform), at most {counts['max_open']} open, "
          f"memory checked empty {counts['empty_checks']} times, live tensors {counts['census']}; "
          f"{counts['encoder_batches']} encoder batches ({counts['ragged_batches']} ragged), "
          f"{counts['vocoder_batches']} vocoder batches; worst rel err {counts['worst_rel_err']:.2e}; "
          f"{counts['seconds']} s")


def test_soak():
    counts = run_soak(int(os.environ.get("SOAK_TICKS", "10000")), n_timesteps=int(os.environ.get("SOAK_STEPS", "2")))
    _report(counts)
    assert counts["ticks"] >= int(os.environ.get("SOAK_TICKS", "10000"))
    assert counts["completed"] > 0 and counts["left_early"] > 0 and counts["refused"] >= 0
    assert counts["streams"] > 100 and counts["ragged_batches"] > 0


def test_soak_paced_prompts():
    """The same with prompt solves spread over ticks (prompt_steps_per_tick=1, 3 steps: 3 ticks a
    prompt): streams push once ready, some close while their prompt is under way."""
    counts = run_soak(int(os.environ.get("SOAK_PACED_TICKS", "3000")), seed=2, n_timesteps=3, prompt_steps=1)
    _report(counts)
    assert counts["completed"] > 0 and counts["left_early"] > 0 and counts["streams"] > 100


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("SOAK_LONG") != "1",
                    reason="100,000-tick soak, about 11 min on 2 cores: run with SOAK_LONG=1")
def test_soak_long():
    counts = run_soak(100_000, seed=1, n_timesteps=3, max_streams=6)
    _report(counts)
    assert counts["ticks"] == 100_000
