"""The Snake's sin² (torch_cfm.kernels.vocoder_elementwise.sin_squared) against float64.

Every fused vocoder kernel computes its Snakes ``x + inv · sin(alpha · x)²`` through
``sin_squared`` (a Cody-Waite reduction and polynomials, no libdevice slow path). Checked in
Triton's interpreter (a child process; no fused multiply-add there, so up to |y| = 1e4) and on
CUDA when present (up to |y| = 1e5), beside float32 ``torch.sin(y) ** 2``'s own error.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
import triton
import triton.language as tl

from interpreter_child import run_child_file

from torch_cfm.kernels.vocoder_elementwise import sin_squared

BOUND = 2e-7  # absolute, on values in [0, 1]


@triton.jit
def _sin_squared_kernel(y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    tl.store(out_ptr + i, sin_squared(tl.load(y_ptr + i, mask=ok, other=0.0)), mask=ok)


def _run(y: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(y)
    _sin_squared_kernel[(triton.cdiv(y.numel(), 1024),)](y, out, y.numel(), BLOCK=1024)
    return out


def _inputs(limit: float, count: int, device: str) -> torch.Tensor:
    """Uniform in [-limit, limit], plus multiples of pi / 4 and their float32 neighbours (the quadrant
    boundaries, where the reduction's remainder is smallest) and the non-finite values."""
    gen = torch.Generator().manual_seed(int(limit))
    y = (torch.rand(count, generator=gen, dtype=torch.float64) * 2 - 1) * limit
    k = torch.arange(-int(limit / (math.pi / 4)), int(limit / (math.pi / 4)) + 1, max(1, int(limit) // 50),
                     dtype=torch.float64)
    grid = (k * math.pi / 4).float()
    edges = torch.cat([grid, torch.nextafter(grid, torch.full_like(grid, math.inf)),
                       torch.nextafter(grid, torch.full_like(grid, -math.inf))])
    special = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan])
    return torch.cat([y.float(), edges, special]).to(device)


def _errors(y: torch.Tensor, got: torch.Tensor) -> tuple[float, float, bool]:
    """(max |got - sin²| over finite y, the same for float32 torch.sin(y)², NaN exactly where y is not finite)."""
    finite = torch.isfinite(y)
    exact = torch.sin(y[finite].double()) ** 2
    ours = float((got[finite].double() - exact).abs().max())
    torch32 = float(((torch.sin(y[finite]) ** 2).double() - exact).abs().max())
    return ours, torch32, bool(torch.equal(torch.isnan(got), ~finite))


def _child(out_path: str) -> None:
    y = _inputs(1e4, 200_000, "cpu")
    torch.save({"y": y, "got": _run(y)}, out_path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return run_child_file(__file__, str(tmp_path_factory.mktemp("sin_squared") / "out.pt"))


def test_sin_squared_interpreter(interpreted):
    ours, torch32, nan_where_not_finite = _errors(interpreted["y"], interpreted["got"])
    assert nan_where_not_finite
    assert ours <= BOUND, (ours, torch32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sin_squared_cuda():
    for limit in (10.0, 1e3, 1e5):
        y = _inputs(limit, 1_000_000, "cuda")
        ours, torch32, nan_where_not_finite = _errors(y, _run(y))
        assert nan_where_not_finite
        assert ours <= BOUND, (limit, ours, torch32)


if __name__ == "__main__" and len(sys.argv) >= 3 and sys.argv[1] == "--child":
    _child(sys.argv[2])
