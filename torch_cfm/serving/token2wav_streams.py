"""Opening streams, checking ticks and warming up a :class:`~torch_cfm.serving.Token2wavServer`.

The server's per-stream bookkeeping that is not a stage: argument checks (a ``ValueError`` naming
the stream and argument, nothing changed on error), the prompt path of ``open_many`` (voices
already solved are copied from the voice cache, and streams of one voice in the call from its
first; the others' tokens run through the encoder in one batch and their prompts through the CFM
in one ragged solve, or queued with pacing), and the warm-up that runs every stage at the shapes a
workload meets.
"""

from __future__ import annotations

from typing import Any, Hashable, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F

from ..errors import fail, shape_str
from ..models.hift_capturable import MEL_CACHE_FRAMES
from .voice_cache import content_key


def as_tokens(server, op: str, arg: str, t: Any, convert: bool = True) -> torch.Tensor:
    """Tokens (1, n) int64 on the encoder's device: one dtype whatever the caller passes, so a
    graph key never depends on it. ``convert=False``: checked and shaped only (a tick's chunks:
    the encoder stage converts each group's tokens at once)."""
    if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.is_complex() or t.dtype == torch.bool:
        fail(op, arg, "be an integer torch.Tensor", type(t).__name__ if not isinstance(t, torch.Tensor) else str(t.dtype))
    if t.dim() == 1:
        t = t[None]
    if t.dim() != 2 or t.shape[0] != 1 or t.shape[1] == 0:
        fail(op, arg, "have shape (1, n) or (n,), n >= 1", shape_str(t))
    return t.to(device=server.enc_device, dtype=torch.int64) if convert else t


def as_float(server, op: str, arg: str, t: Any, dims: int) -> torch.Tensor:
    """A floating-point tensor of ``dims`` dims (or one fewer: a batch of 1 added) on the encoder's device."""
    if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
        fail(op, arg, "be a floating-point torch.Tensor", type(t).__name__ if not isinstance(t, torch.Tensor)
             else str(t.dtype))
    if t.dim() == dims - 1:
        t = t[None]
    if t.dim() != dims:
        fail(op, arg, f"have {dims} dims (or {dims - 1})", shape_str(t))
    return t.to(server.enc_device)


def check_prompts(server, op: str, prompts: Mapping[Hashable, Any]) -> list:
    """Every prompt checked: [(stream id, tokens, mel (1, P, 80), spk (1, E), seed, waveform, voice)]."""
    from .token2wav import StreamPrompt

    staged = []
    for sid, item in prompts.items():
        if sid in server._streams or any(sid == s[0] for s in staged):
            fail(op, "stream_id", "not be open already", repr(sid))
        if isinstance(item, (tuple, list)) and 3 <= len(item) <= 6:
            item = StreamPrompt(*item)
        if not isinstance(item, StreamPrompt):
            fail(op, f"prompts[{sid!r}]",
                 "be a StreamPrompt or (prompt_tokens, prompt_mel, spk[, seed[, waveform[, voice]]])", type(item).__name__)
        tokens = as_tokens(server, op, f"prompts[{sid!r}] prompt_tokens", item.tokens)
        p_tok = tokens.shape[1] - server.lookahead
        mel = as_float(server, op, f"prompts[{sid!r}] prompt_mel", item.mel, 3)
        out = server.flow.output_size
        if p_tok <= 0 or mel.shape[0] != 1 or mel.shape[1] != p_tok * server.up_rate or mel.shape[2] != out:
            fail(op, f"prompts[{sid!r}] prompt_mel", f"have shape (1, {max(p_tok, 0) * server.up_rate}, {out}) for "
                 f"{tokens.shape[1]} prompt tokens ({server.lookahead} of them lookahead)", shape_str(mel))
        if mel.shape[1] > server.max_prompt_frames:
            fail(op, f"prompts[{sid!r}] prompt_mel", f"have at most max_prompt_frames={server.max_prompt_frames} "
                 "frames", str(mel.shape[1]), "build the server with a larger max_prompt_frames")
        spk = as_float(server, op, f"prompts[{sid!r}] spk", item.spk, 2)
        if spk.shape[0] != 1:
            fail(op, f"prompts[{sid!r}] spk", "have shape (1, E) or (E,)", shape_str(spk))
        if server.check_finite:
            for name, t in (("prompt_mel", mel), ("spk", spk)):
                if not bool(torch.isfinite(t).all()):
                    fail(op, f"prompts[{sid!r}] {name}", "hold finite values only", "NaN/Inf")
        if item.voice is not None and item.voice is not False:
            try:
                hash(item.voice)
            except TypeError:
                fail(op, f"prompts[{sid!r}] voice", "be hashable, None or False", type(item.voice).__name__)
        staged.append((sid, tokens, mel, spk, int(item.seed), bool(item.waveform), item.voice))
    return staged


def open_staged(server, staged: list) -> dict[Hashable, torch.Tensor]:
    """Open checked prompts: cached voices copied, the others encoded in one batch and solved
    (in one ragged CFM solve, or queued with pacing). Without pacing, streams that name the same
    voice (with a voice cache: or have the same content) share one encoder run and prompt solve:
    the first is solved, the others get copies of its state. Returns {stream id: prompt mel (80, P)}."""
    from .token2wav import _Stream

    cfm, voices = server.cfm_server, server.cfm_server.voices
    t0 = server._clock()
    keys = {}
    if voices is not None:  # voice=False: a stream kept out of the cache
        keys = {sid: voice if voice is not None else content_key(tokens, mel, spk, server.dtype)
                for sid, tokens, mel, spk, _, _, voice in staged if voice is not False}
    cached = [s for s in staged if s[0] in keys and keys[s[0]] in voices]
    copies = {} if server.prompt_steps_per_tick is not None else _same_voice(
        [s for s in staged if s not in cached], keys)
    solved = [s for s in staged if s not in cached and s[0] not in copies]
    with server.encoder.autocast():
        spks = {sid: server.flow.spk_embed_affine_layer(F.normalize(spk.to(server.enc_dtype), dim=1))
                for sid, _, _, spk, *_ in solved}
    encoder = server.encoder
    for sid, _, mel, *_ in staged:
        encoder.open(sid, mel.shape[1])
    try:
        mus = encoder([(sid, tokens, False) for sid, tokens, *_ in solved])
        for sid, first in copies.items():  # its voice's first stream is solved: copies of its encoder state
            encoder.adopt(sid, *encoder.caches(first))
        for sid in (s[0] for s in cached):  # a cached voice: copies of its prompt's encoder state
            encoder.adopt(sid, *cfm.voice_state(keys[sid]).extra["conformer"])
    except BaseException:
        for sid, *_ in staged:
            encoder.close(sid)
        raise
    t1 = server._clock()
    mels = cfm.open_voices({s[0]: keys[s[0]] for s in cached}) if cached else {}  # each voice's hits together
    for sid, _, _, _, seed, waveform, _ in staged:
        server._streams[sid] = _Stream(waveform=waveform and server.vocoder is not None)
        if server._streams[sid].waveform:
            server.vocoder.open(sid, seed)
    extra = {sid: {"conformer": tuple(t.clone() for t in encoder.caches(sid))} for sid in mus if sid in keys}
    if server.prompt_steps_per_tick is None:
        for sid, _, mel, *_ in solved:
            cfm.open_request(sid, spks[sid][0], prompt_len=mel.shape[1])
            if sid in keys:
                voices.get(keys[sid])  # a counted miss (the CFM server counts its own lookups)
        if solved:
            fresh = cfm.solve_chunk({sid: (mus[sid], mel[0].transpose(0, 1)) for sid, _, mel, *_ in solved})
            kept = {sid for sid in fresh if sid in keys and cfm.keep_voice(sid, keys[sid], fresh[sid], extra[sid])}
            mels.update(fresh)
            states = {first: cfm.prompt_state(first, fresh[first]) for first in set(copies.values()) - kept}
            for sid, first in copies.items():  # from the voice cache (a counted hit) or a copy of the first
                mels[sid] = (cfm.open_request(sid, voice=keys[sid]) if first in kept
                             else cfm.open_copy(sid, states[first]))
    else:  # staged now, solved by the next ticks' advance_prompts
        for sid, _, mel, *_ in solved:
            cfm.open_request(sid, spks[sid][0], prompt_mu=mus[sid], prompt_mel=mel[0].transpose(0, 1),
                             prompt_len=mel.shape[1], voice=keys.get(sid, False), voice_extra=extra.get(sid))
    server._account(t1 - t0, server._clock() - t1, 0.0)
    return {sid: mels[sid] for sid, *_ in staged if sid in mels}


def _same_voice(staged: list, keys: Mapping[Hashable, Any]) -> dict[Hashable, Hashable]:
    """{stream id: the earlier stream of ``staged`` whose prompt it shares}: the same voice-cache
    key in ``keys``, or without one the same explicit voice (None and False name none), and the
    same prompt tokens, mel and speaker embedding (a voice named for two prompts shares nothing)."""
    first: dict = {}
    out = {}
    for sid, tokens, mel, spk, *_, voice in staged:
        key = keys.get(sid, voice)
        if key is None or key is False:
            continue
        if key not in first:
            first[key] = (sid, tokens, mel, spk)
        elif all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(first[key][1:], (tokens, mel, spk))):
            out[sid] = first[key][0]
    return out


def check_chunks(server, op: str, chunks: Mapping[Hashable, Any]) -> list:
    """Every chunk checked: [(stream id, tokens (None: an empty last chunk), last)]."""
    staged = []
    for sid, item in chunks.items():
        st = server._streams.get(sid)
        if st is None:
            fail(op, "chunks", "name open streams only", repr(sid), f"open streams: {list(server._streams)[:8]}")
        if not server.cfm_server.ready(sid):
            fail(op, f"chunks[{sid!r}]", "name a ready stream", "a stream whose prompt solve is under way",
                 "each step advances it; ready(stream_id) says when it takes chunks")
        if st.done:
            fail(op, f"chunks[{sid!r}]", "follow no last chunk", "a chunk after the last one", "close the stream")
        tokens, last = item if isinstance(item, (tuple, list)) else (item, False)
        if last and isinstance(tokens, torch.Tensor) and tokens.numel() == 0 and (server.causal or not st.waveform):
            # minicpmo-utils' Token2wav.stream([], last_chunk=True): the vocoder's held-back frames
            # flushed, the flow not run
            staged.append((sid, None, True))
            continue
        tokens = as_tokens(server, op, f"chunks[{sid!r}] tokens", tokens, convert=False)
        # The conformer's conv caches need 2 new tokens a chunk (its lookahead conv keeps 2 frames);
        # a waveform stream's first chunk needs the vocoder's 8 overlap frames (4 tokens).
        new_tokens = MEL_CACHE_FRAMES // server.up_rate if st.waveform and st.chunks == 0 else 2
        least = new_tokens + (0 if last else server.lookahead)
        if not least <= tokens.shape[1] <= server.max_chunk_tokens:
            fail(op, f"chunks[{sid!r}] tokens", f"have {least}..{server.max_chunk_tokens} tokens "
                 f"(last_chunk={bool(last)}; {server.lookahead} lookahead tokens unless last"
                 + ("; the first chunk of a waveform stream covers the vocoder's 8-frame overlap)"
                    if new_tokens > 2 else ")"), str(tokens.shape[1]))
        staged.append((sid, tokens, bool(last)))
    return staged


def warmup(server, prompt_frames: Sequence[int] = (300,), chunk_tokens: Sequence[int] = (28,),
           last_chunk_tokens: Sequence[int] = (), stream_counts: Optional[Sequence[int]] = None, ticks: int = 4,
           rounds: int = 2, cfm_warmup: Optional[Mapping[str, Any]] = None,
           voices: Optional[Mapping[Hashable, Any]] = None) -> dict:
    """Run every stage of ``server`` at the shapes a workload meets, now.

    First the CFM server warms up: with ``cfm_warmup`` as its keyword arguments, by default the
    (T, L) pairs of these streams' prompts and chunks (:func:`torch_cfm.buckets.shared_solve_shapes`)
    at these stream counts (with ``prompt_steps_per_tick``: the chunks' pairs and the prompt
    cohorts' step spans). Then, for each prompt length and each stream count (default: the CFM's
    slot buckets), that many streams are opened together, run ``ticks`` ticks of each chunk length
    (the conformer and CFM caches grow to the trim bound), then one last chunk of each
    ``last_chunk_tokens`` length, and closed; all of it ``rounds`` times (a new shape runs eagerly
    once, then is captured). Last, ``voices`` ({voice: (prompt_tokens, prompt_mel, spk)}) are
    solved into the voice cache.

    Returns:
        {"streams", "ticks", "graphs": {stage: count}, "voices": solved voices}.
    """
    counts = list(stream_counts) if stream_counts is not None else sorted(
        set(server.cfm_server.slot_buckets or [1, server.max_streams]) | {1})
    if cfm_warmup is None:  # the (T, L) solves these streams meet, not every bucket's product
        frames = [(n - server.lookahead) * server.up_rate for n in chunk_tokens]
        last = [n * server.up_rate for n in last_chunk_tokens] or frames[:1]
        pairs = server.solve_pairs(prompt_frames, frames, last)
        cfm_warmup = dict(pairs=pairs, slot_counts=counts)
        if server.prompt_steps_per_tick is not None:  # prompts are never solved whole
            chunk_lengths = set(frames) | set(last)
            cfm_warmup.update(pairs=[p for p in pairs if p[0] in chunk_lengths or p[0] not in prompt_frames],
                              prompt_frames=list(prompt_frames))
    server.cfm_server.warmup(**dict(cfm_warmup))
    gen = torch.Generator().manual_seed(0)
    runs = [_warm_streams(server, gen, p, count, chunk_tokens, last_chunk_tokens, ticks)
            for _ in range(rounds) for p in prompt_frames for count in counts]
    for i, (voice, prompt) in enumerate((voices or {}).items()):
        sid = ("__voice__", i)
        server.open_stream(sid, *prompt, waveform=False, voice=voice)
        _until_ready(server, [sid])
        server.close_stream(sid)
    return {"streams": sum(r[0] for r in runs), "ticks": sum(r[1] for r in runs), "graphs": server.graph_counts(),
            "voices": len(voices or {})}


def _warm_streams(server, gen, p: int, count: int, chunk_tokens, last_chunk_tokens, ticks: int) -> tuple[int, int]:
    """``count`` streams of prompt length ``p`` through ``ticks`` ticks and each last chunk; (opened, ticks)."""
    from .token2wav import StreamPrompt

    count = min(count, server.max_streams - len(server._streams))
    if count <= 0:
        return 0, 0
    vocab = server.flow.input_embedding.num_embeddings
    spk_dim = server.flow.spk_embed_affine_layer.in_features
    p_tok = p // server.up_rate
    ids = [("__warmup__", p, count, i) for i in range(count)]

    def tokens(n):
        return torch.randint(0, vocab, (1, n), generator=gen)

    def open_all():
        server.open_many({sid: StreamPrompt(tokens(p_tok + server.lookahead),
                                            torch.randn(1, p_tok * server.up_rate, server.flow.output_size, generator=gen),
                                            torch.randn(1, spk_dim, generator=gen), voice=False) for sid in ids})
        return _until_ready(server, ids)

    opened, done = count, open_all()
    for _ in range(ticks):
        for n in chunk_tokens:
            server.step({sid: tokens(n) for sid in ids})
            done += 1
    for n in last_chunk_tokens:
        for sid in ids:
            server.close_stream(sid)
        done += open_all()
        opened += count
        for _ in range(ticks):
            server.step({sid: tokens(chunk_tokens[0]) for sid in ids})
        server.step({sid: (tokens(n), True) for sid in ids})
        done += ticks + 1
    for sid in ids:
        server.close_stream(sid)
    return opened, done


def _until_ready(server, ids) -> int:
    """Empty ticks until every stream of ``ids`` is ready; returns their count."""
    ticks = 0
    while not all(server.ready(sid) for sid in ids):
        server.step({})
        ticks += 1
    return ticks


__all__ = ["as_tokens", "as_float", "check_prompts", "open_staged", "check_chunks", "warmup"]
