"""Registers, spills and shared memory of the Triton kernels, compiled for a GPU target on any machine.

Triton compiles ahead of time without a GPU (``triton.compile`` with a ``GPUTarget``); the cubin's
resource usage (``cuobjdump -res-usage``, shipped with Triton) shows register pressure and spills
(``STACK`` bytes per thread) before any device time is spent. Use the Triton version of the GPU box
for numbers that match it, e.g. on the CPU box:

    pip download triton==3.6.0 --no-deps -d /tmp/whl && python3 -m zipfile -e /tmp/whl/triton-3.6.0-*.whl /tmp/tri36
    chmod +x /tmp/tri36/triton/backends/nvidia/bin/*
    PYTHONPATH=/tmp/tri36 python3 bench/kernel_resources.py            # sm_90 (H100/H200)

Prints one line per kernel configuration: what ``choose_config`` picks for the SPEC §7 attention
shapes, and the body's v5 attention + cache kernel at its default launch parameters. Not a
benchmark (nothing runs): spills predict slowness, no spills do not predict speed.
"""

from __future__ import annotations

import argparse
import inspect
import os
import subprocess
import sys

import torch

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root (in-place build)

_TRITON_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _resources(compiled) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    path = "/tmp/torch_cfm_kernel_resources.cubin"
    with open(path, "wb") as fh:
        fh.write(compiled.asm["cubin"])
    out = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True).stdout
    line = next((ln.strip() for ln in out.splitlines() if "REG:" in ln), "?")
    return line.split(" SHARED")[0] + f" smem={compiled.metadata.shared}"


def _compile(kernel, signature: dict, constexprs: dict, num_warps: int, num_stages: int, arch: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {k: ("constexpr" if k in constexprs else v) for k, v in signature.items()}
    return triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs),
                          target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": num_stages})


def _signature(kernel, pointer: str, ints: tuple[str, ...] = (), floats: tuple[str, ...] = (), **pointers) -> dict:
    sig = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in pointers:
            sig[name] = pointers[name]
        elif name.endswith("_ptr"):
            sig[name] = pointer
        elif name in floats:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def attention_rows(arch: int, n_sm: int) -> list[str]:
    from torch_cfm.config import ATTENTION_BENCH_SHAPES
    from torch_cfm.kernels.cfm_attention import _cfm_attention_fwd_kernel as kernel
    from torch_cfm.kernels.cfm_attention import _dot_precision, choose_config

    rows = []
    heads, head_dim = 8, 64
    for dtype, precision in ((torch.float16, None), (torch.float32, "tf32"), (torch.float32, "ieee")):
        for n, q_len, k_len in ATTENTION_BENCH_SHAPES:
            cfg = choose_config(dtype, head_dim, n * heads, q_len, k_len, n_sm, precision)
            sig = _signature(kernel, f"*{_TRITON_TYPES[dtype]}", floats=("qk_scale",), lengths_ptr="*i32",
                             rows_ptr="*i32", mask_ptr="*u8", part_ptr="*fp32", lse_ptr="*fp32", count_ptr="*i32")
            const = dict(HEAD_DIM=head_dim, BLOCK_Q=cfg.block_q, BLOCK_K=cfg.block_k, HAS_LENGTHS=True,
                         HAS_MASK=False, HAS_ROWS=False, DOT_PRECISION=_dot_precision(dtype, precision, cfg),
                         PEEL=cfg.peel, USE_PDL=False, LAST_MERGES=cfg.splits > 1 and cfg.merge == "last")
            if cfg.splits == 1:
                const["n_splits"] = 1
            compiled = _compile(kernel, sig, const, cfg.num_warps, cfg.num_stages, arch)
            rows.append(f"cfm_attention {n},{q_len},{k_len} {_TRITON_TYPES[dtype]}-{precision or '16'} {cfg.name}: "
                        + _resources(compiled))
    return rows


def dit_attention_rows(arch: int) -> list[str]:
    from torch_cfm.kernels.dit_attention import _dit_attention_cache_kernel as kernel
    from torch_cfm.kernels.dit_attention import attention_tiles

    rows = []
    for dtype, dot in ((torch.float16, "tf32"), (torch.bfloat16, "tf32"), (torch.float32, "tf32"),
                       (torch.float32, "tf32x3")):
        cfg = attention_tiles(dtype, 64, 50)
        sig = _signature(kernel, f"*{_TRITON_TYPES[dtype]}", floats=("eps", "qk_scale"), valid_ptr="*i32",
                         cached_ptr="*i32")
        const = dict(HAS_OLD=True, HEAD_DIM=64, BLOCK_Q=cfg["block_q"], BLOCK_K=cfg["block_k"],
                     BLOCK_C=cfg["block_c"], DOT_PRECISION=dot)
        compiled = _compile(kernel, sig, const, cfg["num_warps"], cfg["num_stages"], arch)
        rows.append(f"dit_attention (v5) T=50 {_TRITON_TYPES[dtype]}-{dot} {cfg}: " + _resources(compiled))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H200)")
    ap.add_argument("--sms", type=int, default=132, help="SM count the heuristics assume")
    args = ap.parse_args(argv)
    import triton

    print(f"triton {triton.__version__}, target sm_{args.arch}")
    for line in attention_rows(args.arch, args.sms) + dit_attention_rows(args.arch):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
