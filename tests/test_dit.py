"""DiT estimator (docs/design.md §1-2) against the plain oracle in tests/dit_oracle.py.

CPU fp32/fp64 with tiny configs; the default config in fp16/bf16 runs on the GPU (gpu marker).
"""

from __future__ import annotations

import pytest
import torch

import dit_oracle as O
from oracle import assert_within_oracle, err_rel_fro
from torch_cfm import policy
from torch_cfm.models import DiT, DiTConfig, config_from_state_dict, load_checkpoint
from torch_cfm.models import dit as dit_module
from torch_cfm.models import dit_blocks

TINY = DiTConfig(hidden=64, depth=2, heads=4, head_dim=16)


def spec_table(cfg: DiTConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter name and shape, typed in from the docs/design.md §1 table."""
    c, d, inner = cfg.hidden, cfg.head_dim, cfg.heads * cfg.head_dim
    names = {
        "t_embedder.mlp.0.weight": (c, 256), "t_embedder.mlp.0.bias": (c,),
        "t_embedder.mlp.2.weight": (c, c), "t_embedder.mlp.2.bias": (c,),
        "in_proj.weight": (c, 320), "in_proj.bias": (c,),
        "final_layer.adaLN_modulation.1.weight": (2 * c, c), "final_layer.adaLN_modulation.1.bias": (2 * c,),
        "final_layer.linear.weight": (80, c), "final_layer.linear.bias": (80,),
    }
    for i in range(cfg.depth):
        b = f"blocks.{i}."
        for proj in ("to_q", "to_k", "to_v"):
            names[b + f"attn.{proj}.weight"] = (inner, c)
            names[b + f"attn.{proj}.bias"] = (inner,)
        for norm in ("q_norm", "k_norm"):
            names[b + f"attn.{norm}.weight"] = (d,)
            names[b + f"attn.{norm}.bias"] = (d,)
        names[b + "attn.proj.weight"] = (c, inner)
        names[b + "attn.proj.bias"] = (c,)
        names[b + "mlp.fc1.weight"] = (4 * c, c)
        names[b + "mlp.fc1.bias"] = (4 * c,)
        names[b + "mlp.fc2.weight"] = (c, 4 * c)
        names[b + "mlp.fc2.bias"] = (c,)
        for conv in ("1", "6"):
            names[b + f"conv.block.{conv}.weight"] = (c, c, 3)
            names[b + f"conv.block.{conv}.bias"] = (c,)
        names[b + "conv.block.3.weight"] = (c,)
        names[b + "conv.block.3.bias"] = (c,)
        names[b + "adaLN_modulation.1.weight"] = (9 * c, c)
        names[b + "adaLN_modulation.1.bias"] = (9 * c,)
    return names


def make_model(cfg=TINY, seed=0, dtype=torch.float32):
    return DiT(cfg).random_init_(seed).to(dtype).eval()


def inputs(n, t_len, cache_len, cfg=TINY, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    x, mu, cond = r(n, 80, t_len), r(n, 80, t_len), r(n, 80, t_len)
    spks, t = r(n, 80), torch.rand(n, generator=g, dtype=torch.float64).to(dtype)
    cnn = r(cfg.depth, n, 2 * cfg.hidden, 2)
    att = r(cfg.depth, n, cfg.heads, cache_len, 2 * cfg.head_dim)
    return x, mu, t, spks, cond, cnn, att


def lengths(values):
    return torch.tensor(values, dtype=torch.int32)


# ------------------------------------------------------------------ checkpoint compatibility

@pytest.mark.parametrize("cfg", [TINY, DiTConfig()], ids=["tiny", "default"])
def test_state_dict_names_and_shapes_are_the_spec_table(cfg):
    with torch.device("meta"):
        model = DiT(cfg)
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert got == spec_table(cfg)


def test_state_dict_round_trip_through_file(tmp_path):
    model = make_model(seed=3)
    path = tmp_path / "estimator.pt"
    torch.save(model.state_dict(), path)
    loaded = load_checkpoint(None, path)
    assert loaded.config == TINY
    assert DiT.from_checkpoint(path).config == TINY
    x, mu, t, spks, cond, cnn, att = inputs(2, 6, 4)
    torch.testing.assert_close(loaded.forward_chunk(x, mu, t, spks, cond, cnn, att)[0],
                               model.forward_chunk(x, mu, t, spks, cond, cnn, att)[0], rtol=0, atol=0)
    fresh = DiT(TINY)
    fresh.load_state_dict(model.state_dict())  # plain load_state_dict works unchanged
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_flow_checkpoint_prefix_is_stripped():
    model = make_model(seed=4)
    flow = {f"decoder.estimator.{k}": v for k, v in model.state_dict().items()}
    flow["encoder.embed.weight"] = torch.randn(3, 3)  # other flow parts are ignored
    flow["decoder.other.bias"] = torch.randn(3)
    loaded = load_checkpoint(DiT(TINY), {"state_dict": flow})
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    assert config_from_state_dict(model.state_dict()) == TINY


def test_checkpoint_errors_list_every_bad_key(tmp_path):
    sd = make_model().state_dict()
    sd.pop("blocks.1.mlp.fc1.bias")
    sd["blocks.0.attn.extra.weight"] = torch.zeros(2)
    sd["in_proj.weight"] = torch.zeros(64, 300)
    with pytest.raises(ValueError) as info:
        load_checkpoint(DiT(TINY), sd)
    msg = str(info.value)
    assert msg.startswith("load_checkpoint: checkpoint must match")
    for part in ("1 missing [blocks.1.mlp.fc1.bias]", "1 unexpected [blocks.0.attn.extra.weight]",
                 "in_proj.weight: expected (64, 320), got (64, 300)"):
        assert part in msg
    bad = tmp_path / "bad.pt"
    bad.write_text("not a checkpoint")
    with pytest.raises(ValueError, match="path must be a torch checkpoint"):
        load_checkpoint(None, bad)
    with pytest.raises(ValueError, match="path must name an existing file"):
        load_checkpoint(None, tmp_path / "missing.pt")
    with pytest.raises(ValueError, match="hold a DiT estimator's keys"):
        load_checkpoint(None, {"encoder.w": torch.zeros(1)})


# ------------------------------------------------------------------ numerics vs the oracle

@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_full_forward_with_masks_matches_oracle(dtype, tol):
    model = make_model(dtype=dtype)
    sd = O.to_dtype(model.state_dict())
    x, mu, t, spks, cond, _, _ = inputs(3, 9, 0, dtype=dtype)
    mask = torch.ones(3, 1, 9, dtype=torch.bool)
    mask[0, 0, 5:] = False                      # prefix
    mask[1, 0, [0, 3, 4, 8]] = False            # holes anywhere
    out = model(x, mask.float(), mu, t, spks, cond)
    ref = O.batch_forward(sd, x.double(), mask, mu.double(), t.double(), spks.double(), cond.double())
    assert err_rel_fro(out, ref) < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_ragged_chunk_matches_oracle_velocity_and_every_cache(dtype, tol):
    model = make_model(dtype=dtype)
    sd = O.to_dtype(model.state_dict())
    x, mu, t, spks, cond, cnn, att = inputs(4, 8, 6, dtype=dtype)
    vl, cl = lengths([8, 3, 0, 5]), lengths([6, 2, 4, 0])
    vel, new_cnn, new_att = model.forward_chunk(x, mu, t, spks, cond, cnn, att, valid_lengths=vl, cache_lengths=cl)
    assert new_att.shape == (2, 4, 4, 14, 32) and new_cnn.shape == (2, 4, 128, 2)
    vels, cnns, atts = O.batch_chunk(sd, *(a.double() for a in (x, mu, t, spks, cond, cnn, att)), vl, cl)
    for n in range(4):
        tn, ln = int(vl[n]), int(cl[n])
        if tn:
            assert err_rel_fro(vel[n, :, :tn], vels[n]) < tol
        assert err_rel_fro(new_cnn[:, n], cnns[n]) < tol
        assert err_rel_fro(new_att[:, n, :, :tn + ln], atts[n]) < tol
    assert torch.isfinite(vel).all() and torch.isfinite(new_att).all()


def test_first_chunk_without_caches_matches_oracle_and_full_forward():
    model = make_model()
    sd = O.to_dtype(model.state_dict())
    x, mu, t, spks, cond, _, _ = inputs(2, 7, 0)
    vel, new_cnn, new_att = model.forward_chunk(x, mu, t, spks, cond)
    assert new_att.shape == (2, 2, 4, 7, 32)
    vels, cnns, atts = O.batch_chunk(sd, *(a.double() for a in (x, mu, t, spks, cond)))
    for n in range(2):
        assert err_rel_fro(vel[n], vels[n]) < 2e-5
        assert err_rel_fro(new_cnn[:, n], cnns[n]) < 2e-5
        assert err_rel_fro(new_att[:, n], atts[n]) < 2e-5
    full = model(x, torch.ones(2, 1, 7), mu, t, spks, cond)
    torch.testing.assert_close(vel, full, rtol=1e-5, atol=1e-5)


def test_prefix_mask_forward_equals_ragged_chunk_on_valid_frames():
    # Masked keys + causal convs: a padded tail changes nothing before it (docs/design.md §1-2).
    model = make_model()
    x, mu, t, spks, cond, _, _ = inputs(3, 10, 0)
    vl = lengths([10, 4, 7])
    mask = (torch.arange(10)[None, None] < vl[:, None, None])
    full = model(x, mask, mu, t, spks, cond)
    vel, _, _ = model.forward_chunk(x, mu, t, spks, cond, valid_lengths=vl)
    for n, tn in enumerate(vl.tolist()):
        torch.testing.assert_close(vel[n, :, :tn], full[n, :, :tn], rtol=1e-5, atol=1e-5)


def test_streaming_chunks_chain_like_the_oracle():
    model = make_model(seed=5)
    sd = O.to_dtype(model.state_dict())
    x, mu, t, spks, cond, _, _ = inputs(2, 12, 0, seed=7)
    cnn = att = None
    ref_cnn = [None, None]
    ref_att = [None, None]
    for lo, hi in ((0, 5), (5, 9), (9, 12)):
        sl = slice(lo, hi)
        vel, cnn, att = model.forward_chunk(x[..., sl], mu[..., sl], t, spks, cond[..., sl], cnn, att)
        for n in range(2):
            v, ref_cnn[n], ref_att[n] = O.row_forward(sd, x[n, :, sl].double(), mu[n, :, sl].double(), float(t[n]),
                                                       spks[n].double(), cond[n, :, sl].double(), ref_cnn[n], ref_att[n])
            assert err_rel_fro(vel[n], v) < 2e-5
            assert err_rel_fro(cnn[:, n], ref_cnn[n]) < 2e-5
            assert err_rel_fro(att[:, n], ref_att[n]) < 2e-5
    assert att.shape[3] == 12


def test_padded_row_equals_solo_row_and_leaves_other_rows_unchanged():
    model = make_model(seed=2)
    x, mu, t, spks, cond, cnn, att = inputs(3, 9, 7, seed=11)
    vl, cl = lengths([9, 4, 6]), lengths([7, 3, 0])
    vel, new_cnn, new_att = model.forward_chunk(x, mu, t, spks, cond, cnn, att, valid_lengths=vl, cache_lengths=cl)
    for n in range(3):
        tn, ln = int(vl[n]), int(cl[n])
        sl = slice(n, n + 1)
        v1, c1, a1 = model.forward_chunk(x[sl, :, :tn], mu[sl, :, :tn], t[sl], spks[sl], cond[sl, :, :tn],
                                         cnn[:, sl], att[:, sl, :, :ln])
        torch.testing.assert_close(vel[sl, :, :tn], v1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(new_cnn[:, sl], c1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(new_att[:, sl, :, :tn + ln], a1, rtol=1e-5, atol=1e-5)
    # Rewriting row 1 entirely (and row 2's padding) changes nothing in the other rows' valid parts.
    x2, mu2, cond2, att2, cnn2 = x.clone(), mu.clone(), cond.clone(), att.clone(), cnn.clone()
    for buf in (x2, mu2, cond2):
        buf[1] = 1e3 * torch.randn_like(buf[1])
        buf[2, :, 6:] = -50.0
    att2[:, 1] = torch.randn_like(att2[:, 1])
    att2[:, 0, :, 7:] = 9.0  # beyond L = 7: nothing there, shape only
    cnn2[:, 1] = 5.0
    v2, nc2, na2 = model.forward_chunk(x2, mu2, t, spks, cond2, cnn2, att2, valid_lengths=vl, cache_lengths=cl)
    for n in (0, 2):
        tn, ln = int(vl[n]), int(cl[n])
        assert torch.equal(v2[n, :, :tn], vel[n, :, :tn])
        assert torch.equal(nc2[:, n], new_cnn[:, n])
        assert torch.equal(na2[:, n, :, :tn + ln], new_att[:, n, :, :tn + ln])
    assert torch.isfinite(v2).all() and torch.isfinite(na2).all()


def test_modulation_table_matches_oracle():
    model = make_model(seed=6)
    sd = O.to_dtype(model.state_dict())
    table = model.modulation_table(0.37)
    mods, (shift, scale) = O.modulations(sd, 0.37)
    assert table.shape == (3, 9, 64) and table.dtype == torch.float32
    for i, m in enumerate(mods):
        for j, slot in enumerate(dit_module.MOD_SLOTS):
            expect = m[slot] + (1 if slot.startswith("scale") else 0)
            torch.testing.assert_close(table[i, j].double(), expect, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(table[2, 0].double(), shift, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(table[2, 1].double(), 1 + scale, rtol=1e-5, atol=1e-6)
    assert torch.equal(table[2, 2:], torch.zeros(7, 64))
    temb = model.t_embedder(torch.tensor([0.37]))
    torch.testing.assert_close(model.modulation_table(temb), table, rtol=1e-6, atol=1e-6)


def test_random_init_is_seeded_realistic_and_every_gate_matters():
    a, b, c = make_model(seed=1), make_model(seed=1), make_model(seed=2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.in_proj.weight, c.in_proj.weight)
    for name, p in a.named_parameters():
        assert p.std() > 0 or p.numel() == 1, name
    gates = a.modulation_table(0.5)[:2, [2, 5, 8]]
    assert gates.abs().min() > 0 and gates.abs().mean() > 0.02
    x, mu, t, spks, cond, _, _ = inputs(1, 6, 0)
    base = a.forward_chunk(x, mu, t, spks, cond)[0]
    assert 0.1 < base.std() < 10
    with torch.no_grad():
        a.blocks[1].conv.block[6].bias.add_(0.1)
    assert not torch.allclose(a.forward_chunk(x, mu, t, spks, cond)[0], base)


# ------------------------------------------------------------------ dispatch hooks and contracts

def test_chunk_attention_uses_key_lengths_not_dense_masks(monkeypatch):
    calls = []
    real = dit_blocks.cfm_attention

    def spy(q, k, v, **kw):
        calls.append(kw)
        assert k.data_ptr() + 16 * k.element_size() == v.data_ptr()  # K|V halves of one cache buffer
        return real(q, k, v, **kw)

    monkeypatch.setattr(dit_blocks, "cfm_attention", spy)
    model = make_model()
    x, mu, t, spks, cond, cnn, att = inputs(2, 5, 3)
    model.forward_chunk(x, mu, t, spks, cond, cnn, att, valid_lengths=lengths([5, 2]), cache_lengths=lengths([3, 1]))
    assert len(calls) == 2
    assert all(c["mask"] is None and c["key_lengths"].tolist() == [8, 3] for c in calls)


def test_fused_hook_is_called_when_policy_says_fused(monkeypatch):
    model = make_model()
    x, mu, t, spks, cond, cnn, att = inputs(2, 5, 3)
    seen = {}

    def fake_fused(self, *args, **kw):
        seen["args"], seen["kw"] = args, kw
        return "fused-result"

    monkeypatch.setattr(dit_module, "dit_forward_chunk_fused", fake_fused)
    monkeypatch.setattr(policy, "decide", lambda device, dtype, fused=None, **kw: policy.Decision(
        True, "sm80", "triton", "tf32", True, (), "argument"))
    assert model.forward_chunk(x, mu, t, spks, cond, cnn, att) == "fused-result"
    assert seen["kw"]["precision"] == "tf32" and seen["args"][5] is cnn
    # policy says reference -> the reference path
    monkeypatch.setattr(policy, "decide", lambda device, dtype, fused=None, **kw: policy.Decision(
        False, "reference", "reference", None, False, (), "argument"))
    out = model.forward_chunk(x, mu, t, spks, cond, cnn, att)
    assert isinstance(out, tuple) and out[0].shape == (2, 80, 5)


def test_cpu_fused_override_keeps_reference():
    model = make_model()
    args = inputs(2, 5, 3)
    a = model.forward_chunk(*args, fused=True)
    b = model.forward_chunk(*args, fused=False)
    assert all(torch.equal(p, q) for p, q in zip(a, b))


@pytest.mark.parametrize("bad,arg", [
    (dict(x=torch.zeros(2, 81, 5)), "x"),
    (dict(mu=torch.zeros(2, 80, 4)), "mu"),
    (dict(spks=torch.zeros(2, 81)), "spks"),
    (dict(cnn_cache=torch.zeros(2, 2, 128, 3)), "cnn_cache"),
    (dict(att_cache=torch.zeros(2, 2, 4, 3, 16)), "att_cache"),
    (dict(valid_lengths=torch.tensor([5, 2])), "valid_lengths"),
    (dict(cache_lengths=torch.tensor([3], dtype=torch.int32)), "cache_lengths"),
    (dict(t=torch.zeros(3)), "t"),
])
def test_chunk_input_errors_name_the_argument(bad, arg):
    model = make_model()
    x, mu, t, spks, cond, cnn, att = inputs(2, 5, 3)
    kw = dict(x=x, mu=mu, t=t, spks=spks, cond=cond, cnn_cache=cnn, att_cache=att,
              valid_lengths=lengths([5, 2]), cache_lengths=lengths([3, 1]))
    kw.update(bad)
    with pytest.raises(ValueError, match=rf"^DiT.forward_chunk: {arg} must"):
        model.forward_chunk(**kw)


def test_forward_mask_error():
    model = make_model()
    x, mu, t, spks, cond, _, _ = inputs(2, 5, 0)
    with pytest.raises(ValueError, match=r"^DiT.forward: mask must have shape \(N, 1, T\)"):
        model(x, torch.ones(2, 1, 4), mu, t, spks, cond)


# ------------------------------------------------------------------ GPU: default config, fp16/bf16

@pytest.mark.gpu
@pytest.mark.parametrize("dtype,bound", [(torch.float16, 1e-2), (torch.bfloat16, 5e-2), (torch.float32, 1e-4)])
def test_default_config_on_gpu_against_fp64_oracle(dtype, bound):
    cfg = DiTConfig()
    model = DiT(cfg).random_init_(0)
    sd = O.to_dtype(model.state_dict())
    gpu = model.to("cuda", dtype)
    x, mu, t, spks, cond, cnn, att = inputs(3, 20, 24, cfg=cfg, dtype=torch.float64)
    vl, cl = lengths([20, 13, 7]), lengths([24, 10, 0])
    vels, cnns, atts = O.batch_chunk(sd, x, mu, t, spks, cond, cnn, att, vl, cl)
    dev = [a.to("cuda", dtype) for a in (x, mu, t, spks, cond, cnn, att)]
    dvl, dcl = vl.cuda(), cl.cuda()
    with policy.tf32_scope(False):
        ref = gpu.forward_chunk(*dev, valid_lengths=dvl, cache_lengths=dcl, fused=False)
        fast = gpu.forward_chunk(*dev, valid_lengths=dvl, cache_lengths=dcl)  # fused when policy says so
    torch.cuda.synchronize()
    for n in range(3):
        tn, ln = int(vl[n]), int(cl[n])
        pieces = [(ref[0][n, :, :tn], fast[0][n, :, :tn], vels[n], "velocity"),
                  (ref[1][:, n], fast[1][:, n], cnns[n], "cnn_cache"),
                  (ref[2][:, n, :, :tn + ln], fast[2][:, n, :, :tn + ln], atts[n], "att_cache")]
        for same, quick, ref64, name in pieces:
            assert err_rel_fro(same.cpu(), ref64) < bound, (name, n, err_rel_fro(same.cpu(), ref64))
            assert_within_oracle(quick.cpu(), same.cpu(), ref64, name=f"{name}[{n}]")
