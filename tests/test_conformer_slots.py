"""torch_cfm.serving.conformer_slots.ConformerSlots: the encoder stage's per-stream cache storage.

Checked directly (the stage's tests check it through whole streams against upstream): a slot per
open stream, reused after a close; a stream's caches are views of its slot, ``length`` frames long;
``write`` and ``scatter`` move exactly the rows they are given (the other slots and the frames past
the written length untouched, bitwise); padding rows go to the spare slot; bad calls raise a
ValueError naming the argument before anything is written.

The encoder stage's trims as copies (``EncoderStage.trim_pieces``), written into the slots without an
intermediate tensor (``ConformerSlots.scatter``), are checked bitwise against the two trim rules
written directly with ``torch_cfm.models.cache.trim_attention_cache``: stepaudio2-minicpmo's
``Token2wav.stream`` (the packed cache cut to the prompt and the last 100 frames) and minicpmo-utils'
(``causal``: the token-rate layers' own frames cut at the token rate, packed twice over).
"""

from __future__ import annotations

import copy

import types

import pytest
import torch

from torch_cfm.models.cache import TRIM_KEEP_OLDEST, trim_attention_cache
from torch_cfm.serving.conformer_slots import ConformerSlots
from torch_cfm.serving.encoder_stage import EncoderStage

DEPTH, HEADS, WIDTH, CHANNELS, TAPS = 3, 2, 4, 5, 6
TRIM_N1, TRIM_DEPTH = 3, 5  # the trim tests' token-rate layers and depth


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


def _reference(att: torch.Tensor, prompt: int, causal: bool) -> torch.Tensor:
    if att.shape[3] <= prompt + TRIM_KEEP_OLDEST:
        return att
    if not causal:
        return trim_attention_cache(att, prompt)
    token = trim_attention_cache(att[:TRIM_N1, :, :, :att.shape[3] // 2], prompt // 2, TRIM_KEEP_OLDEST // 2)
    return torch.cat([token.repeat(1, 1, 1, 2, 1), trim_attention_cache(att[TRIM_N1:], prompt)], dim=0)


def _stage(causal: bool):
    stage = types.SimpleNamespace(causal=causal, _n1=TRIM_N1)
    stage.trim_pieces = lambda frames, prompt: EncoderStage.trim_pieces(stage, frames, prompt)
    return stage


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("prompt,frames", [(0, 60), (40, 120), (40, 140), (40, 200), (0, 150), (64, 300), (300, 450)])
def test_trim_pieces_equal_the_trim_rules(causal, prompt, frames):
    g = torch.Generator().manual_seed(prompt * 1000 + frames)
    att = torch.randn(TRIM_DEPTH, 3, HEADS, frames, WIDTH, generator=g)
    want = _reference(att, prompt, causal)
    stage = _stage(causal)
    assert torch.equal(EncoderStage.trim(stage, att, prompt), want)
    slots = ConformerSlots(6, prompt + TRIM_KEEP_OLDEST + 8, (TRIM_DEPTH, HEADS, WIDTH), (7, 6),
                           (torch.float32, torch.float32), torch.device("cpu"))
    before = slots.att.clone()
    dest = torch.tensor([4, 0, 2])
    cnn = torch.randn(3, 7, 6, generator=g)
    slots.scatter(dest, cnn, att, stage.trim_pieces(frames, prompt))
    kept = want.shape[3]
    assert torch.equal(slots.att[:, dest, :, :kept], want)
    assert torch.equal(slots.att[:, :, :, kept:], before[:, :, :, kept:])  # nothing past the trimmed length
    others = [s for s in range(7) if s not in dest.tolist()]
    assert torch.equal(slots.att[:, others], before[:, others])
    assert torch.equal(slots.cnn[dest], cnn)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("prompt,length,frames", [(0, 0, 60), (40, 40, 90), (40, 140, 240), (64, 164, 264),
                                                  (300, 300, 400), (300, 400, 450), (40, 100, 200)])
def test_changed_pieces_write_the_slots_the_trim_writes(causal, prompt, length, frames):
    """A tick's packed cache gathered from ``length`` frames of the slots (the token-rate layers' first
    length // 2, as the encoder stage gathers them) and grown to ``frames``: the changed pieces leave
    the slots bitwise as the full trim's pieces do, writing no more frames than they."""
    g = torch.Generator().manual_seed(prompt * 1000 + length + frames)
    stage = _stage(causal)
    stage.changed_pieces = lambda pieces, n, depth: EncoderStage.changed_pieces(stage, pieces, n, depth)
    slots = ConformerSlots(6, max(length, prompt + TRIM_KEEP_OLDEST) + 8, (TRIM_DEPTH, HEADS, WIDTH), (7, 6),
                           (torch.float32, torch.float32), torch.device("cpu"))
    slots.att.normal_(generator=g)
    rows = torch.tensor([4, 0, 2])
    att = torch.randn(TRIM_DEPTH, 3, HEADS, frames, WIDTH, generator=g)  # the packed cache after the layers
    att[:TRIM_N1, :, :, :length // 2] = slots.att[:TRIM_N1, rows, :, :length // 2]
    att[TRIM_N1:, :, :, :length] = slots.att[TRIM_N1:, rows, :, :length]
    cnn = torch.randn(3, 7, 6, generator=g)
    full, changed = copy.deepcopy(slots), copy.deepcopy(slots)
    pieces = stage.trim_pieces(frames, prompt)
    full.scatter(rows, cnn, att, pieces)
    fewer = stage.changed_pieces(pieces, length, TRIM_DEPTH)
    changed.scatter(rows, cnn, att, fewer)
    assert torch.equal(changed.att, full.att) and torch.equal(changed.cnn, full.cnn)
    frames_of = lambda ps: sum(n * len(range(*ls.indices(TRIM_DEPTH))) for ls, _, _, n in ps)  # noqa: E731
    assert frames_of(fewer) <= frames_of(pieces)
    if length == 0:
        assert frames_of(fewer) == frames_of(pieces)


def test_an_odd_prompt_under_the_causal_rule_is_refused():
    with pytest.raises(ValueError, match="prompt"):
        EncoderStage.trim_pieces(_stage(True), 200, 41)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_gather_packed_writes_its_strided_halves_eagerly_and_under_capture():
    """``gather_packed`` writes through ``index_select(out=)`` into strided views of the packed
    tensor: on CUDA, eagerly and replayed from a CUDA graph, bitwise the slots' frames."""
    g = torch.Generator().manual_seed(4)
    slots = ConformerSlots(6, 120, (TRIM_DEPTH, HEADS, WIDTH), (7, 6), (torch.float32, torch.float16),
                           torch.device("cuda"))
    slots.att.copy_(torch.randn(slots.att.shape, generator=g).half())
    slots.cnn.copy_(torch.randn(slots.cnn.shape, generator=g))
    index = torch.tensor([5, 1, 3], device="cuda")
    frames, total = 80, 96

    def check(att, cnn):
        assert att.shape == (TRIM_DEPTH, 3, HEADS, total, WIDTH)
        assert torch.equal(att[:TRIM_N1, :, :, :frames // 2], slots.att[:TRIM_N1, :, :, :frames // 2].index_select(1, index))
        assert torch.equal(att[TRIM_N1:, :, :, :frames], slots.att[TRIM_N1:, :, :, :frames].index_select(1, index))
        assert torch.equal(cnn, slots.cnn.index_select(0, index))

    check(*slots.gather_packed(index, frames, total, TRIM_N1))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        slots.gather_packed(index, frames, total, TRIM_N1)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = slots.gather_packed(index, frames, total, TRIM_N1)
    slots.att.copy_(torch.randn(slots.att.shape, generator=g).half())  # new contents, same addresses
    graph.replay()
    torch.cuda.synchronize()
    check(*out)
