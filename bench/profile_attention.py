"""Run the ``cfm_attention`` Triton kernel (or the CUDA one, ``--cuda-config``) at one shape a few times, eagerly, for Nsight Compute.

    ncu -k regex:_cfm_attention_fwd --launch-skip 3 --launch-count 1 --set full --import-source yes \
        -o attn python3 bench/profile_attention.py --shape 8,50,450 --dtype fp16

The inputs are the benchmark's (``bench/attention.py::make_inputs``: ragged lengths, seed 0), so
the profile is of the same calls the bench times (without the CUDA graph and PDL overlap).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention import DTYPES, HEAD_DIM, HEADS, make_inputs  # noqa: E402

from torch_cfm.kernels.cfm_attention import cfm_attention_triton  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="8,50,450", help="N,Q,K")
    ap.add_argument("--dtype", default="fp16", choices=tuple(DTYPES))
    ap.add_argument("--calls", type=int, default=6)
    ap.add_argument("--cuda-config", default=None,
                    help="profile the CUDA kernel (csrc/cuda/) with this block_k,q_groups,key_splits,buffers[,cluster[,kv_groups]]")
    args = ap.parse_args(argv)
    n, q_len, k_len = (int(x) for x in args.shape.split(","))
    dtype, precision = DTYPES[args.dtype]
    inp = make_inputs(n, q_len, k_len, dtype)
    out = torch.empty(n, q_len, HEADS, HEAD_DIM, device="cuda", dtype=dtype).transpose(1, 2)
    for _ in range(args.calls):
        if args.cuda_config:
            from torch_cfm.kernels.cfm_attention_cuda import CudaAttentionConfig, cfm_attention_cuda

            cfg = CudaAttentionConfig(*(int(x) for x in args.cuda_config.split(",")))
            cfm_attention_cuda(inp["q"], inp["k"], inp["v"], inp["lengths"], None, None, out, cfg)
        else:
            cfm_attention_triton(inp["q"], inp["k"], inp["v"], inp["lengths"], None, None, precision, out)
    torch.cuda.synchronize()
    print("lengths", inp["lengths"].tolist())
    return 0


if __name__ == "__main__":
    sys.exit(main())
