"""The vLLM-Omni integration's options, its support checks (which configurations stay on
vLLM-Omni's own path, and why) and its log lines. Imports neither vLLM nor vLLM-Omni."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from typing import Any, Optional

import torch

from ...errors import fail

__all__ = ["Options", "support_reason", "unsupported_reason", "state_base", "log_once", "say", "serving_context",
           "METHODS"]

log = logging.getLogger("torch_cfm.integrations.vllm_omni")

METHODS = ("setup_batch", "decode_batch", "decode_ragged_batch")
_DTYPES = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float32": torch.float32, "fp32": torch.float32}
_LOGGED: set = set()


def log_once(key: str, message: str) -> None:
    """``message`` at WARNING the first time ``key`` is met in this process."""
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.warning("%s", message)


def say(enabled: bool, message: str) -> None:
    if enabled:
        print(f"torch_cfm vLLM-Omni: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def serving_context():
    """What the server runs under: fp32 as the default dtype and no enclosing autocast. vLLM builds
    a model under its own default dtype (bf16, say) and its runner may wrap ``forward`` in bf16
    autocast (vLLM-Omni's backend overrides both for its modules too); the server sets the
    autocast its encoder needs (fp16 for a half flow) itself."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with contextlib.ExitStack() as stack:
            for device in ("cuda", "cpu") if torch.cuda.is_available() else ("cpu",):
                stack.enter_context(torch.autocast(device, enabled=False))
            yield
    finally:
        torch.set_default_dtype(previous)


@dataclasses.dataclass(frozen=True)
class Options:
    """How the Code2Wav backend is served (the keyword arguments of
    :func:`apply_torch_cfm_to_vllm_omni`; the plugin reads them from its environment variable).

    Attributes:
        max_streams: requests served at once (the server's slots; its CFM arenas are allocated
            for them at start). Keep the Code2Wav stage's ``max_num_seqs`` at or below it.
        max_prompt_frames: longest voice prompt (mel frames). vLLM-Omni folds every reference to
            ``ref_audio_max_seconds`` (6 s: 300 frames); a longer prompt falls back.
        max_chunk_tokens: longest chunk one server step takes (25 + 3 lookahead); a longer
            chunk is decoded as consecutive chunks of this size.
        max_memory_bytes: optional admission budget over the per-request bytes of every stage.
        dtype: the CFM's dtype (default: the flow's, i.e. fp16 with ``token2wav_float16``).
        graphs: CUDA graphs (default: on CUDA).
        warmup: run :meth:`TorchCfmBatchedToken2Wav.warmup` when applied (default: with graphs).
        warmup_last_chunk_tokens: last-chunk lengths the warm-up covers (default: every length
            from the lookahead to ``max_chunk_tokens``, all a Code2Wav stream can end with).
        vocoder_seed: the HiFT source's random state per stream: None draws each stream's seed
            from torch's default generator at ``setup_batch``; an int seeds every stream with it
            (each stream's waveform is then that of the stream decoded alone after
            ``torch.manual_seed(vocoder_seed)``).
        encoder_batching: the server's conformer batching (True, "ragged" or False).
        vocoder: the server's HiFT stage: "auto" (torch_cfm's many-stream HiFT, a counter-based
            random stream per stream seeded by ``vocoder_seed``) or "upstream" (the HiFT module
            itself, each stream's source on its own state of the default generator).
        progress: print the warm-up's progress lines (stderr).
    """

    max_streams: int = 16
    max_prompt_frames: int = 300
    max_chunk_tokens: int = 28
    max_memory_bytes: Optional[int] = None
    dtype: Optional[torch.dtype] = None
    graphs: Optional[bool] = None
    warmup: Optional[bool] = None
    warmup_last_chunk_tokens: Optional[tuple] = None
    vocoder_seed: Optional[int] = None
    encoder_batching: Any = True
    vocoder: str = "auto"
    progress: bool = True

    def __post_init__(self) -> None:
        op = "apply_torch_cfm_to_vllm_omni"
        for name in ("max_streams", "max_prompt_frames", "max_chunk_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                fail(op, name, "be a positive int", repr(value))
        if self.max_chunk_tokens < 8:
            fail(op, "max_chunk_tokens", "be >= 8 (a first chunk carries 4 tokens + 3 lookahead)",
                 str(self.max_chunk_tokens))
        for name in ("max_memory_bytes", "vocoder_seed"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                fail(op, name, "be a non-negative int or None", repr(value))
        if isinstance(self.dtype, str):
            if self.dtype not in _DTYPES:
                fail(op, "dtype", f"be one of {sorted(_DTYPES)} or a torch.dtype", repr(self.dtype))
            object.__setattr__(self, "dtype", _DTYPES[self.dtype])
        if self.dtype is not None and self.dtype not in _DTYPES.values():
            fail(op, "dtype", "be torch.float16, torch.bfloat16, torch.float32 or None", repr(self.dtype))
        if self.vocoder not in ("auto", "upstream"):
            fail(op, "vocoder", 'be "auto" or "upstream"', repr(self.vocoder))
        if self.encoder_batching not in (True, False, "ragged"):
            fail(op, "encoder_batching", 'be True, False or "ragged"', repr(self.encoder_batching))
        if self.warmup_last_chunk_tokens is not None:
            object.__setattr__(self, "warmup_last_chunk_tokens", tuple(int(n) for n in self.warmup_last_chunk_tokens))


# ---------------------------------------------------------------------------------------- support
def _device_reason(name: str, module: Any) -> Optional[str]:
    param = next(module.parameters(), None) if isinstance(module, torch.nn.Module) else None
    if param is None:
        return f"unknown layout: the {name} is not a module with parameters ({type(module).__name__})"
    if param.device.type not in ("cuda", "cpu"):
        return (f"the {name} is on a {param.device.type} device: vLLM-Omni's own path (and its "
                f"{param.device.type.upper()} patches) serves it")
    return None


def support_reason(flow: Any, hift: Any, trt_stepper: Any, state_base: Any) -> Optional[str]:
    """Why these parts cannot be served by torch_cfm (None: they can, as far as attributes tell)."""
    if trt_stepper is not None:
        return "the DiT estimator runs on TensorRT (token2wav_trt / MINICPMO_TOKEN2WAV_TRT)"
    for name, module in (("flow", flow), ("hift", hift)):
        reason = _device_reason(name, module)
        if reason is not None:
            return reason
    fields = {f.name for f in dataclasses.fields(state_base)} if dataclasses.is_dataclass(state_base) else set()
    if not {"flow_cache", "hift_cache"} <= fields:
        return "unknown layout: the backend's module has no BatchedToken2WavState(flow_cache, hift_cache) dataclass"
    return None


def state_base(backend_cls: type) -> Any:
    return getattr(sys.modules.get(backend_cls.__module__), "BatchedToken2WavState", None)


def unsupported_reason(backend: Any) -> Optional[str]:
    """Why ``backend`` stays on vLLM-Omni's own path (None: torch_cfm can serve it)."""
    missing = [n for n in ("flow", "hift", "n_timesteps", *METHODS) if not hasattr(backend, n)]
    if missing:
        return f"unknown layout: the backend has no {', '.join(missing)}"
    return support_reason(backend.flow, backend.hift, getattr(backend, "_trt_stepper", None),
                          state_base(type(backend)))
