"""Issue 43: why the vocoder's fused convolutions run at 100-170 TFLOP/s (H100 TF32, 64 streams):
one decode's ``_vocoder_conv_kernel`` launches under Nsight Compute (throughput against peak for
SM, tensor pipes, L1, L2 and HBM; warp stall reasons; occupancy). This script runs the decode;
``ncu`` profiles only the third one (the first two compile and warm up):

    ncu --clock-control none --profile-from-start off -k regex:vocoder_conv --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats \\
        --section Occupancy --section LaunchStats -f -o "$OUT/ncu_tf32" \\
        python3 bench/experiments/vocoder_conv_ncu.py --precision tf32
    ncu --import "$OUT/ncu_tf32.ncu-rep" --csv --page details > "$OUT/ncu_tf32.csv"

The HiFT at its shipped sizes, random weights scaled as ``bench/vocoder.py`` does, ``--streams``
one-second chunks (58 frames with the 8 cached ones); precision and tiles as dispatch picks them.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(ROOT, "tests"), ROOT]

import torch  # noqa: E402

import vocoder as V  # noqa: E402


def main() -> int:
    from torch_cfm.models.vocoder import HiFTVocoder

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", default="tf32")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--frames", type=int, default=58)
    args = ap.parse_args()
    dev = torch.device("cuda")
    hift = V.build_hift(0, dev)
    mel, source = V.make_inputs(hift, args.streams, args.frames, 1, dev)
    V.scale_output(hift, mel, source)
    voc = HiFTVocoder(hift, precision=args.precision)
    for _ in range(2):
        voc.decode(mel, source)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    voc.decode(mel, source)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"decoded {args.streams} x {args.frames} frames at {args.precision}: {voc.fused_convs} fused convolutions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
