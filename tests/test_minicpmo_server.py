"""``Token2wavServer`` serving minicpmo-utils 1.0.7's ``Token2wav`` (its causal vocoder), and the
``bench/minicpmo_stream.py`` smoke run.

minicpmo-utils installs the same top-level ``stepaudio2`` as stepaudio2-minicpmo, so these tests
run in their own interpreter like ``test_minicpmo_utils.py`` (``tests/upstream_packages.py``):
in the main session this module holds launcher tests (CPU, GPU) that run it again in a child
whose ``stepaudio2`` is ``.upstream/minicpmo-utils/stepaudio2``. To run the child directly:
``UPSTREAM_PACKAGE=minicpmo-utils STEPAUDIO2_PATH=.upstream/minicpmo-utils python3 -m pytest
tests/test_minicpmo_server.py``.

In the child, ``Token2wavServer(token2wav)`` takes the Token2wav's flow and ``bounded_vocoder``.
Several streams (prompts of different lengths, opened on different ticks, last chunks of several
lengths, one ended by the empty final call ``Token2wav.stream`` makes without tokens) are served
together, fp32, small sizes, and each is compared with that stream alone through the package's
own ``Token2wav.set_stream_cache`` / ``Token2wav.stream`` (its ``_trim_estimator_cache`` and
``_trim_conformer_cache`` included):

* mel within 1e-5 relative (docs/design.md §6), and the caches after the trims likewise;
* waveform against the package's own streaming vocoder stage (``Token2wav._stream_vocode``:
  ``BoundedVocoder.stream`` plus the first chunk's 8-frame silence) fed the server's mels, within
  the vocoder's rounding: the server's error against a float64 run of the same step is at most
  twice the package's + 1e-6 (streams batched together run other convolution shapes). End to end
  the waveforms are not compared sample by sample: a 1e-7 mel difference moves the causal
  vocoder's float64 phase (issue 40's note).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
import torch

import upstream_packages as P
import upstream_flow as U
from oracle import err_rel_fro

NAME = "minicpmo-utils"
CHILD = P.active() == NAME
in_child = P.isolated(NAME)
pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:CUDA is not available:UserWarning")]  # Token2wav's autocast("cuda")

REL = 1e-5  # docs/design.md §6 fp32 bound, relative Frobenius
HOP = 480
SILENCE = 8 * HOP  # Token2wav.stream's first non-final output starts with the causal delay as zeros
N_STEPS = 4
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_child(marker: str) -> None:
    P.run_child_session(NAME, __file__, marker)


def test_minicpmo_server_cpu_tests_in_their_own_interpreter():
    _run_child("not gpu")


@pytest.mark.gpu
def test_minicpmo_server_gpu_tests_in_their_own_interpreter():
    _run_child("gpu")


test_minicpmo_server_cpu_tests_in_their_own_interpreter.__test__ = not CHILD
test_minicpmo_server_gpu_tests_in_their_own_interpreter.__test__ = not CHILD


# ---------------------------------------------------------------------------- fixtures (child only)
@pytest.fixture(scope="module")
def mods():
    reason = P.missing_reason(NAME)
    if reason is not None:
        pytest.skip(reason)
    return P.load_minicpmo_token2wav()


@pytest.fixture(scope="module")
def flow(mods):
    return U.build_flow(U.TINY, seed=0)


@pytest.fixture(scope="module")
def hift(mods):
    return P.build_causal_hift(mods, seed=0, table_samples=20 * 24000)  # longer than these streams


@dataclass
class Plan:
    """One stream: prompt tokens, the tick it opens on, its chunks' token counts (the last one
    flagged last; 0 = the empty final call)."""

    prompt_tokens: int
    opens: int
    chunks: list
    seed: int


# Prompts of 44, 32, 60 and 44 frames: the caches pass prompt + 100 frames at the third chunk, so every
# stream's trims run ("a" and "d" then share encoder batches); "b" ends with a 2-token chunk, "d"
# with the empty final call.
PLANS = {"a": Plan(22, 0, [28] * 5 + [9], seed=1), "b": Plan(16, 0, [28] * 6 + [2], seed=2),
         "c": Plan(30, 1, [28] * 4 + [13], seed=3), "d": Plan(22, 2, [28] * 4 + [0], seed=4)}


def _prompt(plan: Plan) -> U.Prompt:
    return U.make_prompt(U.TINY, plan.prompt_tokens, seed=100 + plan.seed)


def _chunks(plan: Plan) -> list:
    gen = torch.Generator().manual_seed(200 + plan.seed)
    return [torch.randint(0, U.TINY.vocab, (1, n), generator=gen, dtype=torch.int32) for n in plan.chunks]


def _setup_tokens(prompt: U.Prompt) -> torch.Tensor:
    """The prompt tokens ``Token2wav.set_stream_cache`` gives ``flow.setup_cache``: the prompt's
    tokens (without ``make_prompt``'s lookahead) and their first 3 again as the lookahead."""
    tokens = prompt.tokens[:, :-3]
    return torch.cat([tokens, tokens[:, :3]], dim=1)


def _token2wav(mods, flow, hift, prompt, device="cpu"):
    return P.make_minicpmo_token2wav(mods, flow, prompt, hift=copy.deepcopy(hift), n_timesteps=N_STEPS,
                                     device=device)


@dataclass
class Upstream:
    mels: list = field(default_factory=list)   # (1, 80, T) per chunk, as the flow returned them
    wavs: list = field(default_factory=list)   # Token2wav.stream's (1, samples)
    cache: dict = field(default_factory=dict)  # stream_cache after the last chunk


def _upstream_stream(mods, flow, hift, plan: Plan, device="cpu") -> Upstream:
    """The stream alone through the package's ``Token2wav.set_stream_cache`` / ``stream``."""
    t2w = _token2wav(mods, copy.deepcopy(flow), hift, _prompt(plan), device)
    out = Upstream()
    chunk = t2w.flow.inference_chunk

    def recording(*args, **kwargs):
        mel, cache = chunk(*args, **kwargs)
        out.mels.append(mel.detach().clone())
        return mel, cache

    t2w.flow.inference_chunk = recording
    t2w.set_stream_cache("prompt.wav")
    for i, tok in enumerate(_chunks(plan)):
        wav = t2w.stream(tok[0].tolist(), "prompt.wav", last_chunk=i == len(plan.chunks) - 1, return_waveform=True)
        out.wavs.append(torch.from_numpy(wav))
    out.cache = dict(t2w.stream_cache)
    return out


def _vocode_with_the_package(mods, flow, hift, plan: Plan, mels: list, device="cpu") -> list:
    """``Token2wav._stream_vocode`` (``BoundedVocoder.stream`` and the first-chunk silence) of a
    fresh Token2wav fed ``mels``, each (1, 80, T)."""
    t2w = _token2wav(mods, copy.deepcopy(flow), hift, _prompt(plan), device)
    t2w.set_stream_cache("prompt.wav")
    with torch.inference_mode():
        return [t2w._stream_vocode(mel, i == len(mels) - 1).clone() for i, mel in enumerate(mels)]


def _vocode_fp64(mods, hift, mels: list, device="cpu") -> list:
    """The same causal step in float64 (the rounding reference), the first non-empty non-final
    output behind the 8-frame silence as ``_stream_vocode`` puts it."""
    from torch_cfm.models.vocoder.causal import CausalVocoderCore, stream_batch

    core = CausalVocoderCore(mods.BoundedVocoder(copy.deepcopy(hift).double().to(device)), dtype=torch.float64)
    state, outs, first = core.new_state(), [], True
    for i, mel in enumerate(mels):
        last = i == len(mels) - 1
        wav = stream_batch(core, [state], [mel.double()], [last])[0]
        if wav.shape[1] and first:
            first = False
            if not last:
                wav = torch.cat([wav.new_zeros(1, SILENCE), wav], dim=1)
        outs.append(wav)
    return outs


@dataclass
class Served:
    mels: dict
    wavs: dict
    caches: dict
    server: object


def _serve(mods, flow, hift, plans: dict, device="cpu", batches=None, **options) -> Served:
    """Every stream of ``plans`` through one ``Token2wavServer(token2wav)``: opened on its tick
    (streams of one tick together), a chunk every tick until its last; caches read before close.
    ``batches``: a list given the row count of every causal vocoder step run."""
    from torch_cfm.serving import StreamPrompt, Token2wavServer

    t2w = _token2wav(mods, copy.deepcopy(flow), hift, _prompt(next(iter(plans.values()))), device)
    server = Token2wavServer(t2w, max_streams=len(plans), max_prompt_frames=64, n_timesteps=N_STEPS, **options)
    if batches is not None:
        core = server.vocoder.core
        run = core.run

        def counted(plan, mel, *args):
            batches.append(mel.shape[0])
            return run(plan, mel, *args)

        core.run = counted  # the eager step (CPU: no graphs)
    prompts = {sid: _prompt(p) for sid, p in plans.items()}
    chunks = {sid: _chunks(p) for sid, p in plans.items()}
    mels, wavs, caches = ({sid: [] for sid in plans} for _ in range(3))
    tick = 0
    while any(len(mels[sid]) < len(p.chunks) for sid, p in plans.items()):
        opening = {sid: StreamPrompt(_setup_tokens(prompts[sid]), prompts[sid].mel, prompts[sid].spk)
                   for sid, p in plans.items() if p.opens == tick}
        if opening:
            server.open_many(opening)
        step = {}
        for sid in server.open_streams:
            k = len(mels[sid])
            step[sid] = (chunks[sid][k].to(device), k == len(plans[sid].chunks) - 1)
        for sid, out in server.step(step).items():
            assert out.last == step[sid][1] and out.wav is not None
            mels[sid].append(out.mel)
            wavs[sid].append(out.wav)
        for sid in list(server.open_streams):
            if len(mels[sid]) == len(plans[sid].chunks):
                caches[sid] = server.stream_caches(sid)
                server.close_stream(sid)
        tick += 1
    return Served(mels, wavs, caches, server)


def _check_mels(sid, got: list, up: Upstream, plan: Plan) -> None:
    expected = [m[0] for m in up.mels] + ([torch.zeros(80, 0)] if plan.chunks[-1] == 0 else [])
    assert len(got) == len(expected), f"{sid}: {len(got)} chunks, upstream {len(expected)}"
    for i, (a, b) in enumerate(zip(got, expected)):
        assert a.shape == b.shape, f"{sid} chunk {i}: mel {tuple(a.shape)} != {tuple(b.shape)}"
        err = err_rel_fro(a.cpu(), b.cpu())
        assert err <= REL, f"{sid} chunk {i}: mel rel err {err:.2e} > {REL}"


def _check_caches(sid, got: dict, up: Upstream, prompt_frames: int) -> None:
    for key, dim in (("conformer_att_cache", 3), ("conformer_cnn_cache", None), ("estimator_att_cache", 4),
                     ("estimator_cnn_cache", None)):
        ref = up.cache[key][:N_STEPS] if key.startswith("estimator") else up.cache[key]  # upstream: 16 steps kept
        if dim is not None:
            assert ref.shape[dim] == prompt_frames + 100, f"{sid} {key}: the upstream trim did not run"
        assert got[key].shape == ref.shape, f"{sid} {key}: {tuple(got[key].shape)} != {tuple(ref.shape)}"
        err = err_rel_fro(got[key].cpu(), ref.cpu())
        assert err <= REL, f"{sid} {key}: rel err {err:.2e} > {REL}"


def _check_waveforms(sid, got: list, same_mel: list, fp64: list) -> None:
    assert len(got) == len(same_mel)
    for i, (a, b, r) in enumerate(zip(got, same_mel, fp64)):
        b, r = b[0].cpu(), r[0].cpu()
        assert a.dim() == 1 and a.dtype == torch.float32 and a.shape == b.shape, f"{sid} chunk {i}"
        bound = 2 * err_rel_fro(b, r) + 1e-6
        err = err_rel_fro(a.cpu(), r)
        assert err <= bound, f"{sid} chunk {i}: waveform rel err vs fp64 {err:.2e} > {bound:.2e}"


def _check_stream(mods, flow, hift, sid, plan: Plan, served: Served, device="cpu") -> None:
    up = _upstream_stream(mods, flow, hift, plan, device)
    _check_mels(sid, served.mels[sid], up, plan)
    _check_caches(sid, served.caches[sid], up, _prompt(plan).frames)
    mels = [m[None].float() for m in served.mels[sid]]
    same_mel = _vocode_with_the_package(mods, flow, hift, plan, mels, device)
    _check_waveforms(sid, served.wavs[sid], same_mel, _vocode_fp64(mods, hift, mels, device))
    wavs = served.wavs[sid]
    # the causal delay: 8 frames of silence first, every frame emitted by the end
    assert torch.equal(wavs[0][:SILENCE].cpu(), torch.zeros(SILENCE)) and wavs[0][SILENCE:].abs().max() > 0
    assert sum(w.numel() for w in wavs) == (sum(m.shape[-1] for m in mels) + 8) * HOP
    assert [w.numel() for w in wavs] == [w.shape[1] for w in up.wavs]


# ---------------------------------------------------------------------------- CPU
BATCHES: list = []  # row counts of the served fixture's vocoder steps


@pytest.fixture(scope="module")
def served(mods, flow, hift):
    return _serve(mods, flow, hift, PLANS, batches=BATCHES, batch_buckets=(1, 2, 4))


@in_child
@pytest.mark.parametrize("sid", sorted(PLANS))
def test_served_stream_matches_token2wav_stream(mods, flow, hift, served, sid):
    """Each of four streams served together (padded batches of 1, 2, 4 rows) vs that stream
    alone through the package's ``Token2wav.stream``: mel and trimmed caches within 1e-5, the
    waveform the package's vocoder on the same mels within its rounding, silence first."""
    _check_stream(mods, flow, hift, sid, PLANS[sid], served)


@in_child
def test_the_server_took_the_causal_vocoder_and_batched_it(served):
    """``Token2wavServer(token2wav)`` chose the Token2wav's ``bounded_vocoder`` (not its ``hift``),
    ran streams at the same chunk plan as one padded batch, and freed every state at close."""
    from torch_cfm.serving.vocoder_stages import CausalVocoderStage

    server = served.server
    assert server.causal and isinstance(server.vocoder, CausalVocoderStage)
    assert server.vocoder.core.bounded is server.hift and server.hift.model.conv_pre_look_right == 4
    # streams at the same chunk plan shared a step, padded to the buckets
    assert set(BATCHES) <= {1, 2, 4} and max(BATCHES) == 4 and sum(BATCHES) > len(BATCHES)
    assert server.open_streams == [] and server.vocoder.state_bytes() == 0


@in_child
def test_a_lone_stream_is_the_packages_vocoder(mods, flow, hift):
    """One stream alone in the server (nothing batched or padded): the waveform is the package's
    ``_stream_vocode`` on the same mels within 2e-6 (one decoder pass per chunk where the package
    runs one per 16-frame block: rounding apart, ~7e-7), and its mel is the upstream's within 1e-5."""
    plan = Plan(18, 0, [28] * 5 + [5], seed=9)
    served = _serve(mods, flow, hift, {"x": plan})
    up = _upstream_stream(mods, flow, hift, plan)
    _check_mels("x", served.mels["x"], up, plan)
    mels = [m[None] for m in served.mels["x"]]
    for i, (a, b) in enumerate(zip(served.wavs["x"], _vocode_with_the_package(mods, flow, hift, plan, mels))):
        assert a.shape == b[0].shape and err_rel_fro(a, b[0]) <= 2e-6, f"chunk {i}: {err_rel_fro(a, b[0]):.2e}"


def test_bench_smoke(tmp_path):
    """``bench/minicpmo_stream.py --device cpu --tiny --quick`` (it isolates minicpmo-utils itself):
    rows for both providers and both variants, with provenance, the mel within 2x the upstream's
    error against the float64 flow + 1e-6, nothing captured while timed. Dynamo is off
    (``TORCHDYNAMO_DISABLE``: the package's ``torch.compile(backend="eager")`` encoder then runs
    its own eager code, the same ops) to keep this under 30 s."""
    reason = P.missing_reason(NAME)
    if reason is not None:
        pytest.skip(reason)
    env = dict(os.environ, BENCH_COMMIT="test", OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")
    for key in (P.ACTIVE_ENV, "STEPAUDIO2_PATH"):
        env.pop(key, None)
    res = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "minicpmo_stream.py"), "--device", "cpu",
                          "--tiny", "--quick", "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=300, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = json.loads((tmp_path / "minicpmo_stream.json").read_text())
    got = {(r["provider"], r["variant"]): r for r in rows}
    assert set(got) == {(p, v) for p in ("upstream", "torch_cfm") for v in ("mel", "waveform")}, sorted(got)
    for r in rows:
        assert r["error"] is None and r["commit"] == "test" and r["run_id"] == rows[0]["run_id"]
        assert r["shape"]["size"] == "tiny" and r["shape"]["prompt_frames"] == 80
        assert 0 < r["chunk_ms_p50"] <= r["chunk_ms_p99"] <= r["chunk_ms_max"] and r["setup_ms"] > 0
        assert len(r["chunk_ms_all"]) == (6 if r["provider"] == "torch_cfm" else 4)
    ours, up = got[("torch_cfm", "mel")], got[("upstream", "mel")]
    assert 0 < ours["mel_rel_err"] <= 2 * up["mel_rel_err"] + 1e-6
    assert got[("torch_cfm", "waveform")]["captures_during_timing"] == 0
    assert got[("upstream", "waveform")]["vocoder_ms_p50"] > 0
    assert "| torch_cfm | waveform |" in (tmp_path / "minicpmo_stream.md").read_text()


test_bench_smoke.__test__ = not CHILD


# ---------------------------------------------------------------------------- GPU
@in_child
@pytest.mark.gpu
def test_gpu_served_streams_match_token2wav_stream(mods, flow, hift):
    """The CPU test's four streams on CUDA, fp32 with TF32 off, every stage replayed from CUDA
    graphs (buckets 1, 2, 4): each stream vs the package's ``Token2wav.stream`` on CUDA."""
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        hift = copy.deepcopy(hift).cuda()
        served = _serve(mods, flow, hift, PLANS, device="cuda", batch_buckets=(1, 2, 4), stage_graphs=True)
        call = served.server.vocoder.call
        assert call.graph_count >= 2 and sum(e.replays for e in call.cache.entries()) > 0, call.events
        for sid, plan in PLANS.items():
            _check_stream(mods, flow, hift, sid, plan, served, device="cuda")
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


@in_child
@pytest.mark.gpu
def test_gpu_served_causal_stage_decodes_on_the_fused_convolutions_at_tf32(mods, flow):
    """The server's causal vocoder stage takes the core's default decoder: the fused convolutions at
    PyTorch's default precision (cuDNN TF32), the model's decode with TF32 off (the stream tests
    above; the fused decode's accuracy: test_minicpmo_utils's TF32 tests)."""
    from torch_cfm.serving import Token2wavServer

    hift = P.build_causal_hift(mods, seed=0, table_samples=20 * 24000, **P.SHIPPED_CAUSAL).cuda()
    for tf32 in (True, False):
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=tf32):
            t2w = _token2wav(mods, copy.deepcopy(flow), hift, _prompt(next(iter(PLANS.values()))), "cuda")
            server = Token2wavServer(t2w, max_streams=2, max_prompt_frames=64, n_timesteps=N_STEPS)
            assert (server.vocoder.core.fused is not None) == tf32
