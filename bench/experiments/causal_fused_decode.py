"""minicpmo-utils' causal HiFT decode on the HiFT's fused Triton convolutions (experiment; issues 40, 43).

``CausalHiFTGenerator.decode(mel, source, finalize)`` has the HiFT's structure with causal
convolutions, so :class:`~torch_cfm.models.vocoder.hift.HiFTVocoder`'s fused decode runs it once
each convolution is repacked with the causal geometry (``vocoder_conv``'s asymmetric padding):

* a left-causal convolution (ResBlocks, ``conv_post``, the strided source downsamplings): left pad
  ``dilation · (k - 1)`` (the downsamplings: ``stride - 1``), none on the right;
* ``conv_pre`` (right-looking, ``r`` frames): padded with r zeros on the right when finalizing, else
  unpadded over the chunk and its lookahead (r frames fewer out, the source's STFT loses
  ``prod(upsample_rates) · r`` frames: ``HiFTVocoder._decode_math``'s ``spec_trim``; and, as the
  upstream does, the last frame's samples are held back);
* the nearest-upsampling convolution (``upsample ×u``, then a left-causal k-tap convolution) is a
  transposed convolution of stride u whose ``k + u - 1`` taps are sums of the original ones
  (tap j sums taps ``k - 1 - j .. k - 1 - j + u - 1``), cropped by ``k - 1`` frames on the right.

The sums and the tiles round differently from the upstream's, so the samples agree within the
convolutions' rounding, not bitwise. ``--check`` compares the fused decode with the upstream's
float32 decode against a float64 one (CPU: Triton's interpreter, tiny sizes); the GPU run times a
steady 86-frame decode (history + chunk + lookahead) at B streams from CUDA graphs against the
decode ``CausalVocoderCore`` runs today (cuDNN under ``capturable_causal``), then a whole steady
chunk with each decode, and writes ``causal_fused_decode.json``.

    STEPAUDIO2_PATH=.upstream/minicpmo-utils TRITON_INTERPRET=1 python3 bench/experiments/causal_fused_decode.py --check
    STEPAUDIO2_PATH=.upstream/minicpmo-utils python3 bench/experiments/causal_fused_decode.py --out "$OUT"
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [HERE, os.path.dirname(HERE), os.path.join(ROOT, "tests"), ROOT]

import torch  # noqa: E402

from torch_cfm.kernels.vocoder_conv import pack_conv_weight  # noqa: E402
from torch_cfm.models.vocoder.hift import HiFTVocoder, folded_weight  # noqa: E402
from torch_cfm.models.vocoder.precision import conv_precision_scope  # noqa: E402


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


class FusedCausalDecode:
    """``model.decode(mel, source, finalize)`` on a :class:`HiFTVocoder` whose convolutions carry
    the causal geometry (module docstring). ``model``: a ``CausalHiFTGenerator``."""

    def __init__(self, model: torch.nn.Module, precision: str = "auto", kernels: str = "auto") -> None:
        self.voc = voc = HiFTVocoder(model, precision=precision, kernels=kernels)
        if not voc.fused_convs:
            raise ValueError(f"FusedCausalDecode: no fused convolutions at precision={precision!r}, "
                             f"kernels={kernels!r} on {voc.device}")
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
            k, rate = int(theirs.kernel_size[0]), int(theirs.upsample.scale_factor)
            weight = upsampling_as_transposed(folded_weight(theirs, torch.float64), rate)
            ours.packed = pack(ours, weight, 0, k - 1, transposed=True, stride=rate)
        for ours, theirs in zip(voc.source_downs, model.source_downs):
            left_causal(ours, theirs)
        for ours_blocks, their_blocks in ((voc.source_resblocks, model.source_resblocks),
                                          (voc.resblocks, model.resblocks)):
            for ours, theirs in zip(ours_blocks, their_blocks):
                for o, t in zip(list(ours.convs1) + list(ours.convs2), list(theirs.convs1) + list(theirs.convs2)):
                    left_causal(o, t)
        left_causal(voc.conv_post, model.conv_post)

    def decode(self, mel: torch.Tensor, source: torch.Tensor, finalize: bool) -> torch.Tensor:
        """mel (B, 80, T), source (B, 1, 480·T) -> (B, 480·T') float32, T' = T finalizing, else
        T - lookahead - 1."""
        voc = self.voc
        voc.conv_pre.packed = self.pre_final if finalize else self.pre_stream
        with torch.no_grad(), conv_precision_scope(voc.decision.choice):
            speech = voc._decode_math(mel, source[:, 0], 0 if finalize else self.spec_trim)
        return speech if finalize else speech[:, :speech.shape[1] - self.held_samples]


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def check(mods, P) -> dict:
    """Tiny sizes on the CPU: the fused decode (IEEE and TF32 operands) and the upstream's float32
    decode, each against the upstream's float64 decode, finalizing and not."""
    model = P.build_causal_hift(mods, seed=1, **P.TINY_CAUSAL)
    exact = copy.deepcopy(model).double()
    gen = torch.Generator().manual_seed(3)
    mel = torch.randn(2, 80, 24, generator=gen)
    source = torch.randn(2, 1, 24 * 480, generator=gen) * 0.1
    rows = {}
    for finalize in (True, False):
        with torch.no_grad():
            ref64 = exact.decode(mel.double(), source.double(), finalize=finalize)
            up32 = model.decode(mel, source, finalize=finalize)
        row = dict(upstream_fp32=_err(up32, ref64), shape=list(ref64.shape))
        for prec in ("ieee", "tf32"):
            out = FusedCausalDecode(model, precision=prec, kernels="triton").decode(mel, source, finalize)
            assert out.shape == ref64.shape, (prec, finalize, out.shape, ref64.shape)
            row[prec] = _err(out, ref64)
        rows[f"finalize={finalize}"] = row
        print(f"finalize={finalize}: error vs float64 {row}", flush=True)
    ok = all(r["ieee"] <= 2 * r["upstream_fp32"] + 1e-6 for r in rows.values())
    print("ieee within 2x the upstream fp32 error + 1e-6:", ok)
    return dict(rows=rows, ieee_within_bound=ok)


def timing(mods, P, batches: list[int], out: str) -> None:
    import _harness as H
    from torch_cfm.models.vocoder.causal import CausalModelParts, capturable_causal

    dev = torch.device("cuda")
    model = P.build_causal_hift(mods, seed=1, **P.SHIPPED_CAUSAL).to(dev)
    exact = copy.deepcopy(model).double()
    parts = CausalModelParts.of(model)
    window = model.stft_window.to(dev)
    fused = {p: FusedCausalDecode(model, precision=p) for p in ("tf32", "fp16")}
    rows = []
    for b in batches:
        gen = torch.Generator(device=dev).manual_seed(b)
        mel = torch.randn(b, 80, 86, generator=gen, device=dev)
        source = torch.randn(b, 1, 86 * 480, generator=gen, device=dev) * 0.1
        with torch.no_grad():
            ref64 = exact.decode(mel.double(), source.double(), finalize=False)

        def today():
            with capturable_causal(model, window, parts):
                return model.decode(mel, source, finalize=False)

        candidates = {"cudnn_tf32": today, **{f"fused_{p}": (lambda f=f: f.decode(mel, source, False))
                                              for p, f in fused.items()}}
        for name, fn in candidates.items():
            with torch.no_grad(), torch.backends.cudnn.flags(allow_tf32=True):
                t = H.time_cuda_graph(fn, calls=2, repeats=9, warmup=2)
                err = _err(fn(), ref64)
            row = dict(H.env_info(), op="causal_fused_decode", B=b, frames=86, variant=name,
                       ms=round(t["us_p50"] / 1e3, 3), rel_err_vs_fp64=err)
            rows.append(row)
            print({k: row[k] for k in ("B", "variant", "ms", "rel_err_vs_fp64")}, flush=True)
    rows += chunk_timing(mods, P, model, fused["tf32"], batches)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "causal_fused_decode.json"), "w") as f:
        json.dump(rows, f, indent=1)


def chunk_timing(mods, P, model, fused: FusedCausalDecode, batches: list[int]) -> list[dict]:
    """A whole steady 50-frame chunk (``CausalVocoderCore.run``: f0, source, decode) at B streams
    from CUDA graphs, its decode today's and then the fused one (``model.decode`` swapped)."""
    import _harness as H
    from causal_vocoder_profile import steady_chunk
    from torch_cfm.models.vocoder.causal import CausalVocoderCore

    dev = torch.device("cuda")
    core = CausalVocoderCore(mods.BoundedVocoder(model))
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    with torch.no_grad():
        state, plan = steady_chunk(core, gen)
        for b in batches:
            mel, source, phase = (state[k].expand(b, *state[k].shape[1:]).contiguous()
                                  for k in ("mel", "source", "phase"))
            chunk = torch.randn(b, 80, 50, device=dev, generator=gen)
            base = torch.zeros(b, dtype=torch.int64, device=dev)
            outs = {}
            for name in ("today", "fused_tf32"):
                if name == "today":
                    vars(core.model).pop("decode", None)
                else:
                    core.model.decode = lambda x, s, finalize=True: fused.decode(x, s, finalize)
                with torch.backends.cudnn.flags(enabled=True, allow_tf32=True):
                    t = H.time_cuda_graph(lambda: core.run(plan, mel, source, phase, chunk, base), calls=2,
                                          repeats=9, warmup=2)
                    outs[name] = core.run(plan, mel, source, phase, chunk, base)[0]
                row = dict(H.env_info(), op="causal_fused_chunk", B=b, frames=50, variant=name,
                           ms=round(t["us_p50"] / 1e3, 3))
                if name != "today":
                    row["rel_diff_vs_today"] = _err(outs[name], outs["today"])
                rows.append(row)
                print({k: row.get(k) for k in ("B", "variant", "ms", "rel_diff_vs_today")}, flush=True)
            vars(core.model).pop("decode", None)
    return rows


def main() -> int:
    import upstream_packages as P

    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="CPU, tiny sizes, Triton's interpreter")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    mods = P.load_minicpmo_token2wav()
    if args.check:
        result = check(mods, P)
        return 0 if result["ieee_within_bound"] else 1
    if not args.out:
        ap.error("--out is required for the GPU timing")
    timing(mods, P, [int(b) for b in args.batches.split(",")], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
