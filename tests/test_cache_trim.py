"""The server's trimmed cache write-back kernel (``torch_cfm.kernels.cache_trim``).

Oracle: ``torch_cfm.reference.cache_trim.trim_copy_reference`` (a full ``torch.gather`` then a copy / ``index_copy_``). The kernel
only moves values, so it must match bitwise. CPU: the Triton interpreter in a child process (the
same pattern as test_cfm_attention_triton.py: ``TRITON_INTERPRET`` is read when a kernel is
decorated). CUDA (gpu marker): the compiled kernel, graph capture/replay and no host sync. Also the
in-place arena's key order (``models.cache.reverse_keys``).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from interpreter_child import run_child_file
from torch_cfm.kernels.cache_trim import move_frames_into, trim_copy_into
from torch_cfm.reference.cache_trim import move_frames_reference, trim_copy_reference
from torch_cfm.models.cache import arena_chunk_plan, trim_gather_index


# name, depth, requests n, heads, src frames Fs, arena frames M, width W, 2D, dtype, compacted rows
CASES = [
    ("trim-some-rows", 2, 3, 2, 40, 48, 40, 16, torch.float16, False),
    ("width-below-arena", 3, 2, 2, 30, 64, 25, 32, torch.float32, False),
    ("compacted-rows", 2, 2, 3, 21, 21, 21, 16, torch.bfloat16, True),
    ("one-frame", 1, 1, 1, 1, 4, 1, 16, torch.float16, False),
    ("width-not-tile-multiple", 2, 4, 1, 37, 37, 37, 64, torch.float32, True),
]


def make_case(case, device="cpu"):
    """(dst, src, index, dst_rows) for a case: a realistic trim index (some rows due for a trim,
    some clamped past their length) and fresh random cache values (never zeros)."""
    name, depth, n_req, heads, fs, m, width, two_d, dtype, compact = case
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    rows = 2 * n_req
    src = torch.randn(depth, rows, heads, fs, two_d, generator=g).to(dtype)
    r_dst = rows + 2 if compact else rows
    dst = torch.randn(depth, r_dst, heads, m + 3, two_d, generator=g).to(dtype)[:, :, :, :m]  # strided view
    new_len = torch.randint(0, fs + 1, (n_req,), generator=g)
    prompt = torch.randint(0, max(fs // 3, 1), (n_req,), generator=g)
    index, _ = trim_gather_index(new_len, prompt, width, fs, keep_oldest=max(fs // 4, 1))
    dst_rows = torch.randperm(r_dst, generator=g)[:rows] if compact else None
    to = (lambda t: None if t is None else t.to(device))  # noqa: E731
    return to(dst), to(src), to(index), to(dst_rows)


# The keyed arena's three copies (models.cache.arena_chunk_plan): name, form, dtype, 2D
KEYED_CASES = [
    ("keyed-moves-in-place", "moves", torch.float16, 16),
    ("keyed-gather-src-rows", "gather", torch.bfloat16, 32),
    ("keyed-write-back-dst-rows", "write_back", torch.float32, 16),
]


def make_keyed_case(case, device="cpu"):
    """(dst, src, index, dst_rows, src_rows, aliased) for one copy of a keyed-arena chunk: a real
    plan over scrambled frame keys with some rows trimmed, skipped frames (-1) and renamed rows."""
    name, form, dtype, two_d = case
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    slots, solved, depth, heads, keep, key_frames, t_len = 4, 3, 2, 2, 3, 14, 6
    lengths = torch.tensor([11, 0, 5, 14])[:solved]
    valid = torch.tensor([6, 2, 0, 4])[:solved]
    prompt = torch.tensor([2, 1, 3, 0])[:solved]
    keys = torch.arange(key_frames).repeat(solved, 1)
    for r, ln in enumerate(lengths.tolist()):  # a keyed row: a permutation of its L_r keys
        keys[r, :ln] = torch.randperm(ln, generator=g)
    keys = keys.to(torch.int32)
    cache_frames = int(lengths.max())
    plan = arena_chunk_plan(keys, lengths, valid, prompt, cache_frames, t_len, keep)
    arena = torch.randn(depth, 2 * slots, heads, key_frames + t_len, two_d, generator=g).to(dtype)
    scratch = torch.randn(depth, 2 * solved, heads, cache_frames + t_len, two_d, generator=g).to(dtype)
    rows = torch.cat([torch.tensor([3, 0, 2]), torch.tensor([3, 0, 2]) + slots])[: 2 * solved]
    if form == "moves":
        arena = arena[:, : 2 * solved]
        out = (arena, arena, plan.moves, None, None, True)
        assert (plan.moves.count > 0).any() and (plan.moves.count == 0).any()
    elif form == "gather":
        out = (scratch, arena, plan.old_frames, None, rows, False)
        assert (plan.old_frames < 0).any() and (plan.old_frames >= 0).any(), "skip some frames, copy others"
    else:
        out = (arena, scratch, plan.write_back, rows, None, False)
    to = (lambda t: type(t)(*(to(v) for v in vars(t).values())) if hasattr(t, "count")  # noqa: E731
          else t.to(device) if isinstance(t, torch.Tensor) else t)
    return tuple(to(t) for t in out)


def _keyed_op(form):
    """(kernel, reference) of a keyed case: the move lists or the frame map."""
    return (trim_copy_into, trim_copy_reference) if form == "gather" else (move_frames_into, move_frames_reference)


def _keyed_expected(case, dst, src, index, dst_rows, src_rows, aliased):
    return _keyed_op(case[1])[1](dst.clone(), dst.clone() if aliased else src, index, dst_rows, src_rows)


def _child(out_path: str) -> None:
    results = {}
    for case in CASES:
        dst, src, index, dst_rows = make_case(case)
        results[case[0]] = trim_copy_into(dst, src, index, dst_rows).clone()
    for case in KEYED_CASES:
        dst, src, index, dst_rows, src_rows, _ = make_keyed_case(case)
        results[case[0]] = _keyed_op(case[1])[0](dst, src, index, dst_rows, src_rows).clone()
    torch.save(results, out_path)


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory):
    out_path = str(tmp_path_factory.mktemp("trim_interp") / "out.pt")
    return run_child_file(__file__, out_path)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_interpreter_matches_reference_bitwise(case, interpreter_results):
    dst, src, index, dst_rows = make_case(case)
    untouched = dst.clone()
    expected = trim_copy_reference(dst, src, index, dst_rows)
    got = interpreter_results[case[0]]
    assert torch.equal(got, expected)
    width = index.shape[1]
    # nothing outside the written frames/rows changed
    assert torch.equal(got[:, :, :, width:], untouched[:, :, :, width:])
    if dst_rows is not None:
        others = [r for r in range(dst.shape[1]) if r not in dst_rows.tolist()]
        assert torch.equal(got[:, others], untouched[:, others])


@pytest.mark.parametrize("case", KEYED_CASES, ids=[c[0] for c in KEYED_CASES])
def test_interpreter_keyed_copies_match_reference_bitwise(case, interpreter_results):
    """Skipped frames (-1) stay, rows are renamed on either side, and the in-place moves (source
    and destination the same tensor) read the frames as they were before the call."""
    dst, src, index, dst_rows, src_rows, aliased = make_keyed_case(case)
    expected = _keyed_expected(case, dst, src, index, dst_rows, src_rows, aliased)
    assert torch.equal(interpreter_results[case[0]], expected)


def test_reference_skips_and_renames_rows_per_the_contract():
    """The oracles against a per-frame loop of their contracts (independent of both implementations)."""
    for case in KEYED_CASES:
        dst, src, index, dst_rows, src_rows, aliased = make_keyed_case(case)
        start, src0 = dst.clone(), (dst if aliased else src).clone()
        out = _keyed_expected(case, dst, src, index, dst_rows, src_rows, aliased)
        if case[1] == "gather":
            pairs = [[(j, int(k)) for j, k in enumerate(row.tolist()) if k >= 0] for row in index]
        else:
            pairs = [list(zip(index.dst[n, :c].tolist(), index.src[n, :c].tolist()))
                     for n, c in enumerate(index.count.tolist())]
        n_req = len(pairs)
        n_rows = len(src_rows) if src_rows is not None else len(dst_rows) if dst_rows is not None else src.shape[1]
        written = set()
        for r in range(n_rows):
            d_r = int(dst_rows[r]) if dst_rows is not None else r
            s_r = int(src_rows[r]) if src_rows is not None else r
            for j, k in pairs[r % n_req]:
                written.add((d_r, j))
                assert torch.equal(out[:, d_r, :, j], src0[:, s_r, :, k].to(out.dtype)), (case[0], r, j)
        for d_r in range(dst.shape[1]):
            for j in range(dst.shape[3]):
                if (d_r, j) not in written:
                    assert torch.equal(out[:, d_r, :, j], start[:, d_r, :, j]), (case[0], d_r, j)


def test_reference_implements_the_trim_rule():
    """The oracle itself against a per-row loop of the docs/design.md §3 rule (independent of both)."""
    dst, src, index, _ = make_case(CASES[0])
    out = trim_copy_reference(dst.clone(), src, index)
    n_req, width = index.shape
    for r in range(src.shape[1]):
        for j in range(width):
            assert torch.equal(out[:, r, :, j], src[:, r, :, int(index[r % n_req, j])])


def test_bad_layouts_raise():
    dst, src, index, _ = make_case(CASES[0])
    with pytest.raises(ValueError, match="unit stride"):
        trim_copy_into(dst.transpose(3, 4), src, index)
    with pytest.raises(ValueError, match="incompatible"):
        trim_copy_into(dst[:, :, :, :10], src, index)  # width 40 > 10 arena frames
    with pytest.raises(ValueError, match="incompatible"):
        trim_copy_into(dst, src[:, :5], index)  # 5 rows are not a multiple of 3 requests
    arena, _, moves, *_ = make_keyed_case(KEYED_CASES[0])
    with pytest.raises(ValueError, match="move_frames_into: incompatible"):
        move_frames_into(arena[:, :, :, :5], arena, moves)  # a move list wider than the frames
    with pytest.raises(ValueError, match="unit stride"):
        move_frames_into(arena.transpose(3, 4), arena, moves)


@pytest.mark.gpu
@pytest.mark.parametrize("case", KEYED_CASES, ids=[c[0] for c in KEYED_CASES])
def test_gpu_keyed_copies_match_reference_bitwise_in_a_graph(case):
    dst, src, index, dst_rows, src_rows, aliased = make_keyed_case(case, "cuda")
    start = dst.clone()
    expected = _keyed_expected(case, dst, src, index, dst_rows, src_rows, aliased)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _keyed_op(case[1])[0](dst, dst if aliased else src, index, dst_rows, src_rows)
    dst.copy_(start)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(dst, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_gpu_matches_reference_bitwise_in_a_graph_without_sync(case):
    dst, src, index, dst_rows = make_case(case, "cuda")
    expected = trim_copy_reference(dst.clone(), src, index, dst_rows)
    start = dst.clone()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        trim_copy_into(dst, src, index, dst_rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(dst, expected)
    dst.copy_(start)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        trim_copy_into(dst, src, index, dst_rows)
    dst.copy_(start)
    src.copy_(torch.randn_like(src))  # new values in place: the replay must read them
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(dst, trim_copy_reference(start.clone(), src, index, dst_rows))


if __name__ == "__main__" and len(sys.argv) >= 3 and sys.argv[1] == "--child":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run the child with TRITON_INTERPRET=1")
    _child(sys.argv[2])


def test_reverse_keys_is_its_own_inverse_and_zeroes_padding():
    """The in-place arena's key order (models.cache.reverse_keys): each row's first L_r frames
    reversed, zeros after them; applying it twice gives the newest-first cache back (valid frames)."""
    from torch_cfm.models.cache import reverse_keys, reversed_key_index

    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 3, 4, 2, 7, 6, generator=g)  # (n, depth, rows, H, frames, 2D)
    lengths = torch.tensor([0, 1, 7, 4], dtype=torch.int32)
    rev = reverse_keys(cache, lengths)
    for r, ln in enumerate(lengths.tolist()):
        for j in range(7):
            expect = cache[..., r, :, ln - 1 - j, :] if j < ln else torch.zeros_like(cache[..., r, :, j, :])
            assert torch.equal(rev[..., r, :, j, :], expect), (r, j)
    back = reverse_keys(rev, lengths)
    mask = (torch.arange(7)[None, :] < lengths[:, None]).view(4, 1, 7, 1)
    assert torch.equal(back, torch.where(mask, cache, torch.zeros(())))
    index, valid = reversed_key_index(torch.tensor([9, -2]), 5)  # lengths clamped to [0, frames]
    assert index.tolist() == [[4, 3, 2, 1, 0], [0, 1, 2, 3, 4]] and valid.tolist() == [[True] * 5, [False] * 5]
