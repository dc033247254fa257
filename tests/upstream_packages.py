"""Upstream packages that install the same top-level name, each imported in isolation.

``stepaudio2-minicpmo`` 0.1.1 (installed in the environment) and ``minicpmo-utils`` 1.0.7 (what
MiniCPM-o 4.5 requires) both install ``stepaudio2``, so one process can import only one of them.
The scheme:

* each extra package is installed ``--no-deps`` into its own folder, ``<cache>/<name>``, where
  ``<cache>`` is ``$UPSTREAM_PACKAGES_DIR`` or ``<repo>/.upstream`` (CI:
  ``python3 -m pip install -q --no-deps --target .upstream/minicpmo-utils minicpmo-utils==1.0.7``);
  :func:`missing_reason` says why one cannot be used (the test modules skip with it);
* its tests run in a child interpreter (:func:`run_isolated`: ``python -m pytest <file>``) with
  ``UPSTREAM_PACKAGE=<name>`` and ``STEPAUDIO2_PATH=<cache>/<name>``. ``upstream_flow.load``
  then registers a bare parent package ``stepaudio2`` whose ``__path__`` is that folder alone,
  so every ``stepaudio2.*`` import resolves there and never in site-packages (the folder itself
  is not put on ``sys.path``: its other top-level packages stay hidden too).
  :func:`check_isolated` verifies it from inside the child;
* a test module decorates its tests with :func:`isolated` (collected only inside the child) and
  holds launcher tests (collected only outside; one per marker selection, e.g. ``not gpu`` and a
  ``gpu``-marked one for ``gpu``) that run the module in the child; a failure there fails the
  launcher with the child's output in its message.

Only submodules are imported (``stepaudio2/__init__.py`` imports the TTS stack). For
minicpmo-utils' ``token2wav.py`` the TTS-stack modules it imports at top level (torchaudio,
s3tokenizer, onnxruntime, hyperpyyaml, yaml, and librosa through the mel function's module) are
empty stub modules while it is imported, when absent (:func:`load_minicpmo_token2wav`), and
:func:`make_minicpmo_token2wav` builds a ``Token2wav`` without a checkpoint folder: ``__new__``
plus the attributes its ``__init__`` sets, with a flow (``upstream_flow.build_flow``), a causal
HiFT and the original HiFT at small or shipped sizes with random weights.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import tempfile
import types
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACTIVE_ENV = "UPSTREAM_PACKAGE"
PACKAGES = {"minicpmo-utils": "1.0.7"}


def cache_dir() -> str:
    return os.environ.get("UPSTREAM_PACKAGES_DIR") or os.path.join(ROOT, ".upstream")


def folder(name: str) -> str:
    return os.path.join(cache_dir(), name)


def install_command(name: str) -> str:
    return f"python3 -m pip install -q --no-deps --target .upstream/{name} {name}=={PACKAGES[name]}"


def missing_reason(name: str) -> Optional[str]:
    """Why package ``name`` cannot be tested here (None when it can)."""
    path = folder(name)
    if not os.path.isdir(os.path.join(path, "stepaudio2")):
        return f"{name} {PACKAGES[name]} is not installed at {path} ({install_command(name)})"
    dist = name.replace("-", "_") + "-" + PACKAGES[name] + ".dist-info"
    if not os.path.isdir(os.path.join(path, dist)):
        found = sorted(d for d in os.listdir(path) if d.endswith(".dist-info"))
        return f"{path} does not hold {name} {PACKAGES[name]} (found {found}; {install_command(name)})"
    for dep in ("einops", "numpy", "scipy"):
        if importlib.util.find_spec(dep) is None:
            return f"{name}'s flow and vocoder modules need {dep}"
    return None


def active() -> Optional[str]:
    """The package this interpreter was started for by :func:`run_isolated` (None: the main session)."""
    return os.environ.get(ACTIVE_ENV) or None


def isolated(name: str):
    """Decorator: collect the test only inside ``name``'s child interpreter."""
    def mark(fn):
        fn.__test__ = active() == name
        return fn
    return mark


def check_isolated(name: str) -> list[str]:
    """Every loaded ``stepaudio2`` module that is not from ``name``'s folder (empty: isolated)."""
    root = os.path.realpath(folder(name))
    bad = []
    for mod_name, mod in list(sys.modules.items()):
        if mod_name != "stepaudio2" and not mod_name.startswith("stepaudio2."):
            continue
        paths = list(getattr(mod, "__path__", []) or []) or [getattr(mod, "__file__", None)]
        for path in paths:
            if path is not None and not os.path.realpath(path).startswith(root + os.sep):
                bad.append(f"{mod_name} from {path}")
    return bad


def reexec_isolated(name: str, script: str, argv: list, op: str) -> None:
    """Re-execute ``script`` with ``argv`` in an interpreter whose ``stepaudio2`` is package
    ``name``'s alone; returns at once inside that interpreter. Raises SystemExit when this one
    has imported another ``stepaudio2`` already (nothing can be unloaded)."""
    path = os.path.realpath(folder(name))
    here = os.environ.get("STEPAUDIO2_PATH")
    if active() == name and here and os.path.realpath(here) == path:
        return
    if "stepaudio2" in sys.modules:
        raise SystemExit(f"{op}: stepaudio2 is imported already; run with {ACTIVE_ENV}={name} STEPAUDIO2_PATH={path}")
    env = dict(os.environ, **{ACTIVE_ENV: name, "STEPAUDIO2_PATH": path})
    os.execve(sys.executable, [sys.executable, os.path.abspath(script), *argv], env)


@dataclass
class IsolatedRun:
    returncode: int
    tests: int
    failures: int
    errors: int
    skipped: int
    output: str


def run_isolated(name: str, test_file: str, args: tuple[str, ...] = (), timeout: float = 1800,
                 **env_extra: str) -> IsolatedRun:
    """Run ``pytest test_file`` in a child interpreter isolated for package ``name`` (``env_extra``:
    more environment variables for it)."""
    env = dict(os.environ, **{ACTIVE_ENV: name, "STEPAUDIO2_PATH": folder(name)}, **env_extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    handle, report = tempfile.mkstemp(prefix=f"{name}-", suffix=".xml")
    os.close(handle)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=-ra",
           f"--junitxml={report}", test_file, *args]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    try:
        suite = ET.parse(report).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in counts}
    except (OSError, ET.ParseError, AttributeError):
        pass
    finally:
        if os.path.exists(report):
            os.remove(report)
    return IsolatedRun(res.returncode, output=res.stdout + res.stderr, **counts)



def run_child_session(name: str, test_file: str, marker: str, **env: str) -> None:
    """Launcher-test body: run ``test_file``'s tests marked ``marker`` isolated for ``name``.

    Skips when the package is not installed or every child test skipped; fails on any child
    failure or error, showing the end of the child's output."""
    import pytest

    reason = missing_reason(name)
    if reason is not None:
        pytest.skip(reason)
    run = run_isolated(name, os.path.abspath(test_file), ("-m", marker), **env)
    tail = run.output[-6000:]
    assert run.returncode == 0 and run.failures == 0 and run.errors == 0, f"child session failed:\n{tail}"
    if run.tests == run.skipped:
        pytest.skip(f"every test skipped in the child session:\n{tail}")
    print(f"child session: {run.tests} tests, {run.skipped} skipped")

# ---------------------------------------------------------------------------- minicpmo-utils' Token2wav
_T2W_STUBS = ("torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi", "s3tokenizer", "onnxruntime",
              "hyperpyyaml", "yaml")


def _stub(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    mod.__path__ = []
    mod.__dict__.update(attrs)
    return mod


def _save_raw(out, wav, sample_rate, format):  # noqa: A002 - torchaudio.save's signature
    out.write(wav.float().numpy().tobytes())


def load_minicpmo_token2wav() -> types.SimpleNamespace:
    """minicpmo-utils' modules: ``token2wav`` (the module), ``Token2wav``, ``BoundedVocoder``,
    ``CausalHiFTGenerator``, ``CausalConvRNNF0Predictor``, ``HiFTGenerator``, ``ConvRNNF0Predictor``.

    Each absent TTS-stack module imported by ``token2wav.py`` is a stub while it is imported
    (removed from ``sys.modules`` after); a stub ``torchaudio`` keeps a ``save`` that writes the
    raw float32 samples (what ``Token2wav.__call__`` returns then)."""
    import upstream_flow as U

    U.load()
    if "stepaudio2.token2wav" not in sys.modules:
        added = []
        absent = {n.split(".")[0] for n in _T2W_STUBS
                  if n.split(".")[0] not in sys.modules and importlib.util.find_spec(n.split(".")[0]) is None}
        for name in _T2W_STUBS:
            if name.split(".")[0] in absent:
                sys.modules[name] = _stub(name, load_hyperpyyaml=None, save=_save_raw)
                added.append(name)
        if "torchaudio.compliance.kaldi" in added:
            sys.modules["torchaudio"].compliance = sys.modules["torchaudio.compliance"]
            sys.modules["torchaudio.compliance"].kaldi = sys.modules["torchaudio.compliance.kaldi"]
        if importlib.util.find_spec("librosa") is None:
            sys.modules["stepaudio2.flashcosyvoice.utils.audio"] = _stub("stepaudio2.flashcosyvoice.utils.audio",
                                                                          mel_spectrogram=None)
            added.append("stepaudio2.flashcosyvoice.utils.audio")
        try:
            importlib.import_module("stepaudio2.token2wav")
        finally:
            for name in added:
                sys.modules.pop(name, None)
    t2w = sys.modules["stepaudio2.token2wav"]
    return types.SimpleNamespace(
        token2wav=t2w, Token2wav=t2w.Token2wav, BoundedVocoder=t2w.BoundedVocoder,
        CausalHiFTGenerator=t2w.CausalHiFTGenerator, CausalConvRNNF0Predictor=t2w.CausalConvRNNF0Predictor,
        HiFTGenerator=t2w.HiFTGenerator,
        ConvRNNF0Predictor=importlib.import_module("stepaudio2.flashcosyvoice.modules.hifigan").ConvRNNF0Predictor)


# The shipped CosyVoice3 vocoder (MiniCPM-o 4.5's token2wav/config.yaml `hift`); tests shrink widths only,
# so the frame counts (f0 context 8/3, decoder history 31, delay 8) are the shipped ones.
CAUSAL_HIFT = dict(in_channels=80, base_channels=512, nb_harmonics=8, sampling_rate=24000, nsf_alpha=0.1,
                   nsf_sigma=0.003, nsf_voiced_threshold=10, upsample_rates=[8, 5, 3],
                   upsample_kernel_sizes=[16, 11, 7], istft_params={"n_fft": 16, "hop_len": 4},
                   resblock_kernel_sizes=[3, 7, 11], resblock_dilation_sizes=[[1, 3, 5]] * 3,
                   source_resblock_kernel_sizes=[7, 7, 11], source_resblock_dilation_sizes=[[1, 3, 5]] * 3,
                   lrelu_slope=0.1, audio_limit=0.99, conv_pre_look_right=4)
TINY_CAUSAL = dict(base_channels=16, f0_channels=16)
SHIPPED_CAUSAL = dict(base_channels=512, f0_channels=512)


@torch.no_grad()
def build_causal_hift(mods, seed: int = 0, *, base_channels: int = 16, f0_channels: int = 16,
                      table_samples: Optional[int] = None) -> torch.nn.Module:
    """A real ``CausalHiFTGenerator`` (eval, float32, CPU) with seeded random weights: the
    module's own init, weight-norm magnitudes in [0.4, 1) (log-magnitudes before the inverse STFT
    within about ±3, as a trained vocoder's) and an f0 head giving voiced and unvoiced frames;
    ``table_samples`` shortens the fixed noise table (the upstream keeps 300 s)
    so that short test streams wrap around it."""
    torch.manual_seed(seed)
    f0 = mods.CausalConvRNNF0Predictor(num_class=1, in_channels=80, cond_channels=f0_channels)
    model = mods.CausalHiFTGenerator(**dict(CAUSAL_HIFT, base_channels=base_channels), f0_predictor=f0).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if name.endswith("original0"):  # weight-norm magnitude: unit-ish gain per layer
            p.copy_(0.4 + 0.6 * torch.rand(p.shape, generator=gen))
        elif name.endswith("bias"):
            p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    # the f0 head: |linear| over ELU features, scaled so that f0 spans unvoiced (< 10 Hz) frames to ~400 Hz
    f0.classifier.weight.mul_(1500.0)
    sine = model.m_source.l_sin_gen
    if table_samples is not None:
        sine.sine_waves = sine.sine_waves[:, :table_samples].clone()
    model.m_source.uv = model.m_source.uv[:, :1].clone()  # unused by the streaming path; frees 29 MB
    return model


def build_original_hift(mods, seed: int = 0, **sizes) -> torch.nn.Module:
    """The original (non-causal) ``HiFTGenerator`` that ``Token2wav.__call__`` uses, small."""
    torch.manual_seed(seed)
    kw = dict(base_channels=8, resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1]],
              source_resblock_kernel_sizes=[3, 3, 3], source_resblock_dilation_sizes=[[1], [1], [1]])
    kw.update(sizes)
    return mods.HiFTGenerator(f0_predictor=mods.ConvRNNF0Predictor(cond_channels=16), **kw).eval()


def make_minicpmo_token2wav(mods, flow: torch.nn.Module, prompt, *, hift: torch.nn.Module,
                            original_hift: Optional[torch.nn.Module] = None, n_timesteps: int = 10,
                            float16: bool = False, device: str = "cpu", prompt_wav: str = "prompt.wav"):
    """minicpmo-utils' ``Token2wav`` without model files: ``__new__`` and the attributes its
    ``__init__`` sets, with ``prompt`` (``upstream_flow.Prompt``) already prepared for
    ``prompt_wav`` in its per-prompt cache, the causal ``hift`` wrapped in its own
    ``BoundedVocoder`` and ``original_hift`` loaded (``__call__``'s vocoder)."""
    t2w = mods.Token2wav.__new__(mods.Token2wav)
    t2w.float16, t2w.n_timesteps = float16, n_timesteps
    t2w.device = torch.device(device)
    t2w.model_path = None
    t2w.flow = flow.to(device).eval()
    t2w.hift = hift.float().to(device).eval()
    t2w.vocoder_checkpoint = t2w.vocoder_config = None
    t2w.bounded_vocoder = mods.BoundedVocoder(t2w.hift)
    t2w.sample_rate, t2w.hop_samples = 24000, 480
    t2w.vocoder_delay_frames = t2w.hift.f0_predictor.condnet[0].causal_padding + t2w.hift.conv_pre_look_right + 1
    t2w.vocoder_delay_samples = t2w.vocoder_delay_frames * t2w.hop_samples
    t2w.source_cache_len = t2w.vocoder_delay_samples
    t2w.original_vocoder_checkpoint = None
    t2w.original_hift = None if original_hift is None else original_hift.to(device).eval()
    t2w.stream_cache, t2w.hift_cache_dict, t2w._stream_prompt = None, {}, None
    tokens = prompt.tokens[:, :-3].to(device)
    t2w.cache = {prompt_wav: (tokens, torch.tensor([tokens.shape[1]], dtype=torch.int32, device=device),
                              prompt.spk.to(device), prompt.mel.to(device),
                              torch.tensor([prompt.frames], dtype=torch.int32, device=device))}
    return t2w
