"""One stream through the stepaudio2 token2wav, upstream vs ``apply_torch_cfm`` (issue 29's figures).

The package's real modules (``tests/upstream_flow.py`` loads them without its TTS stack) at the
shipped sizes with seeded random weights, halved as ``Token2wav(float16=True)`` does, batch 1.
Per provider (``upstream``: the modules as they are; ``torch_cfm``: the same modules after
``apply_torch_cfm`` — CFM decoder served by torch_cfm, conformer encoder replayed from CUDA
graphs — warmed up with ``warmup(flow)``), after one warm stream:

* ``mel``: the flow the way ``Token2wav.stream`` drives it: ``flow.setup_cache`` (prompt tokens
  + 3 lookahead, prompt mel, speaker embedding) then ``flow.inference_chunk`` per 25 + 3 tokens
  (fp16 autocast) and its two cache trims to prompt + 100 frames; the last chunk flagged.
* ``waveform``: the package's own ``Token2wav.set_stream_cache`` / ``Token2wav.stream`` (tokens →
  mel → HiFT → waveform, ``return_waveform=True``) on an instance built without model files,
  when HiFT imports (it needs scipy); otherwise an ``error`` row says why. ``torch_cfm``: the
  HiFT also replayed from CUDA graphs (``apply_torch_cfm_to_vocoder``, warmed up with
  ``warmup_vocoder``); ``vocoder_ms_p50`` is the HiFT call's share (a separate synchronised pass).

Each chunk is timed on the host between device synchronisations (a chunk of ``Token2wav.stream``
ends with a copy to the host anyway); rows give the setup ms, chunk p50/p99/median/max ms and
their max/median ratio, the CFM decoder's share (``decoder_ms_p50``, from a separate pass that
synchronises around ``flow.decoder.forward_chunk``; ``rest_ms_p50`` = encoder, projection, trims),
the mel's error against the fp64 upstream flow on the same inputs
(largest relative Frobenius error over the chunks), and the captures that happened during the
timed stream (0 = nothing compiled or captured after warm-up). Rows are upserted into
``bench/results/stepaudio2_stream.json`` (identity: op, provider, variant, shape, dtype,
precision, timing, gpu) with provenance (gpu, torch, triton, commit from ``BENCH_COMMIT`` or git);
a markdown table is printed and written next to it.

Usage (GPU):  BENCH_COMMIT=<hash> python bench/stepaudio2_stream.py [--quick] [--chunks 50]
Smoke (CPU):  python bench/stepaudio2_stream.py --quick --device cpu --tiny --out /tmp/x
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import math
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, os.path.join(ROOT, "tests"), ROOT]

import _harness as H  # noqa: E402
import upstream_flow as U  # noqa: E402
from torch_cfm.integrations.stepaudio2 import (  # noqa: E402
    accelerated, apply_torch_cfm, apply_torch_cfm_to_vocoder, warmup, warmup_vocoder)

OP = "stepaudio2_stream"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
BARS = {"chunk_ms": 28.0, "setup_ms": 25.0, "max_over_median": 1.25}  # issue 29, H200 fp16, tokens -> waveform


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _pct(values, p: float) -> float:
    xs = sorted(values)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * p
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _autocast(device: str, dtype: torch.dtype):
    return torch.amp.autocast(device, dtype=dtype, enabled=device == "cuda" and dtype != torch.float32)


def stream_mel(flow, prompt, chunks, *, n_steps: int, device: str, dtype: torch.dtype):
    """The flow part of Token2wav.set_stream_cache + Token2wav.stream, timed. Returns
    (mels, setup ms, [chunk ms])."""
    _sync(device)
    t0 = time.perf_counter()
    cache = flow.setup_cache(prompt.tokens, prompt.mel, prompt.spk, n_timesteps=n_steps)
    _sync(device)
    setup_ms = (time.perf_counter() - t0) * 1e3
    mels, times = [], []
    for i, tok in enumerate(chunks):
        t0 = time.perf_counter()
        with _autocast(device, dtype):
            mel, cache = flow.inference_chunk(tok, prompt.spk, cache, last_chunk=i == len(chunks) - 1,
                                              n_timesteps=n_steps)
        cache = U.trim_stream_cache(cache, prompt.frames)
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        mels.append(mel.float().clone())
    return mels, setup_ms, times


def timed_pass(owner, name: str, run, device: str) -> list:
    """ms of each call of ``owner.<name>`` during ``run()``, a separate pass with a synchronisation
    around the call (so the main timing has none). The attribute is restored afterwards (an
    instance attribute put back, a class method left to the class)."""
    inner = getattr(owner, name)
    had_own = name in vars(owner)
    times = []

    def timed(*a, **k):
        _sync(device)
        t0 = time.perf_counter()
        out = inner(*a, **k)
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        return out

    setattr(owner, name, timed)
    try:
        run()
    finally:
        if had_own:
            setattr(owner, name, inner)
        else:
            delattr(owner, name)
    return times


def decoder_times(flow, prompt, chunks, *, n_steps: int, device: str, dtype: torch.dtype) -> list:
    """ms of each chunk's ``flow.decoder.forward_chunk`` (the CFM solve)."""
    times = timed_pass(flow.decoder, "forward_chunk", lambda: stream_mel(
        flow, prompt, chunks, n_steps=n_steps, device=device, dtype=dtype), device)
    return times[1:]  # [0] is setup_cache's prompt solve


def stream_waveform(t2w, chunks):
    """Token2wav.set_stream_cache + Token2wav.stream (return_waveform=True), timed."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    t2w.stream_cache, t2w.hift_cache_dict = t2w.set_stream_cache("prompt.wav")
    torch.cuda.synchronize()
    setup_ms = (time.perf_counter() - t0) * 1e3
    times = []
    for i, tok in enumerate(chunks):
        t0 = time.perf_counter()
        t2w.stream(tok[0].tolist(), "prompt.wav", last_chunk=i == len(chunks) - 1, return_waveform=True)
        times.append((time.perf_counter() - t0) * 1e3)
    return setup_ms, times


def vocoder_times(t2w, chunks) -> list:
    """ms of each chunk's HiFT call inside ``Token2wav.stream``."""
    return timed_pass(t2w, "hift", lambda: stream_waveform(t2w, chunks), "cuda")


class GcPauses:
    """Python garbage collections (generation, ms) while active: a host pause a slow chunk may hold."""

    def __init__(self) -> None:
        self.pauses: list = []
        self._t0 = 0.0

    def _cb(self, phase, info) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses.append((info["generation"], (time.perf_counter() - self._t0) * 1e3))

    def __enter__(self):
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._cb)

    def fields(self) -> dict:
        return dict(gc_collections=len(self.pauses), gc_ms_max=round(max((p[1] for p in self.pauses), default=0.0), 3),
                    gc_gen2=sum(1 for p in self.pauses if p[0] == 2))


def _timing_fields(setup_ms: float, times) -> dict:
    med = _pct(times, 0.5)
    return dict(slowest_chunk=max(range(len(times)), key=times.__getitem__), chunk_ms_all=[round(t, 2) for t in times],setup_ms=round(setup_ms, 3), chunk_ms_p50=round(med, 3), chunk_ms_median=round(med, 3),
                chunk_ms_p99=round(_pct(times, 0.99), 3), chunk_ms_max=round(max(times), 3),
                max_over_median=round(max(times) / med, 3) if med > 0 else None,
                us_p20=round(_pct(times, 0.2) * 1e3, 1), us_p50=round(med * 1e3, 1),
                us_p80=round(_pct(times, 0.8) * 1e3, 1))


def _mel_errors(mels, ref) -> dict:
    rel = max(H.rel_err(m, r) for m, r in zip(mels, ref))
    mx = max((m.double() - r.double()).abs().max().item() for m, r in zip(mels, ref))
    return dict(rel_err=rel, max_abs_err=mx)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 chunks instead of --chunks")
    ap.add_argument("--chunks", type=int, default=50, help="streaming chunks after the prompt (the last is flagged)")
    ap.add_argument("--prompt-tokens", type=int, default=150, help="prompt tokens (x2 = mel frames; 150 = 6 s)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: fp16 on CUDA, fp32 on CPU")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny modules (CPU smoke test)")
    ap.add_argument("--no-waveform", action="store_true", help="skip the Token2wav.stream (HiFT) rows")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="directory of the results files")
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("fp16" if args.device == "cuda" else "fp32")
    device, dtype, n_steps = args.device, DTYPES[args.dtype], 10
    n_chunks = 8 if args.quick else args.chunks
    if args.tiny and args.quick:
        n_chunks = min(n_chunks, 6)
    size = U.TINY if args.tiny else U.SHIPPED
    size = dataclasses.replace(size, vocab=max(size.vocab, 4219))  # set_stream_cache pads with token 4218
    prompt_tokens = min(args.prompt_tokens, 40) if args.tiny else args.prompt_tokens
    # The upstream scratch buffers hold 1000 frames; prompt + 100 + the longest chunk is what a stream uses.
    size = dataclasses.replace(size, buffer_frames=2 * prompt_tokens + 100 + 64)
    env = H.env_info()
    precision = args.dtype if dtype != torch.float32 else ("tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee")

    base = U.build_flow(size, seed=0)
    prompt64 = U.make_prompt(size, prompt_tokens, seed=1, device=device, dtype=torch.float64)
    chunks = U.make_chunks(size, n_chunks, seed=2, last_tokens=28, device=device)  # last: T = 56 frames
    prompt = U.Prompt(prompt64.tokens, prompt64.mel.to(dtype), prompt64.spk.to(dtype))
    shape = dict(prompt_frames=prompt.frames, chunk_frames=50, last_frames=56, chunks=n_chunks, batch=1,
                 size="tiny" if args.tiny else "shipped", n_timesteps=n_steps)
    print(f"{OP}: {shape['size']} modules, {args.dtype}, {device}, prompt {prompt.frames} frames, {n_chunks} chunks",
          flush=True)

    ref_flow = copy.deepcopy(base).double().to(device)
    ref_mels, _, _ = stream_mel(ref_flow, prompt64, chunks, n_steps=n_steps, device=device, dtype=torch.float64)
    del ref_flow
    upstream = base.to(device=device, dtype=dtype)  # Token2wav(float16=True): flow.half()
    ours = copy.deepcopy(upstream)
    apply_torch_cfm(ours)
    t0 = time.perf_counter()
    warm = warmup(ours, prompt_frames=(prompt.frames,), last_tokens=(28,), n_timesteps=n_steps)
    warmup_s = time.perf_counter() - t0
    print(f"torch_cfm warm-up: {warm['streams']} streams, {warm['decoder_graphs']} CFM graphs, "
          f"{warm['encoder_graphs']} encoder graphs, {warmup_s:.1f} s", flush=True)
    encoder_call = accelerated(ours).encoder_call

    rows = []
    timing_ours = "cuda_graph" if accelerated(ours).graphs else "eager"
    for provider, flow in (("upstream", upstream), ("torch_cfm", ours)):
        stream_mel(flow, prompt, chunks[:3] + chunks[-1:], n_steps=n_steps, device=device, dtype=dtype)  # warm
        def captured() -> int:
            if provider != "torch_cfm":
                return 0
            return accelerated(flow).graph_count() + (encoder_call.graph_count if encoder_call is not None else 0)

        graphs_before = captured()
        with GcPauses() as pauses:
            mels, setup_ms, times = stream_mel(flow, prompt, chunks, n_steps=n_steps, device=device, dtype=dtype)
        dec_times = decoder_times(flow, prompt, chunks, n_steps=n_steps, device=device, dtype=dtype)
        extra = dict(pauses.fields(), decoder_ms_p50=round(_pct(dec_times, 0.5), 3),
                     rest_ms_p50=round(_pct(times, 0.5) - _pct(dec_times, 0.5), 3))
        if provider == "torch_cfm":
            extra.update(graphs=accelerated(flow).graph_count(),
                         encoder_graphs=encoder_call.graph_count if encoder_call is not None else 0,
                         encoder_events=list(encoder_call.events) if encoder_call is not None else [],
                         captures_during_timing=captured() - graphs_before, warmup_s=round(warmup_s, 2))
        rows.append(H.make_row(env, op=OP, provider=provider, variant="mel", shape=shape, dtype=args.dtype,
                               precision=precision, timing=timing_ours if provider == "torch_cfm" else "eager",
                               **_timing_fields(setup_ms, times), **_mel_errors(mels, ref_mels), **extra))

    if not args.no_waveform:
        reason = None
        if device != "cuda":
            reason = "Token2wav.stream hard-codes device='cuda'"
        else:
            token2wav_cls, hift_cls = U.load_token2wav_class()
            if hift_cls is None:
                reason = "HiFT needs scipy (not installed)"
        for provider, flow in (("upstream", upstream), ("torch_cfm", ours)):
            fields = dict(op=OP, provider=provider, variant="waveform", shape=shape, dtype=args.dtype,
                          precision=precision, timing=timing_ours if provider == "torch_cfm" else "eager")
            if reason is not None:
                rows.append(H.make_row(env, error=reason, **fields))
                continue
            try:
                t2w = U.make_token2wav(token2wav_cls, flow, prompt, real_hift=hift_cls, n_timesteps=n_steps,
                                       float16=dtype == torch.float16)
                extra = {}
                if provider == "torch_cfm":
                    vocoder = apply_torch_cfm_to_vocoder(t2w.hift.inner)
                    warmup_vocoder(vocoder, chunk_frames=(50,), last_frames=(56,))
                stream_waveform(t2w, chunks[:3] + chunks[-1:])  # warm (HiFT's cuDNN choices too)
                t2w.hift.mels.clear()
                before = vocoder.graph_count if provider == "torch_cfm" else 0
                with GcPauses() as pauses:
                    setup_ms, times = stream_waveform(t2w, chunks)
                extra.update(pauses.fields())
                if provider == "torch_cfm":
                    extra.update(vocoder_graphs=vocoder.graph_count,
                                 captures_during_timing=vocoder.graph_count - before,
                                 vocoder_events=list(vocoder.call.events))
                extra["vocoder_ms_p50"] = round(_pct(vocoder_times(t2w, chunks), 0.5), 3)
                rows.append(H.make_row(env, **fields, **_timing_fields(setup_ms, times), **extra))
                if provider == "torch_cfm":
                    # what a server does after its warm-up (vLLM's capture-at-startup does the
                    # same): the objects alive now leave the collector's generations, so that
                    # no full collection scans them mid-stream.
                    gc.collect()
                    gc.freeze()
                    try:
                        with GcPauses() as pauses:
                            setup_ms, times = stream_waveform(t2w, chunks)
                    finally:
                        gc.unfreeze()
                    rows.append(H.make_row(env, **dict(fields, variant="waveform_gc_frozen"),
                                           **_timing_fields(setup_ms, times), **pauses.fields()))
            except Exception as exc:  # noqa: BLE001 - a failing provider gets a row with its error
                rows.append(H.make_row(env, error=f"{type(exc).__name__}: {exc}"[:300], **fields))

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{OP}.json")
    H.upsert_rows(path, rows)

    def cell(r, key, fmt="{:.1f}"):
        v = r.get(key)
        return "err" if r.get("error") else ("" if v is None else fmt.format(v))

    lines = ["| provider | variant | timing | setup ms | chunk p50 ms | p99 ms | max ms | max/median | "
             "CFM decoder p50 ms | HiFT p50 ms | mel rel err vs fp64 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['provider']} | {r['variant']} | {r['timing']} | {cell(r, 'setup_ms')} | "
                     f"{cell(r, 'chunk_ms_p50')} | {cell(r, 'chunk_ms_p99')} | {cell(r, 'chunk_ms_max')} | "
                     f"{cell(r, 'max_over_median', '{:.2f}')} | {cell(r, 'decoder_ms_p50')} | "
                     f"{cell(r, 'vocoder_ms_p50')} | "
                     f"{cell(r, 'rel_err', '{:.2e}')} |")
    for r in rows:
        if r.get("error"):
            lines.append(f"\n{r['provider']} {r['variant']}: {r['error']}")
    ours_wave = next((r for r in rows if r["provider"] == "torch_cfm" and r["variant"] == "waveform"
                      and not r.get("error")), None)
    ours_mel = next(r for r in rows if r["provider"] == "torch_cfm" and r["variant"] == "mel")
    up_mel = next(r for r in rows if r["provider"] == "upstream" and r["variant"] == "mel")
    checks = [f"mel error vs fp64 {ours_mel['rel_err']:.2e} <= 2 x upstream {up_mel['rel_err']:.2e} + 1e-6: "
              f"{ours_mel['rel_err'] <= 2 * up_mel['rel_err'] + 1e-6}",
              f"setup {ours_mel['setup_ms']:.1f} ms <= {BARS['setup_ms']} ms: "
              f"{ours_mel['setup_ms'] <= BARS['setup_ms']}",
              f"captures during the timed stream: {ours_mel.get('captures_during_timing')}"]
    if ours_wave is not None:
        checks += [f"chunk tokens -> waveform p50 {ours_wave['chunk_ms_p50']:.1f} ms <= {BARS['chunk_ms']} ms: "
                   f"{ours_wave['chunk_ms_p50'] <= BARS['chunk_ms']}",
                   f"slowest chunk / median {ours_wave['max_over_median']:.2f} <= {BARS['max_over_median']}: "
                   f"{ours_wave['max_over_median'] <= BARS['max_over_median']}"]
    else:
        checks.append(f"slowest mel chunk / median {ours_mel['max_over_median']:.2f} <= {BARS['max_over_median']}: "
                      f"{ours_mel['max_over_median'] <= BARS['max_over_median']}")
    command = "python bench/stepaudio2_stream.py " + " ".join(argv if argv is not None else sys.argv[1:])
    table = "\n".join(lines) + "\n\nBars (issue 29, H200 fp16):\n" + "\n".join(f"- {c}" for c in checks) + "\n"
    text = f"# {OP}: {shape}\n\n" + table + H.provenance_footer(rows, command.strip())
    with open(os.path.join(args.out, f"{OP}.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
