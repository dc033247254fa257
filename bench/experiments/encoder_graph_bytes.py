"""Issue 42's memory: the bytes a captured encoder graph holds, counted on the CPU.

``GraphCache`` keeps, per captured key, a static copy of the call's tensor inputs (``static_args``,
outside the graph pool) and the outputs the capture allocated (``static_out``, allocated inside it):
both count as allocated memory for as long as the graph lives, as they did for the encoder stage
before it took ``GraphCache(shared_io=True)``. For the encoder stage those are a whole batch's
conformer caches in and out. On the CPU the stage runs eagerly, but its ``GraphedCall`` sees the
same calls, so the inputs and outputs of every key a warm-up meets can be summed here, at the
shipped encoder sizes (the DiT is tiny: the CFM does not change these), as fp16 bytes (the flow's
dtype on CUDA), with the batch buckets a server on CUDA pads to (its CFM slot buckets,
``Buckets.for_graphs``). Then the same keys, in the warm-up's order, as the shared buffers of
``GraphCache(shared_io=True)`` hold them (every key's inputs carved from one buffer, its outputs
from another, 256-byte aligned; a buffer outgrown is replaced by one at least twice its size and
stays alive, the graphs captured before holding views of it).

    python3 bench/experiments/encoder_graph_bytes.py [--streams 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [os.path.join(ROOT, "tests"), ROOT]

import torch  # noqa: E402

import upstream_flow as U  # noqa: E402
from torch_cfm.buckets import Buckets  # noqa: E402
from torch_cfm.graphs import GraphedCall, signature, tree_tensors  # noqa: E402
from torch_cfm.models.cache import TRIM_KEEP_OLDEST  # noqa: E402
from torch_cfm.serving import Token2wavServer  # noqa: E402

MIB = 2 ** 20


def cuda_bytes(obj) -> int:
    """Bytes of the tensors of ``obj`` as the fp16 flow holds them on CUDA (floats in 2 bytes)."""
    return sum(t.numel() * (2 if t.is_floating_point() else t.element_size()) for t in tree_tensors(obj))


ALIGN = 256


def shared_bytes(keys: list[list]) -> int:
    """Bytes of every shared buffer the patch's growth rule allocates for these keys' (dtype, shape)
    lists, carved in order (module docstring)."""
    buffer = total = 0
    for specs in keys:
        need = 0
        for dtype, shape in specs:
            itemsize = 2 if dtype.is_floating_point else torch.empty((), dtype=dtype).element_size()
            need += -(-math.prod(shape) * itemsize // ALIGN) * ALIGN
        if need > buffer:
            buffer = max(need, 2 * buffer)
            total += buffer
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prompt-frames", type=int, default=300)
    args = ap.parse_args()
    size = dataclasses.replace(U.SHIPPED, hidden=64, depth=2, heads=4, head_dim=16)
    flow = U.build_flow(size, seed=0)
    U.resize_scratch_buffers(flow, args.prompt_frames + TRIM_KEEP_OLDEST + 56)
    buckets = Buckets.for_graphs(max_chunk_frames=56, max_cache_frames=400, max_slots=args.streams).slots
    keys: dict = {}
    original = GraphedCall.__call__

    def counted(self, *a, **kw):
        out = original(self, *a, **kw)
        key = (self.name, signature(a), signature(kw))
        if self.name.startswith("Token2wavServer.encoder") and key not in keys:
            keys[key] = ([(t.dtype, tuple(t.shape)) for t in tree_tensors((a, kw))],
                         [(t.dtype, tuple(t.shape)) for t in tree_tensors(out)], cuda_bytes((a, kw)), cuda_bytes(out))
        return out

    GraphedCall.__call__ = counted
    try:
        server = Token2wavServer(flow, None, max_streams=args.streams, max_prompt_frames=args.prompt_frames,
                                 max_chunk_tokens=28, n_timesteps=2, stage_graphs=True, batch_buckets=buckets)
        server.warmup(prompt_frames=(args.prompt_frames,), chunk_tokens=(28,), last_chunk_tokens=(), stream_counts=buckets)
    finally:
        GraphedCall.__call__ = original
    total_in = total_out = 0
    for ins, _, nin, nout in keys.values():
        total_in, total_out = total_in + nin, total_out + nout
        print(f"inputs {str([s for _, s in ins][:3]):62s} static inputs {nin / MIB:7.1f} MiB, outputs {nout / MIB:7.1f} MiB")
    print(f"{len(keys)} encoder keys at {args.streams} streams (batch buckets {list(buckets)}): static inputs "
          f"{total_in / MIB:.0f} MiB, outputs {total_out / MIB:.0f} MiB (fp16), held for as long as their graphs live")
    ins, outs = (shared_bytes([k[i] for k in keys.values()]) for i in (0, 1))
    print(f"with shared_io: input buffers {ins / MIB:.0f} MiB, output buffers {outs / MIB:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
