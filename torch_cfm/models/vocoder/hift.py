"""The HiFT vocoder (``HiFTGenerator``) for many streams: folded weights, one layout, fused elementwise.

:class:`HiFTVocoder` holds an upstream ``HiFTGenerator``'s weights (weight norm folded once, at
construction) and computes, for a batch of streams,

* :meth:`HiFTVocoder.f0`: ``f0_predictor(mel)`` (five convolutions with ELU, a linear head,
  ``abs``), at the frame rate (the HiFT's ``f0_upsamp`` repeats each frame S times; the source
  takes the frames);
* :meth:`HiFTVocoder.decode`: ``HiFTGenerator.decode(x=mel, s=source)``: the source's STFT,
  ``conv_pre``, per stage leaky-ReLU → transposed convolution (→ reflection pad at the last) +
  the source branch (downsampling convolution + ResBlock), then the mean of the stage's
  ResBlocks (Snake → dilated conv → Snake → conv, residual, per dilation); leaky-ReLU(0.01) →
  ``conv_post`` → magnitude/phase → inverse STFT → clamp to ``audio_limit``;
* :meth:`HiFTVocoder.forward`: f0 → :class:`~torch_cfm.models.vocoder.source.HarmonicSource`
  (per-stream counter-based noise) → the cached source samples put back → decode: the upstream
  ``HiFTGenerator.forward(mel, cache_source)`` for every stream of a tick in one call;
* :meth:`HiFTVocoder.stream_chunk`: that and ``Token2wav.stream``'s cross-fade with the previous
  chunk (:func:`overlap_fade`): a serving tick's whole vocoder step, one CUDA graph per shape.

Layout: every activation is frame-major (B, L, C) end to end. On an SM80+ GPU at TF32 or 16-bit
precision (or with ``kernels="triton"``) every convolution is one Triton implicit-GEMM kernel
(:mod:`~torch_cfm.kernels.vocoder_conv`) whose epilogue does the elementwise work after it
(``_Conv.run``): bias, residual, accumulator, leaky-ReLU / ELU, the next Snakes. Otherwise a
convolution sees the activation as a channels-last (B, C, 1, L) tensor (no copy), so cuDNN runs
its NHWC kernels with no layout transposes, and the elementwise work is two fused steps
(:mod:`~torch_cfm.models.vocoder.elementwise`); ``compiled=True`` hands that PyTorch math to
``torch.compile`` (one shape-stable graph per input shape).

Precision (:func:`~torch_cfm.models.vocoder.precision.vocoder_precision`): "auto" = the module's
dtype and, in float32, TF32 convolutions exactly where cuDNN would use them for the upstream
module; "ieee", "tf32", "fp16", "bf16" (16-bit convolution operands, float32 residual stream and
elementwise math), "fp64". The STFTs, the magnitude/phase head and the source are float32 IEEE
(float64 under "fp64").

Batch invariance: every op is per row, and the fused convolutions reduce a row in a fixed order
whatever the batch. A library convolution may round a row differently with the batch size (cuDNN
picks algorithms by shape) or even with the row's memory alignment (oneDNN's 1x1 convolutions and
MKL's matrix-vector products on CPU): ``slab_rows=k`` runs the f0 predictor and the decode on
slabs of k rows (the batch zero-padded to a multiple of k), each slab a fresh copy, so the
libraries see the same shapes whatever the batch (on CPU only k = 1 guarantees it).

Graph safety: no host synchronisation, no data-dependent shape, no host tensor made per call:
each method is CUDA-graph capturable at a fixed input shape.

    >>> voc = HiFTVocoder(hift)                                   # an upstream HiFTGenerator
    >>> rng = stream_rng([7, 8], device)                          # per-stream (seed, calls)
    >>> speech, source, rng = voc(mel, rng, cache_source)         # (2, 480 T), (2, 1, 480 T)
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from ...errors import fail, shape_str
from .elementwise import SNAKE_EPS, accumulate, combine
from .istft import analysis_basis, istft_frames, stft_frames, synthesis_basis
from .precision import activation_dtype, conv_dtype, conv_precision_scope, vocoder_precision
from .source import HarmonicSource

__all__ = ["HiFTVocoder", "folded_weight", "fused_conv_reasons", "overlap_fade"]

F0_LEAKY_FINAL = 0.01  # HiFTGenerator.decode: F.leaky_relu(x) before conv_post, torch's default slope


def folded_weight(conv: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """``conv``'s effective weight, computed once in ``dtype``: a weight-norm parametrization
    (``torch.nn.utils.parametrizations.weight_norm``) or the legacy ``weight_norm`` hook applied
    to its originals cast to ``dtype`` (in float32 bitwise what the module computes per call),
    else the plain weight."""
    if parametrize.is_parametrized(conv, "weight"):
        plist = conv.parametrizations.weight
        names = sorted(n for n, _ in plist.named_parameters(recurse=False) if n.startswith("original"))
        value = plist[0](*[getattr(plist, n).detach().to(dtype) for n in names])
        for extra in list(plist)[1:]:
            value = extra(value)
        return value
    for hook in getattr(conv, "_forward_pre_hooks", {}).values():
        if type(hook).__name__ == "WeightNorm":
            g, v = getattr(conv, hook.name + "_g"), getattr(conv, hook.name + "_v")
            return torch._weight_norm(v.detach().to(dtype), g.detach().to(dtype), hook.dim)
    return conv.weight.detach().to(dtype)


def overlap_fade(speech: torch.Tensor, previous: torch.Tensor, window: torch.Tensor,
                 faded: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``Token2wav.stream``'s cross-fade for a batch of streams, as one shape-stable op.

    Row b with ``faded[b]`` gets its first n samples replaced by
    ``speech[:n] · window[:n] + previous · window[n:]`` (computed in ``window``'s dtype, float64
    for the upstream's numpy Hamming window, then rounded to ``speech``'s dtype as the upstream's
    in-place assignment does); other rows (a stream's first chunk) are unchanged.

    Args:
        speech: (B, L) this call's waveform.
        previous: (B, n) the last n samples of each stream's previous waveform (any values where
            not ``faded``).
        window: (2n,) the fade window (``np.hamming(2n)``).
        faded: (B,) bool, or None: every row.
    Returns:
        (B, L) new tensor in ``speech``'s dtype.
    """
    n = previous.shape[1]
    head = (speech[:, :n] * window[:n] + previous * window[n:]).to(speech.dtype)
    if faded is not None:
        head = torch.where(faded[:, None], head, speech[:, :n])
    return torch.cat([head, speech[:, n:]], dim=1)


class _Conv(nn.Module):
    """A Conv1d / ConvTranspose1d with its folded weight, run channels-last on (B, L, C) tensors."""

    def __init__(self, conv: nn.Module, fold_dtype: torch.dtype, dtype: torch.dtype) -> None:
        super().__init__()
        if getattr(conv, "padding_mode", "zeros") != "zeros":
            fail("HiFTVocoder", "hift", "use zero-padded convolutions", f"padding_mode={conv.padding_mode!r}")
        weight = folded_weight(conv, fold_dtype).to(dtype)[:, :, None, :]
        self.register_buffer("weight", weight.contiguous(memory_format=torch.channels_last))
        # the bias stays in the fold dtype: a 16-bit bias (a magnitude head's log offset of ~5
        # rounds by 4e-3) costs more than the 16-bit operands do
        bias = None if conv.bias is None else conv.bias.detach().to(fold_dtype)
        self.register_buffer("bias", bias)
        self.transposed = isinstance(conv, nn.ConvTranspose1d)
        self.stride, self.padding = int(conv.stride[0]), int(conv.padding[0])
        self.dilation, self.groups = int(conv.dilation[0]), int(conv.groups)
        self.output_padding = int(conv.output_padding[0]) if self.transposed else 0
        self.packed, self.dot = None, "ieee"  # the Triton kernel's weights (:meth:`pack`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, C_in) -> (B, L', C_out): in the weight's dtype, or with 16-bit weights the
        16-bit product plus the bias in the bias' dtype."""
        x4 = x.to(self.weight.dtype).contiguous().transpose(1, 2).unsqueeze(2)  # channels-last view
        own = self.bias is None or self.bias.dtype == self.weight.dtype
        bias = self.bias if own else None
        if self.transposed:
            y = F.conv_transpose2d(x4, self.weight, bias, (1, self.stride), (0, self.padding),
                                   (0, self.output_padding), self.groups, (1, self.dilation))
        else:
            y = F.conv2d(x4, self.weight, bias, (1, self.stride), (0, self.padding), (1, self.dilation),
                         self.groups)
        y = y.squeeze(2).transpose(1, 2)
        return y if own else y.to(self.bias.dtype) + self.bias

    def pack(self, dot: Optional[str]) -> None:
        """Pack the weight for the Triton convolution (``dot``: "tf32" / "ieee" for float32
        weights, None for 16-bit ones); call after the module has moved to its device."""
        from ...kernels.vocoder_conv import pack_conv_weight

        self.dot = dot or "ieee"
        self.packed = pack_conv_weight(self.weight[:, :, 0, :], self.bias, transposed=self.transposed,
                                       stride=self.stride, padding=self.padding, dilation=self.dilation,
                                       output_padding=self.output_padding, dtype=self.weight.dtype,
                                       tf32=dot == "tf32")

    def run(self, x: torch.Tensor, *, cdt: torch.dtype, adt: torch.dtype, backend: str, r=None, acc=None, a=None,
            reflect: bool = False, divisor: Optional[float] = None, slope: Optional[float] = None,
            elu: Optional[float] = None, keep: bool = False, alpha=None, inv=None, external: bool = False,
            feeds_conv: bool = True):
        """The convolution of ``x`` (B, L, C_in) and the elementwise work after it, in the order
        ``s = conv + r``, ``acc + s``, ``a[reflected] + s``, ``leaky_relu(s / divisor, slope)`` or
        ``elu(s, elu)``; returns (``s`` when kept or when no Snake follows, else None; the Snake
        outputs of ``s`` under ``alpha``/``inv`` (K, C)). One Triton kernel where packed and the
        backend allows it; else the convolution, then ``combine`` / ``accumulate`` (the
        upstream's operation order). Under TF32 the kernel's Snake outputs and (``feeds_conv``)
        its activated ``s`` are rounded to TF32 when written, for the convolution that reads
        them; an ``external`` input (not written by this kernel) is rounded as it is loaded."""
        snakes = alpha is not None
        if self.packed is not None and backend != "torch" and x.dtype != torch.float64 \
                and (x.is_cuda or backend == "triton"):
            from ...kernels.vocoder_conv import ACT_ELU, ACT_LEAKY, ACT_NONE, conv_fused_triton

            act = ACT_ELU if elu is not None else (ACT_LEAKY if divisor is not None else ACT_NONE)
            return conv_fused_triton(self.packed, x, dot=self.dot, r=r, acc=acc, a=a, reflect=reflect,
                                     divisor=divisor, act=act, slope=elu if elu is not None else (slope or 0.0),
                                     store_s=keep or not snakes, s_dtype=cdt if divisor is not None else adt,
                                     alpha=alpha, inv=inv, y_dtype=cdt, round_input=external, round_out=feeds_conv)
        t = self(x)
        if elu is not None:
            return F.elu(t, elu), []
        if a is not None:
            return combine(a, t, r, alpha=alpha, inv=inv, reflect=reflect, keep_sum=keep, out_dtype=cdt,
                           act_dtype=adt, backend=backend)
        if snakes or keep:
            return combine(t, r, alpha=alpha, inv=inv, keep_sum=keep, out_dtype=cdt, act_dtype=adt, backend=backend)
        return accumulate(t, r, acc, divisor=divisor, slope=slope, out_dtype=cdt, act_dtype=adt, backend=backend), []


def _snake_params(snake: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    alpha = snake.alpha.detach().to(dtype)
    if getattr(snake, "alpha_logscale", False):
        alpha = torch.exp(alpha)
    eps = float(getattr(snake, "no_div_by_zero", SNAKE_EPS))
    return alpha, 1.0 / (alpha + eps)


class _ResBlock(nn.Module):
    """A ResBlock's folded convolutions and its Snake parameters (alpha, 1 / (alpha + eps))."""

    def __init__(self, block: nn.Module, fold_dtype: torch.dtype, dtype: torch.dtype, act: torch.dtype) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(_Conv(c, fold_dtype, dtype) for c in block.convs1)
        self.convs2 = nn.ModuleList(_Conv(c, fold_dtype, dtype) for c in block.convs2)
        for name, acts in (("1", block.activations1), ("2", block.activations2)):
            params = [_snake_params(a, act) for a in acts]
            self.register_buffer("alpha" + name, torch.stack([p[0] for p in params]))  # (dilations, C)
            self.register_buffer("inv" + name, torch.stack([p[1] for p in params]))

    def chain(self, x: torch.Tensor, y: torch.Tensor, cdt: torch.dtype, adt: torch.dtype, backend: str, **last):
        """The block on residual ``x`` whose first Snake output ``y`` is given; the last
        convolution adds the residual and then does ``last`` (``_Conv.run``'s epilogue)."""
        r, final = x, len(self.convs1) - 1
        dt = dict(cdt=cdt, adt=adt, backend=backend)
        for i, (c1, c2) in enumerate(zip(self.convs1, self.convs2)):
            _, (y2,) = c1.run(y, alpha=self.alpha2[i:i + 1], inv=self.inv2[i:i + 1], **dt)
            if i == final:
                return c2.run(y2, r=r, **last, **dt)
            r, (y,) = c2.run(y2, r=r, keep=True, alpha=self.alpha1[i + 1:i + 2], inv=self.inv1[i + 1:i + 2], **dt)
        raise AssertionError("a ResBlock has at least one dilation")


def _hift_dims(hift: nn.Module) -> dict:
    params = hift.istft_params
    return dict(n_fft=int(params["n_fft"]), hop=int(params["hop_len"]), slope=float(hift.lrelu_slope),
                limit=float(hift.audio_limit), kernels=int(hift.num_kernels), stages=int(hift.num_upsamples))


def fused_conv_reasons(device: torch.device, choice: str, kernels: str = "auto", compiled: bool = False) -> list[str]:
    """Why the vocoder's convolutions would not run as the fused Triton kernel
    (``kernels.vocoder_conv``) for a precision ``choice`` (empty: they would). They do when Triton
    kernels are asked for, or with "auto" on an SM80+ GPU at a tensor-core precision (TF32, fp16,
    bf16: where it was measured faster; IEEE float32 stays on cuDNN); never compiled or float64."""
    device = torch.device(device)
    if compiled:
        return ["compiled: Inductor generates the convolutions' code"]
    if kernels == "torch":
        return ['kernels="torch"']
    if choice == "fp64":
        return ["float64 runs on PyTorch's convolutions"]
    if kernels == "triton":
        return []
    if device.type != "cuda":
        return [f"the fused convolutions need CUDA, found {device.type}"]
    if choice == "ieee":
        return ["IEEE float32 convolutions stay on cuDNN (measured faster there)"]
    if torch.cuda.get_device_capability(device) < (8, 0):
        return ["the fused convolutions need SM80+"]
    return []


class HiFTVocoder(nn.Module):
    """A ``HiFTGenerator``'s f0 predictor, source and decode for a batch of streams (module docstring).

    Args:
        hift: the upstream ``HiFTGenerator`` (read once; not modified, not kept).
        precision: one of ``precision.VOCODER_PRECISIONS`` ("auto": see the module docstring).
        device: where to run (default: the module's).
        slab_rows: run the f0 predictor and the decode on slabs of this many rows (bitwise batch
            invariance across batch sizes); None: the whole batch at once.
        compiled: ``torch.compile`` the PyTorch math of the f0 predictor and the decode.
        kernels: "auto" (Triton kernels for CUDA eager calls), "torch", or "triton" (also on CPU
            under the Triton interpreter: tests).
    Attributes:
        decision: the :class:`~torch_cfm.models.vocoder.precision.VocoderPrecision` in force.
        source: the :class:`~torch_cfm.models.vocoder.source.HarmonicSource`.
        samples_per_frame: waveform samples per mel frame (480 at the shipped sizes).
    """

    def __init__(self, hift: nn.Module, *, precision: str = "auto", device: Optional[torch.device | str] = None,
                 slab_rows: Optional[int] = None, compiled: bool = False, kernels: str = "auto") -> None:
        super().__init__()
        op = "HiFTVocoder"
        missing = [n for n in ("conv_pre", "ups", "source_downs", "source_resblocks", "resblocks", "conv_post",
                               "f0_predictor", "m_source", "istft_params") if not hasattr(hift, n)]
        if missing or not isinstance(hift, nn.Module):
            fail(op, "hift", "be a stepaudio2 HiFTGenerator", f"{type(hift).__name__} without {missing}")
        if slab_rows is not None and (not isinstance(slab_rows, int) or slab_rows < 1):
            fail(op, "slab_rows", "be a positive int or None", repr(slab_rows))
        if kernels not in ("auto", "torch", "triton"):
            fail(op, "kernels", 'be "auto", "torch" or "triton"', repr(kernels))
        param = next(hift.parameters())
        self.device = torch.device(device) if device is not None else param.device
        self.decision = vocoder_precision(self.device, param.dtype, precision)
        choice = self.decision.choice
        cdt, adt = conv_dtype(choice), activation_dtype(choice)
        self.conv_dtype, self.act_dtype = cdt, adt
        self.dims = _hift_dims(hift)
        self.slab_rows, self.compiled, self.kernels = slab_rows, bool(compiled), kernels
        with torch.no_grad():
            self._load(hift, adt, cdt)
        self.to(self.device)
        self.fused_convs = not fused_conv_reasons(self.device, choice, self.kernels, self.compiled)
        if self.fused_convs:
            dot = {"tf32": "tf32", "ieee": "ieee"}.get(choice)
            f0 = set(self.f0_convs)
            for conv in self.modules():
                if isinstance(conv, _Conv):
                    conv.pack(("ieee" if choice == "ieee" else "tf32") if conv in f0 else dot)
        self._f0_fn, self._decode_fn = self._f0_math, self._decode_math
        if self.compiled:
            self._f0_fn = torch.compile(self._f0_math, fullgraph=True, dynamic=False)
            self._decode_fn = torch.compile(self._decode_math, fullgraph=True, dynamic=False)

    def _load(self, hift: nn.Module, adt: torch.dtype, cdt: torch.dtype) -> None:
        fold = adt  # float32 folding is bitwise the module's own per-call weight
        self.conv_pre = _Conv(hift.conv_pre, fold, cdt)
        self.ups = nn.ModuleList(_Conv(u, fold, cdt) for u in hift.ups)
        self.source_downs = nn.ModuleList(_Conv(d, fold, cdt) for d in hift.source_downs)
        self.source_resblocks = nn.ModuleList(_ResBlock(b, fold, cdt, adt) for b in hift.source_resblocks)
        self.resblocks = nn.ModuleList(_ResBlock(b, fold, cdt, adt) for b in hift.resblocks)
        self.conv_post = _Conv(hift.conv_post, fold, cdt)
        stage_alpha = [torch.stack([self.resblocks[i * self.dims["kernels"] + j].alpha1[0]
                                    for j in range(self.dims["kernels"])]) for i in range(self.dims["stages"])]
        stage_inv = [torch.stack([self.resblocks[i * self.dims["kernels"] + j].inv1[0]
                                  for j in range(self.dims["kernels"])]) for i in range(self.dims["stages"])]
        for i in range(self.dims["stages"]):
            self.register_buffer(f"stage_alpha{i}", stage_alpha[i])  # (K, C): first Snake of each ResBlock
            self.register_buffer(f"stage_inv{i}", stage_inv[i])
        f0p = hift.f0_predictor
        convs = [m for m in f0p.condnet if isinstance(m, nn.Conv1d)]
        acts = [m for m in f0p.condnet if not isinstance(m, nn.Conv1d)]
        if len(acts) != len(convs) or not all(isinstance(a, nn.ELU) for a in acts):
            fail("HiFTVocoder", "hift.f0_predictor", "be a ConvRNNF0Predictor (conv, ELU) x n + linear",
                 type(f0p).__name__)
        self.f0_convs = nn.ModuleList(_Conv(c, adt, adt) for c in convs)
        self.f0_elu = [float(a.alpha) for a in acts]
        self.register_buffer("f0_weight", f0p.classifier.weight.detach().to(adt))  # (1, C)
        self.register_buffer("f0_bias", f0p.classifier.bias.detach().to(adt))
        n_fft = self.dims["n_fft"]
        window = hift.stft_window.detach().double()
        self.register_buffer("window", window.to(adt))
        self.register_buffer("analysis", analysis_basis(window, n_fft).to(adt))
        self.register_buffer("synthesis", synthesis_basis(window, n_fft).to(adt))
        scale = math.prod(int(u.stride[0]) for u in hift.ups) * self.dims["hop"]
        self.samples_per_frame = scale
        self.source = HarmonicSource(hift.m_source, scale, kernel=self.kernels)

    def extra_repr(self) -> str:
        return (f"precision={self.decision.describe()}, slab_rows={self.slab_rows}, compiled={self.compiled}, "
                f"kernels={self.kernels}, fused_convs={self.fused_convs}")

    # ------------------------------------------------------------------ math (shape-stable)
    def _backend(self) -> str:
        return "torch" if self.compiled else self.kernels

    def _f0_math(self, mel: torch.Tensor) -> torch.Tensor:
        x = mel.to(self.act_dtype).transpose(1, 2)  # (B, T, 80)
        dt = dict(cdt=self.act_dtype, adt=self.act_dtype, backend=self._backend())
        for i, (conv, alpha) in enumerate(zip(self.f0_convs, self.f0_elu)):
            x, _ = conv.run(x, elu=alpha, external=i == 0, feeds_conv=i < len(self.f0_convs) - 1, **dt)
        # a per-row dot product, not F.linear: a CPU matrix-vector product rounds a row
        # differently depending on where it sits in the batch
        return torch.abs((x * self.f0_weight[0]).sum(dim=-1) + self.f0_bias[0])

    def _decode_math(self, mel: torch.Tensor, source: torch.Tensor, spec_trim: int = 0) -> torch.Tensor:
        """``spec_trim``: STFT frames dropped from the source's end (a causal HiFT's lookahead)."""
        d, dt = self.dims, dict(cdt=self.conv_dtype, adt=self.act_dtype, backend=self._backend())
        spec = stft_frames(source.to(self.act_dtype), self.analysis, d["n_fft"], d["hop"])  # (B, F, n_fft + 2)
        spec = spec[:, :spec.shape[1] - spec_trim] if spec_trim else spec
        a, _ = self.conv_pre.run(mel.transpose(1, 2), divisor=1.0, slope=d["slope"], external=True, **dt)
        k = d["kernels"]
        for i in range(d["stages"]):
            up, _ = self.ups[i].run(a, **dt)
            sblock = self.source_resblocks[i]
            sr, (sy,) = self.source_downs[i].run(spec, keep=True, alpha=sblock.alpha1[:1], inv=sblock.inv1[:1],
                                                 external=True, **dt)
            x, ys = sblock.chain(sr, sy, a=up, reflect=i == d["stages"] - 1, keep=True,
                                 alpha=getattr(self, f"stage_alpha{i}"), inv=getattr(self, f"stage_inv{i}"), **dt)
            acc = None
            for j in range(k):
                final = j == k - 1
                slope = d["slope"] if i < d["stages"] - 1 else F0_LEAKY_FINAL
                acc, _ = self.resblocks[i * k + j].chain(x, ys[j], acc=acc, divisor=float(k) if final else None,
                                                         slope=slope, **dt)
            a = acc
        logits, _ = self.conv_post.run(a, **dt)  # (B, F, n_fft + 2)
        speech = istft_frames(logits, self.synthesis, self.window, d["n_fft"], d["hop"])
        return torch.clamp(speech, -d["limit"], d["limit"])

    # ------------------------------------------------------------------ public
    def _slabbed(self, fn, *tensors: torch.Tensor) -> torch.Tensor:
        """``fn`` over the batch, or over slabs of ``slab_rows`` rows (zero-padded), each slab a
        fresh copy: the same shapes, strides and alignment whatever the batch."""
        rows = self.slab_rows
        if rows is None:
            return fn(*tensors)
        batch = tensors[0].shape[0]
        padded = -(-batch // rows) * rows
        if padded != batch:
            tensors = tuple(F.pad(t, (0,) * (2 * t.dim() - 1) + (padded - batch,)) for t in tensors)
        outs = [fn(*(t[s:s + rows].clone(memory_format=torch.contiguous_format) for t in tensors))
                for s in range(0, padded, rows)]
        return outs[0][:batch] if len(outs) == 1 else torch.cat(outs, dim=0)[:batch]

    def _check_mel(self, op: str, mel: Any) -> None:
        if not isinstance(mel, torch.Tensor) or mel.dim() != 3 or not mel.is_floating_point():
            got = shape_str(mel) if isinstance(mel, torch.Tensor) else repr(mel)
            fail(op, "mel", "be a floating (B, 80, T) tensor", got)
        if mel.shape[1] != self.conv_pre.weight.shape[1]:
            fail(op, "mel", f"have {self.conv_pre.weight.shape[1]} channels", shape_str(mel))
        if mel.device != self.device:
            fail(op, "mel", f"be on the vocoder's device {self.device}", str(mel.device))

    def f0(self, mel: torch.Tensor) -> torch.Tensor:
        """Frame-rate f0: (B, 80, T) mel -> (B, T) in the activation dtype (float32 / float64)."""
        self._check_mel("HiFTVocoder.f0", mel)
        with conv_precision_scope(self.decision.choice, f0=True):
            return self._slabbed(self._f0_fn, mel)

    def decode(self, mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """``HiFTGenerator.decode(x=mel, s=source)``.

        Args:
            mel: (B, 80, T) any float dtype.
            source: (B, 1, L) or (B, L) excitation, L = S·T (S = ``samples_per_frame``).
        Returns:
            (B, hop·(L / hop)) = (B, L) speech, clamped to the audio limit, float32 (float64 for fp64).
        """
        op = "HiFTVocoder.decode"
        self._check_mel(op, mel)
        if isinstance(source, torch.Tensor) and source.dim() == 3 and source.shape[1] == 1:
            source = source[:, 0]
        if not isinstance(source, torch.Tensor) or source.dim() != 2 or source.shape[0] != mel.shape[0]:
            fail(op, "source", f"be (B, 1, L) or (B, L) with B={mel.shape[0]}",
                 shape_str(source) if isinstance(source, torch.Tensor) else repr(source))
        if source.shape[1] != mel.shape[2] * self.samples_per_frame:
            fail(op, "source", f"have {self.samples_per_frame} samples per mel frame "
                 f"({mel.shape[2] * self.samples_per_frame})", str(source.shape[1]))
        with conv_precision_scope(self.decision.choice):
            return self._slabbed(self._decode_fn, mel, source)

    def forward(self, mel: torch.Tensor, rng: torch.Tensor, cache_source: Optional[torch.Tensor] = None):
        """``HiFTGenerator.forward(mel, cache_source)`` per stream, with per-stream random states.

        Args:
            mel: (B, 80, T).
            rng: (B, 2) int64 per-stream ``(seed, calls)`` (``source.stream_rng``).
            cache_source: optional (B, 1, C) source samples that replace the first C generated
                ones (``Token2wav.stream``'s overlap, C = 8·S); C = 0 or None: none.
        Returns:
            (speech (B, S·T), source (B, 1, S·T), next rng (B, 2)); speech and source float32
            (float64 for fp64).
        """
        f0 = self.f0(mel)
        source, next_rng = self.source(f0, rng)
        source = self._with_cache(source, cache_source, mel.shape[0])
        return self.decode(mel, source), source[:, None], next_rng

    def stream_chunk(self, mel: torch.Tensor, rng: torch.Tensor, cache_source: Optional[torch.Tensor] = None,
                     previous_speech: Optional[torch.Tensor] = None, window: Optional[torch.Tensor] = None):
        """One ``Token2wav.stream`` vocoder step for streams that all have (or all lack) a
        previous chunk: :meth:`forward`, then :func:`overlap_fade` of the first n samples with
        ``previous_speech`` (B, n) under ``window`` (2n,) when given. One shape-stable call: the
        whole step (f0, source, decode, inverse STFT, fade) fits one CUDA graph.

        Returns:
            (speech (B, S·T) faded, source (B, 1, S·T), next rng (B, 2)).
        """
        speech, source, next_rng = self.forward(mel, rng, cache_source)
        if previous_speech is not None:
            if window is None or window.shape[0] != 2 * previous_speech.shape[1]:
                fail("HiFTVocoder.stream_chunk", "window", f"be given with 2n = {2 * previous_speech.shape[1]} "
                     "samples", "None" if window is None else shape_str(window))
            speech = overlap_fade(speech, previous_speech, window)
        return speech, source, next_rng

    def _with_cache(self, source: torch.Tensor, cache_source: Optional[torch.Tensor], batch: int) -> torch.Tensor:
        if cache_source is None or cache_source.shape[-1] == 0:
            return source
        cached = cache_source.shape[-1]
        if cache_source.shape[0] != batch or cached > source.shape[1]:
            fail("HiFTVocoder", "cache_source", f"be (B, 1, C) with B={batch}, C <= {source.shape[1]}",
                 shape_str(cache_source))
        return torch.cat([cache_source.reshape(batch, cached).to(source.dtype), source[:, cached:]], dim=1)
