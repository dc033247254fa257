"""torch_cfm.integrations.stepaudio2 against the real upstream package (stepaudio2-minicpmo).

The upstream flow modules are the package's own classes, loaded by ``tests/upstream_flow.py``
without running ``stepaudio2/__init__.py`` (which imports the whole TTS stack): a bare parent
package ``stepaudio2`` whose ``__path__`` is the installed directory is put in ``sys.modules``,
so only ``cosyvoice2/{flow,transformer,utils}`` files run, and ``onnxruntime`` (imported, never
used, by ``flow_matching.py``) is an empty stub when absent. They need torch, einops and numpy.
The whole module is skipped when the package is not installed (``pip install --no-deps
stepaudio2-minicpmo``; on a box without it, ``STEPAUDIO2_PATH`` = a directory holding a copy of
``stepaudio2/``).

CPU (fp32, tiny sizes): whole streams as ``Token2wav.stream`` drives the flow (setup_cache, then
``inference_chunk`` per 25 + 3 tokens, its estimator and conformer cache trims to prompt + 100
frames, a last chunk), upstream vs accelerated side by side, mel and every cache within 1e-5
relative; several prompt lengths on one accelerated flow; interleaved streams and streams begun
by the upstream module; the non-streaming ``flow.inference``; undo (bitwise upstream again);
errors; and the package's own ``Token2wav.set_stream_cache`` / ``stream`` / ``__call__``. Its
``__init__`` loads model files and onnx sessions, so the instance is built with ``__new__`` and
the attributes ``__init__`` sets (``upstream_flow.make_token2wav``; a recording vocoder stands in
for HiFT, which needs scipy); its hard-coded ``device='cuda'`` is redirected to CPU by swapping
its module's ``torch`` for a shim while it runs (``upstream_flow.token2wav_on_cpu``). The GPU
test runs the same methods unpatched on CUDA (with the real HiFT when scipy is there).

GPU (``@pytest.mark.gpu``, shipped sizes): fp16, bf16 and TF32 streams, accelerated error vs the
fp64 upstream <= 2x the upstream module's own error in that dtype + 1e-6 (docs/design.md §6).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys
import types

import pytest
import torch

import upstream_flow as U
from oracle import assert_within_oracle, err_rel_fro

pytestmark = [pytest.mark.skipif(U.missing_reason() is not None, reason=str(U.missing_reason())),
              pytest.mark.usefixtures("one_thread")]

from torch_cfm.integrations.stepaudio2 import (  # noqa: E402
    TorchCFMDecoder, accelerated, apply_torch_cfm, apply_torch_cfm_to_decoder, apply_torch_cfm_to_vocoder,
    undo_torch_cfm, warmup)

REL = 1e-5  # docs/design.md §6 fp32 bound, relative Frobenius
N_STEPS = 10


@pytest.fixture(scope="module")
def flow():
    return U.build_flow(U.TINY, seed=0)


def _accelerated(flow, **options):
    acc = copy.deepcopy(flow)
    apply_torch_cfm(acc, **options)
    return acc


def _assert_stream_close(up, acc, label=""):
    (m_up, first_up, c_up), (m_acc, first_acc, c_acc) = up, acc
    assert len(m_up) == len(m_acc)
    for i, (a, b) in enumerate(zip(m_acc, m_up)):
        assert a.shape == b.shape, f"{label} chunk {i}: {tuple(a.shape)} != {tuple(b.shape)}"
        err = err_rel_fro(a, b)
        assert err <= REL, f"{label} chunk {i}: mel rel err {err:.2e} > {REL}"
    for name, (c_a, c_b) in (("setup", (first_acc, first_up)), ("final", (c_acc, c_up))):
        for key in ("estimator_att_cache", "estimator_cnn_cache"):
            a, b = c_a[key], c_b[key][:N_STEPS]  # upstream: its 16-step scratch buffer, n used
            assert a.shape == b.shape, f"{label} {name} {key}: {tuple(a.shape)} != {tuple(b.shape)}"
            assert err_rel_fro(a, b) <= REL, f"{label} {name} {key}: rel err {err_rel_fro(a, b):.2e}"
        for key in ("conformer_att_cache", "conformer_cnn_cache"):  # upstream code on both sides
            assert c_a[key].shape == c_b[key].shape
            assert err_rel_fro(c_a[key], c_b[key]) <= REL, f"{label} {name} {key}"


# 40 and 74 prompt frames (74: no multiple of 50). graphs=True on CPU: the CUDA path's bucketed
# chunk lengths and cache windows (padded rows and keys), solved eagerly.
@pytest.mark.parametrize("prompt_tokens,graphs", [(20, False), (37, True)])
def test_stream_matches_upstream_through_the_trims(flow, prompt_tokens, graphs):
    acc = _accelerated(flow, graphs=graphs)
    prompt = U.make_prompt(U.TINY, prompt_tokens, seed=prompt_tokens)
    chunks = U.make_chunks(U.TINY, 7, seed=prompt_tokens + 1)  # 6 chunks of 25 + 3 tokens, a last of 13
    up = U.run_stream(flow, prompt, chunks)
    out = U.run_stream(acc, prompt, chunks)
    _assert_stream_close(up, out, f"P={prompt.frames}")
    # the trims ran (the cache is at prompt + 100) and both server paths were taken: continuing
    # from its own returned caches, and loading the caller's trimmed ones
    assert out[2]["estimator_att_cache"].shape[4] == prompt.frames + 100
    stream = accelerated(acc)._streams[N_STEPS]
    assert (stream.server.cache_buckets is not None) == graphs
    assert stream.solves == 1 + len(chunks)
    assert 1 <= stream.loads < len(chunks)


def test_a_prompt_set_up_again_is_a_copy_of_its_first_solve(flow):
    """``setup_cache`` of a prompt already solved (a second ``set_stream_cache`` of one prompt)
    comes from the voice cache: the same mel and caches, bitwise, and the stream continues the
    same; another prompt (or the cache off) is solved."""
    acc = _accelerated(flow)
    prompt, other = U.make_prompt(U.TINY, 20, seed=5), U.make_prompt(U.TINY, 20, seed=6)
    chunk = U.make_chunks(U.TINY, 2, seed=7)[0]
    first = {k: v.clone() for k, v in acc.setup_cache(prompt.tokens, prompt.mel, prompt.spk,
                                                       n_timesteps=N_STEPS).items()}
    mel_1, _ = acc.inference_chunk(chunk, prompt.spk, dict(first), n_timesteps=N_STEPS)
    acc.setup_cache(other.tokens, other.mel, other.spk, n_timesteps=N_STEPS)
    again = acc.setup_cache(prompt.tokens, prompt.mel, prompt.spk, n_timesteps=N_STEPS)
    voices = accelerated(acc)._streams[N_STEPS].server.voices
    assert (voices.hits, voices.misses, len(voices)) == (1, 2, 2)
    for key in ("estimator_att_cache", "estimator_cnn_cache"):
        assert torch.equal(again[key], first[key]), key
    mel_2, _ = acc.inference_chunk(chunk, prompt.spk, dict(again), n_timesteps=N_STEPS)
    assert torch.equal(mel_1, mel_2)
    off = _accelerated(flow, voice_cache_bytes=None)
    off.setup_cache(prompt.tokens, prompt.mel, prompt.spk, n_timesteps=N_STEPS)
    assert accelerated(off)._streams[N_STEPS].server.voices is None


def test_one_accelerated_flow_serves_streams_of_different_prompt_lengths_in_turn(flow):
    acc = _accelerated(flow)
    for prompt_tokens, count in ((9, 7), (52, 6)):
        prompt = U.make_prompt(U.TINY, prompt_tokens, seed=100 + prompt_tokens)
        chunks = U.make_chunks(U.TINY, count, seed=200 + prompt_tokens, last_tokens=5 + prompt_tokens % 7)
        _assert_stream_close(U.run_stream(flow, prompt, chunks), U.run_stream(acc, prompt, chunks),
                             f"P={prompt.frames}")


def test_interleaved_streams_and_streams_begun_upstream_give_the_upstream_results(flow):
    acc = _accelerated(flow)
    p_a, p_b = U.make_prompt(U.TINY, 18, seed=5), U.make_prompt(U.TINY, 27, seed=6)
    ch_a, ch_b = U.make_chunks(U.TINY, 6, seed=7), U.make_chunks(U.TINY, 6, seed=8)
    ref_a, ref_b = U.run_stream(flow, p_a, ch_a)[0], U.run_stream(flow, p_b, ch_b)[0]
    # two streams alternating on one accelerated flow: every call brings the other stream's caches
    cache_a = acc.setup_cache(p_a.tokens, p_a.mel, p_a.spk, n_timesteps=N_STEPS)
    cache_b = flow.setup_cache(p_b.tokens, p_b.mel, p_b.spk, n_timesteps=N_STEPS)  # begun by the upstream
    cache_b = {k: v.clone() for k, v in cache_b.items()}  # (upstream caches are views of its scratch buffers)
    for i in range(6):
        last = i == 5
        mel_a, cache_a = acc.inference_chunk(ch_a[i], p_a.spk, cache_a, last_chunk=last, n_timesteps=N_STEPS)
        cache_a = U.trim_stream_cache(cache_a, p_a.frames)
        mel_b, cache_b = acc.inference_chunk(ch_b[i], p_b.spk, cache_b, last_chunk=last, n_timesteps=N_STEPS)
        cache_b = U.trim_stream_cache(cache_b, p_b.frames)
        assert err_rel_fro(mel_a, ref_a[i]) <= REL, f"stream a chunk {i}"
        assert err_rel_fro(mel_b, ref_b[i]) <= REL, f"stream b chunk {i}"


def test_warmup_then_a_stream_and_the_returned_caches_are_the_servers(flow):
    acc = _accelerated(flow)
    prompt = U.make_prompt(U.TINY, 25, seed=61)
    assert TorchCFMDecoder.stream_shapes((300, 74), (50,), (56, 26)) == [
        (300, 0), (50, 300), (50, 350), (50, 400), (56, 400), (26, 400),
        (74, 0), (50, 74), (50, 124), (50, 174), (56, 174), (26, 174)]
    report = accelerated(acc).warmup(prompt_frames=(prompt.frames,), chunk_frames=(50,), last_chunk_frames=(56,),
                                     n_timesteps=N_STEPS)
    # P = 50: the prompt, 50 at L = 50, 100, 150, then 56 at 150 (the CPU server has no buckets: each
    # pair is one warmed shape); no graphs on CPU
    assert report["shapes"] == [(50, 0), (50, 50), (50, 100), (50, 150), (56, 150)]
    assert (report["solves"], report["graphs"]) == (5, 0)
    assert sorted((s["t_len"], s["cache_frames"]) for s in report["report"].shapes) == sorted(report["shapes"])
    server = accelerated(acc).servers[N_STEPS]
    assert server.open_requests == []  # the warm-up's stream is gone
    chunks = U.make_chunks(U.TINY, 4, seed=62)
    cache = acc.setup_cache(prompt.tokens, prompt.mel, prompt.spk, n_timesteps=N_STEPS)
    ref = U.run_stream(flow, prompt, chunks)[0]
    for i, tok in enumerate(chunks):
        mel, cache = acc.inference_chunk(tok, prompt.spk, cache, last_chunk=i == 3, n_timesteps=N_STEPS)
        assert err_rel_fro(mel, ref[i]) <= REL
        cnn, att = server.request_caches("stream")
        assert torch.equal(cache["estimator_att_cache"], att) and torch.equal(cache["estimator_cnn_cache"], cnn)
        cache = U.trim_stream_cache(cache, prompt.frames)


def test_flow_warmup_runs_two_streams_per_prompt_then_streams_match(flow):
    acc = _accelerated(flow, capture_encoder=True)  # on CPU the graphed encoder passes calls through
    call = accelerated(acc).encoder_call
    assert acc.encoder.forward_chunk is call
    report = warmup(acc, prompt_frames=(40, 74), n_timesteps=N_STEPS)
    assert report == {"streams": 4, "decoder_graphs": 0, "encoder_graphs": 0, "vocoder_graphs": 0}
    assert call.cache.entries() == []  # CPU tensors: never captured, never keyed
    prompt = U.make_prompt(U.TINY, 20, seed=81)
    chunks = U.make_chunks(U.TINY, 6, seed=82)
    _assert_stream_close(U.run_stream(flow, prompt, chunks), U.run_stream(acc, prompt, chunks))
    with pytest.raises(ValueError, match=r"warmup: prompt_frames must hold positive multiples of 2"):
        warmup(acc, prompt_frames=(41,))
    undo_torch_cfm(acc)
    assert "forward_chunk" not in vars(acc.encoder)
    with pytest.raises(ValueError, match=r"warmup: target must be accelerated"):
        warmup(acc)
    dec = copy.deepcopy(flow.decoder)
    with pytest.raises(ValueError, match=r"capture_encoder must be set only for a target with a flow encoder"):
        apply_torch_cfm(dec, capture_encoder=True)
    assert accelerated(dec) is None  # nothing installed


def test_untrimmed_caches_and_in_place_edits_are_followed(flow):
    """No trim at all (the caches grow), and a caller that edits the returned cache in place."""
    acc = _accelerated(flow)
    prompt = U.make_prompt(U.TINY, 12, seed=11)
    chunks = U.make_chunks(U.TINY, 4, seed=12)
    _assert_stream_close(U.run_stream(flow, prompt, chunks, trim=False), U.run_stream(acc, prompt, chunks, trim=False))
    edit = U.make_chunks(U.TINY, 2, seed=13)
    caches = []
    for f in (flow, acc):
        cache = f.setup_cache(prompt.tokens, prompt.mel, prompt.spk, n_timesteps=N_STEPS)
        _, cache = f.inference_chunk(edit[0], prompt.spk, cache, n_timesteps=N_STEPS)
        cache["estimator_att_cache"][:, :, :, :, :3].mul_(0.5)  # in place: the server must reload
        mel, _ = f.inference_chunk(edit[1], prompt.spk, cache, last_chunk=True, n_timesteps=N_STEPS)
        caches.append(mel)
    assert err_rel_fro(caches[1], caches[0]) <= REL


def test_non_streaming_inference_matches_upstream(flow):
    acc = _accelerated(flow)
    prompt = U.make_prompt(U.TINY, 15, seed=21)
    prompt_tok = prompt.tokens[:, :-3]
    gen = U.make_chunks(U.TINY, 1, seed=22, last_tokens=33)[0]
    args = (gen, torch.tensor([gen.shape[1]], dtype=torch.int32), prompt_tok,
            torch.tensor([prompt_tok.shape[1]], dtype=torch.int32), prompt.mel,
            torch.tensor([prompt.frames], dtype=torch.int32), prompt.spk, N_STEPS)
    ref, out = flow.inference(*args), acc.inference(*args)
    assert out.shape == ref.shape == (1, 80, 2 * gen.shape[1])
    assert err_rel_fro(out, ref) <= REL


def test_undo_restores_the_upstream_bitwise_and_options_apply(flow):
    prompt = U.make_prompt(U.TINY, 14, seed=31)
    chunks = U.make_chunks(U.TINY, 3, seed=32)
    fresh = copy.deepcopy(flow)
    ref = U.run_stream(fresh, prompt, chunks)
    acc = copy.deepcopy(flow)
    keys = list(acc.state_dict())
    assert apply_torch_cfm(acc, max_prompt_frames=64, max_chunk_frames=60) is acc
    accel = accelerated(acc)
    assert isinstance(accel, TorchCFMDecoder) and accel.max_prompt_frames == 64
    assert list(acc.state_dict()) == keys  # nothing registered on the module
    U.run_stream(acc, prompt, chunks)
    assert apply_torch_cfm(acc, max_prompt_frames=80) is acc  # applying again replaces it
    assert accelerated(acc) is not accel and accelerated(acc).max_prompt_frames == 80
    assert undo_torch_cfm(acc) is acc and accelerated(acc) is None
    assert "forward_chunk" not in vars(acc.decoder) and "forward" not in vars(acc.decoder)
    again = U.run_stream(acc, prompt, chunks)
    for a, b in zip(again[0], ref[0]):
        assert torch.equal(a, b)
    for key in ref[2]:
        assert torch.equal(again[2][key], ref[2][key])
    assert undo_torch_cfm(acc) is acc  # not accelerated: left as it is


def test_token2wav_shaped_objects_and_the_generic_decoder_entry(flow):
    class Token2wav:  # the attributes apply_torch_cfm reads (the real one needs model files)
        def __init__(self, flow):
            self.flow = flow

    t2w = Token2wav(copy.deepcopy(flow))
    assert apply_torch_cfm(t2w) is t2w
    assert accelerated(t2w) is accelerated(t2w.flow) is accelerated(t2w.flow.decoder) is not None
    undo_torch_cfm(t2w)
    assert accelerated(t2w.flow) is None
    dec = copy.deepcopy(flow.decoder)
    accel = apply_torch_cfm_to_decoder(dec, graphs=False)
    assert accel is accelerated(dec) and dec.forward_chunk == accel.forward_chunk
    assert accel.cfg_rate == flow.decoder.inference_cfg_rate and accel.noise is dec.rand_noise
    for name, p in flow.decoder.estimator.state_dict().items():
        assert torch.equal(accel.estimator.state_dict()[name], p), name


def test_applying_again_without_the_vocoder_graphs_removes_them(flow):
    """``apply_torch_cfm`` again replaces the previous acceleration, the graphed HiFT included."""
    import token2wav_reference as R
    from torch_cfm.integrations.hift import GraphedHiFT

    t2w = types.SimpleNamespace(flow=copy.deepcopy(flow), hift=R.build_hift(seed=3))
    apply_torch_cfm(t2w, graphs=False, capture_vocoder=True)
    assert isinstance(vars(t2w.hift).get("forward"), GraphedHiFT)
    apply_torch_cfm(t2w, graphs=False, capture_vocoder=False)
    assert "forward" not in vars(t2w.hift)
    undo_torch_cfm(t2w)


@pytest.mark.filterwarnings("ignore:CUDA is not available:UserWarning")  # its autocast("cuda") on CPU
def test_the_packages_token2wav_stream_and_call_on_cpu(flow):
    """``Token2wav.set_stream_cache``, ``Token2wav.stream`` (PCM bytes) and ``Token2wav.__call__``
    themselves, on an instance built without model files (``upstream_flow.make_token2wav``), with
    their ``device='cuda'`` redirected to CPU (``upstream_flow.token2wav_on_cpu``) and a
    recording vocoder in HiFT's place: the mel every call hands HiFT, accelerated vs upstream."""
    cls, _ = U.load_token2wav_class()
    prompt = U.make_prompt(U.TINY, 22, seed=71)
    chunks = U.make_chunks(U.TINY, 6, seed=72, last_tokens=9)
    runs = []
    for accelerate in (False, True):
        t2w = U.make_token2wav(cls, copy.deepcopy(flow), prompt, device="cpu")
        if accelerate:
            assert apply_torch_cfm(t2w) is t2w
        with U.token2wav_on_cpu(cls):
            t2w.stream_cache, t2w.hift_cache_dict = t2w.set_stream_cache("prompt.wav")
            pcm = [t2w.stream(tok[0].tolist(), "prompt.wav", last_chunk=i == len(chunks) - 1)
                   for i, tok in enumerate(chunks)]
            wav = t2w(chunks[1][0].tolist(), "prompt.wav")
        runs.append((t2w.hift.mels, pcm, wav, t2w.stream_cache))
    (mels_up, pcm_up, wav_up, cache_up), (mels_acc, pcm_acc, wav_acc, cache_acc) = runs
    assert len(mels_up) == len(mels_acc) == len(chunks) + 1  # every stream chunk, then __call__
    for i, (a, b) in enumerate(zip(mels_acc, mels_up)):
        assert a.shape == b.shape and err_rel_fro(a, b) <= REL, f"call {i}"
    assert [len(p) for p in pcm_acc] == [len(p) for p in pcm_up] and len(wav_acc) == len(wav_up)
    assert cache_acc["estimator_att_cache"].shape[4] == cache_up["estimator_att_cache"].shape[4] == prompt.frames + 100
    assert accelerated(t2w)._streams[N_STEPS].loads >= 1  # Token2wav.stream's own trims were loaded


def test_fallbacks_run_the_upstream_method(flow):
    acc = _accelerated(flow)
    g = torch.Generator().manual_seed(41)
    mu, cond, spks = torch.randn(1, 80, 30, generator=g), torch.zeros(1, 80, 30), torch.randn(1, 80, generator=g)
    ref = flow.decoder.forward_chunk(mu, spks, cond, n_timesteps=N_STEPS, temperature=0.5)[0].clone()
    out = acc.decoder.forward_chunk(mu, spks, cond, n_timesteps=N_STEPS, temperature=0.5)[0]
    assert torch.equal(out, ref)  # temperature != 1: the upstream method itself
    mask = torch.ones(1, 1, 30)
    mask[..., -4:] = 0
    ref = flow.decoder.forward(mu, mask, spks, cond, N_STEPS)  # a padded mask: the upstream method
    assert torch.equal(acc.decoder.forward(mu, mask, spks, cond, N_STEPS), ref)


def test_errors_name_what_was_found(flow):
    with pytest.raises(TypeError, match=r"apply_torch_cfm: target must be a stepaudio2 Token2wav.*"
                                        r"torch\.nn\.modules\.linear\.Linear"):
        apply_torch_cfm(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"got builtins\.object"):
        apply_torch_cfm(object())
    with pytest.raises(TypeError, match=r"its \.flow is .*Linear"):
        apply_torch_cfm(types.SimpleNamespace(flow=torch.nn.Linear(2, 2)))
    with pytest.raises(TypeError, match="undo_torch_cfm"):
        undo_torch_cfm("a string")
    with pytest.raises(TypeError, match=r"apply_torch_cfm_to_decoder: decoder must be CausalConditionalCFM-shaped"):
        apply_torch_cfm_to_decoder(flow)
    # an estimator whose state_dict differs from torch_cfm's DiT: the key is named
    odd = copy.deepcopy(flow)
    odd.decoder.estimator.blocks[1].attn.q_norm = torch.nn.Identity()
    with pytest.raises(ValueError, match=r"does not have torch_cfm's DiT state_dict.*missing.*"
                                         r"blocks\.1\.attn\.q_norm\.weight"):
        apply_torch_cfm(odd)
    odd = copy.deepcopy(flow)
    odd.decoder.estimator.blocks[0].mlp.fc2 = torch.nn.Linear(4 * U.TINY.hidden, U.TINY.hidden + 1)
    with pytest.raises(ValueError, match=r"mis-shaped.*blocks\.0\.mlp\.fc2\.weight"):
        apply_torch_cfm(odd)
    odd = copy.deepcopy(flow)
    odd.decoder.rand_noise = torch.randn(1, 40, 100)
    with pytest.raises(ValueError, match=r"decoder\.rand_noise must have shape \(1, 80, F\)"):
        apply_torch_cfm(odd)
    with pytest.raises(ValueError, match="max_prompt_frames must be a positive int"):
        apply_torch_cfm(copy.deepcopy(flow), max_prompt_frames=0)
    assert accelerated(odd) is None  # a failed apply installs nothing

    acc = _accelerated(flow, max_prompt_frames=40, max_chunk_frames=50)  # arena: 40 + 50 + 100 frames
    prompt = U.make_prompt(U.TINY, 20, seed=51)
    chunks = U.make_chunks(U.TINY, 6, seed=52)
    cache = acc.setup_cache(prompt.tokens, prompt.mel, prompt.spk, n_timesteps=N_STEPS)
    long_prompt = U.make_prompt(U.TINY, 21, seed=53)  # 42 frames > max_prompt_frames
    with pytest.raises(ValueError, match=r"mu must have at most max_prompt_frames=40 frames in a stream's first chunk"):
        acc.setup_cache(long_prompt.tokens, long_prompt.mel, long_prompt.spk, n_timesteps=N_STEPS)
    bad = dict(cache, estimator_att_cache=cache["estimator_att_cache"][:, :, :1])
    with pytest.raises(ValueError, match=r"att_cache must have the upstream layout \(n, depth, 2, H, L, 2D\)"):
        acc.inference_chunk(chunks[0], prompt.spk, bad, n_timesteps=N_STEPS)
    with pytest.raises(ValueError, match=r"att_cache must leave room for the chunk: L \+ T <= 190 frames.*"
                                         r"trim the cache"):
        for tok in chunks:  # never trimmed: 40 -> 90 -> 140 -> 190 -> full
            _, cache = acc.inference_chunk(tok, prompt.spk, cache, n_timesteps=N_STEPS)


def test_importing_the_integration_does_not_import_stepaudio2():
    code = ("import sys, torch_cfm.integrations.stepaudio2 as m; "
            "assert 'stepaudio2' not in sys.modules, sorted(k for k in sys.modules if 'stepaudio2' in k); "
            "print(m.apply_torch_cfm.__name__)")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "apply_torch_cfm", res.stderr


# ---------------------------------------------------------------------------- GPU, shipped sizes
def _gpu_stream(flow, prompt, chunks, dtype, autocast):
    with torch.amp.autocast("cuda", dtype=dtype, enabled=autocast):  # as Token2wav.stream runs the flow
        return U.run_stream(flow, prompt, chunks)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp16", "bf16", "tf32"])
def test_gpu_shipped_stream_within_the_oracle(mode):
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "tf32": torch.float32}[mode]
    base = U.build_flow(dataclasses.replace(U.SHIPPED, buffer_frames=512), seed=3)  # P + 100 + T <= 512 frames
    prompt64 = U.make_prompt(U.SHIPPED, 150, seed=4, device="cuda", dtype=torch.float64)  # 300 frames = 6 s
    chunks = U.make_chunks(U.SHIPPED, 7, seed=5, device="cuda")
    ref64 = U.run_stream(copy.deepcopy(base).double().cuda(), prompt64, chunks)
    prompt = U.Prompt(prompt64.tokens, prompt64.mel.to(dtype), prompt64.spk.to(dtype))
    same = base.to(dtype).cuda()  # Token2wav(float16=True) does flow.half()
    tf32 = mode == "tf32"
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        up = _gpu_stream(same, prompt, chunks, dtype, autocast=not tf32)
        acc = _accelerated(same)
        assert accelerated(acc).graphs
        out = _gpu_stream(acc, prompt, chunks, dtype, autocast=not tf32)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    for i, (a, b, r) in enumerate(zip(out[0], up[0], ref64[0])):
        assert_within_oracle(a, b, r, name=f"{mode} chunk {i} mel", tf32=tf32)
    for key in ("estimator_att_cache", "estimator_cnn_cache"):
        assert_within_oracle(out[2][key], up[2][key][:N_STEPS], ref64[2][key][:N_STEPS], name=f"{mode} {key}",
                             tf32=tf32)
    assert accelerated(acc).graph_count() >= 1  # the chunks ran from captured graphs


@pytest.mark.gpu
def test_gpu_real_token2wav_stream_matches_upstream():
    """The package's own ``Token2wav.stream`` / ``set_stream_cache`` on an instance built without
    model files (``Token2wav.__new__`` plus the attributes its ``__init__`` sets; the TTS-stack
    imports stubbed where absent, HiFT replaced by a recording stub when scipy/librosa are
    missing), fp32 (TF32 off): the accelerated mel within 1e-5 of the upstream's; with the real
    HiFT also graphed (``apply_torch_cfm_to_vocoder``) and both runs from the same seed, the
    waveforms within 1e-4 of each other (the vocoder's random draws are the same ones)."""
    token2wav_cls, real_hift = U.load_token2wav_class()
    size = U.TINY
    base = U.build_flow(size, seed=9).cuda()
    prompt = U.make_prompt(size, 40, seed=10, device="cuda")
    chunks = U.make_chunks(size, 7, seed=11)
    results = []
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # IEEE fp32 on both sides
    try:
        for accelerate in (False, True):
            t2w = U.make_token2wav(token2wav_cls, copy.deepcopy(base), prompt, real_hift=real_hift)
            if accelerate:
                apply_torch_cfm(t2w)
                if t2w.hift.inner is not None:  # the recording stub around the real HiFT
                    apply_torch_cfm_to_vocoder(t2w.hift.inner)
            torch.manual_seed(21)
            t2w.stream_cache, t2w.hift_cache_dict = t2w.set_stream_cache("prompt.wav")
            wavs = [t2w.stream(tok[0].tolist(), "prompt.wav", last_chunk=i == len(chunks) - 1, return_waveform=True)
                    for i, tok in enumerate(chunks)]
            results.append((t2w.hift.mels, wavs, t2w.stream_cache))
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
    (mels_up, wavs_up, cache_up), (mels_acc, wavs_acc, cache_acc) = results
    assert len(mels_up) == len(mels_acc) == len(chunks)
    for i, (a, b) in enumerate(zip(mels_acc, mels_up)):
        assert err_rel_fro(a, b) <= REL, f"chunk {i}"
    assert cache_acc["estimator_att_cache"].shape[4] == prompt.frames + 100  # Token2wav.stream trimmed it
    for i, (a, b) in enumerate(zip(wavs_acc, wavs_up)):
        assert a.shape == b.shape
        if real_hift is not None:
            assert err_rel_fro(torch.from_numpy(a), torch.from_numpy(b)) <= 1e-4, f"waveform chunk {i}"
    if real_hift is not None:
        assert vars(t2w.hift.inner)["forward"].graph_count >= 1  # the steady chunks replayed


@pytest.mark.gpu
def test_gpu_graphed_encoder_replays_equal_its_eager_calls():
    from torch_cfm.graphs import GraphedCall

    flow = U.build_flow(U.TINY, seed=12).cuda()
    enc = flow.encoder
    call = GraphedCall(type(enc).forward_chunk.__get__(enc), name="encoder.forward_chunk")
    g = torch.Generator().manual_seed(0)

    def embedded(n):
        return flow.input_embedding(torch.randint(0, U.TINY.vocab, (1, n), generator=g).cuda())

    with torch.inference_mode():
        _, cnn, att = enc.forward_chunk(embedded(23), last_chunk=False, cnn_cache=None, att_cache=None)
        for i in range(4):  # eager, eager + capture + check, replay, replay
            xs = embedded(28)
            ref = type(enc).forward_chunk(enc, xs, last_chunk=False, cnn_cache=cnn, att_cache=att)
            out = call(xs, last_chunk=False, cnn_cache=cnn, att_cache=att)
            for a, b in zip(out, ref):
                assert a.shape == b.shape and err_rel_fro(a, b) <= 1e-6, f"call {i}"
    assert call.graph_count == 1 and call.cache.entries()[0].replays == 2, call.events
    noisy = GraphedCall(lambda t: t + torch.rand_like(t), name="noisy")  # a replay cannot equal its eager call
    x = torch.randn(64, device="cuda")
    with torch.inference_mode():
        for _ in range(3):
            noisy(x)
    assert noisy.graph_count == 0 and "kept eager" in noisy.events[0], noisy.events
