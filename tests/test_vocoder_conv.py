"""The vocoder's fused Triton convolution (torch_cfm.kernels.vocoder_conv) against float64 references.

Every convolution geometry the HiFT uses (dilated, strided, 1x1, transposed with each of its
upsampling strides), the causal HiFT's asymmetric paddings, seeded random geometries, and every
epilogue form (residual, accumulator, reflected addend, leaky-ReLU / ELU, K Snake outputs) is run
in Triton's interpreter (a child process) and on CUDA when present, and compared with
``F.conv1d`` / ``F.conv_transpose1d`` and the elementwise math in float64.
TF32 is checked against a float64 convolution of the TF32-rounded operands (the kernel rounds to
nearest), and batch invariance bitwise on CUDA.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

from interpreter_child import run_child_file
from oracle import err_rel_fro

from torch_cfm.kernels.vocoder_conv import (ACT_ELU, ACT_LEAKY, conv_fused_triton, pack_conv_weight,  # noqa: E402
                                            round_tf32)
from torch_cfm.kernels.vocoder_tiles import ConvTiles

# (transposed, C_in, C_out, k, stride, padding, dilation, output_padding, L_in)
GEOMETRIES = [
    (False, 32, 32, 3, 1, 1, 1, 0, 37),      # ResBlock, dilation 1
    (False, 32, 32, 11, 1, 25, 5, 0, 61),    # ResBlock, dilation 5
    (False, 80, 48, 7, 1, 3, 1, 0, 19),      # conv_pre (80 mel channels: a masked K tail)
    (False, 18, 32, 30, 15, 7, 1, 0, 160),   # a source downsampling (stride 15)
    (False, 18, 16, 1, 1, 0, 1, 0, 33),      # 1x1
    (True, 48, 32, 16, 8, 4, 1, 0, 9),       # upsampling x8
    (True, 32, 16, 11, 5, 3, 1, 0, 11),      # upsampling x5
    (True, 32, 16, 7, 3, 2, 1, 1, 13),       # upsampling x3 (with an output padding)
]


# (transposed, C_in, C_out, k, stride, (left, right) padding, dilation, L_in): causal geometries
ASYMMETRIC = [
    (False, 24, 20, 3, 1, (6, 0), 3, 29),    # a left-causal dilated convolution (L_out = L_in)
    (False, 18, 16, 8, 4, (3, 0), 1, 41),    # a causal downsampling (stride 4, left pad 3)
    (False, 80, 24, 5, 1, (0, 4), 1, 17),    # a right-looking one (4 frames of lookahead)
    (False, 80, 24, 5, 1, (0, 0), 1, 17),    # its non-final form: no padding (L_out = L_in - 4)
    (True, 24, 16, 9, 3, (0, 6), 1, 7),      # transposed, cropped on the right only
]
WIDE = (False, 20, 130, 3, 1, 1, 1, 0, 520)  # 2 N tiles of 128 channels, 5 M tiles of 128 frames
# launch tiles passed explicitly (a bench's candidates): many small tiles with a K tail; one 256-frame tile
TILES = (ConvTiles(32, 32, 16, 2, 2), ConvTiles(256, 64, 32, 8, 4))


def _random_geometries(count: int = 14, seed: int = 7) -> list[tuple]:
    """Seeded random geometries: plain (kernel, stride, dilation, padding) and transposed
    (stride, kernel, padding, output padding), channel counts off the tile sizes, short inputs."""
    gen = torch.Generator().manual_seed(seed)

    def pick(lo, hi):
        return int(torch.randint(lo, hi + 1, (), generator=gen))

    out = []
    for i in range(count):
        c_in, c_out = pick(1, 70), pick(1, 40)
        if i % 2:
            stride = pick(1, 6)
            k = pick(stride, 3 * stride)
            pad = pick(0, (k - 1) // 2)
            out.append((True, c_in, c_out, k, stride, pad, 1, pick(0, min(stride, 1 + pad) - 1), pick(1, 9)))
        else:
            k, stride, dil = pick(1, 9), pick(1, 4), pick(1, 4)
            pad = pick(0, dil * (k - 1))
            out.append((False, c_in, c_out, k, stride, pad, dil, 0, pick(dil * (k - 1) + 1, 40)))
    return out


def _case(g, seed):
    transposed, c_in, c_out, k, stride, pad, dil, opad, length = g
    gen = torch.Generator().manual_seed(seed)
    shape = (c_in, c_out, k) if transposed else (c_out, c_in, k)
    w = torch.randn(shape, generator=gen) / (c_in * k) ** 0.5
    bias = torch.randn(c_out, generator=gen)
    x = torch.randn(3, length, c_in, generator=gen)
    return w, bias, x


def _ref(g, w, bias, x):
    transposed, _, _, _, stride, pad, dil, opad, _ = g
    xd = x.double().transpose(1, 2)
    if transposed:
        y = F.conv_transpose1d(xd, w.double(), bias.double(), stride, pad, opad, 1, dil)
    else:
        y = F.conv1d(xd, w.double(), bias.double(), stride, pad, dil)
    return y.transpose(1, 2)


def _pack(g, w, bias, dtype=torch.float32, tf32=False):
    transposed, _, _, _, stride, pad, dil, opad, _ = g
    return pack_conv_weight(w, bias, transposed=transposed, stride=stride, padding=pad, dilation=dil,
                            output_padding=opad, dtype=dtype, tf32=tf32)


def _epilogue_inputs(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    r, acc = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    a = torch.randn(shape[0], shape[1] - 1, shape[2], generator=gen)
    alpha = 0.5 + torch.rand(3, shape[2], generator=gen)
    return r, acc, a, alpha, 1.0 / (alpha + 1e-9)


def _run_all(device: str) -> dict:
    out = {}
    for i, g in enumerate(GEOMETRIES):
        w, bias, x = _case(g, i)
        p = _pack(g, w.to(device), bias.to(device))
        out[f"ieee{i}"] = conv_fused_triton(p, x.to(device), dot="ieee", store_s=True)[0].cpu()
        p32 = _pack(g, w.to(device), bias.to(device), tf32=True)
        out[f"tf32_{i}"] = conv_fused_triton(p32, x.to(device), dot="tf32", store_s=True)[0].cpu()
        p16 = _pack(g, w.to(device), bias.to(device), dtype=torch.float16)
        out[f"fp16_{i}"] = conv_fused_triton(p16, x.to(device), dot="ieee", store_s=True)[0].cpu()
    for i, g in enumerate(_random_geometries()):
        w, bias, x = _case(g, 100 + i)
        out[f"random{i}"] = conv_fused_triton(_pack(g, w.to(device), bias.to(device)), x.to(device), dot="ieee",
                                              store_s=True)[0].cpu()
    for name, g in (("up", GEOMETRIES[5]), ("wide", WIDE)):  # a transposed one; several M and N tiles
        w, bias, x = _case(g, 11)
        l_out = _ref(g, w, bias, x).shape[1]
        r, _, _, alpha, inv = (t.to(device) for t in _epilogue_inputs((3, l_out, g[2]), 12))
        p32 = _pack(g, w.to(device), bias.to(device), tf32=True)
        s, ys = conv_fused_triton(p32, x.to(device), dot="tf32", r=r, store_s=True, alpha=alpha[:2], inv=inv[:2],
                                   round_out=True)
        out[f"epi_{name}"] = [s.cpu()] + [y.cpu() for y in ys]
    for name, g in (("up", GEOMETRIES[5]), ("wide", WIDE)):  # tiles no rule picks: small, a K tail, 2 stages
        w, bias, x = _case(g, 13)
        for tiles in TILES:
            out[f"tiles_{name}_{tiles.name}"] = conv_fused_triton(_pack(g, w.to(device), bias.to(device)), x.to(device),
                                                                  dot="ieee", store_s=True, tiles=tiles)[0].cpu()
    for i, (tr, c_in, c_out, k, stride, (left, right), dil, length) in enumerate(ASYMMETRIC):
        w, bias, x = _case((tr, c_in, c_out, k, stride, 0, dil, 0, length), 200 + i)
        p = pack_conv_weight(w.to(device), bias.to(device), transposed=tr, stride=stride, padding=left,
                             padding_right=right, dilation=dil, output_padding=0, dtype=torch.float32, tf32=False)
        out[f"asym{i}"] = conv_fused_triton(p, x.to(device), dot="ieee", store_s=True)[0].cpu()
    g = GEOMETRIES[1]
    w, bias, x = _case(g, 1)
    p = _pack(g, w.to(device), bias.to(device))
    x = x.to(device)
    r, acc, a, alpha, inv = (t.to(device) for t in _epilogue_inputs((3, x.shape[1], g[2]), 5))
    out["snakes"] = [t.cpu() for t in conv_fused_triton(p, x, dot="ieee", r=r, a=a, reflect=True, store_s=True,
                                                        alpha=alpha, inv=inv)[1]]
    out["snakes_s"] = conv_fused_triton(p, x, dot="ieee", r=r, a=a, reflect=True, store_s=True, alpha=alpha,
                                        inv=inv)[0].cpu()
    out["final"] = conv_fused_triton(p, x, dot="ieee", r=r, acc=acc, divisor=3.0, act=ACT_LEAKY, slope=0.1,
                                     store_s=True, s_dtype=torch.float16)[0].cpu()
    out["elu"] = conv_fused_triton(p, x, dot="ieee", act=ACT_ELU, slope=1.0, store_s=True)[0].cpu()
    p32 = _pack(g, w.to(device), bias.to(device), tf32=True)
    s32, y32 = conv_fused_triton(p32, x, dot="tf32", act=ACT_LEAKY, divisor=1.0, slope=0.1, store_s=True,
                                 alpha=alpha, inv=inv, round_out=True)
    out["rounded"] = [s32.cpu()] + [t.cpu() for t in y32]
    return out


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory):
    return run_child_file(__file__, str(tmp_path_factory.mktemp("vocoder_conv") / "out.pt"))


def _check_all(results: dict) -> None:
    for i, g in enumerate(GEOMETRIES):
        w, bias, x = _case(g, i)
        ref = _ref(g, w, bias, x)
        assert results[f"ieee{i}"].shape == ref.shape, g
        assert err_rel_fro(results[f"ieee{i}"], ref) <= 1e-6, g
        ref_tf32 = _ref(g, round_tf32(w), bias, round_tf32(x))  # rounded to nearest, then exact
        assert err_rel_fro(results[f"tf32_{i}"], ref_tf32) <= 4e-6, g
        assert 1e-5 <= err_rel_fro(results[f"tf32_{i}"], ref) <= 2e-3, g  # TF32 did round
        ref16 = _ref(g, w.half().float(), bias, x.half().float())
        assert err_rel_fro(results[f"fp16_{i}"], ref16) <= 1e-6, g
    for i, g in enumerate(_random_geometries()):
        w, bias, x = _case(g, 100 + i)
        ref = _ref(g, w, bias, x)
        assert results[f"random{i}"].shape == ref.shape, g
        assert err_rel_fro(results[f"random{i}"], ref) <= 1e-6, g
    for name, g in (("up", GEOMETRIES[5]), ("wide", WIDE)):
        w, bias, x = _case(g, 11)
        conv = _ref(g, round_tf32(w), bias, round_tf32(x))
        r, _, _, alpha, inv = (t.double() for t in _epilogue_inputs((3, conv.shape[1], g[2]), 12))
        s = conv + r
        assert err_rel_fro(results[f"epi_{name}"][0], s) <= 4e-6, name  # the residual stream: not rounded
        for k in range(2):
            y = results[f"epi_{name}"][k + 1]
            assert torch.equal(y, round_tf32(y)), name
            assert err_rel_fro(y, s + inv[k] * torch.sin(alpha[k] * s) ** 2) <= 1e-3, name
    for name, g in (("up", GEOMETRIES[5]), ("wide", WIDE)):
        w, bias, x = _case(g, 13)
        for tiles in TILES:
            assert err_rel_fro(results[f"tiles_{name}_{tiles.name}"], _ref(g, w, bias, x)) <= 1e-6, (name, tiles)
    for i, (tr, c_in, c_out, k, stride, (left, right), dil, length) in enumerate(ASYMMETRIC):
        w, bias, x = _case((tr, c_in, c_out, k, stride, 0, dil, 0, length), 200 + i)
        xd = x.double().transpose(1, 2)
        if tr:  # the full transposed convolution, cropped
            ref = F.conv_transpose1d(xd, w.double(), bias.double(), stride)
            ref = ref[:, :, left:ref.shape[2] - right]
        else:
            ref = F.conv1d(F.pad(xd, (left, right)), w.double(), bias.double(), stride, 0, dil)
        ref = ref.transpose(1, 2)
        assert results[f"asym{i}"].shape == ref.shape, ASYMMETRIC[i]
        assert err_rel_fro(results[f"asym{i}"], ref) <= 1e-6, ASYMMETRIC[i]
    g = GEOMETRIES[1]
    w, bias, x = _case(g, 1)
    conv = _ref(g, w, bias, x)
    r, acc, a, alpha, inv = (t.double() for t in _epilogue_inputs((3, x.shape[1], g[2]), 5))
    reflected = torch.cat([a[:, 1:2], a], dim=1)
    s = reflected + (conv + r)
    assert err_rel_fro(results["snakes_s"], s) <= 1e-6
    for k in range(3):
        assert err_rel_fro(results["snakes"][k], s + inv[k] * torch.sin(alpha[k] * s) ** 2) <= 1e-6
    final = F.leaky_relu((acc + (conv + r)) / 3.0, 0.1)
    assert results["final"].dtype == torch.float16
    assert err_rel_fro(results["final"], final) <= 1e-3
    assert err_rel_fro(results["elu"], F.elu(conv, 1.0)) <= 1e-6
    conv32 = F.leaky_relu(_ref(g, round_tf32(w), bias, round_tf32(x)), 0.1)
    for k, t in enumerate(results["rounded"]):  # written rounded to TF32: the next convolution's operand
        assert torch.equal(t, round_tf32(t))
        want = conv32 if k == 0 else conv32 + inv[k - 1] * torch.sin(alpha[k - 1] * conv32) ** 2
        assert err_rel_fro(t, want) <= 1e-3


def test_fused_conv_in_the_interpreter(interpreter_results):
    _check_all(interpreter_results)


@pytest.mark.gpu
def test_gpu_fused_conv_against_float64():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _check_all(_run_all("cuda"))


@pytest.mark.gpu
def test_gpu_fused_conv_batch_invariant_bitwise():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = GEOMETRIES[1]
    w, bias, x = _case(g, 3)
    x = torch.randn(37, 700, g[1], device="cuda")
    p = _pack(g, w.cuda(), bias.cuda(), tf32=True)
    whole = conv_fused_triton(p, x, dot="tf32", store_s=True)[0]
    alone = conv_fused_triton(p, x[17:18].clone(), dot="tf32", store_s=True)[0]
    assert torch.equal(whole[17:18], alone)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_sm90_compile_pipelines_16_byte_operand_copies(dtype):
    """Compiled for sm_90 as a launch specialises it (aligned pointers, channel counts divisible by
    16), the K loop's operand tiles arrive by 16-byte asynchronous copies and feed wgmma: a
    weight layout the tensor cores cannot read directly (N-major TF32) would force 4-byte copies."""
    import collections
    import inspect
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from torch_cfm.kernels.vocoder_conv import _vocoder_conv_kernel as kernel

    names = list(inspect.signature(kernel.fn).parameters)
    const = dict(PHASES=1, TAPS=11, TRANSPOSED=False, DOT="tf32" if dtype == "fp32" else None, ROUND_A=False,
                 ROUND_OUT=dtype == "fp32", HAS_BIAS=True, ADD_R=True, ADD_ACC=False, ADD_A=False, REFLECT=False,
                 ACT=0, DIVIDE=False, STORE_S=True, K=1, BLOCK_M=128, BLOCK_N=64, BLOCK_K=32 if dtype == "fp32" else 64)
    sig = {n: "constexpr" if n in const else f"*{dtype}" if n in ("x_ptr", "w_ptr", "y_ptr") else
           "*fp32" if n.endswith("_ptr") else "fp32" if n in ("divisor", "slope") else "i32" for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n.endswith("_ptr") or n in ("C_in", "C_out")}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(n),): v for n, v in const.items()}, attrs=attrs)
    try:
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=3)).asm["ptx"]
    except (RuntimeError, FileNotFoundError) as exc:  # no ptxas in this Triton install
        pytest.skip(f"cannot compile for sm_90 here: {exc}"[:200])
    sizes = collections.Counter(re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^\]]+\], \[[^\]]+\], (0x\w+)", ptx))
    assert "wgmma.mma_async" in ptx
    assert set(sizes) == {"0x10"}, sizes


def test_epilogue_tensors_of_the_wrong_shape_are_refused_before_launch():
    g = GEOMETRIES[0]
    w, bias, x = _case(g, 0)
    p = _pack(g, w, bias)
    with pytest.raises(ValueError, match=r"r must be \(3, 37, 32\), got \(3, 36, 32\)"):
        conv_fused_triton(p, x, dot="ieee", r=torch.zeros(3, 36, 32))
    with pytest.raises(ValueError, match=r"a must be \(3, 36, 32\) \(reflect: at least 2 frames\)"):
        conv_fused_triton(p, x, dot="ieee", a=torch.zeros(3, 37, 32), reflect=True)


def test_pack_refuses_a_dilated_transposed_convolution():
    with pytest.raises(NotImplementedError, match="dilated transposed"):
        pack_conv_weight(torch.zeros(4, 4, 3), None, transposed=True, stride=2, padding=0, dilation=2,
                         output_padding=0, dtype=torch.float32, tf32=False)


if __name__ == "__main__" and len(sys.argv) >= 3 and sys.argv[1] == "--child":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run the child with TRITON_INTERPRET=1")
    torch.save(_run_all("cpu"), sys.argv[2])
