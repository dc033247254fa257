"""Bytes written per steady chunk by the encoder stage's equal-batch body (issue 43 item 2; experiment).

``EncoderStage`` of a torch_cfm tree (``--tree``, default this one), shipped flow sizes, random
weights, fp32 on the CPU, eager: ``--streams`` streams open with 300-frame prompts, run until their
conformer caches reach the trim bound, then one more chunk under a ``TorchDispatchMode`` that adds
up the bytes every op writes (its output; for in-place and ``out=`` ops the tensor written; views
and allocations not counted), by op. A copy's traffic, not its time: compare trees with it, e.g.
this one against an earlier commit unpacked into a folder (``git archive <commit> | tar -x -C DIR``):

    python3 bench/experiments/encoder_bytes.py --streams 8
    python3 bench/experiments/encoder_bytes.py --streams 8 --tree /tmp/earlier_tree
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NOT_WRITES = ("view", "_unsafe_view", "transpose", "expand", "split", "slice", "select", "unsqueeze", "as_strided",
              "permute", "alias", "detach", "t.", "empty", "lift")


class Written(TorchDispatchMode):
    """Bytes each op writes, by op name."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.__name__
        if name.startswith(NOT_WRITES):
            return out
        written = kwargs["out"] if "out" in kwargs else args[0] if name.endswith("_.default") else out
        written = written if isinstance(written, (tuple, list)) else [written]
        self.bytes[name] += sum(t.numel() * t.element_size() for t in written if isinstance(t, torch.Tensor))
        return out


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", default=os.path.dirname(os.path.dirname(here)), help="the torch_cfm tree to import")
    ap.add_argument("--streams", type=int, default=8)
    args = ap.parse_args()
    sys.path[:0] = [os.path.join(args.tree, "tests"), args.tree]
    import upstream_flow as U

    from torch_cfm.serving.encoder_stage import EncoderStage

    streams, prompt = args.streams, 300
    torch.manual_seed(0)
    flow = U.build_flow(U.SHIPPED).eval()
    stage = EncoderStage(flow, max_streams=streams, max_prompt_frames=prompt, max_chunk_tokens=28, batching="equal",
                         batch_buckets=None, graphs=False, stats={"encoder_batches": 0, "ragged_batches": 0})
    g = torch.Generator().manual_seed(1)

    def chunk(tokens: int):
        return [(sid, torch.randint(0, 6561, (1, tokens), generator=g), False) for sid in range(streams)]

    with torch.no_grad():
        for sid in range(streams):
            stage.open(sid, prompt)
        stage(chunk(prompt // 2 + 3))  # the prompts
        for _ in range(5):  # chunks until the caches are at the trim bound
            stage(chunk(28))
        with Written() as written:
            stage(chunk(28))
    total = sum(written.bytes.values())
    print(f"{args.tree}: {streams} streams, caches at {stage.slots.length(0)} frames: "
          f"{total / 1e6:.1f} MB written per steady chunk")
    for name, count in written.bytes.most_common(8):
        print(f"  {name:32s} {count / 1e6:8.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
