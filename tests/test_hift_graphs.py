"""torch_cfm.integrations.hift against the package's real ``HiFTGenerator`` (stepaudio2-minicpmo).

The HiFT class is the package's own (``upstream_flow.load_token2wav_class``; it needs scipy), with
the default random initialisation of its constructor under a fixed seed. The independent
references are ``torch.istft`` (for :func:`istft`) and the upstream ``HiFTGenerator.forward`` run
eagerly from the same generator state (for :func:`capturable` and :class:`GraphedHiFT`): the
vocoder's random draws (initial harmonic phases, additive noise) are part of its output, so
equality needs the same state, which also checks that the accelerated path consumes the
generator as the upstream does.

CPU: fp32 equality up to float rounding; module state untouched afterwards; errors. GPU
(``@pytest.mark.gpu``): a stream of chunks as ``Token2wav.stream`` feeds the vocoder (first chunk
without a source cache, then 8 cached mel frames + 50 new ones with 3840 cached source samples,
a last chunk of 56), upstream eager vs graphed: every output within 1e-5 relative, the generator
left in the same state, and the chunks after the first of each shape replayed.
"""

from __future__ import annotations

import pytest
import torch

import upstream_flow as U
from oracle import err_rel_fro

_, HIFT = U.load_token2wav_class() if U.missing_reason() is None else (None, None)
pytestmark = [pytest.mark.skipif(HIFT is None, reason="stepaudio2 HiFT not importable (needs the package and scipy)"),
              pytest.mark.usefixtures("one_thread")]

from torch_cfm.integrations.hift import GraphedHiFT, capturable, hift_gaps, istft  # noqa: E402
from torch_cfm.integrations.stepaudio2 import (  # noqa: E402
    apply_torch_cfm_to_vocoder, undo_torch_cfm, warmup_vocoder)

REL = 1e-5


def _hift(device="cpu"):
    torch.manual_seed(0)
    return HIFT().to(device).eval()


def _seeded(fn, seed, *args, device="cpu"):
    torch.manual_seed(seed)
    out = fn(*args)
    state = torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()
    return out, state


@pytest.mark.parametrize("frames,batch", [(2, 1), (57, 3), (233, 2)])
def test_istft_equals_torch_istft(frames, batch):
    g = torch.Generator().manual_seed(frames)
    magnitude = torch.rand(batch, 9, frames, generator=g) * 4
    magnitude[..., ::7] *= 100  # past the 1e2 clip
    phase = torch.randn(batch, 9, frames, generator=g) * 3
    window = torch.hann_window(16, periodic=True)
    clipped = magnitude.clip(max=1e2)
    ref = torch.istft(torch.complex(clipped * torch.cos(phase), clipped * torch.sin(phase)), 16, 4, 16,
                      window=window)
    out = istft(magnitude, phase, 16, 4, window)
    assert out.shape == ref.shape == (batch, 4 * (frames - 1))
    assert torch.equal(out, ref)  # torch.istft's own ops, in its order


def test_capturable_forward_equals_the_upstream_and_restores_the_module():
    hift = _hift()
    window = hift.stft_window
    mel = torch.randn(2, 80, 58, generator=torch.Generator().manual_seed(1))
    cache = 0.1 * torch.randn(2, 1, 3840, generator=torch.Generator().manual_seed(2))
    (ref, ref_src), ref_state = _seeded(hift, 5, mel, cache)

    def run(m, c):
        with capturable(hift):
            return hift(m, c)

    (out, src), state = _seeded(run, 5, mel, cache)
    assert err_rel_fro(out, ref) <= REL and err_rel_fro(src, ref_src) <= REL
    assert torch.equal(state, ref_state)  # the same draws, in the same order
    assert hift.stft_window is window and "_istft" not in vars(hift)
    assert "forward" not in vars(hift.m_source.l_sin_gen)


def test_graphed_hift_on_cpu_runs_eagerly_and_equals_the_upstream():
    hift = _hift()
    graphed = GraphedHiFT(hift)
    mel = torch.randn(1, 80, 50, generator=torch.Generator().manual_seed(3))
    (ref, _), _ = _seeded(hift, 6, mel)  # the upstream default: an empty CPU source cache
    (out, _), _ = _seeded(graphed, 6, mel)
    assert err_rel_fro(out, ref) <= REL and graphed.graph_count == 0


def test_apply_and_undo_on_a_hift_and_errors_name_what_is_missing():
    hift = _hift()
    graphed = apply_torch_cfm_to_vocoder(hift)
    assert vars(hift)["forward"] is graphed
    mel = torch.randn(1, 80, 20)
    (ref, _), _ = _seeded(type(hift).forward, 4, hift, mel, torch.zeros(1, 1, 0))
    (out, _), _ = _seeded(hift, 4, mel)
    assert err_rel_fro(out, ref) <= REL
    again = apply_torch_cfm_to_vocoder(hift)  # replaces, never wraps the wrapper
    assert vars(hift)["forward"] is again and again.hift is hift
    undo_torch_cfm(hift)
    assert "forward" not in vars(hift)
    assert hift_gaps(hift) == []
    with pytest.raises(TypeError, match=r"GraphedHiFT: hift must be .*torch.nn.modules.linear.Linear.*'f0_predictor'"):
        GraphedHiFT(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="not an nn.Module"):
        apply_torch_cfm_to_vocoder(object())
    with pytest.raises(ValueError, match="vocoder"):
        warmup_vocoder(torch.nn.Linear(2, 2))


def test_a_token2wavs_hift_is_graphed_warmed_and_undone_with_its_flow():
    """``apply_torch_cfm`` on a Token2wav-shaped object (``.flow``, ``.hift``): with
    ``capture_vocoder=True`` the HiFT's forward is the graphed one (eager on CPU: the upstream
    output), ``warmup`` runs it too, ``undo_torch_cfm`` removes both patches; asking for it
    without a HiFT names what was found."""
    import types

    from torch_cfm.integrations.stepaudio2 import accelerated, apply_torch_cfm, warmup

    hift = _hift()
    t2w = types.SimpleNamespace(flow=U.build_flow(U.TINY, seed=0), hift=hift)
    apply_torch_cfm(t2w, capture_vocoder=True)
    graphed = vars(hift)["forward"]
    assert isinstance(graphed, GraphedHiFT) and accelerated(t2w).vocoder is graphed
    report = warmup(t2w, prompt_frames=(20,), last_tokens=(5,))
    assert report["vocoder_graphs"] == 0 and report["streams"] == 2  # CPU: eager
    mel = torch.randn(1, 80, 12, generator=torch.Generator().manual_seed(9))
    (out, _), _ = _seeded(hift, 2, mel)
    (ref, _), _ = _seeded(type(hift).forward, 2, hift, mel, torch.zeros(1, 1, 0))
    assert err_rel_fro(out, ref) <= REL
    undo_torch_cfm(t2w)
    assert "forward" not in vars(hift) and accelerated(t2w) is None
    with pytest.raises(ValueError, match=r"capture_vocoder.*\.hift torch\.nn\.modules\.linear\.Linear"):
        apply_torch_cfm(types.SimpleNamespace(flow=t2w.flow, hift=torch.nn.Linear(1, 1)), capture_vocoder=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_upstream_vocoder_stage_leaves_the_hifts_window_alone(device):
    """A Token2wavServer with ``vocoder="upstream"`` (its :class:`HiFTStage`) keeps its own device
    copy of ``stft_window``: the HiFT's attribute is the same object on the same device after the
    server is built and after a tick, and its ``__dict__`` holds nothing new."""
    from torch_cfm.serving import StreamPrompt, Token2wavServer

    flow, hift = U.build_flow(U.TINY, seed=0).to(device), _hift(device)
    window, attrs = hift.stft_window, set(vars(hift))
    server = Token2wavServer(flow, hift, vocoder="upstream", max_streams=1, max_prompt_frames=40, n_timesteps=2,
                             graphs=False)
    stage = server.vocoder
    assert hift.stft_window is window and window.device.type == "cpu"
    assert stage.window.device.type == device and torch.equal(stage.window.cpu(), window)
    prompt = U.make_prompt(U.TINY, 10, seed=1, device=device)
    server.open_many({"s": StreamPrompt(prompt.tokens, prompt.mel, prompt.spk, seed=3)})
    chunk = U.make_chunks(U.TINY, 1, seed=2, last_tokens=7)[0].to(device)
    assert server.step({"s": (chunk, True)})["s"].wav.numel() > 0
    assert hift.stft_window is window and window.device.type == "cpu" and set(vars(hift)) == attrs


def _vocoder_stream(vocoder, mels):
    """The vocoder part of Token2wav.stream: mel cache (8 frames), source cache (3840 samples)."""
    outs, mel_cache, source_cache = [], None, torch.zeros(1, 1, 0, device="cuda")
    for chunk in mels:
        mel = chunk if mel_cache is None else torch.cat([mel_cache, chunk], dim=2)
        speech, source = vocoder(mel, source_cache)
        outs.append(speech)
        mel_cache, source_cache = mel[..., -8:].clone(), source[:, :, -3840:].clone()
    return outs


@pytest.mark.gpu
def test_gpu_graphed_stream_equals_the_upstream_eager_stream():
    hift = _hift("cuda")
    g = torch.Generator().manual_seed(7)
    mels = [torch.randn(1, 80, 56 if i == 6 else 50, generator=g).cuda() for i in range(7)]
    graphed = GraphedHiFT(hift)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # IEEE fp32 convolutions on both sides
        assert warmup_vocoder(graphed, chunk_frames=(50,), last_frames=(56,)) == 3  # first, chunk, last
        for _ in range(2):  # the second pass replays only
            ref, ref_state = _seeded(_vocoder_stream, 11, hift, mels, device="cuda")
            out, state = _seeded(_vocoder_stream, 11, graphed, mels, device="cuda")
    for i, (a, b) in enumerate(zip(out, ref)):
        assert a.shape == b.shape and err_rel_fro(a, b) <= REL, f"chunk {i}: {err_rel_fro(a, b):.2e}"
    assert torch.equal(state, ref_state), "the graphed stream drew other random numbers than the upstream"
    replays = sum(e.replays for e in graphed.call.cache.entries())
    assert graphed.graph_count >= 3 and replays >= 7, graphed.call.events
