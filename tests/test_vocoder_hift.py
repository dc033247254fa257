"""torch_cfm.models.vocoder against the package's real ``HiFTGenerator`` (stepaudio2-minicpmo).

References are the upstream modules themselves, run eagerly: ``HiFTGenerator.decode`` /
``f0_predictor`` / ``f0_upsamp`` / ``m_source`` in float32 and in float64 (a deep copy cast to
float64, its STFT window too), plus ``torch.stft`` / ``torch.istft`` and Random123's published
Philox-4x32-10 answers. The source's random draws cannot equal the upstream's (the upstream uses
the global generator, the vocoder one counter-based stream per stream): its deterministic part
is compared with the upstream's with the noise switched off, and its draws statistically.

CPU: tiny HiFTs (one with three ResBlocks of three dilations per stage) and the shipped sizes on a
short chunk; Triton kernels in a child process under ``TRITON_INTERPRET=1`` (the pattern of
test_cfm_attention_triton.py). GPU (``@pytest.mark.gpu``): CUDA-graph replay bitwise equal to
eager, batch invariance under graphs, every precision's error against a float64 decode beside
the upstream module's own in the same precision.
"""

from __future__ import annotations

import copy
import importlib
import os
import sys

import pytest
import torch

from interpreter_child import run_child_file
import token2wav_reference as R
from oracle import err_max, err_rel_fro

pytestmark = [pytest.mark.skipif(R.hift_missing_reason() is not None, reason=str(R.hift_missing_reason())),
              pytest.mark.usefixtures("one_thread")]

from torch_cfm.models.vocoder import (HarmonicSource, HiFTVocoder, istft_frames, overlap_fade,  # noqa: E402
                                      stft_frames, stream_rng, vocoder_precision)
from torch_cfm.models.vocoder.elementwise import snake_channels  # noqa: E402
from torch_cfm.models.vocoder.istft import analysis_basis, synthesis_basis  # noqa: E402
from torch_cfm.models.vocoder.philox import philox4x32  # noqa: E402

S = 480  # samples per mel frame at the shipped 24 kHz / 50 Hz
# Three ResBlocks (kernels 3, 7, 11) of three dilations per stage, narrow channels.
WIDE = dict(base_channels=16, resblock_kernel_sizes=[3, 7, 11], resblock_dilation_sizes=[[1, 3, 5]] * 3,
            source_resblock_kernel_sizes=[7, 7, 11], source_resblock_dilation_sizes=[[1, 3, 5]] * 3)
SHIPPED = dict(base_channels=512, resblock_kernel_sizes=[3, 7, 11], resblock_dilation_sizes=[[1, 3, 5]] * 3,
               source_resblock_kernel_sizes=[7, 7, 11], source_resblock_dilation_sizes=[[1, 3, 5]] * 3)
CONFIGS = {"tiny": {}, "wide": WIDE}


def _hift(sizes: dict, seed: int = 0, f0_channels: int = 16):
    R.build_hift(seed=0)  # loads the package
    hifigan = importlib.import_module("stepaudio2.flashcosyvoice.modules.hifigan")
    torch.manual_seed(seed)
    f0 = hifigan.ConvRNNF0Predictor(cond_channels=f0_channels)
    return hifigan.HiFTGenerator(f0_predictor=f0, **dict(R.TINY_HIFT, **sizes)).eval()


def _double(hift):
    h64 = copy.deepcopy(hift).double()
    h64.stft_window = h64.stft_window.double()
    return h64


def _inputs(batch: int, frames: int, seed: int = 1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    mel = torch.randn(batch, 80, frames, generator=g)
    source = 0.1 * torch.randn(batch, 1, frames * S, generator=g)
    return mel.to(device), source.to(device)


def _voiced_f0(batch: int, frames: int, seed: int = 2) -> torch.Tensor:
    """Contours of 80..400 Hz with unvoiced (0 Hz) and sub-threshold (3 Hz) stretches."""
    g = torch.Generator().manual_seed(seed)
    f0 = 80 + 320 * torch.rand(batch, frames, generator=g)
    f0[:, frames // 3: frames // 2] = 0.0
    f0[0, :2] = 3.0
    return f0


class _NoNoise:
    """Within: ``torch.randn_like`` returns zeros (the upstream source's noise switched off)."""

    def __enter__(self):
        self.saved = torch.randn_like
        torch.randn_like = lambda x, **kw: torch.zeros_like(x, **kw)

    def __exit__(self, *exc):
        torch.randn_like = self.saved


def _quiet(source: HarmonicSource) -> HarmonicSource:
    quiet = copy.deepcopy(source)
    quiet.sigma_voiced = quiet.sigma_unvoiced = 0.0
    return quiet


# ---------------------------------------------------------------------- decode and f0
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_decode_equals_the_upstream_in_float32_and_float64(config):
    hift = _hift(CONFIGS[config])
    mel, source = _inputs(3, 6)
    with torch.no_grad():
        ref = hift.decode(x=mel, s=source)
        ref64 = _double(hift).decode(x=mel.double(), s=source.double())
    voc = HiFTVocoder(hift)
    out = voc.decode(mel, source)
    assert voc.decision.choice == "ieee" and out.dtype == torch.float32 and out.shape == ref.shape
    assert err_rel_fro(out, ref) <= 1e-5
    # no less exact than the upstream module in float32 (docs/design.md §6's rule against float64)
    assert err_rel_fro(out, ref64) <= 2 * err_rel_fro(ref, ref64) + 1e-7
    assert err_max(out, ref64) <= 2 * err_max(ref, ref64) + 1e-7
    out64 = HiFTVocoder(_double(hift)).decode(mel.double(), source.double())
    assert out64.dtype == torch.float64 and err_rel_fro(out64, ref64) <= 1e-12


def test_decode_at_the_shipped_sizes():
    hift = _hift(SHIPPED, f0_channels=512)
    mel, source = _inputs(1, 10)
    with torch.no_grad():
        ref = hift.decode(x=mel, s=source)
    out = HiFTVocoder(hift).decode(mel, source[:, 0])  # (B, L) source accepted too
    assert err_rel_fro(out, ref) <= 1e-5


def test_weight_norm_is_folded_once_into_plain_weights():
    hift = _hift(WIDE)
    voc = HiFTVocoder(hift)
    assert torch.equal(voc.conv_pre.weight[:, :, 0, :], hift.conv_pre.weight.detach())
    assert torch.equal(voc.resblocks[4].convs1[2].weight[:, :, 0, :], hift.resblocks[4].convs1[2].weight.detach())
    assert voc.ups[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert not any(p.requires_grad for p in voc.parameters()) and len(list(voc.parameters())) == 0


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_f0_and_its_upsampling_equal_the_upstream(config):
    hift = _hift(CONFIGS[config])
    mel, _ = _inputs(2, 9)
    with torch.no_grad():
        ref = hift.f0_predictor(mel)
        up = hift.f0_upsamp(ref[:, None]).transpose(1, 2)  # (B, 9·S, 1): what m_source receives
        ref64 = _double(hift).f0_predictor(mel.double())
    f0 = HiFTVocoder(hift).f0(mel)
    assert f0.shape == (2, 9) and err_rel_fro(f0, ref) <= 1e-5
    assert torch.equal(torch.repeat_interleave(ref, S, dim=1), up[..., 0])  # frames repeated S times
    assert err_rel_fro(HiFTVocoder(_double(hift)).f0(mel.double()), ref64) <= 1e-12


# ---------------------------------------------------------------------- the source
def test_source_without_noise_equals_the_upstream_and_is_more_exact():
    hift = _hift({})
    f0 = _voiced_f0(3, 58)
    up = hift.f0_upsamp(f0[:, None]).transpose(1, 2)
    with torch.no_grad(), _NoNoise():
        ref = hift.m_source(up)[0][..., 0]
        ref64 = _double(hift).m_source(up.double())[0][..., 0]
    source = _quiet(HarmonicSource(hift.m_source))
    out, _ = source(f0, stream_rng([1, 2, 3]))
    out64, _ = source(f0.double(), stream_rng([1, 2, 3]))
    assert out.shape == (3, 58 * S) and out.dtype == torch.float32
    assert err_rel_fro(out64, ref64) <= 1e-10
    # float64 phase sums: ~100x closer to float64 than the upstream's float32 phases
    assert err_rel_fro(out, ref64) <= 0.1 * err_rel_fro(ref, ref64)
    assert err_rel_fro(out, ref) <= 2e-3


@pytest.mark.parametrize("scale", [1, 2])
def test_initial_phases_enter_as_upstream_where_the_rate_lets_them(scale):
    """At S = 1 or 2 the decimation reads sample 0: the upstream's ``rand_ini`` (its column 0,
    the fundamental, zeroed) is given this module's draws, the outputs must agree."""
    R.build_hift(seed=0)
    layers = importlib.import_module("stepaudio2.flashcosyvoice.modules.hifigan_components.layers")
    torch.manual_seed(0)
    upstream = layers.SourceModuleHnNSF2(24000, scale, harmonic_num=8, sine_amp=0.1, add_noise_std=0.003,
                                         voiced_threshod=10).double()
    source = _quiet(HarmonicSource(upstream, scale))
    rng = stream_rng([5, 6])
    phases = source.initial_phases(rng)
    assert torch.equal(phases[:, 0], torch.zeros(2)) and (phases[:, 1:] > 0).all()
    f0 = _voiced_f0(2, 40).double()
    up = torch.repeat_interleave(f0, scale, dim=1)[..., None]
    saved = torch.rand
    torch.rand = lambda *shape, **kw: torch.cat([torch.full((2, 1), 0.7), phases[:, 1:]], dim=1).to(**kw)
    try:
        with torch.no_grad(), _NoNoise():
            ref = upstream(up)[0][..., 0]
    finally:
        torch.rand = saved
    out, _ = source(f0, rng)
    assert source.phase_weight == {1: 1.0, 2: 0.5}[scale]
    assert err_max(out, ref) <= 1e-9


def test_at_the_shipped_rate_the_upstream_phase_draws_never_reach_its_output():
    hift = _hift({})
    sine = hift.m_source.l_sin_gen
    f0 = _voiced_f0(2, 12)
    fn = hift.f0_upsamp(f0[:, None]).transpose(1, 2) * torch.arange(1, 10)
    torch.manual_seed(0)
    a = sine._f02sine(fn)
    torch.manual_seed(1)
    b = sine._f02sine(fn)
    assert torch.equal(a, b)
    assert HarmonicSource(hift.m_source).phase_weight == 0.0


def _noise(out: torch.Tensor, quiet: torch.Tensor) -> torch.Tensor:
    return torch.atanh(out.double()) - torch.atanh(quiet.double())


def _ks_normal(z: torch.Tensor) -> float:
    z, _ = torch.sort(z.double().flatten())
    n = z.numel()
    cdf = 0.5 * (1 + torch.erf(z / 2 ** 0.5))
    grid = torch.arange(1, n + 1, dtype=torch.float64) / n
    return max((grid - cdf).abs().max().item(), (cdf - (grid - 1 / n)).abs().max().item())


def test_source_draws_follow_the_upstream_distributions():
    """Fixed seeds. Phases: the fundamental 0, the others U[0, 1) (Kolmogorov-Smirnov). Noise
    before tanh: N(0, σ²) with σ = noise_std·||w|| where voiced and sine_amp/3·||w|| where not,
    for this module's draws and for the upstream's own (global generator); independent across
    streams and calls."""
    hift = _hift({})
    h64 = _double(hift)
    source = HarmonicSource(h64.m_source)
    phases = source.initial_phases(stream_rng(range(20000)))
    assert torch.equal(phases[:, 0], torch.zeros(20000))
    u, _ = torch.sort(phases[:, 1:].double().flatten())
    grid = torch.arange(u.numel(), dtype=torch.float64) / u.numel()
    assert (u >= 0).all() and (u < 1).all() and (u - grid).abs().max().item() < 0.006

    batch, frames = 48, 20
    f0 = torch.zeros(batch, frames, dtype=torch.float64)
    f0[:, :10] = 100 + 200 * torch.rand(batch, 10, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    voiced = torch.repeat_interleave(f0 > 10, S, dim=1)
    rng = stream_rng(range(100, 100 + batch))
    out, rng1 = source(f0, rng)
    out2, _ = source(f0, rng1)
    quiet, _ = _quiet(source)(f0, rng)
    mine, mine2 = _noise(out, quiet), _noise(out2, quiet)
    up = h64.f0_upsamp(f0[:, None]).transpose(1, 2)
    with torch.no_grad():
        torch.manual_seed(7)
        ref = h64.m_source(up)[0][..., 0]
        with _NoNoise():
            ref_quiet = h64.m_source(up)[0][..., 0]
    theirs = _noise(ref, ref_quiet)
    norm = h64.m_source.l_linear.weight.detach().double().norm().item()
    sigma = {True: 0.003 * norm, False: 0.1 / 3 * norm}
    for name, z in (("torch_cfm", mine), ("upstream", theirs)):
        for is_voiced in (True, False):
            part = z[voiced == is_voiced] / sigma[is_voiced]
            assert abs(part.std().item() - 1) < 0.01, (name, is_voiced, part.std().item())
            assert abs(part.mean().item()) < 0.01, (name, is_voiced)
            assert _ks_normal(part) < 0.006, (name, is_voiced)
    scale = torch.where(voiced, sigma[True], sigma[False])
    unit, unit2 = mine / scale, mine2 / scale  # ~N(0, 1) everywhere: products estimate correlations
    corr_streams = (unit[:-1] * unit[1:]).mean().item()  # stream b with b + 1, 47 x 9600 pairs
    corr_calls = (unit * unit2).mean().item()  # one stream's consecutive calls
    assert abs(corr_streams) < 0.01 and abs(corr_calls) < 0.01
    assert torch.equal(rng1[:, 1], rng[:, 1] + 1) and torch.equal(rng1[:, 0], rng[:, 0])


def test_philox_known_answers():
    """Random123's kat_vectors for philox4x32_10."""
    cases = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for counter, key, expected in cases:
        words = philox4x32(tuple(torch.tensor(c) for c in counter), tuple(torch.tensor(k) for k in key))
        assert tuple(int(w) for w in words) == expected


# ---------------------------------------------------------------------- the whole call
def test_forward_without_noise_equals_the_upstream_forward():
    """f0 -> source -> the cached source samples put back -> decode, against
    ``HiFTGenerator.forward(mel, cache_source)`` with both sources' noise off."""
    hift = _hift(WIDE)
    mel, _ = _inputs(2, 12)
    cache = 0.05 * torch.randn(2, 1, 8 * S, generator=torch.Generator().manual_seed(4))
    with _NoNoise():
        ref, ref_source = hift(mel, cache)
        ref64, ref_source64 = _double(hift)(mel.double(), cache.double())
    voc = HiFTVocoder(hift)
    voc.source = _quiet(voc.source)
    speech, source, _ = voc(mel, stream_rng([1, 2]), cache)
    assert source.shape == ref_source.shape and torch.equal(source[..., :8 * S], cache)
    assert err_rel_fro(source, ref_source64) <= 2 * err_rel_fro(ref_source, ref_source64) + 1e-6
    assert err_rel_fro(speech, ref64) <= 2 * err_rel_fro(ref, ref64) + 1e-6


def test_stream_chunks_equal_token2wav_streams_vocoder_without_noise():
    """``stream_chunk`` driven as ``Token2wav.stream`` drives the HiFT (8 cached mel frames, the
    cached source samples, the Hamming fade, the tail held back) against the upstream steps
    (``token2wav_reference.upstream_vocoder``), both sources' noise off."""
    import numpy as np

    hift = _hift(WIDE)
    g = torch.Generator().manual_seed(11)
    mels = [torch.randn(1, 80, t, generator=g) for t in (12, 10, 7)]
    with _NoNoise():
        ref = R.upstream_vocoder(hift, mels, seed=0)
    voc = HiFTVocoder(hift)
    voc.source = _quiet(voc.source)
    n, window = 8 * S, torch.from_numpy(np.hamming(16 * S))
    rng, cache_mel, cache_source, previous = stream_rng([3]), None, None, None
    for i, chunk in enumerate(mels):
        mel = chunk if cache_mel is None else torch.cat([cache_mel, chunk], dim=2)
        speech, source, rng = voc.stream_chunk(mel, rng, cache_source, previous, window)
        cache_mel, cache_source, previous = mel[..., -8:], source[..., -n:], speech[:, -n:]
        wav = speech[0] if i == len(mels) - 1 else speech[0, :-n]
        assert wav.shape == ref[i].shape and err_rel_fro(wav, ref[i]) <= 1e-5, i


def test_batch_invariance_is_bitwise():
    """A stream alone and in a batch of 5 in another order: the same bits (speech, source and
    next random state). On CPU that takes slabs of one row (HiFTVocoder's docstring)."""
    voc = HiFTVocoder(_hift(WIDE), slab_rows=1)
    mel, _ = _inputs(5, 6, seed=5)
    cache = 0.05 * torch.randn(5, 1, 2 * S, generator=torch.Generator().manual_seed(6))
    rng = stream_rng([10, 11, 12, 13, 14])
    speech, source, nxt = voc(mel, rng, cache)
    perm = [3, 0, 4, 2, 1]
    p_speech, p_source, p_nxt = voc(mel[perm], rng[perm], cache[perm])
    assert torch.equal(p_speech, speech[perm]) and torch.equal(p_source, source[perm]) and torch.equal(p_nxt, nxt[perm])
    a_speech, a_source, a_nxt = voc(mel[2:3], rng[2:3], cache[2:3])
    assert torch.equal(a_speech[0], speech[2]) and torch.equal(a_source[0], source[2]) and torch.equal(a_nxt[0], nxt[2])
    f0 = voc.f0(mel)
    alone = voc.source(f0[2:3].clone(), rng[2:3])[0]
    assert torch.equal(alone[0], voc.source(f0[perm], rng[perm])[0][3])  # the source alone: no slabs needed
    again, _, _ = voc(mel, nxt, cache)
    assert not torch.equal(again, speech)  # the next call draws new noise


def test_nan_in_one_stream_stays_in_that_stream():
    voc = HiFTVocoder(_hift(WIDE))  # one batch: rows never mix
    mel, _ = _inputs(4, 6, seed=7)
    rng = stream_rng([1, 2, 3, 4])
    clean, clean_source, _ = voc(mel, rng)
    bad = mel.clone()
    bad[1, 5, 3] = float("nan")
    speech, source, _ = voc(bad, rng)
    assert torch.isnan(speech[1]).any()
    for b in (0, 2, 3):
        assert torch.equal(speech[b], clean[b]) and torch.equal(source[b], clean_source[b])


# ---------------------------------------------------------------------- pieces and policy
def test_overlap_fade_is_token2wav_streams_in_place_fade():
    import numpy as np

    g = torch.Generator().manual_seed(8)
    speech, previous = torch.randn(3, 40, generator=g), torch.randn(3, 8, generator=g)
    window = torch.from_numpy(np.hamming(16))
    out = overlap_fade(speech, previous, window, torch.tensor([True, False, True]))
    for b, faded in enumerate((True, False, True)):
        want = speech[b:b + 1].clone()
        if faded:  # Token2wav.stream: speech[:, :n] = speech[:, :n] * w[:n] + cache[:, -n:] * w[n:]
            want[:, :8] = want[:, :8] * window[:8] + previous[b:b + 1] * window[8:]
        assert torch.equal(out[b], want[0])



@pytest.mark.parametrize("frames,batch", [(3, 1), (57, 3)])
def test_stft_and_istft_frames_equal_torch(frames, batch):
    g = torch.Generator().manual_seed(frames)
    window = torch.hann_window(16, periodic=True)
    signal = torch.randn(batch, 4 * frames, generator=g)
    spec = stft_frames(signal, analysis_basis(window, 16).float(), 16, 4)
    ref = torch.view_as_real(torch.stft(signal, 16, 4, 16, window=window, return_complex=True))
    assert err_rel_fro(spec, torch.cat([ref[..., 0], ref[..., 1]], dim=1).transpose(1, 2)) <= 1e-6
    logits = torch.randn(batch, frames, 18, generator=g) * 2
    logits[..., ::5, :9] += 6  # past the 1e2 magnitude clip
    out = istft_frames(logits, synthesis_basis(window, 16).float(), window, 16, 4)
    magnitude = torch.clip(torch.exp(logits[..., :9]), max=1e2).transpose(1, 2)
    phase = torch.sin(logits[..., 9:]).transpose(1, 2)
    ref = torch.istft(torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase)), 16, 4, 16,
                      window=window)
    assert out.shape == ref.shape == (batch, 4 * (frames - 1)) and err_rel_fro(out, ref) <= 1e-6


def test_vocoder_precision_choices_and_reasons():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert vocoder_precision(cpu, torch.float32) == ("ieee", ("TF32 needs NVIDIA CUDA SM80+, found cpu",))
    assert vocoder_precision(cuda, torch.float32, capability=(9, 0), cudnn_tf32=True) == ("tf32", ())
    choice, reasons = vocoder_precision(cuda, torch.float32, capability=(9, 0), cudnn_tf32=False)
    assert choice == "ieee" and "allow_tf32=False" in reasons[0]
    assert vocoder_precision(cuda, torch.float32, capability=(7, 5)).reasons == ("TF32 needs NVIDIA SM80+, found SM75",)
    assert vocoder_precision(cuda, torch.float32, "tf32", capability=(7, 5)).choice == "ieee"
    assert vocoder_precision(cuda, torch.float32, "ieee", capability=(9, 0)) == ("ieee", ())
    assert vocoder_precision(cuda, torch.float32, "fp16", capability=(9, 0)) == ("fp16", ())
    assert vocoder_precision(cpu, torch.float64).choice == "fp64"
    assert vocoder_precision(cuda, torch.float16, capability=(9, 0)).choice == "fp16"
    with pytest.raises(ValueError, match="precision must be one of"):
        vocoder_precision(cpu, torch.float32, "fp8")


def test_bf16_convolutions_on_cpu_within_twice_the_upstream_autocast_error():
    hift = _hift(WIDE)
    mel, source = _inputs(2, 6)
    with torch.no_grad():
        ref64 = _double(hift).decode(x=mel.double(), s=source.double())
        # torch.istft has no bfloat16 kernel: the reference's magnitude/phase go to it in float32
        hift._istft = lambda m, p: type(hift)._istft(hift, m.float(), p.float())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            upstream = hift.decode(x=mel, s=source)
    out = HiFTVocoder(hift, precision="bf16").decode(mel, source)
    assert out.dtype == torch.float32
    assert err_rel_fro(out, ref64) <= 2 * err_rel_fro(upstream, ref64) + 1e-6


def test_errors_name_the_argument():
    hift = _hift({})
    voc = HiFTVocoder(hift)
    mel, source = _inputs(2, 3)
    with pytest.raises(ValueError, match=r"HiFTVocoder.decode: mel must have 80 channels"):
        voc.decode(mel[:, :40], source)
    with pytest.raises(ValueError, match=r"HiFTVocoder.decode: source must have 480 samples per mel frame"):
        voc.decode(mel, source[..., :-1])
    with pytest.raises(ValueError, match=r"HarmonicSource: rng must be int64 of shape \(B, 2\)=\(2, 2\)"):
        voc(mel, stream_rng([1, 2]).int())
    with pytest.raises(ValueError, match="slab_rows must be a positive int"):
        HiFTVocoder(hift, slab_rows=0)
    with pytest.raises(ValueError, match="hift must be a stepaudio2 HiFTGenerator"):
        HiFTVocoder(torch.nn.Linear(2, 2))


# ---------------------------------------------------------------------- GPU
def _gpu_case(batch: int = 4, frames: int = 58, seed: int = 0):
    """The shipped HiFT on CUDA, Token2wav.stream's chunk (8 cached + 50 new frames), a cache."""
    hift = _hift(SHIPPED, seed=seed, f0_channels=512).cuda()
    mel, _ = _inputs(batch, frames, seed=seed + 1, device="cuda")
    cache = 0.05 * torch.randn(batch, 1, 8 * S, generator=torch.Generator().manual_seed(seed + 2)).cuda()
    return hift, mel, cache, stream_rng(range(20, 20 + batch), "cuda")


def _graphed(fn, *static):
    """(graph, outputs) of ``fn(*static)`` captured after two warm-up calls on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static)
    return graph, out


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["tf32", "fp16"])
def test_gpu_graph_replay_equals_eager_bitwise(precision):
    hift, mel, cache, rng = _gpu_case()
    voc = HiFTVocoder(hift, precision=precision)
    static = [mel.clone(), rng.clone(), cache.clone()]
    graph, out = _graphed(voc, *static)
    mel2 = torch.randn_like(mel)
    for dst, src in zip(static, (mel2, rng + 3, cache.flip(0))):
        dst.copy_(src)
    graph.replay()
    expected = voc(mel2, rng + 3, cache.flip(0))
    for got, want in zip(out, expected):
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("slab_rows,precision", [(None, "tf32"), (None, "fp16"), (4, "tf32")])
def test_gpu_batch_invariance_bitwise_eager_and_graphed(slab_rows, precision):
    hift, mel, cache, _ = _gpu_case(batch=5)
    rng = stream_rng([10, 11, 12, 13, 14], "cuda")
    voc = HiFTVocoder(hift, slab_rows=slab_rows, precision=precision)
    assert voc.fused_convs  # the fused Triton convolutions: batch invariant without slabs
    perm = [3, 0, 4, 2, 1]
    whole = voc(mel, rng, cache)
    alone = voc(mel[2:3], rng[2:3], cache[2:3])
    graph, out = _graphed(voc, mel[perm].clone(), rng[perm].clone(), cache[perm].clone())
    graph.replay()
    for w, a, g in zip(whole, alone, out):
        assert torch.equal(a[0], w[2]) and torch.equal(g, w[perm])


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["ieee", "tf32", "fp16", "bf16"])
def test_gpu_error_vs_float64_beside_the_upstream(precision):
    """Every precision's decode error against a float64 decode of the same mel and source, within
    1.5x the upstream module's own error in the same precision (IEEE: also <= 1e-5)."""
    hift, mel, _, _ = _gpu_case()
    source = 0.1 * torch.randn(mel.shape[0], 1, mel.shape[2] * S, generator=torch.Generator().manual_seed(9)).cuda()
    with torch.no_grad():
        ref64 = _double(hift).decode(x=mel.double(), s=source.double())
        hift._istft = lambda m, p: type(hift)._istft(hift, m.float(), p.float())  # no 16-bit istft
        half = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=precision == "tf32"), \
                torch.autocast("cuda", dtype=half or torch.float16, enabled=half is not None):
            upstream = hift.decode(x=mel, s=source)
    out = HiFTVocoder(hift, precision=precision).decode(mel, source)
    mine, theirs = err_rel_fro(out, ref64), err_rel_fro(upstream, ref64)
    print(f"{precision}: torch_cfm {mine:.2e}, upstream {theirs:.2e}")
    assert mine <= 1.5 * theirs + 1e-6
    if precision == "ieee":
        assert mine <= 1e-5


@pytest.mark.gpu
def test_gpu_triton_source_and_words_match_the_torch_path():
    from torch_cfm.kernels.vocoder_source import philox_words_triton

    hift = _hift({}).cuda()
    rng = stream_rng([1, -5, 2 ** 63 + 7], "cuda")
    rng[:, 1] = torch.tensor([0, 2 ** 33 + 5, 7], device="cuda")
    words = philox_words_triton(rng, 17)
    seed, calls = rng[:, 0], rng[:, 1]
    block = torch.arange(17, device="cuda")[None, :]
    ref = philox4x32((block, (calls & 0xFFFFFFFF)[:, None], (calls >> 32)[:, None], torch.zeros_like(block)),
                     ((seed & 0xFFFFFFFF)[:, None], (seed >> 32 & 0xFFFFFFFF)[:, None]))
    assert torch.equal(words, torch.stack(ref, dim=-1))
    f0 = _voiced_f0(3, 58).cuda()
    fast = HarmonicSource(hift.m_source, kernel="triton").cuda()(f0, rng)[0]
    slow = HarmonicSource(hift.m_source, kernel="torch").cuda()(f0, rng)[0]
    assert err_max(fast, slow) <= 1e-5


@pytest.mark.gpu
def test_gpu_compiled_decode_equals_eager():
    hift = _hift({}).cuda()
    mel, source = _inputs(4, 58, device="cuda")
    eager = HiFTVocoder(hift, precision="ieee").decode(mel, source)
    compiled = HiFTVocoder(hift, precision="ieee", compiled=True).decode(mel, source)
    assert err_rel_fro(compiled, eager) <= 1e-5


def test_16bit_convolutions_keep_the_bias_in_float32():
    """A magnitude head whose log offset is large (a loud vocoder): a 16-bit bias would round it
    by ~4e-3 and the waveform with it; the bias stays float32, so only the 10-bit operands (as
    TF32's) and the 16-bit outputs of the library convolutions round."""
    hift = _hift(WIDE)
    with torch.no_grad():
        hift.conv_post.bias[: hift.istft_params["n_fft"] // 2 + 1] += 5.0
    mel, source = _inputs(2, 6)
    h64 = _double(hift)
    with torch.no_grad():
        ref = h64.decode(x=mel.double(), s=source.double())
    voc = HiFTVocoder(hift, precision="fp16", kernels="torch")
    assert voc.conv_post.bias.dtype == torch.float32
    assert err_rel_fro(voc.decode(mel, source), ref) <= 2.5e-4  # 1.6e-4; a 16-bit bias: 3.9e-4


# ---------------------------------------------------------------------- Triton (interpreter)
def _child(out_path: str) -> None:
    from torch_cfm.kernels.vocoder_source import philox_words_triton

    rng = stream_rng([1, -5, 2 ** 63 + 7, 123456789012345])
    rng[:, 1] = torch.tensor([0, 1, 2 ** 33 + 5, 7])
    results = {"words": philox_words_triton(rng, 9, domain=0)}
    hift = _hift(WIDE)
    f0 = _voiced_f0(2, 4)
    results["source"] = HarmonicSource(hift.m_source, kernel="triton")(f0, rng[:2])[0]
    mel, source = _inputs(2, 3)
    results["decode"] = HiFTVocoder(hift, kernels="triton").decode(mel, source)
    results["decode16"] = HiFTVocoder(hift, kernels="triton", precision="fp16").decode(mel, source)
    x, alpha, inv = _snake_inputs()
    results["snake"] = snake_channels(x, alpha, inv, backend="triton")
    results["snake16"] = snake_channels(x.half(), alpha.half(), inv.half(), backend="triton")
    wide = torch.cat([x, x.flip(2)[:, :, :6] + 50.0], dim=2)  # a causal convolution's output, padding frames last
    results["snake_view"] = snake_channels(wide[:, :, :37], alpha, inv, backend="triton")
    torch.save(results, out_path)


def _snake_inputs():
    """(3, 5, 37) activations up to |x| ~ 8, per-channel alpha in (0.05, 20) and its 1 / (alpha + 1e-9)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 5, 37, generator=g) * 3
    alpha = torch.tensor([0.05, 0.7, 1.0, 4.0, 20.0]).view(1, 5, 1)
    return x, alpha, 1.0 / (alpha + 1e-9)


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory):
    out_path = str(tmp_path_factory.mktemp("vocoder_interp") / "out.pt")
    return run_child_file(__file__, out_path)


def test_triton_kernels_in_the_interpreter(interpreter_results):
    rng = stream_rng([1, -5, 2 ** 63 + 7, 123456789012345])
    rng[:, 1] = torch.tensor([0, 1, 2 ** 33 + 5, 7])
    seed, calls = rng[:, 0], rng[:, 1]
    mask = 0xFFFFFFFF
    block = torch.arange(9)[None, :]
    words = philox4x32((block, (calls & mask)[:, None], (calls >> 32 & mask)[:, None], torch.zeros_like(block)),
                       ((seed & mask)[:, None], (seed >> 32 & mask)[:, None]))
    assert torch.equal(interpreter_results["words"], torch.stack(words, dim=-1))  # bitwise the same words
    hift = _hift(WIDE)
    ref_source = HarmonicSource(hift.m_source, kernel="torch")(_voiced_f0(2, 4), rng[:2])[0]
    assert err_max(interpreter_results["source"], ref_source) <= 2e-6
    mel, source = _inputs(2, 3)
    assert err_rel_fro(interpreter_results["decode"], HiFTVocoder(hift, kernels="torch").decode(mel, source)) <= 1e-6
    ref16 = HiFTVocoder(hift, kernels="torch", precision="fp16").decode(mel, source)
    assert err_rel_fro(interpreter_results["decode16"], ref16) <= 2e-3
    x, alpha, inv = _snake_inputs()
    x64, a64 = x.double(), alpha.double()
    ref = x64 + torch.sin(x64 * a64) ** 2 / (a64 + 1e-9)  # the Snake in float64
    snake = interpreter_results["snake"]
    assert snake.dtype == torch.float32 and snake.shape == x.shape
    assert err_max(snake, ref) <= 4e-6 * ref.abs().max()  # float32 rounding of x·alpha, sin, the sum
    view = interpreter_results["snake_view"]  # read through the view's strides, written contiguous
    assert view.is_contiguous() and torch.equal(view, snake)
    assert torch.equal(snake_channels(x, alpha, inv, backend="torch"), x + inv * pow(torch.sin(x * alpha), 2))
    assert err_max(snake_channels(x, alpha, inv, backend="torch"), ref) <= 4e-6 * ref.abs().max()
    snake16 = interpreter_results["snake16"]
    ref16 = x.half().double() + torch.sin(x.half().double() * alpha.half().double()) ** 2 * inv.half().double()
    assert snake16.dtype == torch.float16 and err_max(snake16, ref16) <= 2 ** -10 * ref16.abs().max()


if __name__ == "__main__" and len(sys.argv) >= 3 and sys.argv[1] == "--child":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run the child with TRITON_INTERPRET=1")
    _child(sys.argv[2])
