"""Issue 43: how much of the vocoder's tick could hide under the CFM's if the two ran concurrently
(experiment; nothing in the package runs stages on two CUDA streams).

At 64 streams a tokens → waveform tick is encoder 9.3 + CFM 43 + vocoder 20 ms, run one after
the other on one CUDA stream (H100, ``docs/performance.md`` §6). Neither fills the GPU: the CFM's
GEMMs run at 60-77 % of peak with 3 ms idle, and the vocoder's convolutions are L2-bound at 25 %
occupancy. A server that vocoded tick n's mel while it solved tick n + 1's CFM (its waveform one
tick later) would gain what the two overlap. This measures that upper bound directly, at the
shipped sizes with random weights:

* ``cfm``: one ``CFMServer.solve_chunk`` of S streams' chunks (graphs, warmed, caches at the trim
  bound), host work included;
* ``voc``: one replay of a CUDA graph of ``HiFTVocoder.stream_chunk`` for S one-second chunks;
* ``sequential``: both on one stream, as today; ``overlapped``: the vocoder's replay issued on a
  second CUDA stream just before the CFM tick, both waited for.

Reported per S: ms p50 of each, and ``hidden`` = (sequential − overlapped) / voc, the share of the
vocoder's time that concurrency removes (0: none; 1: all of it). Fresh random chunks every tick.

    python3 bench/experiments/stage_overlap.py --streams 16,64 --out "$OUT"
    python3 bench/experiments/stage_overlap.py --dry-run        # CPU: tiny sizes, sequential only

Measured (H100, 64 streams): 0.13 hidden; ``stage_overlap.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests"),
                os.path.dirname(os.path.dirname(HERE))]

import torch  # noqa: E402


def cfm_tick(streams: int, dry: bool, seed: int = 0):
    """A warmed CFMServer at ``streams`` streams and a function running one steady tick."""
    from torch_cfm import CFMServer, DiT, DiTConfig, StreamingCFM

    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.float16
    cfg = DiTConfig(hidden=64, depth=2, heads=4, head_dim=16) if dry else DiTConfig()
    prompt, t_len = (20, 10) if dry else (300, 50)
    model = DiT(cfg).random_init_(seed).to(device, dtype).eval()
    cfm = StreamingCFM(model, n_timesteps=10, seed=seed)
    server = CFMServer(cfm, max_requests=streams, max_prompt_frames=prompt, max_chunk_frames=t_len,
                       chunk_buckets=[t_len], cache_buckets=[prompt + 100], slot_buckets=[1, streams],
                       device=device, dtype=dtype, graphs=not dry)
    if not dry:
        server.warmup(progress=False)
    g = torch.Generator(device=device).manual_seed(seed + 1)

    def rand(*size):
        return torch.randn(*size, generator=g, device=device, dtype=torch.float32).to(dtype)

    for rid in range(streams):
        server.open_request(rid, rand(80), prompt_mu=rand(80, prompt), prompt_mel=rand(80, prompt))
    chunks = {rid: rand(80, t_len) for rid in range(streams)}
    for _ in range(-(-100 // t_len) + 3):  # caches at the trim bound, graphs captured
        server.solve_chunk(chunks)

    def tick():
        for mu in chunks.values():
            mu.normal_(generator=g)
        return server.solve_chunk(chunks)

    return tick


def voc_replay(streams: int, dry: bool, seed: int = 0):
    """The many-stream HiFT's ``stream_chunk`` for ``streams`` one-second chunks: a function that
    replays it from a CUDA graph (CPU: runs it)."""
    import vocoder as V

    from torch_cfm.models.vocoder import HiFTVocoder, stream_rng

    device = torch.device("cpu" if dry else "cuda")
    hift = V.build_hift(seed, device, tiny=dry)
    frames = 10 if dry else 58
    mel, source = V.make_inputs(hift, streams, frames, seed + 1, device)
    voc = HiFTVocoder(hift)
    rng = stream_rng(range(streams), device)
    n = min(8 * V.S, frames * V.S // 2)
    cache, previous = source[:, :, :n].clone(), source[:, 0, -n:].clone()
    window = torch.hamming_window(2 * n, periodic=False, dtype=torch.float64, device=device)

    def run():
        return voc.stream_chunk(mel, rng, cache, previous, window)

    if dry:
        return run
    import _harness as H

    with torch.no_grad():
        graph, _ = H.capture_cuda_graph(run)
    return graph.replay


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def measure(streams: int, repeats: int) -> dict:
    tick, voc = cfm_tick(streams, False), voc_replay(streams, False)
    side = torch.cuda.Stream()

    def sequential():
        tick()
        voc()

    def overlapped():
        side.wait_stream(torch.cuda.current_stream())  # the vocoder's input would be the last tick's mel
        with torch.cuda.stream(side):
            voc()
        tick()
        torch.cuda.current_stream().wait_stream(side)

    with torch.no_grad():
        for fn in (tick, voc, sequential, overlapped):  # warm
            fn()
        row = {name: round(median_ms(fn, repeats), 3) for name, fn in
               (("cfm_ms", tick), ("voc_ms", voc), ("sequential_ms", sequential), ("overlapped_ms", overlapped))}
    row["hidden"] = round((row["sequential_ms"] - row["overlapped_ms"]) / row["voc_ms"], 3)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", default="16,64")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=".")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: both stages run once, no timing")
    args = ap.parse_args()
    if args.dry_run:
        with torch.no_grad():
            mel = cfm_tick(2, True)()
            wav = voc_replay(2, True)()
        print(f"dry run: {len(mel)} mels, waveform {tuple(wav[0].shape)}")
        return 0
    import _harness as H

    env = H.env_info()
    rows = []
    for s in (int(v) for v in args.streams.split(",")):
        row = dict(env, op="stage_overlap", streams=s, **measure(s, args.repeats))
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("streams", "cfm_ms", "voc_ms", "sequential_ms", "overlapped_ms",
                                              "hidden")}), flush=True)
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "stage_overlap.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
