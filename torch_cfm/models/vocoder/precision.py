"""The vocoder's precision choices (made by :func:`torch_cfm.policy.vocoder_precision`) put to work.

Choices (:data:`VOCODER_PRECISIONS`):

* ``"ieee"``: float32 operands, IEEE float32 convolutions (cuDNN TF32 off);
* ``"tf32"``: float32 operands, TF32 tensor-core convolutions (float32 accumulation): PyTorch's
  default for cuDNN (``torch.backends.cudnn.allow_tf32`` is True unless changed), hence the
  precision the upstream module gets by default on SM80+;
* ``"fp16"`` / ``"bf16"``: 16-bit convolution operands and outputs (float32 accumulation), the
  residual stream and all elementwise math in float32;
* ``"fp64"``: float64 throughout (references and tests).

Whatever the choice, the inverse STFT, the f0 head's final linear and the source run in IEEE
float32 (float64 for ``"fp64"``), and the f0 predictor's convolutions in float32: TF32 unless the
choice is ``"ieee"`` (an f0 error turns into a phase drift of the harmonic source).

The default (``"auto"``) is never less exact than the upstream module at PyTorch's default
precision: the module's own dtype, and for float32 TF32 exactly when cuDNN would use it for the
upstream module (NVIDIA SM80+ with ``cudnn.allow_tf32``). 16-bit is only ever an explicit choice
(or a 16-bit module).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ...policy import VOCODER_PRECISIONS, VocoderPrecision, vocoder_precision  # noqa: F401  (the choice)

__all__ = ["VOCODER_PRECISIONS", "VocoderPrecision", "vocoder_precision", "conv_dtype", "activation_dtype",
           "conv_precision_scope"]

_CONV_DTYPES = {"ieee": torch.float32, "tf32": torch.float32, "fp16": torch.float16,
                "bf16": torch.bfloat16, "fp64": torch.float64}


def conv_dtype(choice: str) -> torch.dtype:
    """The dtype of the convolution operands and outputs for a precision choice."""
    return _CONV_DTYPES[choice]


def activation_dtype(choice: str) -> torch.dtype:
    """The dtype of the residual stream and the elementwise math (float32, or float64 for fp64)."""
    return torch.float64 if choice == "fp64" else torch.float32


@contextlib.contextmanager
def conv_precision_scope(choice: str, *, f0: bool = False) -> Iterator[None]:
    """Within: cuDNN TF32 as the choice needs (the f0 predictor: TF32 unless "ieee") and cuBLAS
    TF32 off (the STFT products and the f0 head); torch's flags are restored afterwards."""
    cudnn = torch.backends.cudnn.allow_tf32
    try:
        matmul = torch.backends.cuda.matmul.allow_tf32
    except RuntimeError:  # torch refuses the legacy flag once its fp32_precision API was used
        matmul = None
    if matmul is not None:
        torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = (choice != "ieee") if f0 else (choice == "tf32")
    try:
        yield
    finally:
        if matmul is not None:
            torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = cudnn
