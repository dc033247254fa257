"""The ``cfm_attention`` contract (docs/design.md §4): argument errors, fake-kernel metadata, opcheck.

* Every bad argument raises ``ValueError`` whose message starts ``cfm_attention: <arg> ...``, on
  four paths: the public wrapper (eager), the registered op (C++ CPU kernel), the fake kernel
  (FakeTensorMode), and ``torch.compile(fullgraph=True)`` (where Dynamo re-raises it wrapped in
  its own exception: the ValueError text with the argument name must survive).
* The fake kernel returns exactly the real kernel's metadata (shape, dtype, device, strides) for
  every layout the op accepts.
* ``torch.library.opcheck`` with all default checks (schema, autograd registration, fake tensor,
  AOT dispatch with dynamic shapes) on CPU fp32/fp16/bf16 and CUDA fp16/bf16/fp32 (gpu-marked).
"""

from __future__ import annotations

import re
from typing import Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import strategies as S
from torch_cfm import cfm_attention

OP = torch.ops.torch_cfm.cfm_attention.default
N, H, Q, K, D = 2, 2, 5, 7, 16


def base_args() -> dict:
    g = torch.Generator().manual_seed(0)
    return dict(q=torch.randn(N, H, Q, D, generator=g), k=torch.randn(N, H, K, D, generator=g),
                v=torch.randn(N, H, K, D, generator=g),
                key_lengths=torch.tensor([7, 3], dtype=torch.int32),
                mask=torch.rand(N, Q, K, generator=g) > 0.3, kv_rows=None, precision="auto")


def _set(**changes) -> Callable[[dict], dict]:
    def mutate(args: dict) -> dict:
        out = dict(args)
        for key, value in changes.items():
            out[key] = value(args) if callable(value) else value
        return out
    return mutate


# (id, argument the message must name, mutation of base_args, tensor-only: usable on every path)
BAD = [
    ("q-rank3", "q", _set(q=lambda a: a["q"][0]), True),
    ("q-rank5", "q", _set(q=lambda a: a["q"][None]), True),
    ("k-rank3", "k", _set(k=lambda a: a["k"][0]), True),
    ("v-rank5", "v", _set(v=lambda a: a["v"][None]), True),
    ("q-float64", "q", _set(q=lambda a: a["q"].double(), k=lambda a: a["k"].double(),
                            v=lambda a: a["v"].double()), True),
    ("q-int", "q", _set(q=lambda a: a["q"].int(), k=lambda a: a["k"].int(),
                        v=lambda a: a["v"].int()), True),
    ("k-dtype", "k", _set(k=lambda a: a["k"].half()), True),
    ("v-dtype", "v", _set(v=lambda a: a["v"].bfloat16()), True),
    ("k-device", "k", _set(k=lambda a: a["k"].to("meta")), True),
    ("v-device", "v", _set(v=lambda a: a["v"].to("meta")), True),
    ("head-dim-24", "q", _set(q=lambda a: torch.randn(N, H, Q, 24), k=lambda a: torch.randn(N, H, K, 24),
                              v=lambda a: torch.randn(N, H, K, 24)), True),
    ("head-dim-256", "q", _set(q=lambda a: torch.randn(N, H, Q, 256), k=lambda a: torch.randn(N, H, K, 256),
                               v=lambda a: torch.randn(N, H, K, 256)), True),
    ("k-heads", "k", _set(k=lambda a: torch.randn(N, H + 1, K, D), v=lambda a: torch.randn(N, H + 1, K, D)), True),
    ("k-rows", "k", _set(k=lambda a: torch.randn(N + 1, H, K, D), v=lambda a: torch.randn(N + 1, H, K, D)), True),
    ("k-head-dim", "k", _set(k=lambda a: torch.randn(N, H, K, 32), v=lambda a: torch.randn(N, H, K, 32)), True),
    ("kv-keys-differ", "k", _set(v=lambda a: torch.randn(N, H, K + 1, D)), True),
    ("lengths-int64", "key_lengths", _set(key_lengths=lambda a: a["key_lengths"].long()), True),
    ("lengths-float", "key_lengths", _set(key_lengths=lambda a: a["key_lengths"].float()), True),
    ("lengths-size", "key_lengths", _set(key_lengths=torch.tensor([1, 2, 3], dtype=torch.int32)), True),
    ("lengths-2d", "key_lengths", _set(key_lengths=torch.tensor([[1], [2]], dtype=torch.int32)), True),
    ("lengths-device", "key_lengths", _set(key_lengths=lambda a: a["key_lengths"].to("meta")), True),
    ("lengths-list", "key_lengths", _set(key_lengths=[7, 3]), False),
    ("mask-float", "mask", _set(mask=lambda a: a["mask"].float()), True),
    ("mask-2d", "mask", _set(mask=lambda a: a["mask"][0]), True),
    ("mask-unexpanded", "mask", _set(mask=lambda a: a["mask"][:1]), True),
    ("mask-wrong-K", "mask", _set(mask=torch.ones(N, Q, K + 1, dtype=torch.bool)), True),
    ("mask-device", "mask", _set(mask=lambda a: a["mask"].to("meta")), True),
    ("kv-rows-int64", "kv_rows", _set(kv_rows=torch.tensor([0, 1])), True),
    ("kv-rows-size", "kv_rows", _set(kv_rows=torch.tensor([0], dtype=torch.int32)), True),
    ("kv-rows-empty-pool", "k", _set(kv_rows=torch.tensor([0, 0], dtype=torch.int32),
                                     k=torch.randn(0, H, K, D), v=torch.randn(0, H, K, D)), True),
    ("precision", "precision", _set(precision="fp16"), True),
    ("q-not-tensor", "q", _set(q=[[1.0]]), False),
]
BAD_IDS = [b[0] for b in BAD]


def named(arg: str, text: str) -> bool:
    """The message names ``arg`` as the offender: ``cfm_attention: <arg> ...``."""
    return re.search(rf"cfm_attention: {re.escape(arg)}\b", text) is not None


def value_error_text(exc: BaseException) -> str:
    """The ValueError message carried by ``exc`` or its chain ("" if none): Dynamo wraps errors
    raised while tracing (Unsupported / TorchRuntimeError) but keeps the ValueError's text."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ValueError):
            return str(exc)
        text = str(exc)
        if "ValueError(" in text:
            return text
        exc = exc.__cause__ or exc.__context__
    return ""


def call_eager(a: dict):
    return cfm_attention(a["q"], a["k"], a["v"], key_lengths=a["key_lengths"], mask=a["mask"],
                         kv_rows=a["kv_rows"], precision=a["precision"])


def call_op(a: dict):
    return OP(a["q"], a["k"], a["v"], a["key_lengths"], a["mask"], a["kv_rows"], a["precision"])


def call_fake(a: dict):
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = {k: (mode.from_tensor(v) if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
        return call_op(fake)


@pytest.mark.parametrize("case_id,arg,mutate,tensor_only", BAD, ids=BAD_IDS)
@pytest.mark.parametrize("path", ["eager", "op", "fake"])
def test_bad_argument_raises_value_error_naming_it(path, case_id, arg, mutate, tensor_only):
    if not tensor_only and path != "eager":
        pytest.skip("the registered op's schema only takes tensors")
    args = mutate(base_args())
    with pytest.raises(ValueError) as info:
        {"eager": call_eager, "op": call_op, "fake": call_fake}[path](args)
    assert named(arg, str(info.value)), f"{path}: message does not name {arg!r}: {info.value}"


COMPILE_BAD = [b for b in BAD if b[3]]


@pytest.mark.parametrize("case_id,arg,mutate,tensor_only", COMPILE_BAD, ids=[b[0] for b in COMPILE_BAD])
@pytest.mark.parametrize("entry", ["public", "op"])
def test_bad_argument_under_compile_fullgraph(entry, case_id, arg, mutate, tensor_only):
    """Under torch.compile(fullgraph=True) the check runs at trace time (Python check for the
    public wrapper, the fake kernel for the raw op); the ValueError naming ``arg`` reaches the user."""
    args = mutate(base_args())
    fn = call_eager if entry == "public" else call_op
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v, key_lengths, mask, kv_rows: fn(
        dict(q=q, k=k, v=v, key_lengths=key_lengths, mask=mask, kv_rows=kv_rows,
             precision=args["precision"])), fullgraph=True, backend="eager")
    with pytest.raises(Exception) as info:
        compiled(args["q"], args["k"], args["v"], args["key_lengths"], args["mask"], args["kv_rows"])
    text = value_error_text(info.value)
    assert text, f"no ValueError behind {type(info.value).__name__}: {info.value}"
    assert named(arg, text), f"compiled {entry}: message does not name {arg!r}: {text[:400]}"


# --------------------------------------------------------------------------------------------
# fake vs real metadata
# --------------------------------------------------------------------------------------------

LAYOUT_SPECS = [
    pytest.param(S.AttnSpec(1, 1, 1, 0, 16, 1), id="N1-Q1-K0"),
    pytest.param(S.AttnSpec(2, 3, 5, 17, 32, 2, lengths=(17, 0)), id="lengths"),
    pytest.param(S.AttnSpec(2, 2, 7, 33, 64, 3, kv_interleaved=True, q_transposed=True), id="strided"),
    pytest.param(S.AttnSpec(3, 2, 4, 9, 128, 4, mask_mode="expand_n", kv_rows=(1, 0, 1), pool=2),
                 id="mask-pool"),
    pytest.param(S.AttnSpec(2, 1, 65, 129, 16, 5, mask_mode="expand_q", lengths=(3, 200)), id="expand-q"),
]


def fake_out(case: S.AttnCase, precision: str = "auto") -> torch.Tensor:
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in case.args(precision)]
        return OP(*args)


def real_devices() -> list:
    return [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", real_devices())
@pytest.mark.parametrize("dtype", S.DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("spec", LAYOUT_SPECS)
def test_fake_matches_real_metadata(spec, dtype, device):
    case = S.build_attention(spec, device, dtype)
    real, fake = OP(*case.args()), fake_out(case)
    assert fake.shape == real.shape and fake.dtype == real.dtype
    assert fake.device == real.device
    assert fake.stride() == real.stride(), f"fake strides {fake.stride()} != real {real.stride()}"
    assert real.transpose(1, 2).is_contiguous(), "out must be stored as contiguous (N, Q, H, D)"


# --------------------------------------------------------------------------------------------
# opcheck
# --------------------------------------------------------------------------------------------

OPCHECK_SPECS = [
    S.AttnSpec(2, 2, 5, 17, 16, 10, lengths=(17, 4)),
    S.AttnSpec(2, 2, 3, 40, 32, 11, mask_mode="expand_n", kv_interleaved=True, q_transposed=True),
    S.AttnSpec(3, 1, 4, 9, 64, 12, lengths=(9, 0, 5), kv_rows=(1, 1, 0), pool=2, mask_mode="dense"),
    S.AttnSpec(1, 1, 1, 0, 16, 13),
]


def opcheck_all(device: str, dtype: torch.dtype, precision: str) -> None:
    for spec in OPCHECK_SPECS:
        case = S.build_attention(spec, device, dtype)
        result = torch.library.opcheck(OP, case.args(precision))
        assert set(result.values()) == {"SUCCESS"}, f"{spec.describe()}: {result}"
        assert {"test_schema", "test_faketensor", "test_aot_dispatch_dynamic"} <= set(result)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_opcheck_cpu(dtype):
    opcheck_all("cpu", dtype, "auto")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,precision", [(torch.float16, "auto"), (torch.bfloat16, "auto"),
                                             (torch.float32, "tf32"), (torch.float32, "ieee"),
                                             (torch.float32, "auto")],
                         ids=["fp16", "bf16", "fp32-tf32", "fp32-ieee", "fp32-auto"])
def test_opcheck_cuda(dtype, precision):
    opcheck_all("cuda", dtype, precision)
