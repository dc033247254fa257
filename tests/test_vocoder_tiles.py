"""The vocoder convolution's tuning table (torch_cfm.kernels.vocoder_tiles): the rule, table lookups,
validation, and the evidence behind every entry (rows of bench/results/vocoder_tiles.json).

The launches themselves, with the rule's tiles and with tiles passed explicitly, are checked against
float64 convolutions in tests/test_vocoder_conv.py."""

from __future__ import annotations

import pytest
import torch

from torch_cfm.kernels import vocoder_tiles as vt
from torch_cfm.kernels.vocoder_conv import launch_key, pack_conv_weight


@pytest.mark.parametrize("key,want", [
    # (family, C_in, C_out, taps, phases, length) -> (BLOCK_M, BLOCK_N, BLOCK_K, warps), from the rule's
    # docstring: N = C_out up to 128, K = 32 (float32) / 64 (16-bit) up to C_in, M = 128 on long phases,
    # 8 warps for 128 x 128 tiles
    (("tf32", 512, 256, 2, 8, "short"), (64, 128, 32, 4)),     # the first upsampling
    (("tf32", 256, 256, 11, 1, "long"), (128, 128, 32, 8)),    # a stage-0 ResBlock
    (("fp16", 64, 64, 11, 1, "long"), (128, 64, 64, 4)),       # a stage-2 ResBlock
    (("ieee", 80, 512, 7, 1, "short"), (64, 128, 32, 4)),      # conv_pre
    (("bf16", 18, 18, 7, 1, "long"), (128, 32, 32, 4)),        # 18 channels: N and K rounded up to 32
    (("tf32", 1, 1, 1, 1, "short"), (64, 16, 16, 4)),          # the smallest tile
])
def test_rule_tiles(key, want):
    t = vt.rule_tiles(key)
    assert (t.block_m, t.block_n, t.block_k, t.warps, t.stages) == want + (3,)
    assert vt.conv_tiles(key, table={}) == t


def test_launch_key_of_a_packed_convolution():
    """family from the weights and the dot, taps and phases from the packing, the phase length from q."""
    up = pack_conv_weight(torch.zeros(512, 256, 16), None, transposed=True, stride=8, padding=4, dilation=1,
                          output_padding=0, dtype=torch.float16, tf32=False)
    assert launch_key(up, 255, "tf32") == ("fp16", 512, 256, 2, 8, "short")
    res = pack_conv_weight(torch.zeros(64, 64, 11), None, transposed=False, stride=1, padding=25, dilation=5,
                           output_padding=0, dtype=torch.float32, tf32=True)
    assert launch_key(res, 256, "tf32") == ("tf32", 64, 64, 11, 1, "long")
    assert launch_key(res, 256, "ieee")[0] == "ieee"
    with pytest.raises(ValueError, match="dot"):
        launch_key(res, 256, None)


def test_a_table_entry_is_taken_for_its_key_only():
    key = ("tf32", 64, 64, 11, 1, "long")
    mine = vt.ConvTiles(256, 64, 32, 8, 4)
    assert vt.conv_tiles(key, table={key: mine}) is mine
    other = ("tf32", 64, 64, 11, 1, "short")
    assert vt.conv_tiles(other, table={key: mine}) == vt.rule_tiles(other)


@pytest.mark.parametrize("args,field", [((48, 64, 32, 4), "block_m"), ((64, 512, 32, 4), "block_n"),
                                        ((64, 64, 8, 4), "block_k"), ((64, 64, 32, 3), "warps"),
                                        ((64, 64, 32, 4, 0), "stages")])
def test_tiles_are_validated(args, field):
    with pytest.raises(ValueError, match=field):
        vt.ConvTiles(*args)


def test_tile_names_round_trip_and_evidence_ids_are_checked():
    t = vt.ConvTiles(128, 64, 32, 4, 4)
    assert t.name == "m128n64k32w4s4" and vt.ConvTiles.parse(t.name) == t
    with pytest.raises(ValueError, match="m128n64k32w4s3"):
        vt.ConvTiles.parse("128x64")
    rid = "vocoder_tiles/m128n64k32w4s4/64x64x11x1xlong/tf32/20261207T010000Z-abc123"
    vt.ConvTiles(128, 64, 32, 4, 4, evidence=((rid, rid.replace("w4s4", "w4s3")),))
    with pytest.raises(ValueError, match="evidence"):
        vt.ConvTiles(128, 64, 32, 4, 4, evidence=(("dit_step/v1/8x50x400/fp16/20261203T040904Z", rid),))


def test_row_ids_name_exactly_one_row():
    row = dict(op="vocoder_tiles", provider="torch_cfm", variant="m128n64k32w4s3", dtype="tf32",
               run_id="20261207T010000Z-abc123",
               shape=dict(c_in=64, c_out=64, taps=11, phases=1, length="long", streams=64, frames=58, calls=9))
    rid = vt.row_id(row)
    assert rid == "vocoder_tiles/m128n64k32w4s3/64x64x11x1xlong/tf32/20261207T010000Z-abc123"
    assert vt.find_row([row, dict(row, dtype="fp16")], rid) is row
    with pytest.raises(ValueError, match="2 rows"):
        vt.find_row([row, dict(row)], rid)
    with pytest.raises(ValueError, match="form"):
        vt.find_row([row], "vocoder_tiles/table/64x64/tf32/x")


@pytest.mark.parametrize("key", sorted(vt.TABLE, key=repr) or [None])
def test_table_entries_cite_rows_where_they_beat_the_rule(key):
    """Each entry's evidence resolves to rows of one run, the entry's tiles on its key measured faster
    than the rule's (an empty table has nothing to cite)."""
    if key is None:
        assert vt.TABLE == {}
        return
    tiles = vt.TABLE[key]
    assert tiles.evidence, key
    rows = vt.evidence_rows(tiles)
    for chosen, rule in zip(rows[::2], rows[1::2]):
        assert chosen["run_id"] == rule["run_id"] and chosen["dtype"] == rule["dtype"] == key[0]
        assert chosen["variant"] == tiles.name and rule["rule"] and rule["variant"] == vt.rule_tiles(key).name
        assert (chosen["shape"]["c_in"], chosen["shape"]["c_out"], chosen["shape"]["taps"],
                chosen["shape"]["phases"], chosen["shape"]["length"]) == key[1:]
        assert chosen["us_p50"] < rule["us_p50"]
