"""``python -m torch_cfm.demo``: stream several TTS requests through the CFM server.

Requests with different prompt lengths, chunk counts and start times are solved together, one
1-second chunk (50 mel frames) per request per tick, through ``CFMServer`` (10-step Euler, CFG
0.7, ragged rows, streaming trim). Weights: seeded random weights of realistic scale with the
shipped config (C=512, 16 blocks), or ``--checkpoint PATH`` (estimator state_dict or a flow
checkpoint). Prints the dispatch decision, per-tick latency and the real-time factor (compute
seconds / audio seconds; < 1 is faster than real time).

On a CPU the plain-PyTorch reference path runs (the fast kernels need an NVIDIA SM80+ GPU), by
default on a reduced model (C=256, 4 blocks) and 2 requests of up to 2 chunks, which takes seconds
on 2 cores (``--full-size``: the shipped model, minutes). On a GPU (``--device cuda --dtype
float16``) the default is the shipped model and 3 requests of up to 3 chunks.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from . import policy
from .config import DiTConfig
from .models import DiT, load_checkpoint
from .serving import CFMServer
from .solve import StreamingCFM

PROG = "python3 -m torch_cfm.demo"
FRAMES_PER_SECOND = 50
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
TINY = DiTConfig(hidden=64, depth=2, heads=4, head_dim=16)
CPU_SMALL = DiTConfig(hidden=256, depth=4, heads=4, head_dim=64)  # the CPU's default: 1/16 of the shipped cost


class DemoError(Exception):
    """A user-facing problem: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one clear line instead of usage + traceback
        message = re.sub(r"^argument (\S+): (?=\1 )", "", message)  # our messages name the flag already
        raise DemoError(f"{message} (see {PROG} --help)")


def _positive(name: str, maximum: Optional[int] = None, unit: str = ""):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a positive int, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{name} must be a positive int, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{name} must be at most {maximum}{unit}, got {value}")
        return value
    return parse


MAX_STEPS = 1000  # the models ship with 10 Euler steps; the server keeps a cache per step
MAX_PROMPT_FRAMES = 3000  # 60 s of prompt audio; the upstream models take prompts of a few seconds
MAX_CHUNK_FRAMES = 3000
#: default (requests, chunks) per device type: the CPU runs the reference path, so a smaller workload
DEFAULT_WORKLOAD = {"cpu": (2, 2), "cuda": (3, 3)}
GPU_HINT = "python3 -m torch_cfm.demo --device cuda --dtype float16"


def _available_bytes(device: torch.device) -> Optional[int]:
    """Free memory of ``device`` (CUDA: free device memory; CPU: MemAvailable), None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _check_arena_fits(args, cfm: StreamingCFM, server_kw: dict, device: torch.device, dtype: torch.dtype) -> None:
    """A one-line error when the server's cache arena would not fit (sized on the meta device)."""
    need = sum(a.nbytes() for a in CFMServer(cfm, device=torch.device("meta"), dtype=dtype, **server_kw).arenas)
    free = _available_bytes(device)
    if free is not None and need > 0.8 * free:
        raise DemoError(f"the server's cache arena for --steps {args.steps} --requests {args.requests} "
                        f"--chunks {args.chunks} --chunk-frames {args.chunk_frames} --prompt-frames "
                        f"{args.prompt_frames} needs {need / 2**30:.1f} GiB, but {device} has {free / 2**30:.1f} GiB "
                        "free; lower --prompt-frames, --steps, --requests, --chunks or --chunk-frames")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument("--dtype", default="float32", help="float32 (default), float16 or bfloat16")
    p.add_argument("--requests", type=_positive("--requests"), default=None,
                   help="requests to stream (CPU: 2, GPU: 3)")
    p.add_argument("--chunks", type=_positive("--chunks"), default=None,
                   help="chunks of the longest request (CPU: 2, GPU: 3); others get fewer")
    p.add_argument("--steps", type=_positive("--steps", MAX_STEPS), default=10,
                   help=f"Euler steps per chunk (10; at most {MAX_STEPS})")
    p.add_argument("--chunk-frames", type=_positive("--chunk-frames", MAX_CHUNK_FRAMES), default=50,
                   help=f"mel frames per chunk (50 = 1 s; at most {MAX_CHUNK_FRAMES})")
    prompt_frames = _positive("--prompt-frames", MAX_PROMPT_FRAMES, " (60 s of prompt audio)")
    p.add_argument("--prompt-frames", type=prompt_frames, default=40,
                   help=f"prompt frames of the second request (40; at most {MAX_PROMPT_FRAMES}, 60 s); "
                        "others vary around it")
    p.add_argument("--checkpoint", metavar="PATH", default=None,
                   help="estimator state_dict or flow checkpoint (default: seeded random weights)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights, noise and inputs (0)")
    p.add_argument("--tiny", action="store_true", help="tiny model (C=64, 2 blocks) for smoke tests")
    p.add_argument("--full-size", action="store_true",
                   help="the shipped model size (C=512, 16 blocks) on the CPU too (the GPU's default; minutes on a CPU)")
    p.add_argument("--explain", action="store_true", help="also print torch_cfm.explain() for the device")
    return p


@dataclass
class _Plan:
    rid: str
    start_tick: int
    prompt: int
    chunk_lengths: list[int]


def plan_requests(n_requests: int, n_chunks: int, chunk_frames: int, prompt_frames: int) -> list[_Plan]:
    """Staggered requests: request i starts at tick i, has a different prompt and length, and its
    last chunk is ragged (the final chunk of docs/design.md §3 is up to 56 frames for 50-frame chunks)."""
    plans = []
    for i in range(n_requests):
        chunks = max(1, n_chunks - (i % 2))
        lengths = [chunk_frames] * chunks
        lengths[-1] = chunk_frames + 6 if i % 3 == 0 else max(1, chunk_frames - (chunk_frames // 3) * (i % 3))
        prompt = max(1, prompt_frames + 10 * ((i % 3) - 1))
        plans.append(_Plan(f"req{i}", i, prompt, lengths))
    return plans


def _resolve(args) -> tuple[torch.device, torch.dtype]:
    dtype = _DTYPES.get(args.dtype.lower())
    if dtype is None:
        raise DemoError(f"--dtype must be one of float32, float16, bfloat16, got {args.dtype!r}")
    try:
        device = torch.device(args.device)
    except (RuntimeError, ValueError):
        raise DemoError(f"--device must be cpu, cuda or cuda:N, got {args.device!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise DemoError(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DemoError(f"--device {args.device} needs a CUDA GPU, but torch.cuda.is_available() is False "
                            f"(torch {torch.__version__}); leave --device out to run on the CPU")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DemoError(f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA "
                            f"device(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    default_requests, default_chunks = DEFAULT_WORKLOAD[device.type]
    args.workload_default = args.requests is None and args.chunks is None
    args.requests = default_requests if args.requests is None else args.requests
    args.chunks = default_chunks if args.chunks is None else args.chunks
    return device, dtype


def _read_checkpoint(path: str):
    """The object saved at ``path`` (``torch.load``, weights only), or a DemoError saying what the
    file is not: a torch checkpoint holding the model's flow or estimator weights."""
    hint = "pass the model's flow checkpoint (e.g. Step-Audio2's token2wav/flow.pt), or leave --checkpoint out"
    if not os.path.isfile(path):
        raise DemoError(f"--checkpoint {path}: no such file; {hint}")
    try:
        with warnings.catch_warnings():  # torch.load warns on some non-checkpoint files: the error says it
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever torch.load raises, the file is not a checkpoint
        first = str(exc).strip().split("\n")[0].split(". ")[0]
        why = f"{type(exc).__name__}: {first}"[:160] if first else type(exc).__name__
        raise DemoError(f"--checkpoint {path} is not a torch checkpoint (torch.load(weights_only=True) could "
                        f"not read it: {why}); {hint}") from None


def _describe(obj) -> str:
    """What a loaded object is, e.g. "a dict of int -> int (10 entries)"."""
    if isinstance(obj, dict):
        kinds = lambda xs: "/".join(sorted({type(x).__name__ for x in xs})) or "nothing"  # noqa: E731
        count = f"{len(obj)} entr{'y' if len(obj) == 1 else 'ies'}"
        return f"a dict of {kinds(obj.keys())} -> {kinds(obj.values())} ({count})"
    return f"a {type(obj).__name__}"


def _build_model(args, device, dtype) -> DiT:
    if args.checkpoint:
        saved = _read_checkpoint(args.checkpoint)
        try:
            model = load_checkpoint(None, saved)
        except ValueError as exc:
            raise DemoError(f"--checkpoint {args.checkpoint} holds {_describe(saved)}, not a DiT estimator's "
                            f"weights ({exc})") from None
    else:
        model = DiT(_random_config(args, device)).random_init_(args.seed)
    return model.to(device=device, dtype=dtype).eval()


def _random_config(args, device) -> DiTConfig:
    if args.tiny:
        return TINY
    return DiTConfig() if args.full_size or device.type != "cpu" else CPU_SMALL


def run(argv: Optional[Sequence[str]] = None, out=None) -> int:
    out = out or sys.stdout
    args = build_parser().parse_args(argv)
    device, dtype = _resolve(args)

    def say(text: str = "") -> None:
        print(text, file=out, flush=True)

    model = _build_model(args, device, dtype)
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    source = args.checkpoint or f"seeded random weights (seed {args.seed})"
    if not args.checkpoint and not args.tiny and cfg == CPU_SMALL:
        source += "; reduced size for the CPU, --full-size for the shipped C=512, 16 blocks"
    say(f"torch_cfm demo: DiT C={cfg.hidden} depth={cfg.depth} H={cfg.heads} D={cfg.head_dim} "
        f"({n_params / 1e6:.1f} M params, {source}) on {device} {str(dtype).replace('torch.', '')}")
    decision = policy.decide(device, dtype)
    say(f"dispatch: estimator -> {decision.describe()}")
    if not decision.fused:
        say(f"note: {device.type.upper()} runs the plain-PyTorch reference path here: correct, not fast. "
            f"torch_cfm's speed needs an NVIDIA GPU with SM80+ (A100, H100, L40, RTX 30xx/40xx): {GPU_HINT}")
    if args.explain:
        from . import explain

        say(explain(device=device, file=False))

    cfm = StreamingCFM(model, n_timesteps=args.steps, seed=args.seed)
    plans = plan_requests(args.requests, args.chunks, args.chunk_frames, args.prompt_frames)
    max_prompt = max(p.prompt for p in plans)
    max_chunk = max(max(p.chunk_lengths) for p in plans)
    server_kw = dict(max_requests=args.requests, max_prompt_frames=max_prompt, max_chunk_frames=max_chunk)
    _check_arena_fits(args, cfm, server_kw, device, dtype)
    server = CFMServer(cfm, **server_kw)
    label = f" (the {device.type.upper()} default; --requests/--chunks change it)" if args.workload_default else ""
    say(f"workload: {args.requests} requests of up to {args.chunks} chunks of {args.chunk_frames} frames{label}")
    say(f"server: {args.requests} request slots, {args.steps} Euler steps, CFG {cfm.cfg_rate}; "
        f"arena {server.arenas[0].nbytes() / 2**20:.1f} MiB ({server.max_cache_frames} cache frames "
        f"+ {server.arenas[0].append_frames} for in-place appends)")

    gen = torch.Generator().manual_seed(args.seed + 1)
    mel_ch = cfg.out_channels

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    latencies, audio_frames, compute_s = [], 0, 0.0
    done = {p.rid: 0 for p in plans}
    last_tick = max(p.start_tick + len(p.chunk_lengths) for p in plans)
    for tick in range(last_tick + 1):
        for p in plans:
            if p.start_tick == tick:
                sync()
                t0 = time.perf_counter()
                server.open_request(p.rid, rand(mel_ch), prompt_mu=rand(mel_ch, p.prompt),
                                    prompt_mel=rand(mel_ch, p.prompt))
                sync()
                dt = time.perf_counter() - t0
                compute_s += dt
                say(f"  open  {p.rid}: prompt {p.prompt} frames solved in {dt * 1e3:.0f} ms")
        batch = {p.rid: rand(mel_ch, p.chunk_lengths[done[p.rid]]) for p in plans
                 if p.rid in server.open_requests and done[p.rid] < len(p.chunk_lengths)}
        if batch:
            sync()
            t0 = time.perf_counter()
            mels = server.solve_chunk(batch)
            sync()
            dt = time.perf_counter() - t0
            frames = sum(m.shape[1] for m in mels.values())
            ok = all(bool(torch.isfinite(m).all()) for m in mels.values())
            latencies.append(dt)
            compute_s += dt
            audio_frames += frames
            rows = ", ".join(f"{rid}[{m.shape[1]} fr, cache {server.cache_length(rid)}]" for rid, m in mels.items())
            say(f"tick {tick}: {len(mels)} request(s) {rows}: {dt * 1e3:.0f} ms "
                f"(RTF {dt / (frames / FRAMES_PER_SECOND):.2f}{'' if ok else ', NON-FINITE OUTPUT'})")
            for rid in mels:
                done[rid] += 1
        for p in plans:
            if p.rid in server.open_requests and done[p.rid] == len(p.chunk_lengths):
                server.close_request(p.rid)
                say(f"  close {p.rid}: {sum(p.chunk_lengths)} frames streamed")
    audio_s = audio_frames / FRAMES_PER_SECOND
    say(f"done: {len(plans)} requests, {audio_s:.2f} s of audio, chunk latency p50 "
        f"{statistics.median(latencies) * 1e3:.0f} ms / max {max(latencies) * 1e3:.0f} ms, "
        f"real-time factor {compute_s / audio_s:.2f} (incl. prompts; < 1 = faster than real time)")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        return run(argv)
    except DemoError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
