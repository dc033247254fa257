"""Issue 40: a voice-cache hit writes the cached prompt state into a slot of the CFM arena; how
fast, as PyTorch's strided copy of fp16 elements and as ``copy_wide_`` (8-byte words), in one run.

The arena at the shipped sizes (n = 10 steps, 16 blocks, 8 heads, 2D = 128, fp16), ``--slots``
slots of ``--frames`` cache frames; the state of ``--length`` frames (a 300-frame prompt's cache)
goes into one slot's two rows (cond, uncond): what ``CacheArena.write_slot`` does for a hit. Each
variant is timed in a CUDA graph (harness: 20 copies per replay, p50 over repeats), checked
bitwise against the other. Rows (op ``voice_restore``) go to ``<out>/voice_restore.json``.

    python3 bench/experiments/voice_restore_copy.py --out "$OUT"
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [os.path.dirname(HERE), ROOT]

import torch  # noqa: E402

import _harness as H  # noqa: E402
from torch_cfm.models.cache import copy_wide_  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--frames", type=int, default=460)
    ap.add_argument("--length", type=int, default=306)
    ap.add_argument("--out", default="/tmp/voice_restore")
    args = ap.parse_args()
    n, depth, heads, d2 = 10, 16, 8, 128
    att = torch.zeros(n, depth, 2 * args.slots, heads, args.frames, d2, device="cuda", dtype=torch.float16)
    state = torch.randn(n, depth, 2, heads, args.length, d2, device="cuda", dtype=torch.float16)
    slot = args.slots // 2
    dst = [att[:, :, row, :, :args.length] for row in (slot, args.slots + slot)]

    def plain():
        for r in range(2):
            dst[r].copy_(state[:, :, r])

    def wide():
        for r in range(2):
            copy_wide_(dst[r], state[:, :, r])

    env, rows = H.env_info(), []
    nbytes = 2 * state.numel() * state.element_size()  # read and written once each
    for name, fn in (("copy_", plain), ("copy_wide_", wide)):
        att.zero_()
        fn()
        assert torch.equal(att[:, :, [slot, args.slots + slot], :, :args.length].view(torch.int16),
                           state.view(torch.int16)), name
        t = H.time_cuda_graph(fn, calls=20, repeats=30)
        tbps = nbytes / (t["us_p50"] * 1e-6) / 1e12
        print(f"{name:11s} {t['us_p50']:8.1f} us per restore ({state.numel() * 2 / 2**20:.0f} MiB, {tbps:.2f} TB/s)")
        rows.append(H.make_row(env, op="voice_restore", provider="torch_cfm", variant=name,
                               shape={"slots": args.slots, "frames": args.frames, "length": args.length},
                               dtype="fp16", timing="cuda_graph", tb_per_s=round(tbps, 3), **t))
    os.makedirs(args.out, exist_ok=True)
    H.upsert_rows(os.path.join(args.out, "voice_restore.json"), rows, table=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
