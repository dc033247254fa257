"""The hand-written CUDA GEMM of the DiT body's linear layers (csrc/cuda/dit_gemm_kernel.cuh,
torch_cfm.kernels.dit_gemm_cuda).

GPU cases (gpu marker; skipped where torch_cfm._C_cuda is not built): every instantiated tile ×
epilogue × fp16/bf16 at the body's row counts (1, tile edges, 400, 416) against the SPEC §6 oracle
(float64 ground truth, cuBLAS in the same dtype as the reference); split-K partials; PDL == no PDL
bitwise, also when the GEMM reads the output of the kernel in front of it; graph replay == eager.
CPU cases: the coverage reasons, the tile rule, the argument errors.
"""

from __future__ import annotations

import pytest
import torch

from oracle import assert_within_oracle
from strategies import capture_cuda_graph
from torch_cfm.kernels import dit_gemm_cuda as gemm_cuda

needs_kernel = pytest.mark.skipif(not (torch.cuda.is_available() and gemm_cuda.instantiated_tiles()),
                                  reason="needs CUDA and the optional torch_cfm._C_cuda build")
_DTYPES = [torch.float16, torch.bfloat16]


def _operands(m, n, k, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(m, k, device="cuda", dtype=torch.float32, generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", dtype=torch.float32, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, device="cuda", dtype=torch.float32, generator=g).to(dtype)
    return a, w, b


def _references(a, w, b, epilogue):
    """(float64 result, same-dtype cuBLAS result) of the epilogue's math."""
    ref64 = a.double() @ w.double().t()
    same = a @ w.t()
    if epilogue in ("bias", "bias_gelu"):
        ref64 = ref64 + b.double()
        same = same + b
    if epilogue == "bias_gelu":
        ref64 = torch.nn.functional.gelu(ref64, approximate="tanh")
        same = torch.nn.functional.gelu(same, approximate="tanh")
    return ref64, same


def test_tile_rule_and_reasons_on_cpu():
    # the H200 build's tiles: (block_m, block_n, shared-memory bytes)
    tiles = ((64, 128, 206848), (64, 96, 173568), (64, 64, 140288), (64, 32, 107008))
    assert gemm_cuda.choose_tile(400, 1536, 1, tiles=tiles) == (64, 96)  # 112 CTAs, one wave
    assert gemm_cuda.choose_tile(400, 512, 1, tiles=tiles) == (64, 32)  # 112 CTAs (64 x 64: 56)
    assert gemm_cuda.choose_tile(400, 2048, 1, tiles=tiles) == (64, 128)  # 112; 64 x 64 is two waves
    assert gemm_cuda.choose_tile(400, 512, 4, tiles=tiles) == (64, 128)
    assert gemm_cuda.choose_tile(1600, 1536, 1, tiles=tiles) == (64, 128)  # 3 waves of 100 vs 4
    with pytest.raises(ValueError, match="N = 100"):
        gemm_cuda.choose_tile(400, 100, 1, tiles=tiles)
    a, w = torch.zeros(4, 512, dtype=torch.float16), torch.zeros(8, 512, dtype=torch.float16)
    reasons = gemm_cuda.not_supported_reasons(a, w, "bias")
    assert any("CUDA" in r for r in reasons)
    reasons = gemm_cuda.not_supported_reasons(torch.zeros(4, 256), torch.zeros(8, 256), "bias")
    assert any("float16 or bfloat16" in r for r in reasons) and any("K = 512" in r for r in reasons)
    reasons = gemm_cuda.not_supported_reasons(torch.zeros(4, 1024, dtype=torch.half),
                                              torch.zeros(8, 1024, dtype=torch.half), "bias")
    assert any("partial" in r for r in reasons)
    with pytest.raises(ValueError, match="epilogue"):
        gemm_cuda.dit_gemm(a, w, None, torch.zeros(4, 8, dtype=torch.float16), epilogue="relu")


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize("dtype", _DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize("epilogue", ["bias", "bias_gelu", "none"])
def test_gemm_matches_the_oracle(dtype, epilogue):
    for tile in gemm_cuda.instantiated_tiles():
        for m in (1, 31, 64, 65, 400, 416):
            n = 1536 if 1536 % tile[1] == 0 else 2048
            a, w, b = _operands(m, n, 512, dtype, seed=m)
            out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
            gemm_cuda.dit_gemm(a, w, b if epilogue != "none" else None, out, epilogue=epilogue, tile=tile)
            ref64, same = _references(a, w, b, epilogue)
            assert torch.isfinite(out).all(), (tile, m)
            assert_within_oracle(out.cpu(), same.cpu(), ref64.cpu(), name=f"{tile} m={m} {epilogue}")


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize("dtype", _DTYPES, ids=["f16", "bf16"])
def test_split_k_partials_sum_to_the_product(dtype):
    for tile in (t for t in gemm_cuda.instantiated_tiles() if 512 % t[1] == 0):
        m, n, k = 400, 512, 2048
        a, w, _ = _operands(m, n, k, dtype, seed=7)
        parts = torch.full((k // 512, m, n), float("nan"), device="cuda", dtype=torch.float32)
        gemm_cuda.dit_gemm(a, w, None, parts, epilogue="partial", tile=tile)
        for s in range(k // 512):  # each slice is its own K range's product
            ref = a[:, 512 * s:512 * (s + 1)].double() @ w[:, 512 * s:512 * (s + 1)].double().t()
            assert (parts[s].double() - ref).abs().max().item() < 1e-3 * ref.abs().max().item(), (tile, s)
        ref64, same = _references(a, w, None, "none")
        assert_within_oracle(parts.sum(0).to(dtype).cpu(), same.cpu(), ref64.cpu(), name=f"{tile} split-K")


@pytest.mark.gpu
@needs_kernel
def test_pdl_chain_and_graph_replay_are_bitwise_equal():
    """Three dependent GEMMs (each reads the one before), with and without PDL, eager and replayed:
    the PDL launches load only weights before their wait, so every result is the same bits."""
    a, w1, b1 = _operands(400, 512, 512, torch.float16, seed=1)
    _, w2, b2 = _operands(400, 512, 512, torch.float16, seed=2)
    _, w3, b3 = _operands(400, 512, 512, torch.float16, seed=3)
    bufs = [torch.empty(400, 512, device="cuda", dtype=torch.float16) for _ in range(3)]

    def chain(pdl):
        src = a * 1.5  # a kernel that is not a GEMM in front of the first PDL launch
        gemm_cuda.dit_gemm(src, w1, b1, bufs[0], epilogue="bias", pdl=pdl)
        gemm_cuda.dit_gemm(bufs[0], w2, b2, bufs[1], epilogue="bias_gelu", pdl=pdl)
        gemm_cuda.dit_gemm(bufs[1], w3, b3, bufs[2], epilogue="bias", pdl=pdl)
        return bufs[2].clone()

    plain = chain(False)
    with_pdl = chain(True)
    assert torch.equal(plain, with_pdl)
    graph, out = capture_cuda_graph(lambda: chain(True))
    for buf in bufs:
        buf.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, plain)
