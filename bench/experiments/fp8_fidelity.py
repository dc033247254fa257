"""FP8 (e4m3) fidelity of the DiT estimator's block GEMMs over a whole stream, on CPU.

Question: if the estimator's block GEMMs ran in FP8 e4m3 (per-token activation scales,
per-output-channel weight scales, fp32 accumulation), how large is the whole-stream mel error
against a float64 reference, compared with the fp16 error of (a) torch_cfm's reference path in
fp16 and (b) the real upstream module (``stepaudio2`` ``CausalConditionalCFM`` over its ``DiT``)
in fp16?

Workload: one stream as ``Token2wav.stream`` drives the decoder: a prompt solve (``--prompt``
frames, prompt mel as ``cond``), then ``--chunks`` chunks of ``--chunk`` frames (``cond`` = 0),
each a 10-step Euler solve with CFG (r = 0.7) through torch_cfm's ``StreamingCFM`` (reference
path: ``fused=False`` on CPU) driven by ``tests/solo.py``'s ``Solo`` (whole ``forward_chunk``
then the docs/design.md §3 trim to prompt + 100 frames, so trims happen from chunk 3 on). The upstream
decoder (built by ``tests/upstream_flow.build_flow`` with the same estimator weights, its
``rand_noise`` replaced by the same noise) gets the same mu / spks / cond and the same trims.
Weights: ``DiT(cfg).random_init_(seed + 2)`` (what ``build_flow`` loads into the upstream
estimator); inputs unit-scale seeded Gaussians (mu ~ N(0,1), prompt mel and spks ~ 0.5 N(0,1)).

Runs (each against the float64 torch_cfm run; errors of the concatenated chunk mels, the
prompt solve's mel reported apart): torch_cfm fp32 / fp16; FP8-emulated variants (float32
elsewhere: all block GEMMs, all but proj, fc1+fc2 only; with ``--runs all`` also qkv+proj only
and convs only); upstream fp16 (bf16 instead if fp16 fails on CPU) and fp32 (the fp32 run checks
that both sides solve the same problem: it lands at fp32 rounding of the fp64 reference).
``--runs block`` (also in ``all``): the finer-grained scaling variants (:data:`SCHEMES`) -- block
scaling along K ("DeepSeek-style": activations one scale per (token, 128 K), weights one per
(128 out x 128 K) tile, "blk128x128", or per (out channel, 128 K), "blk1x128") in all block GEMMs,
all but the convs, fc1+fc2 only; and per-token / block-scaled FP8 everywhere but the convs with the
convs in fp16 (operands and result rounded through float16, fp32 accumulation).

FP8 emulation (:func:`fp8_gemms`): for the chosen block GEMMs -- attention ``to_q/to_k/to_v``
("qkv"), ``proj``, the two causal convs ("conv1", "conv2") and ``mlp.fc1`` / ``fc2`` -- the
activation is quantised per token (row absmax / 448 -> scale, ``x / scale`` cast to
``torch.float8_e4m3fn`` and back, times scale) and the weight per output channel the same way;
the dequantised operands are multiplied in float32 and the bias added in float32. The convs run
as the fused body plans them (docs/design.md §4): ONE GEMM over the ``[cache ; chunk]`` frames (2 + T
tokens) against the tap-stacked weight (3·C output channels, one scale per tap and output
channel), then the 3-tap shifted sum in float32. ``in_proj``, ``t_embedder``, the adaLN
modulations, the final layer, norms, softmax/attention and the residual stream stay float32.
Hooks: the Linear modules' ``forward`` (instance attribute, removed on exit) and, for the convs,
the ``F`` that ``torch_cfm.models.dit`` calls ``F.conv1d`` through in ``forward_cached``
(restored on exit); every hooked GEMM is counted, and a harness check runs the hooks with
quantisation off against the plain fp32 forward.

Run (full size, default runs: about 10 min on 2 cores, the fp16 runs 160 s each as CPU fp16
GEMMs are slow; --quick: hidden 64, depth 2, prompt 150, seconds)::

    python bench/experiments/fp8_fidelity.py [--quick] [--prompt 300] [--chunks 8] [--runs default|block|all|KEYS] [--out PATH] [--no-merge]

Block scaling (:func:`quant_blocks`): one scale = tile absmax / 448 per tile of the last two axes;
K is the GEMM's reduction axis (for the convs the C input channels of each tap; weight tiles never
straddle taps). Dequantising both operands with their tile scales and multiplying in float32 is
the same arithmetic as fp32 accumulation per K block with the two scales applied per block.

Prints a markdown table and merges the rows into the JSON at ``--out`` (default
bench/experiments/fp8_fidelity.json; same workload required, same-named rows replaced, the earlier
rows kept, so ``--runs block`` needs no rerun of the slow fp16 runs: their rows are reused and
printed alongside); ``--no-merge`` overwrites.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import os
import platform
import sys
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(1, os.path.join(ROOT, "tests"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import torch_cfm.models.dit_blocks as dit_blocks  # noqa: E402
from torch_cfm import policy  # noqa: E402
from torch_cfm.models import DiT, DiTConfig, trim_attention_cache  # noqa: E402
from torch_cfm.solve import StreamingCFM  # noqa: E402

import upstream_flow as U  # noqa: E402  (tests/)
from oracle import err_max, err_rel_fro  # noqa: E402
from solo import Solo  # noqa: E402

E4M3_MAX = 448.0
N_STEPS = 10
CFG_RATE = 0.7
GROUPS = {  # GEMM group -> block submodule names
    "qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "proj": ("attn.proj",),
    "conv1": ("conv.block.1",),
    "conv2": ("conv.block.6",),
    "fc1": ("mlp.fc1",),
    "fc2": ("mlp.fc2",),
}
ALL = tuple(GROUPS)
NO_CONV = tuple(g for g in ALL if not g.startswith("conv"))
CONVS = ("conv1", "conv2")
SCHEMES = {  # scheme -> (activation (rows, K) block, weight (rows, K) block); None = the whole axis
    "tok": ((1, None), (1, None)),      # per token / per output channel
    "blk128": ((1, 128), (128, 128)),   # DeepSeek-style: (token, 128 K) / (128 out x 128 K) blocks
    "blk1x128": ((1, 128), (1, 128)),   # (token, 128 K) / (out channel, 128 K) blocks
    "fp16": None,                       # operands and result rounded through float16, fp32 accumulation
}


def _with(groups, scheme, **extra):
    return {**{g: scheme for g in groups}, **extra}


FP8_VARIANTS = {  # run name -> {quantised group: scheme}
    "fp8 all block GEMMs": _with(ALL, "tok"),
    "fp8 all but proj": _with(tuple(g for g in ALL if g != "proj"), "tok"),
    "fp8 fc1+fc2 only": _with(("fc1", "fc2"), "tok"),
    "fp8 qkv+proj only": _with(("qkv", "proj"), "tok"),
    "fp8 convs only": _with(CONVS, "tok"),
    "fp8 blk128x128 all block GEMMs": _with(ALL, "blk128"),
    "fp8 blk128x128 all but convs": _with(NO_CONV, "blk128"),
    "fp8 blk128x128 fc1+fc2 only": _with(("fc1", "fc2"), "blk128"),
    "fp8 blk1x128 all block GEMMs": _with(ALL, "blk1x128"),
    "fp8 blk1x128 all but convs": _with(NO_CONV, "blk1x128"),
    "fp8 blk1x128 fc1+fc2 only": _with(("fc1", "fc2"), "blk1x128"),
    "fp8 all but convs, convs fp16": _with(NO_CONV, "tok", **_with(CONVS, "fp16")),
    "fp8 blk128x128 all but convs, convs fp16": _with(NO_CONV, "blk128", **_with(CONVS, "fp16")),
}
RUN_KEYS = {  # --runs key -> run name, in run order
    "fp32": "torch_cfm fp32", "fp16": "torch_cfm fp16",
    "fp8_all": "fp8 all block GEMMs", "fp8_no_proj": "fp8 all but proj", "fp8_mlp": "fp8 fc1+fc2 only",
    "fp8_attn": "fp8 qkv+proj only", "fp8_conv": "fp8 convs only",
    "fp8b_all": "fp8 blk128x128 all block GEMMs", "fp8b_no_conv": "fp8 blk128x128 all but convs",
    "fp8b_mlp": "fp8 blk128x128 fc1+fc2 only",
    "fp8r_all": "fp8 blk1x128 all block GEMMs", "fp8r_no_conv": "fp8 blk1x128 all but convs",
    "fp8r_mlp": "fp8 blk1x128 fc1+fc2 only",
    "fp8_conv16": "fp8 all but convs, convs fp16", "fp8b_conv16": "fp8 blk128x128 all but convs, convs fp16",
    "up16": "upstream fp16", "up_bf16": "upstream bf16", "up32": "upstream fp32",
}
RUN_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "up16": torch.float16, "up_bf16": torch.bfloat16,
              "up32": torch.float32}
BLOCK_RUNS = ("fp8b_all", "fp8b_no_conv", "fp8b_mlp", "fp8r_all", "fp8r_no_conv", "fp8r_mlp", "fp8_conv16",
              "fp8b_conv16")  # --runs block
EXTRA_RUNS = ("fp8_attn", "fp8_conv", "up_bf16") + BLOCK_RUNS  # not in --runs default


# ------------------------------------------------------------------------------- FP8 emulation
def quant_rows(x: torch.Tensor, enabled: bool = True) -> torch.Tensor:
    """Per-row (last axis) e4m3 fake quantisation: scale = absmax / 448, float32 out."""
    return quant_blocks(x, (1, None), enabled)


def quant_blocks(x: torch.Tensor, block, enabled: bool = True) -> torch.Tensor:
    """e4m3 fake quantisation of ``x`` (..., R, K) with one scale (block absmax / 448) per
    ``block = (rows, cols)`` tile of the last two axes (None = the whole axis; ragged edges get
    smaller tiles, as zero padding does not change an absmax); float32 out."""
    x = x.to(torch.float32)
    if not enabled:
        return x
    rb, cb = block
    *lead, n_r, n_k = x.shape
    rb, cb = rb or n_r, cb or n_k
    pr, pk = -n_r % rb, -n_k % cb
    xp = F.pad(x, (0, pk, 0, pr)) if pr or pk else x
    tiles = xp.reshape(*lead, (n_r + pr) // rb, rb, (n_k + pk) // cb, cb)
    amax = tiles.abs().amax(dim=(-3, -1), keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = ((tiles / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale).reshape(xp.shape)
    return q[..., :n_r, :n_k] if pr or pk else q


def quant_operand(x: torch.Tensor, scheme: str, weight: bool, enabled: bool = True) -> torch.Tensor:
    """An activation ((..., tokens, K)) or weight ((out, K)) operand as ``scheme`` stores it, float32 out."""
    if not enabled:
        return x.to(torch.float32)
    if scheme == "fp16":
        return x.to(torch.float16).to(torch.float32)
    return quant_blocks(x, SCHEMES[scheme][1 if weight else 0])


def round_result(y: torch.Tensor, scheme: str, enabled: bool = True) -> torch.Tensor:
    """The GEMM result as ``scheme`` stores it: fp16 rounding for "fp16", else float32 as is."""
    return y.to(torch.float16).to(torch.float32) if enabled and scheme == "fp16" else y


def _linear_forward(mod: torch.nn.Linear, group: str, scheme: str, counts: dict, quantise: bool):
    w_q = quant_operand(mod.weight.detach(), scheme, True, quantise)
    bias = mod.bias.detach().to(torch.float32)

    def forward(x: torch.Tensor) -> torch.Tensor:
        counts[group] += 1
        return round_result(quant_operand(x, scheme, False, quantise) @ w_q.T + bias, scheme, quantise).to(x.dtype)

    return forward


class _ConvAsGemm(types.ModuleType):
    """``torch.nn.functional`` for ``torch_cfm.models.dit`` with ``conv1d`` of the hooked conv
    weights done as one FP8 GEMM over the frames; every other attribute is F's."""

    def __init__(self, targets: dict, counts: dict, quantise: bool) -> None:
        super().__init__("torch.nn.functional")
        self._targets, self._counts, self._quantise = targets, counts, quantise
        self._stacked = {}
        for key, (weight, _, _, scheme) in targets.items():
            # rows (tap, out channel), K = the C input channels; scales per tap (blocks never straddle taps)
            per_tap = weight.detach().permute(2, 0, 1)  # (k, c_out, c_in)
            self._stacked[key] = quant_operand(per_tap, scheme, True, quantise).reshape(-1, per_tap.shape[-1])

    def __getattr__(self, name):
        return getattr(F, name)

    def conv1d(self, ext, weight, bias=None, *args, **kwargs):
        hit = self._targets.get(id(weight))
        if hit is None or hit[0] is not weight or args or kwargs:
            return F.conv1d(ext, weight, bias, *args, **kwargs)
        _, group, _, scheme = hit
        self._counts[group] += 1
        c_out, _, k = weight.shape
        n_rows, _, frames = ext.shape
        tokens = quant_operand(ext.transpose(1, 2), scheme, False, self._quantise)  # (N, 2 + T, C): per frame
        taps = (tokens @ self._stacked[id(weight)].T).view(n_rows, frames, k, c_out)
        t_out = frames - (k - 1)
        out = bias.detach().to(torch.float32).expand(n_rows, t_out, c_out).clone()
        for tap in range(k):
            out = out + taps[:, tap:tap + t_out, tap]
        return round_result(out, scheme, self._quantise).transpose(1, 2).to(ext.dtype)


@contextlib.contextmanager
def fp8_gemms(model: DiT, groups, counts: dict, quantise: bool = True):
    """Run ``model``'s reference path with the ``groups`` block GEMMs FP8-emulated (see module doc).
    ``groups``: {group: scheme} (a plain sequence of groups means scheme "tok" for each)."""
    if not isinstance(groups, dict):
        groups = {g: "tok" for g in groups}
    linears, convs = [], {}
    for blk in model.blocks:
        for group, scheme in groups.items():
            for name in GROUPS[group]:
                mod = blk.get_submodule(name)
                if isinstance(mod, torch.nn.Conv1d):
                    convs[id(mod.weight)] = (mod.weight, group, name, scheme)
                else:
                    linears.append((mod, group, scheme))
    for group in groups:
        counts.setdefault(group, 0)
    saved_f = dit_blocks.F
    try:
        for mod, group, scheme in linears:
            mod.forward = _linear_forward(mod, group, scheme, counts, quantise)
        if convs:
            dit_blocks.F = _ConvAsGemm(convs, counts, quantise)
        yield
    finally:
        dit_blocks.F = saved_f
        for mod, _, _ in linears:
            mod.__dict__.pop("forward", None)


# ------------------------------------------------------------------------------- the stream
@dataclasses.dataclass
class Workload:
    prompt_mu: torch.Tensor    # (80, P)
    prompt_mel: torch.Tensor   # (80, P), the cond of the prompt solve
    spks: torch.Tensor         # (80,)
    chunks: list               # [(80, T)] mu of each chunk (cond = 0)
    noise: torch.Tensor        # (1, 80, 30000)

    @property
    def prompt_frames(self) -> int:
        return self.prompt_mu.shape[1]


def make_workload(prompt: int, chunks: int, chunk: int, seed: int) -> Workload:
    g = torch.Generator().manual_seed(seed)
    return Workload(prompt_mu=torch.randn(80, prompt, generator=g),
                    prompt_mel=0.5 * torch.randn(80, prompt, generator=g),
                    spks=0.5 * torch.randn(80, generator=g),
                    chunks=[torch.randn(80, chunk, generator=g) for _ in range(chunks)],
                    noise=torch.randn(1, 80, 30000, generator=g))


def run_torch_cfm(master: DiT, dtype: torch.dtype, w: Workload, groups=None, counts=None):
    """(prompt mel, [chunk mels], cache lengths after each chunk) through StreamingCFM + Solo."""
    model = copy.deepcopy(master).to(dtype)
    assert not policy.decide(torch.device("cpu"), dtype).fused  # CPU: the reference path
    solo = Solo(StreamingCFM(model, n_timesteps=N_STEPS, cfg_rate=CFG_RATE, noise=w.noise), w.spks.to(dtype),
                w.prompt_frames)
    scope = fp8_gemms(model, groups, counts) if groups else contextlib.nullcontext()
    with scope:
        prompt_mel = solo.chunk(w.prompt_mu.to(dtype), w.prompt_mel.to(dtype))
        mels, lengths = [], []
        for mu in w.chunks:
            mels.append(solo.chunk(mu.to(dtype)))
            lengths.append(solo.att.shape[-2])
    return prompt_mel, mels, lengths


def build_upstream_decoder(cfg: DiTConfig, seed: int, w: Workload, max_frames: int):
    """The upstream CausalConditionalCFM (real classes via tests/upstream_flow.py), estimator =
    DiT(cfg).random_init_(seed + 2), rand_noise = the workload's noise. The encoder is built tiny
    (it is never called)."""
    size = dataclasses.replace(U.TINY, hidden=cfg.hidden, depth=cfg.depth, heads=cfg.heads, head_dim=cfg.head_dim,
                               buffer_frames=8)
    flow = U.build_flow(size, seed=seed)
    dec = flow.decoder
    dec.rand_noise = w.noise.clone()
    U.resize_scratch_buffers(flow, frames=max_frames, steps=N_STEPS)
    return dec, size


def run_upstream(dec32, dtype: torch.dtype, w: Workload, max_frames: int):
    dec = copy.deepcopy(dec32).to(dtype)
    U.resize_scratch_buffers(types.SimpleNamespace(decoder=dec), frames=max_frames, steps=N_STEPS)
    spks = w.spks.to(dtype)[None]
    cnn = att = None

    def solve(mu, cond):
        nonlocal cnn, att
        mel, cnn_new, att_new = dec.forward_chunk(mu.to(dtype)[None], spks, cond.to(dtype)[None],
                                                  n_timesteps=N_STEPS, cnn_cache=cnn, att_cache=att)
        cnn = cnn_new.clone()  # views of the decoder's scratch buffers
        att = trim_attention_cache(att_new.clone(), w.prompt_frames)
        return mel[0].clone()

    prompt_mel = solve(w.prompt_mu, w.prompt_mel)
    mels, lengths = [], []
    for mu in w.chunks:
        mels.append(solve(mu, torch.zeros_like(mu)))
        lengths.append(att.shape[-2])
    return prompt_mel, mels, lengths


def harness_check(master: DiT, w: Workload) -> dict:
    """The hooks with quantisation off vs the plain fp32 forward (one chunk forward, all groups):
    shows the emulation harness itself adds only fp32 rounding."""
    model = copy.deepcopy(master).float()
    g = torch.Generator().manual_seed(99)
    t_len, cache = w.chunks[0].shape[1], 20
    cfg = model.config
    x = torch.randn(2, 80, t_len, generator=g)
    args = (x, torch.randn(2, 80, t_len, generator=g), torch.tensor([0.3, 0.3]), torch.randn(2, 80, generator=g),
            torch.randn(2, 80, t_len, generator=g),
            torch.randn(cfg.depth, 2, 2 * cfg.hidden, 2, generator=g),
            torch.randn(cfg.depth, 2, cfg.heads, cache, 2 * cfg.head_dim, generator=g))
    with torch.no_grad():
        ref = model.forward_chunk(*args, fused=False)
        counts = {}
        with fp8_gemms(model, ALL, counts, quantise=False):
            hooked = model.forward_chunk(*args, fused=False)
        ref64 = copy.deepcopy(master).double().forward_chunk(*[a.double() for a in args], fused=False)
        one_forward = {}
        for scheme in SCHEMES:  # every block GEMM in that scheme
            with fp8_gemms(model, {g: scheme for g in ALL}, {}, quantise=True):
                one_forward[scheme] = err_rel_fro(model.forward_chunk(*args, fused=False)[0], ref64[0])
    return {"hooks_off_vs_plain_fp32_rel": err_rel_fro(hooked[0], ref[0]),
            "hooks_off_new_cnn_rel": err_rel_fro(hooked[1], ref[1]),
            "hooks_off_new_att_rel": err_rel_fro(hooked[2], ref[2]),
            "plain_fp32_vs_fp64_rel": err_rel_fro(ref[0], ref64[0]),
            "fp8_one_forward_vs_fp64_rel": one_forward["tok"],
            "one_forward_vs_fp64_rel_by_scheme": one_forward,
            "calls_per_forward": counts}


def errors(result, ref) -> dict:
    (p, mels, lengths), (p64, mels64, _) = result, ref
    stream, stream64 = torch.cat(mels, dim=-1), torch.cat(mels64, dim=-1)
    return {"stream_rel_l2": err_rel_fro(stream, stream64), "stream_max_abs": err_max(stream, stream64),
            "worst_chunk_rel_l2": max(err_rel_fro(a, b) for a, b in zip(mels, mels64)),
            "prompt_rel_l2": err_rel_fro(p, p64), "prompt_max_abs": err_max(p, p64),
            "cache_lengths": lengths, "finite": bool(torch.isfinite(stream).all())}


def workload_args(ap: argparse.ArgumentParser) -> None:
    """The stream workload's options (shared with residual16_fidelity.py)."""
    ap.add_argument("--quick", action="store_true", help="tiny config (hidden 64, depth 2, 4 heads of 16)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt frames (default 300; --quick 150)")
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    workload_args(ap)
    ap.add_argument("--runs", default="default",
                    help="'default' (every run but the extra FP8 attributions and the block-scaled / fp16-conv "
                         "variants), 'block' (only those: " + ", ".join(BLOCK_RUNS) + "), 'all', or a comma "
                         "list of run keys: " + ", ".join(RUN_KEYS) + " (the fp64 reference always runs)")
    ap.add_argument("--out", default=os.path.join(HERE, "fp8_fidelity.json"))
    ap.add_argument("--no-merge", action="store_true",
                    help="overwrite --out instead of merging this invocation's rows into it")
    args = ap.parse_args()

    cfg = DiTConfig(hidden=64, depth=2, heads=4, head_dim=16) if args.quick else DiTConfig()
    prompt = args.prompt if args.prompt is not None else (150 if args.quick else 300)
    w = make_workload(prompt, args.chunks, args.chunk, args.seed)
    max_frames = prompt + 100 + args.chunk
    if args.runs == "all":
        keys = list(RUN_KEYS)
    elif args.runs == "block":
        keys = list(BLOCK_RUNS)
    elif args.runs == "default":
        keys = [k for k in RUN_KEYS if k not in EXTRA_RUNS]
    else:
        keys = [k.strip() for k in args.runs.split(",") if k.strip()]
        unknown = [k for k in keys if k not in RUN_KEYS]
        if unknown:
            ap.error(f"unknown run keys {unknown}; known: {', '.join(RUN_KEYS)}")
    setup = {"config": dataclasses.asdict(cfg), "prompt_frames": prompt, "chunks": args.chunks,
             "chunk_frames": args.chunk, "n_timesteps": N_STEPS, "cfg_rate": CFG_RATE, "seed": args.seed}
    previous = None
    if not args.no_merge and os.path.exists(args.out):
        with open(args.out) as fh:
            previous = json.load(fh)
        if any(previous.get(k) != v for k, v in setup.items()):
            ap.error(f"{args.out} holds a different workload/config; pass another --out or --no-merge")

    t_start = time.perf_counter()
    dec32, size = build_upstream_decoder(cfg, args.seed, w, max_frames)
    master = DiT(size.dit_config).random_init_(args.seed + 2)  # the upstream estimator's weights
    assert size.dit_config == cfg
    up_sd = dec32.estimator.state_dict()
    assert all(torch.equal(v, up_sd[k]) for k, v in master.state_dict().items())

    check = harness_check(master, w)
    results, timings, notes, counts = {}, {}, {}, {}

    def timed(name, fn):
        t0 = time.perf_counter()
        try:
            results[name] = fn()
        except (RuntimeError, NotImplementedError) as exc:  # e.g. an op without a CPU kernel in that dtype
            notes[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            print(f"[{name}] failed: {notes[name]}", flush=True)
        timings[name] = time.perf_counter() - t0
        print(f"[{name}] {timings[name]:.1f} s", flush=True)

    timed("torch_cfm fp64 (reference)", lambda: run_torch_cfm(master, torch.float64, w))
    for key in keys:
        name = RUN_KEYS[key]
        if name in FP8_VARIANTS:
            counts[name] = {}
            timed(name, lambda g=FP8_VARIANTS[name], c=counts[name]: run_torch_cfm(master, torch.float32, w, g, c))
        elif name.startswith("torch_cfm"):
            timed(name, lambda d=RUN_DTYPES[key]: run_torch_cfm(master, d, w))
        else:
            timed(name, lambda d=RUN_DTYPES[key]: run_upstream(dec32, d, w, max_frames))
            if key == "up16" and name in notes and "up_bf16" not in keys:  # no CPU fp16 kernel: bf16 instead
                timed(RUN_KEYS["up_bf16"], lambda: run_upstream(dec32, torch.bfloat16, w, max_frames))

    ref = results["torch_cfm fp64 (reference)"]
    new_rows = {name: errors(res, ref) for name, res in results.items()}
    for name, row in new_rows.items():
        row["quantised_gemm_calls"] = counts.get(name)
        row["seconds"] = timings[name]
    old_rows = previous["rows"] if previous else {}
    if previous:  # same workload, deterministic fp64 reference: the earlier rows stay comparable
        r_old = old_rows.get("torch_cfm fp64 (reference)", {}).get("cache_lengths")
        assert r_old in (None, new_rows["torch_cfm fp64 (reference)"]["cache_lengths"])
    rows = {**old_rows, **new_rows}  # this invocation's rows replace same-named earlier ones
    fp16_ref = rows.get("torch_cfm fp16", {}).get("stream_rel_l2")
    up16 = rows.get("upstream fp16", {}).get("stream_rel_l2")
    for name, row in rows.items():
        row["x_torch_cfm_fp16"] = row["stream_rel_l2"] / fp16_ref if fp16_ref else None
        row["x_upstream_fp16"] = row["stream_rel_l2"] / up16 if up16 else None
        row["from_earlier_invocation"] = name not in new_rows
    total = time.perf_counter() - t_start

    lengths = rows["torch_cfm fp64 (reference)"]["cache_lengths"]
    print(f"\nDiT C={cfg.hidden} depth={cfg.depth} H={cfg.heads} D={cfg.head_dim}; prompt {prompt} frames, "
          f"{args.chunks} chunks x {args.chunk} frames, {N_STEPS} Euler steps, CFG {CFG_RATE}; "
          f"attention cache frames after each chunk {lengths}\n")
    print("| run | stream rel L2 | stream max abs | worst chunk rel | prompt rel L2 | x torch_cfm fp16 | "
          "x upstream fp16 | s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        if name.startswith("torch_cfm fp64") or (name not in new_rows and name not in ("torch_cfm fp16",
                                                                                      "upstream fp16")):
            continue
        if name not in new_rows:
            name = f"{name} (earlier run, from {os.path.basename(args.out)})"
        ratio = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
        print(f"| {name} | {r['stream_rel_l2']:.3e} | {r['stream_max_abs']:.3e} | {r['worst_chunk_rel_l2']:.3e} | "
              f"{r['prompt_rel_l2']:.3e} | {ratio(r['x_torch_cfm_fp16'])} | {ratio(r['x_upstream_fp16'])} | "
              f"{r['seconds']:.0f} |")
    for name, note in notes.items():
        print(f"\n{name}: {note}")
    print(f"\nharness check: {json.dumps(check)}")
    print(f"total {total:.0f} s")

    invocation = {"runs": [RUN_KEYS[k] for k in keys], "harness_check": check,
                  "reference_seconds": timings.get("torch_cfm fp64 (reference)"), "total_seconds": total,
                  "torch": torch.__version__, "threads": torch.get_num_threads(),
                  "machine": platform.processor() or platform.machine()}
    variants = {k: v for k, v in FP8_VARIANTS.items() if k in rows}
    out = {**setup, "fp8_schemes": {k: {"activation_block": v[0], "weight_block": v[1]} if v else
                                    "operands and result rounded through float16, fp32 accumulation"
                                    for k, v in SCHEMES.items()},
           "fp8_variants": variants, "rows": rows, "failed": {**(previous or {}).get("failed", {}), **notes}}
    if previous:  # earlier invocations: the first one's fields were kept at top level
        earlier = previous.get("invocations") or [{
            "runs": [n for n in previous["rows"] if not n.startswith("torch_cfm fp64")],
            **{k: previous.get(k) for k in ("harness_check", "reference_seconds", "total_seconds", "torch",
                                            "threads", "machine")}}]
        out["invocations"] = earlier + [invocation]
    else:
        out["invocations"] = [invocation]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
