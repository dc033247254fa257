"""``torch_cfm::dit_body``: the fused DiT estimator body as a custom op.

One call = one estimator evaluation of one Euler step for a streaming chunk (docs/design.md §2, §4):
staged input -> in_proj -> depth blocks (attention caches read in place, new caches written;
conv caches gathered per row) -> final layer -> velocity. Registered here (Python fragment of the
``torch_cfm`` library):

* schema ``dit_body(Tensor x_in, Tensor[] weights, Tensor mod_table, Tensor? cnn_cache,
  Tensor? att_cache, Tensor? valid_lengths, Tensor? cache_lengths, str precision) -> (Tensor,
  Tensor, Tensor)``;
* CPU kernel = :func:`torch_cfm.reference.dit_body.dit_body_reference` (plain PyTorch);
* CUDA kernel = :func:`torch_cfm.kernels.dit_body.dit_body_triton` (Triton + cuBLAS);
* fake kernel (same validation, exact output metadata) and autocast rules on AutocastCUDA /
  AutocastCPU that follow the ambient autocast dtype.

``DiT.forward_chunk`` calls it through :func:`torch_cfm.models.fused_forward.dit_forward_chunk_fused`
when the policy says fused; the solver writes into preallocated outputs through
:func:`torch_cfm.kernels.dit_body.dit_body_fused_into`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..config import ATTENTION_DTYPES, ATTENTION_PRECISIONS
from ..packing import PER_BLOCK
from ..reference.dit_body import dit_body_reference
from ._checks import check_index_vector, check_tensor, dtype_str, fail, shape_str

_OP = "torch_cfm::dit_body"
_NAME = "dit_body"
BODY_DTYPES = ATTENTION_DTYPES + (torch.float64,)  # float64: CPU reference / oracle only

_lib = torch.library.Library("torch_cfm", "FRAGMENT")  # noqa: TOR901
_lib.define(
    "dit_body(Tensor x_in, Tensor[] weights, Tensor mod_table, Tensor? cnn_cache, Tensor? att_cache, "
    "Tensor? valid_lengths, Tensor? cache_lengths, str precision=\"auto\") -> (Tensor, Tensor, Tensor)")


def check_dit_body(x_in, weights, mod_table, cnn_cache, att_cache, valid_lengths, cache_lengths,
                   precision) -> dict[str, int]:
    """Validate every argument of ``dit_body`` (metadata only); returns the sizes."""
    op = _NAME
    check_tensor(op, "x_in", x_in)
    if x_in.dim() != 3:
        fail(op, "x_in", "have rank 3 (N, Cin, T)", f"rank {x_in.dim()} {shape_str(x_in)}")
    if x_in.dtype not in BODY_DTYPES:
        fail(op, "x_in", "be float16, bfloat16, float32 (or float64 on CPU)", dtype_str(x_in.dtype))
    if not isinstance(weights, (list, tuple)) or len(weights) < 4 or (len(weights) - 4) % PER_BLOCK:
        fail(op, "weights", f"be the packed list of 4 + {PER_BLOCK}*depth tensors (torch_cfm.packing)",
             f"{type(weights).__name__} of length {len(weights) if isinstance(weights, (list, tuple)) else '?'}",
             "build it with torch_cfm.packing.pack_dit(model, dtype, device).body")
    for j, w in enumerate(weights):
        check_tensor(op, f"weights[{j}]", w)
        if w.dtype != x_in.dtype:
            fail(op, f"weights[{j}]", f"have x_in's dtype {dtype_str(x_in.dtype)}", dtype_str(w.dtype),
                 "pack the weights in the compute dtype")
        if w.device != x_in.device:
            fail(op, f"weights[{j}]", f"be on x_in's device {x_in.device}", str(w.device))
    n_rows, cin, t_len = x_in.shape
    depth = (len(weights) - 4) // PER_BLOCK
    c = weights[0].shape[0]
    if weights[0].dim() != 2 or weights[0].shape[1] != cin:
        fail(op, "weights[0]", f"be in_proj (C, Cin) with Cin={cin} (x_in channels)", shape_str(weights[0]))
    head_dim = weights[4].shape[0] if depth else 1
    inner = weights[2].shape[0] // 3 if depth else 1
    heads = inner // head_dim
    if depth and (weights[2].shape != (3 * inner, c) or inner % head_dim):
        fail(op, "weights[2]", f"be the packed qkv weight (3*H*D, C=({c}))", shape_str(weights[2]))
    check_tensor(op, "mod_table", mod_table)
    stat = torch.float64 if x_in.dtype == torch.float64 else torch.float32
    if (mod_table.dim() != 4 or mod_table.shape[0] not in (1, n_rows)
            or tuple(mod_table.shape[1:]) != (depth + 1, 9, c) or mod_table.dtype != stat):
        fail(op, "mod_table", f"be {dtype_str(stat)} of shape (R, depth+1, 9, C) = (1|{n_rows}, {depth + 1}, 9, {c})",
             f"{dtype_str(mod_table.dtype)} {shape_str(mod_table)}", "build it with torch_cfm.packing.modulation_table")
    if mod_table.device != x_in.device:
        fail(op, "mod_table", f"be on x_in's device {x_in.device}", str(mod_table.device))
    cache_len = 0
    if cnn_cache is not None:
        check_tensor(op, "cnn_cache", cnn_cache)
        if tuple(cnn_cache.shape) != (depth, n_rows, 2 * c, 2) or cnn_cache.dtype != x_in.dtype:
            fail(op, "cnn_cache", f"be {dtype_str(x_in.dtype)} of shape (depth, N, 2C, 2)=({depth}, {n_rows}, {2 * c}, 2)",
                 f"{dtype_str(cnn_cache.dtype)} {shape_str(cnn_cache)}")
        if cnn_cache.device != x_in.device:
            fail(op, "cnn_cache", f"be on x_in's device {x_in.device}", str(cnn_cache.device))
    if att_cache is not None:
        check_tensor(op, "att_cache", att_cache)
        if (att_cache.dim() != 5 or tuple(att_cache.shape[:3]) != (depth, n_rows, heads)
                or att_cache.shape[4] != 2 * head_dim or att_cache.dtype != x_in.dtype):
            fail(op, "att_cache", f"be {dtype_str(x_in.dtype)} of shape (depth, N, H, L, 2D)="
                 f"({depth}, {n_rows}, {heads}, L, {2 * head_dim})", f"{dtype_str(att_cache.dtype)} {shape_str(att_cache)}")
        if att_cache.device != x_in.device:
            fail(op, "att_cache", f"be on x_in's device {x_in.device}", str(att_cache.device))
        cache_len = att_cache.shape[3]
    check_index_vector(op, "valid_lengths", valid_lengths, n_rows, x_in)
    check_index_vector(op, "cache_lengths", cache_lengths, n_rows, x_in)
    if precision not in ATTENTION_PRECISIONS:
        fail(op, "precision", f"be one of {ATTENTION_PRECISIONS}", repr(precision))
    return dict(n_rows=n_rows, t_len=t_len, cache_len=cache_len, depth=depth, hidden=c, heads=heads,
                head_dim=head_dim, out_channels=weights[-2].shape[0])


def body_outputs(x_in: torch.Tensor, s: dict[str, int], with_att: bool = True) -> tuple[torch.Tensor, ...]:
    """(velocity, new conv cache[, new attention cache]) for the sizes of ``check_dit_body``."""
    n, t, l_len = s["n_rows"], s["t_len"], s["cache_len"]
    vel = x_in.new_empty((n, s["out_channels"], t))
    cnn = x_in.new_empty((s["depth"], n, 2 * s["hidden"], 2))
    if not with_att:
        return vel, cnn
    att = x_in.new_empty((s["depth"], n, s["heads"], t + l_len, 2 * s["head_dim"]))
    return vel, cnn, att


def dit_body(
    x_in: torch.Tensor,
    weights: Sequence[torch.Tensor],
    mod_table: torch.Tensor,
    cnn_cache: Optional[torch.Tensor] = None,
    att_cache: Optional[torch.Tensor] = None,
    *,
    valid_lengths: Optional[torch.Tensor] = None,
    cache_lengths: Optional[torch.Tensor] = None,
    precision: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One fused estimator evaluation of a streaming chunk (docs/design.md §1-2, §4).

    Row n uses its first ``T_n`` current frames and first ``L_n`` cached frames (lengths clamped
    to [0, T] and [0, L]); its new attention cache holds its T_n current k|v frames (k after the
    k LayerNorm) followed by its L_n old frames, contiguous from frame 0, then zeros; its new conv
    cache is the last 2 frames of ``[cache ; chunk[:T_n]]`` per conv. Velocity at frames >= T_n
    is padding (finite). GEMMs run in the compute dtype with float32 accumulation; the residual
    stream, LayerNorm statistics, modulation and conv tap sums in float32.

    Args:
        x_in: (N, Cin, T) staged input ``concat(x, mu, spks broadcast, cond)``, compute dtype.
        weights: the packed body weights (``torch_cfm.packing.packed_for(model, dtype, device).body``).
        mod_table: (R, depth+1, 9, C) float32 (float64 for a float64 body), R in {1, N}
            (``torch_cfm.packing.modulation_table``).
        cnn_cache: (depth, N, 2C, 2) or None (zero history).
        att_cache: (depth, N, H, L, 2D) or None (L = 0); any strides.
        valid_lengths, cache_lengths: optional (N,) int32 T_n / L_n (default T / L).
        precision: fp32 dots "tf32" | "ieee" | "auto" (torch's TF32 setting). Ignored otherwise.
    Returns:
        velocity (N, Cout, T), new_cnn_cache (depth, N, 2C, 2), new_att_cache (depth, N, H, T+L, 2D),
        contiguous, in x_in's dtype.
    Shapes: N rows, T chunk frames, L cache frames, C hidden, H heads, D head dim, Cin = 320.
    Devices: CPU -> reference math; CUDA -> Triton kernels + cuBLAS (SM80+ attention kernel).
    Raises:
        ValueError: bad shape/dtype/device of any argument (the message names it), eager and fake.
    Graph safety: no host sync; allocates the outputs plus O(N*T*C) workspace; CUDA-graph capturable.
    """
    check_dit_body(x_in, weights, mod_table, cnn_cache, att_cache, valid_lengths, cache_lengths, precision)
    return torch.ops.torch_cfm.dit_body.default(x_in, list(weights), mod_table, cnn_cache, att_cache,
                                                valid_lengths, cache_lengths, precision)


@torch.library.register_fake(_OP)
def _dit_body_fake(x_in, weights, mod_table, cnn_cache=None, att_cache=None, valid_lengths=None,
                   cache_lengths=None, precision="auto"):
    s = check_dit_body(x_in, weights, mod_table, cnn_cache, att_cache, valid_lengths, cache_lengths, precision)
    return body_outputs(x_in, s)


def _dit_body_cpu(x_in, weights, mod_table, cnn_cache=None, att_cache=None, valid_lengths=None,
                  cache_lengths=None, precision="auto"):
    check_dit_body(x_in, weights, mod_table, cnn_cache, att_cache, valid_lengths, cache_lengths, precision)
    vel, cnn, att = dit_body_reference(x_in, list(weights), mod_table, cnn_cache, att_cache,
                                       valid_lengths, cache_lengths)
    return vel.contiguous(), cnn.contiguous(), att.contiguous()


def _dit_body_cuda(x_in, weights, mod_table, cnn_cache=None, att_cache=None, valid_lengths=None,
                   cache_lengths=None, precision="auto"):
    s = check_dit_body(x_in, weights, mod_table, cnn_cache, att_cache, valid_lengths, cache_lengths, precision)
    if x_in.dtype == torch.float64 or s["t_len"] == 0:
        vel, cnn, att = dit_body_reference(x_in, list(weights), mod_table, cnn_cache, att_cache,
                                           valid_lengths, cache_lengths)
        return vel.contiguous(), cnn.contiguous(), att.contiguous()
    from ..kernels.dit_body import dit_body_fused_into  # Triton is optional: imported on the first CUDA call

    out = body_outputs(x_in, s)
    return dit_body_fused_into(x_in, weights, mod_table, cnn_cache, att_cache, valid_lengths, cache_lengths,
                               precision, out)


_lib.impl(_NAME, _dit_body_cpu, "CPU")
_lib.impl(_NAME, _dit_body_cuda, "CUDA")


def _dit_body_autocast(device_type: str):
    def autocast_impl(x_in, weights, mod_table, cnn_cache=None, att_cache=None, valid_lengths=None,
                      cache_lengths=None, precision="auto"):
        dtype = torch.get_autocast_dtype(device_type)

        def cast(t):
            return t.to(dtype) if t is not None and t.is_floating_point() else t

        with torch.autocast(device_type, enabled=False):
            return torch.ops.torch_cfm.dit_body.default(
                cast(x_in), [cast(w) for w in weights], mod_table, cast(cnn_cache), cast(att_cache),
                valid_lengths, cache_lengths, precision)

    return autocast_impl


_lib.impl(_NAME, _dit_body_autocast("cuda"), "AutocastCUDA")
_lib.impl(_NAME, _dit_body_autocast("cpu"), "AutocastCPU")


__all__ = ["dit_body", "check_dit_body", "body_outputs"]
