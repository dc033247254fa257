"""The DiT body's row-norm boundary on the hand-written CUDA kernel (kernels/dit_rownorm_cuda.py).

* CPU: the reasons a call stays on Triton (no CUDA device, C != 512, unaligned rows).
* GPU (``gpu`` marker): every boundary the body launches (in_proj, proj with and without an old conv
  cache, conv 1 with its affine LayerNorm + Mish and emit, conv 2, fc2), per-sequence and shared
  modulation tables, fp16/bf16/fp32, ragged rows incl. T_n = 0, against the Triton kernel (the
  body's oracle-tested row-norm): outputs, the residual stream and the emitted conv cache; a CUDA
  graph replay equals an eager call bitwise. The whole body with the CUDA row-norm is checked
  against the SPEC §6 oracle in tests/test_dit_body.py (test_gpu_fused_cuda_rownorm_within_oracle).
"""

from __future__ import annotations

import pytest
import torch

from torch_cfm.config import BLOCK_LN_EPS, CONV_LN_EPS
from torch_cfm.kernels import dit_rownorm_cuda

C = dit_rownorm_cuda.CHANNELS


def test_reasons_on_cpu_and_other_widths():
    y = torch.zeros(4, C)
    h = torch.zeros(4, C)
    why = dit_rownorm_cuda.not_supported_reasons(y, h, y.clone(), bias=None, table=None, ln_affine=None)
    assert any("CUDA" in r for r in why), why
    narrow = torch.zeros(4, 64)
    why = dit_rownorm_cuda.not_supported_reasons(narrow, narrow.clone(), narrow.clone(), bias=None, table=None,
                                                 ln_affine=None)
    assert any("C = 512" in r for r in why), why


def test_misaligned_rows_are_reported():
    base = torch.zeros(5, C + 1, dtype=torch.float16)
    assert dit_rownorm_cuda._misaligned(base[:, :C])  # row stride of C + 1 halves: not 16-byte multiples
    assert dit_rownorm_cuda._misaligned(base.view(-1)[1:1 + 4 * C].view(4, C))  # base pointer off by 2 bytes
    assert not dit_rownorm_cuda._misaligned(torch.zeros(4, C, dtype=torch.float16))
    assert not dit_rownorm_cuda._misaligned(None)


N, T = 3, 7
VALID = [7, 3, 0]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
BOUNDARIES = ["in_proj", "proj", "proj_nocnn", "conv1", "conv2", "fc2"]
TOL = {torch.float16: dict(rtol=2e-3, atol=2e-3), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
       torch.float32: dict(rtol=2e-5, atol=2e-5)}


def _boundary(name: str, dtype: torch.dtype, per_row_table: bool, seed: int = 0):
    """(y, h, out, valid, rownorm kwargs, emit destination or None) of one boundary on the GPU."""
    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(seed)

    def r(*shape, dt=dtype, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=dev, dtype=dt)

    hist_rows = N * (T + 2)
    valid = torch.tensor(VALID, dtype=torch.int32, device=dev)
    table = r(N if per_row_table else 1, 2, 9, C, dt=torch.float32, scale=0.5)
    mod = dict(table=table, gate=3 * C, shift=1 * C, scale=2 * C)
    cnn = r(N, 2 * C, 2)
    h = r(N * T, C, dt=torch.float32)
    common = dict(n_rows=N, t_len=T)
    emit_dst = None
    if name == "in_proj":
        y, out = r(N * T, C), r(N * T, C)
        kw = dict(bias=r(C, scale=0.1), has_res=False, table=table, shift=C, scale=2 * C)
    elif name in ("proj", "proj_nocnn"):
        y, out = r(N * T, C), r(hist_rows, C)
        kw = dict(mod, out_t=T + 2, out_off=2, head=(cnn if name == "proj" else None, 0))
    elif name == "conv1":
        y, out = r(hist_rows, 3 * C), r(hist_rows, C)
        emit_dst = r(N, 2 * C, 2)
        kw = dict(taps=True, bias=r(C, scale=0.1), has_res=False, write_h=False,
                  ln_affine=(r(C, scale=0.5) + 1, r(C, scale=0.1)), eps=CONV_LN_EPS, out_t=T + 2, out_off=2,
                  head=(cnn, C), emit=(r(hist_rows, C), emit_dst, 0))
    elif name == "conv2":
        y, out = r(hist_rows, 3 * C), r(N * T, C)
        emit_dst = r(N, 2 * C, 2)
        kw = dict(mod, taps=True, bias=r(C, scale=0.1), emit=(r(hist_rows, C), emit_dst, C))
    else:  # fc2
        y, out = r(N * T, C), r(N * T, C)
        kw = dict(mod)
    kw.setdefault("eps", BLOCK_LN_EPS)
    return y, h, out, valid, dict(kw, **common), emit_dst


def _run(kernel: str, y, h, out, valid, kw, emit_dst, monkeypatch):
    from torch_cfm.kernels import dit_body

    monkeypatch.setattr(dit_body, "ROWNORM_KERNEL", kernel)
    h, out = h.clone(), out.clone()
    if emit_dst is not None:
        dst = emit_dst.clone()
        src, _, base = kw["emit"]
        kw = dict(kw, emit=(src, dst, base))
    dit_body.rownorm(y, h, out, valid, **kw)
    return h, out, (kw["emit"][1] if emit_dst is not None else None)


@pytest.mark.gpu
@pytest.mark.parametrize("per_row_table", [True, False], ids=["row_tables", "one_table"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("boundary", BOUNDARIES)
def test_gpu_cuda_rownorm_matches_triton(boundary, dtype, per_row_table, monkeypatch):
    y, h, out, valid, kw, emit_dst = _boundary(boundary, dtype, per_row_table)
    reasons = dit_rownorm_cuda.not_supported_reasons(y, h, out, bias=kw.get("bias"), table=kw.get("table"),
                                                     ln_affine=kw.get("ln_affine"))
    assert reasons == [], reasons
    calls = []
    launch = dit_rownorm_cuda.rownorm_cuda
    monkeypatch.setattr(dit_rownorm_cuda, "rownorm_cuda", lambda *a, **k: (calls.append(1), launch(*a, **k)))
    h_t, out_t, emit_t = _run("triton", y, h, out, valid, kw, emit_dst, monkeypatch)
    h_c, out_c, emit_c = _run("cuda", y, h, out, valid, kw, emit_dst, monkeypatch)
    torch.cuda.synchronize()
    assert calls == [1]  # the Triton run did not take the CUDA path, the CUDA run did
    assert not torch.equal(out_t, out)  # the boundary wrote something
    torch.testing.assert_close(out_c, out_t, **TOL[dtype])
    torch.testing.assert_close(h_c, h_t, rtol=1e-6, atol=1e-6)
    if kw.get("head") is not None:  # history frames 0 and 1: copies, exact
        rows = torch.tensor([n * (T + 2) + j for n in range(N) for j in range(2)], device=out.device)
        assert torch.equal(out_c[rows], out_t[rows])
        if kw["head"][0] is None:
            assert (out_c[rows] == 0).all()
    if emit_dst is not None:
        assert torch.equal(emit_c, emit_t) and not torch.equal(emit_c, emit_dst)


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
def test_gpu_cuda_rownorm_graph_replay_equals_eager(pdl, monkeypatch):
    """Captured behind the kernel that writes its input (a copy into y), replayed after that input
    changed: equal to an eager call, bitwise. With PDL the kernel's pre-wait loads must not read y."""
    from torch_cfm.kernels import dit_body

    monkeypatch.setattr(dit_body, "ROWNORM_KERNEL", "cuda")
    monkeypatch.setattr(dit_body, "ROWNORM_LAUNCH_OVERRIDE", {"pdl": pdl})
    y, h, out, valid, kw, _ = _boundary("proj", torch.float16, True, seed=3)
    y_src, h0 = torch.randn_like(y), h.clone()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        dit_body.rownorm(y, h, out, valid, **kw)  # warm-up (module import, first launch) off the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    h.copy_(h0)
    with torch.cuda.graph(graph):
        y.copy_(y_src)
        dit_body.rownorm(y, h, out, valid, **kw)
    y_src.copy_(torch.randn_like(y))
    h.copy_(h0)
    graph.replay()
    torch.cuda.synchronize()
    got_h, got_out = h.clone(), out.clone()
    monkeypatch.setattr(dit_body, "ROWNORM_LAUNCH_OVERRIDE", {"pdl": False})
    y.copy_(y_src)
    h.copy_(h0)
    out.zero_()
    dit_body.rownorm(y, h, out, valid, **kw)
    torch.cuda.synchronize()
    assert torch.equal(got_out, out) and torch.equal(got_h, h)
