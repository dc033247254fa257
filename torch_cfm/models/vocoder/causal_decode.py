"""The causal HiFT's ``decode`` on the HiFT vocoder's fused convolutions (the causal core's decode
on CUDA at a tensor-core precision; :class:`~torch_cfm.models.vocoder.causal.CausalVocoderCore`).

``CausalHiFTGenerator.decode(mel, source, finalize)`` has the HiFT's structure with causal
convolutions, so :class:`~torch_cfm.models.vocoder.hift.HiFTVocoder`'s decode (one fused Triton
kernel per convolution with its activation, residual sums and Snakes, frame-major activations)
runs it once each convolution is repacked with its causal geometry (``vocoder_conv``'s
asymmetric padding):

* a left-causal convolution (ResBlocks, ``conv_post``, the strided source downsamplings): left pad
  ``dilation · (k - 1)`` (the downsamplings: ``stride - 1``), none on the right;
* ``conv_pre`` (right-looking, r frames): padded with r zeros on the right when finalizing, else
  unpadded over the chunk and its lookahead, so r frames fewer come out; the source's STFT then
  loses ``prod(upsample_rates) · r`` frames (``HiFTVocoder._decode_math``'s ``spec_trim``) and,
  as the upstream does, the last frame's samples are held back;
* the nearest-upsampling convolution (upsample ×u, then a left-causal k-tap convolution) is a
  transposed convolution of stride u whose ``k + u - 1`` taps are sums of the original ones (tap
  j sums taps ``k - 1 - j .. k + u - 2 - j`` clipped to ``0 .. k - 1``), cropped by ``k - 1`` frames
  on the right.

The sums and the tiles round differently from the upstream's, so the samples agree within the
convolutions' rounding, not bitwise; the f0 predictor and the source (the stream's state) are not
touched.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ...kernels.vocoder_conv import pack_conv_weight
from .hift import HiFTVocoder, folded_weight, fused_conv_reasons
from .precision import conv_precision_scope, vocoder_precision

__all__ = ["FusedCausalDecode", "fused_decode_reasons", "upsampling_as_transposed"]


def upsampling_as_transposed(weight: torch.Tensor, rate: int) -> torch.Tensor:
    """A nearest ×``rate`` upsampling then a left-causal convolution (weight (C_out, C_in, k)) as a
    transposed convolution's weight (C_in, C_out, k + rate - 1), float64."""
    c_out, c_in, k = weight.shape
    w = weight.double()
    out = w.new_zeros(c_in, c_out, k + rate - 1)
    for j in range(k + rate - 1):
        lo, hi = max(0, k - 1 - j), min(k - 1, k - 1 - j + rate - 1)
        if lo <= hi:
            out[:, :, j] = w[:, :, lo:hi + 1].sum(dim=2).t()
    return out


def fused_decode_reasons(device: torch.device, dtype: torch.dtype, kernels: str = "auto",
                         precision: str = "auto") -> list[str]:
    """Why a causal core on ``device`` in ``dtype`` would not decode on the fused convolutions
    (empty: it would). ``precision`` as ``HiFTVocoder``'s for a float32 module ("auto": TF32 where
    cuDNN would use it for the upstream module, else IEEE, which stays on cuDNN)."""
    if dtype != torch.float32:
        return [f"the core runs in {dtype}; the fused decode serves float32"]
    return fused_conv_reasons(device, vocoder_precision(device, dtype, precision).choice, kernels)


class FusedCausalDecode:
    """``model.decode(mel, source, finalize)`` on a :class:`HiFTVocoder` whose convolutions carry
    the causal geometry (module docstring).

    Args:
        model: the upstream ``CausalHiFTGenerator`` (read once; not modified, not kept).
        device: where to run (default: the model's).
        kernels: "auto" (CUDA) or "triton" (also on the CPU under Triton's interpreter: tests).
        precision: the convolutions' (``HiFTVocoder``'s choices; "auto": the policy's for a
            float32 module, never less exact than the upstream module at PyTorch's default).
    Attributes:
        voc: the :class:`HiFTVocoder` (its precision: ``voc.decision``).
    Raises:
        ValueError: the convolutions would not run fused here (the reasons).
    """

    def __init__(self, model: nn.Module, device=None, kernels: str = "auto", precision: str = "auto") -> None:
        device = torch.device(device) if device is not None else model.conv_pre.weight.device
        reasons = fused_decode_reasons(device, torch.float32, kernels, precision)
        if reasons:
            raise ValueError(f"FusedCausalDecode: the convolutions would not run fused: {'; '.join(reasons)}")
        choice = vocoder_precision(device, torch.float32, precision).choice
        self.voc = voc = HiFTVocoder(model, precision=choice, device=device, kernels=kernels)
        self.look_right = int(model.conv_pre_look_right)
        rate = int(math.prod(int(u) for u in model.upsample_rates))
        self.spec_trim = rate * self.look_right
        self.held_samples = rate * int(model.istft_params["hop_len"])  # a non-final decode's last frame

        def pack(ours, weight, left, right, transposed=False, stride=1, dilation=1):
            return pack_conv_weight(weight.to(ours.weight.dtype), ours.bias, transposed=transposed, stride=stride,
                                    padding=left, padding_right=right, dilation=dilation, output_padding=0,
                                    dtype=ours.weight.dtype, tf32=ours.dot == "tf32")

        def left_causal(ours, theirs):
            ours.packed = pack(ours, ours.weight[:, :, 0, :], int(theirs.causal_padding), 0,
                               stride=int(theirs.stride[0]), dilation=int(theirs.dilation[0]))

        pre = voc.conv_pre.weight[:, :, 0, :]
        self.pre_final = pack(voc.conv_pre, pre, 0, self.look_right)
        self.pre_stream = pack(voc.conv_pre, pre, 0, 0)
        for ours, theirs in zip(voc.ups, model.ups):
            k, up = int(theirs.kernel_size[0]), int(theirs.upsample.scale_factor)
            ours.packed = pack(ours, upsampling_as_transposed(folded_weight(theirs, torch.float64), up), 0, k - 1,
                               transposed=True, stride=up)
        for ours, theirs in zip(voc.source_downs, model.source_downs):
            left_causal(ours, theirs)
        for ours_blocks, their_blocks in ((voc.source_resblocks, model.source_resblocks),
                                          (voc.resblocks, model.resblocks)):
            for ours, theirs in zip(ours_blocks, their_blocks):
                for o, t in zip(list(ours.convs1) + list(ours.convs2), list(theirs.convs1) + list(theirs.convs2)):
                    left_causal(o, t)
        left_causal(voc.conv_post, model.conv_post)

    def decode(self, mel: torch.Tensor, source: torch.Tensor, finalize: bool) -> torch.Tensor:
        """mel (B, 80, T) float32, source (B, 1, hop·r·T) float32 -> (B, samples) float32: T frames'
        samples finalizing, else ``T - look_right - 1`` frames' (the upstream ``decode``'s)."""
        voc = self.voc
        voc.conv_pre.packed = self.pre_final if finalize else self.pre_stream
        with torch.no_grad(), conv_precision_scope(voc.decision.choice):
            speech = voc._decode_math(mel, source[:, 0], 0 if finalize else self.spec_trim)
        return speech if finalize else speech[:, :speech.shape[1] - self.held_samples]
