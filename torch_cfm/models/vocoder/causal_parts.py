"""The causal HiFT's modules made capturable (:func:`capturable_causal`), on parts computed once
(:class:`CausalModelParts`): what :class:`~torch_cfm.models.vocoder.causal.CausalVocoderCore`
runs the upstream ``CausalHiFTGenerator`` inside. See :mod:`torch_cfm.models.vocoder.causal`.
"""

from __future__ import annotations

import contextlib
import numbers
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..hift_capturable import istft
from .elementwise import snake_channels

__all__ = ["CausalModelParts", "capturable_causal"]

def _causal_kind(m: nn.Module) -> Optional[str]:
    """"left" / "right" (``CausalConv1d``), "up" (``CausalConv1dUpsample``: nearest upsampling, then
    left padding), "down" (``CausalConv1dDownSample``: left padding, strided), or None."""
    pad = getattr(m, "causal_padding", None)
    if not isinstance(m, nn.Conv1d) or not isinstance(pad, numbers.Integral) or tuple(m.padding) != (0,):
        return None  # (the upstream's strided convolutions hold numpy integers)
    kind = getattr(m, "causal_type", None)
    if kind in ("left", "right"):
        return kind
    if isinstance(getattr(m, "upsample", None), nn.Upsample) and m.stride[0] == 1:
        return "up"
    return "down" if kind is None and m.stride[0] > 1 and pad == m.stride[0] - 1 else None


def _causal_convs(model: nn.Module) -> list[nn.Module]:
    """The model's causal convolutions (:func:`_causal_kind`)."""
    return [m for m in model.modules() if _causal_kind(m) is not None]


def _snakes(model: nn.Module) -> list[nn.Module]:
    """The model's ``Snake`` activations (``x + 1 / (alpha + eps) · sin(alpha · x)²``, alpha per channel)."""
    return [m for m in model.modules() if type(m).__name__ == "Snake"
            and isinstance(getattr(m, "alpha", None), torch.Tensor) and m.alpha.dim() == 1
            and isinstance(getattr(m, "no_div_by_zero", None), float)]


def _parametrized(conv: nn.Module) -> bool:
    return "weight" in getattr(getattr(conv, "parametrizations", None), "keys", lambda: ())()


@dataclass(frozen=True)
class CausalModelParts:
    """What :func:`capturable_causal` substitutes, computed once from the model's parameters.

    ``convs``: each causal convolution with its effective weight (a weight-norm parametrization
    evaluated once: the same ``torch._weight_norm`` the parametrization runs per call, so the
    same values; a plain weight is the parameter itself). ``snakes``: each Snake with its
    (1, C, 1) alpha (``exp`` taken for a log-scale alpha) and ``1 / (alpha + eps)``, made by the
    upstream's own ops. Tied to the parameters as they were when made: make new parts after
    changing the model's weights, dtype or device.
    """

    convs: tuple[tuple[nn.Module, torch.Tensor], ...]
    snakes: tuple[tuple[nn.Module, torch.Tensor, torch.Tensor], ...]

    @classmethod
    def of(cls, model: nn.Module) -> "CausalModelParts":
        with torch.no_grad():
            # a parametrized weight is computed here, once; a plain one is the parameter itself
            convs = tuple((conv, conv.weight.detach() if _parametrized(conv) else conv.weight)
                          for conv in _causal_convs(model))
            snakes = []
            for snake in _snakes(model):
                alpha = snake.alpha.detach().unsqueeze(0).unsqueeze(-1)
                if getattr(snake, "alpha_logscale", False):
                    alpha = torch.exp(alpha)
                snakes.append((snake, alpha, 1.0 / (alpha + snake.no_div_by_zero)))
        return cls(convs, tuple(snakes))

    def extra_bytes(self) -> int:
        """Device bytes these parts add to the model's own (the folded weights, Snake parameters)."""
        convs = sum(w.numel() * w.element_size() for conv, w in self.convs if _parametrized(conv))
        return convs + sum(2 * a.numel() * a.element_size() for _, a, _ in self.snakes)


def _conv1d_gemm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], stride: int,
                 dilation: int) -> torch.Tensor:
    """``F.conv1d(x, weight, bias, stride, 0, dilation)`` (one group) as one matrix product over
    (C_in · taps): x (B, C_in, L), weight (C_out, C_in, taps) -> (B, C_out, L_out), same dtype."""
    c_out, c_in, taps = weight.shape
    cols = x.unfold(2, dilation * (taps - 1) + 1, stride)[..., ::dilation]  # (B, C_in, L_out, taps)
    cols = cols.transpose(2, 3).reshape(x.shape[0], c_in * taps, cols.shape[2])
    y = torch.matmul(weight.reshape(c_out, c_in * taps), cols)
    return y if bias is None else y + bias[:, None]


@contextlib.contextmanager
def capturable_causal(model: nn.Module, window: torch.Tensor, parts: Optional[CausalModelParts] = None,
                      implicit_pad: Optional[bool] = None, f64_gemm: Optional[bool] = None):
    """Within: ``model``'s ``decode`` and its f0 predictor make no CPU tensors and read nothing
    on the host, and launch fewer kernels (``parts``, default: made now):

    * a causal convolution (upsampling and strided ones too) runs on its folded weight (no
      weight-norm recomputation per call: the same values). A missing cache is padded on the
      device: with ``implicit_pad`` the convolution pads itself (both sides) and the frames the
      causal padding gives are kept, so no padded copy is made (never in float64; default: on
      CUDA, where it saves a fill and a copy per convolution and the convolution may round
      differently); else one ``F.pad``, where the upstream copies a CPU zero tensor and
      concatenates (the same ops on the same values: the same result). With ``f64_gemm`` (default:
      on CUDA, where cuDNN's float64 convolution took 3.4 of a one-stream chunk's 6.2 ms, all in
      the f0 predictor) a float64 convolution is one DGEMM (:func:`_conv1d_gemm`): f0 within
      float64 rounding, its float32 cast (what the source reads) the upstream's unless a ~1e-16
      difference straddles a float32 rounding boundary;
    * a Snake runs as :func:`~torch_cfm.models.vocoder.elementwise.snake_channels` on its
      precomputed parameters: the upstream's own ops on the CPU (bitwise), one Triton kernel on
      CUDA (where the upstream launches seven; equal within float32 rounding);
    * the STFT window is ``window`` (the device copy of ``model.stft_window``) and the inverse
      STFT is :func:`istft`.

    Instance attributes set here are removed on exit."""
    params = model.istft_params
    saved = model.stft_window
    parts = CausalModelParts.of(model) if parts is None else parts

    def conv_forward(conv, weight):
        kind, pad = _causal_kind(conv), int(conv.causal_padding)
        stride, dilation, taps = int(conv.stride[0]), int(conv.dilation[0]), int(conv.kernel_size[0])
        left = kind != "right"

        def forward(x, cache=None):
            if kind == "up":
                x = conv.upsample(x)
            if cache is not None and cache.size(2) > 0:
                x = torch.cat([cache, x] if left else [x, cache], dim=2)
            elif x.dtype != torch.float64 and (implicit_pad if implicit_pad is not None else x.is_cuda):
                y = F.conv1d(x, weight, conv.bias, stride, pad, dilation, conv.groups)
                frames = (x.shape[2] + pad - dilation * (taps - 1) - 1) // stride + 1
                return y[:, :, :frames] if left else y[:, :, pad:]
            else:
                x = F.pad(x, (pad, 0) if left else (0, pad))
            if gemm(x, conv):
                return _conv1d_gemm(x, weight, conv.bias, stride, dilation)
            return conv._conv_forward(x, weight, conv.bias)
        return forward

    def gemm(x, conv):
        return (x.dtype == torch.float64 and conv.groups == 1
                and (f64_gemm if f64_gemm is not None else x.is_cuda))

    def snake_forward(alpha, inv):
        return lambda x: snake_channels(x, alpha, inv)

    model.stft_window = window
    model._istft = lambda magnitude, phase: istft(magnitude, phase, params["n_fft"], params["hop_len"],
                                                  window.to(magnitude.dtype))
    for conv, weight in parts.convs:
        conv.forward = conv_forward(conv, weight)
    for snake, alpha, inv in parts.snakes:
        snake.forward = snake_forward(alpha, inv)
    try:
        yield model
    finally:
        model.stft_window = saved
        vars(model).pop("_istft", None)
        for module in [c for c, _ in parts.convs] + [m for m, _, _ in parts.snakes]:
            vars(module).pop("forward", None)
