"""Token2wavServer's default vocoder stage (torch_cfm's many-stream HiFT, a random stream per stream):
each stream equals the upstream ``Token2wav.stream`` vocoder on the server's own mel with the
sources' noise off (fp32, 1e-5); with noise, a stream's waveform is bitwise the same whoever
shares its ticks; NaN stays in its stream. And the voice-prompt cache: a stream opened with a
voice already solved equals, bitwise, the same stream solved afresh."""

from __future__ import annotations

import pytest
import torch

import token2wav_reference as R
import upstream_flow as U
from oracle import err_rel_fro

pytestmark = [pytest.mark.skipif(R.hift_missing_reason() is not None, reason=str(R.hift_missing_reason())),
              pytest.mark.usefixtures("one_thread")]

from torch_cfm.serving import StreamPrompt, Token2wavServer  # noqa: E402

N_STEPS = 4


@pytest.fixture(scope="module")
def flow():
    return U.build_flow(U.TINY, seed=0)


@pytest.fixture(scope="module")
def hift():
    return R.build_hift(seed=3)


def _run(server, plan, chunks, prompts, ticks=None):
    """Open the streams of ``plan`` ({id: (opened at tick, seed)}) and push one chunk per tick to
    each open one; returns {id: (mels, wavs)}."""
    got = {s: ([], []) for s in plan}
    for tick in range(ticks or 12):
        opening = {s: StreamPrompt(prompts[s].tokens, prompts[s].mel, prompts[s].spk, seed=seed)
                   for s, (at, seed) in plan.items() if at == tick}
        if opening:
            server.open_many(opening)
        batch = {}
        for s in server.open_streams:
            n = len(got[s][0])
            if n < len(chunks[s]) and server.ready(s):
                batch[s] = (chunks[s][n], n == len(chunks[s]) - 1)
        for s, o in server.step(batch).items():
            got[s][0].append(o.mel)
            got[s][1].append(o.wav)
        for s in server.open_streams:
            if len(got[s][0]) == len(chunks[s]):
                server.close_stream(s)
    return got


def test_streams_equal_the_upstream_vocoder_on_their_mel_without_noise(flow, hift):
    server = Token2wavServer(flow, hift, max_streams=3, max_prompt_frames=80, n_timesteps=N_STEPS)
    R.quiet_vocoder(server)
    prompts = {s: U.make_prompt(U.TINY, p, seed=10 + i) for i, (s, p) in enumerate((("a", 20), ("b", 13), ("c", 16)))}
    chunks = {s: U.make_chunks(U.TINY, n, seed=20 + i, last_tokens=7) for i, (s, n) in enumerate((("a", 5),
                                                                                                  ("b", 4), ("c", 3)))}
    got = _run(server, {"a": (0, 1), "b": (0, 2), "c": (2, 3)}, chunks, prompts)
    for s in "abc":
        mels, wavs = got[s]
        with R.NoNoise():
            ref = R.upstream_vocoder(hift, [m[None] for m in mels], seed=0)
        assert len(wavs) == len(ref) == len(chunks[s])
        for i, (a, b) in enumerate(zip(wavs, ref)):
            assert a.shape == b.shape and err_rel_fro(a, b) <= 1e-5, (s, i, err_rel_fro(a, b))


def test_a_streams_waveform_is_bitwise_the_same_whoever_shares_its_ticks(flow, hift):
    """The vocoder stage itself on the same mels: stream "a" alone, then "a" among two others
    opened before it, with other chunk lengths on some ticks (other groups): bitwise equal."""
    g = torch.Generator().manual_seed(5)
    mels = {s: [torch.randn(80, t, generator=g) for t in (12, 10, 10, 7)] for s in "abc"}
    mels["b"][1] = torch.randn(80, 9, generator=g)  # "b" in its own group on the second tick

    def drive(order):
        stage = Token2wavServer(flow, hift, max_streams=3, max_prompt_frames=80, n_timesteps=N_STEPS).vocoder
        for sid in order:
            stage.open(sid, seed=ord(sid))
        wavs = []
        for k in range(4):
            out = stage([(sid, mels[sid][k], k == 3) for sid in order])
            wavs.append(out["a"])
        return wavs

    alone, crowd = drive(["a"]), drive(["c", "b", "a"])
    for a, b in zip(alone, crowd):
        assert torch.equal(a, b)
    assert all(w.abs().max() > 0 for w in alone)


def test_nan_in_one_stream_stays_in_that_stream(flow, hift):
    """The vocoder stage on the same mels, one stream's mel holding NaN: the others bitwise as without it."""
    g = torch.Generator().manual_seed(6)
    mels = {s: [torch.randn(80, 12, generator=g) for _ in range(3)] for s in "abx"}
    mels["x"][0][3, 5] = float("nan")

    def drive(order):
        stage = Token2wavServer(flow, hift, max_streams=3, max_prompt_frames=80, n_timesteps=N_STEPS).vocoder
        for sid in order:
            stage.open(sid, seed=ord(sid))
        return [stage([(sid, mels[sid][k], False) for sid in order]) for k in range(3)]

    clean, mixed = drive(["a", "b"]), drive(["a", "x", "b"])
    assert not all(torch.isfinite(out["x"]).all() for out in mixed)
    for c, m in zip(clean, mixed):
        for s in "ab":
            assert torch.isfinite(m[s]).all() and torch.equal(c[s], m[s]), s


def _stage(flow, hift, streams=3):
    return Token2wavServer(flow, hift, max_streams=streams, max_prompt_frames=80, n_timesteps=N_STEPS).vocoder


def test_a_reused_slot_starts_clean_and_bad_mels_are_refused_before_anything_runs(flow, hift):
    g = torch.Generator().manual_seed(8)
    mels = [torch.randn(80, 10, generator=g) for _ in range(3)]
    fresh = _stage(flow, hift)
    fresh.open("d", seed=4)
    want = [fresh([("d", m, False)])["d"] for m in mels]

    stage = _stage(flow, hift)
    stage.open("a", seed=1)
    stage([("a", torch.randn(80, 10, generator=g), False)])
    stage.close("a")  # its slot, holding a's frames and tails, goes to "d"
    stage.open("d", seed=4)
    stage.open("e", seed=5)
    state = [t.clone() for t in (stage._mel, stage._source, stage._speech, stage._rng)]
    for bad, match in ((torch.randn(81, 10), "mel must be \\(80, T"), (torch.randn(80, 10**4), "mel must be")):
        with pytest.raises(ValueError, match=match):
            stage([("e", mels[0], False), ("d", bad, False)])
    assert all(torch.equal(a, b) for a, b in zip(state, (stage._mel, stage._source, stage._speech, stage._rng)))
    got = [stage([("d", m, False)])["d"] for m in mels]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    stage([("e", torch.randn(80, 5, generator=g), False)])  # a first chunk shorter than the overlap
    with pytest.raises(ValueError, match="at least 8 frames"):
        stage([("e", mels[0], False)])


@pytest.mark.gpu
def test_gpu_graphed_stage_equals_the_eager_stage_bitwise(flow, hift):
    """CUDA: the default vocoder stage replayed from its in-place graphs (a stream opened two ticks
    late, padded batches, a tick of another chunk length) gives every stream the waveform of the
    same stage run eagerly, bitwise; the graphs were captured and replayed."""
    import copy

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(9)
    opens = {"a": 0, "b": 0, "c": 2}
    mels = {s: [torch.randn(80, 9 if k == 3 else 12, generator=g) for k in range(5)] for s in opens}

    def drive(graphs: bool):
        server = Token2wavServer(copy.deepcopy(flow).cuda(), copy.deepcopy(hift).cuda(), max_streams=4,
                                 max_prompt_frames=80, n_timesteps=N_STEPS, stage_graphs=graphs)
        stage, outs = server.vocoder, {s: [] for s in opens}
        for tick in range(7):
            for s, at in opens.items():
                if at == tick:
                    stage.open(s, seed=ord(s))
            items = [(s, mels[s][tick - at].cuda(), tick - at == 4) for s, at in opens.items() if 0 <= tick - at < 5]
            with torch.no_grad():  # as the server calls it (a call with grad enabled runs eagerly)
                got = stage(items)
            for s, wav in got.items():
                outs[s].append(wav.cpu())
        return outs, stage

    (eager, _), (graphed, stage) = drive(False), drive(True)
    for s in opens:
        assert len(graphed[s]) == 5 and all(torch.equal(a, b) for a, b in zip(graphed[s], eager[s])), s
    # two keys captured (2 and 1 rows at 12 frames, each on its second call), each replayed once
    # more; a capturing call is not counted as a replay
    entries = stage.call.cache.entries()
    assert stage.call.graph_count >= 2 and sum(e.replays for e in entries) >= 2, stage.call.events


def test_paced_streams_kept_out_of_the_voice_cache_leave_it_alone(flow, hift):
    """Under pacing, a stream opened with voice=False is neither looked up nor kept, and once the
    prompts are solved no request still holds a copy of its prompt's encoder state."""
    voice = U.make_prompt(U.TINY, 20, seed=80)
    server = Token2wavServer(flow, hift, max_streams=2, max_prompt_frames=80, n_timesteps=N_STEPS,
                             voice_cache_bytes=2**26, prompt_steps_per_tick=2)
    server.open_many({"off": StreamPrompt(voice.tokens, voice.mel, voice.spk, voice=False),
                      "on": StreamPrompt(voice.tokens, voice.mel, voice.spk)})
    for _ in range(N_STEPS):
        server.step({})
    assert server.ready("off") and server.ready("on")
    voices = server.cfm_server.voices
    assert (voices.hits, voices.misses, len(voices)) == (0, 1, 1)
    assert all(req.voice_extra is None for req in server.cfm_server._requests.values())


@pytest.mark.parametrize("paced", [False, True])
def test_a_cached_voice_equals_a_fresh_solve_bitwise(flow, hift, paced):
    """Two streams open with one voice, one later on: the second copies the first's solved prompt
    (CFM caches, conformer caches) and its mel and waveform equal, bitwise, the same stream on a
    server without the cache; a hit needs no prompt steps under pacing."""
    k = 2 if paced else None
    voice = U.make_prompt(U.TINY, 20, seed=80)
    prompts = {"a": voice, "b": voice}
    chunks = {"a": U.make_chunks(U.TINY, 3, seed=81), "b": U.make_chunks(U.TINY, 3, seed=82)}
    cached = Token2wavServer(flow, hift, max_streams=2, max_prompt_frames=80, n_timesteps=N_STEPS,
                             voice_cache_bytes=2**26, prompt_steps_per_tick=k)
    got = _run(cached, {"a": (0, 1), "b": (6, 2)}, chunks, prompts)
    voices = cached.cfm_server.voices
    assert (voices.hits, voices.misses, len(voices)) == (1, 1, 1)
    assert cached.cfm_server.memory_plan().voice_cache_bytes == 2**26
    fresh = _run(Token2wavServer(flow, hift, max_streams=2, max_prompt_frames=80, n_timesteps=N_STEPS,
                                 prompt_steps_per_tick=k), {"b": (0, 2)}, {"b": chunks["b"]}, prompts)
    for got_b, want_b in zip(got["b"], fresh["b"]):
        for a, b in zip(got_b, want_b):
            assert torch.equal(a, b)
    # opened with a hit, the stream is ready at once (no prompt steps), also under pacing
    cached.open_stream("c", voice.tokens, voice.mel, voice.spk)
    assert cached.ready("c") and voices.hits == 2
    cached.close_stream("c")


def test_prompt_state_and_open_copy_refuse_what_does_not_fit(flow, hift):
    """``prompt_state`` only right after a prompt solve; ``open_copy`` of another server's state
    (other solver steps: other cache shapes) is refused naming ``state``, with nothing opened."""
    voice = U.make_prompt(U.TINY, 20, seed=80)
    one = Token2wavServer(flow, hift, max_streams=2, max_prompt_frames=80, n_timesteps=N_STEPS)
    two = Token2wavServer(flow, hift, max_streams=2, max_prompt_frames=80, n_timesteps=N_STEPS + 1)
    mel = one.open_stream("a", voice.tokens, voice.mel, voice.spk)
    state = one.cfm_server.prompt_state("a", mel)
    two.open_stream("z", voice.tokens, voice.mel, voice.spk)
    other = two.cfm_server.prompt_state("z", mel)
    free = one.cfm_server.free_slots
    with pytest.raises(ValueError, match=r"CFMServer.open_copy: state must be a prompt state of this server"):
        one.cfm_server.open_copy("b", other)
    with pytest.raises(ValueError, match=r"state must be .*got a dict"):
        one.cfm_server.open_copy("b", {})
    assert one.cfm_server.open_requests == ["a"] and one.cfm_server.free_slots == free
    assert torch.equal(one.cfm_server.open_copy("b", state), mel)
    one.step({"a": (U.make_chunks(U.TINY, 1, seed=82)[0], False)})
    with pytest.raises(ValueError, match=r"prompt_state: request_id must name a request just after its prompt solve"):
        one.cfm_server.prompt_state("a", mel)


def test_one_voice_name_on_two_prompts_shares_nothing_and_cache_hits_count(flow, hift):
    """A voice named for two different prompts: each is solved (its own prompt length and mel);
    an unhashable voice is refused naming it; with a voice cache, a copy within one call is a
    counted hit of the voice its first stream just kept."""
    voice, other = U.make_prompt(U.TINY, 20, seed=80), U.make_prompt(U.TINY, 13, seed=83)
    server = Token2wavServer(flow, hift, max_streams=3, max_prompt_frames=80, n_timesteps=N_STEPS)
    with pytest.raises(ValueError, match=r"prompts\['x'\] voice must be hashable, None or False, got list"):
        server.open_many({"x": StreamPrompt(voice.tokens, voice.mel, voice.spk, voice=["v"])})
    assert server.open_streams == []
    mels = server.open_many({"a": StreamPrompt(voice.tokens, voice.mel, voice.spk, voice="v"),
                             "b": StreamPrompt(other.tokens, other.mel, other.spk, voice="v")})
    assert mels["a"].shape[1] == voice.mel.shape[1] and mels["b"].shape[1] == other.mel.shape[1]
    cached = Token2wavServer(flow, hift, max_streams=3, max_prompt_frames=80, n_timesteps=N_STEPS,
                             voice_cache_bytes=1 << 26)
    cached.open_many({s: StreamPrompt(voice.tokens, voice.mel, voice.spk, seed=i) for i, s in enumerate("abc")})
    voices = cached.cfm_server.voices
    assert (voices.hits, voices.misses) == (2, 1)


@pytest.mark.parametrize("cache", [None, 2**26])
def test_streams_of_one_voice_in_one_call_share_its_prompt_solve(flow, hift, cache):
    """``open_many`` of two streams naming one voice (explicitly; with a voice cache, by content)
    and one of another voice: one prompt solve per voice, the second stream
    of the voice holds bitwise the first one's prompt state, and it decodes as the same stream
    opened alone on a fresh server does (1e-5: that prompt is solved without the other voice)."""
    voice, other = U.make_prompt(U.TINY, 20, seed=80), U.make_prompt(U.TINY, 13, seed=83)
    chunks = U.make_chunks(U.TINY, 3, seed=82)
    name = None if cache else "v"
    server = Token2wavServer(flow, hift, max_streams=3, max_prompt_frames=80, n_timesteps=N_STEPS,
                             voice_cache_bytes=cache)
    solves, solve = [], server.cfm_server.solve_chunk
    server.cfm_server.solve_chunk = lambda items, **kw: solves.append(sorted(items)) or solve(items, **kw)
    mels = server.open_many({"a": StreamPrompt(voice.tokens, voice.mel, voice.spk, seed=1, voice=name),
                             "b": StreamPrompt(voice.tokens, voice.mel, voice.spk, seed=2, voice=name),
                             "c": StreamPrompt(other.tokens, other.mel, other.spk, seed=3)})
    assert solves == [["a", "c"]] and torch.equal(mels["a"], mels["b"])
    caches = [server.stream_caches(s) for s in "ab"]
    assert all(torch.equal(caches[0][k], caches[1][k]) for k in caches[0])
    alone = Token2wavServer(flow, hift, max_streams=3, max_prompt_frames=80, n_timesteps=N_STEPS)
    assert err_rel_fro(mels["b"], alone.open_stream("b", voice.tokens, voice.mel, voice.spk, seed=2)) <= 1e-5
    for k, tok in enumerate(chunks):
        last = k == len(chunks) - 1
        got, want = server.step({"b": (tok, last)})["b"], alone.step({"b": (tok, last)})["b"]
        assert err_rel_fro(got.mel, want.mel) <= 1e-5 and err_rel_fro(got.wav, want.wav) <= 1e-5, k


def test_open_voices_equals_one_hit_at_a_time_bitwise(flow):
    """``CFMServer.open_voices`` (the hits of one voice restored together) leaves the arenas, the
    returned mels, the hit counts and the next solve bitwise as ``open_request(voice=)`` one at a
    time does; an unknown voice, an open id or too few slots are refused with nothing opened."""
    prompts = {"A": U.make_prompt(U.TINY, 20, seed=80), "B": U.make_prompt(U.TINY, 13, seed=83)}
    servers = []
    for _ in range(2):
        server = Token2wavServer(flow, None, max_streams=4, max_prompt_frames=80, n_timesteps=N_STEPS,
                                 voice_cache_bytes=1 << 26)
        for v, p in prompts.items():
            server.open_stream(f"solve {v}", p.tokens, p.mel, p.spk, voice=v)
            server.close_stream(f"solve {v}")
        servers.append(server.cfm_server)
    one, many = servers
    plan = {"x": "A", "y": "B", "z": "A"}
    mels_one = {rid: one.open_request(rid, voice=v) for rid, v in plan.items()}
    mels_many = many.open_voices(plan)
    assert list(mels_many) == list(plan) and all(torch.equal(mels_one[r], mels_many[r]) for r in plan)
    assert (one.voices.hits, one.voices.misses) == (many.voices.hits, many.voices.misses) == (3, 2)
    for a, b in zip(one.arenas, many.arenas):
        for name, t in a.tensors().items():
            assert torch.equal(t, b.tensors()[name]), name
    chunk = {r: torch.randn(80, 12, generator=torch.Generator().manual_seed(5)) for r in plan}
    got_one, got_many = one.solve_chunk(chunk), many.solve_chunk(chunk)
    assert all(torch.equal(got_one[r], got_many[r]) for r in plan)
    free = many.free_slots
    with pytest.raises(ValueError, match=r"open_voices: requests\['w'\] must name a request not open yet and a "
                                         r"cached voice, got voice 'C', not cached"):
        many.open_voices({"v": "A", "w": "C"})
    with pytest.raises(ValueError, match=r"requests\['x'\] .* got an open request"):
        many.open_voices({"x": "A"})
    with pytest.raises(many.AdmissionError, match=r"open_voices: 2 requests for 1 free slots"):
        many.open_voices({"v": "A", "w": "B"})
    assert many.open_requests == list(plan) and many.free_slots == free
