"""The DiT body's GEMMs on CUTLASS (``torch_cfm.kernels.cutlass_gemm``, ``libtcfm_cutlass.so``).

CPU: the loader's reasons for an absent or broken library, the body's role shapes, the operand
checks (ValueError naming the argument) and ``linear_into`` leaving what it cannot run to its caller.
GPU (gpu-marked; skipped where the library is not built or
the GPU is not SM90): every config x role x dtype against a float64 product, within the oracle of
cuBLAS called as the body calls it, at 32 and 128 rows and at tile edges (M = 1, 77), with NaN-poisoned
outputs fully written and nothing written past them; strided operands; PDL launches bitwise equal to
plain ones; ValueError for misaligned operands, unknown or GELU-less configs and short workspaces; each
schedule captured in a CUDA graph and replayed on new inputs, bitwise equal to eager calls.
"""

from __future__ import annotations

import pytest
import torch

import strategies as S
from oracle import assert_within_oracle
from torch_cfm.kernels import cutlass_gemm as cg

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def test_absent_library_gives_a_reason(tmp_path):
    path = str(tmp_path / "libtcfm_cutlass.so")
    assert cg.load_library(path) is None
    why = cg.unavailable_reason(path)
    assert "not built" in why and "csrc/cutlass/build.sh" in why and cg.ENV_VAR in why
    assert cg.configs(path) == ()
    assert cg.workspace_bytes("coop_128x256", 1600, 1536, 512, torch.float16, path=path) is None


def test_broken_library_gives_a_reason(tmp_path):
    bad = tmp_path / "broken.so"
    bad.write_bytes(b"not an ELF file")
    assert cg.load_library(str(bad)) is None
    assert "does not load" in cg.unavailable_reason(str(bad))


def test_library_path_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv(cg.ENV_VAR, str(tmp_path / "x.so"))
    assert cg.library_path() == str(tmp_path / "x.so")
    assert cg.library_path("elsewhere.so").endswith("elsewhere.so")
    monkeypatch.delenv(cg.ENV_VAR)
    assert cg.library_path() == cg.DEFAULT_PATH


def test_body_roles_at_32_rows():
    roles = {r.name: r for r in cg.body_roles(32)}
    assert [(r.m, r.n, r.k, r.bias, r.gelu) for r in roles.values()] == [
        (1600, 1536, 512, True, False), (1600, 512, 512, True, False), (1664, 1536, 512, False, False),
        (1600, 2048, 512, True, True), (1600, 512, 2048, True, False)]
    assert roles["fc2"].flop == 2.0 * 1600 * 512 * 2048


def test_linear_into_leaves_what_it_cannot_run_to_its_caller(tmp_path):
    """linear_into (the body's CUTLASS roles) returns False and writes nothing where
    not_supported_reasons names a reason: here an absent library and CPU operands."""
    h = torch.float16
    a, w, b = torch.randn(4, 64).to(h), torch.randn(32, 64).to(h), torch.randn(32).to(h)
    out = torch.full((4, 32), 7.0, dtype=h)
    absent = str(tmp_path / "libtcfm_cutlass.so")
    reasons = cg.not_supported_reasons(a, w, b, out, "pingpong_128x128", path=absent)
    assert any("not built" in r for r in reasons) and any("a must be on a CUDA device" in r for r in reasons)
    assert cg.linear_into(a, w, b, out, "pingpong_128x128", path=absent) is False
    assert (out == 7.0).all()
    # CPU operands are refused whether or not the default library loads
    assert any("CUDA device" in r for r in cg.not_supported_reasons(a, w, b, out, "pingpong_128x128"))
    assert cg.linear_into(a, w, None, out, "pingpong_128x128") is False and (out == 7.0).all()


@pytest.mark.parametrize("case,arg", [
    ("float32 a", "a must be float16 or bfloat16"), ("w of another K", "w must have shape (*, 64)"),
    ("w of another dtype", "w must have a's dtype"), ("bias of another length", "bias must be None or a (32,)"),
    ("out of another shape", "out must have shape (4, 32)"), ("N not a multiple of 8", "a / w must give"),
    ("1-D a", "a must be 2-D"), ("cpu tensors", "a must be on a CUDA device")])
def test_operand_checks_name_the_argument(case, arg):
    h = torch.float16
    a, w, b, out = torch.zeros(4, 64, dtype=h), torch.zeros(32, 64, dtype=h), torch.zeros(32, dtype=h), None
    if case == "float32 a":
        a = a.float()
    elif case == "w of another K":
        w = torch.zeros(32, 72, dtype=h)
    elif case == "w of another dtype":
        w = w.bfloat16()
    elif case == "bias of another length":
        b = torch.zeros(33, dtype=h)
    elif case == "out of another shape":
        out = torch.zeros(4, 40, dtype=h)
    elif case == "N not a multiple of 8":
        w, b = torch.zeros(30, 64, dtype=h), None
    elif case == "1-D a":
        a = torch.zeros(64, dtype=h)
    with pytest.raises(ValueError, match="^cutlass_linear: " + arg.replace("(", r"\(").replace(")", r"\)")
                       .replace("*", r"\*")):
        cg.cutlass_linear(a, w, b, config=0, out=out)


# --- GPU -----------------------------------------------------------------------------------------

def _configs_or_skip():
    why = cg.unavailable_reason()
    if why:
        pytest.skip(why)
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the CUTLASS GEMMs are built for sm_90a (Hopper)")
    return cg.configs()


def _operands(m, n, k, bias, dtype, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    a = torch.randn(m, k, generator=g).to("cuda", dtype)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to("cuda", dtype)
    b = (torch.randn(n, generator=g) * 0.1).to("cuda", dtype) if bias else None
    return a, w, b


def _reference(a, w, b, gelu):
    ref = a.double() @ w.double().t() + (b.double() if b is not None else 0)
    return torch.nn.functional.gelu(ref, approximate="tanh") if gelu else ref


def _cublas(a, w, b, gelu):
    """The body's cuBLAS call (dit_body.py), the oracle's same-dtype baseline."""
    if gelu:
        return torch._addmm_activation(b, a, w.t(), use_gelu=True)
    return torch.addmm(b, a, w.t()) if b is not None else a @ w.t()


def _shapes(role_name):
    """(M, N, K, bias, gelu) of the role at 32 and 128 rows and at two tile edges."""
    roles = [next(r for r in cg.body_roles(rows) if r.name == role_name) for rows in (32, 128)]
    r = roles[0]
    return [(x.m, x.n, x.k, x.bias, x.gelu) for x in roles] + [(m, r.n, r.k, r.bias, r.gelu) for m in (1, 77)]


@pytest.mark.gpu
@pytest.mark.parametrize("dname", DTYPES)
@pytest.mark.parametrize("role", ["qkv", "proj", "conv", "fc1", "fc2"])
def test_gpu_every_config_within_oracle(role, dname):
    cfgs = _configs_or_skip()
    dtype = DTYPES[dname]
    for m, n, k, bias, gelu in _shapes(role):
        a, w, b = _operands(m, n, k, bias, dtype, seed=m + n + k)
        ref, same = _reference(a, w, b, gelu).cpu(), _cublas(a, w, b, gelu).cpu()
        for cfg in (c for c in cfgs if c.gelu or not gelu):
            buf = torch.full((m + 3, n), float("nan"), device="cuda", dtype=dtype)
            cg.cutlass_linear(a, w, b, config=cfg, gelu=gelu, out=buf[:m])
            torch.cuda.synchronize()
            assert torch.isnan(buf[m:]).all(), f"{cfg.name} M={m}: wrote past row {m}"
            assert_within_oracle(buf[:m].cpu(), same, ref, f"{cfg.name} {role} {dname} M={m}")


@pytest.mark.gpu
@pytest.mark.parametrize("dname", DTYPES)
def test_gpu_strided_operands_and_pdl(dname):
    """a and out as column slices of wider buffers (row strides K + 64, N + 64): the same bits as
    contiguous operands, the padding columns untouched; a PDL launch gives the same bits too."""
    cfgs = _configs_or_skip()
    dtype = DTYPES[dname]
    m, n, k = 1600, 1536, 512
    a, w, b = _operands(m, n, k, True, dtype, seed=3)
    wide_a = torch.randn(m, k + 64, device="cuda").to(dtype)
    wide_a[:, :k] = a
    for cfg in cfgs:
        want = cg.cutlass_linear(a, w, b, config=cfg)
        wide_out = torch.full((m, n + 64), 7.0, device="cuda", dtype=dtype)
        cg.cutlass_linear(wide_a[:, :k], w, b, config=cfg, out=wide_out[:, :n])
        pdl = cg.cutlass_linear(a, w, b, config=cfg, pdl=True)
        torch.cuda.synchronize()
        assert torch.equal(wide_out[:, :n], want), cfg.name
        assert (wide_out[:, n:] == 7.0).all(), cfg.name
        assert torch.equal(pdl, want), cfg.name


@pytest.mark.gpu
def test_gpu_linear_into_runs_a_config_or_names_why_not():
    """linear_into runs a library config bitwise like cutlass_linear; an unknown config is a reason
    (False, nothing written), not an error."""
    cfgs = _configs_or_skip()
    h = torch.float16
    a, w, b = _operands(1600, 512, 512, True, h, seed=8)
    out = torch.empty(1600, 512, device="cuda", dtype=h)
    assert cg.not_supported_reasons(a, w, b, out, cfgs[0].name) == []
    assert cg.linear_into(a, w, b, out, cfgs[0].name) is True
    assert torch.equal(out, cg.cutlass_linear(a, w, b, config=cfgs[0]))
    untouched = torch.full_like(out, 7.0)
    assert any("not one of the library's" in r for r in cg.not_supported_reasons(a, w, b, untouched, "no_such"))
    assert cg.linear_into(a, w, b, untouched, "no_such") is False
    torch.cuda.synchronize()
    assert (untouched == 7.0).all()


@pytest.mark.gpu
def test_gpu_bad_calls_raise_value_error():
    cfgs = _configs_or_skip()
    h = torch.float16
    a, w, b = _operands(64, 512, 512, True, h, seed=4)
    shifted = torch.zeros(64 * 512 + 8, device="cuda", dtype=h)[1:1 + 64 * 512].view(64, 512)
    with pytest.raises(ValueError, match="^cutlass_linear: a must have unit column stride.*16-byte aligned"):
        cg.cutlass_linear(shifted, w, b, config=0)
    with pytest.raises(ValueError, match="^cutlass_linear: w must have unit column stride"):
        cg.cutlass_linear(a, w.t().contiguous().t(), b, config=0)
    with pytest.raises(ValueError, match="^cutlass_linear: config must be a CutlassConfig"):
        cg.cutlass_linear(a, w, b, config="no_such_config")
    no_gelu = [c for c in cfgs if not c.gelu]
    if no_gelu:
        with pytest.raises(ValueError, match="^cutlass_linear: config must have the GELU epilogue"):
            cg.cutlass_linear(a, w, b, config=no_gelu[0], gelu=True)
    for cfg in cfgs:
        need = cg.workspace_bytes(cfg, 64, 512, 512, h)
        if need:
            short = torch.empty(need - 1, device="cuda", dtype=torch.uint8)
            with pytest.raises(ValueError, match=f"^cutlass_linear: workspace must be .* >= {need} bytes"):
                cg.cutlass_linear(a, w, b, config=cfg, workspace=short)


@pytest.mark.gpu
@pytest.mark.parametrize("dname", DTYPES)
def test_gpu_graph_capture_replay_bitwise(dname):
    """A chain qkv-shaped -> proj-shaped GEMM of every config (stream-K: workspace zeroed inside the
    graph) captured once, replayed on three new inputs: bitwise equal to the eager chain each time."""
    cfgs = _configs_or_skip()
    dtype = DTYPES[dname]
    m = 1600
    _, w1, b1 = _operands(m, 1536, 512, True, dtype, seed=5)
    _, w2, b2 = _operands(m, 512, 512, True, dtype, seed=6)
    x = torch.empty(m, 512, device="cuda", dtype=dtype)
    g = torch.Generator(device="cpu").manual_seed(7)
    inputs = [torch.randn(m, 512, generator=g).to("cuda", dtype) for _ in range(3)]
    for cfg in cfgs:
        mid = torch.empty(m, 1536, device="cuda", dtype=dtype)
        out = torch.empty(m, 512, device="cuda", dtype=dtype)
        ws = [None if not n else torch.empty(n, device="cuda", dtype=torch.uint8)
              for n in (cg.workspace_bytes(cfg, m, 1536, 512, dtype), cg.workspace_bytes(cfg, m, 512, 512, dtype))]

        def chain(cfg=cfg, mid=mid, out=out, ws=ws):
            cg.cutlass_linear(x, w1, b1, config=cfg, out=mid, workspace=ws[0])
            cg.cutlass_linear(mid[:, 512:1024], w2, b2, config=cfg, out=out, workspace=ws[1])

        want = []
        for inp in inputs:
            x.copy_(inp)
            chain()
            want.append(out.clone())
        graph, _ = S.capture_cuda_graph(chain)
        for inp, expected in zip(inputs[::-1], want[::-1]):
            x.copy_(inp)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, expected), cfg.name
        del graph
