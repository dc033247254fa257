"""Registers, spills, shared memory and load pipelining of the Triton kernels, compiled for a GPU
target on any machine (no GPU needed).

Triton compiles ahead of time without a GPU (``triton.compile`` with a ``GPUTarget``). This script
specialises each kernel the way a real launch would (16-byte aligned pointers and multiples of 16
marked divisible, integer arguments equal to 1 folded to constants, ``do_not_specialize`` honoured)
from the argument values of a representative call, then reads the cubin's resource usage with
``cuobjdump -res-usage`` (shipped with Triton) and counts the asynchronous copies in the PTX. Use
the Triton version of the GPU box for numbers that match it, e.g. on the CPU box:

    pip download triton==3.6.0 --no-deps -d /tmp/whl && python3 -m zipfile -e /tmp/whl/triton-3.6.0-*.whl /tmp/tri36
    chmod +x /tmp/tri36/triton/backends/nvidia/bin/*
    PYTHONPATH=/tmp/tri36 python3 bench/kernel_resources.py            # sm_90 (H100/H200)

One line per kernel configuration: the attention kernel as ``choose_config`` picks it for the
docs/design.md §7 shapes, and the body's v5 attention + cache kernel at its launch parameters (its
new-cache and in-place arena forms); with ``--only vocoder_conv``, the HiFT's fused convolutions at
the shipped sizes; with ``--only cuda_attention``, every instantiation of the hand-written CUDA
attention kernel (``csrc/cuda/``, compiled with the local ``nvcc``; no Triton needed). Not a
benchmark (nothing runs): spills predict slowness, their absence does not predict speed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root (in-place build)

_TRITON_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def compile_like_launch(kernel, args: dict, constexprs: dict, num_warps: int, num_stages: int, arch: int,
                        gluon: bool = False):
    """Compile ``kernel`` for sm_``arch`` as a launch with these argument values would.

    ``args``: every runtime argument by name: a pointer as its Triton type string ("*fp16", assumed
    16-byte aligned), an int as its value, a float as its value. ``constexprs``: the constexpr
    parameters by name. ``gluon``: a ``gluon.jit`` kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource

    signature, consts, attrs = {}, dict(constexprs), {}
    for i, param in enumerate(kernel.params):
        name = param.name
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        value = args[name]
        if isinstance(value, str):  # pointer
            signature[name] = value
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif param.do_not_specialize:
            signature[name] = "i32"
        elif value == 1:  # Triton folds integer arguments equal to 1 into the kernel
            signature[name] = "constexpr"
            consts[name] = 1
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": num_stages})


def describe(compiled) -> str:
    """REG / STACK (spill bytes per thread) from cuobjdump, shared memory, SASS instructions (code
    size: a kernel too big for the instruction cache stalls on fetch), async copies in the PTX."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    path = "/tmp/torch_cfm_kernel_resources.cubin"
    with open(path, "wb") as fh:
        fh.write(compiled.asm["cubin"])
    out = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True).stdout
    line = next((ln.strip() for ln in out.splitlines() if "REG:" in ln), "?")
    ptx = compiled.asm["ptx"]
    sass = subprocess.run([os.path.join(os.path.dirname(tool), "nvdisasm"), path], capture_output=True, text=True).stdout
    instructions = sum(1 for ln in sass.splitlines() if ln.strip().startswith("/*") and "*/" in ln and ";" in ln)
    return (line.split(" SHARED")[0] + f" smem={compiled.metadata.shared} sass={instructions}"
            + f" cp.async={ptx.count('cp.async.cg') + ptx.count('cp.async.ca')}"
            + f" wgmma={ptx.count('wgmma.mma_async')} mma.sync={ptx.count('mma.sync')}")


def attention_rows(arch: int, n_sm: int) -> list[str]:
    from torch_cfm.config import ATTENTION_BENCH_SHAPES
    from torch_cfm.kernels.cfm_attention import LOG2E, _dot_precision, choose_config, qk_slabs
    from torch_cfm.kernels.cfm_attention import _cfm_attention_fwd_kernel as kernel

    rows = []
    heads, d = 8, 64
    for dtype, precision in ((torch.float16, None), (torch.float32, "tf32"), (torch.float32, "ieee")):
        ty = "*" + _TRITON_TYPES[dtype]
        for n, q_len, k_len in ATTENTION_BENCH_SHAPES:
            cfg = choose_config(dtype, d, n * heads, q_len, k_len, n_sm, precision)
            q_tiles = -(-q_len // cfg.block_q)
            # the bench's layout: q a (N, Q, H, D) buffer seen as (N, H, Q, D); k, v the halves of an
            # (N, H, K, 2D) cache; out (N, Q, H, D) seen as (N, H, Q, D); lengths only
            q_strides = (q_len * heads * d, d, heads * d, 1)
            kv_strides = (heads * k_len * 2 * d, k_len * 2 * d, 2 * d, 1)
            args = dict(q_ptr=ty, k_ptr=ty, v_ptr=ty, lengths_ptr="*i32", mask_ptr="*u8", rows_ptr="*i32",
                        out_ptr=ty, part_ptr="*fp32", lse_ptr="*fp32", count_ptr="*i32",
                        n_heads=heads, q_len=q_len, k_len=k_len, n_pool=n, q_tiles=q_tiles, n_splits=cfg.splits,
                        n_rows_heads=n * heads, qk_scale=LOG2E / d ** 0.5, fresh_zero=0.0)
            for prefix, strides in (("q", q_strides), ("k", kv_strides), ("v", kv_strides), ("m", (0, 0, 0)),
                                    ("o", q_strides)):
                names = ("n", "q", "k") if prefix == "m" else ("n", "h", "k" if prefix in "kv" else "q", "d")
                for name, stride in zip(names, strides):
                    args[f"stride_{prefix}_{name}"] = stride
            const = dict(HEAD_DIM=d, BLOCK_Q=cfg.block_q, BLOCK_K=cfg.block_k, HAS_LENGTHS=True, HAS_MASK=False,
                         QK_SLABS=qk_slabs(cfg, d),
                         HAS_ROWS=False, DOT_PRECISION=_dot_precision(dtype, precision, cfg), PEEL=cfg.peel,
                         USE_PDL=False, LAST_MERGES=cfg.splits > 1 and cfg.merge == "last")
            compiled = compile_like_launch(kernel, args, const, cfg.num_warps, cfg.num_stages, arch)
            rows.append(f"cfm_attention {n},{q_len},{k_len} {_TRITON_TYPES[dtype]}-{precision or '16'} {cfg.name}: "
                        + describe(compiled))
    return rows


def dit_attention_rows(arch: int, n_rows: int = 8, t_len: int = 50, l_len: int = 400, append: bool = False
                       ) -> list[str]:
    """The body's attention + cache kernel (the fused_attention plans') at its launch parameters: the
    new-cache form (old cache in, new cache out, copy programs), or with ``append`` the in-place arena
    form (APPEND: the old frames read in the arena, the current ones appended there; fp32 in its IEEE
    form only)."""
    from torch_cfm.kernels.dit_attention import LOG2E, _dit_attention_cache_kernel as kernel
    from torch_cfm.kernels.dit_attention import attention_tiles

    rows = []
    heads, d = 8, 64
    forms = (((torch.float16, "tf32"), (torch.bfloat16, "tf32"), (torch.float32, "tf32x3")) if append else
             ((torch.float16, "tf32"), (torch.bfloat16, "tf32"), (torch.float32, "tf32"), (torch.float32, "tf32x3")))
    for dtype, dot in forms:
        ty = "*" + _TRITON_TYPES[dtype]
        cfg = attention_tiles(dtype, d, t_len)
        q_tiles = -(-t_len // cfg["block_q"])
        frames = t_len + l_len  # the new cache, or the arena (L old frames of room + T)
        old = (heads * frames * 2 * d, frames * 2 * d) if append else (heads * l_len * 2 * d, l_len * 2 * d)
        args = dict(qkv_ptr=ty, stride_qkv=3 * heads * d, qn_w_ptr=ty, qn_b_ptr=ty, kn_w_ptr=ty, kn_b_ptr=ty,
                    old_ptr=ty, s_old_n=old[0], s_old_h=old[1], s_old_f=2 * d, s_old_e=1,
                    new_ptr=ty, s_new_n=heads * frames * 2 * d, s_new_h=frames * 2 * d,
                    s_new_f=2 * d, s_new_e=1, out_ptr=ty, valid_ptr="*i32", cached_ptr="*i32",
                    T=t_len, L=l_len, H=heads, q_tiles=q_tiles, n_attn=n_rows * heads * q_tiles,
                    f_chunks=0 if append else -(-frames // cfg["copy_f"]), eps=1e-6, qk_scale=LOG2E / d ** 0.5)
        const = dict(HAS_OLD=True, HEAD_DIM=d, BLOCK_Q=cfg["block_q"], BLOCK_K=cfg["block_k"],
                     BLOCK_C=cfg["block_c"], COPY_F=cfg["copy_f"], DOT_PRECISION=dot, USE_PDL=True, APPEND=append)
        compiled = compile_like_launch(kernel, args, const, cfg["num_warps"], cfg["num_stages"], arch)
        rows.append(f"dit_attention ({'arena' if append else 'v5'}) {n_rows},{t_len},{l_len} "
                    f"{_TRITON_TYPES[dtype]}-{dot} {cfg}: " + describe(compiled))
    return rows


def cuda_attention_rows(arch: int) -> list[str]:
    """Registers and spills of every instantiation of the hand-written CUDA attention kernel
    (csrc/cuda/), compiled with the local ``nvcc`` for sm_``arch`` (``a`` suffix from 90 on)."""
    import re
    import shutil
    import tempfile

    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not os.path.exists(nvcc):
        return ["cuda_attention: no nvcc on this machine"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    target = f"{arch}a" if arch >= 90 else str(arch)
    rows = []
    for name in ("f16", "bf16", "f32"):
        source = os.path.join(root, "csrc", "cuda", f"cfm_attention_{name}.cu")
        with tempfile.TemporaryDirectory() as tmp:
            res = subprocess.run([nvcc, "-std=c++17", "-O3", f"-gencode=arch=compute_{target},code=sm_{target}",
                                  "-Xptxas", "-v", "-c", source, "-o", os.path.join(tmp, "k.o")],
                                 capture_output=True, text=True)
        if res.returncode:
            rows.append(f"cuda_attention {name}: nvcc failed: {res.stderr.strip().splitlines()[-1]}")
            continue
        kernel = None
        for line in res.stderr.splitlines():
            found = re.search(r"cfm_attention_fwd_kernel.*?Li(\d+)ELi(\d+)ELi(\d+)ELi(\d+)ELi(\d+)ELi(\d+)EE", line)
            if found and "Compiling entry" in line:
                d, bk, wq, wk, nb, c = (int(x) for x in found.groups())
                kernel = f"d{d}_k{bk}_q{16 * wq}_w{wk}_b{nb}" + (f"_c{c}" if c > 1 else "")
            elif kernel and "spill" in line:
                spills = line.strip()
            elif kernel and "Used" in line:
                regs = re.search(r"Used (\d+) registers", line).group(1)
                rows.append(f"cuda_attention {name:<4} {kernel:<24} {regs:>3} registers, {spills}")
                kernel = None
    return rows


def vocoder_conv_rows(arch: int, streams: int = 64, stages: int = 0) -> list[str]:
    """The HiFT's fused convolutions (kernels/vocoder_conv.py) at the shipped sizes, 58 frames per
    stream, with the tiles the tuning table picks (``kernels/vocoder_tiles.py``): a ResBlock convolution per stage (with its Snake
    epilogue), the stage merge (3 Snakes), the upsamplings, TF32 and fp16."""
    import torch_cfm.kernels.vocoder_conv as vc

    rows = []
    # (name, C_in, C_out, taps, phases, transposed, frames out, snakes, add_r, add_a): a stage's merge is its
    # source ResBlock's last convolution, adding the upsampled x (reflected at the last stage) and feeding
    # the three ResBlocks' first Snakes
    layers = [("resblock s0 k11", 256, 256, 11, 1, False, 464, 1, True, False),
              ("resblock s1 k11", 128, 128, 11, 1, False, 2320, 1, True, False),
              ("resblock s2 k11", 64, 64, 11, 1, False, 6961, 1, True, False),
              ("merge s1 k7", 128, 128, 7, 1, False, 2320, 3, True, True),
              ("merge s2 k11", 64, 64, 11, 1, False, 6961, 3, True, True),
              ("up x8", 512, 256, 2, 8, True, 464, 0, False, False), ("up x3", 128, 64, 3, 3, True, 6960, 0, False, False)]
    for dtype, dot in ((torch.float32, "tf32"), (torch.float16, None)):
        ty = "*" + _TRITON_TYPES[dtype]
        for name, c_in, c_out, taps, phases, transposed, l_out, snakes, add_r, add_a in layers:
            weight = torch.empty(phases, taps, c_out, c_in, dtype=dtype)
            conv = vc.PackedConv(weight, None, c_in, c_out, taps * phases, phases, 0, 1, 0, transposed)
            q = -(-l_out // phases)
            tiles = vc.conv_tiles(vc.launch_key(conv, q, dot or "tf32"))
            block_m, block_n, block_k, warps = tiles.block_m, tiles.block_n, tiles.block_k, tiles.warps
            args = dict(x_ptr=ty, w_ptr=ty, bias_ptr="*fp32", r_ptr="*fp32", acc_ptr="*fp32", a_ptr="*fp32",
                        s_ptr="*fp32", y_ptr=ty, y_stride=streams * l_out * c_out, alpha_ptr="*fp32", inv_ptr="*fp32",
                        L_in=l_out, L_out=l_out, L_a=l_out, C_in=c_in, C_out=c_out, Q=q, STRIDE=phases, PAD=1, DIL=3,
                        KSIZE=taps * phases, divisor=1.0, slope=0.1)
            consts = dict(PHASES=phases, TAPS=taps, TRANSPOSED=transposed, DOT=dot, ROUND_A=False,
                          ROUND_OUT=dot == "tf32", HAS_BIAS=True, ADD_R=add_r, ADD_ACC=False, ADD_A=add_a,
                          REFLECT=add_a and c_in == 64, ACT=0, DIVIDE=False, STORE_S=add_r or not snakes, K=snakes,
                          BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
            compiled = compile_like_launch(vc._vocoder_conv_kernel, args, consts, warps, stages or tiles.stages, arch)
            rows.append(f"vocoder_conv {_TRITON_TYPES[dtype]} {name:16s} tiles {block_m}x{block_n}x{block_k} "
                        f"w{warps}: {describe(compiled)}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H200)")
    ap.add_argument("--sms", type=int, default=132, help="SM count the heuristics assume")
    ap.add_argument("--only", default=None, choices=("attention", "dit_attention", "cuda_attention", "vocoder_conv"))
    args = ap.parse_args(argv)
    import triton

    print(f"triton {triton.__version__}, target sm_{args.arch}")
    groups = dict(attention=lambda: attention_rows(args.arch, args.sms),
                  dit_attention=lambda: dit_attention_rows(args.arch) + dit_attention_rows(args.arch, append=True),
                  cuda_attention=lambda: cuda_attention_rows(args.arch),
                  vocoder_conv=lambda: vocoder_conv_rows(args.arch))
    for name, rows in groups.items():
        if args.only in (None, name):
            for line in rows():
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
