"""One stream through minicpmo-utils' ``Token2wav.stream``, upstream vs ``apply_torch_cfm`` (issue 40's bar).

minicpmo-utils 1.0.7 (the ``stepaudio2`` MiniCPM-o 4.5 requires) is imported in isolation, as the
tests do (``tests/upstream_packages.py``): its ``stepaudio2`` is ``.upstream/minicpmo-utils/stepaudio2``
(``python3 -m pip install -q --no-deps --target .upstream/minicpmo-utils minicpmo-utils==1.0.7``),
and this script re-executes itself with ``UPSTREAM_PACKAGE`` / ``STEPAUDIO2_PATH`` set to it when
they are not. Its ``Token2wav`` is built without model files (``make_minicpmo_token2wav``): the
package's flow and causal HiFT (``CausalHiFTGenerator`` in its ``BoundedVocoder``) at the shipped
sizes (``--tiny``: small) with seeded random weights, and ``float16=True`` as ``Token2wav(float16=True)``
sets it (``flow.half()``, the flow under fp16 autocast; the vocoder in float32/float64 as shipped).

Providers: ``upstream`` (the package as it is) and ``torch_cfm`` (the same objects after
``apply_torch_cfm`` + ``warmup``: the CFM decoder served by torch_cfm, the conformer encoder and
the causal vocoder replayed from CUDA graphs). Each runs one warm stream first; then, per chunk
of 25 + 3 tokens after a 300-frame prompt (the last chunk flagged, 28 tokens), host ms between
device synchronisations:

* ``waveform``: ``Token2wav.stream(tokens, return_waveform=True)``: tokens -> mel -> causal
  vocoder -> host samples. ``vocoder_ms_p50``: ``Token2wav._stream_vocode``'s share (a separate
  synchronised pass).
* ``mel``: the same ``Token2wav.stream`` calls with ``_stream_vocode`` replaced by a recorder
  (tokens -> mel, its ``_trim_estimator_cache`` / ``_trim_conformer_cache`` included);
  ``mel_rel_err`` is the largest relative Frobenius error of a chunk's mel against the package's
  flow in float64 on the same stream.

``setup_ms``: ``Token2wav.set_stream_cache`` of the prompt the warm stream used (for torch_cfm a
voice-cache copy: ``apply_torch_cfm`` keeps solved prompts). The upstream runs fewer chunks
(``--upstream-chunks``: it is slow). Rows (with provenance and this process's ``run_id``) are
upserted into ``<out>/minicpmo_stream.json``; a markdown table is written next to it.

Usage (GPU, from the repo root; ``.upstream/minicpmo-utils`` present):
    BENCH_COMMIT=<hash> python3 bench/minicpmo_stream.py [--quick] [--out DIR]
Smoke (CPU, < 1 min):  python3 bench/minicpmo_stream.py --device cpu --tiny --quick --out /tmp/x
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, os.path.join(ROOT, "tests"), ROOT]

import torch  # noqa: E402

import _harness as H  # noqa: E402
import upstream_packages as P  # noqa: E402

OP = "minicpmo_stream"
PACKAGE = "minicpmo-utils"
BARS = {"chunk_ms": 15.0}  # issue 40: H200 fp16, one stream through Token2wav.stream, chunk p50


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _pct(values, p: float) -> float:
    xs = sorted(values)
    pos = (len(xs) - 1) * p
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _timing(setup_ms: float, times: list) -> dict:
    med = _pct(times, 0.5)
    return dict(setup_ms=round(setup_ms, 3), chunk_ms_p50=round(med, 3), chunk_ms_median=round(med, 3),
                chunk_ms_p99=round(_pct(times, 0.99), 3), chunk_ms_max=round(max(times), 3),
                max_over_median=round(max(times) / med, 3) if med > 0 else None,
                us_p20=round(_pct(times, 0.2) * 1e3, 1), us_p50=round(med * 1e3, 1),
                us_p80=round(_pct(times, 0.8) * 1e3, 1), chunk_ms_all=[round(t, 2) for t in times])


def run_stream(t2w, chunks, device: str, mels: list = None) -> tuple[float, list]:
    """``set_stream_cache`` then ``stream`` per chunk (the last flagged), timed: (setup ms, [chunk ms]).
    With ``mels`` (a list): the vocoder stage is replaced by a recorder of each chunk's mel."""
    if mels is not None:
        def record(chunk_mel, last_chunk):
            mels.append(chunk_mel.detach().clone())
            return torch.zeros(1, 0)

        t2w._stream_vocode = record
    try:
        _sync(device)
        t0 = time.perf_counter()
        t2w.set_stream_cache("prompt.wav")
        _sync(device)
        setup_ms = (time.perf_counter() - t0) * 1e3
        times = []
        for i, tok in enumerate(chunks):
            t0 = time.perf_counter()
            t2w.stream(tok[0].tolist(), "prompt.wav", last_chunk=i == len(chunks) - 1, return_waveform=True)
            _sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
    finally:
        if mels is not None:
            vars(t2w).pop("_stream_vocode", None)
    return setup_ms, times


def vocoder_ms(t2w, chunks, device: str) -> list:
    """ms of each chunk's ``Token2wav._stream_vocode`` (synchronised around it; a separate pass)."""
    inner, times = t2w._stream_vocode, []

    def timed(chunk_mel, last_chunk):
        _sync(device)
        t0 = time.perf_counter()
        out = inner(chunk_mel, last_chunk)
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        return out

    t2w._stream_vocode = timed
    try:
        run_stream(t2w, chunks, device)
    finally:
        vars(t2w).pop("_stream_vocode", None)
    return times


@dataclasses.dataclass
class Setup:
    mods: object
    flow: torch.nn.Module      # fp32 on the CPU, the weights every provider copies
    hift: torch.nn.Module
    prompt: object             # upstream_flow.Prompt, float64 on the CPU
    chunks: list
    device: str
    dtype: torch.dtype

    def token2wav(self, flow_dtype: torch.dtype):
        """A Token2wav of copies of the modules: the flow in ``flow_dtype`` (float16: ``float16=True``),
        the prompt mel and speaker embedding float32 as ``Token2wav._prepare_prompt`` makes them
        (float64 for the float64 reference)."""
        import upstream_flow as U

        dt = torch.float64 if flow_dtype == torch.float64 else torch.float32
        prompt = U.Prompt(self.prompt.tokens, self.prompt.mel.to(dt), self.prompt.spk.to(dt))
        return P.make_minicpmo_token2wav(self.mods, copy.deepcopy(self.flow).to(flow_dtype), prompt,
                                         hift=copy.deepcopy(self.hift), n_timesteps=10,
                                         float16=flow_dtype == torch.float16, device=self.device)


def _graph_counts(t2w) -> dict:
    """Graphs captured so far per graph cache: the CFM decoder's, the encoder's, the vocoder's."""
    from torch_cfm.integrations.minicpmo import accelerated_minicpmo
    from torch_cfm.integrations.stepaudio2 import accelerated

    acc, mini = accelerated(t2w), accelerated_minicpmo(t2w)
    if acc is None:
        return {}
    return dict(decoder=acc.graph_count(), encoder=acc.encoder_call.graph_count if acc.encoder_call is not None else 0,
                vocoder=mini.vocoder.graph_count if mini is not None else 0)


def _captures(t2w) -> int:
    return sum(_graph_counts(t2w).values())


def measure(setup: Setup, t2w, provider: str, chunks: list, ref_mels: list, fields: dict) -> list:
    """The provider's mel and waveform rows over ``chunks`` (after one warm stream)."""
    device = setup.device
    warm = chunks[:3] + chunks[-1:]
    run_stream(t2w, warm, device)
    run_stream(t2w, warm, device, mels=[])
    before, counts = _captures(t2w), _graph_counts(t2w)
    mels: list = []
    setup_ms, times = run_stream(t2w, chunks, device, mels=mels)
    rel = max(H.rel_err(m, r) for m, r in zip(mels, ref_mels))
    rows = [H.make_row(fields["env"], **fields["row"], provider=provider, variant="mel",
                       **_timing(setup_ms, times), mel_rel_err=rel, rel_err=rel)]
    setup_ms, times = run_stream(t2w, chunks, device)
    voc = vocoder_ms(t2w, chunks, device)
    extra = {}
    if provider == "torch_cfm":
        extra = dict(captures_during_timing=_captures(t2w) - before, graphs=_captures(t2w),
                     captures_by_cache={k: v - counts.get(k, 0) for k, v in _graph_counts(t2w).items()})
    rows.append(H.make_row(fields["env"], **fields["row"], provider=provider, variant="waveform",
                           **_timing(setup_ms, times), vocoder_ms_p50=round(_pct(voc, 0.5), 3), **extra))
    if extra:
        rows[0].update(extra)
    return rows


def build(args) -> Setup:
    import upstream_flow as U

    mods = P.load_minicpmo_token2wav()
    size = U.TINY if args.tiny else U.SHIPPED
    prompt_tokens = min(args.prompt_tokens, 40) if args.tiny else args.prompt_tokens
    # the upstream scratch buffers hold 1000 frames; a stream uses prompt + 100 + its chunk
    size = dataclasses.replace(size, buffer_frames=2 * prompt_tokens + 100 + 64)
    flow = U.build_flow(size, seed=0)
    widths = P.TINY_CAUSAL if args.tiny else P.SHIPPED_CAUSAL
    # the shipped 300 s noise table (259 MB) at the shipped sizes; 20 s for the smoke run
    hift = P.build_causal_hift(mods, seed=0, table_samples=20 * 24000 if args.tiny else None, **widths)
    prompt = U.make_prompt(size, prompt_tokens, seed=1, dtype=torch.float64)
    n_chunks = args.chunks if not args.quick else (6 if args.tiny else 10)
    chunks = U.make_chunks(size, n_chunks, seed=2, last_tokens=28)  # the last: 56 frames
    dtype = torch.float16 if args.device == "cuda" else torch.float32
    return Setup(mods, flow, hift, prompt, chunks, args.device, dtype)


def _markdown(rows: list, shape: dict, command: str) -> str:
    def cell(r, key, fmt="{:.1f}"):
        v = r.get(key)
        return "err" if r.get("error") else ("" if v is None else fmt.format(v))

    lines = ["| provider | variant | timing | chunks | setup ms | chunk p50 ms | p99 ms | max ms | vocoder p50 ms | "
             "mel rel err vs fp64 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['provider']} | {r['variant']} | {r['timing']} | {len(r.get('chunk_ms_all') or [])} | "
                     f"{cell(r, 'setup_ms')} | {cell(r, 'chunk_ms_p50')} | {cell(r, 'chunk_ms_p99')} | "
                     f"{cell(r, 'chunk_ms_max')} | {cell(r, 'vocoder_ms_p50')} | {cell(r, 'mel_rel_err', '{:.2e}')} |")
    lines += [f"\n{r['provider']} {r['variant']}: {r['error']}" for r in rows if r.get("error")]
    got = {(r["provider"], r["variant"]): r for r in rows if not r.get("error")}
    checks = []
    wave, up_wave = got.get(("torch_cfm", "waveform")), got.get(("upstream", "waveform"))
    if wave is not None:
        checks.append(f"tokens -> waveform chunk p50 {wave['chunk_ms_p50']:.1f} ms <= {BARS['chunk_ms']} ms: "
                      f"{wave['chunk_ms_p50'] <= BARS['chunk_ms']}"
                      + (f" (upstream {up_wave['chunk_ms_p50']:.1f} ms)" if up_wave else ""))
        checks.append(f"captures during the timed streams: {wave.get('captures_during_timing')} "
                      f"{wave.get('captures_by_cache') or ''}")
    mel, up_mel = got.get(("torch_cfm", "mel")), got.get(("upstream", "mel"))
    if mel is not None and up_mel is not None:
        ok = mel["mel_rel_err"] <= 2 * up_mel["mel_rel_err"] + 1e-6
        checks.append(f"mel error vs fp64 {mel['mel_rel_err']:.2e} <= 2 x upstream {up_mel['mel_rel_err']:.2e} "
                      f"+ 1e-6: {ok}")
    return (f"# {OP}: {shape}\n\n" + "\n".join(lines) + "\n\nBars (issue 40, H200 fp16):\n"
            + "\n".join(f"- {c}" for c in checks) + "\n" + H.provenance_footer(rows, command))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 chunks (tiny: 6), the upstream 4")
    ap.add_argument("--chunks", type=int, default=30, help="torch_cfm's chunks after the prompt (the last flagged)")
    ap.add_argument("--upstream-chunks", type=int, default=10, help="the upstream's chunks (the first ones, "
                    "then the last)")
    ap.add_argument("--prompt-tokens", type=int, default=150, help="prompt tokens (x2 = mel frames; 150 = 6 s)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="small modules (CPU smoke test)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="directory of the results files")
    args = ap.parse_args(argv)
    if args.chunks < 4 or args.upstream_chunks < 4:
        ap.error("--chunks and --upstream-chunks must be >= 4 (a stream's trims start at its third chunk)")
    reason = P.missing_reason(PACKAGE)
    if reason is not None:
        print(f"{OP}: {reason}", file=sys.stderr)
        return 2
    P.reexec_isolated(PACKAGE, __file__, argv, OP)
    from torch_cfm.integrations.stepaudio2 import apply_torch_cfm, warmup

    setup = build(args)
    bad = P.check_isolated(PACKAGE)
    if bad:
        raise SystemExit(f"{OP}: stepaudio2 is not minicpmo-utils' alone: {bad}")
    device, chunks = setup.device, setup.chunks
    n_up = min(4 if args.quick else args.upstream_chunks, len(chunks))
    up_chunks = chunks[:n_up - 1] + chunks[-1:]
    prompt_frames = setup.prompt.frames
    shape = dict(prompt_frames=prompt_frames, chunk_frames=50, last_frames=56, chunks=len(chunks),
                 upstream_chunks=n_up, batch=1, size="tiny" if args.tiny else "shipped", n_timesteps=10,
                 vocoder="causal")
    dname = {torch.float16: "fp16", torch.float32: "fp32"}[setup.dtype]
    print(f"{OP}: {shape['size']} modules, {dname}, {device}, prompt {prompt_frames} frames, {len(chunks)} chunks "
          f"(upstream {n_up})", flush=True)
    env = H.env_info()
    row = dict(op=OP, shape=shape, dtype=dname, precision=dname if dname != "fp32" else "ieee")

    ref = setup.token2wav(torch.float64)  # the package's flow in float64 on the same streams
    ref_mels, ref_up_mels = [], []
    run_stream(ref, chunks, device, mels=ref_mels)
    run_stream(ref, up_chunks, device, mels=ref_up_mels)
    del ref

    def provider(name: str, timing: str, run) -> list:
        try:
            return run(dict(env=env, row=dict(row, timing=timing)))
        except Exception as exc:  # noqa: BLE001 - a failing provider gets rows with its error
            error = f"{type(exc).__name__}: {exc}"[:300]
            print(f"{name}: {error}", file=sys.stderr, flush=True)
            return [H.make_row(env, **row, provider=name, variant=v, timing=timing, error=error)
                    for v in ("mel", "waveform")]

    rows = provider("upstream", "eager", lambda fields: measure(setup, setup.token2wav(setup.dtype), "upstream",
                                                                up_chunks, ref_up_mels, fields))

    def ours(fields: dict) -> list:
        t2w = setup.token2wav(setup.dtype)
        apply_torch_cfm(t2w)
        t0 = time.perf_counter()
        warm = warmup(t2w, prompt_frames=(prompt_frames,), last_tokens=(28,))
        warmup_s = time.perf_counter() - t0
        print(f"torch_cfm warm-up {warmup_s:.1f} s: {warm}", flush=True)
        out = measure(setup, t2w, "torch_cfm", chunks, ref_mels, fields)
        core = t2w._torch_cfm_minicpmo.vocoder.core  # which decode the causal vocoder ran
        decoder = "upstream" if core.fused is None else "fused"
        for r in out:
            r.update(warmup_s=round(warmup_s, 2), warmup=warm, causal_decoder=decoder)
        return out

    rows += provider("torch_cfm", "cuda_graph" if device == "cuda" else "eager", ours)

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{OP}.json")
    H.upsert_rows(path, rows, table=False)
    command = ("python3 bench/minicpmo_stream.py " + " ".join(argv)).strip()
    text = _markdown(rows, shape, command)
    with open(os.path.join(args.out, f"{OP}.md"), "w") as f:
        f.write(text)
    print(text)
    return 1 if any(r.get("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
