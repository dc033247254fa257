"""The fused body's tuning table: which kernel runs each role of a body call, per dtype family and rows.

A :class:`BodyPlan` names the kernel of every role of one body call (the QKV GEMM, the attention with
its q/k-norm + cache write, proj, the two conv-tap GEMMs, fc1 + GELU, fc2, the row-norm boundaries,
the QKV GEMM on the in-place arena) and the body kernels launched with programmatic dependent launch.
:data:`TABLE` maps (dtype family, row bucket) to the plan measured fastest there; each plan carries the
bench result that chose it (``evidence``). :func:`torch_cfm.kernels.dit_body.dit_body_triton` reads one
plan and nothing else; benches and tests pass a plan (or a plan's name, or :func:`use_plan` around a
path that takes none) to compare others. Pure data, no Triton import: explain() reads it anywhere.

Adding a plan is one entry: a ``BodyPlan`` constant and its row bucket in :data:`TABLE`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Optional, Union

import torch

WGMMA_MAX_ROWS = 8  # the wgmma GEMM plans cover bodies of at most this many rows
ANY_ROWS = 1 << 62  # the upper end of the last row bucket

# The kernels each role can run on (the body driver implements exactly these)
ROLE_KERNELS = {
    "qkv": ("cublas", "wgmma"),
    "attention": ("qk_cache+cfm_attention", "attention_cache"),  # attention_cache: q/k norm, cache, attention
    "proj": ("cublas", "wgmma"),
    "conv": ("cublas", "wgmma"),
    "fc1": ("cublas_gelu", "wgmma_gelu"),
    "fc2": ("cublas", "wgmma_splitk"),  # wgmma_splitk: fp32 partials, summed by the row-norm behind it
    "rownorm": ("triton",),
    "arena_qkv": ("qk_cache", "wgmma_qk_cache"),  # wgmma_qk_cache: the q/k-cache work in the QKV epilogue
}
# The body's own kernels that can launch with PDL ("linear": the wgmma GEMM, whose weight loads before
# the wait are why it exists). cfm_attention keeps its own rule (kernels.cfm_attention.use_pdl).
PDL_CAPABLE_KERNELS = frozenset({"rownorm", "qk_cache", "attention_cache", "cfg_euler", "linear"})


@dataclasses.dataclass(frozen=True)
class BodyPlan:
    """The kernel of every role of one fused body call (values: :data:`ROLE_KERNELS`).

    ``pdl``: the body kernels launched with PDL (where the device allows it); ``rownorm_launch``:
    (rows per program, num_warps) of the row-norm kernel, None for its rule; ``fc2_splitk``: (splits, BN)
    of the split-K fc2, None for the dtype's (``dit_linear_cuda.SPLITK_CONFIG``); ``attention_launch``:
    (name, value) pairs in place of ``dit_attention.attention_tiles``' launch parameters (the
    attention_cache kernel); ``fallback``: the plan run where the wgmma kernel cannot (not SM90a, or PDL
    off); ``arena_plan``: the plan run on the in-place arena when this one has no arena form (None: it
    has one); ``evidence``: the measurement behind it.
    """

    name: str
    qkv: str = "cublas"
    attention: str = "qk_cache+cfm_attention"
    proj: str = "cublas"
    conv: str = "cublas"
    fc1: str = "cublas_gelu"
    fc2: str = "cublas"
    rownorm: str = "triton"
    arena_qkv: str = "qk_cache"
    pdl: frozenset = frozenset()
    rownorm_launch: Optional[tuple[int, int]] = None
    fc2_splitk: Optional[tuple[int, int]] = None
    attention_launch: tuple = ()
    fallback: Optional["BodyPlan"] = None
    arena_plan: Optional["BodyPlan"] = None
    evidence: str = ""

    def __post_init__(self) -> None:
        for role, kernels in ROLE_KERNELS.items():
            if getattr(self, role) not in kernels:
                raise ValueError(f"BodyPlan {self.name!r}: {role} must be one of {kernels}, "
                                 f"got {getattr(self, role)!r}")
        if not self.pdl <= PDL_CAPABLE_KERNELS:
            raise ValueError(f"BodyPlan {self.name!r}: pdl must be a subset of {sorted(PDL_CAPABLE_KERNELS)}, "
                             f"got {sorted(self.pdl)}")

    @property
    def uses_wgmma(self) -> bool:
        """Whether any role runs on the SM90a wgmma kernel (:mod:`torch_cfm.kernels.dit_linear_cuda`)."""
        return "wgmma" in (self.qkv, self.proj, self.conv) or self.fc1 == "wgmma_gelu" \
            or self.fc2 == "wgmma_splitk" or self.arena_qkv == "wgmma_qk_cache"

    def roles(self) -> str:
        """The roles off cuBLAS, for explain()."""
        off = [f"{role}={getattr(self, role)}" for role in ROLE_KERNELS
               if getattr(self, role) != getattr(V1_16BIT, role)]
        return ", ".join(off) or "cuBLAS GEMMs, Triton row-norm and q/k-cache kernels"


# Evidence cites rows of that data file by (N, T, L) dtype, variant and commit.
V1_16BIT = BodyPlan(
    "v1",
    evidence="bench/results/dit_step.json (32,50,400) fp16: v1 1645.5 us vs v9 2286.9 (8a7e8d6); bf16 v1 1726.8 (fee2b65)")
V1_FP32 = dataclasses.replace(
    V1_16BIT, pdl=frozenset({"rownorm", "cfg_euler"}),
    evidence="bench/results/dit_step.json fp32-tf32 (8,50,400): sweep_v1_pdl_rownorm 1567.4 us vs sweep_v1_pdl_none 1625.3; "
             "(32,50,400) 3001.4 vs 3056.7 (d734227); v5 slower for TF32: sweep_v5_pdl_rownorm 1774.1 / 3344.9")
# v1 on the in-place arena of >= 32 rows with one 512-channel row per one-warp row-norm program: 0.2-1.6 %
# faster per step than the rule's four warps at 32-128 rows (fp16 measured; bf16 shares the 16-bit plans)
V1W_16BIT = dataclasses.replace(
    V1_16BIT, name="v1w", rownorm_launch=(1, 1),
    evidence="bench/results/dit_step.json arena (N,50,400) fp16, 3 rounds each: sweep_arena_rownorm_r1_w1 1434.3 / "
             "2313.3 / 3800.5 us vs the rule's sweep_arena_rownorm_r1_w4 1458.3 / 2317.0 / 3844.4 at N = 32 / 64 / 128 "
             "(4b80244)")
V5_16BIT = BodyPlan(
    "v5", attention="attention_cache", arena_plan=V1W_16BIT,
    evidence="bench/results/dit_step.json (32,50,400) fp16: sweep_v5_pdl_none 1528.3 us vs sweep_v1_pdl_rownorm 1682.8 "
             "(d734227); sweep_v5_l2_off 1526.2 vs sweep_v1_l2_off 1635.0 (a867f09)")
V5_FP32 = dataclasses.replace(V5_16BIT, pdl=V1_FP32.pdl, arena_plan=V1_FP32,
                              evidence="bench/results/dit_step.json (A/B only): fp32-tf32 sweep_v5_* 6-11 % over sweep_v1_* (d734227)")
V9_16BIT = BodyPlan(
    "v9", qkv="wgmma", proj="wgmma", conv="wgmma", fc1="wgmma_gelu", fc2="wgmma_splitk", arena_qkv="wgmma_qk_cache",
    pdl=frozenset({"linear", "rownorm", "qk_cache"}), fallback=V1_16BIT,
    evidence="bench/results/dit_step.json (8,50,400) fp16: sweep_v9_pdl_linear_rownorm_qk 821.4 us vs sweep_v1_pdl_none 929.8 "
             "(061791a); arena sweep_arena_v9_qkv_cache_on 730.7 vs _off 734.6 (8a7e8d6)")
V9_TF32 = dataclasses.replace(
    V9_16BIT, arena_qkv="qk_cache", fallback=V1_FP32,
    evidence="bench/results/dit_step.json (8,50,400) fp32-tf32: sweep_tf32_v9_mlp 1415.0 us vs sweep_tf32_v1 1523.2; "
             "arena qkv epilogue sweep_tf32_arena_v9_mlp_qkv_cache 1370.7 vs sweep_tf32_arena_v9_mlp 1347.4 (3f88bc0)")

# (dtype family) -> ((first row, last row, plan), ...): the buckets cover 0 .. ANY_ROWS
TABLE: dict[str, tuple[tuple[int, int, BodyPlan], ...]] = {
    "fp16": ((0, WGMMA_MAX_ROWS, V9_16BIT), (WGMMA_MAX_ROWS + 1, 31, V1_16BIT), (32, ANY_ROWS, V5_16BIT)),
    "bf16": ((0, WGMMA_MAX_ROWS, V9_16BIT), (WGMMA_MAX_ROWS + 1, 31, V1_16BIT), (32, ANY_ROWS, V5_16BIT)),
    "tf32": ((0, WGMMA_MAX_ROWS, V9_TF32), (WGMMA_MAX_ROWS + 1, ANY_ROWS, V1_FP32)),
    "ieee": ((0, ANY_ROWS, V1_FP32),),
}
# The plan of a family when the rows are not known
UNKNOWN_ROWS = {"fp16": V1_16BIT, "bf16": V1_16BIT, "tf32": V1_FP32, "ieee": V1_FP32}
# Plans by name per family, for benches and tests comparing plans the table does not pick there
NAMED = {
    "fp16": {"v1": V1_16BIT, "v5": V5_16BIT, "v9": V9_16BIT},
    "bf16": {"v1": V1_16BIT, "v5": V5_16BIT, "v9": V9_16BIT},
    "tf32": {"v1": V1_FP32, "v5": V5_FP32, "v9": V9_TF32},
    "ieee": {"v1": V1_FP32, "v5": V5_FP32},
}
PLAN_NAMES = ("v1", "v5", "v9")


def family(dtype: torch.dtype, precision: Optional[str]) -> str:
    """The table's dtype family: "fp16", "bf16", or for fp32 its dot precision, "tf32" or "ieee"."""
    if dtype == torch.float16:
        return "fp16"
    if dtype == torch.bfloat16:
        return "bf16"
    return "tf32" if precision == "tf32" else "ieee"


def body_plan(dtype: torch.dtype, precision: Optional[str], n_rows: Optional[int] = None, *,
              arena: bool = False) -> BodyPlan:
    """The table's plan for a body computing in ``dtype`` (fp32: dot ``precision``) over ``n_rows``
    rows (None: the family's plan for unknown rows); ``arena``: the in-place arena form's plan."""
    fam = family(dtype, precision)
    plan = UNKNOWN_ROWS[fam]
    if n_rows is not None:
        plan = next(p for lo, hi, p in TABLE[fam] if lo <= n_rows <= hi)
    if arena and plan.arena_plan is not None:
        plan = plan.arena_plan
    return plan


def choose_variant(dtype: torch.dtype, precision: Optional[str], n_rows: Optional[int] = None) -> str:
    """The name of the table's plan (:func:`body_plan`), for explain() and the benches."""
    return body_plan(dtype, precision, n_rows).name


def named_plan(plan: Union[BodyPlan, str], dtype: torch.dtype, precision: Optional[str]) -> BodyPlan:
    """``plan`` itself, or the plan of that name in the dtype family (:data:`NAMED`)."""
    if isinstance(plan, BodyPlan):
        return plan
    fam = family(dtype, precision)
    if plan not in NAMED[fam]:
        raise ValueError(f"dit_body_triton: plan must be a BodyPlan or one of {sorted(NAMED[fam])} for {fam} "
                         f"bodies, got {plan!r}")
    return NAMED[fam][plan]


def resolve_plan(plan: BodyPlan, *, wgmma: bool) -> BodyPlan:
    """The plan that runs: its ``fallback`` where it needs the wgmma kernel and ``wgmma`` is False."""
    while plan.uses_wgmma and not wgmma and plan.fallback is not None:
        plan = plan.fallback
    return plan


_SCOPED: list = []  # the plans of the enclosing use_plan blocks, innermost last


@contextlib.contextmanager
def use_plan(plan: Union[BodyPlan, str]) -> Iterator[None]:
    """Inside the block, every body call not given a plan runs ``plan`` (a BodyPlan or a plan name) in
    place of the table's: for tests and benches comparing plans through paths that take none (the
    ``torch_cfm::dit_body`` op, the model hook)."""
    _SCOPED.append(plan)
    try:
        yield
    finally:
        _SCOPED.pop()


def scoped_plan() -> Union[BodyPlan, str, None]:
    """The plan of the innermost :func:`use_plan` block (None outside any)."""
    return _SCOPED[-1] if _SCOPED else None


def describe_table() -> str:
    """The table in one line per family, e.g. "fp16: 0-8 v9, 9-31 v1, 32+ v5 (arena v1w)" (for explain())."""
    def span(lo: int, hi: int) -> str:
        return f"{lo}+" if hi == ANY_ROWS else f"{lo}-{hi}"

    def plan_text(p: BodyPlan) -> str:
        return p.name + (f" (arena {p.arena_plan.name})" if p.arena_plan is not None else "")

    return "; ".join(f"{fam}: " + ", ".join(f"{span(lo, hi)} {plan_text(p)}" for lo, hi, p in entries)
                     for fam, entries in TABLE.items())


def wgmma_roles() -> str:
    """The roles of the wgmma plans, for explain()."""
    return f"16-bit: {V9_16BIT.roles()}; TF32: {V9_TF32.roles()}"
