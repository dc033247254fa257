#!/usr/bin/env python3
"""A property-test finding: one fp16 row differs by 1 ulp alone vs in a batch of 2 (GPU only).

Rebuilds the failing hypothesis case of ``test_padded_rows_change_no_other_row_cuda`` and times
nothing: it prints the max diff for each launch option, to tell which one changes the rounding.
    PYTHONPATH=$PWD:tests python3 bench/repro_padded_rows.py
"""
import os
import sys
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "tests"), os.path.join(HERE, "..")]

import torch  # noqa: E402

import strategies as S  # noqa: E402
from test_properties import insert_rows  # noqa: E402
from torch_cfm.kernels.cfm_attention import cfm_attention_triton, choose_config  # noqa: E402


DEVICE = os.environ.get("REPRO_DEVICE", "cuda")  # "cpu" with TRITON_INTERPRET=1: a smoke run


def main() -> None:
    spec = S.AttnSpec(1, 1, 44, 130, 16, 0, 0.5, mask_mode="expand_q", mask_density=0.3)
    extra = S.logical_values(S.AttnSpec(1, 1, 44, 130, 16, 0 ^ 0x5A5A, 0.5, mask_mode="expand_q",
                                        mask_density=0.5))
    values = S.logical_values(spec)
    big_values, slots = insert_rows(spec, values, extra, [0], [], [])
    dt = torch.float16
    small, big = S.arrange(spec, values, DEVICE, dt), S.arrange(spec, big_values, DEVICE, dt)
    print("mask strides small/big:", small.mask.stride(), big.mask.stride(), "q strides", small.q.stride(),
          big.q.stride(), "k", small.k.stride(), big.k.stride())
    cfg = choose_config(dt, 16, 1, 44, 130)

    def launch(case, **kw):
        n, h, q_len, d = case.q.shape
        out = torch.empty(n, q_len, h, d, device=DEVICE, dtype=dt).transpose(1, 2)
        mask = kw.pop("mask", case.mask)
        cfm_attention_triton(case.q, case.k, case.v, case.key_lengths, mask, case.kv_rows, None, out,
                             config=kw.pop("config", cfg))
        return out

    ref = launch(small)
    for name, kw_small, kw_big in [
        ("default", {}, {}),
        ("pdl off", {"config": replace(cfg, pdl=False)}, {"config": replace(cfg, pdl=False)}),
        ("pdl on", {"config": replace(cfg, pdl=True)}, {"config": replace(cfg, pdl=True)}),
        ("contiguous masks", {"mask": small.mask.contiguous()}, {"mask": big.mask.contiguous()}),
        ("small n-stride 0", {"mask": small.mask.as_strided(small.mask.shape, (0,) + small.mask.stride()[1:])}, {}),
    ]:
        a, b = launch(small, **kw_small), launch(big, **kw_big)[slots]
        print(f"{name:18s} small vs big {(a.double() - b.double()).abs().max().item():.3e}  "
              f"small vs default small {(a.double() - ref.double()).abs().max().item():.3e}")
    # the big batch with the small row's own mask row (strides of an N=2 expand) vs N=1
    print("config", cfg.name)


if __name__ == "__main__":
    main()
