"""The ``stepaudio2`` HiFT vocoder (``HiFTGenerator``) replayed from CUDA graphs.

:class:`GraphedHiFT` replays ``HiFTGenerator.forward`` from one checked CUDA graph per input
shape (:class:`~torch_cfm.graphs.GraphedCall`), the module made capturable for the call
(:func:`torch_cfm.models.hift_capturable.capturable`: the same math without the host copies and
the host check). Random numbers (the source's initial harmonic phases and its additive noise) are
drawn inside the graph from the device's default CUDA generator. A replay takes its Philox seed and
offset from the generator when it starts and advances it by what the captured kernels draw, as the
eager kernels do, so a replayed call consumes and produces the same random stream as the upstream
eager call from the same generator state (checked on the capturing call, ``random=True``).

    >>> vocoder = GraphedHiFT(hift)        # or apply_torch_cfm(token2wav): hift.forward is replaced
    >>> speech, source = vocoder(mel, cache_source)   # HiFTGenerator.forward's signature
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..graphs import GraphedCall
from ..models.hift_capturable import capturable, istft
from ..models.upstream import hift_gaps

__all__ = ["GraphedHiFT", "capturable", "istft", "hift_gaps"]


class GraphedHiFT:
    """``HiFTGenerator.forward(speech_feat, cache_source)`` replayed from one CUDA graph per
    (mel frames, cache samples, batch, dtype); eager (through :func:`capturable`) on CPU.

    Args:
        hift: the upstream ``HiFTGenerator`` (not modified).
        max_graphs: graphs kept (a stream meets three shapes: first chunk, chunk, last chunk).
    Attributes:
        call: the :class:`~torch_cfm.graphs.GraphedCall` (``events``, ``graph_count``).
    """

    def __init__(self, hift: nn.Module, *, max_graphs: int = 16) -> None:
        gaps = hift_gaps(hift)
        if gaps:
            raise TypeError(f"GraphedHiFT: hift must be a stepaudio2 HiFTGenerator, got "
                            f"{type(hift).__module__}.{type(hift).__qualname__} ({', '.join(gaps)})")
        self.hift = hift
        self.device = next(hift.parameters()).device
        self.window = hift.stft_window.to(self.device)
        self.call = GraphedCall(self._forward, name="hift.forward", random=True, max_graphs=max_graphs)

    def _forward(self, speech_feat: torch.Tensor, cache_source: torch.Tensor):
        with capturable(self.hift, self.window):
            return type(self.hift).forward(self.hift, speech_feat, cache_source)

    @property
    def graph_count(self) -> int:
        return self.call.graph_count

    def __call__(self, speech_feat: torch.Tensor, cache_source: Optional[torch.Tensor] = None):
        """(speech (B, 480·T'), source (B, 1, 480·T')) as the upstream forward returns them."""
        if cache_source is None or (cache_source.numel() == 0 and cache_source.device != speech_feat.device):
            cache_source = torch.zeros(speech_feat.shape[0], 1, 0, device=speech_feat.device)
        with torch.inference_mode():  # the upstream forward's own mode; graphs need grad off
            return self.call(speech_feat, cache_source)
