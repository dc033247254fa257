"""``torch_cfm::dit_body``: the fused DiT estimator body as a custom op, and the model hook.

One call = one estimator evaluation of one Euler step for a streaming chunk (SPEC §2, §4):
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

:func:`dit_forward_chunk_fused` is what ``DiT.forward_chunk`` calls when the policy says fused.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch

from .. import policy
from ..config import ATTENTION_DTYPES, ATTENTION_PRECISIONS
from ..packing import PER_BLOCK, modulation_table, packed_for
from ..reference.dit_body import clamp_lengths, dit_body_reference
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


def _empty_outputs(x_in: torch.Tensor, s: dict[str, int], with_att: bool = True) -> tuple[torch.Tensor, ...]:
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
    """One fused estimator evaluation of a streaming chunk (SPEC §1-2, §4).

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
    return _empty_outputs(x_in, s)


def _dit_body_cpu(x_in, weights, mod_table, cnn_cache=None, att_cache=None, valid_lengths=None,
                  cache_lengths=None, precision="auto"):
    check_dit_body(x_in, weights, mod_table, cnn_cache, att_cache, valid_lengths, cache_lengths, precision)
    vel, cnn, att = dit_body_reference(x_in, list(weights), mod_table, cnn_cache, att_cache,
                                       valid_lengths, cache_lengths)
    return vel.contiguous(), cnn.contiguous(), att.contiguous()


def dit_body_fused_into(x_in, weights, mod_table, cnn_cache, att_cache, valid_lengths, cache_lengths,
                        precision: Optional[str], out: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                        plan=None):
    """The fused path writing into preallocated ``out`` (used by the op and the graph runner).

    ``plan`` picks the kernels of :func:`torch_cfm.kernels.dit_body.dit_body_triton`: a
    :class:`torch_cfm.kernels.body_plans.BodyPlan` or a plan name ("v1", "v5", "v9"); None = the
    tuning table's. Every plan is checked against the same oracle.

    Runs the Triton driver on any device (CPU works under TRITON_INTERPRET=1) with cuBLAS TF32
    set from ``precision`` for float32 ("tf32"/"ieee"; "auto"/None follows torch's setting).
    """
    from ..kernels.dit_body import dit_body_triton

    n_rows, _, t_len = x_in.shape
    cache_len = 0 if att_cache is None else att_cache.shape[3]
    valid = clamp_lengths(valid_lengths, n_rows, t_len, x_in.device)
    cached = clamp_lengths(cache_lengths, n_rows, cache_len, x_in.device)
    prec, scope = _driver_precision(x_in, precision)
    with scope:
        return dit_body_triton(x_in, list(weights), mod_table.contiguous(), cnn_cache, att_cache, valid, cached,
                               prec, out, plan)


def _driver_precision(x_in: torch.Tensor, precision: Optional[str]):
    """(resolved dot precision, context setting cuBLAS TF32 from it for float32 CUDA bodies)."""
    prec = policy.resolve_precision(x_in.dtype, precision or "auto")
    scope = (policy.tf32_scope(prec == "tf32") if x_in.dtype == torch.float32 and x_in.is_cuda
             else contextlib.nullcontext())
    return prec, scope


def dit_body_arena_into(x_in, weights, mod_table, cnn_cache, att_arena, valid_lengths, cache_lengths,
                        precision: Optional[str], out: tuple[torch.Tensor, torch.Tensor], plan=None):
    """The fused body on an in-place attention-cache arena (the whole-solve runner's form).

    ``att_arena`` (depth, N, H, P, 2D) holds row n's ``cache_lengths[n]`` old keys at frames [0, L_n)
    in reversed key order (:func:`torch_cfm.models.cache.reverse_keys`); the call appends the T_n
    current keys behind them (reversed too) and copies no old frame, so the arena then holds the
    SPEC §2 new cache, reversed, at [0, T_n + L_n). ``out`` = (velocity (N, Cout, T), new conv cache
    (depth, N, 2C, 2)). Lengths are clamped to [0, T] and [0, P - T]. Same math as the op within
    the SPEC §6 oracle (the attention sums its keys in another order). ``plan``: as
    :func:`dit_body_fused_into` (a plan with an arena form); None: the tuning table's arena plan.
    """
    from ..kernels.dit_body import dit_body_triton

    n_rows, _, t_len = x_in.shape
    if att_arena.dim() != 5 or att_arena.shape[1] != n_rows or att_arena.shape[3] < t_len:
        fail("dit_body_arena_into", "att_arena", f"be (depth, N={n_rows}, H, P >= T={t_len}, 2D)",
             shape_str(att_arena))
    if att_arena.dtype != x_in.dtype or att_arena.device != x_in.device:
        fail("dit_body_arena_into", "att_arena", f"be {dtype_str(x_in.dtype)} on {x_in.device}",
             f"{dtype_str(att_arena.dtype)} on {att_arena.device}")
    valid = clamp_lengths(valid_lengths, n_rows, t_len, x_in.device)
    cached = clamp_lengths(cache_lengths, n_rows, att_arena.shape[3] - t_len, x_in.device)
    prec, scope = _driver_precision(x_in, precision)
    with scope:
        vel, cnn, _ = dit_body_triton(x_in, list(weights), mod_table.contiguous(), cnn_cache, None, valid, cached,
                                      prec, (out[0], out[1], att_arena), plan, arena=True)
    return vel, cnn


def _dit_body_cuda(x_in, weights, mod_table, cnn_cache=None, att_cache=None, valid_lengths=None,
                   cache_lengths=None, precision="auto"):
    s = check_dit_body(x_in, weights, mod_table, cnn_cache, att_cache, valid_lengths, cache_lengths, precision)
    if x_in.dtype == torch.float64 or s["t_len"] == 0:
        vel, cnn, att = dit_body_reference(x_in, list(weights), mod_table, cnn_cache, att_cache,
                                           valid_lengths, cache_lengths)
        return vel.contiguous(), cnn.contiguous(), att.contiguous()
    out = _empty_outputs(x_in, s)
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


# --------------------------------------------------------------------------------------------
# the model hook
# --------------------------------------------------------------------------------------------

def stage_input(x: torch.Tensor, mu: torch.Tensor, spks: Optional[torch.Tensor], cond: Optional[torch.Tensor],
                dtype: torch.dtype) -> torch.Tensor:
    """``concat(x, mu, spks broadcast over time, cond)`` -> (N, 320, T) in ``dtype``."""
    n_rows, mel, t_len = x.shape
    spks = x.new_zeros((n_rows, mel)) if spks is None else spks
    cond = torch.zeros_like(x) if cond is None else cond
    return torch.cat([x.to(dtype), mu.to(dtype), spks.to(dtype)[:, :, None].expand(-1, -1, t_len),
                      cond.to(dtype)], dim=1)


def _time_vector(t, n_rows: int, device: torch.device) -> torch.Tensor:
    if isinstance(t, torch.Tensor):
        t = t.reshape(-1).to(device)
        if t.numel() not in (1, n_rows):
            fail("dit_forward_chunk_fused", "t", f"be a scalar or have N={n_rows} entries", shape_str(t))
        return t
    return torch.full((1,), float(t), device=device, dtype=torch.float64)


def dit_forward_chunk_fused(
    model: torch.nn.Module,
    x: torch.Tensor,
    mu: torch.Tensor,
    t,
    spks: Optional[torch.Tensor],
    cond: Optional[torch.Tensor],
    cnn_cache: Optional[torch.Tensor] = None,
    att_cache: Optional[torch.Tensor] = None,
    *,
    valid_lengths: Optional[torch.Tensor] = None,
    cache_lengths: Optional[torch.Tensor] = None,
    precision: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``DiT.forward_chunk`` on the fused body (same arguments and results, SPEC §2).

    Weights are packed once per (model, compute dtype, device) and repacked when a parameter
    changes. The modulation table is computed per call from ``t`` (one table when t is a scalar,
    one per row when t has N entries). The compute dtype is the autocast dtype when autocast is
    enabled, else the parameters' dtype.

    Returns:
        velocity (N, 80, T), new_cnn_cache (depth, N, 2C, 2), new_att_cache (depth, N, H, T+L, 2D)
        in the compute dtype.
    """
    dev = x.device
    if torch.is_autocast_enabled(dev.type):
        dtype = torch.get_autocast_dtype(dev.type)
    else:
        dtype = next(p for n, p in model.named_parameters() if n == "in_proj.weight").dtype
    packed = packed_for(model, dtype, dev)
    x_in = stage_input(x, mu, spks, cond, dtype)
    prec = precision if precision in ("tf32", "ieee") else "auto"
    tf = policy.resolve_precision(dtype, prec)
    scope = (policy.tf32_scope(tf == "tf32") if dtype == torch.float32 and dev.type == "cuda"
             else contextlib.nullcontext())
    with torch.autocast(dev.type, enabled=False), torch.no_grad():
        with scope:
            table = modulation_table(packed, _time_vector(t, x.shape[0], dev))
        cnn = None if cnn_cache is None else cnn_cache.to(dtype)
        att = None if att_cache is None else att_cache.to(dtype)
        return torch.ops.torch_cfm.dit_body.default(x_in, packed.body, table, cnn, att,
                                                    valid_lengths, cache_lengths, prec)


__all__ = ["dit_body", "dit_forward_chunk_fused", "dit_body_fused_into", "check_dit_body", "stage_input"]
