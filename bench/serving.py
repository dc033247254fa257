"""Many-stream token2wav serving: Poisson arrivals of streams, torch_cfm's front vs the upstream.

The package's real modules (``tests/upstream_flow.py`` loads them without its TTS stack; the HiFT
vocoder ``stepaudio2.flashcosyvoice.modules.hifigan.HiFTGenerator`` needs scipy) at the shipped
sizes with seeded random weights (``--tiny``: CPU-sized). Workload per concurrency C: streams with
6 s prompts (300 mel frames, 150 + 3 tokens) and 1 s chunks (25 + 3 tokens, 50 frames),
``--chunks`` chunks each; C streams open at the start at staggered progress, then new streams
arrive by a Poisson process of rate C / chunks per tick (Little's law: C open on average) and
wait in a queue when C are open. Each tick every open stream pushes its next chunk (the server
never idles: the throughput regime); ``--warm-ticks`` ticks are run first and not measured (the
CFM's graphs of every batch size met are captured there; ``--warmup`` runs the front's warm-up).

Stages (``--stages``): ``cfm`` (the CFM alone: random encoder outputs), ``mel`` (tokens -> mel:
embedding, conformer encoder, CFM), ``wav`` (tokens -> waveform: + the vocoder with its streaming
caches and cross-fade) and ``voc`` (the vocoder alone, every open stream's 1 s chunk a tick:
``torch_cfm`` = Token2wavServer's vocoder stage; ``upstream_ieee`` / ``upstream_tf32`` = the
package's ``HiFTGenerator`` over the same streams batched per tick, IEEE and TF32 convolutions).
Providers:

* ``torch_cfm``: :class:`torch_cfm.serving.Token2wavServer`, one tick =
  one ``step`` over every open stream (``cfm``: its ``cfm_server.solve_chunk``); CUDA graphs.
* ``torch_cfm/enc_per_stream`` (``mel`` only): the same with ``encoder_batching=False`` (the
  conformer encoder one stream at a time, under CUDA graphs per shape): batching's A/B.
* ``torch_cfm/enc_ragged`` (``mel`` only): the same with ``encoder_batching="ragged"`` (one
  encoder batch across conformer cache lengths: streams in their first chunks next to settled
  ones; with ``--mixed-prompts``, prompts of 3, 6, 8 and 10 s, every reference its own length).
* ``torch_cfm/voices``: the same front with its voice-prompt cache (``voice_cache_bytes``): the
  streams' prompts are ``--voices`` K distinct voices (``all``: every stream its own), each
  solved once (at ``--warmup``, or on its first arrival) and copied into every later stream that
  opens with it; rows report ``voice_hits``/``voice_misses`` and ``open_hit_gpu_ms_p50`` (GPU time
  of an open served from the cache).
* ``torch_cfm/paced``: the same front with ``prompt_steps_per_tick=k`` (``--prompt-steps``,
  default 2): an arriving stream's prompt solve is spread over the next n/k ticks (k Euler steps
  per tick, the same result) instead of running whole in its arrival tick; streams push chunks
  once ``ready``. Its ticks carry about k/n of the recent arrivals' prompt work each, so a clump
  of arrivals no longer makes one long tick; first chunks come n/k ticks later.
* ``upstream``: the package's own per-request path, one request at a time as ``Token2wav.stream``
  runs it (``flow.setup_cache`` / ``flow.inference_chunk`` + its trims, ``HiFTGenerator`` +
  fade; ``cfm``: ``decoder.forward_chunk`` + the estimator trim), eager, in the flow's dtype
  (fp16 autocast as ``Token2wav(float16=True)``). The decoder returns views of its scratch
  buffers; they are cloned per stream so that streams can interleave (one copy per chunk).
  Serial, so its throughput does not depend on C: ``--upstream-max`` bounds the C it runs at.
* ``upstream_graph`` (``cfm`` only): the upstream ``CausalConditionalCFM.solve_euler_chunk``
  over all C streams as one batch (its scratch buffers resized to 2C rows) with every stream's
  cache at the steady-state P + 100 frames, the whole n-step solve captured in one CUDA graph
  (eager on CPU); padded to C rows when fewer are open. No prompt solve (first-chunk latency
  not reported): an upper bound for hand-batching the upstream estimator.

Per row: ``audio_s_per_s`` (audio seconds produced / wall seconds of the measured ticks, the
prompt solves of arriving streams included), ``steady_audio_s_per_s`` (the same over the chunk
steps alone: the steady-state rate the upstream_graph peer, which solves no prompts, is an upper
bound of),
``chunk_ms_p50/p99`` (a chunk's latency: from the tick's start, the prompt solves of the streams
admitted in that tick included, to its result; serial providers: its stream's position in the tick),
``tick_ms_p50/p99`` (a whole tick: the arrivals' setup and prompt solves, the chunks; the serving
loop's period), ``step_ms_p50/p99`` (the step call alone: without the arrivals' setup; the paced
provider's prompt steps included), ``first_chunk_ms_p50/p99`` (from the start of the stream's
arrival tick to its first chunk's result),
``captures_measured`` (CUDA graphs captured during the measured ticks: 0 after a complete warm-up),
``bytes_per_stream`` (the front's memory plan; CUDA: also the measured peak over the empty server /
C), stage shares (``share_encoder``/``share_cfm``/``share_vocoder``, and ``ms_encoder``/``ms_cfm``/``ms_vocoder``
per tick, torch_cfm rows: a separate timed pass, streams all in one phase; ``--arrival-stages``: also
``arrival_ms_*`` under the row's own arrivals, :func:`arrival_stages`), streams and chunks counted. Rows (JSON lines, provenance: gpu, torch, triton, commit)
are upserted into ``serving.jsonl`` (identity: op, provider, variant, stage, concurrency, dtype,
gpu) under
``--out`` (default ``bench/results``); ``serving.md`` (table) and ``serving.png`` (throughput and
p99 chunk latency against C; skipped with a message without matplotlib) are written from it.

``--vocoder causal``: the wav stage's vocoder is minicpmo-utils' causal one (a ``BoundedVocoder``
over a ``CausalHiFTGenerator``, shipped sizes, seeded random weights; the package MiniCPM-o 4.5
requires), served by the front's causal vocoder stage; its rows carry the variant
``causal_vocoder``. The script then re-executes itself with minicpmo-utils' ``stepaudio2`` alone
(``tests/upstream_packages.py``: ``.upstream/minicpmo-utils``); the ``voc`` stage and the upstream
wav path (both the ``HiFTGenerator``'s) are skipped.

    BENCH_COMMIT=$(git rev-parse HEAD) python bench/serving.py --quick          # GPU, fp16
    python bench/serving.py --device cpu --tiny --quick --out /tmp/serving      # CPU smoke
    python bench/serving.py --quick --warmup --stages wav --vocoder causal --providers torch_cfm,torch_cfm/voices
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import math
import os
import random
import sys
import time
import traceback
from typing import Callable, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, os.path.join(ROOT, "tests"), ROOT]

import _harness as H  # noqa: E402
import upstream_flow as U  # noqa: E402
import upstream_packages as P  # noqa: E402
from torch_cfm.serving import StreamPrompt, Token2wavServer  # noqa: E402
from torch_cfm.models.cache import TRIM_KEEP_OLDEST  # noqa: E402

OP = "serving"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
IDENTITY = H.IDENTITIES[OP]
FRAME_S = 0.02  # one mel frame = 20 ms (50 Hz)
STAGE_GRAPHS = [None]  # Token2wavServer(stage_graphs=...): None = with the CFM's graphs; --no-stage-graphs: False
PROMPT_STEPS = [2]  # the paced provider's prompt_steps_per_tick (--prompt-steps)
VOICE_CACHE_BYTES = 8 << 30  # the voices provider's cache budget


def graph_report(server) -> dict:
    """CUDA graphs the front's stages captured, and why any shape stayed eager (first note)."""
    out = {}
    stages = {"enc_call": server.encoder.call}
    for name in ("call", "f0_call", "source_call", "decode_call"):
        if server.vocoder is not None and hasattr(server.vocoder, name):
            stages[f"vocoder_{name}"] = getattr(server.vocoder, name)
    for name, call in stages.items():
        if hasattr(call, "graph_count"):
            eager = [e for e in call.events if e.startswith("kept eager")]
            out[name] = {"graphs": call.graph_count, "eager_note": eager[0][:160] if eager else None}
    return out


@dataclasses.dataclass
class Workload:
    prompt_tokens: int
    chunk_tokens: int
    chunks: int
    n_steps: int
    ticks: int
    warm_ticks: int
    prompt_mix: tuple = ()  # prompt token counts of the pool's prompts (default: all prompt_tokens)

    def pool_tokens(self, i: int) -> int:
        return self.prompt_mix[i % len(self.prompt_mix)] if self.prompt_mix else self.prompt_tokens

    @property
    def prompt_frames(self) -> int:
        """The longest prompt (mel frames)."""
        return 2 * max(self.prompt_mix or (self.prompt_tokens,))

    @property
    def chunk_frames(self) -> int:
        return 2 * (self.chunk_tokens - 3)


class _GpuTimer:
    """CUDA events around a block (``ms`` after it; None when off)."""

    def __init__(self, on: bool) -> None:
        self.on, self.ms = on, None

    def __enter__(self):
        if self.on:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        return self

    def __exit__(self, *exc):
        if self.on:
            self.end.record()
            self.end.synchronize()
            self.ms = self.start.elapsed_time(self.end)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _pct(values, p: float) -> Optional[float]:
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * p
    lo, hi = math.floor(pos), math.ceil(pos)
    return round(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo), 3)


def _poisson(rng: random.Random, lam: float) -> int:
    limit, k, p = math.exp(-lam), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


class Arrivals:
    """C streams at staggered progress, then Poisson arrivals (rate C / chunks per tick) into a queue."""

    def __init__(self, concurrency: int, chunks: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.c, self.chunks, self.next_id = concurrency, chunks, 0
        self.queue: list[tuple[int, int]] = []  # (id, chunks to run)
        for i in range(concurrency):  # the initial streams leave at staggered ticks
            self.queue.append((self._id(), chunks - (i * chunks) // concurrency))

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def tick(self, open_count: int) -> list[tuple[int, int]]:
        """Streams admitted this tick (FIFO, up to C open)."""
        for _ in range(_poisson(self.rng, self.c / self.chunks)):
            self.queue.append((self._id(), self.chunks))
        take = max(0, min(len(self.queue), self.c - open_count))
        admitted, self.queue = self.queue[:take], self.queue[take:]
        return admitted


# ---------------------------------------------------------------------------------- inputs
class Inputs:
    """Per-stream prompts (``voices`` distinct ones, reused; None: every stream its own) and chunk
    tokens (a small pool), on the device."""

    def __init__(self, size: U.FlowSize, wl: Workload, device: str, dtype: torch.dtype,
                 voices: Optional[int] = 4) -> None:
        self.size, self.wl, self.device, self.dtype, self.voices = size, wl, device, dtype, voices
        self._prompts: dict[int, tuple] = {}
        gen = torch.Generator().manual_seed(7)
        self.chunks = [torch.randint(0, size.vocab, (1, wl.chunk_tokens), generator=gen, dtype=torch.int32).to(device)
                       for _ in range(4)]
        self.mu_chunk = [torch.randn(80, wl.chunk_frames, generator=gen).to(device, dtype) for _ in range(4)]

    def voice(self, sid) -> int:
        return sid % self.voices if self.voices else sid

    def _voice_inputs(self, sid) -> tuple:
        v = self.voice(sid)
        if v not in self._prompts:
            gen = torch.Generator().manual_seed(1000 + v)
            frames = 2 * self.wl.pool_tokens(v)
            self._prompts[v] = (U.make_prompt(self.size, self.wl.pool_tokens(v), seed=100 + v, device=self.device,
                                              dtype=self.dtype),
                                torch.randn(80, frames, generator=gen).to(self.device, self.dtype),
                                torch.randn(80, generator=gen).to(self.device, self.dtype))
        return self._prompts[v]

    def prompt(self, sid):
        return self._voice_inputs(sid)[0]

    def mu_prompt(self, sid) -> torch.Tensor:
        return self._voice_inputs(sid)[1]

    def spk80(self, sid) -> torch.Tensor:
        return self._voice_inputs(sid)[2]

    def prompt_frames(self, sid) -> int:
        return self.prompt(sid).frames

    def chunk(self, sid, k):
        return self.chunks[(sid + k) % len(self.chunks)]


# ---------------------------------------------------------------------------------- providers
class TorchCfmProvider:
    name = "torch_cfm"
    reports_first_chunk = True
    encoder_batching = True

    prompt_steps = None  # Token2wavServer(prompt_steps_per_tick=...)
    voice_cache = False  # Token2wavServer(voice_cache_bytes=...): streams open with their voice key
    vocoder_precision = "auto"  # Token2wavServer(vocoder_precision=...)

    def __init__(self, flow, hift, stage: str, c: int, wl: Workload, inputs: Inputs, device: str, dtype) -> None:
        if stage == "cfm" and self.encoder_batching is not True:
            raise ValueError("the encoder A/B has no cfm stage")
        self.stage, self.inputs, self.wl = stage, inputs, wl
        self.server = Token2wavServer(flow, hift if stage == "wav" else None, max_streams=c,
                                      max_prompt_frames=wl.prompt_frames, max_chunk_tokens=wl.chunk_tokens,
                                      n_timesteps=wl.n_steps, dtype=dtype, stage_graphs=STAGE_GRAPHS[0],
                                      encoder_batching=self.encoder_batching,
                                      prompt_steps_per_tick=self.prompt_steps,
                                      voice_cache_bytes=VOICE_CACHE_BYTES if self.voice_cache else None,
                                      vocoder_precision=self.vocoder_precision)
        self.open_gpu_ms: list[float] = []
        self.done: dict[int, int] = {}
        # ticks before the first streams' first chunks (their prompts spread over n/k ticks)
        self.ramp_ticks = 0 if self.prompt_steps is None else -(-wl.n_steps // self.prompt_steps)

    def open(self, ids):
        hits = self.voice_cache and all(self._cached(sid) for sid in ids)
        timer = _GpuTimer(self.server.device.type == "cuda" and hits)
        with timer:
            self._open(ids)
        if timer.ms is not None:
            self.open_gpu_ms.append(timer.ms / len(ids))
        for sid in ids:
            self.done[sid] = 0
        _sync(str(self.server.device.type))  # the prompt solves end here, not inside the next step

    def _cached(self, sid) -> bool:
        return self.server.cfm_server.voice_state(self.inputs.voice(sid)) is not None

    def _open(self, ids):
        inp = self.inputs
        if self.stage == "cfm":
            cfm = self.server.cfm_server
            if self.prompt_steps is not None or self.voice_cache:  # per stream: a copy, or staged and queued
                hits = {sid: inp.voice(sid) for sid in ids if self.voice_cache and self._cached(sid)}
                if hits:  # the hits of one voice restored together
                    cfm.open_voices(hits)
                for sid in (s for s in ids if s not in hits):
                    mu = inp.mu_prompt(sid)
                    cfm.open_request(sid, inp.spk80(sid), prompt_mu=mu, prompt_mel=torch.zeros_like(mu),
                                     voice=inp.voice(sid) if self.voice_cache else None)
            else:
                for sid in ids:
                    cfm.open_request(sid, inp.spk80(sid), prompt_len=inp.prompt_frames(sid))
                cfm.solve_chunk({sid: (inp.mu_prompt(sid), torch.zeros_like(inp.mu_prompt(sid))) for sid in ids})
        else:
            self.server.open_many({sid: StreamPrompt(p.tokens, p.mel, p.spk, sid,
                                                     voice=inp.voice(sid) if self.voice_cache else None)
                                   for sid in ids for p in [inp.prompt(sid)]})

    def warm_voices(self) -> None:
        """Every voice of the workload solved once into the cache (``--warmup``)."""
        if not (self.voice_cache and self.inputs.voices):
            return
        for v in range(self.inputs.voices):
            self.open([-1 - v])
            self.settle([-1 - v])
            self.close(-1 - v)
        self.open_gpu_ms.clear()

    def voice_report(self) -> dict:
        voices = self.server.cfm_server.voices
        if voices is None:
            return {}
        return {"voice_hits": voices.hits, "voice_misses": voices.misses, "voices": self.inputs.voices or "all",
                "open_hit_gpu_ms_p50": _pct(self.open_gpu_ms, 0.5), "open_hit_gpu_ms_p99": _pct(self.open_gpu_ms, 0.99)}

    def ready(self, ids) -> list:
        """The streams of ``ids`` that take a chunk this tick (paced: those whose prompt is solved)."""
        return ids if self.prompt_steps is None else [sid for sid in ids if self.server.cfm_server.ready(sid)]

    def settle(self, ids) -> None:
        """Empty ticks until every stream of ``ids`` takes chunks."""
        while len(self.ready(ids)) < len(ids):
            self.step([])

    def step(self, ids) -> dict:
        """One tick over the ready streams of ``ids`` (paced: the prompt solves under way advance
        first); returns {sid: seconds from the tick's start} for the streams that got a chunk (one
        value: batched)."""
        t0 = time.perf_counter()
        ids = self.ready(ids)
        if self.stage == "cfm":
            self.server.cfm_server.advance_prompts()
            if ids:
                self.server.cfm_server.solve_chunk({sid: self.inputs.mu_chunk[(sid + self.done[sid]) % 4]
                                                    for sid in ids})
        else:
            self.server.step({sid: self.inputs.chunk(sid, self.done[sid]) for sid in ids})
        _sync(str(self.server.device.type))
        dt = time.perf_counter() - t0
        for sid in ids:
            self.done[sid] += 1
        return {sid: dt for sid in ids}

    def close(self, sid):
        if self.stage == "cfm":
            self.server.cfm_server.close_request(sid)
        else:
            self.server.close_stream(sid)
        del self.done[sid]

    def captures(self) -> int:
        """CUDA graphs captured so far, every stage (the CFM solver's captures, the stage calls')."""
        stages = self.server.graph_counts()
        cache = self.server.cfm_server.graph_cache
        return (0 if cache is None else cache.captures) + sum(stages.values()) - stages["cfm"]

    def bytes_per_stream(self) -> int:
        plan = self.server.memory_plan()
        if self.stage == "cfm":
            return plan.cfm
        return plan.cfm + plan.encoder + (plan.vocoder if self.stage == "wav" else 0)


class TorchCfmPacedProvider(TorchCfmProvider):
    """The front with ``prompt_steps_per_tick`` (``--prompt-steps``): prompt solves spread over ticks."""

    name = "torch_cfm/paced"

    @property
    def prompt_steps(self):  # noqa: D401 - read when the server is built
        return PROMPT_STEPS[0]


class TorchCfmVoicesProvider(TorchCfmProvider):
    """The front with its voice-prompt cache: streams open with their voice key (``--voices``)."""

    name = "torch_cfm/voices"
    voice_cache = True


class TorchCfmEncPerStreamProvider(TorchCfmProvider):
    """The front with its encoder run one stream at a time (``encoder_batching=False``; under CUDA
    graphs per stream shape): the A/B of batching the conformer encoder."""

    name = "torch_cfm/enc_per_stream"
    encoder_batching = False


class TorchCfmEncRaggedProvider(TorchCfmProvider):
    """The front with ``encoder_batching="ragged"``: one encoder batch across cache lengths
    (streams in their first chunks next to settled ones, mixed prompt lengths)."""

    name = "torch_cfm/enc_ragged"
    encoder_batching = "ragged"


class TorchCfmVocFp16Provider(TorchCfmProvider):
    """The front with its HiFT vocoder's convolutions on 16-bit operands (``vocoder_precision="fp16"``,
    the explicit option; the default is TF32): tokens -> waveform only."""

    name = "torch_cfm/voc_fp16"
    vocoder_precision = "fp16"


class VocoderProvider:
    """The vocoder stage alone (stage ``voc``): every open stream's 1 s chunk of mel a tick."""

    name = "torch_cfm"
    reports_first_chunk = False
    kind, tf32 = "torch_cfm", None  # Token2wavServer(vocoder=kind); the upstream peers' cuDNN TF32

    def __init__(self, flow, hift, stage: str, c: int, wl: Workload, inputs: Inputs, device: str, dtype) -> None:
        if stage != "voc":
            raise ValueError(f"{self.name} runs the voc stage only")
        self.server = Token2wavServer(flow, hift, max_streams=c, max_prompt_frames=wl.prompt_frames,
                                      max_chunk_tokens=wl.chunk_tokens, n_timesteps=wl.n_steps, dtype=dtype,
                                      stage_graphs=STAGE_GRAPHS[0], vocoder=self.kind)
        self.stage, self.device, self.done = self.server.vocoder, device, {}
        gen = torch.Generator().manual_seed(11)
        self.mels = [(0.5 * torch.randn(80, wl.chunk_frames, generator=gen)).to(device) for _ in range(4)]

    def _flags(self):
        import contextlib

        return contextlib.nullcontext() if self.tf32 is None else torch.backends.cudnn.flags(
            enabled=True, allow_tf32=self.tf32)

    def warm(self, c: int) -> int:
        """The server's warm-up for this stage alone: at each batch bucket up to ``c`` (and ``c``), twice,
        that many streams open, 3 ticks (a first chunk and cached ones), close; returns the graphs."""
        counts = sorted({b for b in (self.server.batch_buckets or []) if b <= c} | {c})
        with self._flags(), torch.no_grad():
            for _ in range(2):  # a new shape runs eagerly once, then is captured
                for n in counts:
                    ids = [("__warm__", i) for i in range(n)]
                    for i, sid in enumerate(ids):
                        self.stage.open(sid, seed=i)
                    for t in range(3):
                        self.stage([(sid, self.mels[(i + t) % 4], False) for i, sid in enumerate(ids)])
                    for sid in ids:
                        self.stage.close(sid)
        _sync(self.device)
        return self.captures()

    def open(self, ids):
        for sid in ids:
            self.stage.open(sid, seed=sid)
            self.done[sid] = 0

    def step(self, ids) -> dict:
        t0 = time.perf_counter()
        with self._flags(), torch.no_grad():
            self.stage([(sid, self.mels[(sid + self.done[sid]) % 4], False) for sid in ids])
        _sync(self.device)
        dt = time.perf_counter() - t0
        for sid in ids:
            self.done[sid] += 1
        return {sid: dt for sid in ids}

    def close(self, sid):
        self.stage.close(sid)
        del self.done[sid]

    def captures(self) -> int:
        return self.server.graph_counts()["vocoder"] if "vocoder" in self.server.graph_counts() else 0

    def bytes_per_stream(self) -> int:
        return self.stage.stream_bytes()


class UpstreamVocoderIeee(VocoderProvider):
    """The package's HiFT modules batched per tick (Token2wavServer(vocoder="upstream")), IEEE fp32 convolutions."""

    name, kind, tf32 = "upstream_ieee", "upstream", False


class UpstreamVocoderTf32(VocoderProvider):
    """The same with TF32 convolutions (PyTorch's cuDNN default)."""

    name, kind, tf32 = "upstream_tf32", "upstream", True


class UpstreamProvider:
    """The upstream per-request path: one stream's chunk at a time, as Token2wav.stream runs it."""

    name = "upstream"
    reports_first_chunk = True

    def __init__(self, flow, hift, stage: str, c: int, wl: Workload, inputs: Inputs, device: str, dtype) -> None:
        self.flow, self.hift, self.stage, self.wl, self.inputs = flow, hift, stage, wl, inputs
        self.device, self.dtype = device, dtype
        self.state: dict[int, dict] = {}
        if hift is not None:
            import numpy as np

            self.samples = int(hift.m_source.l_sin_gen.upsample_scale) * 8
            self.window = torch.from_numpy(np.hamming(2 * self.samples)).to(device)

    def _autocast(self):
        return torch.amp.autocast(self.device, dtype=self.dtype,
                                  enabled=self.device == "cuda" and self.dtype != torch.float32)

    def open(self, ids):
        for sid in ids:
            p = self.inputs.prompt(sid)
            with torch.inference_mode(), self._autocast():
                if self.stage == "cfm":
                    dec = self.flow.decoder
                    mu, spk = self.inputs.mu_prompt(sid)[None], self.inputs.spk80(sid)[None]
                    _, cnn, att = dec.forward_chunk(mu, spk, torch.zeros_like(mu), n_timesteps=self.wl.n_steps)
                    st = {"cnn": cnn.clone(), "att": att.clone()}
                else:
                    st = {"cache": {k: v.clone() for k, v in self.flow.setup_cache(
                        p.tokens, p.mel, p.spk, n_timesteps=self.wl.n_steps).items()}}
            st.update(done=0, hmel=torch.zeros(1, 80, 0, device=self.device),
                      hsource=torch.zeros(1, 1, 0, device=self.device), hspeech=torch.zeros(1, 0, device=self.device))
            self.state[sid] = st
        _sync(self.device)

    def _trim(self, t, dim, p):
        if t.shape[dim] > p + TRIM_KEEP_OLDEST:
            t = torch.cat([t.narrow(dim, 0, p), t.narrow(dim, t.shape[dim] - TRIM_KEEP_OLDEST, TRIM_KEEP_OLDEST)], dim)
        return t

    def step(self, ids) -> dict:
        t0, out = time.perf_counter(), {}
        for sid in ids:
            st = self.state[sid]
            with torch.inference_mode(), self._autocast():
                if self.stage == "cfm":
                    dec = self.flow.decoder
                    _, cnn, att = dec.forward_chunk(self.inputs.mu_chunk[(sid + st["done"]) % 4][None],
                                                    self.inputs.spk80(sid)[None],
                                                    torch.zeros_like(self.inputs.mu_chunk[0][None]),
                                                    n_timesteps=self.wl.n_steps, cnn_cache=st["cnn"],
                                                    att_cache=st["att"])
                    # the decoder returns views of its scratch buffers: cloned so that streams interleave
                    st["cnn"], st["att"] = cnn.clone(), self._trim(att, 4, self.inputs.prompt_frames(sid)).clone()
                else:
                    p = self.inputs.prompt(sid)
                    mel, cache = self.flow.inference_chunk(self.inputs.chunk(sid, st["done"]), p.spk, st["cache"],
                                                           n_timesteps=self.wl.n_steps)
                    cache["estimator_att_cache"] = self._trim(cache["estimator_att_cache"], 4, p.frames).clone()
                    cache["estimator_cnn_cache"] = cache["estimator_cnn_cache"].clone()
                    cache["conformer_att_cache"] = self._trim(cache["conformer_att_cache"], 3, p.frames)
                    st["cache"] = cache
            if self.stage == "wav":
                with torch.inference_mode():
                    m = torch.cat([st["hmel"], mel.float()], dim=2)
                    speech, source = self.hift(m, st["hsource"])
                    n = self.samples
                    if st["hspeech"].shape[-1] > 0:
                        speech = speech.clone()
                        speech[..., :n] = speech[..., :n] * self.window[:n] + st["hspeech"][..., -n:] * self.window[n:]
                    st["hmel"], st["hsource"] = m[..., -8:].clone(), source[:, :, -n:].clone()
                    st["hspeech"] = speech[:, -n:].clone()
                    speech[:, :-n].cpu()  # Token2wav.stream hands the samples to the host
            _sync(self.device)
            st["done"] += 1
            out[sid] = time.perf_counter() - t0
        return out

    def close(self, sid):
        del self.state[sid]

    def bytes_per_stream(self) -> Optional[int]:
        return None


class UpstreamGraphProvider:
    """The upstream CFM solver over all C streams as one batch, the whole solve in one CUDA graph."""

    name = "upstream_graph"
    reports_first_chunk = False  # no prompt solve modelled

    def __init__(self, flow, hift, stage: str, c: int, wl: Workload, inputs: Inputs, device: str, dtype) -> None:
        if stage != "cfm":
            raise ValueError("upstream_graph runs the cfm stage only")
        self.device, self.c = device, c
        dec = copy.deepcopy(flow.decoder).to(dtype)
        est = dec.estimator
        depth, attn = len(est.blocks), est.blocks[0].attn
        hidden, n, t = est.in_proj.out_features, wl.n_steps, wl.chunk_frames
        length = wl.prompt_frames + TRIM_KEEP_OLDEST
        kw = dict(device=device, dtype=dtype)
        rows = 2 * c
        est.att_cache_buffer = torch.zeros((depth, rows, attn.num_heads, length + t, 2 * attn.head_dim), **kw)
        est.cnn_cache_buffer = torch.zeros((depth, rows, 2 * hidden, 2), **kw)
        dec.att_cache_buffer = torch.zeros((n, *est.att_cache_buffer.shape), **kw)
        dec.cnn_cache_buffer = torch.zeros((n, *est.cnn_cache_buffer.shape), **kw)
        gen = torch.Generator().manual_seed(3)
        r = lambda *s: (0.5 * torch.randn(*s, generator=gen)).to(**kw)  # noqa: E731
        self.att = r(n, depth, rows, attn.num_heads, length, 2 * attn.head_dim)
        self.cnn = r(n, depth, rows, 2 * hidden, 2)
        self.mu, self.spks, self.cond = r(c, 80, t), r(c, 80), torch.zeros(c, 80, t, **kw)
        self.x = dec.rand_noise[:, :, length:length + t].to(**kw).expand(c, -1, -1).contiguous()
        t_span = torch.linspace(0, 1, n + 1, device=device, dtype=dtype)
        self.t_span = 1 - torch.cos(t_span * 0.5 * torch.pi)
        self.dec = dec

        # The upstream solve_euler_chunk is batch-1 only (its t has 2 rows): the same loop over 2C rows,
        # calling the upstream estimator and storing each step's caches like it does.
        mu2 = torch.cat([self.mu, torch.zeros_like(self.mu)])
        spks2 = torch.cat([self.spks, torch.zeros_like(self.spks)])
        cond2 = torch.cat([self.cond, torch.zeros_like(self.cond)])
        cfg = float(dec.inference_cfg_rate)

        def solve():
            x = self.x
            for i in range(n):
                t_i = self.t_span[i].expand(rows)
                v, new_cnn, new_att = est.forward_chunk(x.repeat(2, 1, 1), mu2, t_i, spks2, cond2,
                                                        self.cnn[i], self.att[i])
                v, v_cfg = v.chunk(2, dim=0)
                x = x + (self.t_span[i + 1] - self.t_span[i]) * ((1.0 + cfg) * v - cfg * v_cfg)
                dec.cnn_cache_buffer[i] = new_cnn
                dec.att_cache_buffer[i][:, :, :, :new_att.shape[3]] = new_att
            return x

        self.fn = solve
        # torch.device(device): the upstream TimestepEmbedder makes its frequency table with a
        # CPU arange in every call (a host copy no capture can hold); as a factory default the
        # same table is made on the device. The math is the upstream's.
        with torch.inference_mode(), torch.device(device):
            if device == "cuda":
                self.graph, _ = H.capture_cuda_graph(solve)
                self.fn = self.graph.replay
            else:
                solve()
        self.open_ids: set = set()

    def open(self, ids):
        self.open_ids.update(ids)

    def step(self, ids) -> dict:
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.fn()
        _sync(self.device)
        dt = time.perf_counter() - t0
        return {sid: dt for sid in ids}

    def close(self, sid):
        self.open_ids.discard(sid)

    def bytes_per_stream(self) -> int:
        held = sum(t.numel() * t.element_size() for t in (self.att, self.cnn, self.dec.att_cache_buffer,
                                                         self.dec.cnn_cache_buffer))
        return held // self.c


PROVIDERS = {"torch_cfm": TorchCfmProvider, "torch_cfm/paced": TorchCfmPacedProvider,
             "torch_cfm/voices": TorchCfmVoicesProvider, "upstream_ieee": UpstreamVocoderIeee,
             "upstream_tf32": UpstreamVocoderTf32,
             "torch_cfm/enc_per_stream": TorchCfmEncPerStreamProvider,
             "torch_cfm/enc_ragged": TorchCfmEncRaggedProvider, "torch_cfm/voc_fp16": TorchCfmVocFp16Provider,
             "upstream": UpstreamProvider, "upstream_graph": UpstreamGraphProvider}


# ---------------------------------------------------------------------------------- one run
def run_one(provider, c: int, wl: Workload, seed: int, on_measure: Optional[Callable[[], None]] = None) -> dict:
    """The workload's ticks over ``provider`` (``on_measure``: called before the first measured tick)."""
    arrivals = Arrivals(c, wl.chunks, seed)
    remaining: dict[int, int] = {}
    chunk_lat, tick_times, step_times, first, new_at = [], [], [], [], {}
    frames = streams = chunks = 0
    measured_s = step_s = 0.0
    captures = getattr(provider, "captures", lambda: 0)
    captured_before = None
    warm_ticks = wl.warm_ticks + getattr(provider, "ramp_ticks", 0)
    for tick in range(warm_ticks + wl.ticks):
        measure = tick >= warm_ticks
        if measure and captured_before is None:
            captured_before = captures()
            if on_measure is not None:
                on_measure()
        admitted = arrivals.tick(len(remaining))
        t0 = time.perf_counter()
        if admitted:
            provider.open([sid for sid, _ in admitted])
        t_step = time.perf_counter()
        setup = t_step - t0
        for sid, n in admitted:
            remaining[sid] = n
            new_at[sid] = t0  # the start of its arrival tick
        if not remaining:
            continue
        lat = provider.step(list(remaining))  # the streams that got a chunk (paced: the ready ones)
        step_end = time.perf_counter()
        tick_s = step_end - t0
        ids = list(lat)
        if measure:
            measured_s += tick_s
            step_s += step_end - t_step
            tick_times.append(tick_s * 1e3)
            step_times.append((step_end - t_step) * 1e3)
            streams += len(admitted)
            for sid in ids:  # a tick's prompt solves delay every chunk of that tick
                chunk_lat.append((setup + lat[sid]) * 1e3)
                if sid in new_at and provider.reports_first_chunk:
                    first.append((t_step + lat[sid] - new_at[sid]) * 1e3)
            frames += len(ids) * wl.chunk_frames
            chunks += len(ids)
        for sid in ids:
            new_at.pop(sid, None)
            remaining[sid] -= 1
            if remaining[sid] == 0:
                provider.close(sid)
                del remaining[sid]
    for sid in list(remaining):
        provider.close(sid)
    return {"audio_s_per_s": round(frames * FRAME_S / measured_s, 3) if measured_s else None,
            "steady_audio_s_per_s": round(frames * FRAME_S / step_s, 3) if step_s else None,
            "chunk_ms_p50": _pct(chunk_lat, 0.5), "chunk_ms_p99": _pct(chunk_lat, 0.99),
            "tick_ms_p50": _pct(tick_times, 0.5), "tick_ms_p99": _pct(tick_times, 0.99),
            "step_ms_p50": _pct(step_times, 0.5), "step_ms_p99": _pct(step_times, 0.99),
            "step_ms_mean": round(step_s * 1e3 / len(step_times), 3) if step_times else None,
            "first_chunk_ms_p50": _pct(first, 0.5), "first_chunk_ms_p99": _pct(first, 0.99),
            "ticks": len(tick_times), "streams": streams, "chunks": chunks, "measured_s": round(measured_s, 3),
            "captures_measured": captures() - (captured_before or 0)}


CAUSAL_PACKAGE = "minicpmo-utils"


def causal_vocoder(tiny: bool, seed: int, device: str):
    """minicpmo-utils' ``BoundedVocoder`` over a ``CausalHiFTGenerator`` (float32, as its
    ``Token2wav`` keeps it) with seeded random weights, at the shipped sizes or tiny ones."""
    mods = P.load_minicpmo_token2wav()
    bad = P.check_isolated(CAUSAL_PACKAGE)
    if bad:
        raise SystemExit(f"serving: stepaudio2 is not {CAUSAL_PACKAGE}'s alone: {bad}")
    model = P.build_causal_hift(mods, seed=seed, **(P.TINY_CAUSAL if tiny else P.SHIPPED_CAUSAL))
    return mods.BoundedVocoder(model.to(device))


def stage_shares(provider: TorchCfmProvider, c: int, wl: Workload) -> dict:
    """The front's per-stage seconds over a few ticks of C streams (timing=True syncs per stage)."""
    server = provider.server
    server.timing = True
    for key in ("encoder", "cfm", "vocoder"):
        server.stats[key] = 0.0
    ids = [10_000 + i for i in range(c)]
    provider.open(ids)
    provider.settle(ids)
    for key in ("encoder", "cfm", "vocoder"):
        server.stats[key] = 0.0
    for _ in range(3):
        provider.step(ids)
    for sid in ids:
        provider.close(sid)
    server.timing = False
    total = sum(server.stats[k] for k in ("encoder", "cfm", "vocoder")) or float("nan")
    out = {f"share_{k}": round(server.stats[k] / total, 3) for k in ("encoder", "cfm", "vocoder")}
    out.update({f"ms_{k}": round(server.stats[k] / 3 * 1e3, 3) for k in ("encoder", "cfm", "vocoder")})
    return out


def arrival_stages(provider: TorchCfmProvider, c: int, wl: Workload, seed: int) -> dict:
    """The front's per-stage ms per tick under the row's own arrivals (a second pass of :func:`run_one`
    with timing=True, which syncs per stage): ``arrival_ms_<stage>``, the pass's mean step
    (``arrival_step_ms_mean``) and what the step spends outside the three stages (``arrival_ms_other``:
    checks, grouping and the provider's own work). :func:`stage_shares` times streams all in one phase
    (one encoder group, equal caches); this times the mix of cache lengths arrivals make."""
    server = provider.server
    keys = ("encoder", "cfm", "vocoder", "ticks")
    opening = dict.fromkeys(keys, 0.0)  # what the arrivals' prompt solves add (outside the steps)
    plain_open = provider.open

    def reset() -> None:
        for key in keys:
            server.stats[key] = opening[key] = 0

    def open_(ids) -> None:
        before = {k: server.stats[k] for k in keys}
        plain_open(ids)
        for k in keys:
            opening[k] += server.stats[k] - before[k]

    server.timing, provider.open = True, open_
    try:
        reset()
        got = run_one(provider, c, wl, seed, on_measure=reset)
    finally:
        server.timing = False
        del provider.open  # the class's method again
    ticks = server.stats["ticks"]
    if not ticks or got["step_ms_mean"] is None:
        return {}
    out = {f"arrival_ms_{k}": round((server.stats[k] - opening[k]) / ticks * 1e3, 3) for k in keys[:3]}
    out["arrival_step_ms_mean"] = got["step_ms_mean"]
    out["arrival_ms_other"] = round(got["step_ms_mean"] - sum(out[f"arrival_ms_{k}"] for k in keys[:3]), 3)
    return out


# ---------------------------------------------------------------------------------- output
def _reproduce(rows: list[dict]) -> str:
    """The commands behind the rows (each row keeps its own), with their commits."""
    seen = {}
    for r in rows:
        if r.get("command"):
            seen.setdefault(r["command"], set()).add(str(r.get("commit") or "")[:7])
    return "; ".join(f"{cmd} ({', '.join(sorted(commits))})" for cmd, commits in seen.items()) or \
        "python3 bench/serving.py --quick --ticks 40 --warmup (GPU; --device cpu --tiny: CPU smoke)"


def _fmt(v, digits=1):
    return "" if v is None else (f"{v:.{digits}f}" if isinstance(v, float) else str(v))


def write_table(rows: list[dict], path: str, command: str) -> str:
    lines = ["# Many-stream token2wav serving (bench/serving.py)", "",
             "Poisson arrivals, 6 s prompts, 1 s chunks; every open stream pushes a chunk each tick. "
             "audio-s/s = audio seconds produced per wall second (steady: over the chunk steps alone, "
             "without the arriving streams' prompt solves); latencies in ms.", "",
             "| run | gpu | dtype | stage | provider | C | audio-s/s | steady audio-s/s | chunk p50 | chunk p99 | "
             "tick p50 | tick p99/p50 | step p50 | step p99/p50 | first chunk p50 | first chunk p99 | captures | "
             "bytes/stream | ms enc/cfm/voc per tick | voice hits/misses | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    labels = H.run_labels(rows)
    def key(r):
        return (labels[H.run_of(r)], r.get("gpu") or "", r.get("dtype") or "", r.get("stage") or "",
                r.get("provider") or "", r.get("variant") or "", r.get("concurrency") or 0)

    for r in sorted(rows, key=key):
        ratio = (r["step_ms_p99"] / r["step_ms_p50"]) if r.get("step_ms_p50") else None
        tick_ratio = (r["tick_ms_p99"] / r["tick_ms_p50"]) if r.get("tick_ms_p50") else None
        stage_ms = "/".join(_fmt(r.get(f"ms_{k}"), 2) for k in ("encoder", "cfm", "vocoder")) \
            if r.get("ms_cfm") is not None else ""
        hits = f"{r['voice_hits']}/{r['voice_misses']}" if r.get("voice_hits") is not None else ""
        lines.append("| " + " | ".join([labels[H.run_of(r)], str(r.get("gpu")), str(r.get("dtype")), str(r.get("stage")),
                                        str(r.get("provider")) + (f" ({r['variant']})" if r.get("variant") else ""),
                                        str(r.get("concurrency")),
                                        _fmt(r.get("audio_s_per_s"), 2), _fmt(r.get("steady_audio_s_per_s"), 2),
                                        _fmt(r.get("chunk_ms_p50")), _fmt(r.get("chunk_ms_p99")),
                                        _fmt(r.get("tick_ms_p50")), _fmt(tick_ratio, 2),
                                        _fmt(r.get("step_ms_p50")), _fmt(ratio, 2), _fmt(r.get("first_chunk_ms_p50")),
                                        _fmt(r.get("first_chunk_ms_p99")), _fmt(r.get("captures_measured")),
                                        _fmt(r.get("bytes_per_stream")), stage_ms, hits,
                                        (r.get("error") or "")[:60]]) + " |")
    lines += ["", "Runs (compare rows of one run only):", H.run_legend(rows, labels)]
    text = "\n".join(lines) + "\n" + H.provenance_footer(rows, command)
    with open(path, "w") as f:
        f.write(text)
    return text


def write_plot(rows: list[dict], path: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("serving: matplotlib is not installed, no plot written (pip install matplotlib)")
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    series: dict = {}
    for r in rows:
        if r.get("audio_s_per_s") is None:
            continue
        prov = r["provider"] + (f" ({r['variant']})" if r.get("variant") else "")
        series.setdefault((r["gpu"], r["dtype"], r["stage"], prov), []).append(r)
    for (gpu, dt, stage, prov), rs in sorted(series.items()):
        rs = sorted(rs, key=lambda r: r["concurrency"])
        cs = [r["concurrency"] for r in rs]
        ax1.plot(cs, [r["audio_s_per_s"] for r in rs], marker="o", label=f"{prov} {stage} {dt}")
        ax2.plot(cs, [r["chunk_ms_p99"] for r in rs], marker="o", label=f"{prov} {stage} {dt}")
    for ax, title in ((ax1, "throughput (audio-s / s)"), (ax2, "chunk latency p99 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrent streams")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


# ---------------------------------------------------------------------------------- main
def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="fp16 | bf16 | fp32 (default fp16 on CUDA, fp32 on CPU)")
    ap.add_argument("--tiny", action="store_true", help="tiny modules (CPU smoke)")
    ap.add_argument("--quick", action="store_true", help="fewer ticks and chunks")
    ap.add_argument("--concurrency", default=None, help="comma list (default 1,4,16,32,64; --tiny: 1,2)")
    ap.add_argument("--stages", default="cfm,mel,wav")
    ap.add_argument("--providers",
                    default="torch_cfm,torch_cfm/paced,torch_cfm/enc_per_stream,torch_cfm/enc_ragged,upstream,"
                            "upstream_graph")
    ap.add_argument("--prompt-steps", type=int, default=2,
                    help="torch_cfm/paced: prompt_steps_per_tick (Euler steps of a prompt solve per tick)")
    ap.add_argument("--voices", default="4",
                    help="distinct prompts the streams open with (an int, or 'all': every stream its own)")
    ap.add_argument("--mixed-prompts", action="store_true",
                    help="prompts of 3, 6, 8 and 10 s (tiny: 5, 10, 13, 16 tokens) instead of 6 s each")
    ap.add_argument("--upstream-max", type=int, default=None, help="largest C the serial upstream path runs at")
    ap.add_argument("--chunks", type=int, default=None, help="chunks per stream")
    ap.add_argument("--ticks", type=int, default=None)
    ap.add_argument("--warm-ticks", type=int, default=None)
    ap.add_argument("--n-steps", type=int, default=None)
    ap.add_argument("--warmup", action="store_true", help="run Token2wavServer.warmup before the ticks")
    ap.add_argument("--no-stage-graphs", action="store_true",
                    help="run the front's encoder and HiFT eagerly (the CFM keeps its graphs): the graphs' A/B")
    ap.add_argument("--vocoder", choices=("hift", "causal"), default="hift",
                    help="the wav stage's vocoder: the HiFTGenerator, or minicpmo-utils' causal one")
    ap.add_argument("--arrival-stages", action="store_true",
                    help="torch_cfm mel/wav rows: also time each stage per tick under the row's own arrivals "
                         "(a second pass, synced per stage: arrival_ms_*)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tables", action="store_true",
                    help="only regenerate serving.md and serving.png from --out's serving.jsonl "
                         "(after _harness.py --merge)")
    args = ap.parse_args(argv)
    if args.tables:
        rows = H.read_rows(os.path.join(args.out, "serving.jsonl"))
        print(write_table(rows, os.path.join(args.out, "serving.md"), _reproduce(rows)))
        write_plot(rows, os.path.join(args.out, "serving.png"))
        return rows
    causal = args.vocoder == "causal"
    if causal:
        P.reexec_isolated(CAUSAL_PACKAGE, __file__, list(sys.argv[1:] if argv is None else argv), "serving")
    STAGE_GRAPHS[0] = False if args.no_stage_graphs else None
    PROMPT_STEPS[0] = args.prompt_steps
    device = args.device
    dname = args.dtype or ("fp16" if device == "cuda" else "fp32")
    dtype = DTYPES[dname]
    size = U.TINY if args.tiny else U.SHIPPED
    cs = [int(c) for c in (args.concurrency or ("1,2" if args.tiny else "1,4,16,32,64")).split(",")]
    mix = ((5, 10, 13, 16) if args.tiny else (75, 150, 200, 250)) if args.mixed_prompts else ()
    wl = Workload(prompt_tokens=10 if args.tiny else 150, chunk_tokens=28, prompt_mix=mix,
                  chunks=args.chunks or (3 if args.tiny else (6 if args.quick else 12)),
                  n_steps=args.n_steps or (2 if args.tiny else 10),
                  ticks=args.ticks or (3 if args.tiny else (12 if args.quick else 40)),
                  warm_ticks=args.warm_ticks if args.warm_ticks is not None else (1 if args.tiny else
                                                                                 (8 if args.quick else 16)))
    up_max = args.upstream_max or (max(cs) if args.tiny else (4 if args.quick else 16))
    torch.manual_seed(args.seed)
    if device == "cpu":
        torch.set_num_threads(1)  # tiny ops: more threads on a shared box cost more than they give
    env = H.env_info()
    flow = U.build_flow(size, seed=args.seed)
    if size.buffer_frames < wl.prompt_frames + TRIM_KEEP_OLDEST + wl.chunk_frames:
        U.resize_scratch_buffers(flow, wl.prompt_frames + TRIM_KEEP_OLDEST + wl.chunk_frames)
    flow = flow.to(device=device, dtype=dtype)
    hift, hift_error = None, None
    if causal and "wav" in args.stages:
        hift = causal_vocoder(args.tiny, args.seed, device)
    elif "wav" in args.stages or "voc" in args.stages:
        try:
            import importlib

            hifigan = importlib.import_module("stepaudio2.flashcosyvoice.modules.hifigan")
            torch.manual_seed(args.seed)
            if args.tiny:
                import token2wav_reference as R

                hift = R.build_hift(seed=args.seed)
            else:
                hift = hifigan.HiFTGenerator().eval()  # Token2wav keeps its HiFT in fp32
            hift = hift.to(device)
        except Exception as exc:  # noqa: BLE001 - scipy missing, typically
            hift_error = f"{type(exc).__name__}: {exc}"[:300]
            print(f"serving: no HiFT ({hift_error}); the wav stage is skipped")
    voices = None if args.voices == "all" else int(args.voices)
    inputs = Inputs(size, wl, device, dtype, voices=voices)
    rows = []
    command = "python bench/serving.py " + " ".join(argv if argv is not None else sys.argv[1:])
    for stage in args.stages.split(","):
        for prov_name in args.providers.split(","):
            if causal and (stage == "voc" or (stage == "wav" and not prov_name.startswith("torch_cfm"))):
                continue  # the HiFTGenerator's paths
            if stage == "voc":
                if prov_name not in ("torch_cfm", "upstream_ieee", "upstream_tf32"):
                    continue
            elif prov_name in ("upstream_ieee", "upstream_tf32") or (prov_name == "upstream_graph" and stage != "cfm") \
                    or (prov_name in ("torch_cfm/enc_per_stream", "torch_cfm/enc_ragged") and stage != "mel") \
                    or (prov_name == "torch_cfm/voc_fp16" and stage != "wav"):
                continue
            for c in cs:
                if prov_name == "upstream" and c > up_max:
                    continue
                variant = "+".join(v for v, on in (("no_stage_graphs", args.no_stage_graphs and prov_name.startswith(
                    "torch_cfm")), ("mixed_prompts", args.mixed_prompts),
                    (f"prompt_steps_{args.prompt_steps}", prov_name == "torch_cfm/paced"),
                    (f"voices_{args.voices}", prov_name == "torch_cfm/voices"),
                    ("causal_vocoder", causal and stage == "wav")) if on)
                base = dict(op=OP, provider=prov_name, variant=variant, stage=stage, concurrency=c, dtype=dname,
                            prompt_s=[2 * wl.pool_tokens(i) * FRAME_S for i in range(4)] if mix
                            else wl.prompt_frames * FRAME_S, chunk_s=wl.chunk_frames * FRAME_S,
                            chunks_per_stream=wl.chunks, n_timesteps=wl.n_steps, tiny=args.tiny, command=command,
                            prompt_steps_per_tick=args.prompt_steps if prov_name == "torch_cfm/paced" else None,
                            **env)
                if stage in ("wav", "voc") and hift is None:
                    rows.append(dict(base, error=f"no HiFT: {hift_error}"))
                    continue
                try:
                    gc.collect()  # whatever the last provider left in reference cycles, freed before the next allocates
                    if device == "cuda":
                        torch.cuda.empty_cache()
                        torch.cuda.reset_peak_memory_stats()
                        mem0 = torch.cuda.memory_allocated()
                    cls = VocoderProvider if stage == "voc" and prov_name == "torch_cfm" else PROVIDERS[prov_name]
                    prov = cls(flow, hift, stage, c, wl, inputs, device, dtype)
                    if args.warmup and stage == "voc" and hasattr(prov, "warm"):
                        print(f"warmup: {prov.warm(c)} vocoder graphs", flush=True)
                    if args.warmup and prov_name.startswith("torch_cfm") and stage != "voc":
                        warm = prov.server.warmup(prompt_frames=(wl.prompt_frames,), chunk_tokens=(wl.chunk_tokens,))
                        print(f"warmup: {warm}", flush=True)
                        prov.warm_voices()
                    row = dict(base, **run_one(prov, c, wl, args.seed + c))
                    row["bytes_per_stream"] = prov.bytes_per_stream()
                    row.update(prov.voice_report() if hasattr(prov, "voice_report") else {})
                    if device == "cuda":
                        row["measured_bytes_per_stream"] = (torch.cuda.max_memory_allocated() - mem0) // c
                    if prov_name.startswith("torch_cfm") and stage in ("mel", "wav"):
                        row.update(stage_shares(prov, c, wl))
                        row["stage_graphs"] = graph_report(prov.server)
                        if args.arrival_stages:
                            row.update(arrival_stages(prov, c, wl, args.seed + c))
                    del prov
                except Exception as exc:  # noqa: BLE001
                    traceback.print_exc()
                    row = dict(base, error=f"{type(exc).__name__}: {str(exc)[:300]}")
                rows.append(row)
                H.upsert_rows(os.path.join(args.out, "serving.jsonl"), [row], identity=IDENTITY)  # kept if cut short
                print(f"{stage:4s} {prov_name:15s} C={c:3d}: {row.get('audio_s_per_s')} audio-s/s, chunk p50 "
                      f"{row.get('chunk_ms_p50')} p99 {row.get('chunk_ms_p99')} ms, first chunk p50 "
                      f"{row.get('first_chunk_ms_p50')} ms {row.get('error') or ''}", flush=True)
    all_rows = H.upsert_rows(os.path.join(args.out, "serving.jsonl"), [], identity=IDENTITY)
    print(write_table(all_rows, os.path.join(args.out, "serving.md"), _reproduce(all_rows)))
    plot = write_plot(all_rows, os.path.join(args.out, "serving.png"))
    if plot:
        print(f"serving: plot {plot}")
    return rows


if __name__ == "__main__":
    main()
