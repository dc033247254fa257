"""The streaming CFM solve of SPEC §3: cosine schedule, classifier-free guidance, Euler.

One solve engine, :func:`solve_arena_chunk`: the whole n-step chunk solve over one cache arena,
fixed shapes, no host synchronisation. Everything that solves a chunk runs it:

* :class:`StreamingCFM` wraps an estimator (:class:`~torch_cfm.models.DiT`) with the fixed noise
  buffer; ``forward_chunk`` (the drop-in equivalent of the upstream solver's chunk call) solves
  through a temporary arena holding the caches it was given;
* :class:`~torch_cfm.models.server.CFMServer` solves over its per-bucket keyed arenas;
* :class:`~torch_cfm.graphs.ArenaGraphSolver` captures it as one CUDA graph per shape, and
  :class:`~torch_cfm.graphs.CFMGraphRunner` is a bucketed wrapper over that.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import ClassVar, Optional

import torch
from torch import nn

from .. import policy
from ..config import SolverConfig, cosine_timesteps
from ..ops._checks import fail, shape_str
from ..ops.dit_body import _empty_outputs, check_dit_body, dit_body_arena_into, dit_body_fused_into, stage_input
from ..packing import PackedDiT, modulation_table, packed_for
from ..reference.cache_trim import move_frames_reference, trim_copy_reference
from .cache import TRIM_KEEP_OLDEST, arena_chunk_plan, trim_gather_index
from .dit import DiT

_SOLVER = SolverConfig()


def euler_timesteps(n_timesteps: int) -> list[float]:
    """``t_i = 1 - cos(pi/2 * i/n)``, i = 0..n, as python floats (baked into captured graphs)."""
    return [float(v) for v in cosine_timesteps(n_timesteps, torch.float64)]


@torch.no_grad()
def solve_arena_chunk(
    estimator: nn.Module,
    att: torch.Tensor,
    cnn: torch.Tensor,
    noise: torch.Tensor,
    mu: torch.Tensor,
    spks: torch.Tensor,
    cond: torch.Tensor,
    valid_lengths: torch.Tensor,
    cache_lengths: torch.Tensor,
    prompt_lengths: torch.Tensor,
    out_mel: torch.Tensor,
    *,
    cache_frames: int,
    n_timesteps: int = _SOLVER.n_timesteps,
    cfg_rate: float = _SOLVER.cfg_rate,
    keep_oldest: int = TRIM_KEEP_OLDEST,
    fused: Optional[bool] = None,
    slots: Optional[torch.Tensor] = None,
    frame_keys: Optional[torch.Tensor] = None,
    x0: Optional[torch.Tensor] = None,
    steps: Optional[tuple[int, int]] = None,
    x_state: Optional[torch.Tensor] = None,
) -> None:
    """Solve one chunk for every row of a cache arena, in place (SPEC §3, ragged per SPEC §2).

    For each request slot r (CFG rows r = cond and R + r = uncond, uncond with mu = spks = cond
    = 0 and the same x): ``x0 = noise[0, :, L_r : L_r + T]`` (its own offset = its cache length),
    then for i = 0..n-1: ``v = (1+r)·v_cond − r·v_uncond``, ``x += (t_{i+1} − t_i)·v`` with the
    estimator reading step i's caches. Each step's new caches (``[cur T_r ; old L_r]``, then the
    trim of SPEC §3 per row) are written back into that step's arena slice. A slot with
    ``valid_lengths[r] == 0`` is idle: its caches and lengths come out unchanged (its ``out_mel``
    row is padding).

    Contract (what a CUDA-graph runner relies on):
        * Static buffers, read: ``noise`` (or ``x0``), ``mu``, ``spks``, ``cond``, ``valid_lengths``,
          ``prompt_lengths``. Static buffers, read and written in place: ``att``, ``cnn``,
          ``cache_lengths`` (holds the new, trimmed lengths afterwards), ``out_mel``. Nothing
          else is read from or returned to the host; shapes depend only on the arguments'
          shapes and the python ints below, so one capture serves any values.
        * No host synchronisation, no data-dependent python control flow; temporaries come from
          the caching allocator (graph pool under capture); the arena is never reallocated.
        * ``cache_frames`` (Lb, python int) must be >= the cache length of every slot solved
          (every slot, idle ones included, when ``slots`` is None) and <= M; keys span
          ``T + Lb`` frames and ``min(M, T + Lb)`` frames per row are written back.
        * With ``slots``, that (S,) index buffer is static too (its values may change between
          replays, its size may not).
        * The estimator is called as ``forward_chunk(x, mu, t, spks, cond, cnn[i],
          att[i][..., :Lb, :], valid_lengths=, cache_lengths=, fused=fused)``, except when it is
          a torch_cfm :class:`~torch_cfm.models.DiT` in the arena's dtype and the policy says
          fused: then each step runs the fused body directly with the schedule's modulation
          tables (computed once per packed weights, outside any capture), the staged input
          built once and updated by one CFG/Euler kernel per step, and a float32 Euler state
          (within the SPEC §6 oracle of the per-step path). Otherwise the Euler state is in
          mu's dtype.

    Args:
        estimator: a :class:`~torch_cfm.models.DiT` (or anything with its ``forward_chunk``).
        att: (n, depth, 2R, H, M, 2D) attention-cache arena (compute dtype).
        cnn: (n, depth, 2R, 2C, 2) conv-cache arena.
        noise: (1, 80, F) noise buffer (any float dtype); slot r starts from frames
            [L_r, L_r + T) (ignored when ``x0`` is given).
        mu, cond: (R, 80, T) staged chunk inputs (frames >= T_r are padding, any finite value).
        spks: (R, 80).
        valid_lengths: (R,) int32 T_r in [0, T]. cache_lengths: (R,) int32 L_r in [0, Lb].
        prompt_lengths: (R,) int32 P_r (trim threshold ``P_r + keep_oldest``).
        out_mel: (R, 80, T) output, written in place.
        cache_frames: Lb, the cache window read this chunk (static).
        n_timesteps, cfg_rate, keep_oldest: SPEC §3 constants (static).
        fused: passed to the estimator (None = policy).
        slots: optional (S,) int64 static buffer of DISTINCT slot indices: solve only these
            slots (their rows are gathered from the arena and scattered back), so the cost
            follows S, not R. Slots not listed are not touched at all (their ``out_mel`` rows
            included). None = every slot. Pad to a bucket size with idle slots (length 0).
        frame_keys: optional (R, Mk) int32 static buffer: the arena is *keyed*
            (:class:`~torch_cfm.models.cache.CacheArena`): slot r's valid frames lie at
            [0, L_r) in any order and ``frame_keys[r, j]`` is the SPEC key frame j holds; read and
            updated in place. Then the chunk's keys are appended in place and the trim only
            refills dropped frames (:func:`~torch_cfm.models.cache.arena_chunk_plan`), where the
            fused body runs, every slot is solved and ``Lb + T <= M`` (else the rows are copied
            out, appended and copied back); ``Lb <= Mk`` and ``P_r + keep_oldest <= Mk``.
            None = ``att`` is in the SPEC layout (newest first) and each step's new cache is
            written back through the trim.
        x0: optional (R, 80, T) static buffer: each slot's initial noise, read instead of
            ``noise`` (any float dtype).
        steps: optional (first, stop), 0 <= first < stop <= n (python ints, static): run Euler
            steps first .. stop - 1 only, so one solve can be spread over several calls (a prompt
            solved a few steps per serving tick). Exact: step i reads and writes step i's caches
            only, and the Euler state between calls is kept in ``x_state`` in float32 (the fused
            route's own state; the reference route's state is in mu's dtype, which float32 holds
            exactly). ``first > 0`` starts from ``x_state`` instead of the noise; ``stop < n``
            stores the state of the rows with ``valid_lengths > 0`` into ``x_state`` and commits
            nothing else (``out_mel``, ``cache_lengths`` and ``frame_keys`` untouched, and no
            trim); ``stop == n`` commits as a whole solve does. The valid and cache lengths, the
            staged inputs and the slot set must be the same in every call of one solve.
            None = (0, n).
        x_state: (R, 80, Tmax) float32 static buffer (read and written in place), needed when
            ``steps`` is not (0, n).
    Shapes: R request slots, T chunk frames (bucket), M arena frames, F noise frames.
    """
    slot_count, _, t_len = mu.shape
    arena_frames = att.shape[4]
    width = min(arena_frames, t_len + cache_frames)
    dtype = mu.dtype  # the Euler state's (the fused route needs att's: _fused_route)
    ts = euler_timesteps(n_timesteps)
    first, stop = step_range(steps, n_timesteps, x_state, slot_count, t_len)
    if slots is not None:  # compact: work on the listed slots only
        rows = torch.cat([slots, slots + slot_count])
        mu, cond, spks = mu.index_select(0, slots), cond.index_select(0, slots), spks.index_select(0, slots)
        vl_in, cl_in = valid_lengths.index_select(0, slots), cache_lengths.index_select(0, slots)
        prompt = prompt_lengths.index_select(0, slots)
        x0 = None if x0 is None else x0.index_select(0, slots)
    else:
        vl_in, cl_in, prompt = valid_lengths, cache_lengths, prompt_lengths
    n_rows = mu.shape[0]

    cl = cl_in.to(torch.int64).clamp(0, cache_frames)
    vl = vl_in.to(torch.int64).clamp(0, t_len)
    commit = stop == n_timesteps
    state = state_in = None
    if first > 0 or not commit:  # the Euler state is read or kept only by a solve spread over calls
        state = x_state[:, :, :t_len]
        state_in = state if slots is None else state.index_select(0, slots)
    if first > 0:  # resume a solve spread over calls
        x = state_in
    elif x0 is None:  # slot r starts from noise frames [L_r, L_r + T); cast by the route
        frames = (cl[:, None] + torch.arange(t_len, device=mu.device)[None]).clamp(max=noise.shape[2] - 1)
        x = noise[0].index_select(1, frames.reshape(-1)).view(-1, n_rows, t_len).transpose(0, 1)
    else:
        x = x0
    span = (first, stop)

    def keep_state(x_out: torch.Tensor) -> None:
        """A solve continued by a later call: the busy rows' Euler state into ``x_state``."""
        busy = (vl > 0)[:, None, None]
        new = torch.where(busy, x_out.to(torch.float32), state_in)
        if slots is None:
            state.copy_(new)
        else:
            state.index_copy_(0, slots, new)

    zeros_mel = torch.zeros_like(mu)
    mu2 = torch.cat([mu, zeros_mel])
    cond2 = torch.cat([cond, zeros_mel]).to(dtype)
    spks2 = torch.cat([spks, torch.zeros_like(spks)]).to(dtype)
    vl2 = torch.cat([vl, vl]).to(torch.int32)
    cl2 = torch.cat([cl, cl]).to(torch.int32)

    if frame_keys is not None:
        x, new_lengths = _solve_keyed(estimator, att, cnn, frame_keys, slots, x, mu2, spks2, cond2, vl, cl, vl2, cl2,
                                      prompt, ts, cfg_rate, fused, t_len, cache_frames, keep_oldest, span, commit)
        if commit:
            _store_outputs(out_mel, cache_lengths, x, new_lengths, slots)
        else:
            keep_state(x)
        return
    index, new_lengths = trim_gather_index(vl + cl, prompt, width, t_len + cache_frames, keep_oldest)
    # Write-back of each step's new attention cache, trimmed: output frame j of a row reads frame
    # index[row, j] of the new cache, in one kernel (kernels/cache_trim.py) or its ATen reference.
    write_trimmed = _frame_copies(att)[0]

    def write_back(i: int, new_cnn: torch.Tensor, new_att: torch.Tensor) -> None:
        """Step i's new caches into the arena, the attention cache trimmed."""
        if slots is None:
            cnn[i].copy_(new_cnn)
        else:
            cnn[i].index_copy_(1, rows, new_cnn.to(cnn.dtype))
        write_trimmed(att[i], new_att.contiguous(), index, None if slots is None else rows)

    def step_caches(i: int) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        att_in, cnn_in = att[i][:, :, :, :cache_frames], cnn[i]
        if slots is not None:
            att_in, cnn_in = att_in.index_select(1, rows), cnn_in.index_select(1, rows)
        return (att_in if cache_frames else None), cnn_in  # no old keys: no attention cache

    precision = _fused_route(estimator, att.device, att.dtype if att.dtype == dtype else None, fused, t_len)
    if precision is not None:
        x = _solve_steps_fused(estimator, x, mu2, spks2, cond2, vl2, cl2, ts, cfg_rate, precision,
                               step_caches, write_back, span=span)
    else:
        x = _solve_steps_reference(estimator, x, mu2, spks2, cond2, vl2, cl2, ts, cfg_rate, fused, step_caches,
                                   write_back, span=span)
    if commit:
        _store_outputs(out_mel, cache_lengths, x, new_lengths, slots)
    else:
        keep_state(x)


def step_range(steps: Optional[tuple[int, int]], n_timesteps: int, x_state: Optional[torch.Tensor],
               rows: int, t_len: int) -> tuple[int, int]:
    """``solve_arena_chunk``'s ``steps`` checked: (first, stop) with 0 <= first < stop <= n, and an
    ``x_state`` of at least (rows, 80, t_len) float32 where the solve spans several calls."""
    op = "solve_arena_chunk"
    if steps is None:
        return 0, n_timesteps
    if not (isinstance(steps, tuple) and len(steps) == 2 and all(isinstance(v, int) for v in steps)
            and 0 <= steps[0] < steps[1] <= n_timesteps):
        fail(op, "steps", f"be a tuple (first, stop) of ints with 0 <= first < stop <= n_timesteps={n_timesteps}",
             repr(steps))
    if steps != (0, n_timesteps) and (
            not isinstance(x_state, torch.Tensor) or x_state.dtype != torch.float32 or x_state.dim() != 3
            or x_state.shape[0] != rows or x_state.shape[2] < t_len):
        fail(op, "x_state", f"be a float32 tensor of shape ({rows}, 80, >= {t_len}) when steps={steps}",
             shape_str(x_state) if isinstance(x_state, torch.Tensor) else type(x_state).__name__)
    return steps


def _solve_steps_reference(estimator, x, mu2, spks2, cond2, vl2, cl2, ts, cfg_rate, fused, step_caches,
                           write_back, span: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """Euler steps ``span`` (default all n) through the estimator's own ``forward_chunk`` (CFG
    rows, Euler in mu2's dtype); ``step_caches(i)`` gives step i's (att_in newest first, cnn_in),
    ``write_back(i, new_cnn, new_att)`` stores its new caches. Returns the last x."""
    n_rows = x.shape[0]
    x = x.to(mu2.dtype)
    for i in range(*(span or (0, len(ts) - 1))):
        t = torch.full((2 * n_rows,), ts[i], device=x.device, dtype=x.dtype)
        att_in, cnn_in = step_caches(i)
        v, new_cnn, new_att = estimator.forward_chunk(
            torch.cat([x, x]), mu2, t, spks2, cond2, cnn_in, att_in,
            valid_lengths=vl2, cache_lengths=cl2, fused=fused)
        v = (1.0 + cfg_rate) * v[:n_rows] - cfg_rate * v[n_rows:]
        x = x + (ts[i + 1] - ts[i]) * v.to(x.dtype)
        write_back(i, new_cnn, new_att)
    return x


def _store_outputs(out_mel: torch.Tensor, cache_lengths: torch.Tensor, x: torch.Tensor, new_lengths: torch.Tensor,
                   slots: Optional[torch.Tensor]) -> None:
    if slots is None:
        out_mel.copy_(x)  # copy_ casts (x is float32 on the fused route)
        cache_lengths.copy_(new_lengths)
    else:
        out_mel.index_copy_(0, slots, x.to(out_mel.dtype))
        cache_lengths.index_copy_(0, slots, new_lengths.to(cache_lengths.dtype))


def _frame_copies(att: torch.Tensor):
    """(frame-map copy, move-list copy) for this arena: the Triton kernels of
    ``kernels/cache_trim.py`` where the policy runs Triton kernels (NVIDIA SM80+), else their ATen
    references."""
    if policy.decide(att.device, att.dtype).attention_kernel == "triton" and att.stride(-1) == 1:
        from ..kernels.cache_trim import move_frames_into, trim_copy_into  # Triton is optional

        return trim_copy_into, move_frames_into
    return trim_copy_reference, move_frames_reference


def _solve_keyed(estimator, att, cnn, frame_keys, slots, x, mu2, spks2, cond2, vl, cl, vl2, cl2, prompt, ts,
                 cfg_rate, fused, t_len, cache_frames, keep_oldest, span, commit) -> tuple[torch.Tensor, torch.Tensor]:
    """Euler steps ``span`` on a keyed arena (``solve_arena_chunk`` with ``frame_keys``); ``commit``:
    the solve's last call (the trim and the frame keys written; before it only the steps' caches).

    Three forms, one plan (:func:`~torch_cfm.models.cache.arena_chunk_plan`):
    * fused body, every slot, room for ``Lb + T`` frames: each step appends its keys into the
      arena in place (``dit_body_arena_into``); after the last step one copy refills the frames of
      dropped keys in every step's cache (at most the dropped frames per row);
    * fused body otherwise: each step copies the rows' old frames out into one scratch cache,
      appends there and copies back only the frames that changed;
    * the estimator's own ``forward_chunk`` (reference route): each step reads its old cache newest
      first and writes the new one back keyed.
    Returns (final x (S, 80, T), new lengths (S,)).
    """
    n_slots = vl.shape[0]
    slot_count = frame_keys.shape[0]
    width = cache_frames + t_len
    dtype = att.dtype
    keys_in = frame_keys if slots is None else frame_keys.index_select(0, slots)
    plan = arena_chunk_plan(keys_in, cl, vl, prompt, cache_frames, t_len, keep_oldest)
    rows = None if slots is None else torch.cat([slots, slots + slot_count])
    copy, move = _frame_copies(att)

    def write_cnn(i: int, new_cnn: torch.Tensor) -> None:
        if rows is None:
            cnn[i].copy_(new_cnn)
        else:
            cnn[i].index_copy_(1, rows, new_cnn.to(cnn.dtype))

    precision = _fused_route(estimator, att.device, dtype if mu2.dtype == dtype else None, fused, t_len)
    if precision is not None:
        in_place = rows is None and width <= att.shape[4]
        scratch = None if in_place else att.new_empty(att.shape[1], 2 * n_slots, *att.shape[3:4], width, att.shape[5])

        def step_caches(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            cnn_in = cnn[i] if rows is None else cnn[i].index_select(1, rows)
            if in_place:
                return att[i][:, :, :, :width], cnn_in
            return copy(scratch, att[i], plan.old_frames, None, rows), cnn_in

        def after_step(i: int, new_cnn: torch.Tensor, _) -> None:
            write_cnn(i, new_cnn)
            if not in_place:
                move(att[i], scratch, plan.write_back, rows)

        x = _solve_steps_fused(estimator, x, mu2, spks2, cond2, vl2, cl2, ts, cfg_rate, precision, step_caches,
                               after_step, arena=True, span=span)
        if in_place and commit:  # the trim: every step's cache at once
            flat = att.flatten(0, 1)
            move(flat, flat, plan.moves)
    else:
        old = att.new_zeros(att.shape[1], 2 * n_slots, att.shape[3], cache_frames, att.shape[5])

        def old_caches(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            return copy(old, att[i], plan.old_by_key, None, rows), cnn[i] if rows is None else cnn[i].index_select(1, rows)

        def write_keyed(i: int, new_cnn: torch.Tensor, new_att: torch.Tensor) -> None:
            write_cnn(i, new_cnn)
            copy(att[i], new_att.contiguous(), plan.new_cache_keys, rows)

        x = _solve_steps_reference(estimator, x, mu2, spks2, cond2, vl2, cl2, ts, cfg_rate, fused, old_caches,
                                   write_keyed, span=span)
    if not commit:
        return x, plan.new_lengths
    kept = plan.new_frame_keys.shape[1]
    if slots is None:
        frame_keys[:, :kept].copy_(plan.new_frame_keys)
    else:
        frame_keys[:, :kept].index_copy_(0, slots, plan.new_frame_keys)
    return x, plan.new_lengths


# Modulation tables of a schedule per packed weights, (n, 1, depth+1, 9, C), keyed by the id of
# the PackedDiT and dropped with it (a repack after a parameter change is a new object); filled
# only outside CUDA-graph capture, so a cached table never lives in a graph's private pool.
_SCHEDULE_TABLES: dict[int, tuple[weakref.ref, dict]] = {}


def _fused_route(estimator: nn.Module, device: torch.device, dtype: Optional[torch.dtype], fused: Optional[bool],
                 t_len: int) -> Optional[str]:
    """The fused-body precision ("tf32" | "ieee" | "" for 16-bit) when the solve may run the
    estimator as the fused body directly (a torch_cfm DiT, policy says fused, not tracing), else None.
    ``dtype``: the arena's, None when the staged inputs are in another dtype (reference route)."""
    if dtype is None or not isinstance(estimator, DiT) or t_len == 0 or torch.compiler.is_compiling():
        return None
    if torch.is_autocast_enabled(device.type) or estimator.in_proj.weight.dtype != dtype:
        return None  # forward_chunk would compute in another dtype than the arena's
    decision = policy.decide(device, dtype, fused=fused)
    if not decision.fused:
        return None
    return decision.precision or ""


def schedule_tables(packed: PackedDiT, n_steps: int) -> torch.Tensor:
    """Modulation tables (n, 1, depth+1, 9, C) of the cosine schedule's times t_0..t_{n-1}."""
    ts = cosine_timesteps(n_steps, torch.float64)
    return torch.stack([modulation_table(packed, ts[i:i + 1].to(packed.device)) for i in range(n_steps)])


def _schedule_tables(packed: PackedDiT, n_steps: int, precision: str) -> torch.Tensor:
    """:func:`schedule_tables`, cached per packed weights (never filled under capture)."""
    key = (n_steps, precision)
    entry = _SCHEDULE_TABLES.get(id(packed))
    if entry is not None and entry[0]() is packed and key in entry[1]:
        return entry[1][key]
    scope = (policy.tf32_scope(precision == "tf32") if packed.dtype == torch.float32 and packed.device.type == "cuda"
             else contextlib.nullcontext())
    with scope:
        tables = schedule_tables(packed, n_steps)
    capturing = packed.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if not capturing:
        if entry is None or entry[0]() is not packed:
            entry = (weakref.ref(packed, lambda _, k=id(packed): _SCHEDULE_TABLES.pop(k, None)), {})
            _SCHEDULE_TABLES[id(packed)] = entry
        entry[1][key] = tables
    return tables


def _solve_steps_fused(estimator, x, mu2, spks2, cond2, vl2, cl2, ts, cfg_rate, precision,
                       step_caches, write_back, arena: bool = False,
                       span: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """Euler steps ``span`` (default all n) on the fused body: the schedule's modulation tables
    computed once per weights (not per step), the staged input built once and updated in place by
    one CFG/Euler kernel per step, the outputs allocated once. The Euler state is float32.
    ``arena``: ``step_caches`` gives in-place attention arenas (``dit_body_arena_into``) and
    ``write_back`` gets None for the attention cache. Returns the final x (rows, 80, T) in float32."""
    from ..kernels.dit_body import cfg_euler  # Triton is optional: imported on the first fused solve

    dtype = mu2.dtype
    packed = packed_for(estimator, dtype, mu2.device)
    tables = _schedule_tables(packed, len(ts) - 1, precision)
    prec = precision or None
    staged = stage_input(torch.cat([x, x]), mu2, spks2, cond2, dtype)
    # a copy: x may be the caller's static x0, and cfg_euler updates the state in place (densely)
    x32 = x.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    outs = None
    for i in range(*(span or (0, len(ts) - 1))):
        att_in, cnn_in = step_caches(i)
        if outs is None:
            sizes = check_dit_body(staged, packed.body, tables[i], cnn_in, None if arena else att_in, vl2, cl2,
                                   precision or "auto")
            outs = _empty_outputs(staged, sizes, with_att=not arena)
        if arena:
            vel, new_cnn = dit_body_arena_into(staged, packed.body, tables[i], cnn_in, att_in, vl2, cl2, prec, outs)
            new_att = None
        else:
            vel, new_cnn, new_att = dit_body_fused_into(staged, packed.body, tables[i], cnn_in, att_in, vl2, cl2,
                                                        prec, outs)
        cfg_euler(x32, vel, staged, ts[i + 1] - ts[i], cfg_rate)
        write_back(i, new_cnn, new_att)
    return x32


class StreamingCFM(nn.Module):
    """Streaming conditional flow matching: the estimator plus the fixed noise (SPEC §3).

    Args:
        estimator: a :class:`~torch_cfm.models.DiT` (anything with its ``forward_chunk``).
        n_timesteps: Euler steps n (10).
        cfg_rate: classifier-free guidance r (0.7).
        noise: optional (1, 80, F) noise buffer; default drawn once, on CPU in fp32, from
            ``torch.Generator().manual_seed(seed)`` with F = 30000.
        seed: seed of the default noise.
    Attributes:
        noise: the (1, 80, F) buffer (a non-persistent module buffer: moves with ``.to()``).
    Example:
        >>> cfm = StreamingCFM(DiT(DiTConfig(hidden=64, depth=2, heads=4, head_dim=16)).random_init_())
        >>> mel, cnn, att = cfm.forward_chunk(torch.randn(1, 80, 20), torch.randn(1, 80), torch.zeros(1, 80, 20))
        >>> mel.shape, att.shape
        (torch.Size([1, 80, 20]), torch.Size([10, 2, 2, 4, 20, 32]))
    """

    # The serving layer sits above the solver: torch_cfm.models.server sets this when it is
    # imported (importing torch_cfm.models imports it).
    server_class: ClassVar[Optional[type]] = None

    def __init__(self, estimator: nn.Module, n_timesteps: int = _SOLVER.n_timesteps,
                 cfg_rate: float = _SOLVER.cfg_rate, noise: Optional[torch.Tensor] = None, seed: int = 0) -> None:
        super().__init__()
        op = "StreamingCFM"
        if not isinstance(n_timesteps, int) or n_timesteps <= 0:
            fail(op, "n_timesteps", "be a positive int", repr(n_timesteps))
        mel = estimator.config.out_channels if hasattr(estimator, "config") else _SOLVER.mel_channels
        if noise is None:
            gen = torch.Generator().manual_seed(int(seed))
            noise = torch.randn((1, mel, _SOLVER.noise_frames), generator=gen)
        elif not isinstance(noise, torch.Tensor) or noise.dim() != 3 or noise.shape[:2] != (1, mel):
            fail(op, "noise", f"be a tensor of shape (1, {mel}, F)",
                 shape_str(noise) if isinstance(noise, torch.Tensor) else type(noise).__name__)
        self.estimator = estimator
        self.n_timesteps = n_timesteps
        self.cfg_rate = float(cfg_rate)
        self.register_buffer("noise", noise, persistent=False)

    def timesteps(self) -> list[float]:
        """The cosine schedule t_0..t_n as python floats."""
        return euler_timesteps(self.n_timesteps)

    @torch.no_grad()
    def forward_chunk(self, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                      cnn_cache: Optional[torch.Tensor] = None, att_cache: Optional[torch.Tensor] = None,
                      fused: Optional[bool] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Solve one chunk for B requests that share T and L (the upstream call).

        Rows ``[cond × B | uncond × B]``; ``x0 = noise[:, :, o:o+T]`` with o = L (the attention
        cache length), the same for every request; n Euler steps with CFG; step i reads
        ``cnn_cache[i]`` / ``att_cache[i]`` and returns its new caches. No trim here (the caller
        applies :func:`~torch_cfm.models.cache.trim_attention_cache`, or uses the server).
        Solved by :func:`solve_arena_chunk` over a temporary arena of T + L frames that holds
        the given caches (the server's engine: the fused body with a float32 Euler state where
        the policy says fused, else the estimator's ``forward_chunk`` per step); an estimator
        without a ``config`` runs that engine's step loop on the given caches directly.

        Args:
            mu: (B, 80, T); spks: (B, 80); cond: (B, 80, T).
            cnn_cache: (n, depth, 2B, 2C, 2) or None (zero history).
            att_cache: (n, depth, 2B, H, L, 2D) or None (L = 0).
            fused: force (True) / forbid (False) the fused body (None = policy).
        Returns:
            mel (B, 80, T) in mu's dtype, cnn caches (n, depth, 2B, 2C, 2), attention caches
            (n, depth, 2B, H, T+L, 2D) (compute dtype).
        Raises:
            ValueError: bad shapes, or ``L + T`` beyond the noise buffer.
        """
        op = "StreamingCFM.forward_chunk"
        n = self.n_timesteps
        if not isinstance(mu, torch.Tensor) or mu.dim() != 3:
            fail(op, "mu", "be a tensor of shape (B, 80, T)",
                 shape_str(mu) if isinstance(mu, torch.Tensor) else type(mu).__name__)
        batch, _, t_len = mu.shape
        for name, cache in (("cnn_cache", cnn_cache), ("att_cache", att_cache)):
            if cache is None:
                continue
            if not isinstance(cache, torch.Tensor) or cache.dim() not in (5, 6) or cache.shape[0] != n \
                    or cache.shape[2] != 2 * batch:
                layout = "(n, depth, 2B, 2C, 2)" if name == "cnn_cache" else "(n, depth, 2B, H, L, 2D)"
                fail(op, name, f"have shape {layout} with n={n}, 2B={2 * batch}",
                     shape_str(cache) if isinstance(cache, torch.Tensor) else type(cache).__name__)
        offset = 0 if att_cache is None else att_cache.shape[4]
        if offset + t_len > self.noise.shape[2]:
            fail(op, "att_cache", f"leave room in the noise buffer: L + T <= {self.noise.shape[2]}",
                 f"L={offset}, T={t_len}", "trim the cache (trim_attention_cache)")
        dev = mu.device
        x0 = self.noise[:, :, offset:offset + t_len].to(dev).expand(batch, -1, -1)
        cond = torch.zeros_like(mu) if cond is None else cond.to(mu.dtype)
        spks = spks.to(mu.dtype)
        cfg = getattr(self.estimator, "config", None)
        if cfg is None:  # an estimator without a DiTConfig: the engine's step loop on the given caches
            return self._solve_steps_without_arena(mu, spks, cond, x0, cnn_cache, att_cache, fused)
        # A temporary SPEC-layout arena holding the given caches, wide enough for the new ones
        # (T + L frames); the trim threshold lies past every length, so nothing is trimmed.
        cdt = self.estimator.compute_dtype(dev.type) if hasattr(self.estimator, "compute_dtype") else mu.dtype
        rows = 2 * batch
        att = torch.empty((n, cfg.depth, rows, cfg.heads, offset + t_len, 2 * cfg.head_dim), device=dev, dtype=cdt)
        if offset:
            att[..., :offset, :].copy_(att_cache)
        cnn = torch.zeros((n, cfg.depth, rows, 2 * cfg.hidden, cfg.conv_cache_frames), device=dev, dtype=cdt)
        if cnn_cache is not None:
            cnn.copy_(cnn_cache)
        lengths = dict(device=dev, dtype=torch.int32)
        mel = torch.empty_like(mu)
        solve_arena_chunk(self.estimator, att, cnn, self.noise, mu, spks, cond,
                          torch.full((batch,), t_len, **lengths), torch.full((batch,), offset, **lengths),
                          torch.zeros((batch,), **lengths), mel, cache_frames=offset, n_timesteps=n,
                          cfg_rate=self.cfg_rate, keep_oldest=offset + t_len, fused=fused, x0=x0)
        return mel, cnn, att

    def _solve_steps_without_arena(self, mu, spks, cond, x0, cnn_cache, att_cache, fused):
        """The engine's reference step loop on the caller's caches, new caches stacked."""
        zeros = torch.zeros_like(mu)
        cnn_out, att_out = [], []

        def step_caches(i: int):
            return (None if att_cache is None else att_cache[i]), (None if cnn_cache is None else cnn_cache[i])

        def keep(i: int, new_cnn: torch.Tensor, new_att: torch.Tensor) -> None:
            cnn_out.append(new_cnn)
            att_out.append(new_att)

        x = _solve_steps_reference(self.estimator, x0, torch.cat([mu, zeros]), torch.cat([spks, torch.zeros_like(spks)]),
                                   torch.cat([cond, zeros]), None, None, self.timesteps(), self.cfg_rate, fused,
                                   step_caches, keep)
        return x, torch.stack(cnn_out), torch.stack(att_out)

    def server(self, **kwargs) -> "CFMServer":  # noqa: F821 - defined in server.py
        """A :class:`~torch_cfm.models.server.CFMServer` over this solver (kwargs forwarded)."""
        return self.server_class(self, **kwargs)

