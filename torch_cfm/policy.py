"""The dispatch policy of SPEC §5: one function, used by eager dispatch, compile passes and explain.

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
from typing import Iterator, Mapping, Optional

import torch

from .config import ATTENTION_DTYPES, MIN_CAPABILITY

ENV_FUSED = "TORCH_CFM_FUSED"
ENV_TF32 = "TORCH_CFM_TF32"
ENV_PDL = "TORCH_CFM_PDL"
ENV_ATTENTION_KERNEL = "TORCH_CFM_ATTENTION_KERNEL"
ATTENTION_KERNEL_CHOICES = ("auto", "triton", "cuda")
PDL_MIN_CAPABILITY = (9, 0)  # griddepcontrol (programmatic dependent launch) is SM90+

_TRUE = {"1", "true", "on", "yes"}
_FALSE = {"0", "false", "off", "no"}


@dataclass(frozen=True)
class Decision:
    """What runs, and why.

    Attributes:
        fused: the fused DiT body / compile-rule swap is used.
        attention_kernel: "triton" (CUDA SM80+), "sdpa" (older CUDA) or "reference" (CPU/other).
        precision: dot precision for fp32 inputs, "tf32" or "ieee"; None for fp16/bf16.
        tf32: whether TF32 is allowed (after env > explicit > torch setting).
        reasons: why ``fused`` is False (empty when fused); each a short clause with the numbers.
        source: what settled ``fused``: "policy", "argument" or "env".
    """

    fused: bool
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
        return f"{verdict}{extra} (attention={self.attention_kernel}{prec}){why}"


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


def attention_kernel_choice(env: Optional[Mapping[str, str]] = None) -> str:
    """Which SM80+ kernel ``cfm_attention`` may use, from env ``TORCH_CFM_ATTENTION_KERNEL``.

    "auto" (default): the hand-written CUDA kernel (optional build, ``torch_cfm._C_cuda``) where it
    covers the call and its tile rule picks it, Triton otherwise; "triton": always Triton; "cuda":
    the CUDA kernel, and a ValueError with its reasons where it does not cover the call. A launch
    detail under the decision's ``attention_kernel == "triton"`` (the SM80+ family), read at call
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
    """Decide the path for a computation in ``dtype`` on ``device`` (SPEC §5).

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
        attention_kernel = "triton"
    elif device.type == "cuda":
        attention_kernel = "sdpa"
    else:
        attention_kernel = "reference"

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

    override, source = _parse_flag(env, ENV_FUSED), "env"
    if override is None and fused is not None:
        override, source = bool(fused), "argument"
    if override is not None:
        if override and (device.type != "cuda" or dtype not in ATTENTION_DTYPES):
            # An override cannot make a kernel exist: CPU has only the reference.
            return Decision(False, attention_kernel, precision, allow_tf32,
                            tuple(r for r in reasons if r != "fp32 with TF32 off"), source)
        return Decision(override, attention_kernel, precision, allow_tf32,
                        () if override else (f"disabled by {source}",), source)
    return Decision(not reasons, attention_kernel, precision, allow_tf32, tuple(reasons), "policy")


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
