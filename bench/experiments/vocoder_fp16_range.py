"""Whether 16-bit convolution operands suit a HiFT's weights: their range per layer, and the waveform
error of each operand rounding against float64 (experiment; issue 43; CPU, no GPU needed).

float16 and TF32 keep the same 10 explicit mantissa bits; they differ in range (float16: largest
65504, smallest normal 6.1e-5). So a HiFT whose convolution operands (inputs and weights) sit inside
float16's normal range loses no more to float16 operands than to TF32 ones, and the vocoder's 16-bit
path (1.5 x faster at 64 streams) is as exact as the default. This script measures that for the
bench's seeded random weights or a real checkpoint:

* the upstream ``HiFTGenerator`` run in float64 on a mel and source (``bench/vocoder.py``'s inputs
  unless ``--mel`` is given), every convolution's input and weight recorded: largest magnitude,
  float16 headroom (log2(65504 / max |x|)), the share of nonzero values below 6.1e-5;
* the same decode with every convolution's operands rounded as TF32 (nearest even), float16 and
  bfloat16 would round them, the math otherwise float64: the error each rounding alone causes;
* torch_cfm's ``HiFTVocoder`` at "fp16" and "bf16" on the CPU (library convolutions; 16-bit
  operands and outputs, float32 residuals).

    python3 bench/experiments/vocoder_fp16_range.py [--checkpoint hift.pt] [--mel mel.pt] --out DIR
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
sys.path[:0] = [os.path.dirname(HERE), ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

FP16_MAX, FP16_MIN_NORMAL = 65504.0, 2.0 ** -14


def as_tf32(t: torch.Tensor) -> torch.Tensor:
    from torch_cfm.kernels.vocoder_conv import round_tf32

    return round_tf32(t).double()


ROUNDINGS = {"tf32": as_tf32, "fp16": lambda t: t.half().double(), "bf16": lambda t: t.bfloat16().double()}


def _stats(t: torch.Tensor) -> dict:
    a = t.detach().abs()
    nz = a[a > 0]
    top = float(a.max()) if a.numel() else 0.0
    return {"max": top, "headroom_log2": round(math.log2(FP16_MAX / top), 2) if top > 0 else None,
            "below_fp16_normal": float((nz < FP16_MIN_NORMAL).double().mean()) if nz.numel() else 0.0}


def decode64(h64, mel: torch.Tensor, source: torch.Tensor, rounding=None, record: list | None = None) -> torch.Tensor:
    """The float64 module's decode, each convolution's operands rounded by ``rounding`` (None: exact);
    ``record`` gets per-convolution operand statistics."""
    from torch_cfm.models.hift_capturable import capturable

    h = copy.deepcopy(h64)
    for name, m in h.named_modules():
        if not isinstance(m, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
            continue

        def forward(x, m=m, name=name):
            w = m.weight
            if record is not None:
                record.append({"layer": name, "weight_shape": list(w.shape), "input": _stats(x), "weight": _stats(w)})
            if rounding is not None:
                x, w = rounding(x), rounding(w)
            if isinstance(m, torch.nn.ConvTranspose1d):
                return F.conv_transpose1d(x, w, m.bias, m.stride, m.padding, m.output_padding, m.groups, m.dilation)
            return m._conv_forward(x, w, m.bias)

        m.forward = forward
    with torch.no_grad(), capturable(h, h.stft_window):
        return h.decode(x=mel.double(), s=source.double())


def main() -> int:
    import vocoder as V
    from oracle import err_rel_fro
    from torch_cfm.models.vocoder import HiFTVocoder

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default=None, help="a HiFTGenerator state dict (e.g. Step-Audio 2's hift.pt)")
    ap.add_argument("--mel", default=None, help="a (B, 80, T) mel tensor saved with torch.save")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--frames", type=int, default=58)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(min(8, os.cpu_count() or 1))
    dev = torch.device("cpu")
    hift = V.build_hift(args.seed, dev)
    mel, source = V.make_inputs(hift, args.batch, args.frames, args.seed + 1, dev)
    if args.checkpoint:
        hift.load_state_dict(torch.load(args.checkpoint, map_location="cpu"))
    if args.mel:  # its own mel; the source from the bench's f0 contour at its length
        mel = torch.load(args.mel, map_location="cpu").float()
        source = V.make_inputs(hift, mel.shape[0], mel.shape[2], args.seed + 1, dev)[1]
    if not args.checkpoint:
        V.scale_output(hift, mel, source)  # random weights: the waveform inside the clamp
    h64 = copy.deepcopy(hift).double()
    layers: list = []
    ref = decode64(h64, mel, source, record=layers)
    result = {"weights": args.checkpoint or f"seeded random (bench/vocoder.py, seed {args.seed})",
              "batch": int(mel.shape[0]), "frames": int(mel.shape[2]), "operand_rounding_rel_err": {},
              "hift_vocoder_rel_err": {}}
    for name, rounding in ROUNDINGS.items():
        result["operand_rounding_rel_err"][name] = err_rel_fro(decode64(h64, mel, source, rounding), ref)
    for precision in ("fp16", "bf16"):
        with torch.no_grad():
            out = HiFTVocoder(hift, precision=precision).decode(mel, source)
        result["hift_vocoder_rel_err"][precision] = err_rel_fro(out.double(), ref)
    heads = [x["input"]["headroom_log2"] for x in layers if x["input"]["headroom_log2"] is not None]
    result["least_input_headroom_log2"] = min(heads)
    result["most_inputs_below_fp16_normal"] = max(x["input"]["below_fp16_normal"] for x in layers)
    result["most_weights_below_fp16_normal"] = max(x["weight"]["below_fp16_normal"] for x in layers)
    result["layers"] = layers
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "vocoder_fp16_range.json"), "w") as f:
        json.dump(result, f, indent=1)
    for key in ("operand_rounding_rel_err", "hift_vocoder_rel_err"):
        print(key, {k: f"{v:.3e}" for k, v in result[key].items()})
    print(f"least float16 headroom of a convolution input: 2^{result['least_input_headroom_log2']}; "
          f"most inputs below float16's normal range in a layer: {result['most_inputs_below_fp16_normal']:.2%}; "
          f"weights: {result['most_weights_below_fp16_normal']:.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
