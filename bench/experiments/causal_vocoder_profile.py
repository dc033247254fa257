"""Where minicpmo-utils' causal vocoder spends a steady chunk (experiment; not a shipped benchmark).

A shipped-size ``CausalHiFTGenerator`` (seeded random weights) behind ``CausalVocoderCore``: one
steady 50-frame chunk at batch B replayed from a CUDA graph (ms per chunk), then one eager chunk
under the profiler (kernel count, CUDA ms, top kernels). Writes ``causal_vocoder_profile.json``.

    STEPAUDIO2_PATH=.upstream/minicpmo-utils python3 bench/experiments/causal_vocoder_profile.py --out "$OUT"
    ... --repo .old --out "$OUT/old"     # the same on another (built) tree
    ... --count-ops --out /tmp/ops          # no GPU: top-level aten ops of one steady chunk (CPU)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [HERE, os.path.dirname(HERE), os.path.join(ROOT, "tests"), ROOT]

import torch  # noqa: E402

import _harness as H  # noqa: E402


def count_ops(fn) -> dict:
    """Top-level aten ops of one ``fn()`` (those not called from another aten op), by name."""
    from collections import Counter
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as p:
        fn()
    top = Counter(e.name for e in p.events() if e.name.startswith("aten::")
                  and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))
    return dict(batch=1, device="cpu", aten_ops=sum(top.values()), by_op=dict(top.most_common()))


def steady_chunk(core, gen: torch.Generator, frames: int = 50):
    """A one-stream state two ``frames``-frame chunks in, and the plan of its next chunk (the steady
    plan, the one a timed chunk should have): (state, plan). Call without autograd."""
    from torch_cfm.models.vocoder.causal import COUNTERS, plan_chunk, stream_batch

    state = core.new_state()
    for _ in range(2):
        stream_batch(core, [state], [torch.randn(1, 80, frames, device=core.device, generator=gen)], [False])
    counters = {k: int(state[k].item()) for k in COUNTERS}
    plan, _, _ = plan_chunk(core.sizes, counters, state["mel"].shape[2], state["source"].shape[2] // core.sizes.hop,
                            frames, False)
    return state, plan


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--out", required=True)
    ap.add_argument("--repo", default=None, help="the torch_cfm tree to time (default: this one), e.g. .old")
    ap.add_argument("--count-ops", action="store_true",
                    help="on the CPU: count the top-level aten ops of one steady batch-1 chunk, nothing timed")
    args = ap.parse_args()
    if args.repo:
        sys.path.insert(0, os.path.abspath(args.repo))
    import torch_cfm  # noqa: F401  from --repo, before vocoder_profile puts this checkout first on sys.path
    import upstream_packages as P
    import vocoder_profile as VP  # its profiler summary (imports torch_cfm: after --repo)
    from torch_cfm.models.vocoder.causal import CausalVocoderCore

    print("torch_cfm from", os.path.dirname(sys.modules["torch_cfm"].__file__), flush=True)
    dev = torch.device("cpu" if args.count_ops else "cuda")
    mods = P.load_minicpmo_token2wav()
    model = P.build_causal_hift(mods, seed=0, table_samples=60 * 24000, **P.SHIPPED_CAUSAL).to(dev)
    core = CausalVocoderCore(mods.BoundedVocoder(model))
    result = dict(env=H.env_info(), rows=[])
    gen = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        state, plan = steady_chunk(core, gen)
        if args.count_ops:
            result["rows"].append(count_ops(lambda: core.run(plan, state["mel"], state["source"], state["phase"],
                                                             torch.randn(1, 80, 50, generator=gen),
                                                             torch.zeros(1, dtype=torch.int64))))
            print(result["rows"][-1], flush=True)
        for b in [] if args.count_ops else [int(x) for x in args.batches.split(",")]:
            mel, source, phase = (state[k].expand(b, *state[k].shape[1:]).contiguous()
                                  for k in ("mel", "source", "phase"))
            chunk = torch.randn(b, 80, 50, device=dev, generator=gen)
            base = torch.zeros(b, dtype=torch.int64, device=dev)
            for tf32 in (True, False):
                with torch.backends.cudnn.flags(enabled=True, allow_tf32=tf32):
                    t = H.time_cuda_graph(lambda: core.run(plan, mel, source, phase, chunk, base), calls=2,
                                          repeats=7, warmup=2)
                row = dict(batch=b, tf32=tf32, ms=round(t["us_p50"] / 1e3, 3))
                if tf32 and b in (1, 64):
                    prof = VP.profile(lambda: core.run(plan, mel, source, phase, chunk, base), top=15)
                    row.update(kernels=prof["kernel_count"], kernel_ms=prof["kernel_ms_total"], top=prof["kernels"])
                result["rows"].append(row)
                print({k: v for k, v in row.items() if k != "top"}, flush=True)
                for k in row.get("top", [])[:10]:
                    print("   ", k, flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "causal_vocoder_profile.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
