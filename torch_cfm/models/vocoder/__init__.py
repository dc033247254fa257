"""The HiFT vocoder for many streams (``stepaudio2``'s ``HiFTGenerator``, read once).

* :class:`HiFTVocoder`: the f0 predictor, the harmonic source and ``decode`` for a batch of
  streams: weight norm folded at construction, frame-major activations end to end (channels-last
  convolutions), the elementwise work fused (Triton on CUDA, or ``compiled=True``), each call a
  pure function of fixed-shape tensors (CUDA-graph capturable); ``slab_rows`` for bitwise batch
  invariance across batch sizes.
* :class:`HarmonicSource` and :func:`stream_rng`: the ``SourceModuleHnNSF2`` excitation of every
  stream in one call, each stream on its own counter-based (Philox-4x32-10) random stream.
* :func:`vocoder_precision`: which precision the convolutions run in, with reasons.
* :func:`stft_frames` / :func:`istft_frames`: the HiFT's STFT pair, frame-major, host-sync free;
  :func:`overlap_fade`: ``Token2wav.stream``'s cross-fade of consecutive chunks, batched.
"""

from .hift import HiFTVocoder, folded_weight, overlap_fade
from .istft import istft_frames, stft_frames
from .precision import VOCODER_PRECISIONS, VocoderPrecision, conv_precision_scope, vocoder_precision
from .source import HarmonicSource, stream_rng

__all__ = [
    "HiFTVocoder", "HarmonicSource", "stream_rng", "vocoder_precision", "VocoderPrecision", "VOCODER_PRECISIONS",
    "conv_precision_scope", "stft_frames", "istft_frames", "folded_weight", "overlap_fade",
]
