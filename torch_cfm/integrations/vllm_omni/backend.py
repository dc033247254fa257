"""torch_cfm behind vLLM-Omni's MiniCPM-o 4.5 token2wav backend (``BatchedToken2Wav``).

vLLM-Omni's Code2Wav stage drives its backend with request-owned state: ``setup_batch(features,
B)`` returns B initial states for one voice prompt, ``decode_batch(tokens, features, states,
last_chunk=...)`` and ``decode_ragged_batch(tokens, features, states, last_chunks=...)`` return
each row's audio and its next state, and the stage keeps the state of each request between
steps. :class:`TorchCfmBatchedToken2Wav` keeps that contract and serves every request as a stream
of one :class:`~torch_cfm.serving.Token2wavServer` over the backend's own
flow and HiFT: the conformer encoder, the CFM (one ``CFMServer``: CUDA graphs, preallocated cache
arenas) and the vocoder run batched across every stream of a call, whatever their prompts and
positions.

State lifecycle. A state this backend returns is a ``BatchedToken2WavState`` subclass that names
its stream and how many chunks it has decoded (``flow_cache`` and ``hift_cache`` are empty: the
caches live in the server's arenas, so every such state has the same shape signature and the
stage buckets a prompt's requests together whatever their positions). The stream is

* opened by ``setup_batch`` (its prompt solved there, as the original solves it there: once per call,
  copied into each of the call's streams);
* advanced by ``decode_batch`` / ``decode_ragged_batch``: the state passed in must be the one the
  last call returned for that request (a state is consumed once; an older one raises ValueError);
* closed when its last chunk is decoded, by :meth:`TorchCfmBatchedToken2Wav.release`, or when the
  newest state of the stream is garbage collected (the stage drops it when the request finishes
  or is aborted). A finalizer only queues the stream; the queue is drained at the start of the
  next call, so no stream is closed in the middle of a tick.

Per-request fallback (the reason logged once, at WARNING on the
``torch_cfm.integrations.vllm_omni`` logger): a voice prompt longer than ``max_prompt_frames`` is
set up, and then decoded, by the original methods (their states are ordinary
``BatchedToken2WavState``); a call that mixes both kinds of state is split between the two paths.
Whole-backend fallbacks (TensorRT stepper, NPU, unknown layouts) are decided when it is applied
(:mod:`.apply`).

Importing this module imports neither vLLM nor vLLM-Omni: the backend is the caller's object.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import time
import weakref
from collections import deque
from typing import Any, Callable, Optional, Sequence

import torch

from ...errors import fail
from .options import Options, log_once, say, serving_context, state_base

__all__ = ["TorchCfmBatchedToken2Wav", "is_torch_cfm_state"]

SILENCE_TOKEN = 4218  # the original pads a prompt's lookahead with it (batched_token2wav._SILENCE_TOKEN)
_ADAPTER_IDS = itertools.count(1)
_STATE_CLASSES: dict = {}


def _state_class(base: type) -> type:
    """``base`` (``BatchedToken2WavState``) with the stream it names and the chunks it has decoded."""
    cls = _STATE_CLASSES.get(base)
    if cls is None:
        cls = dataclasses.make_dataclass(
            "TorchCfmToken2WavState",
            [("stream", int, dataclasses.field(default=-1)), ("version", int, dataclasses.field(default=0)),
             ("owner", int, dataclasses.field(default=0))],
            bases=(base,), frozen=True, eq=False,
            namespace={"__doc__": "A request's state on torch_cfm: its stream and how many chunks it has "
                                  "decoded (the caches live in the server; flow_cache and hift_cache are empty)."})
        cls.__module__ = __name__
        _STATE_CLASSES[base] = cls
    return cls


def is_torch_cfm_state(state: Any) -> bool:
    """Whether ``state`` was made by a :class:`TorchCfmBatchedToken2Wav` (any backend's)."""
    return isinstance(state, tuple(_STATE_CLASSES.values()))


class _Dropped:
    """Streams whose newest state was garbage collected, closed at the next call."""

    def __init__(self) -> None:
        self.items: deque = deque()


def _state_dropped(queue_ref: "weakref.ref[_Dropped]", stream: int, version: int) -> None:
    queue = queue_ref()
    if queue is not None:  # deque.append is atomic: safe from a finalizer on any thread
        queue.items.append((stream, version))


@dataclasses.dataclass
class _Record:
    version: int
    failed: Optional[str] = None


def _pieces(tokens: torch.Tensor, last: bool, longest: int, lookahead: int) -> list[tuple[torch.Tensor, bool]]:
    """A chunk as server steps of at most ``longest`` tokens: the chunk itself, or consecutive
    chunks whose lookahead tokens overlap the next one's start (how a stream is fed), their new
    tokens split as evenly as possible."""
    n = int(tokens.shape[0])
    if n <= longest:
        return [(tokens, last)]
    new = n if last else n - lookahead
    count = -(-new // (longest - lookahead))
    sizes = [new // count + (i < new % count) for i in range(count)]
    out, start = [], 0
    for i, size in enumerate(sizes):
        final = i == count - 1
        stop = n if final else start + size + lookahead
        out.append((tokens[start:stop], last and final))
        start += size
    return out


# ---------------------------------------------------------------------------------------- backend
class TorchCfmBatchedToken2Wav:
    """vLLM-Omni's ``BatchedToken2Wav`` contract served by a torch_cfm :class:`Token2wavServer`.

    Built by :func:`apply_torch_cfm_to_vllm_omni`, which installs its three methods on the backend
    (module docstring: lifecycle and fallbacks).

    Attributes:
        server: the :class:`Token2wavServer` (one stream per request).
        options: the :class:`Options`.
        stats: ``setups`` / ``decodes`` (calls served), ``fallback_setups`` / ``fallback_rows``
            (requests and rows the original methods served), ``closed`` (streams closed),
            ``captures_after_warmup`` (CUDA graphs captured after :meth:`warmup`: 0 when it covered
            the workload).
    """

    def __init__(self, backend: Any, server: Any, options: Options) -> None:
        self.server, self.options = server, options
        self._backend = weakref.ref(backend)  # the backend owns this object: no cycle
        self._cls = type(backend)
        self._state_cls = _state_class(state_base(self._cls))
        self._silence = int(getattr(sys.modules.get(self._cls.__module__), "_SILENCE_TOKEN", SILENCE_TOKEN))
        self._token = next(_ADAPTER_IDS)
        self._ids = itertools.count()
        self._records: dict[int, _Record] = {}
        self._dropped = _Dropped()
        self._graphs_seen: Optional[dict] = None
        self.stats = {"setups": 0, "decodes": 0, "fallback_setups": 0, "fallback_rows": 0, "closed": 0,
                      "captures_after_warmup": 0}

    # ------------------------------------------------------------------ the backend contract
    def setup_batch(self, features: Any, batch_size: int) -> list:
        """``batch_size`` new requests with the voice prompt ``features`` (a ``PromptFeatures``:
        speech_tokens (1, P_tok), speaker_embedding (1, E), mels (1, P, 80)): each a stream with
        its prompt state set now (the prompt solved once, copied into every stream). Returns
        their initial states.

        Raises:
            ValueError: ``batch_size`` is not a non-negative int.
            AdmissionError (a RuntimeError): ``max_streams`` or ``max_memory_bytes`` is reached.
        """
        op = "BatchedToken2Wav.setup_batch (torch_cfm)"
        self._drain()
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 0:
            fail(op, "batch_size", "be a non-negative int", repr(batch_size))
        prompt = self._prompt(features)
        if isinstance(prompt, str):
            log_once(f"prompt:{prompt.split(':')[0]}", f"{op}: requests fall back to vLLM-Omni's own path: {prompt}")
            self.stats["fallback_setups"] += batch_size
            return self._original("setup_batch")(features, batch_size)
        if batch_size == 0:
            return []
        tokens, mel, spk = prompt
        ids = [next(self._ids) for _ in range(batch_size)]
        # one voice for the call: its prompt is solved once and copied into every other stream
        voice = None if self.server.cfm_server.voices is not None else ("setup_batch", self._token, ids[0])
        with serving_context():
            self.server.open_many({sid: (tokens, mel, spk, self._seed(), True, voice) for sid in ids})
        for sid in ids:
            self._records[sid] = _Record(version=0)
        self.stats["setups"] += 1
        self._note_captures()
        return [self._new_state(sid, 0) for sid in ids]

    def decode_batch(self, tokens: torch.Tensor, features: Any, states: Sequence, *, last_chunk: bool,
                     flush_encoder: bool = False) -> tuple[list, list]:
        """One chunk per row: ``tokens`` (B, n) ints (the stage's 3 context tokens + new ones; the
        last 3 are the encoder's lookahead unless ``last_chunk``). Returns ([audio (samples,)
        float32] per row, [next state] per row). A torch_cfm state carries its stream's prompt:
        ``features`` is used for the original's rows only.

        Raises:
            ValueError: row/state counts differ, a state is stale, finished or another backend's,
                ``flush_encoder`` without ``last_chunk`` on a torch_cfm state, a chunk too short
                for the server (the message names it).
        """
        op = "BatchedToken2Wav.decode_batch (torch_cfm)"
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
            fail(op, "tokens", "be a (B, n) integer tensor", type(tokens).__name__ if not isinstance(
                tokens, torch.Tensor) else str(tuple(tokens.shape)))
        if tokens.shape[0] != len(states):
            fail(op, "states", f"hold one state per row of tokens ({tokens.shape[0]})", str(len(states)))
        rows = [(tokens[b], bool(last_chunk)) for b in range(tokens.shape[0])]

        def original(idx: list[int]):
            pick = torch.tensor(idx, device=tokens.device)
            return self._original("decode_batch")(tokens.index_select(0, pick), features, [states[i] for i in idx],
                                                  last_chunk=last_chunk, flush_encoder=flush_encoder)

        if flush_encoder and not last_chunk and any(self.owns(s) for s in states):
            fail(op, "flush_encoder", "be False for torch_cfm states unless last_chunk", "True",
                 "a Token2wavServer stream ends its encoder and vocoder together: pass last_chunk=True")
        return self._decode(op, rows, states, original)

    def decode_ragged_batch(self, tokens: Sequence[torch.Tensor], features: Any, states: Sequence, *,
                            last_chunks: Sequence[bool]) -> tuple[list, list]:
        """:meth:`decode_batch` with a chunk of its own length and last flag per row, all in one
        server step."""
        op = "BatchedToken2Wav.decode_ragged_batch (torch_cfm)"
        if not (len(tokens) == len(states) == len(last_chunks)):
            fail(op, "tokens, states and last_chunks", "have the same length",
                 f"{len(tokens)}, {len(states)} and {len(last_chunks)}")
        rows = [(torch.as_tensor(t).reshape(-1), bool(last)) for t, last in zip(tokens, last_chunks)]

        def original(idx: list[int]):
            return self._original("decode_ragged_batch")([tokens[i] for i in idx], features,
                                                         [states[i] for i in idx],
                                                         last_chunks=[last_chunks[i] for i in idx])

        return self._decode(op, rows, states, original)

    # ------------------------------------------------------------------ lifecycle
    def owns(self, state: Any) -> bool:
        """Whether ``state`` is one of this backend's torch_cfm states."""
        return isinstance(state, self._state_cls) and state.owner == self._token

    @property
    def open_streams(self) -> int:
        """Requests with a live stream (a slot and its caches)."""
        self._drain()
        return len(self._records)

    def release(self, states: Optional[Sequence] = None) -> int:
        """Close the streams of ``states`` now (None: every open stream); returns how many closed.
        Their states (and any older one) then raise ValueError if decoded."""
        self._drain()
        sids = list(self._records) if states is None else [s.stream for s in states if self.owns(s)]
        closed = 0
        for sid in sids:
            if self._records.pop(sid, None) is not None:
                closed += self._close(sid)
        return closed

    def close(self) -> None:
        """Close every stream and drop the server (its arenas and graph pools are freed)."""
        self.release()
        self.server = None

    def _close(self, sid: int) -> int:
        if self.server is not None and sid in self.server.open_streams:
            self.server.close_stream(sid)
            self.stats["closed"] += 1
            return 1
        return 0

    def _drain(self) -> None:
        """Close the streams whose newest state was dropped (queued by the states' finalizers)."""
        items = self._dropped.items
        while items:
            sid, version = items.popleft()
            rec = self._records.get(sid)
            if rec is not None and rec.version == version:
                del self._records[sid]
                self._close(sid)

    def _new_state(self, sid: int, version: int) -> Any:
        state = self._state_cls(flow_cache={}, hift_cache={}, stream=sid, version=version, owner=self._token)
        weakref.finalize(state, _state_dropped, weakref.ref(self._dropped), sid, version)
        return state

    # ------------------------------------------------------------------ decoding
    def _decode(self, op: str, rows: list, states: Sequence, original: Callable) -> tuple[list, list]:
        self._drain()
        ours = [i for i, s in enumerate(states) if self.owns(s)]
        foreign = [i for i, s in enumerate(states) if is_torch_cfm_state(s) and i not in ours]
        if foreign:
            fail(op, f"states[{foreign[0]}]", "come from this backend",
                 "a torch_cfm state of another (or an undone) one")
        self._check_states(op, [(i, states[i]) for i in ours])
        audios: list = [None] * len(rows)
        new: list = [None] * len(rows)
        theirs = [i for i in range(len(rows)) if i not in set(ours)]
        if theirs:  # the original's own states (set up before apply, or a fallen-back prompt)
            self.stats["fallback_rows"] += len(theirs)
            got_audio, got_states = original(theirs)
            for i, audio, state in zip(theirs, got_audio, got_states):
                audios[i], new[i] = audio, state
        if ours:
            wavs = self._run({states[i].stream: rows[i] for i in ours})
            for i in ours:
                sid, last = states[i].stream, rows[i][1]
                rec = self._records[sid]
                rec.version += 1
                audios[i] = wavs[sid]
                new[i] = self._new_state(sid, rec.version)
                if last:  # the stream takes no more chunks: its slot is free now
                    del self._records[sid]
                    self._close(sid)
            self.stats["decodes"] += 1
            self._note_captures()
        return audios, new

    def _check_states(self, op: str, items: list) -> None:
        seen = set()
        for i, state in items:
            rec = self._records.get(state.stream)
            if rec is None:
                fail(op, f"states[{i}]", "belong to an open request", "a finished or released request's state",
                     "start the request again with setup_batch")
            if rec.failed is not None:
                fail(op, f"states[{i}]", "belong to a request whose stream is intact",
                     f"a request whose earlier decode failed ({rec.failed})", "start the request again")
            if state.version != rec.version:
                fail(op, f"states[{i}]", "be the state the request's last decode returned",
                     f"a state {rec.version - state.version} chunk(s) old", "a state is consumed by one decode")
            if state.stream in seen:
                fail(op, f"states[{i}]", "name each request once", "a request given twice")
            seen.add(state.stream)

    def _run(self, items: dict) -> dict:
        """{stream: (tokens 1-D, last)} through the server: one step per piece round; returns
        {stream: audio (samples,) float32}."""
        lookahead = self.server.lookahead
        plans = {sid: _pieces(t, last, self.options.max_chunk_tokens, lookahead) for sid, (t, last) in items.items()}
        wavs: dict = {sid: [] for sid in plans}
        rounds = max(len(p) for p in plans.values())
        for r in range(rounds):
            chunk = {sid: plan[r] for sid, plan in plans.items() if r < len(plan)}
            try:
                with serving_context():
                    out = self.server.step(chunk)
            except ValueError:
                if r == 0:  # refused before any stream moved: the states stay usable
                    raise
                self._fail(plans, "a chunk piece was refused")
                raise
            except BaseException as exc:  # the streams are part-way through a step
                self._fail(plans, f"{type(exc).__name__}: {str(exc)[:120]}")
                raise
            for sid, res in out.items():
                wavs[sid].append(res.wav)
        return {sid: (w[0] if len(w) == 1 else torch.cat(w)).reshape(-1).to(torch.float32) for sid, w in wavs.items()}

    def _fail(self, sids, why: str) -> None:
        for sid in sids:
            rec = self._records.get(sid)
            if rec is not None:
                rec.failed = why
                self._close(sid)

    # ------------------------------------------------------------------ helpers
    def _original(self, name: str) -> Callable:
        """The backend class's own method, bound to the backend (a platform patch of the class
        included)."""
        backend = self._backend()
        if backend is None:
            raise ReferenceError("TorchCfmBatchedToken2Wav: its backend is gone")
        return getattr(self._cls, name).__get__(backend, self._cls)

    def _prompt(self, features: Any):
        """(tokens (1, P_tok + lookahead), mel (1, P, 80), spk (1, E)) of a PromptFeatures, or why
        torch_cfm does not take it."""
        tokens = getattr(features, "speech_tokens", None)
        mel = getattr(features, "mels", None)
        spk = getattr(features, "speaker_embedding", None)
        if not all(isinstance(t, torch.Tensor) for t in (tokens, mel, spk)) or tokens.dim() != 2 or mel.dim() != 3 \
                or tokens.shape[0] != 1 or mel.shape[0] != 1:
            return ("unknown layout: prompt features are not speech_tokens (1, P_tok), mels (1, P, 80), "
                    "speaker_embedding")
        frames = int(mel.shape[1])
        if frames != tokens.shape[1] * self.server.up_rate:
            return f"unknown layout: a prompt of {frames} mel frames for {tokens.shape[1]} tokens"
        if frames > self.options.max_prompt_frames:
            return (f"prompt too long: {frames} mel frames > max_prompt_frames={self.options.max_prompt_frames} "
                    "(raise it with the option of that name)")
        pad = torch.full((1, self.server.lookahead), self._silence, dtype=tokens.dtype, device=tokens.device)
        return torch.cat([tokens, pad], dim=1), mel, spk

    def _seed(self) -> int:
        if self.options.vocoder_seed is not None:
            return self.options.vocoder_seed
        return int(torch.randint(0, 2 ** 62, (1,)).item())

    def _note_captures(self) -> None:
        if self._graphs_seen is None:
            return
        counts = self.server.graph_counts()
        new = sum(max(0, counts[k] - self._graphs_seen.get(k, 0)) for k in counts)
        if new:
            self.stats["captures_after_warmup"] += new
            log_once("captures_after_warmup", f"{new} CUDA graph(s) captured after the warm-up ({counts}): the "
                     "workload meets shapes the warm-up did not cover (see Options.warmup_last_chunk_tokens)")
            self._graphs_seen = counts

    # ------------------------------------------------------------------ start-up
    def warmup(self, *, prompt_frames: Optional[Sequence[int]] = None, chunk_tokens: Optional[Sequence[int]] = None,
               last_chunk_tokens: Optional[Sequence[int]] = None, stream_counts: Optional[Sequence[int]] = None,
               progress: Optional[bool] = None) -> dict:
        """Run every shape the Code2Wav stage can produce now (kernels compiled, graphs captured),
        one progress line per stream count; afterwards ``stats["captures_after_warmup"]`` counts
        what a later call still captures.

        Defaults: prompts of ``max_prompt_frames`` (every reference is folded to one length), chunks
        of ``max_chunk_tokens``, last chunks of every length in [lookahead, max_chunk_tokens] (or
        ``Options.warmup_last_chunk_tokens``), the server's slot buckets as stream counts.
        Returns {"seconds", "graphs", **:meth:`memory_report`}.
        Raises:
            RuntimeError: requests are open (warm up at stage start).
        """
        if self._records:
            raise RuntimeError(f"TorchCfmBatchedToken2Wav.warmup: {len(self._records)} requests are open; warm up "
                               "at stage start")
        loud = self.options.progress if progress is None else progress
        prompts = tuple(prompt_frames or (self.options.max_prompt_frames,))
        chunks = tuple(chunk_tokens or (self.options.max_chunk_tokens,))
        lasts = last_chunk_tokens if last_chunk_tokens is not None else self.options.warmup_last_chunk_tokens
        if lasts is None:
            lasts = range(self.server.lookahead, self.options.max_chunk_tokens + 1)
        lasts = tuple(lasts)
        buckets = self.server.cfm_server.slot_buckets or [self.options.max_streams]
        counts = list(stream_counts or sorted({1, *buckets}))
        last_text = f"{min(lasts)}-{max(lasts)} tokens ({len(lasts)} lengths)" if lasts else "none"
        say(loud, f"warm-up: prompts {list(prompts)} frames, chunks {list(chunks)} tokens, last chunks "
                   f"{last_text}, stream counts {counts}")
        start = time.perf_counter()
        for k, count in enumerate(counts):
            tick = time.perf_counter()
            with serving_context():
                self.server.warmup(prompt_frames=prompts, chunk_tokens=chunks, last_chunk_tokens=lasts,
                                   stream_counts=[count])
            say(loud, f"warm-up [{k + 1}/{len(counts)}] {count} stream(s): {time.perf_counter() - tick:.1f} s, "
                       f"graphs {self.server.graph_counts()}")
        self._graphs_seen = self.server.graph_counts()
        report = dict(seconds=round(time.perf_counter() - start, 2), graphs=dict(self._graphs_seen),
                      **self.memory_report())
        say(loud, f"warm-up done in {report['seconds']} s; {self.describe_memory(report)}")
        return report

    def memory_report(self) -> dict:
        """Memory in the stage's terms: ``bytes_per_request`` (the server's memory plan: CFM slot,
        conformer caches and vocoder caches of one request, at the configured maxima) and its
        parts, ``max_requests``, ``arena_bytes`` (the CFM arenas, allocated when the stage loads),
        ``graph_pool_bytes`` and ``reserved_bytes`` (arenas + every request's encoder and vocoder
        state at ``max_requests``)."""
        plan = self.server.memory_plan()
        cfm_plan = self.server.cfm_server.memory_plan()
        return {"bytes_per_request": plan.total, "cfm_bytes": plan.cfm, "encoder_bytes": plan.encoder,
                "vocoder_bytes": plan.vocoder, "max_requests": self.options.max_streams,
                "arena_bytes": cfm_plan.arena_bytes, "graph_pool_bytes": cfm_plan.graph_pool_bytes,
                "reserved_bytes": cfm_plan.arena_bytes + self.options.max_streams * (plan.encoder + plan.vocoder)}

    @staticmethod
    def describe_memory(report: dict) -> str:
        mib = 2 ** 20
        return (f"{report['bytes_per_request'] / mib:.1f} MiB per request (cfm {report['cfm_bytes'] / mib:.1f}, "
                f"encoder {report['encoder_bytes'] / mib:.1f}, vocoder {report['vocoder_bytes'] / mib:.2f}); "
                f"{report['reserved_bytes'] / 2 ** 30:.2f} GiB reserved for {report['max_requests']} requests "
                f"(keep the Code2Wav stage's max_num_seqs <= {report['max_requests']}), graph pools "
                f"{report['graph_pool_bytes'] / mib:.0f} MiB")
