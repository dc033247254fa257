"""The DiT GEMM on the SM90a wgmma kernel (``torch_cfm.kernels.dit_linear_cuda``).

CPU: the support rules (``not_supported_reasons``) and the tile rule. GPU (gpu-marked, SM90 with
the extension built for 9.0a): the docs/design.md §6 oracle against a float64 product, next to cuBLAS's own
error, at the body's shapes and the tile edges (M in 1, 63, 64, 65; TMA zero fill, masked
stores), every flag (bias, no bias, GELU) and tile width, with poisoned rows past M left alone;
a chain of PDL launches captured in a CUDA graph, replayed on new inputs, bitwise equal to the
same chain eager without PDL. Split-K (``linear_splitk_into``, the body's fc2): CPU, its support
rules, and the row-norm kernel summing fp32 partials + bias (Triton interpreter) against torch math;
GPU, the partials' sum within the oracle for every (splits, BN), every element written, two runs
bitwise equal. QKV + cache (``qkv_cache_into``, the block's QKV GEMM on the in-place arena): queries
and the appended keys/values within the oracle against float64 torch math, ragged rows (T_n = 0, 1,
T; L_n = 0, ...), every arena frame outside [L_n, L_n + T_n) left as it was.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from interpreter_child import interpreter_env
import strategies as S
from oracle import assert_within_oracle, err_rel_fro
from torch_cfm.kernels import dit_linear_cuda as L


def test_block_n_rule():
    assert L.block_n_for(512) == 32 and L.block_n_for(192) == 32
    assert L.block_n_for(1536) == 96 and L.block_n_for(2048) == 128 and L.block_n_for(640) == 128
    assert L.block_n_for(704) == 64
    assert L.block_n_for(520) is None
    # fp32 (TF32): the resident weight tile caps BN at 96
    f32 = torch.float32
    assert L.block_n_for(512, f32) == 32 and L.block_n_for(1536, f32) == 96 and L.block_n_for(2048, f32) == 64
    assert L.block_n_for(640, f32) == 64


def test_tf32_not_supported_reasons_on_cpu():
    a, w, out = torch.zeros(4, 32), torch.zeros(32, 32), torch.zeros(4, 32)
    # fp32 only when the caller asks for TF32 (an "ieee" body never reaches the kernel)
    assert any("with tf32=True" in r for r in L.not_supported_reasons(a, w, out))
    assert not any("dtype" in r for r in L.not_supported_reasons(a, w, out, tf32=True))
    assert any("CUDA" in r for r in L.not_supported_reasons(a, w, out, tf32=True))
    assert L.linear_into(a, w, None, out, tf32=True) is False  # nothing launched
    assert any("multiple of 32" in r for r in L.not_supported_reasons(a[:, :16], w[:, :16], out, tf32=True))
    assert any("up to 512" in r for r in L.not_supported_reasons(torch.zeros(4, 544), torch.zeros(32, 544), out,
                                                                 tf32=True))
    assert any("aligned column pairs" in r
               for r in L.not_supported_reasons(a, w, torch.zeros(4, 33)[:, 1:], tf32=True))
    # the split-K form: fp32 K' a multiple of 32, BN 64 only (its default config)
    a2, w2, parts = torch.zeros(4, 2048), torch.zeros(512, 2048), torch.zeros(4, 4, 512)
    assert any("with tf32=True" in r for r in L.splitk_not_supported_reasons(a2, w2, parts))
    assert not any("dtype" in r or "block_n" in r or "split" in r
                   for r in L.splitk_not_supported_reasons(a2, w2, parts, tf32=True))
    assert any("block_n 128" in r and "(64,)" in r
               for r in L.splitk_not_supported_reasons(a2, w2, parts, (4, 128), tf32=True))
    assert any("multiples of 32" in r
               for r in L.splitk_not_supported_reasons(a2[:, :2016], w2[:, :2016], parts, tf32=True))
    assert L.linear_splitk_into(a2, w2, parts, tf32=True) is False


def test_not_supported_reasons_on_cpu():
    a, w, out = torch.zeros(4, 64, dtype=torch.float16), torch.zeros(32, 64, dtype=torch.float16), \
        torch.zeros(4, 32, dtype=torch.float16)
    assert any("CUDA" in r for r in L.not_supported_reasons(a, w, out))
    assert L.linear_into(a, w, None, out) is False  # nothing launched: the caller falls back
    f32 = [t.float() for t in (a, w, out)]
    assert any("fp16/bf16" in r for r in L.not_supported_reasons(*f32))
    k48 = torch.zeros(4, 48, dtype=torch.float16)
    assert any("multiple of 64" in r for r in L.not_supported_reasons(k48, torch.zeros(32, 48, dtype=torch.float16),
                                                                       out))
    k576 = torch.zeros(4, 576, dtype=torch.float16)
    assert any("up to 512" in r for r in L.not_supported_reasons(k576, torch.zeros(32, 576, dtype=torch.float16), out))
    strided = torch.zeros(64, 4, dtype=torch.float16).t()
    assert any("a needs unit column stride" in r for r in L.not_supported_reasons(strided, w, out))
    assert any("N must be a multiple of 32" in r
               for r in L.not_supported_reasons(a, torch.zeros(20, 64, dtype=torch.float16), torch.zeros(4, 20)))


def test_splitk_not_supported_reasons_on_cpu():
    a, w = torch.zeros(4, 2048, dtype=torch.float16), torch.zeros(512, 2048, dtype=torch.float16)
    parts = torch.zeros(4, 4, 512)
    assert any("CUDA" in r for r in L.splitk_not_supported_reasons(a, w, parts, (4, 128)))
    assert L.linear_splitk_into(a, w, parts, config=(4, 128)) is False  # nothing launched
    assert any("up to 512" in r for r in L.splitk_not_supported_reasons(a, w, torch.zeros(2, 4, 512), (2, 128)))
    assert any("multiples of 64" in r
               for r in L.splitk_not_supported_reasons(a[:, :1984], w[:, :1984], parts, (4, 128)))
    assert any("partials must be contiguous float32" in r
               for r in L.splitk_not_supported_reasons(a, w, parts.half(), (4, 128)))
    assert any("partials must be contiguous float32" in r
               for r in L.splitk_not_supported_reasons(a, w, torch.zeros(8, 4, 512), (4, 128)))
    assert any("block_n 96" in r for r in L.splitk_not_supported_reasons(a, w, parts, (4, 96)))
    assert any("fp16/bf16" in r for r in L.splitk_not_supported_reasons(a.float(), w.float(), parts, (4, 128)))


_ROWNORM_SPLITS_CHILD = textwrap.dedent("""
    import torch
    from torch_cfm.config import BLOCK_LN_EPS
    from torch_cfm.kernels.rownorm import rownorm
    g = torch.Generator().manual_seed(3)
    n, t, c, splits = 3, 5, 64, 4
    m = n * t
    parts = torch.randn(splits, m, c, generator=g)
    bias = torch.randn(c, generator=g).half()
    h0 = torch.randn(m, c, generator=g)
    table = torch.randn(1, 1, 9, c, generator=g)  # gate, shift, 1 + scale at rows 0, 1, 2 of one table row
    valid = torch.full((n,), t, dtype=torch.int32)
    # torch math in float64: residual + gate * (sum of partials + bias), LayerNorm, adaLN modulation
    tab = table.double()[0, 0]
    y = parts.double().sum(0) + bias.double()
    want_h = h0.double() + tab[0] * y
    z = torch.nn.functional.layer_norm(want_h, (c,), eps=BLOCK_LN_EPS) * tab[2] + tab[1]
    # the shipped launch rule (8 rows per program at 64 channels), then the bench's overrides: 15 rows
    # are no multiple of 2 or 4, so the last program's masked rows are exercised
    for launch in (None, (1, 1), (2, 2), (4, 4)):
        h, out = h0.clone(), torch.full((m, c), float("nan"), dtype=torch.float16)
        rownorm(parts, h, out, valid, n_rows=n, t_len=t, bias=bias, table=table, gate=0, shift=c, scale=2 * c,
                launch=launch)
        assert torch.allclose(h.double(), want_h, rtol=1e-5, atol=1e-5), (launch, (h.double() - want_h).abs().max())
        assert torch.allclose(out.double(), z, rtol=2e-3, atol=2e-3), (launch, (out.double() - z).abs().max())
    print("ok")
""")


def test_rownorm_sums_splitk_partials_interpreter():
    """The reader of the split-K partials: the row-norm kernel (Triton interpreter) adds the S fp32
    partials and the bias, then residual + gate, LayerNorm and modulation, as torch math in float64,
    under its shipped launch rule and the bench's (rows per program, warps) overrides."""
    env = interpreter_env()
    proc = subprocess.run([sys.executable, "-c", _ROWNORM_SPLITS_CHILD], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def _skip_unless_runnable():
    why = L.device_reason(torch.device("cuda"))
    if why:
        pytest.skip(why)


# (M, K, N, bias, GELU): the body's roles at (8, 50) and tile edges
SHAPES = [(400, 512, 512, True, False), (400, 512, 1536, True, False), (416, 512, 1536, False, False),
          (400, 512, 2048, True, True), (1, 512, 512, True, False), (63, 512, 1536, False, False),
          (64, 256, 512, True, True), (65, 64, 192, True, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("m,k,n,bias,gelu", SHAPES)
def test_gpu_linear_within_oracle(dtype, m, k, n, bias, gelu):
    _skip_unless_runnable()
    ext, _ = L._extension()
    g = torch.Generator(device="cpu").manual_seed(m + k + n)
    a = torch.randn(m, k, generator=g).to("cuda", dtype)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to("cuda", dtype)
    b = (torch.randn(n, generator=g) * 0.1).to("cuda", dtype) if bias else None
    ref = a.double() @ w.double().t() + (b.double() if bias else 0)
    if gelu:
        ref = torch.nn.functional.gelu(ref, approximate="tanh")
    same = a @ w.t() + (b if bias else 0)  # cuBLAS in the dtype: the oracle's baseline
    if gelu:
        same = torch.nn.functional.gelu(same, approximate="tanh")
    flags = L.TRIGGER_EARLY | (L.GELU_TANH if gelu else 0) | (0 if bias else L.NO_BIAS)
    for bn in [x for x in L.BLOCK_NS if n % x == 0]:
        for pdl in (False, True):
            buf = torch.full((m + 5, n), float("nan"), device="cuda", dtype=dtype)
            out = buf[:m]
            ext.dit_linear_into(a, w, b, out, bn, pdl, flags, 1)
            torch.cuda.synchronize()
            assert torch.isnan(buf[m:]).all(), f"bn{bn}: wrote past row {m}"
            assert_within_oracle(out.cpu(), same.cpu(), ref.cpu(), f"bn{bn} pdl={pdl}")
    # the library entry point (its own tile rule, PDL) gives the same bits as an explicit launch
    if L.linear_into(a, w, b, out, gelu=gelu):
        want = torch.empty_like(out)
        ext.dit_linear_into(a, w, b, want, L.block_n_for(n), False, flags, 1)
        torch.cuda.synchronize()
        assert torch.equal(out, want)


# (M, K, N, bias, GELU) for the TF32 form: the body's roles, K = 160 (5 stages: the ring of 4 wraps
# once), K = 32 (one stage, fewer than the ring holds) and row-tile edges
TF32_SHAPES = [(400, 512, 512, True, False), (400, 512, 1536, True, False), (416, 512, 1536, False, False),
               (400, 512, 2048, True, True), (1, 512, 512, True, False), (63, 512, 1536, False, False),
               (64, 160, 512, True, True), (65, 32, 192, True, False), (130, 256, 96, False, False)]


def _tf32_rounded(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) rounded to the nearest TF32 value (10 mantissa bits; ties away from zero, which
    differs from the hardware's ties-to-even only on exact ties): the operand a TF32 GEMM multiplies."""
    bits = (x.contiguous().view(torch.int32) + 0x1000) & -8192  # + half of the dropped 13 bits, then clear them
    return bits.view(torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,bias,gelu", TF32_SHAPES)
def test_gpu_linear_tf32_within_oracle(m, k, n, bias, gelu):
    """fp32 operands in TF32 against exact TF32 math (operands rounded to nearest TF32, products summed
    in float64), the 2x rule of docs/design.md §6 without its TF32 relaxation: a kernel that truncated its
    operands would fail it. (Not cuBLAS as the baseline: at M = 1 it runs an IEEE fp32 GEMV even with
    TF32 allowed, an error 3000x smaller.)"""
    _skip_unless_runnable()
    ext, _ = L._extension()
    g = torch.Generator(device="cpu").manual_seed(m + k + n + 1)
    a = torch.randn(m, k, generator=g).cuda()
    w = (torch.randn(n, k, generator=g) * k ** -0.5).cuda()
    b = (torch.randn(n, generator=g) * 0.1).cuda() if bias else None
    ref = a.double() @ w.double().t() + (b.double() if bias else 0)
    if gelu:
        ref = torch.nn.functional.gelu(ref, approximate="tanh")
    same = _tf32_rounded(a).double() @ _tf32_rounded(w).double().t() + (b.double() if bias else 0)
    if gelu:
        same = torch.nn.functional.gelu(same, approximate="tanh")
    same = same.float()
    flags = L.TRIGGER_EARLY | (L.GELU_TANH if gelu else 0) | (0 if bias else L.NO_BIAS)
    for bn in [x for x in L.TF32_BLOCK_NS if n % x == 0]:
        for pdl in (False, True):
            buf = torch.full((m + 5, n), float("nan"), device="cuda")
            out = buf[:m]
            ext.dit_linear_into(a, w, b, out, bn, pdl, flags, 1)
            torch.cuda.synchronize()
            assert torch.isnan(buf[m:]).all(), f"bn{bn}: wrote past row {m}"
            print(f"bn{bn} pdl={pdl}: rel {err_rel_fro(out.cpu(), ref.cpu()):.3e}, "
                  f"exact TF32 {err_rel_fro(same.cpu(), ref.cpu()):.3e}")
            assert_within_oracle(out.cpu(), same.cpu(), ref.cpu(), f"bn{bn} pdl={pdl}")
    assert L.linear_into(a, w, b, out, gelu=gelu, tf32=True)
    want = torch.empty_like(out)
    ext.dit_linear_into(a, w, b, want, L.block_n_for(n, torch.float32), False, flags, 1)
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "tf32"])
def test_gpu_linear_pdl_chain_graph_replay_bitwise(dtype):
    """proj -> qkv -> conv-shaped GEMMs, each reading the previous output, launched with PDL inside
    a CUDA graph: three replays on new inputs equal the chain run eagerly without PDL, bitwise."""
    _skip_unless_runnable()
    g = torch.Generator(device="cpu").manual_seed(5)
    m = 400
    ws = [(torch.randn(n, 512, generator=g) * 512 ** -0.5).to("cuda", dtype) for n in (512, 1536, 1536)]
    bs = [(torch.randn(n, generator=g) * 0.1).to("cuda", dtype) for n in (512, 1536)] + [None]
    x = torch.empty(m, 512, device="cuda", dtype=dtype)
    outs = [torch.empty(m, w.shape[0], device="cuda", dtype=dtype) for w in ws]

    def chain(pdl: bool):
        src = x
        for w, b, o in zip(ws, bs, outs):
            assert L.linear_into(src, w, b, o, pdl=pdl, tf32=dtype == torch.float32)
            src = o[:, :512]

    inputs = [torch.randn(m, 512, generator=g).to("cuda", dtype) for _ in range(3)]
    want = []
    for inp in inputs:
        x.copy_(inp)
        chain(False)
        want.append([o.clone() for o in outs])
    graph, _ = S.capture_cuda_graph(lambda: chain(True))
    for inp, expected in zip(inputs[::-1], want[::-1]):
        x.copy_(inp)
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for o, e in zip(outs, expected):
            assert torch.equal(o, e)


# (M, K, N): the body's fc2 at (8, 50), a single row, tile edges
SPLITK_SHAPES = [(400, 2048, 512), (1, 2048, 512), (65, 1024, 128), (64, 512, 256)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "tf32"])
@pytest.mark.parametrize("m,k,n", SPLITK_SHAPES)
def test_gpu_splitk_partials_within_oracle(dtype, m, k, n):
    """fp32 (TF32) against exact TF32 math, as test_gpu_linear_tf32_within_oracle."""
    _skip_unless_runnable()
    tf32 = dtype == torch.float32
    g = torch.Generator(device="cpu").manual_seed(m + k + n + 1)
    a = torch.randn(m, k, generator=g).to("cuda", dtype)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to("cuda", dtype)
    ref = a.double() @ w.double().t()
    # the oracle's baseline: cuBLAS in the dtype, or exact TF32 products
    same = (_tf32_rounded(a).double() @ _tf32_rounded(w).double().t()).float() if tf32 else a @ w.t()
    ran = 0
    for splits in (1, 2, 4, 8):
        for bn in L.SPLITK_BLOCK_NS:
            config = (splits, bn)
            parts = torch.full((splits, m, n), float("nan"), device="cuda")
            if L.splitk_not_supported_reasons(a, w, parts, config, tf32=tf32):
                continue
            for pdl in (False, True):
                parts.fill_(float("nan"))
                assert L.linear_splitk_into(a, w, parts, pdl=pdl, config=config, tf32=tf32)
                torch.cuda.synchronize()
                assert not torch.isnan(parts).any(), f"{config}: a partial left unwritten"
                assert_within_oracle(parts.sum(0).to(dtype).cpu(), same.cpu(), ref.cpu(), f"{config} pdl={pdl}")
                again = torch.empty_like(parts)
                assert L.linear_splitk_into(a, w, again, pdl=pdl, config=config, tf32=tf32)
                assert torch.equal(parts, again)  # no atomics: the same bits every run
                ran += 1
    assert ran >= 2


def test_qkv_cache_not_supported_reasons_on_cpu():
    a, w = torch.zeros(8, 512, dtype=torch.float16), torch.zeros(1536, 512, dtype=torch.float16)
    q_out, cache = torch.zeros(8, 512, dtype=torch.float16), torch.zeros(2, 8, 10, 128, dtype=torch.float16)
    assert any("CUDA" in r for r in L.qkv_cache_not_supported_reasons(a, w, q_out, cache, 4))
    assert any("N x t_len" in r for r in L.qkv_cache_not_supported_reasons(a, w, q_out, cache, 3))
    assert any("head_dim 64" in r
               for r in L.qkv_cache_not_supported_reasons(a, w, q_out, torch.zeros(2, 8, 10, 64, dtype=torch.float16), 4))
    assert any("even number of heads" in r
               for r in L.qkv_cache_not_supported_reasons(a, w[:1344], q_out[:, :448],
                                                          torch.zeros(2, 7, 10, 128, dtype=torch.float16), 4))
    assert any("q_out must be contiguous" in r for r in L.qkv_cache_not_supported_reasons(a, w, q_out[:, :256], cache, 4))
    # 16-bit only (the TF32 plans run the q/k-cache kernel on the arena)
    f32 = [t.float() for t in (a, w, q_out, cache)]
    assert any("fp16/bf16" in r for r in L.qkv_cache_not_supported_reasons(*f32, 4))


def _layer_norm64(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head LayerNorm over the last 64 channels (float64 torch math)."""
    x = x.unflatten(-1, (-1, 64))
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return ((x - mu) / torch.sqrt(var + eps) * w + b).flatten(-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("t_len,valid,cached", [(50, [50, 37, 1, 0], [400, 10, 0, 64]), (7, [7, 3], [0, 5]),
                                                (64, [64], [3])])
def test_gpu_qkv_cache_within_oracle(dtype, t_len, valid, cached):
    _skip_unless_runnable()
    from torch_cfm.config import QK_NORM_EPS

    g = torch.Generator(device="cpu").manual_seed(t_len + len(valid))
    n, heads, k = len(valid), 8, 512
    inner = 64 * heads
    m = n * t_len
    frames = max(v + c for v, c in zip(valid, cached)) + 3
    a = torch.randn(m, k, generator=g).to("cuda", dtype)
    w = (torch.randn(3 * inner, k, generator=g) * k ** -0.5).to("cuda", dtype)
    b = (torch.randn(3 * inner, generator=g) * 0.1).to("cuda", dtype)
    norms = [(torch.randn(64, generator=g) * 0.2 + (1.0 if i % 2 == 0 else 0.0)).to("cuda", dtype) for i in range(4)]
    vt = torch.tensor(valid, dtype=torch.int32, device="cuda")
    ct = torch.tensor(cached, dtype=torch.int32, device="cuda")
    poison = torch.randn(n, heads, frames, 128, generator=g).to("cuda", dtype)
    cache = poison.clone()
    q_out = torch.full((m, inner), float("nan"), device="cuda", dtype=dtype)
    for pdl in (False, True):
        assert L.qkv_cache_into(a, w, b, norms, q_out, cache, vt, ct, t_len=t_len, eps=QK_NORM_EPS, pdl=pdl)
    torch.cuda.synchronize()

    def heads_of(y, qn, kn):  # q, k (per-head LayerNorm), v of the packed (M, 3 inner) GEMM output
        q, kk, v = y.split(inner, dim=1)
        return _layer_norm64(q, *qn, QK_NORM_EPS), _layer_norm64(kk, *kn, QK_NORM_EPS), v

    nd = [t.double() for t in norms]
    ref = heads_of(a.double() @ w.double().t() + b.double(), nd[:2], nd[2:])
    # the two-kernel path: GEMM output rounded to the dtype, LayerNorm in fp32
    y16 = (a @ w.t() + b).float()
    same = [t.to(dtype) for t in heads_of(y16.to(dtype).float(), [t.float() for t in norms[:2]],
                                          [t.float() for t in norms[2:]])]
    assert_within_oracle(q_out.cpu(), same[0].cpu(), ref[0].cpu(), "queries")
    expect_written = torch.zeros(n, frames, dtype=torch.bool)
    for row in range(n):
        tn, ln = valid[row], cached[row]
        if tn == 0:
            continue
        pos = [ln + tn - 1 - t for t in range(tn)]  # reversed key order behind the L_n old frames
        expect_written[row, pos] = True
        rows = slice(row * t_len, row * t_len + tn)
        for part, lo, name in ((1, 0, "keys"), (2, 64, "values")):
            got = cache[row][:, pos, lo:lo + 64]  # (heads, tn, 64)
            want = ref[part][rows].view(tn, heads, 64).transpose(0, 1)
            base = same[part][rows].view(tn, heads, 64).transpose(0, 1)
            assert_within_oracle(got.cpu(), base.cpu(), want.cpu(), f"row {row} {name}")
    untouched = ~expect_written.cuda()[:, None, :, None].expand_as(cache)
    assert torch.equal(cache[untouched], poison[untouched]), "a frame outside [L_n, L_n + T_n) was written"
