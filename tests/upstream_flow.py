"""The upstream ``stepaudio2`` flow modules, loaded without the package's TTS stack, at any size.

``stepaudio2/__init__.py`` imports the whole TTS stack (transformers, s3tokenizer, torchaudio,
onnxruntime, hyperpyyaml); the flow needs only torch, einops and numpy. :func:`load` therefore
registers a bare parent package ``stepaudio2`` in ``sys.modules`` whose ``__path__`` is the
installed package directory (found with ``importlib.util.find_spec``, which locates a package
without running it, or given by the env var ``STEPAUDIO2_PATH`` = the directory that holds
``stepaudio2/``), so ``import stepaudio2.cosyvoice2.flow.flow`` runs only the flow submodules'
own files. ``flow_matching.py`` imports ``onnxruntime`` at top level without using it: when it
is not installed an empty stub module stands in. Nothing here copies upstream code; the tests
call the package's own classes.

:func:`build_flow` builds a real ``CausalMaskedDiffWithXvec`` (encoder, projection, CFM decoder
over the DiT estimator) at a given size with seeded random weights of realistic scale, and
resizes the streaming scratch buffers the upstream code hard-codes for the shipped sizes
(``DiT.att_cache_buffer`` / ``cnn_cache_buffer``, ``CausalConditionalCFM.att_cache_buffer`` /
``cnn_cache_buffer``: docs/design.md §10).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import math
import os
import sys
import types
from dataclasses import dataclass
from typing import Optional

import torch

from torch_cfm.models import DiT as TorchCfmDiT
from torch_cfm.models import DiTConfig

MODULES = {
    "flow": "stepaudio2.cosyvoice2.flow.flow",
    "flow_matching": "stepaudio2.cosyvoice2.flow.flow_matching",
    "decoder_dit": "stepaudio2.cosyvoice2.flow.decoder_dit",
    "encoder": "stepaudio2.cosyvoice2.transformer.upsample_encoder_v2",
}


def package_dir() -> Optional[str]:
    """The installed ``stepaudio2`` package directory, or None (nothing is imported)."""
    root = os.environ.get("STEPAUDIO2_PATH")
    if root:
        path = os.path.join(root, "stepaudio2")
        return path if os.path.isdir(path) else None
    mod = sys.modules.get("stepaudio2")
    if mod is not None and getattr(mod, "__path__", None):
        return list(mod.__path__)[0]
    try:
        spec = importlib.util.find_spec("stepaudio2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def missing_reason() -> Optional[str]:
    """Why the upstream flow cannot be loaded here (None when it can)."""
    if package_dir() is None:
        return "stepaudio2 (pip install --no-deps stepaudio2-minicpmo) is not installed"
    for dep in ("einops", "numpy"):
        if importlib.util.find_spec(dep) is None:
            return f"the upstream flow needs {dep}"
    return None


def load() -> types.SimpleNamespace:
    """The upstream flow submodules (``flow``, ``flow_matching``, ``decoder_dit``, ``encoder``)."""
    path = package_dir()
    if path is None:
        raise ImportError(missing_reason())
    if "stepaudio2" not in sys.modules:
        parent = types.ModuleType("stepaudio2")
        parent.__spec__ = importlib.machinery.ModuleSpec("stepaudio2", None, is_package=True)
        parent.__spec__.submodule_search_locations = [path]
        parent.__path__ = [path]
        sys.modules["stepaudio2"] = parent
    if "onnxruntime" not in sys.modules and importlib.util.find_spec("onnxruntime") is None:
        stub = types.ModuleType("onnxruntime")  # imported by flow_matching, never used by the flow
        stub.__spec__ = importlib.machinery.ModuleSpec("onnxruntime", None)  # torch._dynamo find_spec()s it
        sys.modules["onnxruntime"] = stub
    return types.SimpleNamespace(**{k: importlib.import_module(v) for k, v in MODULES.items()})


@dataclass(frozen=True)
class FlowSize:
    """Sizes of a flow build (defaults: tiny, for CPU tests). ``SHIPPED`` is the public config."""

    hidden: int = 64          # DiT C
    depth: int = 2
    heads: int = 4
    head_dim: int = 16
    enc_size: int = 32        # encoder input/output size (token embedding width)
    enc_heads: int = 2
    enc_units: int = 64
    enc_blocks: int = 1
    enc_up_blocks: int = 1
    vocab: int = 6561         # Token2wav.set_stream_cache pads prompts with token 4218
    spk_dim: int = 24
    buffer_frames: int = 1000  # upstream scratch buffers (frames), as shipped

    @property
    def dit_config(self) -> DiTConfig:
        return DiTConfig(hidden=self.hidden, depth=self.depth, heads=self.heads, head_dim=self.head_dim)


TINY = FlowSize()
SHIPPED = FlowSize(hidden=512, depth=16, heads=8, head_dim=64, enc_size=512, enc_heads=8, enc_units=2048,
                   enc_blocks=6, enc_up_blocks=4, vocab=6561, spk_dim=192)


@torch.no_grad()
def _random_init_(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Realistic-scale weights for the non-estimator modules: weights U(±1/√fan_in), biases and
    norm shifts 0.02·N(0,1), norm scales 1 + 0.1·N(0,1) (PyTorch's default scale, all nonzero)."""
    for name, p in module.named_parameters():
        if p.dim() >= 2:
            fan_in = p[0].numel()
            p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) / math.sqrt(fan_in))
        elif "norm" in name and name.endswith("weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(0.02 * torch.randn(p.shape, generator=gen))


def resize_scratch_buffers(flow: torch.nn.Module, frames: int = 1000, steps: int = 16) -> None:
    """Give the upstream streaming scratch buffers this flow's sizes (they are hard-coded for the
    shipped DiT and batch 1): DiT (depth, 2, H, frames, 2D) / (depth, 2, 2C, 2), CFM with a
    leading ``steps`` (the upstream keeps 16)."""
    dec = flow.decoder
    est = dec.estimator
    depth = len(est.blocks)
    attn = est.blocks[0].attn
    hidden = est.in_proj.out_features
    like = est.in_proj.weight
    kw = dict(dtype=like.dtype, device=like.device)
    est.att_cache_buffer = torch.zeros((depth, 2, attn.num_heads, frames, 2 * attn.head_dim), **kw)
    est.cnn_cache_buffer = torch.zeros((depth, 2, 2 * hidden, 2), **kw)
    dec.att_cache_buffer = torch.zeros((steps, *est.att_cache_buffer.shape), **kw)
    dec.cnn_cache_buffer = torch.zeros((steps, *est.cnn_cache_buffer.shape), **kw)


def build_flow(size: FlowSize = TINY, seed: int = 0, *, cfg_rate: float = 0.7) -> torch.nn.Module:
    """A real upstream ``CausalMaskedDiffWithXvec`` with seeded random weights, eval mode, fp32, CPU.

    The estimator's weights come from :meth:`torch_cfm.models.DiT.random_init_` loaded through
    the upstream ``load_state_dict`` (every gate nonzero, unlike the upstream zero init); the
    CFM's ``rand_noise`` is drawn like upstream's, from the global RNG seeded with ``seed``.
    """
    up = load()
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    encoder = up.encoder.UpsampleConformerEncoderV2(
        input_size=size.enc_size, output_size=size.enc_size, pre_lookahead_len=3, num_blocks=size.enc_blocks,
        num_up_blocks=size.enc_up_blocks, up_stride=2, up_scale_factor=2, attention_heads=size.enc_heads,
        linear_units=size.enc_units, dropout_rate=0.0, positional_dropout_rate=0.0, attention_dropout_rate=0.0,
        key_bias=True)
    estimator = up.decoder_dit.DiT(in_channels=320, out_channels=80, mlp_ratio=4.0, depth=size.depth,
                                   num_heads=size.heads, head_dim=size.head_dim, hidden_size=size.hidden)
    # The CFM's constructor allocates 2 GiB of scratch buffers for the shipped sizes whatever the
    # estimator: build it on the meta device, then give it real buffers (resize_scratch_buffers)
    # and the noise the upstream draws, torch.randn([1, 80, 50 * 600]) from the seeded global RNG.
    with torch.device("meta"):
        decoder = up.flow_matching.CausalConditionalCFM(estimator, inference_cfg_rate=cfg_rate)
    decoder.rand_noise = torch.randn([1, decoder.out_channels, 50 * 600])
    flow = up.flow.CausalMaskedDiffWithXvec(input_size=size.enc_size, output_size=80, spk_embed_dim=size.spk_dim,
                                            vocab_size=size.vocab, encoder=encoder, decoder=decoder)
    _random_init_(flow, gen)
    estimator.load_state_dict(TorchCfmDiT(size.dit_config).random_init_(seed + 2).state_dict(), strict=True)
    resize_scratch_buffers(flow, size.buffer_frames)
    return flow.eval()


@dataclass
class Prompt:
    """A stream's prompt as ``Token2wav.set_stream_cache`` passes it to ``flow.setup_cache``."""

    tokens: torch.Tensor  # (1, P_tok + 3) int32, the last 3 = lookahead
    mel: torch.Tensor     # (1, 2 * P_tok, 80)
    spk: torch.Tensor     # (1, spk_dim)

    @property
    def frames(self) -> int:
        return self.mel.shape[1]


def make_prompt(size: FlowSize, prompt_tokens: int, seed: int, device="cpu", dtype=torch.float32) -> Prompt:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, size.vocab, (1, prompt_tokens + 3), generator=gen, dtype=torch.int64)
    mel = torch.randn(1, 2 * prompt_tokens, 80, generator=gen) * 0.5
    spk = torch.randn(1, size.spk_dim, generator=gen)
    return Prompt(tokens.to(device=device, dtype=torch.int32), mel.to(device=device, dtype=dtype),
                  spk.to(device=device, dtype=dtype))


def make_chunks(size: FlowSize, count: int, seed: int, chunk_tokens: int = 25, last_tokens: int = 13,
                device="cpu") -> list[torch.Tensor]:
    """``count`` token chunks as ``Token2wav.stream`` receives them: 25 + 3 lookahead each, the
    last one ``last_tokens`` long (no lookahead: it is flagged ``last_chunk``)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [chunk_tokens + 3] * (count - 1) + [last_tokens]
    return [torch.randint(0, size.vocab, (1, n), generator=gen).to(device=device, dtype=torch.int32)
            for n in lengths]


def trim_stream_cache(cache: dict, prompt_frames: int) -> dict:
    """The cache trims of ``Token2wav.stream`` (after each ``inference_chunk``), reproduced from
    its behaviour for tests that cannot run ``Token2wav`` itself (it hard-codes ``device='cuda'``):
    the estimator attention cache (dim 4) and the conformer attention cache (dim 3) are cut to
    their first ``prompt_frames`` and last 100 frames once longer than ``prompt_frames + 100``."""
    est = cache["estimator_att_cache"]
    if est.shape[4] > prompt_frames + 100:
        cache["estimator_att_cache"] = torch.cat([est[:, :, :, :, :prompt_frames], est[:, :, :, :, -100:]], dim=4)
    conf = cache["conformer_att_cache"]
    if conf.shape[3] > prompt_frames + 100:
        cache["conformer_att_cache"] = torch.cat([conf[:, :, :, :prompt_frames, :], conf[:, :, :, -100:, :]], dim=3)
    return cache


def run_stream(flow, prompt: Prompt, chunks: list[torch.Tensor], n_timesteps: int = 10, trim: bool = True):
    """setup_cache, then inference_chunk per chunk (last flagged) with Token2wav.stream's trims.
    Returns ([chunk mels], the cache after setup_cache (cloned), the final cache)."""
    cache = flow.setup_cache(prompt.tokens, prompt.mel, prompt.spk, n_timesteps=n_timesteps)
    first = {k: v.clone() for k, v in cache.items()}
    mels = []
    for i, tok in enumerate(chunks):
        mel, cache = flow.inference_chunk(tok, prompt.spk, cache, last_chunk=i == len(chunks) - 1,
                                          n_timesteps=n_timesteps)
        mels.append(mel.clone())
        if trim:
            cache = trim_stream_cache(cache, prompt.frames)
    return mels, first, cache


# ---------------------------------------------------------------------------- Token2wav without files
_T2W_STUBS = ("torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi", "s3tokenizer", "onnxruntime",
              "hyperpyyaml")


def _stub(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    mod.__path__ = []  # a package: "import torchaudio.compliance.kaldi" finds the stubbed children
    mod.__dict__.update(attrs)
    return mod


def load_token2wav_class():
    """(``stepaudio2.token2wav.Token2wav``, the real ``HiFTGenerator`` class or None).

    ``token2wav.py`` imports torchaudio, s3tokenizer, onnxruntime and hyperpyyaml (used only by
    ``__init__``/``_prepare_prompt``, which the tests do not call) and HiFT (needs scipy) and
    ``mel_spectrogram`` (needs librosa): each one missing is an empty stub module while it is
    imported, removed from ``sys.modules`` again afterwards."""
    load()
    added = []
    absent = {name.split(".")[0] for name in _T2W_STUBS
              if name.split(".")[0] not in sys.modules and importlib.util.find_spec(name.split(".")[0]) is None}
    for name in _T2W_STUBS:
        if name.split(".")[0] in absent:
            sys.modules[name] = _stub(name, load_hyperpyyaml=None)
            added.append(name)
    if "torchaudio.compliance.kaldi" in added:
        sys.modules["torchaudio"].compliance = sys.modules["torchaudio.compliance"]
        sys.modules["torchaudio.compliance"].kaldi = sys.modules["torchaudio.compliance.kaldi"]
    hift_cls = None
    try:
        if importlib.util.find_spec("scipy") is not None:
            hift_cls = importlib.import_module("stepaudio2.flashcosyvoice.modules.hifigan").HiFTGenerator
        else:
            sys.modules["stepaudio2.flashcosyvoice.modules.hifigan"] = _stub(
                "stepaudio2.flashcosyvoice.modules.hifigan", HiFTGenerator=None)
            added.append("stepaudio2.flashcosyvoice.modules.hifigan")
        if importlib.util.find_spec("librosa") is None or importlib.util.find_spec("scipy") is None:
            sys.modules["stepaudio2.flashcosyvoice.utils.audio"] = _stub(
                "stepaudio2.flashcosyvoice.utils.audio", mel_spectrogram=None)
            added.append("stepaudio2.flashcosyvoice.utils.audio")
        cls = importlib.import_module("stepaudio2.token2wav").Token2wav
    finally:
        for name in added:
            sys.modules.pop(name, None)
    return cls, hift_cls


class RecordingVocoder(torch.nn.Module):
    """``hift`` for a Token2wav built without files: records the mel of every call and returns
    (speech (1, 480·T), source (1, 1, 480·T)) from the real HiFT (random weights) when given,
    else a deterministic stand-in (each frame's mean, repeated over its 480 samples)."""

    def __init__(self, inner: Optional[torch.nn.Module] = None) -> None:
        super().__init__()
        self.inner = inner
        self.mels: list[torch.Tensor] = []

    def forward(self, speech_feat: torch.Tensor, cache_source: Optional[torch.Tensor] = None):
        self.mels.append(speech_feat.detach().clone())
        if self.inner is not None:
            return self.inner(speech_feat, torch.zeros(1, 1, 0, device=speech_feat.device)
                              if cache_source is None else cache_source)
        speech = speech_feat.float().mean(1).repeat_interleave(480, dim=1).tanh()
        return speech, torch.zeros_like(speech)[:, None]


def make_token2wav(cls, flow: torch.nn.Module, prompt: Prompt, *, real_hift=None, n_timesteps: int = 10,
                   float16: bool = False, device: str = "cuda"):
    """A ``Token2wav`` without model files: ``cls.__new__`` and the attributes its ``__init__``
    sets (flow, hift, stream constants), with ``_prepare_prompt`` returning ``prompt`` (it
    would tokenize a wav file). ``float16``: the flag ``Token2wav(float16=True)`` sets (the caller
    halves the flow, as its ``__init__`` does). The class hard-codes ``device='cuda'``: on CPU,
    call its methods inside :func:`token2wav_on_cpu`."""
    import numpy as np

    t2w = cls.__new__(cls)
    t2w.float16 = float16
    t2w.n_timesteps = n_timesteps
    t2w.flow = flow.to(device).eval()
    hift = None
    if real_hift is not None:
        torch.manual_seed(0)
        hift = real_hift().to(device).eval()
    t2w.hift = RecordingVocoder(hift).to(device)
    t2w.cache = None
    t2w.mel_cache_len = 8
    t2w.source_cache_len = int(t2w.mel_cache_len * 480)
    t2w.speech_window = torch.from_numpy(np.hamming(2 * t2w.source_cache_len)).to(device)
    t2w.hift_cache_dict = {}
    tokens = prompt.tokens[:, :-3].to(device)
    prepared = (tokens, torch.tensor([tokens.shape[1]], dtype=torch.int32, device=device), prompt.spk.to(device),
                prompt.mel.to(device), torch.tensor([prompt.frames], dtype=torch.int32, device=device))
    t2w._prepare_prompt = lambda prompt_wav: prepared
    return t2w


class _TorchOnCpu(types.ModuleType):
    """``torch`` as ``token2wav.py`` sees it inside :func:`token2wav_on_cpu`: every attribute is
    torch's, except that the factories it calls with ``device='cuda'`` make CPU tensors."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _cpu(kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return kwargs

    def tensor(self, *args, **kwargs):
        return torch.tensor(*args, **self._cpu(kwargs))

    def zeros(self, *args, **kwargs):
        return torch.zeros(*args, **self._cpu(kwargs))

    def ones(self, *args, **kwargs):
        return torch.ones(*args, **self._cpu(kwargs))


@contextlib.contextmanager
def token2wav_on_cpu(cls):
    """Run ``Token2wav``'s own ``set_stream_cache`` / ``stream`` / ``__call__`` code on CPU: its
    module's ``torch`` global becomes :class:`_TorchOnCpu` (``device='cuda'`` -> CPU; its
    ``torch.amp.autocast("cuda", ...)`` disables itself without CUDA) and, when torchaudio is a
    stub, ``torchaudio.save`` writes the raw float32 samples. Restored on exit."""
    module = sys.modules[cls.__module__]
    saved = {name: module.__dict__[name] for name in ("torch", "torchaudio")}
    module.torch = _TorchOnCpu()
    if getattr(saved["torchaudio"], "__spec__", None) is not None and saved["torchaudio"].__spec__.origin is None:
        module.torchaudio = types.SimpleNamespace(
            save=lambda out, wav, sample_rate, format: out.write(wav.float().numpy().tobytes()))
    try:
        yield
    finally:
        module.__dict__.update(saved)
