"""torch_cfm.models.conformer_attention against the upstream conformer attention it stands in for.

The upstream ``RelPositionMultiHeadedAttention`` (the chunk encoder's, loaded as
``tests/upstream_flow.py`` does) is the reference: in float64 the output and the new cache must
agree to 1e-12 (the same arithmetic, GEMM operands laid out differently), with and without a cache,
one positional table for the batch or one per row, with and without a key mask; the encoder's
whole ``forward_chunk`` with the replacement installed agrees in fp32 within the oracle's 1e-5; the
modules get their own ``forward`` back after the block, also when it raises.
"""

from __future__ import annotations

import pytest
import torch

import upstream_flow as U
from oracle import err_rel_fro

pytestmark = [pytest.mark.skipif(U.missing_reason() is not None, reason=str(U.missing_reason())),
              pytest.mark.usefixtures("one_thread")]

from torch_cfm.models.conformer_attention import (  # noqa: E402
    encoder_attention,
    is_rel_pos_attention,
    one_copy_attention,
    rel_pos_attention,
)


@pytest.fixture(scope="module")
def flow():
    return U.build_flow(U.TINY, seed=0)


def _attention(flow, dtype):
    attn = flow.encoder.encoders[0].self_attn
    return attn.to(dtype).eval()


@pytest.mark.parametrize("batch,t0,t1,pos_rows,masked", [
    (1, 0, 5, 1, False), (3, 0, 7, 1, False), (3, 12, 5, 1, False), (4, 10, 6, 4, False), (3, 8, 4, 1, True),
])
def test_rel_pos_attention_equals_upstream_float64(flow, batch, t0, t1, pos_rows, masked):
    attn = _attention(flow, torch.float64)
    try:
        g = torch.Generator().manual_seed(batch * 100 + t0 * 10 + t1)
        width = attn.h * attn.d_k
        x = torch.randn(batch, t1, width, generator=g, dtype=torch.float64)
        cache = torch.randn(batch, attn.h, t0, 2 * attn.d_k, generator=g, dtype=torch.float64) if t0 else None
        pos = torch.randn(pos_rows, 2 * (t0 + t1) - 1, width, generator=g, dtype=torch.float64)
        mask = torch.ones((0, 0, 0), dtype=torch.bool)
        if masked:  # left padding of each row's cache masked out, as the ragged encoder batches do
            keys = torch.arange(t0 + t1)
            mask = (keys[None, :] >= torch.tensor([0, 3, 6])[:batch, None])[:, None, :].expand(-1, t1, -1)
        upstream = attn.forward(x, x, x, mask, pos, cache if cache is not None else torch.zeros((0, 0, 0, 0),
                                                                                              dtype=torch.float64))
        got = rel_pos_attention(attn, x, x, x, mask, pos, cache)
        for name, a, b in zip(("output", "new cache"), got, upstream):
            assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape)
            assert err_rel_fro(a, b) <= 1e-12, (name, err_rel_fro(a, b))
        if cache is not None:
            assert torch.equal(got[1][:, :, :t0], cache)  # the old frames copied, not recomputed
    finally:
        attn.float()


def test_encoder_forward_chunk_with_one_copy_attention(flow):
    """The whole chunk encoder (both conformer stacks) with the replacement installed, fp32, a
    cached chunk after a prompt: mu and both new caches within the oracle's 1e-5 of upstream."""
    enc = flow.encoder
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        prompt = flow.input_embedding(torch.randint(0, 6561, (2, 12), generator=g))
        _, cnn, att = enc.forward_chunk(prompt, False)
        chunk = flow.input_embedding(torch.randint(0, 6561, (2, 7), generator=g))
        want = enc.forward_chunk(chunk, False, cnn, att)
        with one_copy_attention(encoder_attention(enc)) as count:
            assert count == len(enc.encoders) + len(enc.up_encoders)
            got = enc.forward_chunk(chunk, False, cnn, att)
    for name, a, b in zip(("xs", "cnn cache", "att cache"), got, want):
        assert a.shape == b.shape
        assert err_rel_fro(a, b) <= 1e-5, (name, err_rel_fro(a, b))


def test_one_copy_attention_restores_the_modules(flow):
    mods = encoder_attention(flow.encoder)
    assert mods and all(is_rel_pos_attention(m) for m in mods)
    with pytest.raises(RuntimeError, match="inside"):
        with one_copy_attention(mods):
            assert all("forward" in vars(m) for m in mods)
            raise RuntimeError("inside")
    assert not any("forward" in vars(m) for m in mods)
    plain = torch.nn.Linear(2, 2)
    with one_copy_attention([plain]) as count:  # not an attention: left alone
        assert count == 0 and "forward" not in vars(plain)


def test_a_cache_already_in_place_is_not_copied(flow):
    """``into`` giving the buffer whose first T0 frames are the cache (as the encoder stage's packed
    chunk does): the result is the upstream's, and only the new keys and values are written."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Copies.count += func is torch.ops.aten.copy_.default
            return func(*args, **(kwargs or {}))

    attn = _attention(flow, torch.float64)
    try:
        g = torch.Generator().manual_seed(9)
        batch, t0, t1, width = 2, 10, 4, attn.h * attn.d_k
        x = torch.randn(batch, t1, width, generator=g, dtype=torch.float64)
        buf = torch.randn(batch, attn.h, t0 + t1, 2 * attn.d_k, generator=g, dtype=torch.float64)
        cache = buf[:, :, :t0]
        pos = torch.randn(1, 2 * (t0 + t1) - 1, width, generator=g, dtype=torch.float64)
        want = attn.forward(x, x, x, torch.ones((0, 0, 0), dtype=torch.bool), pos, cache.clone())
        with Copies():
            got = rel_pos_attention(attn, x, x, x, pos_emb=pos, cache=cache,
                                    into=lambda shape, dtype, device: buf[:, :, :shape[2]])
        assert Copies.count == 2  # the new keys, the new values
        assert got[1].data_ptr() == buf.data_ptr()
        for a, b in zip(got, want):
            assert err_rel_fro(a, b) <= 1e-12
    finally:
        attn.float()


@pytest.mark.parametrize("t0,t1", [(0, 1), (0, 7), (5, 3), (37, 28), (400, 50)])
def test_the_shift_view_is_the_upstream_rel_shift_bitwise(flow, t0, t1):
    """The upstream ``rel_shift`` (zero column, concatenation, views) against the strided view that
    replaces it, on both score layouts ``rel_pos_attention`` produces: equal, element for element."""
    from torch_cfm.models.conformer_attention import _shift_view, shift_is_a_view

    attn = flow.encoder.encoders[0].self_attn
    assert shift_is_a_view(type(attn))
    p = 2 * (t0 + t1) - 1
    g = torch.Generator().manual_seed(t0 * 100 + t1)
    for x in (torch.randn(3, 2, t1, p, generator=g),                   # one GEMM per row: (B, H, T1, P)
              torch.randn(2, 3, t1, p, generator=g).transpose(0, 1)):  # one GEMM per head, batch-transposed
        want, got = attn.rel_shift(x), _shift_view(x)
        assert got.shape == want.shape == (x.shape[0], x.shape[1], t1, t0 + t1)
        assert torch.equal(got, want)
        assert got.data_ptr() >= x.data_ptr() and got.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert _shift_view(torch.randn(1, 2, 9, 3).transpose(2, 3)) is None  # rows not P apart: no view


def test_a_different_rel_shift_keeps_its_own(flow):
    """A module class whose ``rel_shift`` is not Transformer-XL's shift (or needs its module) is
    not replaced: rel_pos_attention calls it."""
    from torch_cfm.models.conformer_attention import shift_is_a_view

    base = type(flow.encoder.encoders[0].self_attn)

    class Flipped(base):
        def rel_shift(self, x):
            return base.rel_shift(self, x).flip(-1)

    class NeedsSelf(base):
        def rel_shift(self, x):
            return base.rel_shift(self, x) * self.d_k / self.d_k

    assert not shift_is_a_view(Flipped) and not shift_is_a_view(NeedsSelf)
    attn = _attention(flow, torch.float64)
    try:
        attn.__class__ = Flipped
        g = torch.Generator().manual_seed(3)
        width = attn.h * attn.d_k
        x = torch.randn(2, 4, width, generator=g, dtype=torch.float64)
        cache = torch.randn(2, attn.h, 6, 2 * attn.d_k, generator=g, dtype=torch.float64)
        pos = torch.randn(1, 19, width, generator=g, dtype=torch.float64)
        want = attn.forward(x, x, x, torch.ones((0, 0, 0), dtype=torch.bool), pos, cache)
        got = rel_pos_attention(attn, x, x, x, pos_emb=pos, cache=cache)
        assert err_rel_fro(got[0], want[0]) <= 1e-12
    finally:
        attn.__class__ = base
        attn.float()
