"""The fused body's tuning table: which kernel runs each role of a body call, per dtype family and rows.

A :class:`BodyPlan` names the kernel of every role of one body call (the QKV GEMM, the attention with
its q/k-norm + cache write, proj, the two conv-tap GEMMs, fc1 + GELU, fc2, the row-norm boundaries,
the QKV GEMM on the in-place arena) and the body kernels launched with programmatic dependent launch.
Plans are named after what they run: "cublas" (cuBLAS GEMMs, Triton row-norm, q/k-cache and
attention kernels), "cublas_warp_rownorm" (the same with one-warp row-norm programs),
"fused_attention" (the q/k norm and cache write fused into the attention kernel; no arena form),
"fused_attention_warp_rownorm" (the same with one-warp row-norm programs, and an arena form: the
attention kernel appends to the arena itself), "cutlass_warp_rownorm" (cublas_warp_rownorm with four of the
GEMMs on the CUTLASS library) and "wgmma" (the GEMMs on the SM90a wgmma kernel).
:data:`TABLE` maps (dtype family, row bucket) to the plan measured fastest there; each plan cites the
bench rows that chose it (``evidence``, resolved by :func:`evidence_rows`).
:func:`torch_cfm.kernels.dit_body.dit_body_triton` reads one plan and nothing else; benches and tests
pass a plan (or a plan's name, or :func:`use_plan` around a path that takes none) to compare others.
Pure data, no Triton import: explain() reads it anywhere.

Adding a plan is one entry: a ``BodyPlan`` constant and its row bucket in :data:`TABLE`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import re
from typing import Iterator, Optional, Union

import torch

from ._evidence import check_pairs, data_rows, one_row

WGMMA_MAX_ROWS = 8  # the wgmma GEMM plans cover bodies of at most this many rows
CUTLASS_MIN_ROWS = 128  # 16-bit arena bodies from this many rows run their GEMMs on the CUTLASS library
ANY_ROWS = 1 << 62  # the upper end of the last row bucket

# The kernels each role can run on (the body driver implements exactly these). arena_qkv: the QKV GEMM
# and q/k-cache work of attention "qk_cache+cfm_attention" on the arena; attention "attention_cache"
# does that work in its own kernel (its APPEND mode), so its plans keep arena_qkv at "qk_cache".
ROLE_KERNELS = {
    "qkv": ("cublas", "wgmma", "cutlass"),
    "attention": ("qk_cache+cfm_attention", "attention_cache"),  # attention_cache: q/k norm, cache, attention
    "proj": ("cublas", "wgmma", "cutlass"),
    "conv": ("cublas", "wgmma", "cutlass"),
    "fc1": ("cublas_gelu", "wgmma_gelu"),
    "fc2": ("cublas", "wgmma_splitk", "cutlass"),  # wgmma_splitk: fp32 partials, summed by the row-norm behind it
    "rownorm": ("triton",),
    "arena_qkv": ("qk_cache", "wgmma_qk_cache"),  # wgmma_qk_cache: the q/k-cache work in the QKV epilogue
}
# The body's own kernels that can launch with PDL ("linear": the wgmma GEMM, whose weight loads before
# the wait are why it exists). cfm_attention keeps its own rule (kernels.cfm_attention.use_pdl).
PDL_CAPABLE_KERNELS = frozenset({"rownorm", "qk_cache", "attention_cache", "cfg_euler", "linear"})

# A bench row id names one torch_cfm row of the step bench's data file: its variant ("table" for the
# table's own plan, variant ""), shape, dtype (fp32 with its dot precision) and run: the row's run_id,
# or for rows written before run ids its UTC timestamp, e.g.
# "dit_step/sweep_arena_rownorm_r1_w1/32x50x400/fp16/20261204T203301Z".
EVIDENCE_DATA = os.path.join("bench", "results", "dit_step.json")
ROW_ID_FORM = "dit_step/<variant>/<N>x<T>x<L>/<fp16|bf16|fp32-tf32|fp32-ieee>/<run id or YYYYMMDDTHHMMSSZ>"
_ROW_ID = re.compile(r"dit_step/(?P<variant>[^/]+)/(?P<shape>\d+x\d+x\d+)/(?P<dtype>fp16|bf16|fp32-tf32|fp32-ieee)/"
                     r"(?P<run>\d{8}T\d{6}Z(?:-[0-9a-f]+)?)$")


@dataclasses.dataclass(frozen=True)
class BodyPlan:
    """The kernel of every role of one fused body call (values: :data:`ROLE_KERNELS`).

    ``pdl``: the body kernels launched with PDL (where the device allows it); ``rownorm_launch``:
    (rows per program, num_warps) of the row-norm kernel, None for its rule; ``fc2_splitk``: (splits, BN)
    of the split-K fc2, None for the dtype's (``dit_linear_cuda.SPLITK_CONFIG``); ``attention_launch``:
    (name, value) pairs in place of ``dit_attention.attention_tiles``' launch parameters (the
    attention_cache kernel); ``fallback``: the plan run where the wgmma kernel cannot (not SM90a, or PDL
    off); ``arena_plan``: the plan run on the in-place arena when this one has no arena form (None: it
    has one); ``cutlass``: the CUTLASS library's config (``kernels.cutlass_gemm``) of the roles on
    "cutlass" (each falls back to cuBLAS call by call where the library cannot run it), None when no
    role is; ``evidence``: the measurement behind it, as (this plan's row, the alternative's row)
    pairs of bench row ids (:func:`row_id`), each pair measured in one run.
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
    cutlass: Optional[str] = None
    evidence: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for role, kernels in ROLE_KERNELS.items():
            if getattr(self, role) not in kernels:
                raise ValueError(f"BodyPlan {self.name!r}: {role} must be one of {kernels}, "
                                 f"got {getattr(self, role)!r}")
        if self.attention == "attention_cache" and self.arena_qkv != "qk_cache":
            raise ValueError(f"BodyPlan {self.name!r}: attention 'attention_cache' appends to the arena itself, "
                             f"so arena_qkv must be 'qk_cache', got {self.arena_qkv!r}")
        if self.uses_cutlass != (self.cutlass is not None):
            raise ValueError(f"BodyPlan {self.name!r}: cutlass names the config of the roles on 'cutlass', so it "
                             f"must be set exactly when one is, got {self.cutlass!r}")
        if not self.pdl <= PDL_CAPABLE_KERNELS:
            raise ValueError(f"BodyPlan {self.name!r}: pdl must be a subset of {sorted(PDL_CAPABLE_KERNELS)}, "
                             f"got {sorted(self.pdl)}")
        check_pairs(f"BodyPlan {self.name!r}", self.evidence, _ROW_ID, ROW_ID_FORM)

    @property
    def uses_wgmma(self) -> bool:
        """Whether any role runs on the SM90a wgmma kernel (:mod:`torch_cfm.kernels.dit_linear_cuda`)."""
        return "wgmma" in (self.qkv, self.proj, self.conv) or self.fc1 == "wgmma_gelu" \
            or self.fc2 == "wgmma_splitk" or self.arena_qkv == "wgmma_qk_cache"

    @property
    def uses_cutlass(self) -> bool:
        """Whether any role runs on the CUTLASS library (:mod:`torch_cfm.kernels.cutlass_gemm`)."""
        return "cutlass" in (self.qkv, self.proj, self.conv, self.fc2)

    def roles(self) -> str:
        """The roles off cuBLAS, for explain()."""
        off = [f"{role}={getattr(self, role)}" for role in ROLE_KERNELS
               if getattr(self, role) != getattr(CUBLAS_16BIT, role)]
        return ", ".join(off) or "cuBLAS GEMMs, Triton row-norm and q/k-cache kernels"


# Evidence pairs: (a row of the plan, a row of the alternative it was chosen over), both of one run of
# bench/results/dit_step.json (ids: :func:`row_id`, quoting each row's variant as the data file spells it).
# cuBLAS GEMMs with Triton row-norm, q/k-cache and attention kernels: where the wgmma GEMMs lose
CUBLAS_16BIT = BodyPlan(
    "cublas",
    evidence=(("dit_step/v1/32x50x400/fp16/20261203T040904Z", "dit_step/v9/32x50x400/fp16/20261203T040904Z"),
              ("dit_step/sweep_v1_pdl_none/32x50x400/fp16/20261202T173730Z",
               "dit_step/sweep_v9_pdl_linear_rownorm_qk/32x50x400/fp16/20261202T173730Z")))
# TF32 / IEEE bodies: the row-norm and Euler kernels under PDL; the fused attention + cache kernel loses in fp32
CUBLAS_FP32 = dataclasses.replace(
    CUBLAS_16BIT, pdl=frozenset({"rownorm", "cfg_euler"}),
    evidence=(("dit_step/sweep_v1_pdl_rownorm/8x50x400/fp32-tf32/20261201T062427Z",
               "dit_step/sweep_v1_pdl_none/8x50x400/fp32-tf32/20261201T062427Z"),
              ("dit_step/sweep_v1_pdl_rownorm/32x50x400/fp32-tf32/20261201T062427Z",
               "dit_step/sweep_v1_pdl_none/32x50x400/fp32-tf32/20261201T062427Z"),
              ("dit_step/sweep_v1_pdl_rownorm/8x50x400/fp32-tf32/20261201T062427Z",
               "dit_step/sweep_v5_pdl_rownorm/8x50x400/fp32-tf32/20261201T062427Z"),
              ("dit_step/sweep_v1_pdl_rownorm/32x50x400/fp32-tf32/20261201T062427Z",
               "dit_step/sweep_v5_pdl_rownorm/32x50x400/fp32-tf32/20261201T062427Z")))
# cublas on the in-place arena of >= 32 rows: one 512-channel row per one-warp row-norm program
CUBLAS_WARP_ROWNORM_16BIT = dataclasses.replace(
    CUBLAS_16BIT, name="cublas_warp_rownorm", rownorm_launch=(1, 1),
    evidence=tuple((f"dit_step/sweep_arena_rownorm_r1_w1/{n}x50x400/fp16/20261204T203301Z",
                    f"dit_step/sweep_arena_rownorm_r1_w4/{n}x50x400/fp16/20261204T203301Z") for n in (32, 64, 128)))
# cuBLAS GEMMs, the q/k norm and cache write fused into the attention kernel (kernels.dit_attention)
FUSED_ATTENTION_16BIT = BodyPlan(
    "fused_attention", attention="attention_cache", arena_plan=CUBLAS_WARP_ROWNORM_16BIT,
    evidence=(("dit_step/sweep_v5_pdl_none/32x50x400/fp16/20261201T062427Z",
               "dit_step/sweep_v1_pdl_rownorm/32x50x400/fp16/20261201T062427Z"),
              ("dit_step/sweep_v5_body_pdl_off/32x50x400/fp16/20261201T052125Z",
               "dit_step/sweep_v1_body_pdl_off/32x50x400/fp16/20261201T052125Z"),
              ("dit_step/sweep_v5_l2_off/32x50x400/fp16/20261202T134007Z",
               "dit_step/sweep_v1_l2_off/32x50x400/fp16/20261202T134007Z")))
# fused_attention with cublas_warp_rownorm's row-norm launch and an arena form (the attention kernel's
# APPEND mode: q/k norm, the arena append and attention in one launch per block), for A/B runs against
# cublas_warp_rownorm on the arena: no bucket picks it (not measured yet)
FUSED_ATTENTION_WARP_ROWNORM_16BIT = dataclasses.replace(
    FUSED_ATTENTION_16BIT, name="fused_attention_warp_rownorm", rownorm_launch=(1, 1), arena_plan=None, evidence=())
# cublas_warp_rownorm with qkv, proj, the conv taps and fc2 on the CUTLASS library's persistent ping-pong
# 128 x 128 kernel (fc1 + GELU stays on cuBLASLt, faster there); each role falls back to cuBLAS call by call
# where the library cannot run (cutlass_gemm.not_supported_reasons)
CUTLASS_WARP_ROWNORM_16BIT = dataclasses.replace(
    CUBLAS_WARP_ROWNORM_16BIT, name="cutlass_warp_rownorm", qkv="cutlass", proj="cutlass", conv="cutlass",
    fc2="cutlass", cutlass="pingpong_128x128",
    evidence=tuple((f"dit_step/sweep_arena_cutlass_warp_rownorm/{n}x50x400/{d}/20261208T011714Z-cacdc2",
                    f"dit_step/sweep_arena_cublas_warp_rownorm/{n}x50x400/{d}/20261208T011714Z-cacdc2")
                   for n in (128, 256) for d in ("fp16", "bf16")))
# fused_attention whose arena form is cutlass_warp_rownorm: the 16-bit plan from CUTLASS_MIN_ROWS rows
FUSED_ATTENTION_CUTLASS_16BIT = dataclasses.replace(
    FUSED_ATTENTION_16BIT, arena_plan=CUTLASS_WARP_ROWNORM_16BIT)
# fp32 form for A/B runs only: no bucket picks it (CUBLAS_FP32's evidence has it slower)
FUSED_ATTENTION_FP32 = dataclasses.replace(FUSED_ATTENTION_16BIT, pdl=CUBLAS_FP32.pdl, arena_plan=CUBLAS_FP32,
                                           evidence=())
# qkv, proj, the conv GEMMs and the MLP on the SM90a wgmma kernel (fc2 split-K), loading weights under PDL
WGMMA_16BIT = BodyPlan(
    "wgmma", qkv="wgmma", proj="wgmma", conv="wgmma", fc1="wgmma_gelu", fc2="wgmma_splitk", arena_qkv="wgmma_qk_cache",
    pdl=frozenset({"linear", "rownorm", "qk_cache"}), fallback=CUBLAS_16BIT,
    evidence=(("dit_step/sweep_v9_pdl_linear_rownorm_qk/8x50x400/fp16/20261202T175202Z",
               "dit_step/sweep_v1_pdl_none/8x50x400/fp16/20261202T175202Z"),
              ("dit_step/sweep_arena_v9_qkv_cache_on/8x50x400/fp16/20261203T040823Z",
               "dit_step/sweep_arena_v9_qkv_cache_off/8x50x400/fp16/20261203T040823Z"),
              ("dit_step/sweep_arena_v9_qkv_cache_on/8x50x400/fp16/20261203T040823Z",
               "dit_step/sweep_arena_v1/8x50x400/fp16/20261203T040823Z")))
# TF32: the q/k-cache epilogue of the arena's QKV GEMM loses there, so the arena keeps the q/k-cache kernel
WGMMA_TF32 = dataclasses.replace(
    WGMMA_16BIT, arena_qkv="qk_cache", fallback=CUBLAS_FP32,
    evidence=(("dit_step/sweep_tf32_v9_mlp/8x50x400/fp32-tf32/20261203T072215Z",
               "dit_step/sweep_tf32_v1/8x50x400/fp32-tf32/20261203T072215Z"),
              ("dit_step/sweep_tf32_arena_v9_mlp/8x50x400/fp32-tf32/20261203T072215Z",
               "dit_step/sweep_tf32_arena_v9_mlp_qkv_cache/8x50x400/fp32-tf32/20261203T072215Z"),
              ("dit_step/sweep_tf32_arena_v9_mlp/8x50x400/fp32-tf32/20261203T072215Z",
               "dit_step/sweep_tf32_arena_v1/8x50x400/fp32-tf32/20261203T072215Z")))

# (dtype family) -> ((first row, last row, plan), ...): the buckets cover 0 .. ANY_ROWS
TABLE: dict[str, tuple[tuple[int, int, BodyPlan], ...]] = {
    "fp16": ((0, WGMMA_MAX_ROWS, WGMMA_16BIT), (WGMMA_MAX_ROWS + 1, 31, CUBLAS_16BIT),
             (32, CUTLASS_MIN_ROWS - 1, FUSED_ATTENTION_16BIT),
             (CUTLASS_MIN_ROWS, ANY_ROWS, FUSED_ATTENTION_CUTLASS_16BIT)),
    "bf16": ((0, WGMMA_MAX_ROWS, WGMMA_16BIT), (WGMMA_MAX_ROWS + 1, 31, CUBLAS_16BIT),
             (32, CUTLASS_MIN_ROWS - 1, FUSED_ATTENTION_16BIT),
             (CUTLASS_MIN_ROWS, ANY_ROWS, FUSED_ATTENTION_CUTLASS_16BIT)),
    "tf32": ((0, WGMMA_MAX_ROWS, WGMMA_TF32), (WGMMA_MAX_ROWS + 1, ANY_ROWS, CUBLAS_FP32)),
    "ieee": ((0, ANY_ROWS, CUBLAS_FP32),),
}
# The plan of a family when the rows are not known
UNKNOWN_ROWS = {"fp16": CUBLAS_16BIT, "bf16": CUBLAS_16BIT, "tf32": CUBLAS_FP32, "ieee": CUBLAS_FP32}
# Plans by name per family, for benches and tests comparing plans the table does not pick there
NAMED = {
    "fp16": {"cublas": CUBLAS_16BIT, "fused_attention": FUSED_ATTENTION_16BIT, "wgmma": WGMMA_16BIT,
             "fused_attention_warp_rownorm": FUSED_ATTENTION_WARP_ROWNORM_16BIT,
             "cutlass_warp_rownorm": CUTLASS_WARP_ROWNORM_16BIT},
    "bf16": {"cublas": CUBLAS_16BIT, "fused_attention": FUSED_ATTENTION_16BIT, "wgmma": WGMMA_16BIT,
             "fused_attention_warp_rownorm": FUSED_ATTENTION_WARP_ROWNORM_16BIT,
             "cutlass_warp_rownorm": CUTLASS_WARP_ROWNORM_16BIT},
    "tf32": {"cublas": CUBLAS_FP32, "fused_attention": FUSED_ATTENTION_FP32, "wgmma": WGMMA_TF32},
    "ieee": {"cublas": CUBLAS_FP32, "fused_attention": FUSED_ATTENTION_FP32},
}
PLAN_NAMES = ("cublas", "fused_attention", "wgmma")


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
    """The table in one line per family, e.g. "fp16: 0-8 wgmma, 9-31 cublas, 32-127 fused_attention (arena
    cublas_warp_rownorm), 128+ ..." (for explain())."""
    def span(lo: int, hi: int) -> str:
        return f"{lo}+" if hi == ANY_ROWS else f"{lo}-{hi}"

    def plan_text(p: BodyPlan) -> str:
        return p.name + (f" (arena {p.arena_plan.name})" if p.arena_plan is not None else "")

    return "; ".join(f"{fam}: " + ", ".join(f"{span(lo, hi)} {plan_text(p)}" for lo, hi, p in entries)
                     for fam, entries in TABLE.items())


def wgmma_roles() -> str:
    """The roles of the wgmma plans, for explain()."""
    return f"16-bit: {WGMMA_16BIT.roles()}; TF32: {WGMMA_TF32.roles()}"


# --- evidence: bench row ids ------------------------------------------------------------------------

def _run_stamp(timestamp: str) -> str:
    """An ISO timestamp as the compact UTC form of row ids and run ids: YYYYMMDDTHHMMSSZ."""
    stamp = datetime.datetime.fromisoformat(timestamp)
    if stamp.tzinfo is not None:
        stamp = stamp.astimezone(datetime.timezone.utc)
    return stamp.strftime("%Y%m%dT%H%M%SZ")


def row_id(row: dict) -> str:
    """The id of a ``dit_step`` data row (:data:`ROW_ID_FORM`)."""
    shape = row["shape"]
    dtype = row["dtype"] + (f"-{row['precision']}" if row.get("precision") else "")
    run = row.get("run_id") or _run_stamp(row["timestamp"])
    return f"dit_step/{row.get('variant') or 'table'}/{shape['N']}x{shape['T']}x{shape['L']}/{dtype}/{run}"


def _matches(row: dict, fields: dict) -> bool:
    if row.get("op") != "dit_step" or row.get("provider") != "torch_cfm":
        return False
    shape = row.get("shape") or {}
    dtype = str(row.get("dtype")) + (f"-{row['precision']}" if row.get("precision") else "")
    runs = {row.get("run_id")} | ({_run_stamp(row["timestamp"])} if row.get("timestamp") else set())
    return ((row.get("variant") or "table") == fields["variant"] and dtype == fields["dtype"]
            and f"{shape.get('N')}x{shape.get('T')}x{shape.get('L')}" == fields["shape"] and fields["run"] in runs)


def find_row(rows: list[dict], rid: str) -> dict:
    """The one row of ``rows`` that ``rid`` names; ValueError when it names none or several."""
    return one_row(rows, rid, _ROW_ID, ROW_ID_FORM, _matches)


def evidence_rows(plan: BodyPlan, path: Optional[str] = None) -> list[dict]:
    """The rows ``plan.evidence`` names, two per pair (the plan's, then the alternative's).

    ``path``: the data file; default :data:`EVIDENCE_DATA` of the source tree (an installed package
    without the repository has none: FileNotFoundError). ValueError when an id names no row or several.
    """
    rows = data_rows(EVIDENCE_DATA, path)
    return [find_row(rows, rid) for pair in plan.evidence for rid in pair]
