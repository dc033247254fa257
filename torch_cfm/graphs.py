"""Whole-solve CUDA graphs: one graph per bucket replays a complete n-step CFG chunk solve.

A chunk solve (SPEC §3) for B requests is n Euler steps, each one fused body call on 2B rows
(``[cond rows x B | uncond rows x B]``) followed by the CFG combine and the Euler update. Here
the whole solve (staging x into both halves, n fused bodies writing every step's caches, n
CFG/Euler updates, the final cast) is captured once per (batch bucket, chunk-length bucket,
cache-length bucket) and replayed; ragged requests are padded into the bucket and described by
per-row lengths only (padding rows get length 0).

Contract (what a server needs):

* :class:`SolveBuffers` — the static arena of one bucket: ``staged`` (2B, Cin, T) compute dtype
  (mu | spks | cond already written for the cond half, zeros for the uncond half; the x part is
  written by the solve), ``x0`` (B, 80, T) float32 initial noise (read only; the Euler state
  ``x`` is re-initialised from it by every solve, so a solve is idempotent), ``cnn_in``
  (n, depth, 2B, 2C, 2) conv caches of the previous chunk, ``valid`` / ``cached`` (2B,) int32
  lengths, the outputs ``cnn_out``, ``mel`` (B, 80, T), and the attention caches in one of two forms:

  - in place (the default): ``att`` (n, depth, 2B, H, L+T, 2D). Row r's L_r old keys sit at frames
    [0, L_r) in reversed key order (:func:`torch_cfm.models.cache.reverse_keys`); each step's body
    appends its T_r current keys behind them and copies no old frame, so after the solve frames
    [0, T_r + L_r) hold the new cache (SPEC §2), reversed. Half the bytes of the other form, and no
    per-step copy of the old frames.
  - functional (``variant`` given, for A/B and the other kernel variants): ``att_in``
    (n, depth, 2B, H, L, 2D) read, ``att_out`` (n, depth, 2B, H, T+L, 2D) written newest-first.

  A server may keep its request state directly in these buffers (zero copy) or let
  :meth:`CFMGraphRunner.solve` copy in and out (it converts between the layouts).
* :func:`solve_chunk_into` — the eager function that is captured: reads only the buffers, writes
  only the buffers (plus graph-pool workspace); no host sync.
* :class:`CFMGraphRunner` — buckets, capture, LRU budget, fallback to the eager fused path with
  a logged reason. Replay equals :func:`solve_chunk_into` run eagerly, bitwise.
* :class:`ArenaGraphSolver` — the same capture/LRU/fallback machinery wrapped around the model
  server's :func:`torch_cfm.models.solver.solve_arena_chunk` (same signature): a drop-in
  ``CFMServer.solve_fn`` (``server.solve_fn = ArenaGraphSolver()``), one graph per static key
  (arena tensors, bucketed T and cache window, slot count).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from . import policy
from .config import cosine_timesteps
from .models.cache import reverse_keys
from .packing import PackedDiT, modulation_table, packed_for

log = logging.getLogger("torch_cfm.graphs")

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16)
DEFAULT_CHUNK_BUCKETS = (25, 50, 56, 64, 100, 128, 150, 200, 300)
DEFAULT_CACHE_BUCKETS = (0, 100, 200, 300, 400, 500, 600, 800, 1024)


@dataclass
class SolveBuffers:
    """The static arena of one bucket (shapes in the module docstring)."""

    staged: torch.Tensor
    x0: torch.Tensor
    x: torch.Tensor
    cnn_in: torch.Tensor
    valid: torch.Tensor
    cached: torch.Tensor
    cnn_out: torch.Tensor
    vel: torch.Tensor
    mel: torch.Tensor
    att: Optional[torch.Tensor] = None       # in place: (n, depth, 2B, H, L+T, 2D), reversed key order
    att_in: Optional[torch.Tensor] = None    # functional: (n, depth, 2B, H, L, 2D)
    att_out: Optional[torch.Tensor] = None   # functional: (n, depth, 2B, H, T+L, 2D)

    @classmethod
    def allocate(cls, packed: PackedDiT, n_steps: int, batch: int, t_len: int, cache_len: int,
                 in_place: bool = True) -> "SolveBuffers":
        dev, cd = packed.device, packed.dtype
        rows, c, depth = 2 * batch, packed.hidden, packed.depth
        h, d2, mel = packed.heads, 2 * packed.head_dim, packed.out_channels

        def z(*shape, dtype=cd):
            return torch.zeros(shape, dtype=dtype, device=dev)

        att = dict(att=z(n_steps, depth, rows, h, cache_len + t_len, d2)) if in_place else dict(
            att_in=z(n_steps, depth, rows, h, cache_len, d2), att_out=z(n_steps, depth, rows, h, t_len + cache_len, d2))
        return cls(staged=z(rows, packed.in_channels, t_len), x0=z(batch, mel, t_len, dtype=torch.float32),
                   x=z(batch, mel, t_len, dtype=torch.float32), cnn_in=z(n_steps, depth, rows, 2 * c, 2),
                   valid=z(rows, dtype=torch.int32), cached=z(rows, dtype=torch.int32),
                   cnn_out=z(n_steps, depth, rows, 2 * c, 2), vel=z(rows, mel, t_len), mel=z(batch, mel, t_len), **att)

    @property
    def batch(self) -> int:
        return self.x.shape[0]

    @property
    def in_place(self) -> bool:
        return self.att is not None

    def arena_bytes(self) -> int:
        """Bytes of the cache arena (attention caches, conv caches in and out)."""
        return sum(t.numel() * t.element_size() for t in (self.att, self.att_in, self.att_out, self.cnn_in,
                                                          self.cnn_out) if t is not None)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values() if t is not None)


def solve_tables(packed: PackedDiT, n_steps: int) -> tuple[torch.Tensor, list[float]]:
    """Modulation tables (n, 1, depth+1, 9, C) for the cosine schedule and the step sizes dt_i."""
    ts = cosine_timesteps(n_steps, torch.float64)
    tables = torch.stack([modulation_table(packed, ts[i:i + 1].to(packed.device)) for i in range(n_steps)])
    dts = [float(ts[i + 1] - ts[i]) for i in range(n_steps)]
    return tables, dts


def solve_chunk_into(packed: PackedDiT, tables: torch.Tensor, dts: Sequence[float], bufs: SolveBuffers,
                     cfg_rate: float, precision: Optional[str], variant: Optional[str] = None) -> None:
    """The complete n-step CFG chunk solve on one arena (eager; this is what gets captured).

    Reads ``bufs.staged`` (mu/spks/cond parts), ``bufs.x0`` (initial noise, float32), the input
    caches and lengths; writes every step i's new caches (in place: ``bufs.att[i]`` frames
    [L_r, L_r + T_r) of each row; functional: ``bufs.att_out[i]``) and ``bufs.cnn_out[i]``, the
    Euler state ``bufs.x``, the x part of ``bufs.staged`` and ``bufs.mel`` (compute dtype).
    Idempotent (running it twice gives the same outputs: the in-place form never overwrites the
    old keys it reads), so warm-up before a capture is harmless. No host sync. ``variant`` applies
    to the functional form only (the in-place form runs v1's kernels).
    """
    from .kernels.dit_body import cfg_euler
    from .ops.dit_body import dit_body_arena_into, dit_body_fused_into

    b, mel_ch = bufs.batch, bufs.x.shape[1]
    bufs.x.copy_(bufs.x0)
    xs = bufs.x0.to(bufs.staged.dtype)
    bufs.staged[:b, :mel_ch].copy_(xs)
    bufs.staged[b:, :mel_ch].copy_(xs)
    for i, dt in enumerate(dts):
        if bufs.in_place:
            dit_body_arena_into(bufs.staged, packed.body, tables[i], bufs.cnn_in[i], bufs.att[i], bufs.valid,
                                bufs.cached, precision, (bufs.vel, bufs.cnn_out[i]))
        else:
            dit_body_fused_into(bufs.staged, packed.body, tables[i], bufs.cnn_in[i], bufs.att_in[i], bufs.valid,
                                bufs.cached, precision, (bufs.vel, bufs.cnn_out[i], bufs.att_out[i]), variant)
        cfg_euler(bufs.x, bufs.vel, bufs.staged, dt, cfg_rate)
    bufs.mel.copy_(bufs.x)


@dataclass
class _Entry:
    key: tuple[int, int, int]
    bufs: SolveBuffers
    graph: Optional["torch.cuda.CUDAGraph"] = None
    failed: Optional[str] = None
    pool_bytes: int = 0
    replays: int = 0
    stats: dict = field(default_factory=dict)


def _bucket(value: int, buckets: Sequence[int]) -> Optional[int]:
    i = bisect.bisect_left(list(buckets), value)
    return buckets[i] if i < len(buckets) else None


class CFMGraphRunner:
    """Captures and replays whole n-step CFG chunk solves of one estimator, per bucket.

    Args:
        model: the DiT estimator (SPEC §1 parameter names).
        dtype: compute dtype (float16 | bfloat16 | float32) of the body and the cache arena.
        device: a CUDA device (graphs); on CPU everything runs eagerly (interpreter/testing).
        n_timesteps, cfg_rate: the solve (SPEC §3).
        batch_buckets, chunk_buckets, cache_buckets: sorted bucket sizes for B requests,
            T frames, L cached frames; a larger shape runs eagerly (reason logged).
        max_graphs: graph budget; the least recently used bucket (graph + arena) is evicted.
        precision: fp32 dots "tf32" | "ieee" (None: torch's TF32 setting at capture time).
        use_graphs: False = always eager fused (same buffers, same kernels).
        variant: None = the in-place attention-cache arena (v1's kernels, no per-step copy of the
            old keys); a kernel variant of the fused body (kernels/dit_body.py) = the functional
            form with that variant (``att_in`` read, ``att_out`` written: the A/B reference).
    """

    def __init__(self, model: torch.nn.Module, *, dtype: torch.dtype, device: torch.device | str,
                 n_timesteps: int = 10, cfg_rate: float = 0.7,
                 batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
                 chunk_buckets: Sequence[int] = DEFAULT_CHUNK_BUCKETS,
                 cache_buckets: Sequence[int] = DEFAULT_CACHE_BUCKETS,
                 max_graphs: int = 8, precision: Optional[str] = None, use_graphs: bool = True,
                 variant: Optional[str] = None) -> None:
        if max_graphs < 1:
            raise ValueError(f"CFMGraphRunner: max_graphs must be >= 1, got {max_graphs}")
        if n_timesteps < 1:
            raise ValueError(f"CFMGraphRunner: n_timesteps must be >= 1, got {n_timesteps}")
        self.model, self.dtype, self.device = model, dtype, torch.device(device)
        self.n_steps, self.cfg_rate = n_timesteps, float(cfg_rate)
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.chunk_buckets = tuple(sorted(chunk_buckets))
        self.cache_buckets = tuple(sorted(cache_buckets))
        self.max_graphs = max_graphs
        self.variant = variant
        self.precision = policy.resolve_precision(dtype, precision or "auto")
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self._entries: "OrderedDict[tuple[int, int, int], _Entry]" = OrderedDict()
        self._packed: Optional[PackedDiT] = None
        self._tables: Optional[torch.Tensor] = None
        self._dts: list[float] = []
        self.events: list[str] = []  # capture/fallback/eviction log (also sent to logging)

    # ------------------------------------------------------------------ state
    def _note(self, msg: str) -> None:
        self.events.append(msg)
        log.info(msg)

    def _refresh(self) -> PackedDiT:
        packed = packed_for(self.model, self.dtype, self.device)
        if packed is not self._packed:
            if self._packed is not None:
                self._note("weights changed: tables recomputed, graphs dropped")
                self._entries.clear()
            self._packed = packed
            with self._tf32():
                self._tables, self._dts = solve_tables(packed, self.n_steps)
        return packed

    def _tf32(self):
        if self.dtype == torch.float32 and self.device.type == "cuda":
            return policy.tf32_scope(self.precision == "tf32")
        return contextlib.nullcontext()

    def bucket_for(self, batch: int, t_len: int, cache_len: int) -> Optional[tuple[int, int, int]]:
        """The (B, T, L) bucket a solve falls into, or None (runs eagerly)."""
        kb, kt, kl = (_bucket(batch, self.batch_buckets), _bucket(t_len, self.chunk_buckets),
                      _bucket(cache_len, self.cache_buckets))
        if kb is None or kt is None or kl is None:
            return None
        return kb, kt, kl

    def entry(self, key: tuple[int, int, int]) -> _Entry:
        """The bucket's arena (allocated on first use; most recently used after this call)."""
        packed = self._refresh()
        ent = self._entries.get(key)
        if ent is None:
            while len(self._entries) >= self.max_graphs:
                old_key, old = self._entries.popitem(last=False)
                self._note(f"evicted bucket {old_key} (LRU, budget {self.max_graphs})")
                del old
            ent = _Entry(key, SolveBuffers.allocate(packed, self.n_steps, *key, in_place=self.variant is None))
            self._entries[key] = ent
        self._entries.move_to_end(key)
        return ent

    @property
    def graphs(self) -> dict[tuple[int, int, int], bool]:
        """Bucket -> captured?"""
        return {k: e.graph is not None for k, e in self._entries.items()}

    # ------------------------------------------------------------------ run
    def run_eager(self, bufs: SolveBuffers) -> None:
        """The solve on ``bufs`` without a graph (same kernels as the replay)."""
        packed = self._refresh()
        with self._tf32(), torch.no_grad():
            solve_chunk_into(packed, self._tables, self._dts, bufs, self.cfg_rate, self.precision, self.variant)

    def _capture(self, ent: _Entry) -> None:
        packed = self._refresh()
        try:
            with self._tf32(), torch.no_grad():
                stream = torch.cuda.Stream(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):  # warm-up: compiles kernels, creates handles
                    solve_chunk_into(packed, self._tables, self._dts, ent.bufs, self.cfg_rate, self.precision, self.variant)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                # torch.cuda.graph() empties the allocator cache on entry: empty it first so the
                # reserved-bytes delta is the graph pool alone
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()
                before = torch.cuda.memory_reserved(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    solve_chunk_into(packed, self._tables, self._dts, ent.bufs, self.cfg_rate, self.precision, self.variant)
                ent.pool_bytes = torch.cuda.memory_reserved(self.device) - before
            ent.graph = graph
            self._note(f"captured bucket {ent.key} ({self.n_steps} steps, {ent.bufs.arena_bytes() / 2**20:.1f} MiB arena)")
        except Exception as exc:  # noqa: BLE001 - any capture failure falls back to eager
            ent.graph, ent.failed = None, f"{type(exc).__name__}: {exc}"
            self._note(f"capture of bucket {ent.key} failed, eager fused instead: {ent.failed}")

    def run(self, ent: _Entry) -> None:
        """Solve on the bucket's buffers: replay its graph (capturing on first use), else eager."""
        if self.use_graphs and ent.graph is None and ent.failed is None:
            self._capture(ent)
        if ent.graph is not None:
            ent.graph.replay()
            ent.replays += 1
        else:
            self.run_eager(ent.bufs)

    def solve(self, mu: torch.Tensor, spks: Optional[torch.Tensor], cond: Optional[torch.Tensor],
              x0: torch.Tensor, att_cache: Optional[torch.Tensor] = None, cnn_cache: Optional[torch.Tensor] = None,
              valid_lengths: Optional[torch.Tensor] = None, cache_lengths: Optional[torch.Tensor] = None,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One chunk solve of B requests, copied into / out of the bucket's arena.

        Args:
            mu, cond: (B, 80, T); spks: (B, 80) (None = zeros); x0: (B, 80, T) initial noise.
            att_cache: (n, depth, 2B, H, L, 2D) or None; cnn_cache: (n, depth, 2B, 2C, 2) or None;
                rows ``[cond x B | uncond x B]``.
            valid_lengths, cache_lengths: optional (B,) int32 per request (default T / L).
        Returns:
            mel (B, 80, T), cnn caches (n, depth, 2B, 2C, 2), att caches (n, depth, 2B, H, T+L, 2D),
            in the compute dtype; request b's valid frames are a prefix as in SPEC §2.
        """
        b, mel_ch, t_len = mu.shape
        cache_len = 0 if att_cache is None else att_cache.shape[4]
        key = self.bucket_for(b, t_len, cache_len)
        if key is None:
            self._note(f"shape B={b} T={t_len} L={cache_len} beyond the largest bucket: eager fused")
            key_eager = (b, t_len, cache_len)
            bufs = SolveBuffers.allocate(self._refresh(), self.n_steps, *key_eager, in_place=self.variant is None)
            ent = None
        else:
            ent = self.entry(key)
            bufs = ent.bufs
        kb = bufs.batch
        with torch.no_grad():
            cd = self.dtype
            bufs.staged.zero_()
            bufs.staged[:b, mel_ch:2 * mel_ch, :t_len].copy_(mu)
            if spks is not None:
                bufs.staged[:b, 2 * mel_ch:3 * mel_ch, :t_len].copy_(spks[:, :, None].expand(-1, -1, t_len))
            if cond is not None:
                bufs.staged[:b, 3 * mel_ch:4 * mel_ch, :t_len].copy_(cond)
            bufs.x0.zero_()
            bufs.x0[:b, :, :t_len].copy_(x0)
            rows = torch.cat([torch.arange(b), kb + torch.arange(b)]).to(self.device)
            lengths_v = (torch.full((b,), t_len, dtype=torch.int32, device=self.device) if valid_lengths is None
                         else valid_lengths.to(device=self.device, dtype=torch.int32).clamp(0, t_len))
            lengths_c = (torch.full((b,), cache_len, dtype=torch.int32, device=self.device) if cache_lengths is None
                         else cache_lengths.to(device=self.device, dtype=torch.int32).clamp(0, cache_len))
            bufs.valid.zero_()
            bufs.cached.zero_()
            bufs.valid[rows] = torch.cat([lengths_v, lengths_v])
            bufs.cached[rows] = torch.cat([lengths_c, lengths_c])
            if att_cache is not None and cache_len:
                if bufs.in_place:  # newest-first -> the arena's reversed key order
                    bufs.att[:, :, rows, :, :cache_len] = reverse_keys(att_cache.to(cd), bufs.cached[rows])
                else:
                    bufs.att_in[:, :, rows, :, :cache_len] = att_cache.to(cd)
            if cnn_cache is not None:
                bufs.cnn_in.zero_()
                bufs.cnn_in[:, :, rows] = cnn_cache.to(cd)
            else:
                bufs.cnn_in.zero_()
            if ent is not None:
                self.run(ent)
            else:
                self.run_eager(bufs)
            mel = bufs.mel[:b, :, :t_len].clone()
            if bufs.in_place:  # back to newest-first, zeros past each row's T_r + L_r frames
                att = reverse_keys(bufs.att[:, :, rows, :, :t_len + cache_len], bufs.valid[rows] + bufs.cached[rows])
            else:
                att = bufs.att_out[:, :, rows, :, :t_len + cache_len]
            cnn = bufs.cnn_out[:, :, rows]
        return mel, cnn, att


def _sig(t: Optional[torch.Tensor]) -> Optional[tuple]:
    if t is None:
        return None
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


def _meta(t: Optional[torch.Tensor]) -> Optional[tuple]:
    if t is None:
        return None
    return (tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


@dataclass
class _Captured:
    graph: Optional["torch.cuda.CUDAGraph"]
    inputs: dict  # name -> static read-only tensor the graph reads
    failed: Optional[str] = None
    eager_calls: int = 0
    replays: int = 0


class ArenaGraphSolver:
    """A CUDA-graph wrapper with :func:`~torch_cfm.models.solver.solve_arena_chunk`'s signature.

    Plug into the model server: ``server.solve_fn = ArenaGraphSolver()``. Per static key (the
    in-place arena tensors by identity — ``att``, ``cnn``, ``cache_lengths``, ``out_mel``,
    ``frame_keys`` —, the shapes of the read-only inputs, the python ints, the estimator and its
    packed weights) the first ``warmup`` calls run eagerly (they are real solves: no state is
    touched twice), the next call captures (capture runs nothing) and replays; later calls copy
    read-only inputs whose
    storage changed (e.g. a fresh ``slots`` tensor) into the captured ones and replay. A capture
    failure is logged and that key stays eager. At most ``max_graphs`` keys keep a graph (LRU).
    On CPU everything runs eagerly.

    Args:
        solve_fn: the solve to capture (default ``solve_arena_chunk``).
        max_graphs: graph budget (LRU eviction).
        warmup: eager calls per key before capturing (>= 1: compiles kernels, creates handles).
    """

    READ_ONLY = ("noise", "mu", "spks", "cond", "valid_lengths", "prompt_lengths", "slots")

    def __init__(self, solve_fn=None, *, max_graphs: int = 8, warmup: int = 1) -> None:
        if max_graphs < 1:
            raise ValueError(f"ArenaGraphSolver: max_graphs must be >= 1, got {max_graphs}")
        if warmup < 1:
            raise ValueError(f"ArenaGraphSolver: warmup must be >= 1, got {warmup}")
        if solve_fn is None:
            from .models.solver import solve_arena_chunk as solve_fn
        self.solve_fn = solve_fn
        self.max_graphs, self.warmup = max_graphs, warmup
        self._keys: "OrderedDict[tuple, _Captured]" = OrderedDict()
        self.events: list[str] = []

    def _note(self, msg: str) -> None:
        self.events.append(msg)
        log.info(msg)

    @staticmethod
    def _weights_key(estimator, dtype, device):
        try:
            return id(packed_for(estimator, dtype, device))
        except (ValueError, TypeError, AttributeError):
            return None

    def __call__(self, estimator, att, cnn, noise, mu, spks, cond, valid_lengths, cache_lengths, prompt_lengths,
                 out_mel, *, cache_frames: int, n_timesteps: int = 10, cfg_rate: float = 0.7,
                 keep_oldest: int = 100, fused: Optional[bool] = None, slots: Optional[torch.Tensor] = None,
                 frame_keys: Optional[torch.Tensor] = None) -> None:
        kwargs = dict(cache_frames=cache_frames, n_timesteps=n_timesteps, cfg_rate=cfg_rate, keep_oldest=keep_oldest,
                      fused=fused)
        read = dict(noise=noise, mu=mu, spks=spks, cond=cond, valid_lengths=valid_lengths,
                    prompt_lengths=prompt_lengths, slots=slots)

        def eager(inputs):
            self.solve_fn(estimator, att, cnn, inputs["noise"], inputs["mu"], inputs["spks"], inputs["cond"],
                          inputs["valid_lengths"], cache_lengths, inputs["prompt_lengths"], out_mel,
                          slots=inputs["slots"], frame_keys=frame_keys, **kwargs)

        if att.device.type != "cuda":
            return eager(read)
        key = (id(estimator), self._weights_key(estimator, att.dtype, att.device),
               _sig(att), _sig(cnn), _sig(cache_lengths), _sig(out_mel), _sig(frame_keys),
               tuple((k, _meta(v)) for k, v in read.items()), tuple(sorted(kwargs.items(), key=lambda kv: kv[0])),
               torch.backends.cuda.matmul.allow_tf32)
        ent = self._keys.get(key)
        if ent is None:
            while len(self._keys) >= self.max_graphs:
                old_key, _ = self._keys.popitem(last=False)
                self._note(f"evicted a solve graph (LRU, budget {self.max_graphs})")
            ent = _Captured(graph=None, inputs={})
            self._keys[key] = ent
        self._keys.move_to_end(key)
        if ent.graph is None:
            if ent.failed is not None or ent.eager_calls < self.warmup:
                ent.eager_calls += 1
                return eager(read)
            static = {k: (None if v is None else v.clone()) for k, v in read.items()}
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    eager(static)
            except Exception as exc:  # noqa: BLE001 - any capture failure falls back to eager
                ent.failed = f"{type(exc).__name__}: {exc}"
                self._note(f"solve capture failed, eager instead: {ent.failed}")
                return eager(read)
            ent.graph, ent.inputs = graph, static
            self._note(f"captured a solve graph (T={mu.shape[2]}, cache_frames={cache_frames}, "
                       f"slots={None if slots is None else slots.shape[0]})")
        for k, v in read.items():
            if v is not None and v.data_ptr() != ent.inputs[k].data_ptr():
                ent.inputs[k].copy_(v)
        ent.graph.replay()
        ent.replays += 1
        return None


__all__ = ["ArenaGraphSolver", "CFMGraphRunner", "SolveBuffers", "solve_chunk_into", "solve_tables"]
