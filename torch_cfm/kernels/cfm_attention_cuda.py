"""The hand-written CUDA kernel of ``cfm_attention`` (``csrc/cuda/``), where it is built and applies.

The Triton kernel (:mod:`torch_cfm.kernels.cfm_attention`) runs one program per (row, head, query
tile) that walks the row's keys serially; at docs/design.md §7's small shapes that walk is the time
(docs/performance.md). The CUDA kernel gives each (row, head, query tile) a CTA of up to 16
warps that split the key walk and merge (m, l, O) in shared memory, with mma.sync tensor-core dots
(fp16/bf16 m16n8k16, TF32 m16n8k8).

It is an optional build (``torch_cfm._C_cuda``: torch with CUDA and nvcc, see setup.py) and covers
D = 64, fp16/bf16/fp32-TF32, unit stride along D and 16-byte aligned rows; everything else, fp32
"ieee" included, stays on Triton. :func:`not_supported_reasons` says why a call is not covered,
:func:`choose_config` which tile config runs (None: Triton is faster there).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from ..config import MIN_CAPABILITY  # SM80: mma.sync m16n8k16 f16/bf16 and m16n8k8 tf32, cp.async, ldmatrix

HEAD_DIM = 64


@dataclass(frozen=True)
class CudaAttentionConfig:
    """One instantiated tile config of the CUDA kernel (csrc/cuda/cfm_attention_params.h).

    Attributes:
        block_k: keys per tile.
        q_groups: 16-query groups per CTA (the CTA covers 16 · q_groups queries).
        key_splits: warps per query group, each walking every key_splits-th tile.
        buffers: tiles in flight per split (1 or 2).
        cluster: consecutive query tiles of one (row, head) per thread-block cluster (SM90): each
            K/V row is read from L2 once and multicast into every CTA of the cluster; 1 = no cluster.
        kv_groups: cp.async groups per tile: 2 lands K before V, so the score dot and softmax run
            while V is still landing; 1 waits for both.
    """

    block_k: int
    q_groups: int
    key_splits: int
    buffers: int
    cluster: int = 1
    kv_groups: int = 1

    @property
    def name(self) -> str:
        return (f"cuda_k{self.block_k}_q{16 * self.q_groups}_w{self.key_splits}_b{self.buffers}"
                + (f"_c{self.cluster}" if self.cluster > 1 else "")
                + (f"_kv{self.kv_groups}" if self.kv_groups > 1 else ""))


@functools.lru_cache(maxsize=1)
def _extension():
    """(module, None) when torch_cfm._C_cuda imports, else (None, why)."""
    try:
        from .. import _C_cuda  # type: ignore[attr-defined]
    except ImportError as exc:
        import importlib.util

        reinstall = "python3 -m pip install --no-build-isolation -e ."
        if importlib.util.find_spec("torch_cfm._C_cuda") is not None:
            return None, f"torch_cfm._C_cuda is present but does not load ({exc}); rebuild it: {reinstall}"
        if torch.version.cuda is None:
            return None, (f"torch {torch.__version__} has no CUDA; the optional CUDA extension torch_cfm._C_cuda "
                          "is built at install only for a CUDA torch with nvcc (the Triton and reference "
                          "kernels run without it)")
        return None, ("the optional CUDA extension torch_cfm._C_cuda was not built at install (it needs nvcc, "
                      f"and TORCH_CFM_BUILD_CUDA=0 skips it); to build it, set CUDA_HOME and reinstall: {reinstall} "
                      "(the Triton kernel runs without it)")
    return _C_cuda, None


def build_status() -> str:
    """One line for explain(): whether the CUDA kernel is built, and its configs."""
    module, why = _extension()
    if module is None:
        return f"not available: {why}"
    return f"built, {len(module.configs())} tile configs (D = {HEAD_DIM})"


@functools.lru_cache(maxsize=None)
def _instantiated(family: str) -> dict[CudaAttentionConfig, int]:
    """{config: shared-memory bytes per CTA} compiled into the extension for "16bit" or "fp32"."""
    module, _ = _extension()
    if module is None:
        return {}
    return {CudaAttentionConfig(*fields[:-1]): fields[-1] for fam, *fields in module.configs() if fam == family}


def instantiated_configs(family: str) -> tuple[CudaAttentionConfig, ...]:
    """The configs compiled into the extension for "16bit" or "fp32" (empty when not built)."""
    return tuple(_instantiated(family))


def shared_memory_reason(config: CudaAttentionConfig, dtype: torch.dtype, limit: Optional[int]) -> Optional[str]:
    """Why ``config`` cannot launch where a CTA may use at most ``limit`` bytes of shared memory
    (None: it can, or the limit is unknown). E.g. 227 KB on SM90, 163 KB on SM80, 99 KB on SM86/89."""
    need = _instantiated(_family(dtype)).get(config)
    if need is None or limit is None or need <= limit:
        return None
    return (f"config {config.name} needs {need // 1024} KB of shared memory per CTA, "
            f"this GPU allows {limit // 1024} KB")


def cluster_capable(device: torch.device) -> bool:
    """Whether configs with ``cluster > 1`` (thread-block clusters, bulk-copy multicast) run here: SM90+."""
    from .. import policy

    cap = policy.device_capability(device)
    return cap is not None and cap >= (9, 0)


def config_device_reason(config: CudaAttentionConfig, dtype: torch.dtype, device: torch.device) -> Optional[str]:
    """Why ``config`` cannot launch on CUDA ``device`` (clusters need SM90+; its shared memory must
    fit the per-CTA opt-in limit); None when it can. Cached: asked on every eager call."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _config_device_reason(config, _family(dtype), index)


@functools.lru_cache(maxsize=None)
def _config_device_reason(config: CudaAttentionConfig, family: str, index: int) -> Optional[str]:
    if config.cluster > 1 and not cluster_capable(torch.device("cuda", index)):
        return f"config {config.name}: thread-block clusters need SM90+"
    limit = getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", None)
    return shared_memory_reason(config, torch.float32 if family == "fp32" else torch.float16, limit)


def runnable_configs(dtype: torch.dtype, device: torch.device) -> tuple[CudaAttentionConfig, ...]:
    """The instantiated configs for ``dtype`` that can launch on ``device`` (tests, memcheck, benches)."""
    return tuple(c for c in instantiated_configs(_family(dtype)) if config_device_reason(c, dtype, device) is None)


def _family(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else "16bit"


def _aligned(t: torch.Tensor, name: str) -> Optional[str]:
    size = t.element_size()
    if t.stride(-1) != 1:
        return f"{name} needs unit stride along D, got stride {t.stride(-1)}"
    if t.data_ptr() % 16 or any((s * size) % 16 for s in t.stride()[:-1]):
        return f"{name} rows must be 16-byte aligned (data_ptr and strides), got strides {tuple(t.stride())}"
    return None


def not_supported_reasons(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, precision: Optional[str]) -> list[str]:
    """Why the CUDA kernel cannot run this (validated) call; empty when it can.

    Args:
        q, k, v: the op's inputs (already checked by ``ops._checks.check_cfm_attention``).
        precision: resolved precision, "tf32" | "ieee" for float32, None for 16-bit.
    """
    reasons = []
    _, why = _extension()
    if why is not None:
        reasons.append(why)
    if q.device.type != "cuda":
        reasons.append(f"needs a CUDA device, found {q.device.type}")
    elif torch.version.hip is not None:
        reasons.append("needs NVIDIA CUDA, found HIP/ROCm")
    else:
        from .. import policy

        cap = policy.device_capability(q.device)  # cached: this runs on every eager call
        if cap is None or cap < MIN_CAPABILITY:
            reasons.append(f"needs SM{MIN_CAPABILITY[0]}{MIN_CAPABILITY[1]}+, found {f'SM{cap[0]}{cap[1]}' if cap else 'none'}")
    if q.shape[-1] != HEAD_DIM:
        reasons.append(f"covers D = {HEAD_DIM} only, got D = {q.shape[-1]}")
    if q.dtype == torch.float32 and precision != "tf32":
        reasons.append(f"float32 needs precision 'tf32' (3xTF32 'ieee' is Triton's), got {precision!r}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        reasons.append(f"dtype {q.dtype} not covered")
    for name, t in (("q", q), ("k", k), ("v", v)):
        why = _aligned(t, name)
        if why is not None:
            reasons.append(why)
    return reasons


def default_config(dtype: torch.dtype) -> CudaAttentionConfig:
    """The config used where :func:`choose_config` has no rule but the CUDA kernel is forced (env
    ``TORCH_CFM_ATTENTION_KERNEL=cuda``): 32 queries per CTA, 4 key splits (the fastest fp16 and
    TF32 configs at (8, 50, 450))."""
    if _family(dtype) == "16bit":
        return CudaAttentionConfig(64, 2, 4, 2, kv_groups=2)
    return CudaAttentionConfig(32, 2, 4, 2)


def choose_config(dtype: torch.dtype, rows_heads: int, q_len: int, k_len: int,
                  n_sm: int) -> Optional[CudaAttentionConfig]:
    """The CUDA kernel's tile config for a call, or None where the Triton kernel is as fast or faster.

    Set from sweeps on the H200 (H = 8, D = 64, ragged lengths; docs/performance.md,
    bench/results/attention_sweep.md), for Q <= 64 and K <= 1024 only:

    * fp16/bf16, K <= 512: one wave of 16-query CTAs → 8 splits of one 64-key tile each, K landing
      before V; else one wave of 32-query CTAs → 4 splits of one 128-key tile each (two 64-key
      tiles per split are slower). Each CTA loads its row's whole K/V. Multicast clusters (each K/V
      row read from L2 once for two query tiles) do not make the loads cheaper and add cluster
      set-up: no rule picks them.
    * fp32 (TF32): 32-query CTAs with 4 splits when they fill between half and one wave; 64-query
      CTAs with 2 splits beyond one wave. Fewer CTAs stay on Triton's split-K. K before V
      (kv_groups = 2) is slower in TF32.

    A pure rule (no device or build query): the caller checks :func:`not_supported_reasons`.
    """
    if q_len > 64 or k_len > 1024:
        return None
    if dtype == torch.float32:
        ctas_q32 = rows_heads * -(-q_len // 32)
        if n_sm // 2 < ctas_q32 <= n_sm:
            return CudaAttentionConfig(32, 2, 4, 2)
        if rows_heads * -(-q_len // 64) > n_sm:
            return CudaAttentionConfig(32, 4, 2, 2)
        return None
    if k_len > 512:
        return None
    if rows_heads * -(-q_len // 16) <= n_sm:
        return CudaAttentionConfig(64, 1, 8, 1, kv_groups=2)
    if rows_heads * -(-q_len // 32) <= n_sm:
        return CudaAttentionConfig(128, 2, 4, 1, kv_groups=2)
    return None


def cfm_attention_cuda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_lengths: Optional[torch.Tensor],
    mask: Optional[torch.Tensor],
    kv_rows: Optional[torch.Tensor],
    out: torch.Tensor,
    config: CudaAttentionConfig,
    pdl: Optional[bool] = None,
) -> torch.Tensor:
    """Launch the CUDA kernel into a preallocated ``out``; same contract as
    :func:`torch_cfm.kernels.cfm_attention.cfm_attention_triton` for the calls
    :func:`not_supported_reasons` accepts.

    Args:
        q: (N, H, Q, 64) float16 | bfloat16 | float32 (TF32 dots), unit stride along D, 16-byte rows.
        k, v: (N, H, K, 64), or (R, H, K, 64) pools with kv_rows; q's dtype and alignment rules.
        key_lengths, kv_rows: optional (N,) int32; mask: optional bool (N, Q, K), any strides.
        out: (N, H, Q, 64) in q.dtype with unit stride along D; every element is written.
        config: an instantiated :class:`CudaAttentionConfig`.
        pdl: programmatic dependent launch; None = the Triton kernel's rule (one wave of CTAs, SM90+,
            ``TORCH_CFM_PDL`` not off).
    Returns:
        ``out``. No host sync, no allocation (graph-capturable), launched on the current stream.
    """
    module, why = _extension()
    if module is None:
        raise RuntimeError(f"cfm_attention CUDA kernel unavailable: {why}")
    why_not = config_device_reason(config, q.dtype, q.device)
    if why_not is not None:
        raise ValueError(why_not)
    if key_lengths is not None and key_lengths.stride(0) != 1:
        key_lengths = key_lengths.contiguous()
    if kv_rows is not None and kv_rows.stride(0) != 1:
        kv_rows = kv_rows.contiguous()
    if pdl is None:
        from .. import policy
        from ._launch import sm_count
        from .cfm_attention_config import use_pdl

        q_tiles = -(-q.shape[2] // (16 * config.q_groups))
        ctas = q.shape[0] * q.shape[1] * -(-q_tiles // config.cluster) * config.cluster
        pdl = policy.pdl_allowed(q.device) and use_pdl(ctas, sm_count(q.device))
    module.cfm_attention_fwd(q, k, v, key_lengths, mask, kv_rows, out, config.block_k, config.q_groups,
                             config.key_splits, config.buffers, config.cluster, config.kv_groups, pdl)
    return out
