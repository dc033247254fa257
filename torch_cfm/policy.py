"""The dispatch policy of docs/design.md §5: one function, used by eager dispatch, compile passes and explain.

``decide()`` answers "which path runs for this device/dtype/TF32 state?" and returns a
:class:`Decision` whose ``reasons`` say why whenever the answer is "not fused". ``TORCH_CFM_*``
environment variables are read here and nowhere else.

    >>> d = decide(torch.device("cpu"), torch.float16)
    >>> d.fused, d.reasons
    (False, ['needs a CUDA device, found cpu'])
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass, field
from typing import Iterator, Mapping, NamedTuple, Optional

import torch

from .config import ATTENTION_DTYPES, MIN_CAPABILITY

ENV_FUSED = "TORCH_CFM_FUSED"
ENV_TF32 = "TORCH_CFM_TF32"
ENV_PDL = "TORCH_CFM_PDL"
ENV_ATTENTION_KERNEL = "TORCH_CFM_ATTENTION_KERNEL"
ENV_VLLM_OMNI = "TORCH_CFM_VLLM_OMNI"  # the vLLM-Omni plugin's switch and options (integrations/vllm_omni)
ATTENTION_KERNEL_CHOICES = ("auto", "triton", "cuda")
PDL_MIN_CAPABILITY = (9, 0)  # griddepcontrol (programmatic dependent launch) is SM90+

_TRUE = {"1", "true", "on", "yes"}
_FALSE = {"0", "false", "off", "no"}


@dataclass(frozen=True)
class Decision:
    """What runs, and why.

    Attributes:
        fused: the fused DiT body / compile-rule swap is used.
        backend: the kernels that exist here: "sm80" (NVIDIA SM80+: torch_cfm's Triton kernels and,
            where built, its CUDA kernels), "sdpa" (older CUDA: attention through SDPA, no fused
            body) or "reference" (CPU and others: plain PyTorch and the C++ CPU kernel).
        attention_kernel: the kernel ``cfm_attention`` runs here: "cuda" (the optional CUDA kernel
            is built and allowed, and covers this dtype; a call whose shape it does not cover runs
            Triton), "triton", "sdpa" or "reference".
        precision: dot precision for fp32 inputs, "tf32" or "ieee"; None for fp16/bf16.
        tf32: whether TF32 is allowed (after env > explicit > torch setting).
        reasons: why ``fused`` is False (empty when fused); each a short clause with the numbers.
        source: what settled ``fused``: "policy", "argument" or "env".
    """

    fused: bool
    backend: str
    attention_kernel: str
    precision: Optional[str]
    tf32: bool
    reasons: tuple[str, ...] = field(default_factory=tuple)
    source: str = "policy"

    def describe(self) -> str:
        verdict = "fused" if self.fused else "reference"
        extra = f" [{self.source}]" if self.source != "policy" else ""
        prec = f", precision={self.precision}" if self.precision else ""
        why = f" — {'; '.join(self.reasons)}" if self.reasons else ""
        return f"{verdict}{extra} (backend={self.backend}, attention={self.attention_kernel}{prec}){why}"


def env_setting(name: str, env: Optional[Mapping[str, str]] = None) -> str:
    """The raw value of a ``TORCH_CFM_*`` variable ("" when unset), for the readers of the settings
    that are not dispatch decisions (the vLLM-Omni plugin's options)."""
    if not name.startswith("TORCH_CFM_"):
        raise ValueError(f"env_setting: name must be a TORCH_CFM_* variable, got {name!r}")
    return (os.environ if env is None else env).get(name, "")


def _parse_flag(env: Mapping[str, str], name: str) -> Optional[bool]:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name} must be one of 1/0/on/off/true/false, got {raw!r}")


def torch_tf32_enabled() -> bool:
    """The ambient ``torch.backends.cuda.matmul`` TF32 setting (works on torch 2.11-2.13)."""
    try:
        return bool(torch.backends.cuda.matmul.allow_tf32)
    except RuntimeError:
        # torch refuses the legacy flag once the new fp32_precision API was used: read that instead.
        return str(getattr(torch.backends.cuda.matmul, "fp32_precision", "ieee")) == "tf32"


def tf32_allowed(tf32: Optional[bool] = None, env: Optional[Mapping[str, str]] = None) -> bool:
    """TF32 allowed? env ``TORCH_CFM_TF32`` > explicit ``tf32`` > torch's matmul setting."""
    env = os.environ if env is None else env
    from_env = _parse_flag(env, ENV_TF32)
    if from_env is not None:
        return from_env
    if tf32 is not None:
        return bool(tf32)
    return torch_tf32_enabled()


def device_capability(device: torch.device) -> Optional[tuple[int, int]]:
    """(major, minor) of an NVIDIA CUDA device, None for anything else (CPU, HIP, ...)."""
    if device.type != "cuda" or torch.version.hip is not None or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_capability(index)


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    # Cached: the eager hot path asks once per call and the answer never changes.
    return torch.cuda.get_device_capability(index)


def pdl_allowed(device: torch.device, env: Optional[Mapping[str, str]] = None,
                capability: Optional[tuple[int, int]] = None) -> bool:
    """May Triton kernels on ``device`` use programmatic dependent launch? NVIDIA SM90+ and env
    ``TORCH_CFM_PDL`` not off. A launch detail, not part of the fused/reference decision: whether
    a given launch uses it is the kernel's rule (e.g. ``kernels.cfm_attention.use_pdl``).
    ``capability`` overrides the device query (tests, explain for another machine)."""
    env = os.environ if env is None else env
    if _parse_flag(env, ENV_PDL) is False:
        return False
    if capability is None:
        capability = device_capability(device)
    return device.type == "cuda" and capability is not None and tuple(capability) >= PDL_MIN_CAPABILITY


@functools.lru_cache(maxsize=None)
def _cuda_extension_present() -> bool:
    """Whether the optional CUDA extension ``torch_cfm._C_cuda`` was built (whether it loads is
    checked where it is used: ``kernels.cfm_attention_cuda``)."""
    import importlib.util

    return importlib.util.find_spec("torch_cfm._C_cuda") is not None


def attention_kernel_choice(env: Optional[Mapping[str, str]] = None) -> str:
    """Which SM80+ kernel ``cfm_attention`` may use, from env ``TORCH_CFM_ATTENTION_KERNEL``.

    "auto" (default): the hand-written CUDA kernel (optional build, ``torch_cfm._C_cuda``) where it
    covers the call and its tile rule picks it, Triton otherwise; "triton": always Triton; "cuda":
    the CUDA kernel, and a ValueError with its reasons where it does not cover the call. A launch
    detail of the decision's ``backend == "sm80"``, read at call
    (or capture / trace) time like the TF32 setting."""
    env = os.environ if env is None else env
    raw = env.get(ENV_ATTENTION_KERNEL, "").strip().lower() or "auto"
    if raw not in ATTENTION_KERNEL_CHOICES:
        raise ValueError(f"{ENV_ATTENTION_KERNEL} must be one of {ATTENTION_KERNEL_CHOICES}, "
                         f"got {env.get(ENV_ATTENTION_KERNEL)!r}")
    return raw


def decide(
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    tf32: Optional[bool] = None,
    fused: Optional[bool] = None,
    capability: Optional[tuple[int, int]] = None,
    env: Optional[Mapping[str, str]] = None,
) -> Decision:
    """Decide the path for a computation in ``dtype`` on ``device`` (docs/design.md §5).

    Args:
        device: where the tensors live.
        dtype: the compute dtype (float16, bfloat16 or float32).
        tf32: explicit TF32 permission for fp32; None follows torch's matmul setting.
        fused: explicit override; env ``TORCH_CFM_FUSED`` wins over it.
        capability: pretend the CUDA device has this capability (tests, explain for other GPUs).
        env: environment mapping (default ``os.environ``).
    Returns:
        a :class:`Decision`.
    """
    env = os.environ if env is None else env
    device = torch.device(device)
    allow_tf32 = tf32_allowed(tf32, env)
    if capability is None:
        capability = device_capability(device)
    is_nvidia = device.type == "cuda" and torch.version.hip is None

    if device.type == "cuda" and is_nvidia and capability is not None and capability >= MIN_CAPABILITY:
        backend = "sm80"
    elif device.type == "cuda":
        backend = "sdpa"
    else:
        backend = "reference"

    reasons: list[str] = []
    if device.type != "cuda":
        reasons.append(f"needs a CUDA device, found {device.type}")
    elif not is_nvidia:
        reasons.append("needs NVIDIA CUDA, found HIP/ROCm")
    elif capability is None:
        reasons.append("CUDA device capability unknown (no CUDA runtime)")
    elif capability < MIN_CAPABILITY:
        reasons.append(f"needs NVIDIA SM{MIN_CAPABILITY[0]}{MIN_CAPABILITY[1]}+, "
                       f"found SM{capability[0]}{capability[1]}")
    if dtype not in ATTENTION_DTYPES:
        reasons.append(f"dtype must be float16/bfloat16/float32, found {dtype}")
    elif dtype == torch.float32 and not allow_tf32:
        reasons.append("fp32 with TF32 off")

    precision: Optional[str] = None
    if dtype == torch.float32:
        precision = "tf32" if allow_tf32 else "ieee"
    attention_kernel = backend
    if backend == "sm80":
        covered = dtype in (torch.float16, torch.bfloat16) or precision == "tf32"
        cuda = covered and _cuda_extension_present() and attention_kernel_choice(env) != "triton"
        attention_kernel = "cuda" if cuda else "triton"

    override, source = _parse_flag(env, ENV_FUSED), "env"
    if override is None and fused is not None:
        override, source = bool(fused), "argument"
    if override is not None:
        if override and (device.type != "cuda" or dtype not in ATTENTION_DTYPES):
            # An override cannot make a kernel exist: CPU has only the reference.
            return Decision(False, backend, attention_kernel, precision, allow_tf32,
                            tuple(r for r in reasons if r != "fp32 with TF32 off"), source)
        return Decision(override, backend, attention_kernel, precision, allow_tf32,
                        () if override else (f"disabled by {source}",), source)
    return Decision(not reasons, backend, attention_kernel, precision, allow_tf32, tuple(reasons), "policy")


def resolve_precision(dtype: torch.dtype, precision: str = "auto") -> Optional[str]:
    """The dot precision an fp32 op runs with: "tf32"/"ieee" as given, "auto" via :func:`tf32_allowed`.

    Returns None for fp16/bf16 (tensor-core dots with fp32 accumulation).
    """
    if dtype != torch.float32:
        return None
    if precision == "auto":
        return "tf32" if tf32_allowed() else "ieee"
    return precision


@contextlib.contextmanager
def tf32_scope(enabled: bool) -> Iterator[None]:
    """Set torch's CUDA matmul/cuDNN TF32 flags for the estimator only; restore them afterwards."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = cudnn


# --------------------------------------------------------------------------------------------
# the vocoder's precision
# --------------------------------------------------------------------------------------------

VOCODER_PRECISIONS = ("auto", "ieee", "tf32", "fp16", "bf16", "fp64")
VOCODER_TF32_MIN_CAPABILITY = (8, 0)


class VocoderPrecision(NamedTuple):
    """``(choice, reasons)``: the precision that runs and why it is not what was asked or the
    fastest one (each reason a short clause with the numbers)."""

    choice: str
    reasons: tuple[str, ...]

    def describe(self) -> str:
        return self.choice + (f" — {'; '.join(self.reasons)}" if self.reasons else "")


def vocoder_precision(device: torch.device | str, dtype: torch.dtype, precision: str = "auto", *,
                      capability: Optional[tuple[int, int]] = None,
                      cudnn_tf32: Optional[bool] = None) -> VocoderPrecision:
    """The HiFT vocoder convolutions' precision for a module of ``dtype`` on ``device``
    (:class:`torch_cfm.models.vocoder.HiFTVocoder`).

    "ieee": float32 operands and IEEE convolutions; "tf32": float32 operands, TF32 tensor-core
    convolutions (PyTorch's cuDNN default, what the upstream module gets on SM80+); "fp16" /
    "bf16": 16-bit convolution operands (float32 accumulation and elementwise math); "fp64":
    references. "auto" is never less exact than the upstream module at PyTorch's default
    precision: the module's own dtype, and for float32 TF32 exactly where cuDNN would use it.

    Args:
        device: where the vocoder runs.
        dtype: the upstream module's parameter dtype (float32, float64, float16 or bfloat16).
        precision: one of :data:`VOCODER_PRECISIONS`; "auto" follows the module and torch.
        capability: pretend the CUDA device has this capability (tests, explain for other GPUs).
        cudnn_tf32: the cuDNN TF32 permission to assume (default: ``torch.backends.cudnn.allow_tf32``).
    Returns:
        :class:`VocoderPrecision` ``(choice, reasons)``.
    Raises:
        ValueError: an unknown ``precision`` or an unsupported ``dtype``.
    """
    device = torch.device(device)
    if precision not in VOCODER_PRECISIONS:
        raise ValueError(f"vocoder_precision: precision must be one of {VOCODER_PRECISIONS}, got {precision!r}")
    if dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        raise ValueError(f"vocoder_precision: dtype must be float32/float64/float16/bfloat16, got {dtype}")
    if capability is None:
        capability = device_capability(device)
    allow = torch.backends.cudnn.allow_tf32 if cudnn_tf32 is None else bool(cudnn_tf32)
    tf32_gap = None
    if device.type != "cuda":
        tf32_gap = f"TF32 needs NVIDIA CUDA SM80+, found {device.type}"
    elif capability is None:
        tf32_gap = "TF32 needs NVIDIA CUDA SM80+, found a device of unknown capability"
    elif tuple(capability) < VOCODER_TF32_MIN_CAPABILITY:
        tf32_gap = f"TF32 needs NVIDIA SM80+, found SM{capability[0]}{capability[1]}"

    if precision == "auto":
        if dtype == torch.float64:
            return VocoderPrecision("fp64", ())
        if dtype == torch.float16:
            return VocoderPrecision("fp16", ("a float16 module",))
        if dtype == torch.bfloat16:
            return VocoderPrecision("bf16", ("a bfloat16 module",))
        if tf32_gap is not None:
            return VocoderPrecision("ieee", (tf32_gap,))
        if not allow:
            return VocoderPrecision("ieee", ("cuDNN TF32 off (torch.backends.cudnn.allow_tf32=False)",))
        return VocoderPrecision("tf32", ())
    if precision == "tf32" and tf32_gap is not None:
        return VocoderPrecision("ieee", (f"tf32 requested; {tf32_gap}",))
    return VocoderPrecision(precision, ())
