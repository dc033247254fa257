"""The vocoder convolution's tuning table: the launch tiles of each layer shape, measured, with a rule
for the shapes no measurement covers.

:func:`conv_tiles` is what :func:`torch_cfm.kernels.vocoder_conv.conv_fused_triton` launches with. A
layer's key (:func:`layer_key`) holds only what is fixed by the layer and the chunk length (operand
family, C_in, C_out, taps, phases, and whether a phase has at least 256 output frames), never the batch:
a stream's waveform must not depend on how many streams share its tick (the kernel's bitwise batch
invariance, ``vocoder_conv``'s docstring). :data:`TABLE` maps keys to the tiles measured fastest by
``bench/vocoder_tiles.py``; each entry cites its rows (``evidence``: (chosen, the rule's) pairs of row
ids, :func:`row_id`, both of one run). A key not in the table gets :func:`rule_tiles`.

Pure data, no Triton import.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Optional

import torch

from ._evidence import check_pairs, data_rows, one_row

LONG_PHASE = 256  # output frames per phase from which the rule takes 128-frame tiles

EVIDENCE_DATA = os.path.join("bench", "results", "vocoder_tiles.json")
ROW_ID_FORM = "vocoder_tiles/<variant>/<C_in>x<C_out>x<taps>x<phases>x<short|long>/<ieee|tf32|fp16|bf16>/<run id>"
_ROW_ID = re.compile(r"vocoder_tiles/(?P<variant>m\d+n\d+k\d+w\d+s\d+)/(?P<layer>\d+x\d+x\d+x\d+x(?:short|long))/"
                     r"(?P<dtype>ieee|tf32|fp16|bf16)/(?P<run>\d{8}T\d{6}Z(?:-[0-9a-f]+)?)$")


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


@dataclasses.dataclass(frozen=True)
class ConvTiles:
    """Launch parameters of one fused convolution: BLOCK_M output frames of one phase of one batch row
    x BLOCK_N output channels per program, BLOCK_K input channels per reduction step, ``warps`` warps,
    ``stages`` software-pipelining stages of the reduction loop. ``evidence``: (row id of these tiles,
    row id of the rule's) pairs, each pair from one run of ``bench/vocoder_tiles.py``."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int = 3
    evidence: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for name, lo, hi in (("block_m", 16, 256), ("block_n", 16, 256), ("block_k", 16, 128), ("warps", 1, 16)):
            v = getattr(self, name)
            if not (isinstance(v, int) and _pow2(v) and lo <= v <= hi):
                raise ValueError(f"ConvTiles: {name} must be a power of 2 in [{lo}, {hi}], got {v!r}")
        if not (isinstance(self.stages, int) and 1 <= self.stages <= 6):
            raise ValueError(f"ConvTiles: stages must be an int in [1, 6], got {self.stages!r}")
        check_pairs("ConvTiles", self.evidence, _ROW_ID, ROW_ID_FORM)

    @property
    def name(self) -> str:
        """The bench variant of these tiles, e.g. ``m128n64k32w4s3``."""
        return f"m{self.block_m}n{self.block_n}k{self.block_k}w{self.warps}s{self.stages}"

    @classmethod
    def parse(cls, name: str) -> "ConvTiles":
        """The tiles a :attr:`name` spells (ValueError for anything else)."""
        m = re.fullmatch(r"m(\d+)n(\d+)k(\d+)w(\d+)s(\d+)", name)
        if m is None:
            raise ValueError(f"ConvTiles.parse: name must look like m128n64k32w4s3, got {name!r}")
        return cls(*(int(v) for v in m.groups()))


def family(weight_dtype: torch.dtype, dot: str) -> str:
    """The operand family of a launch: "fp16" / "bf16" for 16-bit weights, else the float32 ``dot``."""
    if weight_dtype == torch.float16:
        return "fp16"
    if weight_dtype == torch.bfloat16:
        return "bf16"
    if dot not in ("ieee", "tf32"):
        raise ValueError(f"vocoder_tiles.family: dot must be 'ieee' or 'tf32' for float32 weights, got {dot!r}")
    return dot


def layer_key(fam: str, c_in: int, c_out: int, taps: int, phases: int, q: int) -> tuple:
    """(family, C_in, C_out, taps, phases, "long" | "short"): a phase is long from LONG_PHASE output
    frames (``q``). Nothing here depends on the batch."""
    return (fam, c_in, c_out, taps, phases, "long" if q >= LONG_PHASE else "short")


def layer_text(key: tuple) -> str:
    """The row-id spelling of a key's layer part: ``<C_in>x<C_out>x<taps>x<phases>x<short|long>``."""
    return "x".join(str(v) for v in key[1:])


def channel_block(channels: int, cap: int) -> int:
    """A tile's channel extent: ``channels`` rounded up to a power of 2, at least 16, at most ``cap``."""
    return min(cap, max(16, 1 << max(0, (channels - 1).bit_length())))


def rule_tiles(key: tuple) -> ConvTiles:
    """The tiles of a key no measurement covers: BLOCK_N the channel count up to 128, BLOCK_K 32 for
    float32 operands and 64 for 16-bit ones (at most C_in rounded up to a power of 2), 128-frame tiles
    on long phases, 8 warps for 128 x 128 tiles."""
    fam, c_in, c_out, _, _, length = key
    block_n = channel_block(c_out, 128)
    block_k = channel_block(c_in, 32 if fam in ("ieee", "tf32") else 64)
    block_m = 128 if length == "long" else 64
    return ConvTiles(block_m, block_n, block_k, 8 if block_m * block_n >= 128 * 128 else 4)


def _measured(fam: str, layer: str, chosen: str, rule: str, run: str) -> tuple[tuple, ConvTiles]:
    """A table entry: ``chosen`` tiles on the key (``fam``, ``layer`` in row-id spelling), with the run's
    rows of the chosen and the rule's tiles as evidence."""
    c_in, c_out, taps, phases, length = layer.split("x")
    key = (fam, int(c_in), int(c_out), int(taps), int(phases), length)
    ids = tuple(f"vocoder_tiles/{name}/{layer}/{fam}/{run}" for name in (chosen, rule))
    return key, dataclasses.replace(ConvTiles.parse(chosen), evidence=(ids,))


# Keys where bench/vocoder_tiles.py measured tiles beating the rule by more than 3 % (H100, 64 streams x
# 58 frames; rows in EVIDENCE_DATA): (family, layer, chosen tiles, the rule's tiles). Long phases with
# short reductions (3-7 taps at 64 channels, 3 at 128) gain from 64 x 64 tiles (more programs per SM);
# TF32 at C = 256 and the 11-tap C = 128 key from 64-channel reduction steps. Other keys measured the
# rule fastest.
TABLE: dict[tuple, ConvTiles] = dict(_measured(*entry, run="20261207T193744Z-7d15f0") for entry in (
    ("tf32", "18x64x1x1xlong", "m128n64k32w8s3", "m128n64k32w4s3"),
    ("tf32", "18x128x6x1xlong", "m64n64k32w4s3", "m128n128k32w8s3"),
    ("tf32", "64x64x3x1xlong", "m64n64k32w4s3", "m128n64k32w4s3"),
    ("tf32", "64x64x7x1xlong", "m64n64k32w4s3", "m128n64k32w4s3"),
    ("tf32", "128x128x3x1xlong", "m64n64k32w4s3", "m128n128k32w8s3"),
    ("tf32", "128x128x7x1xlong", "m128n64k32w4s4", "m128n128k32w8s3"),
    ("tf32", "128x128x11x1xlong", "m128n128k64w8s3", "m128n128k32w8s3"),
    ("tf32", "256x256x3x1xlong", "m128n128k64w8s3", "m128n128k32w8s3"),
    ("tf32", "256x256x7x1xlong", "m128n128k64w8s3", "m128n128k32w8s3"),
    ("tf32", "256x256x11x1xlong", "m128n128k64w8s3", "m128n128k32w8s3"),
    ("fp16", "18x64x1x1xlong", "m64n64k32w4s3", "m128n64k32w4s3"),
    ("fp16", "18x128x6x1xlong", "m64n64k32w4s3", "m128n128k32w8s3"),
    ("fp16", "64x64x3x1xlong", "m64n64k32w4s3", "m128n64k64w4s3"),
    ("fp16", "128x128x3x1xlong", "m128n64k64w4s3", "m128n128k64w8s3"),
    ("fp16", "256x256x3x1xlong", "m128n64k64w4s3", "m128n128k64w8s3"),
    ("fp16", "256x256x7x1xlong", "m128n64k64w4s3", "m128n128k64w8s3"),
))


def conv_tiles(key: tuple, table: Optional[dict] = None) -> ConvTiles:
    """The tiles ``key`` launches with: its :data:`TABLE` entry, else :func:`rule_tiles`."""
    found = (TABLE if table is None else table).get(key)
    return found if found is not None else rule_tiles(key)


def row_id(row: dict) -> str:
    """The id of a ``bench/vocoder_tiles.py`` data row (:data:`ROW_ID_FORM`)."""
    s = row["shape"]
    layer = f"{s['c_in']}x{s['c_out']}x{s['taps']}x{s['phases']}x{s['length']}"
    return f"vocoder_tiles/{row['variant']}/{layer}/{row['dtype']}/{row['run_id']}"


def find_row(rows: list[dict], rid: str) -> dict:
    """The one ``vocoder_tiles`` row of ``rows`` that ``rid`` names; ValueError when none or several."""
    def matches(row: dict, _: dict) -> bool:
        return (row.get("op") == "vocoder_tiles" and bool(row.get("run_id")) and bool(row.get("variant"))
                and isinstance(row.get("shape"), dict) and row_id(row) == rid)
    return one_row(rows, rid, _ROW_ID, ROW_ID_FORM, matches)


def evidence_rows(tiles: ConvTiles, path: Optional[str] = None) -> list[dict]:
    """The rows ``tiles.evidence`` names, two per pair (these tiles', then the rule's). ``path``: the
    data file; default :data:`EVIDENCE_DATA` of the source tree (FileNotFoundError without one)."""
    rows = data_rows(EVIDENCE_DATA, path)
    return [find_row(rows, rid) for pair in tiles.evidence for rid in pair]


__all__ = ["ConvTiles", "TABLE", "channel_block", "conv_tiles", "evidence_rows", "family", "find_row", "layer_key",
           "layer_text", "row_id", "rule_tiles"]
