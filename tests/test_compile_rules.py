"""Compile rules (torch_cfm.compile_rules): the passes fire iff the docs/design.md §5 policy says so.

CPU tests decide with a faked device (``RulesConfig(assume_device="cuda", capability=...)``) or
on fake CUDA tensors, and inspect the graphs before/after; the rewritten DiT step still runs on
CPU (the fused op's CPU kernel is reference math), so its numbers are checked against the fp64
oracle of tests/dit_oracle.py. GPU-marked tests do the real swap, reduce-overhead and timing.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import torch_cfm
from torch_cfm import compile_rules
from torch_cfm.compile_rules import RulesConfig, TorchCfmBackend, TorchCfmPass, explain_model, hooks
from torch_cfm.compile_rules.markers import (fused_dit_step, fused_dit_step_prepacked, mark_dit_step,
                                             marker_op)
from torch_cfm.config import DiTConfig
from torch_cfm.models.dit import random_dit

import dit_oracle
from oracle import assert_within_oracle, naive_attention64

H200, T4 = (9, 0), (7, 5)
TINY = DiTConfig(hidden=32, depth=1, heads=2, head_dim=16)
CFM_ATTENTION = torch.ops.torch_cfm.cfm_attention.default


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def tf32_flag():
    """Restore torch's TF32 matmul flag after a test flips it."""
    before = torch.backends.cuda.matmul.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.fixture
def no_compile_caches():
    """Compile for real (the joint pass must run, not a cached artifact of an earlier run).

    Through torch's scoped ``config.patch`` (never monkeypatch.setattr on a torch config module:
    pytest >= 9.2 undoes it with delattr, which torch's config modules refuse)."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------


class EagerCompiler:
    """Stands in for Inductor: keeps the rewritten Dynamo graph and runs it eagerly."""

    def __init__(self):
        self.graphs: list[torch.fx.GraphModule] = []
        self.patches: list[dict] = []

    def __call__(self, gm, example_inputs, config_patches=None):
        self.graphs.append(gm)
        self.patches.append(dict(config_patches or {}))
        return gm.forward


def attention_fn(q, cache, lengths):
    d = q.shape[-1]
    out = torch_cfm.cfm_attention(q, cache[..., :d], cache[..., d:], key_lengths=lengths)
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1) * 2.0


def attention_inputs(dtype=torch.float32, device="cpu"):
    q = torch.randn(2, 2, 5, 16, dtype=dtype, device=device)
    cache = torch.randn(2, 2, 7, 32, dtype=dtype, device=device)
    lengths = torch.tensor([7, 3], dtype=torch.int32, device=device)
    return q, cache, lengths


def attention_oracle(q, cache, lengths):
    d = q.shape[-1]
    ref = naive_attention64(q, cache[..., :d], cache[..., d:], key_lengths=lengths)
    return ref.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1) * 2.0


def attention_op_fn(q, cache, lengths):
    """attention_fn through the op itself (what Dynamo records for the public wrapper)."""
    d = q.shape[-1]
    out = CFM_ATTENTION(q, cache.narrow(-1, 0, d), cache.narrow(-1, d, d), lengths, None, None, "auto")
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def fake_cuda_attention_graph(dtype):
    """An ATen graph of attention_op_fn traced on fake CUDA tensors (no GPU needed)."""
    with FakeTensorMode():
        q, cache, lengths = (torch.empty(2, 2, 5, 16, dtype=dtype, device="cuda"),
                             torch.empty(2, 2, 7, 32, dtype=dtype, device="cuda"),
                             torch.empty(2, dtype=torch.int32, device="cuda"))
        return make_fx(attention_op_fn, tracing_mode="fake")(q, cache, lengths)


def precisions(graph):
    from torch_cfm.compile_rules.passes._graph import schema_args

    return [schema_args(n)["precision"] for n in graph.nodes
            if n.op == "call_function" and n.target is CFM_ATTENTION]


def step_inputs(config=TINY, n_rows=2, t_len=5, cache_len=4, ragged=True, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(1)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    mel = config.out_channels
    args = (rnd(n_rows, mel, t_len), rnd(n_rows, mel, t_len), torch.rand(n_rows, generator=g).to(device),
            rnd(n_rows, mel), rnd(n_rows, mel, t_len),
            rnd(config.depth, n_rows, 2 * config.hidden, 2),
            rnd(config.depth, n_rows, config.heads, cache_len, 2 * config.head_dim))
    if ragged:
        # every other row ragged: 2 padded frames and a 1-frame cache
        lengths = (torch.tensor([t_len - 2 * (i % 2) for i in range(n_rows)], dtype=torch.int32, device=device),
                   torch.tensor([1 if i % 2 else cache_len for i in range(n_rows)], dtype=torch.int32,
                                device=device))
    else:
        lengths = (None, None)
    return args + lengths


def model_marks_itself(model) -> bool:
    """True once DiT.forward_chunk calls mark_dit_step under torch.compile (the model hook)."""
    import inspect

    return "mark_dit_step" in inspect.getsource(type(model).forward_chunk)


def make_step(model):
    """One marked estimator step: the hook a model/solver calls under torch.compile."""
    if model_marks_itself(model):
        def hooked(x, mu, t, spks, cond, cnn, att, valid_lengths, cache_lengths):
            return model.forward_chunk(x, mu, t, spks, cond, cnn, att, valid_lengths=valid_lengths,
                                       cache_lengths=cache_lengths)

        return hooked

    def step(x, mu, t, spks, cond, cnn, att, valid_lengths, cache_lengths):
        out = model.forward_chunk(x, mu, t, spks, cond, cnn, att, valid_lengths=valid_lengths,
                                  cache_lengths=cache_lengths, fused=False)
        mark_dit_step(model, out, x, mu, t, spks, cond, cnn, att, valid_lengths=valid_lengths,
                      cache_lengths=cache_lengths)
        return out

    return step


def graph_targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def assert_step_within_oracle(model, args, fast, same_dtype):
    """docs/design.md §6 on the valid part of every row: velocity and both caches vs the fp64 oracle."""
    x, mu, t, spks, cond, cnn, att, valid, cached = args
    sd = dit_oracle.to_dtype(model.state_dict())
    vels, cnns, atts = dit_oracle.batch_chunk(sd, x.double().cpu(), mu.double().cpu(), t.double().cpu(),
                                              spks.double().cpu(), cond.double().cpu(), cnn.double().cpu(),
                                              att.double().cpu(), valid, cached)
    for n in range(x.shape[0]):
        tn, ln = int(valid[n]), int(cached[n])
        assert_within_oracle(fast[0][n, :, :tn].float().cpu(), same_dtype[0][n, :, :tn].float().cpu(),
                             vels[n], f"velocity[{n}]")
        assert_within_oracle(fast[1][:, n].float().cpu(), same_dtype[1][:, n].float().cpu(), cnns[n],
                             f"cnn_cache[{n}]")
        assert_within_oracle(fast[2][:, n, :, :tn + ln].float().cpu(),
                             same_dtype[2][:, n, :, :tn + ln].float().cpu(), atts[n], f"att_cache[{n}]")


# ------------------------------------------------------------------------------------------
# registration and entry points
# ------------------------------------------------------------------------------------------


def _needs_entry_point():
    """The entry point exists only where torch_cfm is pip-installed (CI), not in an in-place build."""
    eps = importlib.metadata.entry_points(group="torch_dynamo_backends")
    if "torch_cfm" not in eps.names:
        pytest.skip("torch_cfm is not pip-installed here (in-place build): no entry-point metadata")


def test_backend_registered_by_name_and_entry_point():
    from torch._dynamo.backends.registry import lookup_backend

    _needs_entry_point()
    assert "torch_cfm" in torch._dynamo.list_backends()
    assert lookup_backend("torch_cfm") is compile_rules.torch_cfm_backend
    eps = importlib.metadata.entry_points(group="torch_dynamo_backends")
    assert eps["torch_cfm"].value == "torch_cfm.compile_rules.backend:torch_cfm_backend"
    assert eps["torch_cfm"].load() is compile_rules.torch_cfm_backend


def test_backend_name_works_in_a_fresh_process_without_importing_the_rules():
    _needs_entry_point()
    code = (
        "import sys, torch, torch_cfm\n"
        "assert 'torch_cfm.compile_rules' not in sys.modules\n"
        "q, k = torch.randn(2, 2, 5, 16), torch.randn(2, 2, 7, 16)\n"
        "f = lambda q, k: torch_cfm.cfm_attention(q, k, k) * 2.0\n"
        "out = torch.compile(f, backend='torch_cfm')(q, k)\n"
        "ref = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 4.0, -1) @ k.double() * 2.0\n"
        "err = (out.double() - ref).abs().max().item()\n"
        "assert err < 1e-5, err\n"
        "from torch_cfm.compile_rules import default_backend\n"
        "print([s.rule for s in default_backend().sites])\n")
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "['cfm_attention']" in res.stdout


def test_torch_cfm_compile_runs_inductor_and_matches_the_oracle():
    args = attention_inputs()
    out = torch_cfm.compile(attention_fn, tf32=False)(*args)
    ref = attention_oracle(*args)
    assert (out.double() - ref).abs().max().item() < 1e-5


def test_backend_options_split_and_bad_option_named():
    be = TorchCfmBackend(compiler=EagerCompiler())
    args = attention_inputs()
    torch.compile(attention_fn, backend=be, options={"torch_cfm.tf32": True})(*args)
    assert precisions(be.compiler.graphs[-1].graph) == ["tf32"]
    with pytest.raises(ValueError, match="torch_cfm backend: option 'torch_cfm.bogus' must be one of"):
        compile_rules.backend.split_options({"torch_cfm.bogus": 1})
    with pytest.raises(ValueError, match="option 'not_an_inductor_option' must be an Inductor config name"):
        compile_rules.backend.inductor_patches(None, {"not_an_inductor_option": 1})
    patches = compile_rules.backend.inductor_patches("reduce-overhead", {"max_autotune": False})
    assert patches["triton.cudagraphs"] is True and patches["max_autotune"] is False


def test_backend_puts_the_same_pass_in_the_joint_slot_and_keeps_users_passes():
    from torch._inductor import config as inductor_config

    def user_pass(graph):
        return None

    eager = EagerCompiler()
    be = TorchCfmBackend(compiler=eager)
    with inductor_config.patch(joint_custom_pre_pass=user_pass):
        torch.compile(attention_fn, backend=be)(*attention_inputs())
    slot = hooks.passes_in(eager.patches[-1]["joint_custom_pre_pass"])
    assert slot[0] is user_pass and slot[1] is be.last_pass


# ------------------------------------------------------------------------------------------
# cfm_attention rule: decisions on fake CUDA graphs, precision pinned at trace time
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_site_on_sm90_uses_triton_with_no_reasons(dtype):
    gm = fake_cuda_attention_graph(dtype)
    rules = TorchCfmPass(RulesConfig(capability=H200, env={}))
    rules(gm.graph)
    (site,) = rules.last_sites
    assert (site.rule, site.action, site.dtype, site.reasons) == ("cfm_attention", "kept", dtype, ())
    assert site.detail == "attention=triton" and site.device == "cuda:0"
    assert precisions(gm.graph) == ["auto"]  # fp16/bf16: nothing to pin


def test_attention_site_below_sm80_records_the_reason():
    gm = fake_cuda_attention_graph(torch.float16)
    rules = TorchCfmPass(RulesConfig(capability=T4, env={}))
    rules(gm.graph)
    (site,) = rules.last_sites
    assert site.detail == "attention=sdpa" and site.reasons == ("needs NVIDIA SM80+, found SM75",)


@pytest.mark.parametrize("tf32, expected", [(True, "tf32"), (False, "ieee")])
def test_fp32_attention_precision_is_pinned_from_the_trace_time_policy(tf32, expected):
    gm = fake_cuda_attention_graph(torch.float32)
    assert precisions(gm.graph) == ["auto"]
    rules = TorchCfmPass(RulesConfig(capability=H200, tf32=tf32, env={}))
    rules(gm.graph)
    assert precisions(gm.graph) == [expected]
    (site,) = rules.last_sites
    assert site.action == "pinned" and site.detail == f"attention=triton precision={expected}"


def test_env_tf32_wins_over_the_rules_config():
    gm = fake_cuda_attention_graph(torch.float32)
    TorchCfmPass(RulesConfig(capability=H200, tf32=True, env={"TORCH_CFM_TF32": "off"}))(gm.graph)
    assert precisions(gm.graph) == ["ieee"]


def test_cpu_attention_site_says_why():
    gm = make_fx(attention_fn)(*attention_inputs())
    rules = TorchCfmPass(RulesConfig(tf32=False, env={}))
    rules(gm.graph)
    (site,) = rules.last_sites
    assert site.device == "cpu" and site.reasons == ("needs a CUDA device, found cpu",)


def test_flipping_tf32_recompiles_and_pins_the_new_precision(tf32_flag):
    eager = EagerCompiler()
    be = TorchCfmBackend(RulesConfig(env={}), compiler=eager)
    fn = torch.compile(attention_fn, backend=be)
    args = attention_inputs()
    torch.backends.cuda.matmul.allow_tf32 = False
    fn(*args)
    fn(*args)
    assert len(eager.graphs) == 1 and precisions(eager.graphs[-1].graph) == ["ieee"]
    torch.backends.cuda.matmul.allow_tf32 = True
    fn(*args)
    assert len(eager.graphs) == 2 and precisions(eager.graphs[-1].graph) == ["tf32"]
    torch.backends.cuda.matmul.allow_tf32 = False
    fn(*args)  # back to the first entry: a cache hit, not a stale tf32 graph
    assert len(eager.graphs) == 2


# ------------------------------------------------------------------------------------------
# dit_step rule: the marked reference step -> fused body
# ------------------------------------------------------------------------------------------


SWAP_CASES = [
    # (rules config, fused?, reasons when not)
    (RulesConfig(assume_device="cuda", capability=H200, tf32=True, env={}), True, ()),
    (RulesConfig(assume_device="cuda", capability=H200, tf32=False, env={}), False, ("fp32 with TF32 off",)),
    (RulesConfig(assume_device="cuda", capability=T4, tf32=True, env={}), False,
     ("needs NVIDIA SM80+, found SM75",)),
    (RulesConfig(tf32=True, env={}), False, ("needs a CUDA device, found cpu",)),
    (RulesConfig(assume_device="cuda", capability=H200, tf32=True, fused=False, env={}), False,
     ("disabled by argument",)),
    (RulesConfig(assume_device="cuda", capability=H200, tf32=True, env={"TORCH_CFM_FUSED": "0"}), False,
     ("disabled by env",)),
    (RulesConfig(assume_device="cuda", capability=H200, tf32=False, fused=True, env={}), True, ()),
]


@pytest.mark.parametrize("rules, fused, reasons", SWAP_CASES,
                         ids=["sm90-tf32", "tf32-off", "sm75", "cpu", "fused=False", "env-0", "forced-ieee"])
def test_step_swap_fires_iff_policy_says_so(rules, fused, reasons):
    model = random_dit(TINY, 0)
    args = step_inputs()
    eager = EagerCompiler()
    be = TorchCfmBackend(rules, compiler=eager)
    out = torch.compile(make_step(model), backend=be, fullgraph=True)(*args)  # no graph break
    (gm,) = eager.graphs
    targets = graph_targets(gm)
    assert marker_op() not in targets  # the marker never survives the rules
    assert (fused_dit_step_prepacked in targets) is fused  # our backend packs at compile time
    assert fused_dit_step not in targets
    (step_site,) = [s for s in be.sites if s.rule == "dit_step"]
    assert step_site.action == ("fused" if fused else "kept") and step_site.reasons == reasons
    attention_sites = [s for s in be.sites if s.rule == "cfm_attention"]
    # a swapped step replaces its attention calls: they are dead and not reported
    assert len(attention_sites) == (0 if fused else TINY.depth)
    assert all(torch.isfinite(o).all() for o in out)


def test_swapped_step_is_within_the_oracle_on_every_valid_frame_and_cache():
    model = random_dit(TINY, 0)
    args = step_inputs()
    rules = RulesConfig(assume_device="cuda", capability=H200, tf32=True, env={})
    fast = torch.compile(make_step(model), backend=TorchCfmBackend(rules, compiler=EagerCompiler()))(*args)
    same_dtype = model.forward_chunk(*args[:7], valid_lengths=args[7], cache_lengths=args[8], fused=False)
    assert_step_within_oracle(model, args, fast, same_dtype)


def test_without_prepack_the_packing_is_traced_into_the_graph():
    model = random_dit(TINY, 0)
    args = step_inputs()
    rules = RulesConfig(assume_device="cuda", capability=H200, tf32=True, env={}, prepack=False)
    eager = EagerCompiler()
    fast = torch.compile(make_step(model), backend=TorchCfmBackend(rules, compiler=eager))(*args)
    (gm,) = eager.graphs
    assert fused_dit_step in graph_targets(gm) and not list(gm.buffers())
    same_dtype = model.forward_chunk(*args[:7], valid_lengths=args[7], cache_lengths=args[8], fused=False)
    assert_step_within_oracle(model, args, fast, same_dtype)


def test_weights_packed_at_compile_time_follow_parameter_updates():
    model = random_dit(TINY, 0)
    args = step_inputs()
    rules = RulesConfig(assume_device="cuda", capability=H200, tf32=True, env={})
    eager = EagerCompiler()
    step = torch.compile(make_step(model), backend=TorchCfmBackend(rules, compiler=eager))
    step(*args)
    (gm,) = eager.graphs
    n_pack = 4 + 18 * TINY.depth + 4 + 2  # body + time-embedding MLP + adaLN weight/bias
    assert len(list(gm.buffers())) == n_pack
    with torch.no_grad():  # in place: version counters move
        model.in_proj.weight.mul_(1.5)
        model.blocks[0].attn.to_k.bias.add_(0.25)
    updated = step(*args)
    same_dtype = model.forward_chunk(*args[:7], valid_lengths=args[7], cache_lengths=args[8], fused=False)
    assert_step_within_oracle(model, args, updated, same_dtype)
    model.blocks[0].mlp.fc1.weight = torch.nn.Parameter(torch.randn_like(model.blocks[0].mlp.fc1.weight))
    replaced = step(*args)  # a new Parameter object: a new graph input, repacked as well
    same_dtype = model.forward_chunk(*args[:7], valid_lengths=args[7], cache_lengths=args[8], fused=False)
    assert_step_within_oracle(model, args, replaced, same_dtype)
    assert len(eager.graphs) == 1  # no recompile was needed for either update


def test_steps_of_one_graph_share_one_pack():
    model = random_dit(TINY, 0)
    args = step_inputs(ragged=False)
    step = make_step(model)

    def two_steps(x, mu, t, spks, cond, cnn, att, valid_lengths, cache_lengths):
        v, cnn1, att1 = step(x, mu, t, spks, cond, cnn, att, None, None)
        return step(x + 0.1 * v, mu, t + 0.1, spks, cond, cnn1, att1, None, None)

    rules = RulesConfig(assume_device="cuda", capability=H200, tf32=True, env={})
    eager = EagerCompiler()
    be = TorchCfmBackend(rules, compiler=eager)
    fast = torch.compile(two_steps, backend=be)(*args)
    (gm,) = eager.graphs
    assert [s.action for s in be.sites if s.rule == "dit_step"] == ["fused", "fused"]
    assert len(list(gm.buffers())) == 4 + 18 * TINY.depth + 4 + 2  # one pack, not two
    ref = two_steps(*args)
    for got, want in zip(fast, ref):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_explicit_fused_argument_of_the_marker_wins_over_the_rules_config():
    model = random_dit(TINY, 0)
    args = step_inputs(ragged=False)

    def step(x, mu, t, spks, cond, cnn, att, valid_lengths, cache_lengths):
        out = model.forward_chunk(x, mu, t, spks, cond, cnn, att, fused=False)
        mark_dit_step(model, out, x, mu, t, spks, cond, cnn, att, fused=False)
        return out

    be = TorchCfmBackend(RulesConfig(assume_device="cuda", capability=H200, tf32=True, fused=True, env={}),
                         compiler=EagerCompiler())
    torch.compile(step, backend=be)(*args)
    (site,) = [s for s in be.sites if s.rule == "dit_step"]
    assert site.action == "kept" and site.reasons == ("disabled by argument",)


def test_a_step_marked_twice_is_one_site():
    model = random_dit(TINY, 0)
    args = step_inputs()

    def twice(x, mu, t, spks, cond, cnn, att, valid_lengths, cache_lengths):
        out = model.forward_chunk(x, mu, t, spks, cond, cnn, att, valid_lengths=valid_lengths,
                                  cache_lengths=cache_lengths)  # marks the step itself
        for _ in range(2):  # plus a caller's marks of the same step
            mark_dit_step(model, out, x, mu, t, spks, cond, cnn, att, valid_lengths=valid_lengths,
                          cache_lengths=cache_lengths)
        return out

    eager = EagerCompiler()
    be = TorchCfmBackend(RulesConfig(assume_device="cuda", capability=H200, tf32=True, env={}), compiler=eager)
    torch.compile(twice, backend=be)(*args)
    assert [s.action for s in be.sites if s.rule == "dit_step"] == ["fused"]
    assert graph_targets(eager.graphs[0]).count(fused_dit_step_prepacked) == 1


def test_mark_dit_step_is_a_no_op_in_eager():
    model = random_dit(TINY, 0)
    args = step_inputs()
    out = make_step(model)(*args)  # would raise if the marker op ran with bad arguments
    assert out[0].shape == args[0].shape


@pytest.mark.slow
def test_inductor_output_code_calls_the_fused_body_and_no_attention():
    from torch._inductor.utils import run_and_get_code

    model = random_dit(TINY, 0)
    args = step_inputs()
    rules = RulesConfig(assume_device="cuda", capability=H200, tf32=True, env={})
    with torch.no_grad():
        fast, codes = run_and_get_code(torch.compile(make_step(model), backend=TorchCfmBackend(rules)), *args)
    code = "\n".join(codes)
    assert "torch.ops.torch_cfm.dit_body.default(" in code
    assert "cfm_attention" not in code and "_dit_step_marker" not in code
    same_dtype = model.forward_chunk(*args[:7], valid_lengths=args[7], cache_lengths=args[8], fused=False)
    assert_step_within_oracle(model, args, fast, same_dtype)


# ------------------------------------------------------------------------------------------
# explain
# ------------------------------------------------------------------------------------------


def test_explain_lists_every_site_with_its_reason_on_cpu():
    model = random_dit(TINY, 0)
    text = explain_model(make_step(model), step_inputs(), config=RulesConfig(tf32=False, env={}))
    assert "graphs: 1\n" in text and f"sites: {1 + TINY.depth}" in text
    assert "dit_step [" in text and "float32 on cpu: kept (reference step kept)" in text
    assert text.count("      - needs a CUDA device, found cpu") == 1 + TINY.depth
    assert text.count("      - fp32 with TF32 off") == 1  # the step's reason; attention pins ieee
    assert "precision=ieee" in text


def test_explain_for_an_h200_and_a_t4_from_a_cpu_machine():
    model = random_dit(TINY, 0)
    args = step_inputs()
    h200 = explain_model(make_step(model), args, config=RulesConfig(assume_device="cuda", capability=H200,
                                                                    tf32=True, env={}))
    assert "sites: 1 (fused 1)" in h200 and "fused (torch_cfm::dit_body precision=tf32)" in h200
    t4 = explain_model(make_step(model), args, config=RulesConfig(assume_device="cuda", capability=T4,
                                                                  tf32=True, env={}))
    assert "kept (reference step kept)" in t4 and "needs NVIDIA SM80+, found SM75" in t4
    assert "attention=sdpa precision=tf32" in t4


def test_torch_cfm_explain_delegates_for_a_model():
    model = random_dit(TINY, 0)
    text = torch_cfm.explain(model.forward_chunk, step_inputs()[:7], file=False)
    assert text.startswith("torch_cfm.compile_rules.explain") and "cfm_attention [" in text


def test_explain_leaves_the_models_dynamo_cache_alone():
    model = random_dit(TINY, 0)
    args = step_inputs()
    for _ in range(3):
        explain_model(make_step(model), args)
    code = type(model).forward_chunk.__code__
    assert torch._C._dynamo.eval_frame._debug_get_cache_entry_list(code) == []


# ------------------------------------------------------------------------------------------
# cache uuid
# ------------------------------------------------------------------------------------------


def test_uuid_is_stable_and_changes_with_policy_inputs(tf32_flag, monkeypatch):
    monkeypatch.delenv("TORCH_CFM_FUSED", raising=False)
    monkeypatch.delenv("TORCH_CFM_TF32", raising=False)
    torch.backends.cuda.matmul.allow_tf32 = False
    base = TorchCfmPass().uuid()
    assert isinstance(base, str) and base == TorchCfmPass().uuid()
    seen = {base}
    for config in (RulesConfig(fused=True), RulesConfig(fused=False), RulesConfig(tf32=True),
                   RulesConfig(capability=T4), RulesConfig(guard_clones=False)):
        seen.add(TorchCfmPass(config).uuid())
    assert len(seen) == 6
    torch.backends.cuda.matmul.allow_tf32 = True
    flipped = TorchCfmPass().uuid()
    assert flipped not in seen
    torch.backends.cuda.matmul.allow_tf32 = False
    assert TorchCfmPass().uuid() == base
    monkeypatch.setenv("TORCH_CFM_FUSED", "0")
    assert TorchCfmPass().uuid() not in seen | {flipped}
    monkeypatch.delenv("TORCH_CFM_FUSED")
    monkeypatch.setenv("TORCH_CFM_TF32", "on")
    assert TorchCfmPass().uuid() not in seen | {flipped}


def test_uuid_hashes_the_rules_source():
    files = compile_rules.passes.source_files()
    names = {f.replace("\\", "/").rsplit("/", 1)[-1] for f in files}
    assert {"attention.py", "dit_step.py", "clone_guard.py", "policy.py", "backend.py", "markers.py",
            "packing.py", "dit_body.py"} <= names


# ------------------------------------------------------------------------------------------
# install / uninstall into stock Inductor (2.11: one pass per slot; 2.13: lists)
# ------------------------------------------------------------------------------------------


def test_install_adds_one_pass_to_both_slots_and_uninstall_keeps_others():
    from torch._inductor import config as inductor_config

    def user_pass(graph):
        return None

    with inductor_config.patch(pre_grad_custom_pass=user_pass, joint_custom_pre_pass=None):
        rules = compile_rules.install()
        try:
            assert hooks.passes_in(inductor_config.pre_grad_custom_pass) == [user_pass, rules]
            assert hooks.passes_in(inductor_config.joint_custom_pre_pass) == [rules]
            again = compile_rules.install()  # replaces, never stacks
            assert hooks.passes_in(inductor_config.pre_grad_custom_pass) == [user_pass, again]
        finally:
            compile_rules.uninstall()
        assert inductor_config.pre_grad_custom_pass in (user_pass, [user_pass])
        assert inductor_config.joint_custom_pre_pass is None


def test_slots_on_torch_2_11_take_a_single_chained_pass(monkeypatch):
    monkeypatch.setattr(hooks, "slots_take_lists", lambda: False)
    calls = []

    def user_pass(graph):
        calls.append("user")

    rules = TorchCfmPass()
    value = hooks.add_pass(user_pass, rules)
    assert isinstance(value, hooks.ChainedPass) and value.passes == [user_pass, rules]
    assert value.uuid() is None  # a member without uuid: Inductor must not cache
    value(torch.fx.Graph())
    assert calls == ["user"]
    assert hooks.add_pass(None, rules) is rules
    assert hooks.remove_pass(value, rules) is user_pass
    both = hooks.add_pass(TorchCfmPass(RulesConfig(fused=True)), rules)
    assert isinstance(both.uuid(), str)


def test_installed_rules_run_under_plain_torch_compile(tf32_flag, no_compile_caches):
    torch.backends.cuda.matmul.allow_tf32 = False
    args = attention_inputs()
    with compile_rules.installed(RulesConfig(env={})) as rules:
        out = torch.compile(attention_fn)(*args)
    sites = [s for s in rules.sites if s.rule == "cfm_attention"]
    assert sites and sites[0].stage == "dynamo" and sites[0].detail == "attention=reference precision=ieee"
    assert (out.double() - attention_oracle(*args)).abs().max().item() < 1e-5


# ------------------------------------------------------------------------------------------
# clone guard (pytorch#198031)
# ------------------------------------------------------------------------------------------


@torch.library.custom_op("cfm_rules_test::reverse_into", mutates_args=("dst",))
def reverse_into(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst[i] = src[n-1-i], element by element: reads src while writing dst."""
    n = src.shape[0]
    for k in range(n):
        dst[n - 1 - k] = src[k]


def clone_then_mutate(x):
    y = x.clone()
    reverse_into(y, x)
    return x * 2.0


def mutate_from_other(x, src):
    reverse_into(src, x)
    return x * 2.0


def test_clone_then_mutate_keeps_its_copy(no_compile_caches):
    from torch._inductor.utils import run_and_get_code

    be = TorchCfmBackend(RulesConfig(guard_namespaces=("cfm_rules_test",)))
    x = torch.arange(8.0)
    out, (code,) = run_and_get_code(torch.compile(clone_then_mutate, backend=be), x)
    assert x.tolist() == [7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.0]
    assert out.tolist() == [14.0, 12.0, 10.0, 8.0, 6.0, 4.0, 2.0, 0.0]
    assert "reverse_into.default(arg0_1, arg0_1)" not in code
    (site,) = [s for s in be.last_pass.sites if s.rule == "clone_guard"]
    assert site.action == "guarded" and "pytorch#198031" in site.detail


def test_no_copy_is_added_when_the_op_reads_another_tensor(no_compile_caches):
    from torch._inductor.utils import run_and_get_code

    be = TorchCfmBackend(RulesConfig(guard_namespaces=("cfm_rules_test",)))
    x, src = torch.zeros(8), torch.arange(8.0)
    _, (code,) = run_and_get_code(torch.compile(mutate_from_other, backend=be), x, src)
    assert x.tolist() == [7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.0]
    assert "reverse_into.default(arg0_1, arg1_1)" in code  # in place, no copy of x
    assert not [s for s in be.last_pass.sites if s.rule == "clone_guard"]


# ------------------------------------------------------------------------------------------
# GPU: the real swap, reduce-overhead, stream order, timing (run on the H200 by the lead)
# ------------------------------------------------------------------------------------------

GPU_CFG = DiTConfig(depth=2)  # the shipped widths (C=512, H=8, D=64), two blocks


def gpu_model(dtype, config=GPU_CFG):
    return random_dit(config, 0).to("cuda", dtype).eval()


def full_lengths(n_rows, t_len, cache_len):
    return (torch.full((n_rows,), t_len, dtype=torch.int32, device="cuda"),
            torch.full((n_rows,), cache_len, dtype=torch.int32, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gpu_real_swap_within_oracle(dtype, tf32_flag, no_compile_caches):
    from torch._inductor.utils import run_and_get_code

    torch.backends.cuda.matmul.allow_tf32 = True  # fp32 fuses with TF32 (docs/design.md §5)
    model = gpu_model(dtype)
    args = step_inputs(GPU_CFG, n_rows=4, t_len=10, cache_len=12, dtype=dtype, device="cuda")
    be = TorchCfmBackend()
    with torch.no_grad():
        fast, codes = run_and_get_code(torch.compile(make_step(model), backend=be), *args)
        same_dtype = model.forward_chunk(*args[:7], valid_lengths=args[7], cache_lengths=args[8], fused=False)
    code = "\n".join(codes)
    assert "torch.ops.torch_cfm.dit_body.default(" in code and "cfm_attention" not in code
    (site,) = [s for s in be.sites if s.rule == "dit_step"]
    assert site.action == "fused" and site.reasons == ()
    assert_step_within_oracle(model, args, fast, same_dtype)


@pytest.mark.gpu
def test_gpu_fp32_without_tf32_keeps_the_reference(tf32_flag):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = gpu_model(torch.float32)
    args = step_inputs(GPU_CFG, n_rows=2, t_len=6, cache_len=5, device="cuda")
    be = TorchCfmBackend(compiler=EagerCompiler())
    with torch.no_grad():
        torch.compile(make_step(model), backend=be)(*args)
    (site,) = [s for s in be.sites if s.rule == "dit_step"]
    assert site.action == "kept" and site.reasons == ("fp32 with TF32 off",)
    assert {s.detail for s in be.sites if s.rule == "cfm_attention"} == {"attention=triton precision=ieee"}


class ArenaStep(torch.nn.Module):
    """A chunk step over a cache arena held as module buffers (static under CUDA graphs)."""

    def __init__(self, model, n_rows, t_len, cache_len, clone_first=False):
        super().__init__()
        c, dt = model.config, model.in_proj.weight.dtype
        self.model, self.cache_len, self.clone_first = model, cache_len, clone_first
        # decided here: inspect.getsource inside forward is a graph break, and the resumed frame's
        # arena writes then count as mutated inputs (a cudagraph skip seen on the H200)
        self.marks_itself = model_marks_itself(model)
        g = torch.Generator().manual_seed(5)
        self.register_buffer("att_arena", torch.randn(c.depth, n_rows, c.heads, t_len + cache_len,
                                                      2 * c.head_dim, generator=g).to("cuda", dt))
        self.register_buffer("cnn_arena", torch.randn(c.depth, n_rows, 2 * c.hidden, 2, generator=g).to("cuda", dt))

    def forward(self, x, mu, t, spks, cond):
        att = self.att_arena[:, :, :, :self.cache_len]
        cnn = self.cnn_arena
        if self.clone_first:  # the pytorch#198031 shape: read a clone of what is written below
            att, cnn = att.clone(), cnn.clone()
        if self.marks_itself:
            out = self.model.forward_chunk(x, mu, t, spks, cond, cnn, att)
        else:
            out = self.model.forward_chunk(x, mu, t, spks, cond, cnn, att, fused=False)
            mark_dit_step(self.model, out, x, mu, t, spks, cond, cnn, att)
        velocity, new_cnn, new_att = out
        self.cnn_arena.copy_(new_cnn)
        self.att_arena.copy_(new_att)  # new window = T current + L old frames
        return velocity


@pytest.mark.gpu
@pytest.mark.parametrize("clone_first", [False, True], ids=["in-place", "clone-then-mutate"])
def test_gpu_reduce_overhead_no_skips_no_arena_copies(clone_first, no_compile_caches):
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    dtype, n_rows, t_len, cache_len = torch.float16, 2, 8, 8
    model = gpu_model(dtype)
    arena = ArenaStep(model, n_rows, t_len, cache_len, clone_first)
    compiled = torch.compile(arena, backend="torch_cfm", mode="reduce-overhead")
    counters.clear()
    c = GPU_CFG
    arena_shape = f"({c.depth}, {n_rows}, {c.heads}, {t_len + cache_len}, {2 * c.head_dim})"
    for i in range(3):
        x, mu, t, spks, cond = step_inputs(GPU_CFG, n_rows, t_len, cache_len, dtype=dtype, device="cuda")[:5]
        before_att = arena.att_arena[:, :, :, :cache_len].clone()
        before_cnn = arena.cnn_arena.clone()
        with torch.no_grad():
            if i == 0:
                velocity, codes = run_and_get_code(compiled, x, mu, t, spks, cond)
                code = "\n".join(codes)
            else:
                velocity = compiled(x, mu, t, spks, cond)
            velocity = velocity.clone()  # CUDA-graph outputs are overwritten by the next replay
            ref = model.forward_chunk(x, mu, t, spks, cond, before_cnn, before_att, fused=False)
        args = (x, mu, t, spks, cond, before_cnn, before_att) + full_lengths(n_rows, t_len, cache_len)
        assert_step_within_oracle(model, args, (velocity, arena.cnn_arena, arena.att_arena), ref)
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert "torch.ops.torch_cfm.dit_body.default(" in code
    # no arena-sized temporary: the new window is copied straight into the static buffer (a clone
    # the user wrote of the cache window may stay; it is smaller and it is theirs)
    allocations = [line for line in code.splitlines() if "empty_strided_cuda(" + arena_shape in line]
    assert not allocations, allocations


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_gpu_linear_before_attention_on_a_side_stream(mode):
    n_rows, heads, q_len, k_len, head_dim = 2, 8, 16, 40, 64
    lin = torch.nn.Linear(heads * head_dim, heads * head_dim).to("cuda", torch.float16)

    def f(x, cache, lengths):
        q = lin(x).view(n_rows, q_len, heads, head_dim).transpose(1, 2)
        return torch_cfm.cfm_attention(q, cache[..., :head_dim], cache[..., head_dim:], key_lengths=lengths)

    compiled = torch.compile(f, backend="torch_cfm", mode=mode)
    lengths = torch.tensor([k_len, 17], dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    for _ in range(4):
        x = torch.randn(n_rows, q_len, heads * head_dim, device="cuda", dtype=torch.float16)
        cache = torch.randn(n_rows, heads, k_len, 2 * head_dim, device="cuda", dtype=torch.float16)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            out = compiled(x, cache, lengths).clone()
            same = f(x, cache, lengths)
        torch.cuda.current_stream().wait_stream(stream)
        q64 = (x.double() @ lin.weight.double().T + lin.bias.double()).view(n_rows, q_len, heads, head_dim)
        ref64 = naive_attention64(q64.transpose(1, 2), cache[..., :head_dim].double(), cache[..., head_dim:].double(),
                                  key_lengths=lengths.cpu())
        assert_within_oracle(out.cpu(), same.cpu(), ref64, "attention after linear")


def compiled_and_direct_step():
    """(config, direct, compiled, args) of the timing tests: a depth-4 fp16 step at (8,50,400),
    called directly on the fused path and through torch.compile(backend="torch_cfm")."""
    from torch_cfm.models.fused_forward import dit_forward_chunk_fused

    config = DiTConfig(depth=4)
    model = gpu_model(torch.float16, config)
    args = step_inputs(config, n_rows=8, t_len=50, cache_len=400, ragged=False, dtype=torch.float16, device="cuda")

    def direct(*a):
        return dit_forward_chunk_fused(model, *a[:7])

    return config, direct, torch.compile(make_step(model), backend="torch_cfm"), args


def elapsed_ms(run) -> float:
    """GPU ms of one ``run()`` between two events (waits for it)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


@pytest.mark.gpu
@pytest.mark.timing
def test_gpu_compiled_step_close_to_calling_the_fused_path():
    """Loose timing guard, eager launches (the 5 % target is the CUDA-graph row "torch_cfm/compiled"
    vs "torch_cfm/hook" of bench/dit_step.py): compiled vs direct call."""
    config, direct, compiled, args = compiled_and_direct_step()

    def one_ms(fn):
        return elapsed_ms(lambda: fn(*args))

    from torch_cfm.compile_rules import markers

    repacks = {"n": 0}
    refresh = markers.PackBinding.refresh

    def counting_refresh(self, call_args):
        did = refresh(self, call_args)
        repacks["n"] += int(did)
        return did

    # Interleaved, best of 30 each: the GPU suite runs tests in parallel processes on one GPU, and
    # contention only ever adds time (a median failed there once while passing alone).
    with torch.no_grad():
        for _ in range(5):
            direct(*args)
            compiled(*args)
        markers.PackBinding.refresh = counting_refresh
        try:
            pairs = [(one_ms(direct), one_ms(compiled)) for _ in range(30)]
        finally:
            markers.PackBinding.refresh = refresh
    t_direct, t_compiled = min(p[0] for p in pairs), min(p[1] for p in pairs)
    print(f"dit step depth={config.depth} fp16 (8,50,400): direct {t_direct:.3f} ms, "
          f"torch_cfm compiled {t_compiled:.3f} ms ({t_compiled / t_direct:.3f}x; target <= 1.05x); "
          f"weight repacks while timing: {repacks['n']}")
    if t_compiled > 1.25 * t_direct + 0.02:  # say where the time goes before failing
        from torch.profiler import ProfilerActivity, profile

        for name, fn in (("direct", direct), ("compiled", compiled)):
            with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                fn(*args)
                torch.cuda.synchronize()
            print(name, prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    assert repacks["n"] == 0, "the compiled step repacked its weights although no parameter changed"
    assert t_compiled <= 1.25 * t_direct + 0.02


@pytest.mark.gpu
@pytest.mark.timing
def test_gpu_compiled_step_within_5_percent_in_a_cuda_graph():
    """Issue 5's target, timed as served (each path captured in a CUDA graph, so host overhead
    is out): the torch.compile(backend="torch_cfm") step vs the fused path called directly.
    Measured with bench/dit_step.py on the H200 at depth 16: -2 % to +0.5 %."""
    config, direct, compiled, args = compiled_and_direct_step()

    def capture(fn):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(*args)
        return graph

    def one_ms(graph):
        return elapsed_ms(graph.replay)

    with torch.no_grad():
        g_direct = capture(direct)
        g_compiled = capture(compiled)
    for _ in range(3):
        g_direct.replay()
        g_compiled.replay()
    # interleaved, best of 30: parallel test processes share the GPU and only ever add time
    pairs = [(one_ms(g_direct), one_ms(g_compiled)) for _ in range(30)]
    t_direct, t_compiled = min(p[0] for p in pairs), min(p[1] for p in pairs)
    print(f"dit step depth={config.depth} fp16 (8,50,400) in a CUDA graph: direct {t_direct:.3f} ms, "
          f"compiled {t_compiled:.3f} ms ({t_compiled / t_direct:.3f}x)")
    assert t_compiled <= 1.05 * t_direct + 0.005
