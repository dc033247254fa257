"""Triton kernel of ``cfm_attention`` (docs/design.md §4): ragged, cache-aware attention, optional split-K.

1. ``_cfm_attention_fwd_kernel``: program = (row, head, query tile, key split). It walks the keys
   ``[split·chunk, (split+1)·chunk) ∩ [0, length)`` with an online softmax in FP32 (``exp2``,
   log2(e)/√D folded into one FFMA per score), whole tiles without bound tests and a masked
   tail. With one split it normalises and writes ``out`` directly; otherwise it writes its
   normalised partial output and its log2-sum-exp to a workspace. ``chunk`` comes from the
   row's own (clamped) key length, so ragged rows split their *valid* keys evenly and no
   program walks padding.
2. ``_cfm_attention_combine_kernel`` (only when splits > 1): merges the partials of each query
   with weights ``2^(lse_s − max lse)``.

At the streaming shapes (K ≤ 524) the combine kernel costs more than the shorter key walk saves
(``docs/performance.md``), so :func:`~torch_cfm.kernels.cfm_attention_config.choose_config` splits
only fp32 calls and long key ranges with few programs, merged in-kernel by the last program
(:class:`ArrivalCounters`). FP32 ``precision="ieee"`` runs its dots as 3xTF32
(error-compensated TF32 on tensor cores, FP32-level accuracy: rel. error ≈ 4e-7 vs float64,
below the FMA dot's); ``AttentionConfig(ieee_dot="ieee")`` selects plain FP32 FMA dots.

A query whose keys are all invalid ends with ``l = 0``: every exponent is taken against 0 rather
than ``-inf`` (no ``-inf − -inf``), so it yields exactly 0, never NaN.

The split workspace (splits · N·H · Q · (D+1) fp32) is the only allocation besides ``out``: it
comes from PyTorch's caching allocator on the calls that split, so it is sync-free and CUDA-graph
capturable (a captured graph keeps it in its private pool). No host synchronisation, no
autotuning: tiles and splits come from the deterministic per-shape rule of
:mod:`torch_cfm.kernels.cfm_attention_config` (re-exported here), so the Triton interpreter
(``TRITON_INTERPRET=1``) runs the same code on CPU tensors and graph capture never benchmarks.
"""

from __future__ import annotations

import math
import threading
from typing import Optional

import torch
import triton
import triton.language as tl

from ._launch import launch_kwargs, on_device, pdl_prologue, pdl_supported, sm_count
from .cfm_attention_config import AttentionConfig, choose_config, qk_slabs, use_pdl

__all__ = ["COUNTERS", "LOG2E", "ArrivalCounters", "AttentionConfig", "cfm_attention_triton", "choose_config",
           "qk_slabs", "use_pdl"]

LOG2E = 1.4426950408889634


@triton.jit
def _qk_slab(q_j, j, k_base, offs_k, k_ok, stride_k_k, stride_k_d, fresh_zero,
             SLAB: tl.constexpr, MASK_KEYS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Raw scores of head-dim slice ``[j·SLAB, (j+1)·SLAB)`` in an accumulator of their own.

    ``fresh_zero`` is 0.0 at run time: Triton folds ``s + dot(a, b)`` (a constant-zero
    accumulator) into ``dot(a, b, s)``, which would chain the slices into one running sum again.
    """
    offs_d = j * SLAB + tl.arange(0, SLAB)
    k_ptrs = k_base + offs_k[None, :] * stride_k_k + offs_d[:, None] * stride_k_d
    if MASK_KEYS:
        kt = tl.load(k_ptrs, mask=k_ok[None, :], other=0.0)
    else:
        kt = tl.load(k_ptrs)
    zero = tl.zeros((q_j.shape[0], offs_k.shape[0]), dtype=tl.float32) + fresh_zero
    return tl.dot(q_j, kt, zero, input_precision=DOT_PRECISION)


@triton.jit
def _cfm_attention_fwd_inner(
    q0, q1, q2, q3, m_i, l_i, acc, k0, k_end,
    k_base, v_base, m_base, offs_q, q_ok, offs_d, offs_kb,
    stride_k_k, stride_k_d, stride_v_k, stride_v_d, stride_m_q, stride_m_k,
    qk_scale, fresh_zero,
    HAS_MASK: tl.constexpr, MASK_KEYS: tl.constexpr, DOT_PRECISION: tl.constexpr, QK_SLABS: tl.constexpr,
):
    """One key tile ``[k0, k0 + BLOCK_K)``: scores, online-softmax update, ``acc += p·v``.

    MASK_KEYS=False is the fast path for tiles entirely inside ``[k_start, k_end)``: unmasked
    loads and no per-key bound test. QK_SLABS = 1: ``q0`` is the whole (BLOCK_Q, D) query tile;
    2 or 4: ``q0..q{QK_SLABS-1}`` are its head-dim slices (see ``AttentionConfig.qk_slab``).
    """
    offs_k = k0 + offs_kb
    k_ok = offs_k < k_end
    v_ptrs = v_base + offs_k[:, None] * stride_v_k + offs_d[None, :] * stride_v_d
    # -- raw scores (FP32 accumulation); the log2(e)/sqrt(D) scale is folded into the exponent
    if QK_SLABS == 1:
        k_ptrs = k_base + offs_k[None, :] * stride_k_k + offs_d[:, None] * stride_k_d
        if MASK_KEYS:
            kt = tl.load(k_ptrs, mask=k_ok[None, :], other=0.0)
        else:
            kt = tl.load(k_ptrs)
        s = tl.dot(q0, kt, input_precision=DOT_PRECISION)
    else:
        SLAB: tl.constexpr = q0.shape[1]
        s = _qk_slab(q0, 0, k_base, offs_k, k_ok, stride_k_k, stride_k_d, fresh_zero, SLAB, MASK_KEYS,
                     DOT_PRECISION)
        s += _qk_slab(q1, 1, k_base, offs_k, k_ok, stride_k_k, stride_k_d, fresh_zero, SLAB, MASK_KEYS,
                      DOT_PRECISION)
        if QK_SLABS == 4:
            s += _qk_slab(q2, 2, k_base, offs_k, k_ok, stride_k_k, stride_k_d, fresh_zero, SLAB, MASK_KEYS,
                          DOT_PRECISION)
            s += _qk_slab(q3, 3, k_base, offs_k, k_ok, stride_k_k, stride_k_d, fresh_zero, SLAB, MASK_KEYS,
                          DOT_PRECISION)
    if HAS_MASK:
        if MASK_KEYS:
            keep = q_ok[:, None] & k_ok[None, :]
        else:
            keep = q_ok[:, None] & (offs_k[None, :] >= 0)
        mk = tl.load(m_base + offs_q[:, None] * stride_m_q + offs_k[None, :] * stride_m_k, mask=keep, other=0)
        s = tl.where(mk != 0, s, float("-inf"))
    elif MASK_KEYS:
        s = tl.where(k_ok[None, :], s, float("-inf"))
    # -- running max / sum in log2 units; exponents against 0 while a row has seen no valid key
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s * qk_scale - m_ref[:, None])
    alpha = tl.math.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    # -- rescale and accumulate p·v
    if MASK_KEYS:
        v = tl.load(v_ptrs, mask=k_ok[:, None], other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# Scalars that vary per call and gain nothing from Triton's "== 1" / "% 16" specialisation: leaving
# them unspecialised keeps one compiled variant per tile config across shapes. n_splits stays
# specialised so that splits == 1 compiles the direct-store path only.
# stride_m_n is left unspecialised too: otherwise a mask shared by all rows (stride 0) and a per-row one
# compile two kernels that round 1 fp16 ulp apart, and a row's output depends on its batch
# (docs/performance.md).
_NO_SPEC = ["n_heads", "q_len", "k_len", "n_pool", "q_tiles", "n_rows_heads", "stride_m_n"]


@triton.jit(do_not_specialize=_NO_SPEC)
def _cfm_attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr,  # (N, H, Q, D), (R, H, K, D), (R, H, K, D); any strides
    lengths_ptr,  # (N,) int32 key lengths (read when HAS_LENGTHS)
    mask_ptr,  # (N, Q, K) uint8 view of the bool mask, any strides incl. 0 (read when HAS_MASK)
    rows_ptr,  # (N,) int32 pool row of each query row (read when HAS_ROWS)
    out_ptr,  # (N, H, Q, D) output (written when n_splits == 1)
    part_ptr,  # (splits, N·H, Q, D) fp32 normalised partial outputs (written when n_splits > 1)
    lse_ptr,  # (splits, N·H, Q) fp32 log2-sum-exp of each partial (written when n_splits > 1)
    count_ptr,  # (N·H·q_tiles,) int32 arrival counters, zero between launches (read when LAST_MERGES)
    stride_q_n, stride_q_h, stride_q_q, stride_q_d,
    stride_k_n, stride_k_h, stride_k_k, stride_k_d,
    stride_v_n, stride_v_h, stride_v_k, stride_v_d,
    stride_m_n, stride_m_q, stride_m_k,
    stride_o_n, stride_o_h, stride_o_q, stride_o_d,
    n_heads, q_len, k_len, n_pool, q_tiles, n_splits, n_rows_heads,
    qk_scale,  # log2(e) / sqrt(D)
    fresh_zero,  # 0.0 at run time (QK_SLABS > 1)
    HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_LENGTHS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_ROWS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PEEL: tl.constexpr, USE_PDL: tl.constexpr, LAST_MERGES: tl.constexpr,
    QK_SLABS: tl.constexpr,
):
    pdl_prologue(USE_PDL)  # programmatic dependent launch: wait for the previous kernel first
    # program -> (row·head, query tile, split); splits of one tile are adjacent
    pid = tl.program_id(0)
    split = pid % n_splits
    rest = pid // n_splits
    q_tile = rest % q_tiles
    nh = rest // q_tiles
    n = nh // n_heads
    h = nh % n_heads

    if HAS_LENGTHS:
        length = tl.load(lengths_ptr + n)
        length = tl.minimum(tl.maximum(length, 0), k_len)
    else:
        length = k_len
    if HAS_ROWS:
        row = tl.load(rows_ptr + n)
        row = tl.minimum(tl.maximum(row, 0), n_pool - 1)
    else:
        row = n
    # this split's keys: an even share of the row's valid keys, rounded up to whole tiles
    chunk = tl.cdiv(tl.cdiv(length, n_splits), BLOCK_K) * BLOCK_K
    k_start = split * chunk
    k_end = tl.minimum(k_start + chunk, length)

    offs_q = q_tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_kb = tl.arange(0, BLOCK_K)
    q_ok = offs_q < q_len

    q_base = q_ptr + n.to(tl.int64) * stride_q_n + h.to(tl.int64) * stride_q_h
    k_base = k_ptr + row.to(tl.int64) * stride_k_n + h.to(tl.int64) * stride_k_h
    v_base = v_ptr + row.to(tl.int64) * stride_v_n + h.to(tl.int64) * stride_v_h
    m_base = mask_ptr + n.to(tl.int64) * stride_m_n

    # q stays resident for the whole key walk (whole, or as QK_SLABS head-dim slices)
    if QK_SLABS == 1:
        q0 = tl.load(q_base + offs_q[:, None] * stride_q_q + offs_d[None, :] * stride_q_d,
                     mask=q_ok[:, None], other=0.0)
        q1 = q0
        q2 = q0
        q3 = q0
    else:
        SLAB: tl.constexpr = HEAD_DIM // QK_SLABS
        offs_s = tl.arange(0, SLAB)
        q_ptrs = q_base + offs_q[:, None] * stride_q_q + offs_s[None, :] * stride_q_d
        q0 = tl.load(q_ptrs, mask=q_ok[:, None], other=0.0)
        q1 = tl.load(q_ptrs + SLAB * stride_q_d, mask=q_ok[:, None], other=0.0)
        q2 = q0
        q3 = q0
        if QK_SLABS == 4:
            q2 = tl.load(q_ptrs + 2 * SLAB * stride_q_d, mask=q_ok[:, None], other=0.0)
            q3 = tl.load(q_ptrs + 3 * SLAB * stride_q_d, mask=q_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)  # running max (scaled, log2 units)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)  # running sum of 2^(s·scale - m_i)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM], dtype=tl.float32)

    if PEEL:
        # whole tiles without bound tests, then at most one masked tail tile
        k_mid = k_start + ((k_end - k_start) // BLOCK_K) * BLOCK_K
        for k0 in range(k_start, k_mid, BLOCK_K):
            m_i, l_i, acc = _cfm_attention_fwd_inner(
                q0, q1, q2, q3, m_i, l_i, acc, k0, k_end, k_base, v_base, m_base, offs_q, q_ok, offs_d, offs_kb,
                stride_k_k, stride_k_d, stride_v_k, stride_v_d, stride_m_q, stride_m_k, qk_scale, fresh_zero,
                HAS_MASK, False, DOT_PRECISION, QK_SLABS)
        for k0 in range(k_mid, k_end, BLOCK_K):
            m_i, l_i, acc = _cfm_attention_fwd_inner(
                q0, q1, q2, q3, m_i, l_i, acc, k0, k_end, k_base, v_base, m_base, offs_q, q_ok, offs_d, offs_kb,
                stride_k_k, stride_k_d, stride_v_k, stride_v_d, stride_m_q, stride_m_k, qk_scale, fresh_zero,
                HAS_MASK, True, DOT_PRECISION, QK_SLABS)
    else:
        for k0 in range(k_start, k_end, BLOCK_K):
            m_i, l_i, acc = _cfm_attention_fwd_inner(
                q0, q1, q2, q3, m_i, l_i, acc, k0, k_end, k_base, v_base, m_base, offs_q, q_ok, offs_d, offs_kb,
                stride_k_k, stride_k_d, stride_v_k, stride_v_d, stride_m_q, stride_m_k, qk_scale, fresh_zero,
                HAS_MASK, True, DOT_PRECISION, QK_SLABS)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]  # rows without a valid key: acc = 0 -> exactly 0
    if n_splits == 1:
        out_base = out_ptr + n.to(tl.int64) * stride_o_n + h.to(tl.int64) * stride_o_h
        tl.store(out_base + offs_q[:, None] * stride_o_q + offs_d[None, :] * stride_o_d,
                 o.to(out_ptr.dtype.element_ty), mask=q_ok[:, None])
    else:
        slot = (split * n_rows_heads + nh).to(tl.int64) * q_len
        tl.store(part_ptr + (slot + offs_q[:, None]) * HEAD_DIM + offs_d[None, :], o, mask=q_ok[:, None])
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + slot + offs_q, lse, mask=q_ok)
        if LAST_MERGES:
            # Every thread's partial is stored before the (gpu-scope, acq_rel) arrival; the program
            # that arrives last sees all partials and merges them; it also re-zeroes the counter.
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr + rest, 1, sem="acq_rel", scope="gpu")
            if arrived == n_splits - 1:
                tl.debug_barrier()
                tl.atomic_xchg(count_ptr + rest, 0, sem="relaxed", scope="gpu")
                out_base = out_ptr + n.to(tl.int64) * stride_o_n + h.to(tl.int64) * stride_o_h
                _merge_partials(part_ptr, lse_ptr, out_base, offs_q, offs_d, q_ok, nh, q_len, n_splits,
                                n_rows_heads, stride_o_q, stride_o_d, HEAD_DIM, BLOCK_Q, True)


@triton.jit
def _merge_partials(part_ptr, lse_ptr, out_base, offs_q, offs_d, q_ok, nh, q_len, n_splits, n_rows_heads,
                    stride_o_q, stride_o_d, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BYPASS_L1: tl.constexpr):
    """out[q] = sum_s 2^(lse_s - max) part_s[q] / sum_s 2^(lse_s - max), splits in order (so both merge
    paths give the same bits). BYPASS_L1: the partials were written by other SMs during this launch."""
    m = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    w_sum = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, HEAD_DIM], dtype=tl.float32)
    for s in range(0, n_splits):
        slot = (s * n_rows_heads + nh).to(tl.int64) * q_len
        if BYPASS_L1:
            lse = tl.load(lse_ptr + slot + offs_q, mask=q_ok, other=float("-inf"), cache_modifier=".cg")
            part = tl.load(part_ptr + (slot + offs_q[:, None]) * HEAD_DIM + offs_d[None, :],
                           mask=q_ok[:, None], other=0.0, cache_modifier=".cg")
        else:
            lse = tl.load(lse_ptr + slot + offs_q, mask=q_ok, other=float("-inf"))
            part = tl.load(part_ptr + (slot + offs_q[:, None]) * HEAD_DIM + offs_d[None, :],
                           mask=q_ok[:, None], other=0.0)
        m_new = tl.maximum(m, lse)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m - m_ref)
        w = tl.math.exp2(lse - m_ref)
        acc = acc * alpha[:, None] + part * w[:, None]
        w_sum = w_sum * alpha + w
        m = m_new
    o = acc / tl.where(w_sum > 0.0, w_sum, 1.0)[:, None]
    tl.store(out_base + offs_q[:, None] * stride_o_q + offs_d[None, :] * stride_o_d,
             o.to(out_base.dtype.element_ty), mask=q_ok[:, None])


@triton.jit(do_not_specialize=["n_heads", "q_len", "q_tiles", "n_splits", "n_rows_heads"])
def _cfm_attention_combine_kernel(
    part_ptr,  # (splits, N·H, Q, D) fp32 normalised partial outputs
    lse_ptr,  # (splits, N·H, Q) fp32 log2-sum-exp per partial (-inf: no valid key)
    out_ptr,  # (N, H, Q, D) output, any strides
    stride_o_n, stride_o_h, stride_o_q, stride_o_d,
    n_heads, q_len, q_tiles, n_splits, n_rows_heads,
    HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    q_tile = pid % q_tiles
    nh = pid // q_tiles
    n = nh // n_heads
    h = nh % n_heads
    offs_q = q_tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, HEAD_DIM)
    q_ok = offs_q < q_len
    out_base = out_ptr + n.to(tl.int64) * stride_o_n + h.to(tl.int64) * stride_o_h
    _merge_partials(part_ptr, lse_ptr, out_base, offs_q, offs_d, q_ok, nh, q_len, n_splits, n_rows_heads,
                    stride_o_q, stride_o_d, HEAD_DIM, BLOCK_Q, False)


class ArrivalCounters:
    """Zeroed int32 counters for ``merge="last"``: one per (row, head, query tile) of a launch.

    A launch increments each tile's counter once per split; the program that brings it to
    ``splits`` merges the partials and writes the counter back to 0, so a counter is zero again
    when its launch ends. Two launches may share counters only if one finishes before the other
    starts, hence:

    * outside CUDA-graph capture, each (device, stream) has its own counters (launches on one
      stream are ordered; the buffer grows when a launch needs more);
    * inside a capture, every captured launch reserves counters of its own, never handed out
      again (the graph may be replayed on any stream, next to anything), from a pool zeroed
      outside capture: :meth:`reserve_for_capture` returns None when the pool is missing or
      used up, and the caller then merges with the combine kernel instead.

    The pool is (re)filled by eager launches (a capture cannot zero memory without adding a node
    to the graph); 2**18 counters (1 MiB) per refill, i.e. thousands of captured launches.
    """

    POOL = 1 << 18

    def __init__(self) -> None:
        self._lock = threading.Lock()  # launches (and captures) may come from several threads
        self._eager: dict[tuple[int, int], torch.Tensor] = {}
        self._pool: dict[int, tuple[torch.Tensor, int]] = {}  # device index -> (pool, next free)
        self._retired: list[torch.Tensor] = []  # used-up pools: captured graphs still point into them

    @staticmethod
    def _index(device: torch.device) -> int:
        return device.index if device.index is not None else torch.cuda.current_device()

    def for_eager(self, device: torch.device, n: int) -> torch.Tensor:
        """Counters for an eager launch of ``n`` tiles on the current stream (tops the pool up)."""
        index = self._index(device)
        key = (index, torch.cuda.current_stream(index).cuda_stream)
        with self._lock:
            buf = self._eager.get(key)
            if buf is None or buf.numel() < n:
                buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
                self._eager[key] = buf
            pool = self._pool.get(index)
            if pool is None or pool[0].numel() - pool[1] < self.POOL // 4:
                if pool is not None:
                    self._retired.append(pool[0])
                self._pool[index] = (torch.zeros(self.POOL, dtype=torch.int32, device=device), 0)
        return buf

    def reserve_for_capture(self, device: torch.device, n: int) -> Optional[torch.Tensor]:
        """``n`` counters of the pool that no other launch will ever get, or None."""
        index = self._index(device)
        with self._lock:
            pool = self._pool.get(index)
            if pool is None or pool[0].numel() - pool[1] < n:
                return None
            buf, start = pool
            self._pool[index] = (buf, start + n)
        return buf[start:start + n]


COUNTERS = ArrivalCounters()


def _dot_precision(dtype: torch.dtype, precision: Optional[str], config: AttentionConfig) -> str:
    if dtype == torch.float32:
        if precision == "tf32":
            return "tf32"
        if precision == "ieee":
            return config.ieee_dot
        raise ValueError(
            f"cfm_attention: precision must be 'tf32' or 'ieee' for float32 inputs, got {precision!r}; "
            "resolve 'auto' with torch_cfm.policy.resolve_precision first")
    return "tf32"  # ignored by tl.dot for 16-bit operands (tensor cores, FP32 accumulation)


def cfm_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_lengths: Optional[torch.Tensor],
    mask: Optional[torch.Tensor],
    kv_rows: Optional[torch.Tensor],
    precision: Optional[str],
    out: torch.Tensor,
    config: Optional[AttentionConfig] = None,
) -> torch.Tensor:
    """Launch the Triton kernel(s) of ``cfm_attention`` into a preallocated ``out``.

    Inputs are assumed validated (``torch_cfm.ops._checks.check_cfm_attention``). Semantics are
    docs/design.md §4: keys ``>= key_lengths[n]`` (clamped to [0, K]) or masked out are ignored; a query
    with no valid key gets exactly 0; ``kv_rows`` (clamped to [0, R)) picks the pool row.

    Args:
        q: (N, H, Q, D) float16 | bfloat16 | float32, any strides.
        k, v: (N, H, K, D), or (R, H, K, D) with kv_rows; q's dtype, any strides.
        key_lengths: optional (N,) int32.
        mask: optional bool (N, Q, K), True = attend; any strides (stride 0 allowed).
        kv_rows: optional (N,) int32.
        precision: "tf32" | "ieee" for float32 (already resolved), None for 16-bit inputs.
        out: (N, H, Q, D) in q.dtype, any strides; every element is written.
        config: launch parameters; default :func:`choose_config` (tests and the sweep pass one).
    Returns:
        ``out``.
    Shapes: N rows, H heads, Q queries, K keys, D in {16, 32, 64, 128}, R pool rows.
    Graph safety: no host sync; allocates only a workspace when splits > 1 (caching allocator);
    ``merge="last"`` takes its counters from :data:`COUNTERS` (see :class:`ArrivalCounters`).
    """
    n_rows, n_heads, q_len, head_dim = q.shape
    n_pool, _, k_len, _ = k.shape
    rows_heads = n_rows * n_heads
    if config is None:
        config = choose_config(q.dtype, head_dim, rows_heads, q_len, k_len, sm_count(q.device), precision)
    dot_precision = _dot_precision(q.dtype, precision, config)
    slabs = qk_slabs(config, head_dim)
    if out.numel() == 0:
        return out
    block_q, block_k = config.block_q, config.block_k
    q_tiles = triton.cdiv(q_len, block_q)
    splits = max(1, min(config.splits, triton.cdiv(max(k_len, 1), block_k)))

    counters = None
    if splits > 1 and config.merge == "last":
        if q.device.type != "cuda":
            counters = torch.zeros(rows_heads * q_tiles, dtype=torch.int32, device=q.device)
        elif torch.cuda.is_current_stream_capturing():
            counters = COUNTERS.reserve_for_capture(q.device, rows_heads * q_tiles)
        else:
            counters = COUNTERS.for_eager(q.device, rows_heads * q_tiles)
    if splits > 1:
        work = torch.empty(splits * rows_heads * q_len * (head_dim + 1), device=q.device, dtype=torch.float32)
        part = work[: splits * rows_heads * q_len * head_dim]
        lse = work[splits * rows_heads * q_len * head_dim:]
    else:
        part = lse = out  # never touched
    # The kernel reads the (N,) vectors with unit stride; a strided view (rare) is compacted.
    if key_lengths is not None and key_lengths.stride(0) != 1:
        key_lengths = key_lengths.contiguous()
    if kv_rows is not None and kv_rows.stride(0) != 1:
        kv_rows = kv_rows.contiguous()
    mask_arg = mask.view(torch.uint8) if mask is not None else q
    m_strides = mask.stride() if mask is not None else (0, 0, 0)
    qk_scale = LOG2E / math.sqrt(head_dim)
    pdl = use_pdl(rows_heads * q_tiles * splits, sm_count(q.device)) if config.pdl is None else config.pdl
    pdl = pdl and pdl_supported(q.device)

    with on_device(q.device):
        _cfm_attention_fwd_kernel[(rows_heads * q_tiles * splits,)](
            q, k, v,
            key_lengths if key_lengths is not None else q,
            mask_arg,
            kv_rows if kv_rows is not None else q,
            out, part, lse, counters if counters is not None else q,
            *q.stride(), *k.stride(), *v.stride(), *m_strides, *out.stride(),
            n_heads, q_len, k_len, n_pool, q_tiles, splits, rows_heads,
            qk_scale, 0.0,
            HEAD_DIM=head_dim, BLOCK_Q=block_q, BLOCK_K=block_k,
            HAS_LENGTHS=key_lengths is not None, HAS_MASK=mask is not None, HAS_ROWS=kv_rows is not None,
            DOT_PRECISION=dot_precision, PEEL=config.peel, USE_PDL=pdl, LAST_MERGES=counters is not None,
            QK_SLABS=slabs, num_warps=config.num_warps, num_stages=config.num_stages, **launch_kwargs(pdl),
        )
        if splits > 1 and counters is None:
            block_qc = 16 if q_len <= 16 else 32
            qc_tiles = triton.cdiv(q_len, block_qc)
            _cfm_attention_combine_kernel[(rows_heads * qc_tiles,)](
                part, lse, out, *out.stride(),
                n_heads, q_len, qc_tiles, splits, rows_heads,
                HEAD_DIM=head_dim, BLOCK_Q=block_qc, USE_PDL=pdl,
                num_warps=4, **launch_kwargs(pdl),
            )
    return out
