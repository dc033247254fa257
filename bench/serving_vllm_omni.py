"""vLLM-Omni's MiniCPM-o 4.5 Code2Wav backend as shipped, patched by torch_cfm, and the torch_cfm front.

The same seeded modules (``tests/upstream_flow.py``'s flow at the shipped sizes, vLLM-Omni's own
``HiFTGenerator`` at its shipped 24 kHz configuration, ``tests/vllm_omni_reference.py``: vLLM is a
two-attribute stand-in, vLLM-Omni the real wheel), tokens -> waveform, driven by
``bench/serving.py``'s workload (``run_one``: C streams at staggered progress, then Poisson
arrivals; 6 s prompts, 1 s chunks of 25 + 3 tokens, every open stream pushes a chunk each tick).
All providers run in one invocation, per flow dtype (``--dtypes``: fp16 = ``token2wav_float16:
true``, the flow halved; fp32 = as the deploy YAML ships) and concurrency C:

* ``vllm_omni``: ``BatchedToken2Wav`` as the deploy YAML builds it (``enable_hift_graph``,
  ``enable_cfm_graph``, ``cfm_max_graphs: 32``, ``cfm_graph_bucket_frames: 16``), driven the way
  ``MiniCPMO45Code2Wav.forward`` drives it: each tick, new requests set up per voice prompt
  (``setup_batch(features, n)``, its setup cache included), then one ``decode_batch`` per bucket
  (voice prompt x state shape).
* ``vllm_omni/torch_cfm``: the same class built the way the plugin builds it
  (``TORCH_CFM_VLLM_OMNI``: the original without its graphs, then torch_cfm with its warm-up),
  driven the same way with the plugin's Code2Wav bucket key (every continuing request in one
  bucket).
* ``torch_cfm``: the ``Token2wavServer`` with the same options, driven directly (one ``step`` per tick).

By default every stream shares one prompt (vLLM-Omni batches a voice's requests only);
``--mixed-prompts`` gives them four. Rows (``serving_vllm_omni.jsonl`` under ``--out``, JSON
lines with provenance, identity: provider, variant, dtype, concurrency, gpu, run): audio-s/s (the
arrivals' setup included), steady audio-s/s (chunk steps alone), chunk and first-chunk latency
p50/p99, ``peak_gib`` (device memory allocated at the peak, over what the modules hold; the larger
of ``build_peak_gib``, building and warming up, and ``serve_peak_gib``, the measured ticks),
``reserved_peak_gib`` (the same for memory reserved: CUDA-graph pools are reserved but not
allocated once captured, so this is the footprint a card must hold; ``build_``/``serve_`` too),
``memory_attribution`` (``--memory-attribution``: pools and allocated bytes by source line,
``bench/_memory.py``), ``bytes_per_request`` (torch_cfm's memory plan), ``captures_measured``
(graphs captured during the measured ticks) and the error of a provider that failed (out of memory, say). The summary prints
the issue's ratios per C.

    python bench/serving_vllm_omni.py --quick                      # GPU: fp16 and fp32 flows, C = 1, 4, 16, 32
    python bench/serving_vllm_omni.py --device cpu --tiny --quick  # CPU smoke
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import sys
import time
import traceback
from typing import Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, os.path.join(ROOT, "tests"), ROOT]

import _harness as H  # noqa: E402
import _memory as M  # noqa: E402
import serving as S  # noqa: E402
import upstream_flow as U  # noqa: E402
import vllm_omni_reference as V  # noqa: E402
from torch_cfm.integrations.vllm_omni import apply as VA  # noqa: E402
from torch_cfm.integrations.vllm_omni.options import Options  # noqa: E402
from torch_cfm.integrations.vllm_omni.plugin import merged_bucket_key  # noqa: E402

OP = "serving_vllm_omni"
IDENTITY = H.IDENTITIES[OP]
PROVIDERS = ("vllm_omni", "vllm_omni/torch_cfm", "torch_cfm")


def _cfm_memory(server) -> tuple[int, int]:
    plan = server.cfm_server.memory_plan()
    return plan.arena_bytes, plan.graph_pool_bytes


class Code2WavDriver:
    """A ``BatchedToken2Wav`` driven as the Code2Wav stage drives it (module docstring)."""

    reports_first_chunk = True

    def __init__(self, bt, backend, voices: list, inputs: S.Inputs, device: str) -> None:
        self.bt, self.backend, self.voices, self.inputs, self.device = bt, backend, voices, inputs, device
        self.states: dict = {}
        self.done: dict = {}

    def voice(self, sid: int) -> int:
        return sid % len(self.voices)

    def open(self, ids) -> None:
        groups: dict = {}
        for sid in ids:
            groups.setdefault(self.voice(sid), []).append(sid)
        with torch.inference_mode():
            for v, sids in groups.items():
                for sid, state in zip(sids, self.backend.setup_batch(self.voices[v], len(sids))):
                    self.states[sid], self.done[sid] = state, 0
        S._sync(self.device)

    def _key(self, sid: int):
        state = self.states[sid]
        return merged_bucket_key(state, 0) or (self.voice(sid), self.bt.state_shape_signature(state))

    def step(self, ids) -> dict:
        t0, out, buckets = time.perf_counter(), {}, {}
        for sid in ids:
            buckets.setdefault(self._key(sid), []).append(sid)
        with torch.inference_mode():
            for sids in buckets.values():
                tokens = torch.cat([self.inputs.chunk(sid, self.done[sid]) for sid in sids]).long()
                _, states = self.backend.decode_batch(tokens, self.voices[self.voice(sids[0])],
                                                      [self.states[sid] for sid in sids], last_chunk=False)
                S._sync(self.device)
                for sid, state in zip(sids, states):
                    self.states[sid] = state
                    self.done[sid] += 1
                    out[sid] = time.perf_counter() - t0
        return out

    def close(self, sid) -> None:
        del self.states[sid], self.done[sid]  # the stage drops the state: torch_cfm closes the stream

    def captures(self) -> int:
        adapter = VA.accelerated_backend(self.backend)
        if adapter is not None:
            return adapter.stats["captures_after_warmup"]
        cfm, hift = self.backend._cfm_graph_wrapper, self.backend.hift_graph_wrapper
        return (cfm.stats_snapshot()["captures"] if cfm else 0) + (hift.lazy_graph_count if hift else 0)

    def bytes_per_request(self) -> Optional[int]:
        adapter = VA.accelerated_backend(self.backend)
        return adapter.memory_report()["bytes_per_request"] if adapter is not None else None

    def cfm_memory(self) -> Optional[tuple[int, int]]:
        """(CFM arena bytes, CFM graph pool bytes) of torch_cfm's server; None unpatched."""
        adapter = VA.accelerated_backend(self.backend)
        return None if adapter is None else _cfm_memory(adapter.server)


class ServerDriver:
    """The ``Token2wavServer`` driven directly: one ``open_many`` per tick's arrivals, one ``step``."""

    reports_first_chunk = True

    def __init__(self, server, voices: list, inputs: S.Inputs, device: str, silence: int = V.SILENCE) -> None:
        self.server, self.inputs, self.device, self.done = server, inputs, device, {}
        self.prompts = []
        for f in voices:
            pad = torch.full((1, server.lookahead), silence, dtype=f.speech_tokens.dtype, device=f.speech_tokens.device)
            self.prompts.append((torch.cat([f.speech_tokens, pad], dim=1), f.mels, f.speaker_embedding))

    def open(self, ids) -> None:
        with torch.inference_mode():
            self.server.open_many({sid: (*self.prompts[sid % len(self.prompts)], sid) for sid in ids})
        for sid in ids:
            self.done[sid] = 0
        S._sync(self.device)

    def step(self, ids) -> dict:
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.server.step({sid: self.inputs.chunk(sid, self.done[sid]) for sid in ids})
        S._sync(self.device)
        dt = time.perf_counter() - t0
        for sid in ids:
            self.done[sid] += 1
        return {sid: dt for sid in ids}

    def close(self, sid) -> None:
        self.server.close_stream(sid)
        del self.done[sid]

    def captures(self) -> int:
        return sum(self.server.graph_counts().values())

    def cfm_memory(self) -> tuple[int, int]:
        return _cfm_memory(self.server)

    def bytes_per_request(self) -> int:
        return self.server.memory_plan().total


def build(name: str, bt, flow, hift, c: int, wl: S.Workload, voices, inputs, device: str, float16: bool):
    """One provider over the shared modules (module docstring)."""
    t2w = V.make_token2wav(flow, hift, wl.n_steps, float16=float16)
    yaml = dict(connector_config=V.YAML_CONNECTOR, hift_graph_config=V.YAML_HIFT_GRAPH,
                cfm_graph_config=V.YAML_CFM_GRAPH)
    options = dict(max_streams=c, max_prompt_frames=wl.prompt_frames, max_chunk_tokens=wl.chunk_tokens,
                   warmup_last_chunk_tokens=(), progress=True)  # the workload pushes no last chunks
    if name == "vllm_omni":
        return Code2WavDriver(bt, bt.BatchedToken2Wav(t2w, **yaml), voices, inputs, device)
    if name == "vllm_omni/torch_cfm":  # as the plugin builds it
        backend = bt.BatchedToken2Wav.__new__(bt.BatchedToken2Wav)
        VA.construct_patched(bt.BatchedToken2Wav.__init__, backend, t2w, (), yaml, options)
        if VA.accelerated_backend(backend) is None:
            raise RuntimeError("torch_cfm fell back to vLLM-Omni's own path (see the warning above)")
        return Code2WavDriver(bt, backend, voices, inputs, device)
    server = VA.build_server(flow, hift, wl.n_steps, Options(**options))
    if server.graphs:
        server.warmup(prompt_frames=(wl.prompt_frames,), chunk_tokens=(wl.chunk_tokens,), last_chunk_tokens=())
    return ServerDriver(server, voices, inputs, device)


def summary(rows: list[dict]) -> str:
    """The issue's ratios per (variant, C): patched vs shipped (fp16 flow), vs the front, memory."""
    got = {(r["provider"], r["dtype"], r["variant"], r["concurrency"]): r for r in rows if not r.get("error")}
    lines = []
    for (prov, dt, variant, c), r in sorted(got.items(), key=lambda kv: (kv[0][2], kv[0][3], kv[0][1])):
        if prov != "vllm_omni/torch_cfm":
            continue
        parts = [f"{variant or 'one voice'} C={c} {dt}: {r['audio_s_per_s']} audio-s/s"]
        for base_dt in sorted({"fp16", dt}):
            base = got.get(("vllm_omni", base_dt, variant, c))
            if base and base.get("audio_s_per_s"):
                bar = " (bar: >= 4 at 16)" if base_dt == "fp16" else ""
                parts.append(f"{r['audio_s_per_s'] / base['audio_s_per_s']:.2f}x vllm_omni {base_dt}{bar}")
                if base.get("peak_gib") and r.get("peak_gib") is not None:
                    parts.append(f"peak {r['peak_gib'] / base['peak_gib']:.2f}x{' (bar: <= 0.5 at 16)' if bar else ''}")
                if base.get("reserved_peak_gib") and r.get("reserved_peak_gib") is not None:
                    parts.append(f"reserved {r['reserved_peak_gib'] / base['reserved_peak_gib']:.2f}x")
        front = got.get(("torch_cfm", dt, variant, c))
        if front and front.get("audio_s_per_s"):
            parts.append(f"{r['audio_s_per_s'] / front['audio_s_per_s']:.2f}x torch_cfm front (bar: >= 0.9)")
        lines.append("; ".join(parts))
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", default=None, help="flow dtypes, comma list of fp16,fp32 (default both; CPU: fp32)")
    ap.add_argument("--tiny", action="store_true", help="tiny modules (CPU smoke)")
    ap.add_argument("--quick", action="store_true", help="fewer ticks and chunks")
    ap.add_argument("--concurrency", default=None, help="comma list (default 1,4,16,32; --tiny: 1,2)")
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    ap.add_argument("--mixed-prompts", action="store_true", help="four voice prompts instead of one")
    ap.add_argument("--chunks", type=int, default=None, help="chunks per stream")
    ap.add_argument("--ticks", type=int, default=None)
    ap.add_argument("--warm-ticks", type=int, default=None)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--memory-attribution", action="store_true",
                    help="record every CUDA allocation's stack; rows carry memory_attribution (bench/_memory.py): "
                         "pools reserved vs allocated, allocated bytes by source line (a diagnostic run: "
                         "recording slows allocation)")
    args = ap.parse_args(argv)
    device = args.device
    if args.memory_attribution and device == "cuda":
        M.start()
    size = U.TINY if args.tiny else U.SHIPPED
    cs = [int(c) for c in (args.concurrency or ("1,2" if args.tiny else "1,4,16,32")).split(",")]
    dtypes = (args.dtypes or ("fp16,fp32" if device == "cuda" else "fp32")).split(",")
    wl = S.Workload(prompt_tokens=10 if args.tiny else 150, chunk_tokens=28,
                    chunks=args.chunks or (3 if args.tiny else (6 if args.quick else 12)),
                    n_steps=2 if args.tiny else 10,
                    ticks=args.ticks or (3 if args.tiny else (12 if args.quick else 40)),
                    warm_ticks=args.warm_ticks if args.warm_ticks is not None else (1 if args.tiny else 8))
    command = "python bench/serving_vllm_omni.py " + " ".join(argv if argv is not None else sys.argv[1:])
    env = H.env_info()
    run = env["run_id"]
    if device == "cpu":
        torch.set_num_threads(1)
    rows = []
    with V.vllm_stub() as stub:
        bt = V.load_backend_module()
        flow32 = U.build_flow(size, seed=args.seed)
        U.resize_scratch_buffers(flow32, frames=1, steps=1)  # neither backend uses the upstream's scratch
        hift = V.build_hift(seed=args.seed + 3, shipped=not args.tiny).to(device)
        inputs = S.Inputs(size, wl, device, torch.float32)
        for dname in dtypes:
            flow = (copy.deepcopy(flow32).half() if dname == "fp16" else flow32).to(device)
            # fp32 prompt features whatever the flow's dtype, as vLLM-Omni's prompt extraction gives them
            pool = [inputs.prompt(i) for i in range(4 if args.mixed_prompts else 1)]
            voices = [V.features(bt, p, f"voice{i}") for i, p in enumerate(pool)]
            for name in args.providers.split(","):
                for c in cs:
                    row = dict(env)
                    row.update(op=OP, provider=name, variant="mixed_prompts" if args.mixed_prompts else "",
                               stage="wav", dtype=dname, concurrency=c, run=run, prompt_s=wl.prompt_frames * 0.02,
                               chunk_s=wl.chunk_frames * 0.02, chunks_per_stream=wl.chunks, n_timesteps=wl.n_steps,
                               tiny=args.tiny, command=command)
                    prov = None
                    try:
                        gc.collect()
                        if device == "cuda":
                            torch.cuda.empty_cache()
                            torch.cuda.reset_peak_memory_stats()
                            mem0, res0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
                        stub.new_process()  # vLLM's per-process graph pool: one per backend built here
                        prov = build(name, bt, flow, hift, c, wl, voices, inputs, device, dname == "fp16")
                        if device == "cuda":  # the build and warm-up apart from serving: which sets the peak
                            row["build_peak_gib"] = round((torch.cuda.max_memory_allocated() - mem0) / 2 ** 30, 3)
                            row["build_reserved_gib"] = round((torch.cuda.max_memory_reserved() - res0) / 2 ** 30, 3)
                            torch.cuda.reset_peak_memory_stats()
                        row.update(S.run_one(prov, c, wl, args.seed + c))
                        row["bytes_per_request"] = prov.bytes_per_request()
                        cfm_mem = prov.cfm_memory()
                        if cfm_mem is not None:
                            row["cfm_arena_gib"], row["cfm_graph_pool_gib"] = (round(b / 2 ** 30, 3) for b in cfm_mem)
                        if device == "cuda":
                            row["serve_peak_gib"] = round((torch.cuda.max_memory_allocated() - mem0) / 2 ** 30, 3)
                            row["peak_gib"] = max(row["build_peak_gib"], row["serve_peak_gib"])
                            row["serve_reserved_gib"] = round((torch.cuda.max_memory_reserved() - res0) / 2 ** 30, 3)
                            row["reserved_peak_gib"] = max(row["build_reserved_gib"], row["serve_reserved_gib"])
                            if args.memory_attribution:
                                row["memory_attribution"] = M.attribution(top=15)
                                print("\n".join(M.lines(row["memory_attribution"])), flush=True)
                    except Exception as exc:  # noqa: BLE001 - out of memory, typically: the row says so
                        traceback.print_exc()
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    del prov
                    rows.append(row)
                    H.upsert_rows(os.path.join(args.out, f"{OP}.jsonl"), [row], identity=IDENTITY)
                    print(f"{name:20s} {dname} C={c:3d}: {row.get('audio_s_per_s')} audio-s/s, first chunk p50 "
                          f"{row.get('first_chunk_ms_p50')} ms, peak {row.get('peak_gib')} GiB "
                          f"{row.get('error') or ''}", flush=True)
            del flow
    print(summary(rows))
    print(f"rows: {os.path.join(args.out, OP + '.jsonl')}\nreproduce: {command}")
    return rows


if __name__ == "__main__":
    main()
