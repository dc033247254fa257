"""The hand-written CUDA kernel of cfm_attention (csrc/cuda/, torch_cfm.kernels.cfm_attention_cuda).

GPU cases (gpu marker; skipped where torch_cfm._C_cuda is not built): every instantiated tile
config × fp16/bf16/fp32-TF32 against the docs/design.md §6 oracle with ragged lengths (0, 1, tile edges, K),
masks, pool rows, the interleaved cache halves, NaN padding and Q at query-tile edges; graph
replay == eager bitwise; no host sync; the op's dispatch under TORCH_CFM_ATTENTION_KERNEL.
CPU cases: the env choice and the coverage reasons.
"""

from __future__ import annotations

import pytest
import torch

from oracle import TF32_REL_BOUND, assert_within_oracle, err_rel_fro
from strategies import capture_cuda_graph
from test_cfm_attention_triton import _gpu_check, _gpu_inputs
from torch_cfm import policy
from torch_cfm.kernels import cfm_attention_cuda as cuda_kernel
from torch_cfm.reference.cfm_attention import cfm_attention_reference

_DTYPES = [(torch.float16, None), (torch.bfloat16, None), (torch.float32, "tf32")]
_DTYPE_IDS = ["f16", "bf16", "f32-tf32"]


def _built() -> bool:
    return cuda_kernel.build_status().startswith("built")


needs_kernel = pytest.mark.skipif(not (torch.cuda.is_available() and _built()),
                                  reason="needs CUDA and the optional torch_cfm._C_cuda build")


def _configs(dtype):
    """The instantiated configs this GPU runs (cluster configs need SM90; each needs its shared memory)."""
    return cuda_kernel.runnable_configs(dtype, torch.device("cuda"))


def _launch(config):
    def run(q, k, v, key_lengths, mask, kv_rows, precision, out, config=None):
        return cuda_kernel.cfm_attention_cuda(q, k, v, key_lengths, mask, kv_rows, out, run.config)

    run.config = config
    return run


def _check(a: dict, dtype: torch.dtype, config) -> None:
    """The kernel into a NaN-poisoned out vs the docs/design.md §6 oracle, references computed on the GPU
    (float64 ground truth; same-dtype reference for fp16/bf16, the TF32 bound for fp32)."""
    n, h, q_len, d = a["q"].shape
    out = torch.full((n, q_len, h, d), float("nan"), device="cuda", dtype=dtype).transpose(1, 2)
    cuda_kernel.cfm_attention_cuda(a["q"], a["k"], a["v"], a["key_lengths"], a["mask"], a["kv_rows"], out, config)
    clean = {name: (x.nan_to_num() if x is not None and x.is_floating_point() else x) for name, x in a.items()}
    args = (clean["q"], clean["k"], clean["v"], clean["key_lengths"], clean["mask"], clean["kv_rows"])
    ref64 = cfm_attention_reference(*(x.double() if x is not None and x.is_floating_point() else x for x in args),
                                    compute_dtype=torch.float64).cpu()
    res = out.cpu()
    assert torch.isfinite(res).all(), config
    if dtype == torch.float32:
        assert err_rel_fro(res, ref64) <= TF32_REL_BOUND, (config, err_rel_fro(res, ref64))
    else:
        assert_within_oracle(res, cfm_attention_reference(*args, compute_dtype=dtype).cpu(), ref64, name=str(config))
    empty = ref64.abs().amax(dim=-1) == 0
    assert (res.double().abs().amax(dim=-1)[empty] == 0).all(), config


# ---------------------------------------------------------------------------------------------- CPU


def test_attention_kernel_choice_reads_env() -> None:
    assert policy.attention_kernel_choice({}) == "auto"
    assert policy.attention_kernel_choice({policy.ENV_ATTENTION_KERNEL: " Triton "}) == "triton"
    assert policy.attention_kernel_choice({policy.ENV_ATTENTION_KERNEL: "cuda"}) == "cuda"
    with pytest.raises(ValueError, match=policy.ENV_ATTENTION_KERNEL):
        policy.attention_kernel_choice({policy.ENV_ATTENTION_KERNEL: "cutlass"})


def test_not_supported_reasons_name_each_gap() -> None:
    q = torch.randn(2, 2, 5, 32)
    reasons = cuda_kernel.not_supported_reasons(q, q, q, "ieee")
    text = "; ".join(reasons)
    assert "needs a CUDA device" in text and "D = 32" in text and "'tf32'" in text
    misaligned = torch.randn(2, 2, 5, 65)[..., 1:]  # unit stride, rows of 65 floats: not 16-byte aligned
    assert any("16-byte" in r for r in cuda_kernel.not_supported_reasons(misaligned, q, q, None))
    strided = torch.randn(2, 2, 5, 128)[..., ::2]
    assert any("unit stride" in r for r in cuda_kernel.not_supported_reasons(strided, q, q, None))


def test_select_cuda_kernel_config_follows_env(monkeypatch) -> None:
    """The op's kernel choice: None (Triton) under "triton" and wherever the kernel does not cover
    the call under "auto"; a ValueError with the reasons under "cuda"."""
    from torch_cfm.ops.cfm_attention import select_cuda_kernel_config

    q = torch.randn(2, 2, 5, 64)
    for choice in ("triton", "auto"):
        monkeypatch.setenv(policy.ENV_ATTENTION_KERNEL, choice)
        assert select_cuda_kernel_config(q, q, q, None) is None
    monkeypatch.setenv(policy.ENV_ATTENTION_KERNEL, "cuda")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_cuda_kernel_config(q, q, q, None)


def test_shared_memory_reason_names_need_and_limit(monkeypatch) -> None:
    """A config whose shared memory exceeds the GPU's per-CTA limit is refused with both numbers;
    the op's selection falls back to Triton there (select_cuda_kernel_config, GPU tests)."""
    big, small = cuda_kernel.CudaAttentionConfig(64, 1, 8, 1), cuda_kernel.CudaAttentionConfig(32, 2, 4, 2)
    monkeypatch.setattr(cuda_kernel, "_instantiated", lambda family: {big: 150 * 1024, small: 80 * 1024})
    reason = cuda_kernel.shared_memory_reason(big, torch.float16, 99 * 1024)  # SM86/89
    assert reason is not None and "150 KB" in reason and "99 KB" in reason and big.name in reason
    assert cuda_kernel.shared_memory_reason(big, torch.float16, 227 * 1024) is None  # SM90
    assert cuda_kernel.shared_memory_reason(small, torch.float16, 99 * 1024) is None
    assert cuda_kernel.shared_memory_reason(big, torch.float16, None) is None  # limit unknown: launch decides
    other = cuda_kernel.CudaAttentionConfig(16, 4, 4, 2)  # not instantiated: nothing to say
    assert cuda_kernel.shared_memory_reason(other, torch.float16, 1024) is None


def test_instantiated_configs_read_the_extension_listing(monkeypatch) -> None:
    """The binding's configs() rows (family, 6 tile fields, shared-memory bytes) become configs per
    family with their byte counts (a stand-in module: CPU builds have no extension)."""
    rows = [("16bit", 64, 2, 4, 2, 1, 2, 153088), ("fp32", 32, 2, 4, 2, 1, 1, 148992),
            ("16bit", 128, 2, 4, 1, 2, 2, 187000)]

    class FakeExtension:
        @staticmethod
        def configs():
            return rows

    monkeypatch.setattr(cuda_kernel, "_extension", lambda: (FakeExtension, None))
    cuda_kernel._instantiated.cache_clear()
    try:
        C = cuda_kernel.CudaAttentionConfig
        assert cuda_kernel.instantiated_configs("16bit") == (C(64, 2, 4, 2, 1, 2), C(128, 2, 4, 1, 2, 2))
        assert cuda_kernel.instantiated_configs("fp32") == (C(32, 2, 4, 2, 1, 1),)
        assert cuda_kernel.build_status().startswith("built, 3 tile configs")
        reason = cuda_kernel.shared_memory_reason(C(64, 2, 4, 2, 1, 2), torch.bfloat16, 100 * 1024)
        assert reason is not None and "149 KB" in reason
    finally:
        cuda_kernel._instantiated.cache_clear()


def test_choose_config_rule() -> None:
    """The measured regimes of the rule (H200, 132 SMs) and its limits."""
    rule, C = cuda_kernel.choose_config, cuda_kernel.CudaAttentionConfig
    assert rule(torch.float16, 16, 50, 450, 132) == C(64, 1, 8, 1, kv_groups=2)
    assert rule(torch.bfloat16, 16, 50, 450, 132) == C(64, 1, 8, 1, kv_groups=2)
    assert rule(torch.float16, 64, 50, 450, 132) == C(128, 2, 4, 1, kv_groups=2)  # (8, 50, 450)
    assert rule(torch.float16, 128, 50, 450, 132) is None  # (16, 50, 450): beyond one wave, Triton
    assert rule(torch.float16, 16, 50, 600, 132) is None  # a split would walk more tiles
    assert rule(torch.float32, 64, 50, 450, 132) == C(32, 2, 4, 2)
    assert rule(torch.float32, 256, 50, 450, 132) == C(32, 4, 2, 2)
    assert rule(torch.float32, 16, 50, 450, 132) is None  # few CTAs: Triton's split-K
    assert rule(torch.float32, 128, 50, 450, 132) is None  # (16, 50, 450): not measured, Triton
    assert rule(torch.float16, 16, 100, 450, 132) is None and rule(torch.float32, 64, 50, 2000, 132) is None


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize("dtype,precision", _DTYPES, ids=_DTYPE_IDS)
@pytest.mark.parametrize("shape", [(3, 2, 37, 300), (8, 8, 50, 450), (2, 2, 1, 70), (2, 3, 64, 129),
                                   (2, 2, 65, 33), (4, 2, 100, 2100)], ids=lambda s: "x".join(map(str, s)))
def test_gpu_every_config_matches_oracle(dtype, precision, shape) -> None:
    n, h, q_len, k_len = shape
    for i, config in enumerate(_configs(dtype)):
        a = _gpu_inputs(n, h, q_len, k_len, 64, dtype, mask=(i % 2 == 0), pool=(n + 2 if i % 3 == 0 else 0),
                        seed=i + k_len)
        _check(a, dtype, config)


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize("dtype,precision", _DTYPES, ids=_DTYPE_IDS)
def test_gpu_default_config_against_naive_oracle(dtype, precision) -> None:
    """The forced config once against the loop-per-row float64 oracle of tests/oracle.py."""
    a = _gpu_inputs(3, 2, 37, 300, 64, dtype, mask=True, pool=5)
    _gpu_check(a, dtype, precision, launch=_launch(cuda_kernel.default_config(dtype)))


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize("dtype,precision", _DTYPES, ids=_DTYPE_IDS)
def test_gpu_edge_lengths_and_nan_padding(dtype, precision) -> None:
    """Lengths at every tile edge, out of range, and NaN in every frame past a row's length."""
    lengths = [0, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 200, -3, 500]
    n, k_len = len(lengths), 200
    for config in _configs(dtype):
        a = _gpu_inputs(n, 2, 21, k_len, 64, dtype, seed=config.block_k)
        a["key_lengths"] = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        cache = a["k"]._base
        assert cache is not None
        for row, length in enumerate(lengths):
            cache[row, :, max(min(length, k_len), 0):] = float("nan")
        _check(a, dtype, config)


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize("dtype,precision", _DTYPES, ids=_DTYPE_IDS)
def test_gpu_graph_replay_matches_eager(dtype, precision) -> None:
    """The forced config and every cluster config: replay after new inputs and lengths == a fresh call, bitwise."""
    for config in [cuda_kernel.default_config(dtype)] + [c for c in _configs(dtype) if c.cluster > 1]:
        a = _gpu_inputs(8, 8, 50, 450, 64, dtype, mask=True)
        out = torch.empty(8, 50, 8, 64, device="cuda", dtype=dtype).transpose(1, 2)

        def call(a=a, out=out, config=config):
            return cuda_kernel.cfm_attention_cuda(a["q"], a["k"], a["v"], a["key_lengths"], a["mask"], None, out,
                                                  config)

        graph, _ = capture_cuda_graph(call)
        b = _gpu_inputs(8, 8, 50, 450, 64, dtype, mask=True, seed=7)
        for name in ("q", "k", "v", "key_lengths", "mask"):
            a[name].copy_(b[name])
        graph.replay()
        torch.cuda.synchronize()
        fresh = torch.empty_like(out)
        cuda_kernel.cfm_attention_cuda(a["q"], a["k"], a["v"], a["key_lengths"], a["mask"], None, fresh, config)
        assert torch.equal(out, fresh), config


@pytest.mark.gpu
@needs_kernel
def test_gpu_no_host_sync() -> None:
    a = _gpu_inputs(8, 8, 50, 450, 64, torch.float16, mask=True, pool=9)
    out = torch.empty(8, 50, 8, 64, device="cuda", dtype=torch.float16).transpose(1, 2)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for config in _configs(torch.float16):
            cuda_kernel.cfm_attention_cuda(a["q"], a["k"], a["v"], a["key_lengths"], a["mask"], a["kv_rows"], out,
                                           config)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.gpu
@needs_kernel
def test_gpu_op_dispatch_follows_env(monkeypatch) -> None:
    """The op runs the CUDA kernel under "auto" where its rule picks it and Triton elsewhere, Triton
    under "triton", and "cuda" on an uncovered call (D = 32) raises ValueError with the reason."""
    from torch_cfm.kernels._launch import sm_count
    from torch_cfm.kernels.cfm_attention import cfm_attention_triton

    for n in (2, 32):  # (2, 50, 450) fp16 is the CUDA kernel's by the rule, (32, 50, 450) Triton's
        a = _gpu_inputs(n, 8, 50, 450, 64, torch.float16, seed=n)
        args = (a["q"], a["k"], a["v"])
        monkeypatch.setenv(policy.ENV_ATTENTION_KERNEL, "auto")
        got = torch.ops.torch_cfm.cfm_attention(*args, key_lengths=a["key_lengths"])
        config = cuda_kernel.choose_config(torch.float16, n * 8, 50, 450, sm_count(a["q"].device))
        assert (config is not None) == (n == 2)  # on a GPU of 64-255 SMs
        want = torch.empty_like(got)
        if config is not None:
            cuda_kernel.cfm_attention_cuda(*args, a["key_lengths"], None, None, want, config)
        else:
            cfm_attention_triton(*args, a["key_lengths"], None, None, None, want)
        assert torch.equal(got, want)
        monkeypatch.setenv(policy.ENV_ATTENTION_KERNEL, "triton")
        got = torch.ops.torch_cfm.cfm_attention(*args, key_lengths=a["key_lengths"])
        cfm_attention_triton(*args, a["key_lengths"], None, None, None, want)
        assert torch.equal(got, want)
    monkeypatch.setenv(policy.ENV_ATTENTION_KERNEL, "cuda")
    b = _gpu_inputs(2, 2, 10, 40, 32, torch.float16)
    with pytest.raises(ValueError, match="D = 32"):
        torch.ops.torch_cfm.cfm_attention(b["q"], b["k"], b["v"])
