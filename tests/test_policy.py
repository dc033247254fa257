"""docs/design.md §5 dispatch policy: one decision function, env > argument > torch setting."""

import contextlib

import pytest
import torch

from torch_cfm import policy
from torch_cfm.policy import decide

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
H200, T4 = (9, 0), (7, 5)


@contextlib.contextmanager
def matmul_tf32(enabled: bool):
    """Set torch's CUDA matmul TF32 flag and restore it (pytest >= 9.2's monkeypatch cannot: its
    undo deletes the attribute, which torch.backends.cuda.matmul refuses)."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_types_fuse_on_sm80_plus(dtype):
    d = decide(CUDA, dtype, capability=H200, env={})
    assert d.fused and d.reasons == () and d.backend == "sm80" and d.precision is None
    # the kernel that runs: the CUDA kernel where it is built (and not switched off), else Triton
    assert d.attention_kernel == ("cuda" if policy._cuda_extension_present() else "triton")
    assert decide(CUDA, dtype, capability=H200, env={policy.ENV_ATTENTION_KERNEL: "triton"}).attention_kernel == "triton"


def test_fp32_needs_tf32():
    off = decide(CUDA, torch.float32, tf32=False, capability=H200, env={})
    on = decide(CUDA, torch.float32, tf32=True, capability=H200, env={})
    assert not off.fused and off.reasons == ("fp32 with TF32 off",) and off.precision == "ieee"
    assert on.fused and on.precision == "tf32"


def test_old_gpu_gets_sdpa_and_a_reason_with_numbers():
    d = decide(CUDA, torch.float16, capability=T4, env={})
    assert not d.fused and d.backend == d.attention_kernel == "sdpa"
    assert d.reasons == ("needs NVIDIA SM80+, found SM75",)


def test_cpu_is_reference():
    d = decide(CPU, torch.float32, tf32=False, env={})
    assert not d.fused and d.backend == d.attention_kernel == "reference"
    assert d.reasons == ("needs a CUDA device, found cpu", "fp32 with TF32 off")


def test_env_tf32_beats_argument_and_torch_setting():
    assert decide(CUDA, torch.float32, tf32=True, capability=H200, env={"TORCH_CFM_TF32": "off"}).precision == "ieee"
    assert decide(CUDA, torch.float32, tf32=False, capability=H200, env={"TORCH_CFM_TF32": "on"}).fused
    with matmul_tf32(True):
        assert decide(CUDA, torch.float32, capability=H200, env={}).precision == "tf32"
        assert decide(CUDA, torch.float32, tf32=False, capability=H200, env={}).precision == "ieee"


def test_fused_override_and_env_override():
    forced = decide(CUDA, torch.float32, tf32=False, fused=True, capability=H200, env={})
    assert forced.fused and forced.precision == "ieee" and forced.source == "argument"
    off = decide(CUDA, torch.float16, fused=True, capability=H200, env={"TORCH_CFM_FUSED": "0"})
    assert not off.fused and off.source == "env" and off.reasons == ("disabled by env",)
    # An override cannot make a CUDA kernel run on CPU.
    cpu = decide(CPU, torch.float16, fused=True, env={})
    assert not cpu.fused and "needs a CUDA device, found cpu" in cpu.reasons


def test_bad_env_value_names_the_variable():
    with pytest.raises(ValueError, match="TORCH_CFM_FUSED"):
        decide(CUDA, torch.float16, capability=H200, env={"TORCH_CFM_FUSED": "maybe"})


def test_unsupported_dtype_has_a_reason():
    d = decide(CUDA, torch.float64, capability=H200, env={})
    assert not d.fused and any("float64" in r for r in d.reasons)


def test_resolve_precision_follows_torch_at_call_time(monkeypatch):
    monkeypatch.delenv("TORCH_CFM_TF32", raising=False)
    with matmul_tf32(False):
        assert policy.resolve_precision(torch.float32) == "ieee"
    with matmul_tf32(True):
        assert policy.resolve_precision(torch.float32) == "tf32"
        assert policy.resolve_precision(torch.float32, "ieee") == "ieee"
    assert policy.resolve_precision(torch.float16) is None


def test_tf32_scope_restores_previous_setting():
    before = torch.backends.cuda.matmul.allow_tf32
    with policy.tf32_scope(not before):
        assert torch.backends.cuda.matmul.allow_tf32 is (not before)
    assert torch.backends.cuda.matmul.allow_tf32 is before


def test_explain_prints_each_decision_with_reasons(capsys):
    import torch_cfm

    text = torch_cfm.explain(device=CPU)
    assert "cfm_attention [float16]: kernel=reference" in text
    assert "needs a CUDA device, found cpu" in text
    from torch_cfm.kernels import cutlass_gemm
    why = cutlass_gemm.unavailable_reason()
    assert ("  CUTLASS:    " + (f"not available: {why}" if why else cutlass_gemm.library_path())) in text
    assert text in capsys.readouterr().out


@pytest.mark.parametrize("device, capability, env, expected", [
    ("cuda", (9, 0), {}, True),
    ("cuda", (8, 0), {}, False),  # griddepcontrol needs SM90
    ("cuda", (9, 0), {"TORCH_CFM_PDL": "0"}, False),
    ("cuda", (10, 0), {"TORCH_CFM_PDL": "on"}, True),
    ("cpu", (9, 0), {}, False),
])
def test_pdl_allowed_by_capability_and_env(device, capability, env, expected):
    assert policy.pdl_allowed(torch.device(device), env=env, capability=capability) is expected


def test_pdl_env_value_is_validated():
    with pytest.raises(ValueError, match="TORCH_CFM_PDL"):
        policy.pdl_allowed(torch.device("cuda"), env={"TORCH_CFM_PDL": "maybe"}, capability=(9, 0))
