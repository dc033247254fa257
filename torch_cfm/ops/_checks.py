"""ValueError helpers shared by the eager wrappers and the fake kernels.

They read metadata only (shape, dtype, device): never data, so they never synchronise and run
unchanged under FakeTensorMode. Messages follow ``<op>: <arg> must <expectation>, got <actual>``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..config import ATTENTION_DTYPES, ATTENTION_HEAD_DIMS, ATTENTION_PRECISIONS
from ..errors import dtype_str, fail, shape_str  # noqa: F401  (re-exported for the ops)

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def check_tensor(op: str, arg: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        fail(op, arg, "be a torch.Tensor", type(value).__name__)
    return value  # type: ignore[return-value]


def check_rank(op: str, arg: str, t: torch.Tensor, rank: int, letters: str) -> None:
    if t.dim() != rank:
        fail(op, arg, f"have rank {rank} {letters}", f"rank {t.dim()} {shape_str(t)}")


def check_same_device(op: str, arg: str, t: torch.Tensor, ref: torch.Tensor, ref_name: str) -> None:
    if t.device != ref.device:
        fail(op, arg, f"be on {ref_name}'s device {ref.device}", str(t.device))


def check_index_vector(
    op: str, arg: str, t: Optional[torch.Tensor], n_rows: int, ref: torch.Tensor
) -> None:
    """An optional (N,) int32 vector on ``ref``'s device (key_lengths, kv_rows, lengths...)."""
    if t is None:
        return
    check_tensor(op, arg, t)
    if t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] != n_rows:
        remedy = "use .to(torch.int32)" if t.dtype in _INT_DTYPES and t.dtype != torch.int32 else ""
        fail(op, arg, f"be int32 of shape (N,)=({n_rows},)",
             f"{dtype_str(t.dtype)} {shape_str(t)}", remedy)
    check_same_device(op, arg, t, ref, "q")


def check_cfm_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_lengths: Optional[torch.Tensor],
    mask: Optional[torch.Tensor],
    kv_rows: Optional[torch.Tensor],
    precision: str,
) -> None:
    """Validate every argument of ``cfm_attention`` (docs/design.md §4); raises ValueError naming it."""
    op = "cfm_attention"
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(op, name, t)
        check_rank(op, name, t, 4, "(N, H, Q, D)" if name == "q" else "(N, H, K, D)")
    if q.dtype not in ATTENTION_DTYPES:
        fail(op, "q", "be float16, bfloat16 or float32", dtype_str(q.dtype))
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            fail(op, name, f"have q's dtype {dtype_str(q.dtype)}", dtype_str(t.dtype))
        check_same_device(op, name, t, q, "q")
    n_rows, heads, _, head_dim = q.shape
    if head_dim not in ATTENTION_HEAD_DIMS:
        fail(op, "q", f"have head dim D in {ATTENTION_HEAD_DIMS}", f"D={head_dim} {shape_str(q)}")
    pool = kv_rows is not None
    rows_name = "R" if pool else "N"
    if k.shape != v.shape:
        raise ValueError(
            f"{op}: k and v must have the same shape ({rows_name}, H, K, D), got\n"
            f"  q: {shape_str(q)}\n  k: {shape_str(k)}\n  v: {shape_str(v)}")
    if (not pool and k.shape[0] != n_rows) or k.shape[1] != heads or k.shape[3] != head_dim:
        expect = f"({'R' if pool else n_rows}, {heads}, K, {head_dim})"
        raise ValueError(
            f"{op}: k must have shape {expect} to match q, got\n"
            f"  q: {shape_str(q)}\n  k: {shape_str(k)}\n  v: {shape_str(v)}"
            + ("" if pool else "\nHINT: pass kv_rows to read k/v from a pool of rows"))
    if pool and k.shape[0] == 0 and n_rows > 0:
        fail(op, "k", "have at least one pool row when kv_rows is given", shape_str(k))
    check_index_vector(op, "key_lengths", key_lengths, n_rows, q)
    check_index_vector(op, "kv_rows", kv_rows, n_rows, q)
    if mask is not None:
        check_tensor(op, "mask", mask)
        expect = (n_rows, q.shape[2], k.shape[2])
        if mask.dtype != torch.bool or tuple(mask.shape) != expect:
            fail(op, "mask", f"be bool of shape (N, Q, K)={expect}",
                 f"{dtype_str(mask.dtype)} {shape_str(mask)}",
                 "broadcast a (Q, K) mask with mask.expand(N, Q, K)")
        check_same_device(op, "mask", mask, q, "q")
    if precision not in ATTENTION_PRECISIONS:
        fail(op, "precision", f"be one of {ATTENTION_PRECISIONS}", repr(precision))


def check_one_of(op: str, arg: str, value: object, allowed: Sequence[object]) -> None:
    if value not in allowed:
        fail(op, arg, f"be one of {tuple(allowed)}", repr(value))
