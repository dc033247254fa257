"""vLLM-Omni's MiniCPM-o 4.5 token2wav backend, loaded from the real wheel without vLLM.

``vllm_omni/__init__.py`` imports vLLM (and patches it); the backend module
``vllm_omni.model_executor.models.minicpmo_4_5.batched_token2wav`` and the HiFT it drives
(``...cosyvoice3.code2wav_core.hifigan``) need only torch, scipy, ``vllm.logger.init_logger`` and
``vllm.platforms.current_platform.get_global_graph_pool``. :func:`vllm_stub` puts a two-attribute
stand-in for those in ``sys.modules`` and bare parent packages for ``vllm_omni`` and
``vllm_omni.model_executor.models`` (their ``__path__`` is the installed directory, so only the
leaf modules' own files run), and removes every ``vllm``/``vllm_omni`` module it added on exit. Install the wheel with
``pip install --no-deps vllm-omni==0.30.0``.

Builders: the vLLM-Omni ``HiFTGenerator`` (tiny, or the shipped 24 kHz configuration of
``StepAudio2Token2WavCore``, with ``stepaudio2``'s ``ConvRNNF0Predictor``, the same layers as
vLLM-Omni's), the ``token2wav`` object ``BatchedToken2Wav`` reads (the attributes
``MiniCPMO45Token2wav`` exposes) and ``PromptFeatures`` from a test prompt.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
import types
from typing import Optional

import numpy as np
import torch

import upstream_flow as U

TARGET = "vllm_omni.model_executor.models.minicpmo_4_5.batched_token2wav"
HIFIGAN = "vllm_omni.model_executor.models.cosyvoice3.code2wav_core.hifigan"
SILENCE = 4218  # BatchedToken2Wav pads a prompt's lookahead with this token
# The deploy YAMLs' Code2Wav settings (vllm_omni/deploy/minicpmo_4_5*.yaml, connector extra)
YAML_CONNECTOR = {"codec_chunk_frames": 25, "codec_left_context_frames": 3}
YAML_HIFT_GRAPH = {"enabled": True, "capture_batch_sizes": [1]}
YAML_CFM_GRAPH = {"enabled": True, "max_graphs": 32, "bucket_frames": 16}
TINY_HIFT = dict(base_channels=8, resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1]],
                 source_resblock_kernel_sizes=[3, 3, 3], source_resblock_dilation_sizes=[[1], [1], [1]])
SHIPPED_HIFT = dict(source_resblock_kernel_sizes=[7, 7, 11], source_resblock_dilation_sizes=[[1, 3, 5]] * 3)


def missing_reason() -> Optional[str]:
    """Why the backend cannot be loaded here (None: it can)."""
    reason = U.missing_reason()
    if reason is not None:
        return reason
    for name, hint in (("vllm_omni", "pip install --no-deps vllm-omni==0.30.0"), ("scipy", "pip install scipy")):
        if importlib.util.find_spec(name) is None:
            return f"{name} is not installed ({hint})"
    return None


def _package(name: str, path: Optional[str]) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    mod.__spec__.submodule_search_locations = [path] if path else []
    mod.__path__ = [path] if path else []
    return mod


@contextlib.contextmanager
def vllm_stub():
    """``vllm`` as two attributes, and bare ``vllm_omni`` parents, for the ``with`` block.

    Yields a namespace with ``root`` (the installed ``vllm_omni`` folder) and ``new_process()``: a
    process builds one backend in vLLM, and its graph pool dies with that backend's graphs (the
    caching allocator refuses a capture into a released pool), so a caller that builds backends one
    after another calls it before each build."""
    before = set(sys.modules)
    root = list(importlib.util.find_spec("vllm_omni").submodule_search_locations)[0]
    pools: list = []

    def global_graph_pool():  # vLLM keeps one graph pool per process
        if not pools:
            pools.append(torch.cuda.graph_pool_handle())
        return pools[0]

    logger = _package("vllm.logger", None)
    logger.init_logger = logging.getLogger
    platforms = _package("vllm.platforms", None)
    platforms.current_platform = types.SimpleNamespace(get_global_graph_pool=global_graph_pool)
    added = {"vllm": _package("vllm", None), "vllm.logger": logger, "vllm.platforms": platforms,
             "vllm_omni": _package("vllm_omni", root),
             "vllm_omni.model_executor.models": _package("vllm_omni.model_executor.models",
                                                         os.path.join(root, "model_executor", "models"))}
    saved = {name: sys.modules[name] for name in added if name in sys.modules}
    sys.modules.update(added)
    try:
        yield types.SimpleNamespace(root=root, new_process=pools.clear)
    finally:  # only vLLM's and vLLM-Omni's names: an extension module (scipy, ...) cannot be loaded twice
        for name in set(sys.modules) - before:
            if name.split(".")[0] in ("vllm", "vllm_omni"):
                sys.modules.pop(name, None)
        sys.modules.update(saved)


def load_backend_module():
    """The real ``batched_token2wav`` module (inside :func:`vllm_stub`)."""
    U.load()
    return importlib.import_module(TARGET)


def build_hift(seed: int = 3, *, shipped: bool = False) -> torch.nn.Module:
    """vLLM-Omni's ``HiFTGenerator`` at 24 kHz (480 samples per mel frame), seeded, eval."""
    hifigan = importlib.import_module(HIFIGAN)
    f0 = importlib.import_module("stepaudio2.flashcosyvoice.modules.hifigan").ConvRNNF0Predictor
    torch.manual_seed(seed)
    sizes = SHIPPED_HIFT if shipped else TINY_HIFT
    predictor = f0() if shipped else f0(cond_channels=16)
    return hifigan.HiFTGenerator(sampling_rate=24000, upsample_rates=[8, 5, 3], upsample_kernel_sizes=[16, 11, 7],
                                 f0_predictor=predictor, **sizes).eval()


def make_token2wav(flow: torch.nn.Module, hift: torch.nn.Module, n_timesteps: int, float16: bool = False):
    """What ``BatchedToken2Wav`` reads of ``MiniCPMO45Token2wav``: the modules and stream constants."""
    device = next(hift.parameters()).device
    window = torch.from_numpy(np.hamming(2 * 8 * 480)).to(device=device, dtype=torch.float32)
    return types.SimpleNamespace(flow=flow, hift=hift, float16=float16, n_timesteps=n_timesteps, mel_cache_len=8,
                                 source_cache_len=8 * 480, speech_window=window)


def features(bt, prompt: U.Prompt, key: str):
    """``PromptFeatures`` of a test prompt (its tokens without the 3 lookahead tokens)."""
    return bt.PromptFeatures(cache_key=(key, f"{key}.wav"), speech_tokens=prompt.tokens[:, :-3],
                             speaker_embedding=prompt.spk, mels=prompt.mel)


def padded_prompt(prompt: U.Prompt) -> U.Prompt:
    """The prompt as ``BatchedToken2Wav.setup_batch`` solves it: lookahead = 3 silence tokens."""
    tokens = prompt.tokens.clone()
    tokens[:, -3:] = SILENCE
    return U.Prompt(tokens, prompt.mel, prompt.spk)


class HiftInference:
    """vLLM-Omni's HiFT as ``Token2wav.stream`` calls its vocoder: ``hift(mel, cache_source)``."""

    def __init__(self, hift: torch.nn.Module) -> None:
        self.hift, self.m_source = hift, hift.m_source

    def __call__(self, mel: torch.Tensor, cache_source: torch.Tensor):
        return self.hift.inference(mel, cache_source)
