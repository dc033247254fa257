"""docs/design.md §6 oracle for every ``cfm_attention`` feature, on CPU always and CUDA (gpu-marked).

Each case is a fixed spec (no randomness beyond its seed) compared with the fp64 loop oracle
``tests/oracle.py::naive_attention64``: ``err(op) <= 2 * err(same-dtype math) + 1e-6`` for max-abs
and relative-Frobenius error, plus the absolute fp32 bounds (IEEE <= 1e-5, TF32 <= 3e-3 relative).
Outputs are allocated on a NaN-poisoned allocator so unwritten elements fail the check.

Features: key lengths 0, 1, K and block multiples +-1 (16/32/64/128); K = 0, block multiples +-1,
K >= 600; Q = 1 and block multiples +-1; each D; k/v as interleaved halves of a (.., K, 2D)
cache; transposed q; expanded (stride-0) masks; mask + lengths; kv_rows pools; dead queries.
"""

from __future__ import annotations

import pytest
import torch

import strategies as S
from oracle import IEEE_REL_BOUND, TF32_REL_BOUND, assert_within_oracle, err_rel_fro, naive_attention64
from torch_cfm import cfm_attention

EDGE_LENGTHS = (0, 1) + tuple(b + d for b in S.BLOCKS for d in (-1, 0, 1))
SPEC = S.AttnSpec


def _cases() -> list:
    cases = []

    def add(name: str, **kw) -> None:
        base = dict(n=2, h=2, q_len=5, k_len=40, d=32, seed=len(cases) + 1)
        base.update(kw)
        cases.append(pytest.param(SPEC(**base), id=name))

    # key lengths 0, 1, block multiples +-1 and K in one ragged batch (one row per length)
    add("lengths-edges", n=len(EDGE_LENGTHS) + 1, h=2, q_len=3, k_len=300, d=64,
        lengths=EDGE_LENGTHS + (300,))
    add("lengths-edges-d128", n=len(EDGE_LENGTHS) + 1, h=1, q_len=2, k_len=200, d=128,
        lengths=EDGE_LENGTHS + (200,))
    for k_len in (0, 1) + tuple(b + d for b in S.BLOCKS for d in (-1, 0, 1)) + (600, 601):
        add(f"K{k_len}", n=1, h=2, q_len=5, k_len=k_len, d=64)
    for q_len in (1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 129):
        add(f"Q{q_len}", n=1, h=1, q_len=q_len, k_len=90, d=32, lengths=(77,))
    for d in (16, 32, 64, 128):
        add(f"D{d}", n=3, h=2, q_len=9, k_len=70, d=d, lengths=(70, 33, 1))
    add("K0-lengths-mask", n=2, k_len=0, lengths=(0, 5), mask_mode="dense")
    add("Q1-K600-ragged", n=3, h=2, q_len=1, k_len=640, d=64, lengths=(640, 450, 17))
    add("interleaved-kv", n=3, q_len=7, k_len=129, d=64, lengths=(129, 64, 3), kv_interleaved=True)
    add("transposed-q", n=2, q_len=33, k_len=65, d=16, q_transposed=True)
    add("interleaved-transposed", n=2, q_len=17, k_len=450, d=64, lengths=(450, 300),
        kv_interleaved=True, q_transposed=True)
    add("mask-dense", n=2, q_len=16, k_len=48, mask_mode="dense", mask_density=0.5)
    add("mask-expanded-over-N", n=3, q_len=8, k_len=33, mask_mode="expand_n")
    add("mask-expanded-over-Q", n=3, q_len=8, k_len=33, mask_mode="expand_q")
    add("mask-and-lengths", n=3, q_len=8, k_len=97, lengths=(97, 40, 0), mask_mode="dense",
        mask_density=0.6)
    add("mask-dead-queries", n=2, q_len=8, k_len=31, mask_mode="dense", dead_queries=(0, 5))
    add("mask-sparse", n=2, q_len=8, k_len=257, mask_mode="dense", mask_density=0.05)
    add("kv-rows-permutation", n=3, q_len=6, k_len=65, lengths=(65, 12, 40), kv_rows=(2, 0, 1),
        pool=3)
    add("kv-rows-pool-repeats", n=4, q_len=6, k_len=64, lengths=(64, 10, 0, 33), kv_rows=(1, 1, 0, 4),
        pool=5)
    add("kv-rows-everything", n=3, q_len=9, k_len=130, lengths=(130, 77, 5), kv_rows=(2, 2, 0),
        pool=3, mask_mode="expand_q", kv_interleaved=True, q_transposed=True)
    add("peaky-softmax", n=2, q_len=5, k_len=200, d=64, scale=2.0, lengths=(200, 100))
    return cases


CASES = _cases()

# (device, dtype, precision) combinations: the CPU kernel upcasts fp16/bf16 and is IEEE in fp32.
MODES = [
    pytest.param("cpu", torch.float32, "auto", id="cpu-fp32"),
    pytest.param("cpu", torch.float16, "auto", id="cpu-fp16"),
    pytest.param("cpu", torch.bfloat16, "auto", id="cpu-bf16"),
    pytest.param("cuda", torch.float16, "auto", id="cuda-fp16", marks=pytest.mark.gpu),
    pytest.param("cuda", torch.bfloat16, "auto", id="cuda-bf16", marks=pytest.mark.gpu),
    pytest.param("cuda", torch.float32, "tf32", id="cuda-fp32-tf32", marks=pytest.mark.gpu),
    pytest.param("cuda", torch.float32, "ieee", id="cuda-fp32-ieee", marks=pytest.mark.gpu),
]


def check_against_oracle(case: S.AttnCase, precision: str) -> torch.Tensor:
    S.poison_allocator(case.q.device, S.out_nbytes(case))
    out = cfm_attention(case.q, case.k, case.v, **case.kwargs(), precision=precision)
    n, h, q_len, d = case.q.shape
    assert out.shape == (n, h, q_len, d) and out.dtype == case.q.dtype
    assert out.transpose(1, 2).is_contiguous(), f"out strides {out.stride()}"
    ref64 = naive_attention64(case.q, case.k, case.v, case.key_lengths, case.mask, case.kv_rows)
    tf32 = precision == "tf32"
    same = S.attention_same_dtype(case, tf32=tf32)
    out_cpu = out.cpu()
    assert torch.isfinite(out_cpu).all(), "output has non-finite values (unwritten?)"
    assert_within_oracle(out_cpu, same.cpu(), ref64, name=case.spec.describe(), tf32=tf32)
    if case.q.dtype == torch.float32:
        bound = TF32_REL_BOUND if tf32 else IEEE_REL_BOUND
        rel = err_rel_fro(out_cpu, ref64)
        assert rel <= bound, f"{case.spec.describe()}: fp32 {precision} rel err {rel:.2e} > {bound:.0e}"
    dead = ~S.valid_keys(case).any(-1)  # (N, Q): no valid key -> exactly 0
    assert (out_cpu.transpose(1, 2)[dead] == 0).all(), "a query with no valid key is not 0"
    return out


@pytest.mark.parametrize("device,dtype,precision", MODES)
@pytest.mark.parametrize("spec", CASES)
def test_matches_oracle(spec, device, dtype, precision):
    check_against_oracle(S.build_attention(spec, device, dtype), precision)


@pytest.mark.parametrize("device,dtype,precision", MODES)
def test_clamped_lengths_and_rows(device, dtype, precision):
    """Out-of-range key_lengths clamp to [0, K] and kv_rows to [0, R) (docs/design.md §4)."""
    spec = SPEC(n=4, h=2, q_len=5, k_len=70, d=32, seed=7,
                lengths=(-5, 2**31 - 1, 71, -(2**31)), kv_rows=(-3, 9, 1, 2**31 - 1), pool=3)
    case = S.build_attention(spec, device, dtype)
    out = check_against_oracle(case, precision)
    clamped = S.build_attention(SPEC(n=4, h=2, q_len=5, k_len=70, d=32, seed=7, lengths=(0, 70, 70, 0),
                                     kv_rows=(0, 2, 1, 2), pool=3), device, dtype)
    expect = cfm_attention(clamped.q, clamped.k, clamped.v, **clamped.kwargs(), precision=precision)
    assert torch.equal(out, expect)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,precision", [(torch.float16, None), (torch.bfloat16, None),
                                             (torch.float32, "tf32"), (torch.float32, "ieee")])
def test_every_triton_config_matches_oracle(dtype, precision):
    """Each tile/split variant the heuristic may pick, forced on one ragged case."""
    from torch_cfm.kernels.cfm_attention import AttentionConfig, cfm_attention_triton
    from torch_cfm.ops.cfm_attention import empty_attention_out

    spec = SPEC(n=3, h=2, q_len=40, k_len=300, d=64, seed=11, lengths=(300, 129, 0),
                mask_mode="expand_n", kv_interleaved=True, q_transposed=True)
    case = S.build_attention(spec, "cuda", dtype)
    ref64 = naive_attention64(case.q, case.k, case.v, case.key_lengths, case.mask, case.kv_rows)
    same = S.attention_same_dtype(case, tf32=precision == "tf32").cpu()
    for block_q in (16, 32, 64):
        for block_k in (16, 32, 64):
            for splits in (1, 2, 3, 8):
                cfg = AttentionConfig(block_q, block_k, splits)
                S.poison_allocator("cuda", S.out_nbytes(case))
                out = empty_attention_out(case.q)
                out.fill_(float("nan"))
                cfm_attention_triton(case.q, case.k, case.v, case.key_lengths, case.mask, None,
                                     precision, out, config=cfg)
                assert_within_oracle(out.cpu(), same, ref64, name=cfg.name, tf32=precision == "tf32")


@pytest.mark.parametrize("device,dtype,precision", MODES)
def test_strided_index_vectors(device, dtype, precision):
    """key_lengths and kv_rows taken as every other element of a longer vector (any strides)."""
    spec = SPEC(n=3, h=2, q_len=6, k_len=70, d=32, seed=9, lengths=(70, 9, 0), kv_rows=(2, 0, 1), pool=3)
    case = S.build_attention(spec, device, dtype)
    contiguous = check_against_oracle(case, precision)
    for name in ("key_lengths", "kv_rows"):
        vec = getattr(case, name)
        wide = torch.full((2 * vec.shape[0],), -1, dtype=vec.dtype, device=vec.device)
        wide[::2] = vec
        setattr(case, name, wide[::2])
        strided = check_against_oracle(case, precision)
        assert torch.equal(strided, contiguous), f"strided {name} changed the result"
        setattr(case, name, vec)
