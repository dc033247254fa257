"""Hypothesis strategies and case builders shared by the property, numerics and failure tests.

A drawn *spec* (plain Python numbers, cheap to shrink) is turned into tensors by ``build_*`` on a
given device and dtype, so the same spec runs on CPU and CUDA with identical layouts:

* shapes: N >= 1, H, Q (1, odd, block multiples +-1), K = 0..640 (block multiples +-1 and >= 600),
  D in {16, 32, 64, 128};
* strides: k/v as the two halves of an interleaved (.., K, 2D) cache, q as a transposed
  (N, Q, H, D) buffer, masks expanded with stride 0 over N or over Q;
* lengths: per row 0, 1, K or random (``edge_lengths``); out-of-range ones for failure tests;
* kv_rows: permutations of a pool or random rows with repeats;
* dtypes {fp32, fp16, bf16} and TF32 policies {torch flag on/off, env override, explicit precision}.

``CASES`` counts how many examples each property ran; ``tests/conftest.py`` prints it at the end.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
from dataclasses import dataclass, field, replace
from typing import Iterator, Optional, Sequence

import torch
from hypothesis import settings
from hypothesis import strategies as st

from torch_cfm.config import ATTENTION_HEAD_DIMS

CASES: collections.Counter = collections.Counter()


def tried(name: str) -> None:
    """Count one example of property ``name`` (printed by conftest's terminal summary)."""
    CASES[name] += 1


def gpu_settings() -> settings:
    """Settings of the CUDA variants: a fifth of the profile's examples (>= 6). Each new shape or
    stride pattern costs a Triton JIT compile on the GPU, so the CUDA runs stay within minutes
    (ci profile: 10 examples per property, gpu profile: 40)."""
    return settings(max_examples=max(6, settings.default.max_examples // 5))


DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCKS = (16, 32, 64, 128)
# Key counts around every block size the kernels may use, plus long caches (K >= 600).
EDGE_KEYS = tuple(sorted({0, 1, 2} | {b + d for b in BLOCKS for d in (-1, 0, 1)} | {600, 601, 640}))
EDGE_QUERIES = (1, 2, 3, 7, 15, 16, 17, 31, 32, 33, 50)
MAX_QUERY_ROWS = 160  # N*H*Q cap: the fp64 oracle loops over query rows in Python
MASK_MODES = ("none", "dense", "expand_n", "expand_q")
LENGTH_MODES = ("none", "edge", "random")
POOL_MODES = ("none", "permutation", "repeats")


@dataclass(frozen=True)
class AttnSpec:
    """Everything that defines one ``cfm_attention`` call, in plain numbers.

    lengths: per-row key lengths (None = no key_lengths); may be out of [0, K] in failure tests.
    kv_rows / pool: pool row of each query row and the pool size R (None = no kv_rows).
    mask_mode: "none" | "dense" (N, Q, K) | "expand_n" ((1, Q, K) expanded over N) |
        "expand_q" ((N, 1, K) expanded over Q). ``dead_queries`` get an all-False mask row.
    kv_interleaved: k = cache[..., :D], v = cache[..., D:] of one (rows, H, K, 2D) buffer.
    q_transposed: q is a (N, Q, H, D) buffer transposed to (N, H, Q, D).
    """

    n: int
    h: int
    q_len: int
    k_len: int
    d: int
    seed: int
    scale: float = 1.0
    lengths: Optional[tuple[int, ...]] = None
    kv_rows: Optional[tuple[int, ...]] = None
    pool: Optional[int] = None
    mask_mode: str = "none"
    mask_density: float = 0.7
    dead_queries: tuple[int, ...] = ()
    kv_interleaved: bool = False
    q_transposed: bool = False

    @property
    def kv_count(self) -> int:
        return self.n if self.pool is None else self.pool

    def describe(self) -> str:
        parts = [f"N{self.n} H{self.h} Q{self.q_len} K{self.k_len} D{self.d}"]
        if self.lengths is not None:
            parts.append(f"len={list(self.lengths)}")
        if self.kv_rows is not None:
            parts.append(f"kv_rows={list(self.kv_rows)}/R{self.pool}")
        if self.mask_mode != "none":
            parts.append(f"mask={self.mask_mode}")
        if self.kv_interleaved:
            parts.append("kv-interleaved")
        if self.q_transposed:
            parts.append("q-transposed")
        return " ".join(parts)


@dataclass
class AttnCase:
    """Tensors of one call, built from an :class:`AttnSpec` on one device in one dtype."""

    spec: AttnSpec
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    key_lengths: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None
    kv_rows: Optional[torch.Tensor] = None
    extra: dict = field(default_factory=dict)

    def kwargs(self) -> dict:
        return dict(key_lengths=self.key_lengths, mask=self.mask, kv_rows=self.kv_rows)

    def args(self, precision: str = "auto") -> tuple:
        """Positional arguments of ``torch.ops.torch_cfm.cfm_attention``."""
        return (self.q, self.k, self.v, self.key_lengths, self.mask, self.kv_rows, precision)


# ---------------------------------------------------------------------------------------------
# strategies
# ---------------------------------------------------------------------------------------------

head_dims = st.sampled_from(ATTENTION_HEAD_DIMS)
dtypes = st.sampled_from(DTYPES)
key_counts = st.one_of(st.sampled_from(EDGE_KEYS), st.integers(0, 700))
query_counts = st.one_of(st.sampled_from(EDGE_QUERIES), st.integers(1, 70))


def edge_lengths(k_len: int) -> st.SearchStrategy[int]:
    """One row's key length: 0, 1, K or anything in [0, K]."""
    return st.one_of(st.sampled_from(sorted({0, min(1, k_len), k_len})), st.integers(0, k_len))


def wild_lengths(k_len: int) -> st.SearchStrategy[int]:
    """Lengths a caller may pass by mistake: negative, > K, int32 extremes (documented: clamped)."""
    return st.sampled_from([-(2**31), -7, -1, k_len + 1, k_len + 1000, 2**31 - 1])


@st.composite
def attention_specs(
    draw,
    *,
    n_max: int = 4,
    k_values: Optional[st.SearchStrategy[int]] = None,
    d_values: Optional[st.SearchStrategy[int]] = None,
    lengths: bool = True,
    masks: bool = True,
    pools: bool = True,
    layouts: bool = True,
    min_k: int = 0,
) -> AttnSpec:
    """A valid ``cfm_attention`` spec exercising shapes, strides, lengths, masks and kv_rows."""
    n = draw(st.integers(1, n_max))
    h = draw(st.integers(1, 3))
    d = draw(d_values if d_values is not None else head_dims)
    k_len = max(min_k, draw(k_values if k_values is not None else key_counts))
    q_len = max(1, min(draw(query_counts), MAX_QUERY_ROWS // (n * h)))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([0.5, 1.0, 2.0]))

    row_lengths = None
    length_mode = draw(st.sampled_from(LENGTH_MODES)) if lengths else "none"
    if length_mode == "edge":
        row_lengths = tuple(draw(st.lists(edge_lengths(k_len), min_size=n, max_size=n)))
    elif length_mode == "random":
        row_lengths = tuple(draw(st.lists(st.integers(0, k_len), min_size=n, max_size=n)))

    kv_rows, pool = None, None
    pool_mode = draw(st.sampled_from(POOL_MODES)) if pools else "none"
    if pool_mode == "permutation":
        pool = n + draw(st.integers(0, 2))
        kv_rows = tuple(draw(st.permutations(range(pool)))[:n])
    elif pool_mode == "repeats":
        pool = draw(st.integers(1, n + 1))
        kv_rows = tuple(draw(st.lists(st.integers(0, pool - 1), min_size=n, max_size=n)))

    mask_mode = draw(st.sampled_from(MASK_MODES)) if masks else "none"
    density = draw(st.sampled_from([0.3, 0.7, 0.95])) if mask_mode != "none" else 0.7
    dead: tuple[int, ...] = ()
    if mask_mode in ("dense", "expand_n") and q_len > 1:
        dead = tuple(sorted(set(draw(st.lists(st.integers(0, q_len - 1), max_size=2)))))

    interleaved = draw(st.booleans()) if layouts else False
    transposed = draw(st.booleans()) if layouts else False
    return AttnSpec(n, h, q_len, k_len, d, seed, scale, row_lengths, kv_rows, pool, mask_mode,
                    density, dead, interleaved, transposed)


@dataclass(frozen=True)
class TF32Policy:
    """One way a user sets fp32 dot precision for ``cfm_attention`` (docs/design.md §4/§5).

    torch_flag: ``torch.backends.cuda.matmul.allow_tf32`` during the call.
    env: value of ``TORCH_CFM_TF32`` (None = unset).
    precision: the op's explicit ``precision`` argument ("auto" = follow env, then torch flag).
    """

    name: str
    torch_flag: bool
    env: Optional[str]
    precision: str

    def expected(self) -> str:
        """The fp32 dot precision the SPEC prescribes: explicit argument > env > torch flag."""
        if self.precision != "auto":
            return self.precision
        if self.env is not None:
            return "tf32" if self.env in ("on", "1", "true") else "ieee"
        return "tf32" if self.torch_flag else "ieee"

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Set the torch flag and the env var for the duration; restore both afterwards."""
        saved_flag = torch.backends.cuda.matmul.allow_tf32
        saved_env = os.environ.get("TORCH_CFM_TF32")
        torch.backends.cuda.matmul.allow_tf32 = self.torch_flag
        if self.env is None:
            os.environ.pop("TORCH_CFM_TF32", None)
        else:
            os.environ["TORCH_CFM_TF32"] = self.env
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32 = saved_flag
            if saved_env is None:
                os.environ.pop("TORCH_CFM_TF32", None)
            else:
                os.environ["TORCH_CFM_TF32"] = saved_env


TF32_POLICIES = (
    TF32Policy("torch-on", True, None, "auto"),
    TF32Policy("torch-off", False, None, "auto"),
    TF32Policy("env-on-over-torch-off", False, "on", "auto"),
    TF32Policy("env-off-over-torch-on", True, "off", "auto"),
    TF32Policy("explicit-tf32", False, None, "tf32"),
    TF32Policy("explicit-ieee", True, None, "ieee"),
    TF32Policy("explicit-ieee-over-env-on", True, "on", "ieee"),
    TF32Policy("explicit-tf32-over-env-off", False, "off", "tf32"),
)
tf32_policies = st.sampled_from(TF32_POLICIES)


# ---------------------------------------------------------------------------------------------
# builders
# ---------------------------------------------------------------------------------------------

def _randn(gen: torch.Generator, shape: Sequence[int], scale: float) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale


@dataclass
class Logical:
    """Values of one call before layout: q (N, H, Q, D), k/v (R, H, K, D), mask base, ints."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask_base: Optional[torch.Tensor] = None  # (N|1, Q|1, K) bool, expanded by ``arrange``
    lengths: Optional[list[int]] = None
    kv_rows: Optional[list[int]] = None


def logical_values(spec: AttnSpec) -> Logical:
    """The fp32 CPU values of ``spec`` (deterministic in ``spec.seed``)."""
    gen = torch.Generator().manual_seed(spec.seed)
    n, h, q_len, k_len, d, rows = spec.n, spec.h, spec.q_len, spec.k_len, spec.d, spec.kv_count
    q = _randn(gen, (n, h, q_len, d), spec.scale)
    k = _randn(gen, (rows, h, k_len, d), spec.scale)
    v = _randn(gen, (rows, h, k_len, d), spec.scale)
    mask_base = None
    if spec.mask_mode != "none":
        shape = {"expand_n": (1, q_len, k_len), "expand_q": (n, 1, k_len)}.get(
            spec.mask_mode, (n, q_len, k_len))
        mask_base = torch.rand(*shape, generator=gen) < spec.mask_density
        for i in spec.dead_queries:
            mask_base[:, i, :] = False
    return Logical(q, k, v, mask_base,
                   None if spec.lengths is None else list(spec.lengths),
                   None if spec.kv_rows is None else list(spec.kv_rows))


def arrange(spec: AttnSpec, values: Logical, device: torch.device | str = "cpu",
            dtype: torch.dtype = torch.float32) -> AttnCase:
    """Lay ``values`` out on ``device`` in ``dtype`` with the strides ``spec`` asks for.

    The row counts come from ``values`` (so callers may add rows); the layout flags from spec.
    """
    device = torch.device(device)
    n, h, q_len, d = values.q.shape
    rows, _, k_len, _ = values.k.shape
    if spec.q_transposed:
        q = torch.empty(n, q_len, h, d, dtype=dtype, device=device).transpose(1, 2)
        q.copy_(values.q)
    else:
        q = values.q.to(dtype).to(device)
    if spec.kv_interleaved:
        cache = torch.empty(rows, h, k_len, 2 * d, dtype=dtype, device=device)
        k, v = cache[..., :d], cache[..., d:]
        k.copy_(values.k)
        v.copy_(values.v)
    else:
        k, v = values.k.to(dtype).to(device), values.v.to(dtype).to(device)
    mask = None
    if values.mask_base is not None:
        mask = values.mask_base.to(device).expand(n, q_len, k_len)
    key_lengths = None
    if values.lengths is not None:
        key_lengths = torch.tensor(values.lengths, dtype=torch.int32, device=device)
    kv_rows = None
    if values.kv_rows is not None:
        kv_rows = torch.tensor(values.kv_rows, dtype=torch.int32, device=device)
    return AttnCase(spec, q, k, v, key_lengths, mask, kv_rows)


def build_attention(spec: AttnSpec, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32) -> AttnCase:
    """Materialise ``spec`` on ``device`` in ``dtype`` (layouts made on the device, not copied)."""
    return arrange(spec, logical_values(spec), device, dtype)


def clamp_spec_lengths(spec: AttnSpec) -> AttnSpec:
    """The spec with lengths clamped to [0, K] (the documented meaning of out-of-range lengths)."""
    if spec.lengths is None:
        return spec
    return replace(spec, lengths=tuple(min(max(x, 0), spec.k_len) for x in spec.lengths))


def valid_keys(case: AttnCase) -> torch.Tensor:
    """(N, Q, K) bool on CPU: the keys each query may attend to (lengths clamped, mask ANDed)."""
    n, _, q_len, _ = case.q.shape
    k_len = case.k.shape[2]
    keep = torch.ones(n, q_len, k_len, dtype=torch.bool)
    if case.key_lengths is not None:
        lengths = case.key_lengths.cpu().long().clamp(0, k_len)
        keep &= (torch.arange(k_len)[None, None, :] < lengths[:, None, None])
    if case.mask is not None:
        keep &= case.mask.cpu()
    return keep


def tf32_operand(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) as a TF32 dot operand: the 13 low mantissa bits cleared (truncation, what
    Triton's TF32 dots do on Hopper, triton-lang/triton#4574; cuBLAS rounds, which is closer)."""
    bits = x.contiguous().view(torch.int32) & -8192  # 0xFFFFE000
    return bits.view(torch.float32)


def attention_same_dtype(case: AttnCase, tf32: bool = False) -> torch.Tensor:
    """docs/design.md §6 baseline: the attention math run in the inputs' dtype (dense, written here).

    ``tf32`` (float32 inputs): TF32 math emulated exactly where a TF32 kernel loses precision —
    both dots take TF32 operands (q, k, the probabilities and v truncated to 10 mantissa bits)
    and accumulate in float64, softmax in float32 — instead of asking cuBLAS for TF32, which
    runs small problems in IEEE FP32. Fully masked queries give 0.
    """
    q, k, v = case.q, case.k, case.v
    if case.kv_rows is not None:
        rows = case.kv_rows.long().clamp(0, k.shape[0] - 1)
        k, v = k[rows], v[rows]
    if k.shape[2] == 0:
        return torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    keep = valid_keys(case).to(q.device)[:, None]
    emulate = tf32 and q.dtype == torch.float32

    def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if emulate:
            return torch.matmul(tf32_operand(a).double(), tf32_operand(b).double()).float()
        return torch.matmul(a, b)

    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        scores = dot(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
        scores = scores.masked_fill(~keep, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        probs = torch.where(keep.any(-1, keepdim=True), probs, torch.zeros((), dtype=q.dtype,
                                                                           device=q.device))
        return dot(probs, v)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def poison_allocator(device: torch.device | str, nbytes: int) -> None:
    """Fill ``nbytes`` of freshly freed memory with NaN so an output that reuses it and leaves
    elements unwritten shows NaN (reliable with the CUDA caching allocator, best effort on CPU)."""
    junk = torch.full((max(nbytes // 4, 1) + 64,), float("nan"), device=device)
    del junk


def out_nbytes(case: AttnCase) -> int:
    return case.q.numel() * case.q.element_size()


# ---------------------------------------------------------------------------------------------
# estimator chunks (tiny DiT configs)
# ---------------------------------------------------------------------------------------------

def tiny_configs():
    """Tiny DiT configs: (C, depth, H, D) small enough for the fp64 loop oracle."""
    from torch_cfm.config import DiTConfig

    return (DiTConfig(hidden=32, depth=2, heads=2, head_dim=16),
            DiTConfig(hidden=64, depth=1, heads=4, head_dim=16),
            DiTConfig(hidden=32, depth=1, heads=1, head_dim=32))


@dataclass(frozen=True)
class ChunkSpec:
    """One ``forward_chunk`` call in plain numbers.

    valid / cached: per-row T_n / L_n (None = argument omitted, i.e. T / L for every row).
    att: "none" (no attention cache, L = 0), "dense" or "arena" (a window [.., :L, :] of a
    longer (.., L + 3, 2D) buffer, so its strides are not contiguous).
    """

    cfg: int
    n: int
    t_len: int
    l_len: int
    seed: int
    valid: Optional[tuple[int, ...]] = None
    cached: Optional[tuple[int, ...]] = None
    cnn: bool = True
    att: str = "dense"
    scalar_t: bool = False
    spks: bool = True
    cond: bool = True

    def describe(self) -> str:
        return (f"cfg{self.cfg} N{self.n} T{self.t_len} L{self.l_len} valid={self.valid} "
                f"cached={self.cached} cnn={self.cnn} att={self.att} scalar_t={self.scalar_t}")


@st.composite
def chunk_specs(draw, *, n_max: int = 4, cfgs: Sequence[int] = (0, 1, 2)) -> ChunkSpec:
    """A valid streaming chunk: N>=1, T 1..9, L 0..12, ragged lengths (0, 1, full, random)."""
    cfg = draw(st.sampled_from(list(cfgs)))
    n = draw(st.integers(1, n_max))
    t_len = draw(st.one_of(st.just(1), st.integers(1, 9)))
    att = draw(st.sampled_from(["none", "dense", "arena"]))
    l_len = 0 if att == "none" else draw(st.one_of(st.just(0), st.integers(0, 12)))

    def lengths(limit: int) -> Optional[tuple[int, ...]]:
        if not draw(st.booleans()):
            return None
        one = st.one_of(st.sampled_from(sorted({0, min(1, limit), limit})), st.integers(0, limit))
        return tuple(draw(st.lists(one, min_size=n, max_size=n)))

    valid = lengths(t_len)
    cached = lengths(l_len) if att != "none" else None
    return ChunkSpec(cfg, n, t_len, l_len, draw(st.integers(0, 2**31 - 1)), valid, cached,
                     draw(st.booleans()), att, draw(st.booleans()), draw(st.booleans()), draw(st.booleans()))


def build_chunk(spec: ChunkSpec, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> dict:
    """Keyword inputs of ``DiT.forward_chunk`` for ``spec`` (values drawn in fp32 on CPU)."""
    cfg = tiny_configs()[spec.cfg]
    gen = torch.Generator().manual_seed(spec.seed)
    n, t_len, l_len = spec.n, spec.t_len, spec.l_len

    def r(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    x, mu = r(n, 80, t_len), r(n, 80, t_len)
    t = torch.rand(1 if spec.scalar_t else n, generator=gen).to(device)
    t = t[0] if spec.scalar_t else t
    spks = r(n, 80) if spec.spks else None
    cond = r(n, 80, t_len) if spec.cond else None
    cnn = r(cfg.depth, n, 2 * cfg.hidden, 2) if spec.cnn else None
    att = None
    if spec.att == "dense":
        att = r(cfg.depth, n, cfg.heads, l_len, 2 * cfg.head_dim)
    elif spec.att == "arena":
        att = r(cfg.depth, n, cfg.heads, l_len + 3, 2 * cfg.head_dim)[:, :, :, :l_len]

    def lengths(values):
        return None if values is None else torch.tensor(values, dtype=torch.int32, device=device)

    return dict(x=x, mu=mu, t=t, spks=spks, cond=cond, cnn_cache=cnn, att_cache=att,
                valid_lengths=lengths(spec.valid), cache_lengths=lengths(spec.cached))


def chunk_row_lengths(spec: ChunkSpec) -> list[tuple[int, int]]:
    """(T_n, L_n) of every row."""
    valid = spec.valid if spec.valid is not None else (spec.t_len,) * spec.n
    cached = spec.cached if spec.cached is not None else (spec.l_len,) * spec.n
    return list(zip(valid, cached))


def capture_cuda_graph(fn):
    """Warm up on a side stream, then capture ``fn`` into a CUDA graph; returns (graph, output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def poisoned_arena(att: Optional[torch.Tensor], valid: Optional[torch.Tensor], cached: Optional[torch.Tensor],
                   shape: Sequence[int], t_len: int, dtype: torch.dtype, device: torch.device | str
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs of the body's in-place arena form (``dit_body_arena_into``) from a newest-first cache.

    ``shape`` = (depth, N, H, L + T, 2D). Returns (arena, valid, cached): lengths defaulted to T / L
    and clamped; the arena holds row n's first L_n old keys reversed at frames [0, L_n) and NaN
    everywhere else, so any frame the body reads or leaves unwritten by mistake shows up."""
    from torch_cfm.models.cache import reverse_keys

    depth, n, heads, frames, width = shape
    l_len = frames - t_len
    full = lambda v, k: torch.full((n,), k, dtype=torch.int32, device=device) if v is None else v  # noqa: E731
    valid, cached = full(valid, t_len).clamp(0, t_len), full(cached, l_len).clamp(0, l_len)
    arena = torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)
    if att is not None and l_len:
        keep = (torch.arange(l_len, device=device)[None, :] < cached[:, None]).view(1, n, 1, l_len, 1)
        arena[..., :l_len, :] = torch.where(keep, reverse_keys(att, cached), float("nan"))
    return arena, valid, cached
