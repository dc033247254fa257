"""torch_cfm.serving.Token2wavServer (many token2wav streams per tick) against the upstream.

Every stream's mel, waveform and caches are compared with that stream decoded alone by the real
upstream modules (``tests/token2wav_reference.py``: ``flow.setup_cache`` / ``inference_chunk`` with
``Token2wav.stream``'s trims, and its HiFT vocoder stage), fp32 on CPU at tiny sizes, docs/design.md §6:
within 1e-5 relative (Frobenius). The upstream flow modules load without the package's TTS stack
(see ``tests/upstream_flow.py``); the waveforms are compared when scipy is installed (the upstream
``hifigan`` imports it; without it the same tests check mel and caches only). Cases: whole streams
with ragged prompt lengths (encoder batched by shape, ragged, padded and per stream), streams arriving and leaving at random
ticks with slot reuse, NaN/Inf isolation, admission and memory.
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

import token2wav_reference as R
import upstream_flow as U
from oracle import err_rel_fro

pytestmark = [pytest.mark.skipif(U.missing_reason() is not None, reason=str(U.missing_reason())),
              pytest.mark.usefixtures("one_thread")]

from torch_cfm.serving import AdmissionError, StreamPrompt, Token2wavServer  # noqa: E402

REL = 1e-5
N_STEPS = 4
needs_hift = pytest.mark.skipif(R.hift_missing_reason() is not None, reason=str(R.hift_missing_reason()))


@pytest.fixture(scope="module")
def flow():
    return U.build_flow(U.TINY, seed=0)


@pytest.fixture(scope="module")
def hift():
    """The upstream HiFT, or None without scipy (then the tests check mel and caches only)."""
    return None if R.hift_missing_reason() is not None else R.build_hift(seed=3)


def _live_tensors() -> int:
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on torch.distributed's deprecated aliases warns
        warnings.simplefilter("ignore")
        return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())


def _close(a, b, what):
    assert a.shape == b.shape, f"{what}: {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    err = err_rel_fro(a, b)
    assert err <= REL, f"{what}: rel err {err:.2e} > {REL}"


def _check_stream(label, got_mels, got_wavs, ref):
    mels, wavs, _ = ref
    assert len(got_mels) == len(mels), f"{label}: {len(got_mels)} chunks, upstream {len(mels)}"
    for i, (a, b) in enumerate(zip(got_mels, mels)):
        _close(a, b, f"{label} chunk {i} mel")
    if wavs is not None:
        assert len(got_wavs) == len(wavs)
        for i, (a, b) in enumerate(zip(got_wavs, wavs)):
            _close(a, b, f"{label} chunk {i} wav")


def _check_caches(server, sid, ref_cache, label):
    got = server.stream_caches(sid)
    for key in ("conformer_cnn_cache", "conformer_att_cache", "estimator_cnn_cache", "estimator_att_cache"):
        ref = ref_cache[key]
        if key.startswith("estimator"):
            ref = ref[:N_STEPS]  # the upstream's 16-step scratch buffer, n used
        _close(got[key], ref, f"{label} {key}")


@pytest.mark.parametrize("encoder_batching,batch_buckets",
                         [(True, None), (False, None), (True, (4,)), ("ragged", None), ("ragged", (4,))],
                         ids=["batched", "per_stream", "padded", "ragged", "ragged_padded"])
def test_whole_streams_match_each_stream_alone(flow, hift, encoder_batching, batch_buckets):
    """Three streams (prompts of 20, 20 and 13 tokens: two batch in the encoder, one ragged)
    through setup and 6 chunks each (trims included, ragged last chunks): mel, waveform and every
    cache equal the stream decoded alone upstream; also with encoder and vocoder batches padded
    to 4 rows (the CUDA-graph shapes; stage_graphs runs eagerly on CPU), and with the encoder
    batched across cache lengths ("ragged": left-padded, masked; padded to 50-frame buckets)."""
    server = Token2wavServer(flow, hift, vocoder="upstream", max_streams=4, max_prompt_frames=80, n_timesteps=N_STEPS,
                             encoder_batching=encoder_batching, batch_buckets=batch_buckets,
                             stage_graphs=batch_buckets is not None)
    ragged_batches = []
    inner = server.encoder.ragged_call  # count the ragged batches

    def counted(tokens, *args):
        ragged_batches.append(tokens.shape[0])
        return inner(tokens, *args)

    server.encoder.ragged_call = counted
    prompts = [U.make_prompt(U.TINY, p, seed=10 + i) for i, p in enumerate((20, 20, 13))]
    chunks = [U.make_chunks(U.TINY, 6, seed=20 + i, last_tokens=(7, 7, 11)[i]) for i in range(3)]
    server.open_many({i: StreamPrompt(p.tokens, p.mel, p.spk, seed=100 + i) for i, p in enumerate(prompts)})
    mels, wavs = {i: [] for i in range(3)}, {i: [] for i in range(3)}
    for k in range(6):
        out = server.step({i: (chunks[i][k], k == 5) for i in range(3)})
        assert list(out) == [0, 1, 2] and all(o.last == (k == 5) for o in out.values())
        for i, o in out.items():
            mels[i].append(o.mel)
            wavs[i].append(o.wav)
    if encoder_batching == "ragged":  # chunks 0-4 of all three streams (the last chunks differ in length)
        assert ragged_batches == [batch_buckets[0] if batch_buckets else 3] * 5, ragged_batches
    else:
        assert not ragged_batches
    for i in range(3):
        ref = R.upstream_stream(flow, prompts[i], chunks[i], N_STEPS, hift=hift, seed=100 + i)
        _check_stream(f"stream {i}", mels[i], wavs[i], ref)
        _check_caches(server, i, ref[2], f"stream {i}")


def test_prompt_mel_matches_setup_cache(flow):
    server = Token2wavServer(flow, None, max_streams=2, max_prompt_frames=80, n_timesteps=N_STEPS)
    prompt = U.make_prompt(U.TINY, 17, seed=5)
    mel = server.open_stream("a", prompt.tokens, prompt.mel, prompt.spk)
    # The upstream setup_cache returns no mel: its decoder's prompt solve is compared through the caches.
    cache = flow.setup_cache(prompt.tokens, prompt.mel, prompt.spk, n_timesteps=N_STEPS)
    _check_caches(server, "a", cache, "setup")
    ref, _, _ = flow.decoder.forward_chunk(
        flow.encoder_proj(flow.encoder.forward_chunk(flow.input_embedding(prompt.tokens))[0]).transpose(1, 2),
        flow.spk_embed_affine_layer(torch.nn.functional.normalize(prompt.spk, dim=1)),
        prompt.mel.transpose(1, 2), n_timesteps=N_STEPS)
    _close(mel, ref[0], "prompt mel")


def test_mixed_arrivals_departures_and_slot_reuse(flow, hift):
    """Streams open at different ticks (alone and several at once), push on some ticks only, one
    leaves before its last chunk, its slot goes to a new stream, one is mel-only: each stream's
    output equals the stream decoded alone."""
    server = Token2wavServer(flow, hift, vocoder="upstream", max_streams=3, max_prompt_frames=80, n_timesteps=N_STEPS)
    plan = {  # id: (prompt tokens, chunk count, opened at tick, pushes on ticks where (tick % m) == 0, waveform)
        "a": (12, 4, 0, 1, True), "b": (16, 3, 1, 2, False), "c": (16, 5, 1, 1, True),
        "d": (9, 3, 4, 1, True)}
    prompts = {s: U.make_prompt(U.TINY, p[0], seed=hash(s) % 1000) for s, p in plan.items()}
    chunks = {s: U.make_chunks(U.TINY, p[1], seed=hash(s) % 1000 + 1, last_tokens=9) for s, p in plan.items()}
    leaves_early = {"a": 2}  # "a" leaves after 2 chunks (no last chunk)
    got = {s: ([], []) for s in plan}
    tick = 0
    while tick < 40 and (not got["d"][0] or len(got["d"][0]) < plan["d"][1]):
        opening = {s: StreamPrompt(prompts[s].tokens, prompts[s].mel, prompts[s].spk, seed=7, waveform=p[4])
                   for s, p in plan.items() if p[2] == tick and s not in server.open_streams}
        if opening:
            server.open_many(opening)
        batch = {}
        for s in server.open_streams:
            count = leaves_early.get(s, plan[s][1])
            n = len(got[s][0])
            if n < count and tick % plan[s][3] == 0:
                batch[s] = (chunks[s][n], s not in leaves_early and n == count - 1)
        for s, o in server.step(batch).items():
            got[s][0].append(o.mel)
            got[s][1].append(o.wav)
        for s in server.open_streams:
            if len(got[s][0]) == leaves_early.get(s, plan[s][1]):
                server.close_stream(s)
        tick += 1
    for s, p in plan.items():
        count = leaves_early.get(s, p[1])
        ref = R.upstream_stream(flow, prompts[s], chunks[s][:count], N_STEPS, hift=hift if p[4] else None, seed=7,
                                last=s not in leaves_early)
        _check_stream(s, got[s][0], got[s][1] if p[4] else None, ref)
        if not p[4]:
            assert all(w is None for w in got[s][1])


@pytest.mark.parametrize("k", [1, 3])
def test_paced_prompts_streams_match_each_stream_alone(flow, hift, k):
    """prompt_steps_per_tick=k: streams opened on different ticks (their prompt solves spread over
    ceil(n/k) ticks, cohorts at different steps next to chunk ticks of ready streams), one closed
    while its prompt is under way: every finished stream equals the stream decoded alone."""
    server = Token2wavServer(flow, hift, vocoder="upstream", max_streams=5, max_prompt_frames=80, n_timesteps=N_STEPS,
                             prompt_steps_per_tick=k)
    plan = {"a": (12, 3, 0), "b": (16, 3, 0), "c": (20, 2, 1), "d": (9, 3, 2), "e": (14, 2, 2)}
    prompts = {s: U.make_prompt(U.TINY, p[0], seed=50 + i) for i, (s, p) in enumerate(plan.items())}
    chunks = {s: U.make_chunks(U.TINY, p[1], seed=60 + i, last_tokens=9) for i, (s, p) in enumerate(plan.items())}
    got = {s: ([], []) for s in plan}
    for tick in range(20):
        opening = {s: StreamPrompt(prompts[s].tokens, prompts[s].mel, prompts[s].spk, seed=3)
                   for s, p in plan.items() if p[2] == tick}
        if opening:
            assert server.open_many(opening) == {}
            assert not any(server.ready(s) for s in opening)
            with pytest.raises(ValueError, match="ready"):
                server.step({next(iter(opening)): chunks[next(iter(opening))][0]})
        if tick == 2:
            server.close_stream("e")  # before its prompt solve ends
        batch = {s: (chunks[s][len(got[s][0])], len(got[s][0]) == plan[s][1] - 1)
                 for s in server.open_streams if server.ready(s)}
        for s, o in server.step(batch).items():
            got[s][0].append(o.mel)
            got[s][1].append(o.wav)
        for s in server.open_streams:
            if len(got[s][0]) == plan[s][1]:
                server.close_stream(s)
    assert server.open_streams == [] and server.cfm_server.pending_prompts == []
    for s, p in plan.items():
        if s == "e":
            assert not got[s][0]
            continue
        ref = R.upstream_stream(flow, prompts[s], chunks[s], N_STEPS, hift=hift, seed=3)
        _check_stream(s, got[s][0], got[s][1], ref)


def test_paced_warmup_covers_the_cohorts(flow):
    """With prompt_steps_per_tick, warmup covers the prompt cohorts' step spans and the chunks:
    arrivals in bursts next to settled streams create no new CFM solve key (on CUDA: no capture)."""
    server = Token2wavServer(flow, None, max_streams=4, max_prompt_frames=80, n_timesteps=N_STEPS, graphs=True,
                             prompt_steps_per_tick=2)
    server.warmup(prompt_frames=(80,), chunk_tokens=(28,), ticks=3, rounds=1)
    solver = server.cfm_server.graph_cache
    misses = solver.misses
    prompts = [U.make_prompt(U.TINY, 40, seed=70 + i) for i in range(6)]
    chunk = U.make_chunks(U.TINY, 2, seed=80)[0]  # 25 + 3 tokens (a 1-chunk list holds a short last chunk)
    opened = 0
    for tick, arrivals in enumerate((1, 0, 3, 0, 0, 1, 1, 0, 0, 0)):
        if tick == 5:
            server.close_stream(0)
        for _ in range(min(arrivals, 4 - len(server.open_streams))):
            p = prompts[opened]
            server.open_stream(opened, p.tokens, p.mel, p.spk)
            opened += 1
        server.step({s: chunk for s in server.open_streams if server.ready(s)})
    assert opened == 5
    assert solver.misses == misses, [e.label for e in solver.entries()][-3:]


@pytest.mark.parametrize("poison", ["prompt_mel", "spk"])
def test_nan_stream_corrupts_no_other(flow, hift, poison):
    """A stream whose prompt mel (or speaker embedding) holds NaN and Inf is decoded in the same
    ticks as two clean ones, then closed and its slot reused: every clean stream (the later one
    in the poisoned slot too) equals its stream decoded alone; check_finite=True rejects it."""
    server = Token2wavServer(flow, hift, vocoder="upstream", max_streams=3, max_prompt_frames=80, n_timesteps=N_STEPS)
    prompts = [U.make_prompt(U.TINY, 20, seed=40 + i) for i in range(4)]
    chunks = [U.make_chunks(U.TINY, 4, seed=50 + i) for i in range(4)]
    bad = U.make_prompt(U.TINY, 20, seed=40)
    if poison == "prompt_mel":
        bad.mel[0, 3, 5] = float("nan")
        bad.mel[0, 7, 1] = float("inf")
    else:
        bad.spk[0, 2] = float("nan")
    order = [("x", bad), (1, prompts[1]), (2, prompts[2])]
    server.open_many({s: StreamPrompt(p.tokens, p.mel, p.spk, seed=9) for s, p in order})
    got = {s: ([], []) for s in ("x", 1, 2, 3)}
    for k in range(4):
        if k == 2:  # the poisoned stream leaves; a new stream takes its slot
            server.close_stream("x")
            server.open_stream(3, prompts[3].tokens, prompts[3].mel, prompts[3].spk, seed=9)
        for s, o in server.step({s: (chunks[s if s != "x" else 0][k if s != 3 else k - 2], False)
                                 for s in server.open_streams}).items():
            got[s][0].append(o.mel)
            got[s][1].append(o.wav)
    assert not torch.isfinite(got["x"][0][0]).all(), "the poisoned stream was expected to go non-finite"
    for s in (1, 2):
        ref = R.upstream_stream(flow, prompts[s], chunks[s], N_STEPS, hift=hift, seed=9, last=False)
        _check_stream(f"clean stream {s}", *got[s], ref)
    ref = R.upstream_stream(flow, prompts[3], chunks[3][:2], N_STEPS, hift=hift, seed=9, last=False)
    _check_stream("stream in the reused slot", *got[3], ref)
    strict = Token2wavServer(flow, None, max_streams=1, max_prompt_frames=80, n_timesteps=N_STEPS,
                             check_finite=True)
    with pytest.raises(ValueError, match=poison):
        strict.open_stream("x", bad.tokens, bad.mel, bad.spk)
    assert strict.open_streams == []


def test_admission_and_memory(flow):
    """max_streams and max_memory_bytes: AdmissionError naming the limit; closing frees the
    stream's state (bytes back to the empty server's, no tensor left behind by a round); the plan
    bounds them."""
    server = Token2wavServer(flow, None, max_streams=2, max_prompt_frames=80, n_timesteps=N_STEPS)
    empty = server.state_bytes()
    plan = server.memory_plan()
    assert plan.cfm > 0 and plan.encoder > 0 and plan.vocoder == 0 and plan.total == plan.cfm + plan.encoder
    prompt = U.make_prompt(U.TINY, 20, seed=1)
    chunk = U.make_chunks(U.TINY, 1, seed=2, last_tokens=28)[0]
    for round_ in range(3):
        server.open_stream("a", prompt.tokens, prompt.mel, prompt.spk)
        server.open_stream("b", prompt.tokens, prompt.mel, prompt.spk)
        with pytest.raises(AdmissionError, match="max_streams=2"):
            server.open_stream("c", prompt.tokens, prompt.mel, prompt.spk)
        with pytest.raises(AdmissionError, match="max_streams=2"):
            server.open_many({"c": (prompt.tokens, prompt.mel, prompt.spk)})
        for _ in range(4):
            server.step({"a": chunk, "b": chunk})
        assert server.state_bytes() == empty  # the conformer slots are held from the start, like the CFM arenas
        assert 0 < server.encoder.slots.nbytes() <= (server.max_streams + 1) * plan.encoder, plan  # + the padding slot
        (ca, a), (cb, b) = (server.encoder.caches(s) for s in "ab")  # batched, yet each in its own slot
        for x, y in ((a, b), (ca, cb)):
            assert x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr() and x.data_ptr() != y.data_ptr()
        del a, b, ca, cb, x, y
        server.close_stream("a")
        server.close_stream("b")
        assert server.state_bytes() == empty
        if round_ == 0:  # after the stages' first calls made their scratch
            tensors_before = _live_tensors()
    assert _live_tensors() == tensors_before
    budget = Token2wavServer(flow, None, max_streams=4, max_prompt_frames=80, n_timesteps=N_STEPS,
                             max_memory_bytes=plan.total * 2 + 1)
    budget.open_stream("a", prompt.tokens, prompt.mel, prompt.spk)
    budget.open_stream("b", prompt.tokens, prompt.mel, prompt.spk)
    with pytest.raises(AdmissionError, match="max_memory_bytes"):
        budget.open_stream("c", prompt.tokens, prompt.mel, prompt.spk)
    budget.close_stream("a")
    budget.open_stream("c", prompt.tokens, prompt.mel, prompt.spk)


def test_errors(flow):
    with pytest.raises(TypeError, match="CausalMaskedDiffWithXvec"):
        Token2wavServer(torch.nn.Linear(2, 2))
    server = Token2wavServer(flow, None, max_streams=2, max_prompt_frames=40, n_timesteps=N_STEPS)
    prompt = U.make_prompt(U.TINY, 10, seed=1)
    with pytest.raises(ValueError, match="prompt_mel"):
        server.open_stream("a", prompt.tokens, prompt.mel[:, :-2], prompt.spk)
    long = U.make_prompt(U.TINY, 30, seed=1)
    with pytest.raises(ValueError, match="max_prompt_frames"):
        server.open_stream("a", long.tokens, long.mel, long.spk)
    server.open_stream("a", prompt.tokens, prompt.mel, prompt.spk)
    with pytest.raises(ValueError, match="not be open"):
        server.open_stream("a", prompt.tokens, prompt.mel, prompt.spk)
    with pytest.raises(ValueError, match="open streams"):
        server.step({"zz": prompt.tokens})
    with pytest.raises(ValueError, match="tokens"):
        server.step({"a": torch.zeros(1, 4, dtype=torch.int32)})  # 1 token + lookahead: too short
    with pytest.raises(ValueError, match="tokens"):
        server.step({"a": (torch.zeros(1, 1, dtype=torch.int32), True)})
    server.step({"a": (torch.zeros(1, 5, dtype=torch.int32), True)})
    with pytest.raises(ValueError, match="last chunk"):
        server.step({"a": torch.zeros(1, 5, dtype=torch.int32)})
    server.close_stream("a")
    with pytest.raises(ValueError, match="open stream"):
        server.close_stream("a")


def test_a_tick_launches_the_same_few_ops_whatever_its_streams_or_their_token_dtypes(flow, hift):
    """Outside its graphs (the encoder's slot call, the CFM's whole solve and the vocoder's call, one
    replay each) a tick runs a fixed handful of ATen ops per stage (tests/launch_census.py): the
    same at 2 and 6 streams, with token chunks in int64, int32 and int16 mixed in one tick
    (converted once per group; the vocoder's stream state gathered and written inside its call).
    The mels equal those of the same streams fed int64 only."""
    from launch_census import OpCensus, instrument

    def tick(streams, dtypes):
        server = Token2wavServer(flow, hift, max_streams=streams, max_prompt_frames=40, n_timesteps=N_STEPS)
        census = OpCensus()
        instrument(server, census)
        prompts = {s: U.make_prompt(U.TINY, 10, seed=s) for s in range(streams)}
        server.open_many({s: StreamPrompt(p.tokens, p.mel, p.spk) for s, p in prompts.items()})
        chunks = {s: U.make_chunks(U.TINY, 3, seed=40 + s) for s in range(streams)}
        server.step({s: chunks[s][0] for s in range(streams)})
        batch = {s: chunks[s][1].to(dtypes[s % len(dtypes)]) for s in range(streams)}
        with census:
            out = server.step(batch)
        return census.per_stage(), {s: o.mel for s, o in out.items()}

    mixed = (torch.int64, torch.int32, torch.int16)
    (few, _), (many, mels) = tick(2, mixed), tick(6, mixed)
    stages = {"encoder", "cfm"} | ({"vocoder"} if hift is not None else set())
    assert few == many and set(many) == stages and max(many.values()) <= 6, (few, many)
    _, want = tick(6, (torch.int64,))
    assert all(torch.equal(mels[s], want[s]) for s in want)


@pytest.mark.skipif(R.hift_missing_reason() is not None, reason=str(R.hift_missing_reason()))
def test_waveform_first_chunk_covers_the_overlap(flow, hift):
    """The vocoder's cross-fade needs 8 mel frames from the first chunk (the upstream fails on a
    shorter one): ValueError naming the tokens; a mel-only stream takes the short chunk."""
    server = Token2wavServer(flow, hift, vocoder="upstream", max_streams=2, max_prompt_frames=40, n_timesteps=N_STEPS)
    prompt = U.make_prompt(U.TINY, 10, seed=1)
    server.open_stream("w", prompt.tokens, prompt.mel, prompt.spk)
    server.open_stream("m", prompt.tokens, prompt.mel, prompt.spk, waveform=False)
    with pytest.raises(ValueError, match="tokens.*8-frame overlap"):
        server.step({"w": torch.zeros(1, 6, dtype=torch.int32)})  # 3 new tokens = 6 frames
    assert server.step({"m": torch.zeros(1, 6, dtype=torch.int32)})["m"].mel.shape == (80, 6)
    assert server.step({"w": torch.zeros(1, 7, dtype=torch.int32)})["w"].wav.numel() == 0  # 8 frames, all overlap
    assert server.step({"w": torch.zeros(1, 5, dtype=torch.int32)})["w"].mel.shape == (80, 4)  # later: 2 tokens


@pytest.mark.gpu
@needs_hift
def test_cuda_graphs_streams_match_upstream():
    """CUDA, fp32, tiny: CFM, encoder and HiFT stages replayed from CUDA graphs (batches padded to
    the slot buckets) over several ticks of three streams; each stream equals the upstream decoding
    it alone on the same device (TF32 off: the same random draws, per stream), and the encoder,
    the HiFT's f0 predictor, per-stream source and batched decode were replayed from graphs."""
    prev = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        _cuda_graph_streams()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = prev


def _cuda_graph_streams():
    flow_gpu = U.build_flow(U.TINY, seed=0).cuda()
    hift_gpu = R.build_hift(seed=3).cuda()
    server = Token2wavServer(flow_gpu, hift_gpu, vocoder="upstream", max_streams=4, max_prompt_frames=80, n_timesteps=N_STEPS)
    assert server.graphs and server.stage_graphs
    prompts = [U.make_prompt(U.TINY, p, seed=10 + i, device="cuda") for i, p in enumerate((20, 20, 13))]
    chunks = [[c.cuda() for c in U.make_chunks(U.TINY, 8, seed=20 + i)] for i in range(3)]
    server.open_many({i: StreamPrompt(p.tokens, p.mel, p.spk, seed=100 + i) for i, p in enumerate(prompts)})
    mels, wavs = {i: [] for i in range(3)}, {i: [] for i in range(3)}
    for k in range(8):
        for i, o in server.step({i: (chunks[i][k], k == 7) for i in range(3)}).items():
            mels[i].append(o.mel)
            wavs[i].append(o.wav)
    for call in (server.encoder.call, server.vocoder.f0_call, server.vocoder.source_call, server.vocoder.decode_call):
        assert call.graph_count > 0 and sum(e.replays for e in call.cache.entries()) > 0, (call.name, call.events)
    for i in range(3):
        # the upstream's HiFT draws on the CUDA generator, seeded like the stream's
        ref_mels, _, _ = R.upstream_stream(flow_gpu, prompts[i], chunks[i], N_STEPS)
        _check_stream(f"stream {i}", mels[i], None, (ref_mels, None, None))
        ref_w = R.upstream_vocoder(hift_gpu, [m[None] for m in ref_mels], 100 + i)
        for k, (a, b) in enumerate(zip(wavs[i], ref_w)):
            assert err_rel_fro(a, b) <= 1e-4, f"stream {i} chunk {k} wav"


def test_warmup_covers_prompt_solves_next_to_settled_streams(flow):
    """The CFM solver's keys (kept on CPU too, where it runs eagerly) after ``warmup``: a stream
    settled at the trim bound, then three arrivals in one tick (a 3-slot prompt solve, padded to
    the 4-slot bucket: the whole arena, whose window covers the settled stream's cache), then a
    tick of all four, then a departure and an arrival (a 1-slot prompt solve): no new key, i.e.
    on CUDA no capture after warm-up."""
    server = Token2wavServer(flow, None, max_streams=4, max_prompt_frames=80, n_timesteps=N_STEPS, graphs=True)
    server.warmup(prompt_frames=(80,), chunk_tokens=(28,), ticks=3, rounds=1)
    solver = server.cfm_server.graph_cache
    misses = solver.misses
    prompts = [U.make_prompt(U.TINY, 40, seed=30 + i) for i in range(5)]  # 80 frames: its own T bucket
    chunks = U.make_chunks(U.TINY, 4, seed=40)[:3]  # 25 + 3 tokens each (the 4th would be a short last chunk)
    server.open_stream(0, prompts[0].tokens, prompts[0].mel, prompts[0].spk)
    for c in chunks:  # 80 + 3 x 50 frames: trimmed to 80 + 100
        server.step({0: c})
    server.open_many({i: StreamPrompt(p.tokens, p.mel, p.spk) for i, p in enumerate(prompts[1:4], start=1)})
    server.step({i: chunks[1] for i in range(4)})
    server.close_stream(2)
    server.open_stream(4, prompts[4].tokens, prompts[4].mel, prompts[4].spk)
    server.step({i: chunks[0] for i in (0, 1, 3, 4)})
    assert solver.misses == misses, [e.label for e in solver.entries()][-3:]


def test_a_dropped_server_is_freed_without_the_cycle_collector(flow):
    """The stage wrappers hold the server's methods weakly: the last reference going frees the
    server (on CUDA: its arenas and graph pools) at once, not at the next full collection."""
    import weakref

    server = Token2wavServer(flow, R.build_hift(seed=1), max_streams=2, max_prompt_frames=40, n_timesteps=N_STEPS,
                             stage_graphs=True)
    prompt = U.make_prompt(U.TINY, 10, seed=8)
    server.open_stream("a", prompt.tokens, prompt.mel, prompt.spk)
    server.step({"a": U.make_chunks(U.TINY, 1, seed=9)[0]})
    ref = weakref.ref(server)
    gc.disable()
    try:
        del server
        assert ref() is None
    finally:
        gc.enable()


def test_warmup_leaves_nothing_open(flow):
    """warmup runs the stream shapes (prompt, chunks to the trim bound, a last chunk) for each
    stream count and closes its streams: the server is empty and serves a stream correctly after."""
    server = Token2wavServer(flow, None, max_streams=2, max_prompt_frames=40, n_timesteps=N_STEPS)
    empty = server.state_bytes()
    report = server.warmup(prompt_frames=(20,), chunk_tokens=(28,), last_chunk_tokens=(5,), ticks=3, rounds=1)
    assert report["streams"] == (1 + 2) * 2 and report["ticks"] > 0  # counts 1 and 2, each reopened once
    assert report["graphs"] == {"cfm": 0, "encoder": 0, "vocoder": 0}  # CPU: eager
    assert server.open_streams == [] and server.state_bytes() == empty
    prompt = U.make_prompt(U.TINY, 10, seed=8)
    chunks = U.make_chunks(U.TINY, 3, seed=9)
    server.open_stream("a", prompt.tokens, prompt.mel, prompt.spk)
    got = [server.step({"a": (c, i == 2)})["a"].mel for i, c in enumerate(chunks)]
    _check_stream("after warmup", got, None, R.upstream_stream(flow, prompt, chunks, N_STEPS))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp16", "bf16"])
def test_gpu_shipped_streams_within_the_oracle(mode):
    """Shipped sizes on the GPU, the flow halved as ``Token2wav(float16=True)`` does: three streams
    (two 6 s prompts, one 4 s) through the front in the same ticks; each stream's mel against the
    fp64 upstream decoding it alone is no worse than the upstream module in that dtype (docs/design.md §6)."""
    import copy
    import dataclasses

    from oracle import assert_within_oracle

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[mode]
    base = U.build_flow(dataclasses.replace(U.SHIPPED, buffer_frames=512), seed=3)
    prompts64 = [U.make_prompt(U.SHIPPED, p, seed=4 + i, device="cuda", dtype=torch.float64)
                 for i, p in enumerate((150, 150, 100))]
    chunks = [U.make_chunks(U.SHIPPED, 5, seed=20 + i, device="cuda") for i in range(3)]
    flow64 = copy.deepcopy(base).double().cuda()
    same = base.to(dtype).cuda()
    prompts = [U.Prompt(p.tokens, p.mel.to(dtype), p.spk.to(dtype)) for p in prompts64]
    server = Token2wavServer(same, None, max_streams=4, max_prompt_frames=300, n_timesteps=10)
    server.open_many({i: StreamPrompt(p.tokens, p.mel, p.spk) for i, p in enumerate(prompts)})
    got = {i: [] for i in range(3)}
    for k in range(5):
        for i, o in server.step({i: (chunks[i][k], k == 4) for i in range(3)}).items():
            got[i].append(o.mel)
    for i in range(3):
        ref64, _, _ = R.upstream_stream(flow64, prompts64[i], chunks[i], 10)
        with torch.amp.autocast("cuda", dtype=dtype):  # as Token2wav.stream runs the flow
            up, _, _ = R.upstream_stream(same, prompts[i], chunks[i], 10)
        for k, (a, b, r) in enumerate(zip(got[i], up, ref64)):
            assert_within_oracle(a, b, r, name=f"{mode} stream {i} chunk {k} mel")
