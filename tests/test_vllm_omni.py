"""torch_cfm.integrations.vllm_omni against the real vLLM-Omni wheel (vllm-omni 0.30.0, --no-deps).

vLLM is not installed: ``tests/vllm_omni_reference.vllm_stub`` stands in for ``vllm.logger`` and
``vllm.platforms`` (the two names the backend module imports) for this module's tests and removes
itself after. The backend is vLLM-Omni's own ``BatchedToken2Wav`` over the real upstream flow
modules (``tests/upstream_flow.py``, tiny, fp32, CPU) and vLLM-Omni's own ``HiFTGenerator``.

Per stream, through ``setup_batch`` / ``decode_batch`` / ``decode_ragged_batch`` of the patched
backend with streams of three prompts (two lengths) in every call: the mel equals the upstream
``stepaudio2`` decode (``flow.setup_cache`` / ``inference_chunk`` with ``Token2wav.stream``'s trims)
within 1e-5 relative (docs/design.md §6, fp32), the waveform equals ``Token2wav.stream``'s vocoder
stage and vLLM-Omni's own path (the same backend unpatched: on CPU it has no CFM graphs, hence no
bucketing) within the vocoder's rounding (1e-5 relative); lengths are exact. Also: the state
lifecycle (stale, finished, dropped and released states), per-request fallback for long prompts
in mixed calls, long chunks, configuration fallbacks, bitwise undo, the plugin's entry point
loaded twice, and a disabled plugin changing nothing.
"""

from __future__ import annotations

import ast
import gc
import importlib
import logging
import os
import re
import sys
import types

import pytest
import torch

import token2wav_reference as R
import upstream_flow as U
import vllm_omni_reference as V
from oracle import err_rel_fro

pytestmark = [pytest.mark.skipif(V.missing_reason() is not None, reason=str(V.missing_reason())),
              pytest.mark.usefixtures("one_thread")]

from torch_cfm.integrations import vllm_omni as VO  # noqa: E402
from torch_cfm.integrations.vllm_omni import apply as VA  # noqa: E402
from torch_cfm.integrations.vllm_omni import backend as VB  # noqa: E402
from torch_cfm.integrations.vllm_omni import options as VOPT  # noqa: E402
from torch_cfm.integrations.vllm_omni import plugin as VP  # noqa: E402

REL = 1e-5
N_STEPS = 4
SEED = 1234
# the HiFT module itself per stream (its upstream random draws): waveforms equal the upstream's exactly
OPTS = dict(max_streams=4, max_prompt_frames=80, vocoder_seed=SEED, progress=False, vocoder="upstream")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bt():
    with V.vllm_stub():
        yield V.load_backend_module()


@pytest.fixture(scope="module")
def flow():
    return U.build_flow(U.TINY, seed=0)


@pytest.fixture(scope="module")
def hift(bt):
    return V.build_hift(seed=3)


def _backend(bt, flow, hift):
    """vLLM-Omni's own backend over the shared modules, built as its Code2Wav stage builds it on CPU."""
    return bt.BatchedToken2Wav(V.make_token2wav(flow, hift, N_STEPS))


def _close(a, b, what, rel=REL):
    assert a.shape == b.shape, f"{what}: {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    err = err_rel_fro(a, b)
    assert err <= rel, f"{what}: rel err {err:.2e} > {rel}"


def _record_mels(adapter) -> dict:
    """Spy on the server's steps: {stream: [chunk mel (80, T)]}."""
    mels: dict = {}
    step = adapter.server.step

    def recording(chunks):
        out = step(chunks)
        for sid, res in out.items():
            mels.setdefault(sid, []).append(res.mel.clone())
        return out

    adapter.server.step = recording
    return mels


def _own_path(bt, flow, hift, feats, chunks):
    """One request alone through vLLM-Omni's own, unpatched backend (seeded like Token2wav.stream):
    ([audio per chunk], [chunk mel (80, T)])."""
    backend = _backend(bt, flow, hift)
    mels = []
    decode_cfm = backend._decode_cfm

    def recording(*args, **kwargs):
        out = decode_cfm(*args, **kwargs)
        mels.append(out[0][0].clone())
        return out

    backend._decode_cfm = recording
    torch.manual_seed(SEED)
    with torch.inference_mode():
        states = backend.setup_batch(feats, 1)
        audios = []
        for k, tok in enumerate(chunks):
            got, states = backend.decode_batch(tok.long(), feats, states, last_chunk=k == len(chunks) - 1)
            audios.append(got[0])
    return audios, mels[1:]  # mels[0]: the prompt solve


@pytest.mark.parametrize("vocoder", ["upstream", "auto"])
def test_mixed_prompts_match_upstream_and_own_path(bt, flow, hift, vocoder):
    """Three requests, three prompts (20, 20 and 13 tokens), in the same calls: four decode_batch
    chunks, then a decode_ragged_batch of last chunks of 7, 9 and 11 tokens. "auto": the default
    vocoder (torch_cfm's, a random stream per stream), compared with every source's noise off."""
    import contextlib

    backend = _backend(bt, flow, hift)
    adapter = VO.apply_torch_cfm_to_vllm_omni(backend, **dict(OPTS, vocoder=vocoder))
    quiet = contextlib.nullcontext
    if vocoder == "auto":
        R.quiet_vocoder(adapter.server)
        quiet = R.NoNoise
    assert adapter is not None and VO.accelerated_backend(backend) is adapter
    mels = _record_mels(adapter)
    prompts = [U.make_prompt(U.TINY, p, seed=10 + i) for i, p in enumerate((20, 20, 13))]
    feats = [V.features(bt, p, f"voice{i}") for i, p in enumerate(prompts)]
    chunks = [U.make_chunks(U.TINY, 5, seed=20 + i, last_tokens=(7, 9, 11)[i]) for i in range(3)]
    audios = [[] for _ in range(3)]
    with torch.inference_mode():
        states = [s for f in feats for s in backend.setup_batch(f, 1)]
        assert [s.version for s in states] == [0, 0, 0]
        assert {bt.state_shape_signature(s) for s in states} == {((), ())}  # one bucket whatever the position
        for k in range(4):
            got, states = backend.decode_batch(torch.cat([c[k] for c in chunks]).long(), feats[0], states,
                                               last_chunk=False)
            for i in range(3):
                audios[i].append(got[i])
        got, states = backend.decode_ragged_batch([c[4][0].long() for c in chunks], feats[0], states,
                                                  last_chunks=[True] * 3)
    for i in range(3):
        audios[i].append(got[i])
    assert adapter.open_streams == 0 and adapter.stats["closed"] == 3  # the last chunks closed them
    for i in range(3):
        sid = states[i].stream
        with quiet():
            up_mels, up_wavs, _ = R.upstream_stream(flow, V.padded_prompt(prompts[i]), chunks[i], N_STEPS,
                                                    hift=V.HiftInference(hift), seed=SEED)
            own_audio, own_mels = _own_path(bt, flow, hift, feats[i], chunks[i])
        assert len(mels[sid]) == len(up_mels) == len(own_mels) == 5
        for k in range(5):
            _close(mels[sid][k], up_mels[k], f"stream {i} chunk {k} mel vs upstream")
            _close(own_mels[k], up_mels[k], f"stream {i} chunk {k} vLLM-Omni's own mel vs upstream")
            assert audios[i][k].dtype == torch.float32 and audios[i][k].dim() == 1
            _close(audios[i][k], up_wavs[k], f"stream {i} chunk {k} audio vs upstream")
            _close(audios[i][k], own_audio[k], f"stream {i} chunk {k} audio vs vLLM-Omni's own path")


def test_state_lifecycle(bt, flow, hift):
    """Stale, finished, foreign and released states raise; dropping a request's newest state
    closes its stream at the next call; a chunk refused by the server leaves the state usable."""
    backend = _backend(bt, flow, hift)
    adapter = VO.apply_torch_cfm_to_vllm_omni(backend, **OPTS)
    feats = V.features(bt, U.make_prompt(U.TINY, 12, seed=5), "v")
    chunk = U.make_chunks(U.TINY, 2, seed=6)[0].long()
    with torch.inference_mode():
        first = backend.setup_batch(feats, 2)
        assert adapter.open_streams == 2 and backend.setup_batch(feats, 0) == []
        _, second = backend.decode_batch(torch.cat([chunk, chunk]), feats, first, last_chunk=False)
        with pytest.raises(ValueError, match=r"states\[0\] must be the state the request's last decode returned"):
            backend.decode_batch(chunk, feats, first[:1], last_chunk=False)
        with pytest.raises(ValueError, match="name each request once"):
            backend.decode_batch(torch.cat([chunk, chunk]), feats, [second[0], second[0]], last_chunk=False)
        with pytest.raises(ValueError, match=r"tokens .*must have"):  # 2 tokens: below the lookahead window
            backend.decode_batch(chunk[:, :2], feats, second[:1], last_chunk=False)
        _, third = backend.decode_batch(chunk, feats, second[:1], last_chunk=False)  # still usable
        with pytest.raises(ValueError, match="flush_encoder"):
            backend.decode_batch(chunk, feats, third, last_chunk=False, flush_encoder=True)
        assert adapter.open_streams == 2
        del first, second  # the request of row 1 drops its newest state: closed at the next call
        gc.collect()
        assert adapter.open_streams == 1 and adapter.stats["closed"] == 1
        _, done = backend.decode_batch(chunk[:, :9], feats, third, last_chunk=True)
        assert adapter.open_streams == 0
        with pytest.raises(ValueError, match="a finished or released request's state"):
            backend.decode_batch(chunk, feats, done, last_chunk=False)
        fresh = backend.setup_batch(feats, 2)
        assert adapter.release(fresh[:1]) == 1 and adapter.open_streams == 1
        with pytest.raises(ValueError, match="finished or released"):
            backend.decode_batch(chunk, feats, fresh[:1], last_chunk=False)
        other = VO.apply_torch_cfm_to_vllm_omni(_backend(bt, flow, hift), **OPTS)
        with pytest.raises(ValueError, match="another"):
            other.decode_batch(chunk, feats, fresh[1:], last_chunk=False)
        with pytest.raises(RuntimeError, match="max_streams=4"):
            backend.setup_batch(feats, 4)
        assert adapter.release() == 1 and adapter.open_streams == 0


def test_setup_batch_solves_its_prompt_once(bt, flow, hift):
    """``setup_batch(features, 3)``: one encoder row and one prompt solve; every stream's caches
    are bitwise those of a stream set up alone, and its audio equals vLLM-Omni's own path."""
    feats = V.features(bt, U.make_prompt(U.TINY, 16, seed=7), "v")
    chunks = U.make_chunks(U.TINY, 2, seed=8, last_tokens=9)
    alone = VO.apply_torch_cfm_to_vllm_omni(_backend(bt, flow, hift), **OPTS)
    backend = _backend(bt, flow, hift)
    adapter = VO.apply_torch_cfm_to_vllm_omni(backend, **OPTS)
    solves, solve, encoder = [], adapter.server.cfm_server.solve_chunk, adapter.server.encoder
    adapter.server.cfm_server.solve_chunk = lambda chunks, **kw: solves.append(len(chunks)) or solve(chunks, **kw)
    encoded = []

    class Encoder:  # the server's encoder stage, counting the rows it is given
        def __getattr__(self, name):
            return getattr(encoder, name)

        def __call__(self, items):
            encoded.append(len(items))
            return encoder(items)

    adapter.server.encoder = Encoder()
    with torch.inference_mode():
        ref_state = alone.setup_batch(feats, 1)[0]
        ref = alone.server.stream_caches(ref_state.stream)
        states = backend.setup_batch(feats, 3)
        assert solves == [1] and encoded == [1]
        adapter.server.encoder = encoder
        for st in states:
            got = adapter.server.stream_caches(st.stream)
            assert all(torch.equal(got[k], ref[k]) for k in ref), st.stream
        audios = [[] for _ in states]
        for k, tok in enumerate(chunks):
            got, states = backend.decode_batch(tok.long().expand(3, -1), feats, states, last_chunk=k == 1)
            for i, audio in enumerate(got):
                audios[i].append(audio)
    own_audio, _ = _own_path(bt, flow, hift, feats, chunks)
    for i in range(3):
        for k in range(2):
            _close(audios[i][k], own_audio[k], f"stream {i} chunk {k} audio vs vLLM-Omni's own path")


def test_long_prompt_falls_back_per_request_and_mixes(bt, flow, hift, caplog):
    """A prompt over max_prompt_frames runs on the original methods; one call mixing its state
    with torch_cfm states gives each row what it gives alone."""
    backend = _backend(bt, flow, hift)
    VO.apply_torch_cfm_to_vllm_omni(backend, **dict(OPTS, max_prompt_frames=30))
    short = V.features(bt, U.make_prompt(U.TINY, 10, seed=7), "short")
    long = V.features(bt, U.make_prompt(U.TINY, 20, seed=8), "long")
    chunks = U.make_chunks(U.TINY, 3, seed=9, last_tokens=6)
    VOPT._LOGGED.discard("prompt:prompt too long")
    with caplog.at_level(logging.WARNING, logger="torch_cfm.integrations.vllm_omni"), torch.inference_mode():
        torch.manual_seed(SEED)  # the original's vocoder draws from the global generator
        states = backend.setup_batch(short, 1) + backend.setup_batch(long, 1)
        assert type(states[1]) is bt.BatchedToken2WavState and states[1].flow_cache
        mixed = []
        for k, tok in enumerate(chunks):
            got, states = backend.decode_batch(torch.cat([tok, tok]).long(), long, states, last_chunk=k == 2)
            mixed.append(got)
    assert sum("prompt too long: 40 mel frames > max_prompt_frames=30" in r.message for r in caplog.records) == 1
    assert backend._torch_cfm.stats["fallback_rows"] == 3 and backend._torch_cfm.stats["fallback_setups"] == 1
    own, _ = _own_path(bt, flow, hift, long, chunks)
    ref_mels, ref_wavs, _ = R.upstream_stream(flow, V.padded_prompt(U.make_prompt(U.TINY, 10, seed=7)), chunks,
                                              N_STEPS, hift=V.HiftInference(hift), seed=SEED)
    for k in range(3):
        _close(mixed[k][0], ref_wavs[k], f"torch_cfm row, chunk {k}")
        assert torch.equal(mixed[k][1], own[k]), f"fallback row, chunk {k}: not the original's result"


def test_long_chunk_is_decoded_as_consecutive_chunks(bt, flow, hift):
    """A 60-token chunk (over max_chunk_tokens=28) equals its three overlapping 22-token pieces
    decoded one after the other."""
    feats = V.features(bt, U.make_prompt(U.TINY, 12, seed=5), "v")
    tokens = U.make_chunks(U.TINY, 2, seed=11, chunk_tokens=57)[0].long()
    pieces = [p for p, _ in VB._pieces(tokens[0], False, 28, 3)]
    assert [len(p) for p in pieces] == [22, 22, 22] and torch.equal(pieces[1][:3], tokens[0, 19:22])
    outs = []
    for split in (False, True):
        backend = _backend(bt, flow, hift)
        VO.apply_torch_cfm_to_vllm_omni(backend, **OPTS)
        with torch.inference_mode():
            states = backend.setup_batch(feats, 1)
            if split:
                audio = []
                for p in pieces:
                    got, states = backend.decode_batch(p[None], feats, states, last_chunk=False)
                    audio.append(got[0])
                outs.append(torch.cat(audio))
            else:
                got, states = backend.decode_batch(tokens, feats, states, last_chunk=False)
                outs.append(got[0])
            assert states[0].version == (3 if split else 1)
    assert torch.equal(outs[0], outs[1])


def test_unsupported_configurations_fall_back(bt, flow, hift, caplog):
    """TensorRT stepper, a non-CUDA/CPU device (meta here, NPU in production) and an unknown layout
    keep vLLM-Omni's own path, each reason logged once; strict raises."""
    VOPT._LOGGED.clear()
    trt = _backend(bt, flow, hift)
    trt._trt_stepper = object()
    with caplog.at_level(logging.WARNING, logger="torch_cfm.integrations.vllm_omni"):
        for _ in range(2):
            assert VO.apply_torch_cfm_to_vllm_omni(trt, **OPTS) is None
    assert sum("TensorRT" in r.message for r in caplog.records) == 1
    assert "decode_batch" not in vars(trt)
    with pytest.raises(NotImplementedError, match="TensorRT"):
        VO.apply_torch_cfm_to_vllm_omni(trt, strict=True, **OPTS)
    meta = _backend(bt, flow, hift)
    meta.flow = U.build_flow(U.TINY, seed=0).to("meta")
    assert "meta device" in VO.unsupported_reason(meta)
    assert VO.apply_torch_cfm_to_vllm_omni(meta, **OPTS) is None
    odd = _backend(bt, flow, hift)
    odd.hift = torch.nn.Linear(2, 2)
    assert VO.apply_torch_cfm_to_vllm_omni(odd, **OPTS) is None
    assert any("unknown layout" in r.message and "HiFTGenerator" in r.message for r in caplog.records)
    with pytest.raises(ValueError, match="max_streams must be a positive int"):
        VO.apply_torch_cfm_to_vllm_omni(_backend(bt, flow, hift), max_streams=0)


def test_warmup_progress_and_memory_report(bt, flow, hift, capsys):
    """The warm-up at apply (forced on CPU: eager) prints a line per stream count and a memory
    line, reports the memory plan in the stage's terms, and refuses to run with requests open."""
    backend = _backend(bt, flow, hift)
    adapter = VO.apply_torch_cfm_to_vllm_omni(backend, **dict(OPTS, max_streams=1, progress=True, warmup=True,
                                                               warmup_last_chunk_tokens=(7,)))
    err = capsys.readouterr().err
    plan_line = ("warm-up: prompts [80] frames, chunks [28] tokens, last chunks 7-7 tokens (1 lengths), "
                 "stream counts [1]")
    assert plan_line in err and "warm-up [1/1] 1 stream(s)" in err and "MiB per request" in err, err
    report = adapter.memory_report()
    plan = adapter.server.memory_plan()
    assert report["bytes_per_request"] == plan.cfm + plan.encoder + plan.vocoder > 0 and report["max_requests"] == 1
    assert report["reserved_bytes"] == report["arena_bytes"] + plan.encoder + plan.vocoder
    feats = V.features(bt, U.make_prompt(U.TINY, 12, seed=5), "v")
    with torch.inference_mode():
        states = backend.setup_batch(feats, 1)
        with pytest.raises(RuntimeError, match="1 requests are open"):
            adapter.warmup()
        backend.decode_batch(U.make_chunks(U.TINY, 2, seed=1)[0].long(), feats, states, last_chunk=False)
    assert adapter.stats["captures_after_warmup"] == 0 and adapter.server.open_streams == [states[0].stream]


def test_vllm_default_dtype_and_autocast_do_not_reach_the_server(bt, flow, hift):
    """Built the plugin's way under a bf16 default dtype (as vLLM builds a model) and driven under
    bf16 autocast (as its runner may wrap forward): the audio is bitwise that of a plain build."""
    feats = V.features(bt, U.make_prompt(U.TINY, 12, seed=5), "v")
    chunks = U.make_chunks(U.TINY, 2, seed=13, last_tokens=8)
    outs = []
    for vllm_like in (False, True):
        backend = bt.BatchedToken2Wav.__new__(bt.BatchedToken2Wav)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16 if vllm_like else torch.float32)
        try:
            VA.construct_patched(bt.BatchedToken2Wav.__init__, backend, V.make_token2wav(flow, hift, N_STEPS), (),
                                 {}, dict(OPTS))
        finally:
            torch.set_default_dtype(previous)
        got = []
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=vllm_like):
            states = backend.setup_batch(feats, 1)
            for k, tok in enumerate(chunks):
                audio, states = backend.decode_batch(tok.long(), feats, states, last_chunk=k == 1)
                got += audio
        outs.append(got)
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_undo_is_bitwise(bt, flow, hift):
    """After undo the backend is vLLM-Omni's again: its own results bitwise, same __dict__ keys,
    same parameters and buffers (the HiFT's window the same tensor)."""
    backend = _backend(bt, flow, hift)
    feats = V.features(bt, U.make_prompt(U.TINY, 12, seed=5), "v")
    chunks = U.make_chunks(U.TINY, 2, seed=13, last_tokens=8)

    def run():
        torch.manual_seed(SEED)
        with torch.inference_mode():
            states, out = backend.setup_batch(feats, 1), []
            for k, tok in enumerate(chunks):
                got, states = backend.decode_batch(tok.long(), feats, states, last_chunk=k == 1)
                out += got
        return out

    before = run()  # first: the HiFT's Snake activations cache a buffer on their first call
    keys = set(vars(backend))
    params = {k: v.clone() for k, v in backend.state_dict().items()}
    window = hift.stft_window
    VO.apply_torch_cfm_to_vllm_omni(backend, **OPTS)
    assert hift.stft_window is window  # the server keeps its own device copy
    for k, (a, b) in enumerate(zip(run(), before)):
        _close(a, b, f"patched vs own, output {k}")
    assert hift.stft_window is window
    assert VO.undo_torch_cfm_from_vllm_omni(backend) and not VO.undo_torch_cfm_from_vllm_omni(backend)
    after = run()
    assert set(vars(backend)) == keys and hift.stft_window is window
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    state = backend.state_dict()
    assert set(state) == set(params) and all(torch.equal(v, params[k]) for k, v in state.items())


@pytest.fixture
def fresh_target(bt, monkeypatch):
    """The backend module imported anew by the test (the plugin's hook patches it on import);
    the plugin is unregistered and the fresh module dropped after."""
    with V.vllm_stub():
        monkeypatch.delitem(sys.modules, V.TARGET, raising=False)
        yield
        VP.unregister()


def _entry_point():
    """The plugin as vLLM loads it: the object pyproject.toml declares in vllm.general_plugins."""
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()
    section = text.split('[project.entry-points."vllm.general_plugins"]', 1)[1].split("\n[", 1)[0]
    module, _, attr = re.search(r'^torch_cfm_vllm_omni\s*=\s*"([^"]+)"', section, re.M).group(1).partition(":")
    return getattr(importlib.import_module(module), attr)


def test_plugin_entry_point_loads_twice(bt, flow, hift, fresh_target, monkeypatch):
    monkeypatch.setenv(VP.ENV, "max_streams=4,max_prompt_frames=80,vocoder_seed=1234,progress=0,vocoder=upstream")
    for _ in range(2):  # vLLM may load a plugin several times in one process
        _entry_point()()
    assert sum(getattr(f, "torch_cfm_vllm_omni", False) for f in sys.meta_path) == 1
    module = importlib.import_module(V.TARGET)  # the hook patches the class as it is imported
    cls = module.BatchedToken2Wav
    wrapper, original = cls.__init__, vars(cls)[VP._MARK]["__init__"]
    _entry_point()()
    assert cls.__init__ is wrapper and vars(cls)[VP._MARK]["__init__"] is original is not wrapper
    backend = cls(V.make_token2wav(flow, hift, N_STEPS), connector_config=V.YAML_CONNECTOR,
                  hift_graph_config=V.YAML_HIFT_GRAPH, cfm_graph_config=V.YAML_CFM_GRAPH)
    adapter = VO.accelerated_backend(backend)
    assert adapter is not None and adapter.options.max_streams == 4 and adapter.server.max_streams == 4
    prompt = U.make_prompt(U.TINY, 12, seed=5)
    feats = module.PromptFeatures(cache_key=("v", "v.wav"), speech_tokens=prompt.tokens[:, :-3],
                                  speaker_embedding=prompt.spk, mels=prompt.mel)
    chunks = U.make_chunks(U.TINY, 2, seed=13, last_tokens=8)
    with torch.inference_mode():
        states = backend.setup_batch(feats, 1)
        got = []
        for k, tok in enumerate(chunks):
            audio, states = backend.decode_batch(tok.long(), feats, states, last_chunk=k == 1)
            got += audio
    _, up_wavs, _ = R.upstream_stream(flow, V.padded_prompt(prompt), chunks, N_STEPS, hift=V.HiftInference(hift),
                                      seed=SEED)
    for k in range(2):
        _close(got[k], up_wavs[k], f"plugin-built backend, chunk {k}")
    VP.unregister()
    assert VP._MARK not in vars(cls) and cls.__init__ is original
    assert not any(getattr(f, "torch_cfm_vllm_omni", False) for f in sys.meta_path)
    assert VO.accelerated_backend(cls(V.make_token2wav(flow, hift, N_STEPS))) is None


def test_disabled_plugin_changes_nothing(bt, fresh_target, monkeypatch):
    module = importlib.import_module(V.TARGET)
    init = module.BatchedToken2Wav.__init__
    for value in (None, "", "0", "off"):
        if value is None:
            monkeypatch.delenv(VP.ENV, raising=False)
        else:
            monkeypatch.setenv(VP.ENV, value)
        modules, hooks = set(sys.modules), list(sys.meta_path)
        _entry_point()()
        assert set(sys.modules) == modules and sys.meta_path == hooks
        assert module.BatchedToken2Wav.__init__ is init and VP._MARK not in vars(module.BatchedToken2Wav)


def test_plugin_options_from_the_environment():
    env = {VP.ENV: "max_streams=64, dtype=float16,warmup=0,encoder_batching=ragged,warmup_last_chunk_tokens=3+28"}
    assert VP.plugin_options(env) == {"max_streams": 64, "dtype": "float16", "warmup": False,
                                      "encoder_batching": "ragged", "warmup_last_chunk_tokens": (3, 28)}
    assert VP.plugin_options({VP.ENV: "yes"}) == {} and VP.plugin_options({}) is None
    for raw, match in (("max_streams", "key=value"), ("max_sterams=4", "max_sterams"), ("max_streams=four", "int"),
                       ("max_streams=-1", "max_streams must be a positive int"), ("graphs=maybe", "graphs"),
                       ("dtype=float8", "dtype")):
        with pytest.raises(ValueError, match=match):
            VP.plugin_options({VP.ENV: raw})


def test_code2wav_buckets_merge_torch_cfm_requests(bt, flow, hift, monkeypatch):
    """The plugin's bucket key for vLLM-Omni's Code2Wav stage: continuing requests with torch_cfm
    states share one bucket whatever their prompts and positions; other requests keep the
    stage's key. The stage's layout is checked in the wheel's source (its module needs vLLM's
    config classes to import); the key is exercised on a stand-in holding the stage's staticmethod."""
    source = open(os.path.join(os.path.dirname(bt.__file__), "minicpmo_4_5_code2wav.py")).read()
    tree = ast.parse(source)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    key_fn = next(f for f in classes["MiniCPMO45Code2Wav"].body if getattr(f, "name", "") == "_bucket_key")
    assert [d.id for d in key_fn.decorator_list] == ["staticmethod"] and len(key_fn.args.args) == 1
    fields = {c: {s.target.id for s in classes[c].body if isinstance(s, ast.AnnAssign)}
              for c in ("_WorkItem", "_RequestState")}
    assert {"previous", "cache_epoch", "prompt_cache_id"} <= fields["_WorkItem"]
    assert "token2wav" in fields["_RequestState"]

    class MiniCPMO45Code2Wav:  # the stand-in: a key per prompt and cache shape, like the stage's
        @staticmethod
        def _bucket_key(item):
            state = item.previous.token2wav if item.previous is not None else None
            return (item.prompt_cache_id, "uninitialized" if state is None else bt.state_shape_signature(state),
                    item.cache_epoch)

    stand_in = types.ModuleType(VP.CODE2WAV_MODULE)
    stand_in.MiniCPMO45Code2Wav = MiniCPMO45Code2Wav
    monkeypatch.setitem(sys.modules, VP.CODE2WAV_MODULE, stand_in)
    original = vars(MiniCPMO45Code2Wav)["_bucket_key"]
    backend = _backend(bt, flow, hift)
    VO.apply_torch_cfm_to_vllm_omni(backend, **OPTS)
    feats = [V.features(bt, U.make_prompt(U.TINY, n, seed=n), f"v{n}") for n in (10, 12)]
    with torch.inference_mode():
        ours = backend.setup_batch(feats[0], 1) + backend.setup_batch(feats[1], 1)
        _, ours[:1] = backend.decode_batch(U.make_chunks(U.TINY, 2, seed=1)[0].long(), feats[0], ours[:1],
                                           last_chunk=False)
        theirs = bt.BatchedToken2Wav.setup_batch(backend, feats[0], 1)

    def item(state, prompt, epoch=0):
        previous = None if state is None else types.SimpleNamespace(token2wav=state)
        return types.SimpleNamespace(previous=previous, prompt_cache_id=prompt, cache_epoch=epoch)

    try:
        VP.install(dict(OPTS))
        key = MiniCPMO45Code2Wav._bucket_key
        assert key(item(ours[0], "v10")) == key(item(ours[1], "v12")) == ("torch_cfm", 0)
        assert key(item(ours[1], "v12", epoch=1)) == ("torch_cfm", 1)
        assert key(item(theirs[0], "v10")) == original.__func__(item(theirs[0], "v10"))
        assert key(item(None, "v12")) == ("v12", "uninitialized", 0)
        VP.install(dict(OPTS))  # idempotent: not wrapped twice
        assert MiniCPMO45Code2Wav._bucket_key is key
    finally:
        VP.unregister()
    assert vars(MiniCPMO45Code2Wav)["_bucket_key"] is original


def test_bench_smoke(tmp_path):
    """bench/serving_vllm_omni.py on CPU at tiny sizes: every provider runs and writes its row."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        bench = importlib.import_module("serving_vllm_omni")
    finally:
        sys.path.remove(os.path.join(ROOT, "bench"))
    rows = bench.main(["--device", "cpu", "--tiny", "--quick", "--concurrency", "2", "--ticks", "2", "--chunks", "2",
                       "--warm-ticks", "1", "--mixed-prompts", "--out", str(tmp_path)])
    assert [r["provider"] for r in rows] == list(bench.PROVIDERS)
    for r in rows:
        assert not r.get("error"), r
        assert r["audio_s_per_s"] > 0 and r["first_chunk_ms_p50"] > 0 and r["variant"] == "mixed_prompts"
        assert all(k in r for k in ("gpu", "torch", "commit", "timestamp", "run"))
    assert rows[0]["bytes_per_request"] is None and rows[1]["bytes_per_request"] == rows[2]["bytes_per_request"] > 0
    assert len((tmp_path / "serving_vllm_omni.jsonl").read_text().splitlines()) == 3


@pytest.mark.gpu
def test_cuda_graphs_warmup_covers_the_workload(bt, flow, hift):
    """On CUDA (tiny sizes, fp32): after the warm-up a mixed workload (new requests beside settled
    ones, two prompts, ragged last chunks) captures no graph, and its audio equals the eager
    server's within the graph check's bound."""
    cuda_flow, cuda_hift = U.build_flow(U.TINY, seed=0).cuda(), V.build_hift(seed=3).cuda()
    outs = []
    for graphs in (True, False):
        backend = _backend(bt, cuda_flow, cuda_hift)
        adapter = VO.apply_torch_cfm_to_vllm_omni(
            backend, **dict(OPTS, graphs=graphs, warmup=graphs, warmup_last_chunk_tokens=(7, 11)))
        prompts = [V.features(bt, U.make_prompt(U.TINY, 40, seed=10 + i, device="cuda"), f"v{i}") for i in range(2)]
        chunks = [c.cuda().long() for c in U.make_chunks(U.TINY, 4, seed=21, last_tokens=7)]
        got = []
        with torch.inference_mode():
            states = backend.setup_batch(prompts[0], 2)
            for k in range(3):
                audio, states = backend.decode_batch(torch.cat([chunks[k]] * len(states)), prompts[0], states,
                                                     last_chunk=False)
                got += audio
                if k == 0:
                    states = states + backend.setup_batch(prompts[1], 1)
            audio, states = backend.decode_ragged_batch([chunks[3][0]] * 2 + [chunks[2][0][:11]], prompts[0], states,
                                                        last_chunks=[True] * 3)
            got += audio
        if graphs:
            assert adapter.stats["captures_after_warmup"] == 0, adapter.server.graph_counts()
        outs.append(got)
    for k, (a, b) in enumerate(zip(*outs)):
        _close(a, b, f"graphs vs eager, output {k}", rel=1e-4)
