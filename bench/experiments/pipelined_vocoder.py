"""Issue 43: tokens → waveform with the vocoder one tick behind, on a second CUDA stream (experiment;
the package runs its stages one after the other on one stream).

A :class:`~torch_cfm.serving.Token2wavServer` tick runs encoder → CFM → vocoder in order, and at 64
streams (H100) that is about 9 + 43 + 20 ms. Neither the CFM nor the vocoder fills the GPU (CFM
GEMMs at 60-77 % of peak with 3 ms idle; vocoder convolutions L2-bound at 25 % occupancy). Here
tick n issues its encoder on the main stream, then the vocoder of tick n − 1's mels on a side
stream (after tick n − 1's CFM, by event), then its CFM on the main stream; the main stream waits
for the side stream at the end of the tick. A stream's waveform arrives one tick after its mel.
Its waveform is the same as the sequential server's: the vocoder stage sees the same mels, in the
same order, with the same per-stream random streams.

``PipelinedSteps`` drives a server's stages directly (its own ``step``, ``close`` and ``flush``);
:class:`TorchCfmPipelinedProvider` puts it under ``bench/serving.py`` as provider
``torch_cfm/pipelined`` (stage ``wav``). The A/B against the sequential front, one process, one GPU:

    python3 bench/experiments/pipelined_vocoder.py --stages wav --concurrency 16,64 --quick --warmup \
        --dtype fp16 --providers torch_cfm,torch_cfm/pipelined --out "$OUT"
    python3 bench/experiments/pipelined_vocoder.py --check     # CPU: waveforms equal the sequential server's

Measured (H100, 64 streams): +1.2 % steady audio-s/s, not worth a tick of latency; ``stage_overlap.md``.
"""

from __future__ import annotations

import os
import sys
from typing import Hashable, Mapping

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]

import torch  # noqa: E402

from torch_cfm.serving import token2wav_streams as _streams  # noqa: E402
from torch_cfm.serving.token2wav import ChunkOutput  # noqa: E402


class PipelinedSteps:
    """Ticks of ``server`` with its vocoder one tick behind (module docstring).

    ``step(chunks)`` returns {stream: ChunkOutput} for this tick's chunks, each with its mel, and
    ``wav`` set on the outputs of the previous tick (returned then, filled now: the caller keeps
    them). ``close(sid)`` waits for the stream's pending waveform; ``flush()`` vocodes what is
    pending. The waveforms are allocated on the side stream and safe to read on the main stream
    after ``step`` returns; kept across later ticks unsynchronised they would need ``record_stream``.
    """

    def __init__(self, server) -> None:
        self.server = server
        self.cuda = server.device.type == "cuda"
        self.side = torch.cuda.Stream(server.device) if self.cuda else None
        self.pending: list = []  # [(sid, mel, last, ChunkOutput)] of the previous tick
        self.ready_event = None
        self.closing: list = []

    def _vocode_pending(self) -> None:
        server, items = self.server, self.pending
        self.pending = []
        if not items:
            return
        voc = [(sid, mel, last) for sid, mel, last, _ in items]
        if self.cuda:
            self.side.wait_event(self.ready_event)
            with torch.cuda.stream(self.side):
                wavs = server.vocoder(voc)
            for _, mel, _ in voc:
                mel.record_stream(self.side)
        else:
            wavs = server.vocoder(voc)
        for sid, _, _, out in items:
            out.wav = wavs[sid]

    def step(self, chunks: Mapping[Hashable, object]) -> dict:
        server = self.server
        staged = _streams.check_chunks(server, "PipelinedSteps.step", chunks)
        with server._context():
            run = [s for s in staged if s[1] is not None]
            mus = server.encoder(run) if run else {}
            for sid, tokens, last in staged:
                st = server._streams[sid]
                st.done = last
                st.chunks += tokens is not None
            self._vocode_pending()  # tick n - 1's vocoder under this tick's CFM
            self._close_deferred()
            mels = server.cfm_server.solve_chunk({sid: mus[sid] for sid, *_ in run}) if run else {}
            for sid, tokens, _ in staged:
                if tokens is None:
                    mels[sid] = torch.zeros(server.flow.output_size, 0, dtype=server.dtype, device=server.device)
            out = {sid: ChunkOutput(mels[sid], None, last) for sid, _, last in staged}
            self.pending = [(sid, mels[sid], last, out[sid]) for sid, _, last in staged
                            if server._streams[sid].waveform]
            if self.cuda:
                self.ready_event = torch.cuda.Event()
                self.ready_event.record()
                torch.cuda.current_stream().wait_stream(self.side)
        return out

    def close(self, sid: Hashable) -> None:
        """The stream's encoder and CFM slots are freed now (a new stream may take them this tick);
        its vocoder state after its last waveform, next tick."""
        server = self.server
        if not any(p[0] == sid for p in self.pending):
            server.close_stream(sid)
            return
        server.cfm_server.close_request(sid)
        del server._streams[sid]
        server.encoder.close(sid)
        self.closing.append(sid)

    def _close_deferred(self) -> None:
        for sid in self.closing:
            self.server.vocoder.close(sid)
        self.closing = []

    def flush(self) -> None:
        with self.server._context():
            self._vocode_pending()
            self._close_deferred()
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.side)


def _provider():
    import serving as S

    class TorchCfmPipelinedProvider(S.TorchCfmProvider):
        """The front with its vocoder one tick behind on a second CUDA stream (stage wav)."""

        name = "torch_cfm/pipelined"

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.pipe = PipelinedSteps(self.server) if self.stage == "wav" else None

        def step(self, ids) -> dict:
            if self.pipe is None:
                return super().step(ids)
            import time
            t0 = time.perf_counter()
            ids = self.ready(ids)
            self.pipe.step({sid: self.inputs.chunk(sid, self.done[sid]) for sid in ids})
            S._sync(str(self.server.device.type))
            dt = time.perf_counter() - t0
            for sid in ids:
                self.done[sid] += 1
            return {sid: dt for sid in ids}

        def close(self, sid):
            if self.pipe is None:
                return super().close(sid)
            self.pipe.close(sid)
            del self.done[sid]

    return TorchCfmPipelinedProvider


def check() -> None:
    """CPU: every stream's mels and waveforms through PipelinedSteps equal the sequential server's,
    bitwise (tiny stepaudio2 modules, three streams opened at different ticks, chunk counts 5 / 4 / 3,
    each ending with a flagged last chunk)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests"))
    import token2wav_reference as R
    import upstream_flow as U
    from torch_cfm.serving import StreamPrompt, Token2wavServer

    flow, hift = U.build_flow(U.TINY, seed=0), R.build_hift(seed=3)
    prompts = {s: U.make_prompt(U.TINY, p, seed=10 + i) for i, (s, p) in enumerate((("a", 20), ("b", 13), ("c", 16)))}
    chunks = {s: U.make_chunks(U.TINY, n, seed=20 + i, last_tokens=7)
              for i, (s, n) in enumerate((("a", 5), ("b", 4), ("c", 3)))}
    plan = {"a": (0, 1), "b": (0, 2), "c": (2, 3)}
    results = []
    for pipelined in (False, True):
        server = Token2wavServer(flow, hift, max_streams=3, max_prompt_frames=80, n_timesteps=4)
        pipe = PipelinedSteps(server) if pipelined else None
        got = {s: ([], []) for s in plan}
        outs = {s: [] for s in plan}
        for tick in range(10):
            opening = {s: StreamPrompt(prompts[s].tokens, prompts[s].mel, prompts[s].spk, seed=seed)
                       for s, (at, seed) in plan.items() if at == tick}
            if opening:
                server.open_many(opening)
            batch = {s: (chunks[s][len(outs[s])], len(outs[s]) == len(chunks[s]) - 1)
                     for s in server.open_streams if len(outs[s]) < len(chunks[s])}
            for s, o in (pipe.step(batch) if pipe else server.step(batch)).items():
                outs[s].append(o)
            for s in server.open_streams:
                if len(outs[s]) == len(chunks[s]):
                    (pipe.close if pipe else server.close_stream)(s)
        if pipe:
            pipe.flush()
        for s in plan:
            got[s] = ([o.mel for o in outs[s]], [o.wav for o in outs[s]])
        results.append(got)
    for s in plan:
        for kind, a, b in (("mel", results[0][s][0], results[1][s][0]), ("wav", results[0][s][1], results[1][s][1])):
            assert len(a) == len(b) == len(chunks[s]), (s, kind, len(a), len(b))
            for i, (x, y) in enumerate(zip(a, b)):
                assert y is not None and x.shape == y.shape and torch.equal(x, y), (s, kind, i)
    print("check: mels and waveforms bitwise equal, 3 streams, 12 chunks")


if __name__ == "__main__":
    if "--check" in sys.argv:
        check()
        raise SystemExit(0)
    sys.path.insert(0, os.path.dirname(HERE))
    import serving as S

    S.PROVIDERS["torch_cfm/pipelined"] = _provider()
    S.main(sys.argv[1:])
