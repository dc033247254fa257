"""torch_cfm.serving.conformer_slots.ConformerSlots: the encoder stage's per-stream cache storage.

Checked directly (the stage's tests check it through whole streams against upstream): a slot per
open stream, reused after a close; a stream's caches are views of its slot, ``length`` frames long;
``write`` and ``scatter`` move exactly the rows they are given (the other slots and the frames past
the written length untouched, bitwise); padding rows go to the spare slot; bad calls raise a
ValueError naming the argument before anything is written.
"""

from __future__ import annotations

import pytest
import torch

from torch_cfm.serving.conformer_slots import ConformerSlots

DEPTH, HEADS, WIDTH, CHANNELS, TAPS = 3, 2, 4, 5, 6


def _slots(count: int = 3, frames: int = 20) -> ConformerSlots:
    return ConformerSlots(count, frames, (DEPTH, HEADS, WIDTH), (CHANNELS, TAPS), (torch.float32, torch.float16),
                          torch.device("cpu"))


def _caches(rows: int, frames: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, CHANNELS, TAPS, generator=g),
            torch.randn(DEPTH, rows, HEADS, frames, WIDTH, generator=g).half())


def test_slots_open_write_view_and_reuse():
    slots = _slots()
    assert slots.att.shape == (DEPTH, 4, HEADS, 20, WIDTH) and slots.cnn.shape == (4, CHANNELS, TAPS)  # + the spare
    assert slots.nbytes() == slots.att.numel() * 2 + slots.cnn.numel() * 4
    for sid in ("a", "b", "c"):
        slots.open(sid)
    assert slots.caches("a") == (None, None) and slots.length("a") == 0
    cnn, att = _caches(1, 12, seed=1)
    slots.write(["b"], cnn, att)
    got_cnn, got_att = slots.caches("b")
    assert slots.length("b") == 12 and torch.equal(got_att, att) and torch.equal(got_cnn, cnn)
    got_att[0, 0, 0, 0, 0] = 7.0  # a view of the slot, not a copy
    assert slots.caches("b")[1][0, 0, 0, 0, 0] == 7.0
    slots.close("b")
    assert "b" not in slots
    slots.open("d")  # the freed slot
    assert slots.length("d") == 0 and slots.caches("d") == (None, None)


def test_scatter_and_write_move_only_their_rows():
    slots = _slots(count=4)
    for sid in range(4):
        slots.open(sid)
    g = torch.Generator().manual_seed(2)
    slots.att.copy_(torch.randn(slots.att.shape, generator=g).half())
    slots.cnn.copy_(torch.randn(slots.cnn.shape, generator=g))
    before_att, before_cnn = slots.att.clone(), slots.cnn.clone()
    cnn, att = _caches(2, 9, seed=3)
    slots.write([3, 1], cnn, att)
    index = slots.index([3, 1]).tolist()
    assert torch.equal(slots.att[:, index, :, :9], att) and torch.equal(slots.cnn[index], cnn)
    assert torch.equal(slots.att[:, :, :, 9:], before_att[:, :, :, 9:])  # frames past the written length
    others = [s for s in range(5) if s not in index]
    assert torch.equal(slots.att[:, others], before_att[:, others]) and torch.equal(slots.cnn[others], before_cnn[others])
    assert slots.length(3) == slots.length(1) == 9 and slots.length(0) == 0


def test_index_pads_with_the_spare_slot():
    slots = _slots()
    slots.open("x")
    slots.open("y")
    index = slots.index(["y", "x"], rows=4).tolist()
    assert index[2:] == [slots.dump, slots.dump] == [3, 3]
    assert slots.dump not in index[:2] and len(set(index[:2])) == 2


@pytest.mark.parametrize("bad,arg", [
    (lambda s: s.open("a"), "sid"),  # already open
    (lambda s: s.write(["a"], *_caches(1, 21, 0)), "att"),  # longer than the slots hold
    (lambda s: s.write(["a"], _caches(1, 5, 0)[0], _caches(1, 5, 0)[1].float()), "att"),  # wrong dtype
    (lambda s: s.write(["a"], _caches(2, 5, 0)[0], _caches(1, 5, 0)[1]), "cnn"),  # rows of another count
    (lambda s: s.write(["a", "b"], *_caches(1, 5, 0)), "att"),  # fewer rows than streams
])
def test_bad_calls_name_the_argument_and_write_nothing(bad, arg):
    slots = _slots()
    slots.open("a")
    slots.open("b")
    before = (slots.att.clone(), slots.cnn.clone(), slots.length("a"), slots.length("b"))
    with pytest.raises(ValueError, match=arg):
        bad(slots)
    assert torch.equal(slots.att, before[0]) and torch.equal(slots.cnn, before[1])
    assert (slots.length("a"), slots.length("b")) == before[2:]


def test_a_full_store_refuses_another_stream():
    slots = _slots(count=2)
    slots.open(1)
    slots.open(2)
    with pytest.raises(ValueError, match="sid"):
        slots.open(3)
