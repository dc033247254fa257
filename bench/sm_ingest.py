"""How many bytes per µs one SM takes in, by copy method and by how many SMs copy at once
(``bench/sm_ingest.cu``, JIT-built with torch's cpp_extension on the GPU box).

Why (docs/performance.md, the ingest floor): at M = 400 token rows each DiT GEMM is bound by the
operand bytes one SM must receive (≈ 80 KB per SM for proj, ≈ 320 KB for fc2), and the CUDA
attention kernel's loads ran at ≈ 40 GB/s per SM. This measures the rate itself: per-thread 16-byte loads into
registers, cp.async into shared memory, and 1D bulk copies (the TMA engine), from L2 (a buffer
read in every call) and from HBM (a fresh slice of a 2 GB buffer in every captured call).

op "sm_ingest", provider = copy method, shape {ctas, kb_per_cta, source}; each row also has
``empty_us`` (an empty kernel on the same grid, same graph method) and ``gb_per_s_per_sm``
= kb_per_cta / (us_p50 − empty_us).

    python3 bench/sm_ingest.py --out bench/results          # on the GPU box (bash bench/run_device.sh sm-ingest)
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import env_info, make_row, markdown_table, provenance_footer, time_cuda_graph, upsert_rows  # noqa: E402

MODES = {"ldg_v4": 0, "cp_async16": 1, "bulk_1d": 2}
KB_PER_CTA = (16, 64, 128, 192)
CTAS = (1, 16, 66, 132)
HBM_BYTES = 2 << 30
EVICT_BYTES = 120 << 20  # the HBM rows' captured calls read this much between two reads of a slice (L2: 50 MB)
MAX_HBM_CALLS = 400


def _module():
    from torch.utils.cpp_extension import load

    here = os.path.dirname(os.path.abspath(__file__))
    return load(name="torch_cfm_sm_ingest", sources=[os.path.join(here, "sm_ingest.cu")],
                extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"], verbose=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--kb", default=",".join(map(str, KB_PER_CTA)), help="KB per CTA (comma list)")
    ap.add_argument("--ctas", default=",".join(map(str, CTAS)), help="CTAs per launch (comma list)")
    ap.add_argument("--sources", default="l2,hbm")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        print("bench/sm_ingest.py needs an SM90 CUDA device (bulk copies)")
        return 2
    mod = _module()
    env = env_info()
    command = "python3 " + shlex.join([os.path.relpath(__file__)] + list(argv if argv is not None else sys.argv[1:]))
    sink = torch.zeros(4, dtype=torch.int32, device="cuda")
    kbs = [int(x) for x in args.kb.split(",")]
    ctas_list = [int(x) for x in args.ctas.split(",")]
    hbm = torch.randint(0, 2 ** 31 - 1, (HBM_BYTES // 4,), dtype=torch.int32, device="cuda") if "hbm" in args.sources \
        else None
    rows = []
    for source in args.sources.split(","):
        for ctas in ctas_list:
            for kb in kbs:
                size = kb * 1024
                span, calls = ctas * size, args.calls
                if source == "l2":
                    buf = torch.randint(0, 2 ** 31 - 1, (span // 4,), dtype=torch.int32, device="cuda")
                    slices = [buf]
                else:  # a fresh slice per captured call, the graph's slices together far larger than L2
                    calls = max(args.calls, -(-EVICT_BYTES // span))
                    if calls > MAX_HBM_CALLS:
                        continue  # too small a span to leave L2 with a bounded graph
                    slices = [hbm[i * span // 4:(i + 1) * span // 4] for i in range(calls)]

                def launcher(mode: int):
                    state = {"i": 0}

                    def fn():
                        src = slices[state["i"] % len(slices)]
                        state["i"] += 1
                        mod.ingest(src, sink, ctas, size, size, mode)
                    return fn

                empty = time_cuda_graph(launcher(-1), calls=calls, repeats=args.repeats)["us_p50"]
                for name in args.modes.split(","):
                    shape = {"ctas": ctas, "kb_per_cta": kb, "source": source}
                    row = make_row(env, op="sm_ingest", provider=name, shape=shape, dtype="bytes", precision=None,
                                   timing="cuda_graph", rel_err=None, error=None, empty_us=empty)
                    try:
                        row.update(time_cuda_graph(launcher(MODES[name]), calls=calls, repeats=args.repeats))
                        busy = row["us_p50"] - empty
                        row["gb_per_s_per_sm"] = round(size / busy / 1e3, 2) if busy > 0 else None
                    except Exception as exc:  # noqa: BLE001
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    rows.append(row)
                    print(f"{source} ctas {ctas:4d} {kb:4d} KB {name:11s} p50 {row.get('us_p50')} us "
                          f"(empty {empty:.2f}) -> {row.get('gb_per_s_per_sm')} GB/s per SM", flush=True)
    os.makedirs(args.out, exist_ok=True)
    upsert_rows(os.path.join(args.out, "sm_ingest.json"), rows)  # also writes sm_ingest.md (the whole file)
    print(markdown_table(rows, lambda r: f"{r['shape']['source']} ctas={r['shape']['ctas']} "
                                       f"{r['shape']['kb_per_cta']} KB",
                         lambda r: r["provider"], lambda r: str(r.get("gb_per_s_per_sm")),
                         row_title="source, CTAs, KB per CTA") + "\n" + provenance_footer(rows, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
