"""torch_cfm against minicpmo-utils 1.0.7 (the ``stepaudio2`` package MiniCPM-o 4.5 requires).

minicpmo-utils installs the same top-level ``stepaudio2`` as stepaudio2-minicpmo 0.1.1 (tested in
``test_integration_stepaudio2.py``), so its tests run in their own interpreter
(``tests/upstream_packages.py``): in the main session this module holds two tests (its CPU
tests, and its ``gpu``-marked ones), each running the module again in a child interpreter whose
``stepaudio2`` is ``.upstream/minicpmo-utils/stepaudio2`` (``python3 -m pip install -q --no-deps
--target .upstream/minicpmo-utils minicpmo-utils==1.0.7``; skipped with that command as the
reason when the folder is missing); a failure in the child fails it, with the child's output.
To run the child directly: ``UPSTREAM_PACKAGE=minicpmo-utils STEPAUDIO2_PATH=.upstream/minicpmo-utils
python3 -m pytest tests/test_minicpmo_utils.py``.

In the child, the package's own classes (``Token2wav``, ``BoundedVocoder``, ``CausalHiFTGenerator``,
the flow) at small sizes with random weights, on CPU in fp32:

* the causal vocoder's chunk step (:mod:`torch_cfm.models.vocoder.causal`) equals
  ``BoundedVocoder.stream`` over ragged chunks, a flush, a wrap of the noise table and the
  finalized-stream rules: state bitwise, samples (one decoder pass per chunk, not per block)
  within 2x the upstream fp32 error against its float64 stream + 1e-6; batched over streams it
  equals each stream alone (the same bounds);
* ``Token2wav.set_stream_cache`` / ``stream`` (its trims, its first-chunk silence, a last chunk)
  and ``__call__`` after ``apply_torch_cfm``: mel within 1e-5 relative of the upstream's (docs/design.md §6);
  the waveform equals the package's own vocoder run on the same mel within 2e-6 (a 1e-6 mel difference
  grows through the causal vocoder's float64 phase, so the end-to-end waveforms are compared
  loosely only); ``undo_torch_cfm`` gives the upstream results bitwise.

GPU (``@pytest.mark.gpu``): the same step replayed from CUDA graphs, batched, and the whole
``Token2wav.stream`` after ``apply_torch_cfm`` + ``warmup`` on CUDA.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import numbers
import os
import types
from dataclasses import dataclass

import pytest
import torch

import upstream_packages as P
import upstream_flow as U
from oracle import err_rel_fro

NAME = "minicpmo-utils"
CHILD = P.active() == NAME
in_child = P.isolated(NAME)
pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:CUDA is not available:UserWarning")]  # Token2wav's autocast("cuda")

REL = 1e-5  # docs/design.md §6 fp32 bound, relative Frobenius
HOP = 480


def _run_child(marker: str, **env: str) -> None:
    P.run_child_session(NAME, __file__, marker, **env)


def test_minicpmo_utils_cpu_tests_in_their_own_interpreter():
    _run_child("not gpu", TRITON_INTERPRET="1")  # the fused decode's Triton kernels on the CPU


@pytest.mark.gpu
def test_minicpmo_utils_gpu_tests_in_their_own_interpreter():
    _run_child("gpu")


test_minicpmo_utils_cpu_tests_in_their_own_interpreter.__test__ = not CHILD
test_minicpmo_utils_gpu_tests_in_their_own_interpreter.__test__ = not CHILD


# ---------------------------------------------------------------------------- fixtures (child only)
@pytest.fixture(scope="module")
def mods():
    reason = P.missing_reason(NAME)
    if reason is not None:
        pytest.skip(reason)
    return P.load_minicpmo_token2wav()


@pytest.fixture(scope="module")
def hift(mods):
    # a 20 s noise table (the upstream's 300 s one is 259 MB, copied by every deepcopy): longer
    # than these streams; the wrap-around is tested on its own
    return P.build_causal_hift(mods, seed=0, table_samples=20 * 24000)


@pytest.fixture(scope="module")
def flow(mods):
    return U.build_flow(U.TINY, seed=0)


def _mel(frames: int, seed: int, batch: int = 1) -> torch.Tensor:
    """Log-mel-like input: N(-4, 2²)."""
    return 2 * torch.randn(batch, 80, frames, generator=torch.Generator().manual_seed(seed)) - 4


def _upstream_stream(mods, hift, mel, schedule):
    """``BoundedVocoder.stream`` over ``schedule`` (frames per call, the last call finalizes)."""
    bounded = mods.BoundedVocoder(copy.deepcopy(hift))
    outs, pos = [], 0
    for i, frames in enumerate(schedule):
        outs.append(bounded.stream(mel[:, :, pos:pos + frames], finalize=i == len(schedule) - 1))
        pos += frames
    return outs, bounded


# ---------------------------------------------------------------------------- isolation and the package
@in_child
def test_the_package_is_loaded_in_isolation(mods):
    assert P.check_isolated(NAME) == []
    assert mods.token2wav.__file__.startswith(os.path.realpath(P.folder(NAME)))
    assert mods.BoundedVocoder.__module__ == "stepaudio2.causal_vocoder.bounded_vocoder"


@in_child
def test_its_flow_modules_are_stepaudio2_minicpmos_and_the_encoder_is_compiled(mods, flow):
    """The flow, DiT and CFM files are byte for byte 0.1.1's (when 0.1.1 is installed), so the
    decoder integration applies unchanged; the encoder's forward_chunk is a Dynamo wrapper."""
    from torch_cfm.integrations.minicpmo import encoder_forward_chunk

    enc = flow.encoder
    wrapped = type(enc).forward_chunk
    assert hasattr(wrapped, "_torchdynamo_orig_callable")
    assert encoder_forward_chunk(enc).__func__ is wrapped._torchdynamo_orig_callable
    try:
        old = importlib.metadata.distribution("stepaudio2-minicpmo")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("stepaudio2-minicpmo 0.1.1 is not installed: nothing to compare with")
    for rel in ("cosyvoice2/flow/flow.py", "cosyvoice2/flow/flow_matching.py", "cosyvoice2/flow/decoder_dit.py"):
        with open(old.locate_file(f"stepaudio2/{rel}"), "rb") as a, \
                open(os.path.join(P.folder(NAME), "stepaudio2", rel), "rb") as b:
            assert a.read() == b.read(), rel


# ---------------------------------------------------------------------------- the causal step
@in_child
@pytest.mark.parametrize("ending, f0_convs", [("last chunk", "library"), ("empty flush", "library"),
                                              ("last chunk", "dgemm")])
def test_causal_step_equals_bounded_vocoder_stream(mods, ending, f0_convs, monkeypatch):
    """Ragged chunks (a partial block, a 1-frame chunk, an empty non-final call), then a last
    chunk with frames or the empty final call (``Token2wav.stream`` without tokens), over a noise
    table shortened to 2 s so the ~400-frame stream wraps it twice: the state bitwise the
    upstream's; the samples (one decoder pass per chunk, not one per block) within 2x the
    upstream fp32 error against its float64 stream + 1e-6. "dgemm": f0's float64 convolutions as
    matrix products (``f64_gemm``, the CUDA default) and still the state bitwise."""
    import functools

    import torch_cfm.models.vocoder.causal as causal
    from torch_cfm.integrations.minicpmo import CausalVocoderStream

    if f0_convs == "dgemm":
        monkeypatch.setattr(causal, "capturable_causal", functools.partial(causal.capturable_causal, f64_gemm=True))

    model = P.build_causal_hift(mods, seed=1, table_samples=2 * 24000)
    schedule = [50, 50, 16, 0, 33, 1, 50, 7, 50, 50] + ([93] if ending == "last chunk" else [43, 0])
    mel = _mel(sum(schedule), seed=2)
    ref, bounded = _upstream_stream(mods, model, mel, schedule)
    ref64, _ = _upstream_stream(mods, copy.deepcopy(model).double(), mel.double(), schedule)
    ours = mods.BoundedVocoder(copy.deepcopy(model))
    voc = CausalVocoderStream(ours, graphs=False)
    pos = 0
    for i, (frames, expected, exact) in enumerate(zip(schedule, ref, ref64)):
        out = voc.stream(mel[:, :, pos:pos + frames], finalize=i == len(schedule) - 1)
        pos += frames
        assert out.dtype == expected.dtype and out.shape == expected.shape, f"call {i}"
        if exact.numel():
            bound = 2 * err_rel_fro(expected, exact) + 1e-6
            assert err_rel_fro(out, exact) <= bound, f"call {i}: {err_rel_fro(out, exact):.2e} > {bound:.2e}"
            assert err_rel_fro(out, expected) <= 2e-6, f"call {i}"  # the decoder's rounding (~6e-7)
    assert sum(r.shape[1] for r in ref) == sum(schedule) * HOP and ref[-1].std() > 0.01
    for key, value in bounded.cache.items():
        assert torch.equal(ours.cache[key], value), key
    assert ours.maxima == bounded.maxima
    # the finalized stream: frames or a non-final call are refused, a flush returns nothing
    with pytest.raises(ValueError, match=r"stream_batch: states\[0\] must not be finalized.*BoundedVocoder\.reset"):
        voc.stream(_mel(5, seed=3))
    assert voc.stream(mel[:, :, :0], finalize=True).shape == (1, 0)
    with pytest.raises(ValueError, match=r"stream_batch: mels\[0\] must have shape \(1, 80, T\), got \(1, 40, 5\)"):
        voc.stream(torch.zeros(1, 40, 5))


@in_child
def test_the_models_folded_parts_leave_its_decode_and_f0_bitwise(mods, hift):
    """Inside ``capturable_causal`` the causal convolutions run on weights whose weight norm was
    folded once (a missing cache padded on the device) and each Snake on parameters made once:
    on the CPU the same ops on the same values, so ``decode`` and the f0 predictor equal the
    upstream's bitwise; every weight-normed causal convolution and every Snake is covered, and
    on exit the model runs its own modules again."""
    from torch_cfm.models.vocoder.causal import CausalModelParts, capturable_causal

    model = mods.BoundedVocoder(copy.deepcopy(hift)).model  # its f0 predictor in float64, as it runs
    parts = CausalModelParts.of(model)
    normed = [m for m in model.modules() if isinstance(m, torch.nn.Conv1d) and hasattr(m, "parametrizations")
              and isinstance(getattr(m, "causal_padding", None), numbers.Integral)]  # causal, upsampling, strided
    assert len(normed) >= 10 and {id(m) for m in normed} <= {id(c) for c, _ in parts.convs}
    kinds = {type(m).__name__.removeprefix("Parametrized") for m, _ in parts.convs}
    assert kinds == {"CausalConv1d", "CausalConv1dUpsample", "CausalConv1dDownSample"}, kinds
    assert len(parts.snakes) == sum(type(m).__name__ == "Snake" for m in model.modules()) >= 6
    folded = [w for c, w in parts.convs if hasattr(c, "parametrizations")]  # float32: 4 bytes an element
    assert parts.extra_bytes() >= 4 * sum(w.numel() for w in folded) > 0
    mel = _mel(40, seed=7)
    source = torch.randn(1, 1, 40 * HOP, generator=torch.Generator().manual_seed(8)) * 0.1
    with torch.no_grad():
        expected = model.decode(mel, source, finalize=False)
        f0 = model.f0_predictor(mel.double(), finalize=False)
        with capturable_causal(model, model.stft_window, parts):
            assert all("forward" in vars(m) for m, _ in parts.convs)
            out = model.decode(mel, source, finalize=False)
            f0_out = model.f0_predictor(mel.double(), finalize=False)
        assert not any("forward" in vars(m) for m in model.modules())
    assert torch.equal(out, expected) and torch.equal(f0_out, f0)


@in_child
@pytest.mark.parametrize("finalize", [True, False])
def test_the_fused_decode_is_within_the_upstream_fp32_error(mods, hift, finalize):
    """``FusedCausalDecode`` (the causal core's decode on CUDA at TF32; here IEEE operands in
    Triton's interpreter): 2 streams x 12 frames, finalizing (``conv_pre`` padded on the right)
    and not (the lookahead consumed, the last frame held back): the upstream decode's shape, and
    within 2x its float32 error against its float64 decode + 1e-6."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1 before import; the launcher sets it)")
    from torch_cfm.models.vocoder.causal_decode import FusedCausalDecode

    model = mods.BoundedVocoder(copy.deepcopy(hift)).model  # its f0 predictor in float64, as it runs
    exact = copy.deepcopy(model).double()
    mel = _mel(12, seed=9, batch=2)
    source = torch.randn(2, 1, 12 * HOP, generator=torch.Generator().manual_seed(10)) * 0.1
    with torch.no_grad():
        ref64 = exact.decode(mel.double(), source.double(), finalize=finalize)
        up32 = model.decode(mel, source, finalize=finalize)
    out = FusedCausalDecode(model, kernels="triton").decode(mel, source, finalize)
    assert out.dtype == torch.float32 and out.shape == ref64.shape == up32.shape
    bound = 2 * err_rel_fro(up32, ref64) + 1e-6
    assert err_rel_fro(out, ref64) <= bound, f"{err_rel_fro(out, ref64):.2e} > {bound:.2e}"


@in_child
def test_the_core_decodes_fused_only_where_asked_and_where_it_runs(mods, hift):
    """``CausalVocoderCore(decoder=...)``: "auto" (the default) keeps the model's decode off
    CUDA, as "upstream" does; "fused" asks for :class:`FusedCausalDecode` (its Triton kernels, the
    interpreter's on the CPU); a float64 core or an unknown choice is refused with a ValueError
    naming the argument. (On CUDA "auto" is "fused" at TF32: the GPU tests below.)"""
    from torch_cfm.models.vocoder.causal import CausalVocoderCore

    bounded = mods.BoundedVocoder(copy.deepcopy(hift))
    assert CausalVocoderCore(bounded).fused is None
    assert CausalVocoderCore(bounded, decoder="upstream").fused is None
    assert CausalVocoderCore(bounded, decoder="fused").fused is not None
    with pytest.raises(ValueError, match=r"CausalVocoderCore: decoder must be .*float64"):
        CausalVocoderCore(mods.BoundedVocoder(copy.deepcopy(hift).double()), dtype=torch.float64, decoder="fused")
    with pytest.raises(ValueError, match=r"CausalVocoderCore: decoder must be \"auto\", \"upstream\" or \"fused\""):
        CausalVocoderCore(bounded, decoder="cudnn")


@in_child
def test_convolutions_that_pad_themselves_keep_decode_within_rounding(mods, hift):
    """``implicit_pad`` (the CUDA default outside float64): each causal, upsampling and strided
    convolution pads itself and keeps the frames its causal padding gives. The decode stays within
    float32 rounding of a float64 decode (the upstream's own float32 error, doubled, + 1e-6); the
    default on the CPU pads explicitly, so f0 stays bitwise (float64 on CUDA runs as DGEMMs, the
    next test)."""
    from torch_cfm.models.vocoder.causal import capturable_causal

    model = mods.BoundedVocoder(copy.deepcopy(hift)).model
    exact_model = copy.deepcopy(model).double()
    mel = _mel(40, seed=9)
    source = torch.randn(1, 1, 40 * HOP, generator=torch.Generator().manual_seed(10)) * 0.1
    with torch.no_grad():
        expected = model.decode(mel, source, finalize=False)
        exact = exact_model.decode(mel.double(), source.double(), finalize=False)
        f0 = model.f0_predictor(mel.double(), finalize=False)
        with capturable_causal(model, model.stft_window, implicit_pad=True):
            out = model.decode(mel, source, finalize=False)
        with capturable_causal(model, model.stft_window):  # auto: the CPU pads explicitly
            f0_out = model.f0_predictor(mel.double(), finalize=False)
    assert out.shape == expected.shape
    assert err_rel_fro(out, exact) <= 2 * err_rel_fro(expected, exact) + 1e-6
    assert torch.equal(f0_out, f0)


@in_child
def test_float64_convolutions_as_matrix_products_keep_f0_within_float64_rounding(mods, hift):
    """``f64_gemm`` (the CUDA default): each float64 causal convolution is one matrix product over
    (C_in · taps). The f0 predictor (float64, as ``BoundedVocoder`` runs it) stays within float64
    rounding of the upstream's (1e-13 relative) and its float32 cast, what the source reads,
    equals the upstream's; a float64 decode (strided and upsampling convolutions too) stays within
    1e-13 of the same decode on library convolutions (``f64_gemm=False``)."""
    from torch_cfm.models.vocoder.causal import capturable_causal

    model = mods.BoundedVocoder(copy.deepcopy(hift)).model
    exact_model = copy.deepcopy(model).double()
    mel = _mel(40, seed=11).double()
    source = torch.randn(1, 1, 40 * HOP, generator=torch.Generator().manual_seed(12), dtype=torch.float64) * 0.1
    with torch.no_grad():
        f0 = model.f0_predictor(mel, finalize=False)
        with capturable_causal(model, model.stft_window, f64_gemm=True):
            f0_out = model.f0_predictor(mel, finalize=False)
        with capturable_causal(exact_model, exact_model.stft_window, f64_gemm=False):
            expected = exact_model.decode(mel, source, finalize=False)
        with capturable_causal(exact_model, exact_model.stft_window, f64_gemm=True):
            out = exact_model.decode(mel, source, finalize=False)
    assert f0_out.dtype == torch.float64 and err_rel_fro(f0_out, f0) <= 1e-13
    assert torch.equal(f0_out.float(), f0.float())
    assert out.shape == expected.shape and err_rel_fro(out, expected) <= 1e-13


@in_child
def test_a_stream_meets_one_plan_per_chunk_kind_and_its_state_stays_bounded(mods, hift):
    """50-frame chunks: the first chunk's plan, then one steady plan (the CUDA-graph key) for
    every later chunk, each decoded in one pass (86 frames: 31 of history, 50, 5 of lookahead;
    the upstream's four blocks decode 194), the last chunk in two (its final flush apart); the
    state between chunks is never larger than ``state_bytes``."""
    from torch_cfm.models.vocoder.causal import CausalVocoderCore, stream_batch

    core = CausalVocoderCore(mods.BoundedVocoder(copy.deepcopy(hift)))
    plans, decoded = [], []
    decode = core.model.decode

    def call(plan, *tensors):
        plans.append(plan)
        decoded.append([])
        return core.run(plan, *tensors)

    def counted(x, *args, **kwargs):
        decoded[-1].append(x.shape[2])
        return decode(x, *args, **kwargs)

    core.model.decode = counted
    state = core.new_state()
    mel = _mel(8 * 50, seed=4)
    sizes = []
    for i in range(8):
        stream_batch(core, [state], [mel[:, :, 50 * i:50 * i + 50]], [i == 7], call=call)
        sizes.append(sum(state[k].numel() * state[k].element_size() for k in ("mel", "source", "phase")))
    del core.model.decode
    assert decoded[1:7] == [[86]] * 6 and len(decoded[7]) == 2
    assert sum(step.decode[1] - step.decode[0] for step in plans[1].steps if step.decode) == 194
    assert len(set(plans[1:7])) == 1 and plans[0] != plans[1] and plans[7] != plans[1]
    assert plans[1].samples == 50 * HOP and plans[7].samples == (50 + 8) * HOP
    assert max(sizes[:7]) == core.state_bytes() == 4 * (80 * 39 + HOP * 36) + 8 * 9  # 39 mel, 36 source frames


@in_child
def test_a_16_bit_chunk_meets_the_graph_key_of_a_float32_chunk(mods, hift):
    """A float16 flow's mel chunk reaches the (graphed) step in the core's float32, so a warm-up
    on float32 mel captures the graphs a float16 stream replays; the output is the float32
    chunk's, bitwise (the step appended the chunk in float32 anyway)."""
    from torch_cfm.models.vocoder.causal import CausalVocoderCore, stream_batch

    core = CausalVocoderCore(mods.BoundedVocoder(copy.deepcopy(hift)))
    mel = _mel(100, seed=5).half()
    seen, outs = [], []
    for chunk_dtype in (torch.float16, torch.float32):
        def call(plan, *tensors):
            seen.append(tensors[3].dtype)
            return core.run(plan, *tensors)

        state = core.new_state()
        outs.append([stream_batch(core, [state], [mel[:, :, a:a + 50].to(chunk_dtype)], [a == 50], call=call)[0]
                     for a in (0, 50)])
    assert seen == [torch.float32] * 4
    assert all(torch.equal(a, b) for a, b in zip(*outs))


@in_child
def test_batched_streams_equal_each_stream_alone(mods, hift):
    """Three streams arriving on different ticks with different last chunks, batched (buckets
    1, 2, 4: padded rows) vs ``BoundedVocoder.stream`` per stream on the same mel: state bitwise;
    samples within 2x the upstream fp32 error against the float64 step + 1e-6."""
    from torch_cfm.models.vocoder.causal import CausalVocoderCore, stream_batch

    schedules = {"a": [50, 50, 50, 50, 56], "b": [50, 50, 50, 50, 50, 20], "c": [50, 50, 50, 16]}
    arrival = {"a": 0, "b": 1, "c": 0}
    mels = {k: _mel(sum(s), seed=10 + i) for i, (k, s) in enumerate(schedules.items())}
    refs = {k: _upstream_stream(mods, hift, mels[k], s) for k, s in schedules.items()}
    core64 = CausalVocoderCore(mods.BoundedVocoder(copy.deepcopy(hift).double()), dtype=torch.float64)
    core = CausalVocoderCore(mods.BoundedVocoder(copy.deepcopy(hift)))
    states = {k: core.new_state() for k in schedules}
    states64 = {k: core64.new_state() for k in schedules}
    done = {k: 0 for k in schedules}
    tick = 0
    while any(done[k] < len(s) for k, s in schedules.items()):
        ids = [k for k in schedules if arrival[k] <= tick and done[k] < len(schedules[k])]
        chunks, last = [], []
        for k in ids:
            start = sum(schedules[k][:done[k]])
            chunks.append(mels[k][:, :, start:start + schedules[k][done[k]]])
            last.append(done[k] == len(schedules[k]) - 1)
        outs = stream_batch(core, [states[k] for k in ids], chunks, last, batch_buckets=(1, 2, 4))
        outs64 = [stream_batch(core64, [states64[k]], [c], [f])[0] for k, c, f in zip(ids, chunks, last)]
        for k, out, out64 in zip(ids, outs, outs64):
            ref = refs[k][0][done[k]]
            assert out.shape == ref.shape, f"{k} chunk {done[k]}"
            bound = 2 * err_rel_fro(ref, out64) + 1e-6
            assert err_rel_fro(out, out64) <= bound, f"{k} chunk {done[k]}: {err_rel_fro(out, out64):.2e} > {bound:.2e}"
            # and the upstream's own samples (out64 runs this code too): the decoder's rounding only
            assert err_rel_fro(out, ref) <= 2e-6, f"{k} chunk {done[k]}: {err_rel_fro(out, ref):.2e}"
            done[k] += 1
        tick += 1
    for k, (_, bounded) in refs.items():
        for key, value in bounded.cache.items():
            assert torch.equal(states[k][key], value), f"{k} {key}"


# ---------------------------------------------------------------------------- Token2wav through apply_torch_cfm
@dataclass
class Run:
    mels: list          # the mel of every stream chunk, as the flow returned it
    wavs: list          # Token2wav.stream's waveforms (1, samples)
    call_mel: torch.Tensor
    call_wav: torch.Tensor
    cache: dict         # stream_cache after the last chunk
    t2w: object


@contextlib.contextmanager
def _raw_torchaudio(mods):
    """``token2wav.torchaudio.save`` writes raw float32 samples while inside (``__call__``'s bytes)."""
    module = mods.token2wav
    saved = module.torchaudio
    module.torchaudio = types.SimpleNamespace(save=P._save_raw)
    try:
        yield
    finally:
        module.torchaudio = saved


def _recording(flow):
    """The flow's ``inference_chunk`` / ``inference`` recording the mel they return."""
    mels = {"chunk": [], "call": []}
    chunk, whole = flow.inference_chunk, flow.inference

    def inference_chunk(*args, **kwargs):
        mel, cache = chunk(*args, **kwargs)
        mels["chunk"].append(mel.detach().clone())
        return mel, cache

    def inference(*args, **kwargs):
        mel = whole(*args, **kwargs)
        mels["call"].append(mel.detach().clone())
        return mel

    flow.inference_chunk, flow.inference = inference_chunk, inference
    return mels


def _run_token2wav(mods, t2w, chunks, seed: int = 21) -> Run:
    mels = _recording(t2w.flow)
    t2w.set_stream_cache("prompt.wav")
    wavs = [torch.from_numpy(t2w.stream(tok[0].tolist(), "prompt.wav", last_chunk=i == len(chunks) - 1,
                                        return_waveform=True)) for i, tok in enumerate(chunks)]
    torch.manual_seed(seed)  # the original HiFT draws its source phases and noise
    with _raw_torchaudio(mods):
        raw = t2w(chunks[1][0].tolist(), "prompt.wav")
    return Run(mels["chunk"], wavs, mels["call"][0], torch.frombuffer(bytearray(raw), dtype=torch.float32),
               dict(t2w.stream_cache), t2w)


def _token2wav(mods, flow, hift, prompt, device="cpu"):
    return P.make_minicpmo_token2wav(mods, copy.deepcopy(flow), prompt, hift=copy.deepcopy(hift),
                                     original_hift=P.build_original_hift(mods, seed=5), device=device)


PROMPT_TOKENS, CHUNKS = 22, 7  # 44 prompt frames; the caches reach 44 + 100 by the third chunk


@pytest.fixture(scope="module")
def prompt():
    return U.make_prompt(U.TINY, PROMPT_TOKENS, seed=71)


@pytest.fixture(scope="module")
def chunks():
    return U.make_chunks(U.TINY, CHUNKS, seed=72, last_tokens=9)


@pytest.fixture(scope="module")
def upstream_run(mods, flow, hift, prompt, chunks):
    return _run_token2wav(mods, _token2wav(mods, flow, hift, prompt), chunks)


@pytest.fixture(scope="module")
def accelerated_run(mods, flow, hift, prompt, chunks):
    from torch_cfm.integrations.stepaudio2 import apply_torch_cfm

    t2w = _token2wav(mods, flow, hift, prompt)
    assert apply_torch_cfm(t2w) is t2w
    return _run_token2wav(mods, t2w, chunks)


def _vocode_with_the_package(mods, flow, hift, prompt, mels: list, device: str = "cpu") -> list:
    """The package's own streaming vocoder stage (``Token2wav._stream_vocode``, first-chunk silence
    included) on a fresh Token2wav, fed the given chunk mels."""
    t2w = _token2wav(mods, flow, hift, prompt, device=device)
    t2w.set_stream_cache("prompt.wav")
    with torch.inference_mode():
        return [t2w._stream_vocode(mel, i == len(mels) - 1) for i, mel in enumerate(mels)]


@in_child
def test_token2wav_stream_mel_matches_upstream_and_its_trims_ran(upstream_run, accelerated_run, prompt, chunks):
    from torch_cfm.integrations.stepaudio2 import accelerated

    up, acc = upstream_run, accelerated_run
    assert len(up.mels) == len(acc.mels) == len(chunks)
    for i, (a, b) in enumerate(zip(acc.mels, up.mels)):
        assert a.shape == b.shape and err_rel_fro(a, b) <= REL, f"chunk {i}: {err_rel_fro(a, b):.2e}"
    bound = prompt.frames + 100
    for key, dim in (("estimator_att_cache", 4), ("conformer_att_cache", 3)):
        assert acc.cache[key].shape[dim] == up.cache[key].shape[dim] == bound, key  # both trims ran
        assert err_rel_fro(acc.cache[key][:10], up.cache[key][:10]) <= REL, key
    stream = accelerated(acc.t2w)._streams[10]
    assert stream.solves == 1 + len(chunks) and stream.loads >= 1  # the caller's trimmed caches were loaded


@in_child
def test_token2wav_stream_waveform_is_the_packages_vocoder_on_the_same_mel(mods, flow, hift, prompt, upstream_run,
                                                                         accelerated_run):
    up, acc = upstream_run, accelerated_run
    same_mel = _vocode_with_the_package(mods, flow, hift, prompt, acc.mels)
    for i, (a, b) in enumerate(zip(acc.wavs, same_mel)):  # one decoder pass per chunk: rounding apart
        assert a.shape == b.shape and err_rel_fro(a, b) <= 2e-6, f"chunk {i}: {err_rel_fro(a, b):.2e}"
    # every frame is emitted by the last chunk, behind 8 frames of silence (the causal delay)
    assert [w.shape for w in acc.wavs] == [w.shape for w in up.wavs]
    assert sum(w.shape[1] for w in acc.wavs) == (sum(m.shape[2] for m in acc.mels) + 8) * HOP
    # End to end, the mels' ~1e-7 difference moves f0 by an fp32 rounding step now and then, and
    # the phase accumulates it (here ~1e-4 in the first chunk, ~1e-3 by the seventh): same audio,
    # not the same samples; the check above is the one on the vocoder.
    assert err_rel_fro(torch.cat(acc.wavs, 1), torch.cat(up.wavs, 1)) <= 1e-2


@in_child
def test_token2wav_call_matches_upstream(mods, upstream_run, accelerated_run):
    """``__call__``: the flow's whole-utterance solve (torch_cfm) and the original HiFT."""
    up, acc = upstream_run, accelerated_run
    assert acc.call_mel.shape == up.call_mel.shape and err_rel_fro(acc.call_mel, up.call_mel) <= REL
    hift = acc.t2w.original_hift
    torch.manual_seed(21)
    with torch.inference_mode():
        same_mel, _ = hift(speech_feat=acc.call_mel.float())
    assert torch.equal(acc.call_wav, same_mel.flatten())
    assert acc.call_wav.shape == up.call_wav.shape and err_rel_fro(acc.call_wav, up.call_wav) <= 1e-3


@in_child
def test_apply_installs_by_what_the_token2wav_holds_and_undo_is_bitwise(mods, flow, hift, prompt, chunks,
                                                                        upstream_run):
    from torch_cfm.integrations.minicpmo import accelerated_minicpmo, is_causal_hift, is_causal_token2wav
    from torch_cfm.integrations.stepaudio2 import accelerated, apply_torch_cfm, undo_torch_cfm

    t2w = _token2wav(mods, flow, hift, prompt)
    assert is_causal_token2wav(t2w) and is_causal_hift(t2w.hift) and not is_causal_hift(t2w.original_hift)
    apply_torch_cfm(t2w)
    acc = accelerated_minicpmo(t2w)
    assert acc is not None and acc.vocoder.call is None  # CPU: the step runs eagerly
    assert t2w.bounded_vocoder.stream == acc.vocoder.stream
    assert "forward" not in vars(t2w.hift)  # the causal HiFT is never wrapped as a HiFTGenerator
    assert vars(t2w.flow.encoder)["forward_chunk"] == acc.encoder_call  # Dynamo's wrapper stripped
    assert undo_torch_cfm(t2w) is t2w and accelerated(t2w) is None and accelerated_minicpmo(t2w) is None
    for obj, name in ((t2w.bounded_vocoder, "stream"), (t2w, "_get_original_vocoder"),
                      (t2w.flow.encoder, "forward_chunk"), (t2w.original_hift, "forward")):
        assert name not in vars(obj), name
    again = _run_token2wav(mods, t2w, chunks)
    for a, b in zip(again.mels + again.wavs + [again.call_mel, again.call_wav],
                    upstream_run.mels + upstream_run.wavs + [upstream_run.call_mel, upstream_run.call_wav]):
        assert torch.equal(a, b)
    for key, value in upstream_run.cache.items():
        assert torch.equal(again.cache[key], value), key


@in_child
def test_vocoder_warmup_uses_private_states_and_errors_name_what_was_found(mods, flow, hift, prompt):
    from torch_cfm.integrations.minicpmo import apply_minicpmo, warmup_minicpmo
    from torch_cfm.integrations.stepaudio2 import apply_torch_cfm
    from torch_cfm.models.vocoder.causal import CausalVocoderCore, stream_batch

    t2w = _token2wav(mods, flow, hift, prompt)
    with pytest.raises(ValueError, match=r"warmup_minicpmo: token2wav must be accelerated"):
        warmup_minicpmo(t2w)
    apply_torch_cfm(t2w)
    t2w.set_stream_cache("prompt.wav")
    before = {k: v.clone() for k, v in t2w.hift_cache_dict.items()}
    assert warmup_minicpmo(t2w, steady_chunks=2, rounds=1) == {"vocoder_graphs": 0, "vocoder_plans": 0}
    assert t2w.bounded_vocoder.cache is t2w.hift_cache_dict
    for key, value in before.items():
        assert torch.equal(t2w.hift_cache_dict[key], value), key
    with pytest.raises(TypeError, match=r"apply_minicpmo: token2wav must be minicpmo-utils' Token2wav.*"
                                        r"no 'bounded_vocoder'"):
        apply_minicpmo(types.SimpleNamespace(flow=flow, hift=t2w.original_hift), graphs=False)
    odd = types.SimpleNamespace(bounded_vocoder=t2w.bounded_vocoder, hift=t2w.original_hift)
    with pytest.raises(TypeError, match=r"bounded_vocoder\.model is not its \.hift"):
        apply_minicpmo(odd, graphs=False)
    sizes = dict(hop=480, block_frames=16, f0_left=8, f0_right=3, history=31, decoder_right=5, cache={})
    with pytest.raises(TypeError, match=r"CausalVocoderCore: bounded must be .*model: no int 'conv_pre_look_right'.*"
                                        r"no causal m_source\.l_sin_gen"):
        CausalVocoderCore(types.SimpleNamespace(model=t2w.original_hift, **sizes))
    core = CausalVocoderCore(t2w.bounded_vocoder)
    with pytest.raises(ValueError, match=r"stream_batch: states, mels and finalize must have one entry per stream, "
                                         r"got 1, 0 and 1"):
        stream_batch(core, [core.new_state()], [], [True])



# ---------------------------------------------------------------------------- GPU
@contextlib.contextmanager
def _ieee_fp32():
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


@in_child
@pytest.mark.gpu
@pytest.mark.parametrize("sizes", ["tiny", "shipped"])
def test_gpu_graphed_causal_step_equals_bounded_vocoder_stream(mods, sizes):
    """The step replayed from CUDA graphs (first chunk, steady chunks, a last chunk) vs
    ``BoundedVocoder.stream`` on CUDA: state bitwise, samples within 2x the upstream fp32 error
    against its float64 stream + 1e-6."""
    from torch_cfm.integrations.minicpmo import CausalVocoderStream

    widths = P.TINY_CAUSAL if sizes == "tiny" else P.SHIPPED_CAUSAL
    model = P.build_causal_hift(mods, seed=1, **widths).cuda()
    schedule = [50] * 8 + [56]
    mel = _mel(sum(schedule), seed=2).cuda()
    with _ieee_fp32():
        ref, bounded = _upstream_stream(mods, model, mel, schedule)
        ref64, _ = _upstream_stream(mods, copy.deepcopy(model).double(), mel.double(), schedule)
        ours = mods.BoundedVocoder(copy.deepcopy(model))
        voc = CausalVocoderStream(ours, graphs=True)
        pos = 0
        for i, (frames, expected, exact) in enumerate(zip(schedule, ref, ref64)):
            out = voc.stream(mel[:, :, pos:pos + frames], finalize=i == len(schedule) - 1)
            pos += frames
            bound = 2 * err_rel_fro(expected, exact) + 1e-6
            assert out.shape == expected.shape and err_rel_fro(out, exact) <= bound, f"call {i}"
    for key, value in bounded.cache.items():
        assert torch.equal(ours.cache[key], value), key
    replays = sum(e.replays for e in voc.call.cache.entries())
    assert voc.graph_count >= 1 and replays >= 5, voc.call.events  # the steady chunks replayed


@in_child
@pytest.mark.gpu
def test_gpu_fused_decode_stream_at_tf32_equals_bounded_vocoder_stream(mods):
    """At PyTorch's default precision (cuDNN TF32) the core decoding on the fused convolutions
    (``decoder="fused"``), replayed from CUDA graphs: the state bitwise the upstream's
    ``BoundedVocoder.stream`` (TF32 too), the samples within 2x the upstream's TF32 error against
    its float64 stream + 1e-6. At the shipped widths: at the tiny ones cuDNN keeps narrow layers
    off TF32, so the upstream's "TF32" error there is partly IEEE's (``causal_fused_error`` rows of
    ``bench/experiments/causal_fused_decode.py``)."""
    from torch_cfm.integrations.minicpmo import CausalVocoderStream

    model = P.build_causal_hift(mods, seed=1, **P.SHIPPED_CAUSAL).cuda()
    schedule = [50] * 6 + [56]
    mel = _mel(sum(schedule), seed=2).cuda()
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=True):
        ref, bounded = _upstream_stream(mods, model, mel, schedule)
        ref64, _ = _upstream_stream(mods, copy.deepcopy(model).double(), mel.double(), schedule)
        ours = mods.BoundedVocoder(copy.deepcopy(model))
        voc = CausalVocoderStream(ours, graphs=True, decoder="fused")
        pos = 0
        for i, (frames, expected, exact) in enumerate(zip(schedule, ref, ref64)):
            out = voc.stream(mel[:, :, pos:pos + frames], finalize=i == len(schedule) - 1)
            pos += frames
            bound = 2 * err_rel_fro(expected, exact) + 1e-6
            assert out.shape == expected.shape, f"call {i}"
            assert err_rel_fro(out, exact) <= bound, f"call {i}: {err_rel_fro(out, exact):.2e} > {bound:.2e}"
    for key, value in bounded.cache.items():
        assert torch.equal(ours.cache[key], value), key
    assert voc.graph_count >= 1


@in_child
@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
def test_gpu_batched_graphed_stage_equals_each_stream_alone(mods, hift, precision):
    """Five streams on CUDA, arriving on different ticks, batched through a graphed step (buckets
    1, 2, 4, 8) vs ``BoundedVocoder.stream`` per stream: samples within 2x the upstream fp32
    error against the float64 step + 1e-6, phase within 1e-4 cycles. IEEE: the model's decode;
    TF32 (PyTorch's default; the upstream's error at TF32): the default decoder, the fused one, at
    the shipped widths (as the test above)."""
    from torch_cfm.graphs import GraphedCall
    from torch_cfm.models.vocoder.causal import CausalVocoderCore, stream_batch

    model = (copy.deepcopy(hift) if precision == "ieee" else
             P.build_causal_hift(mods, seed=0, table_samples=20 * 24000, **P.SHIPPED_CAUSAL)).cuda()
    schedules = [[50] * 6 + [56], [50] * 7 + [20], [50] * 5 + [2], [50] * 6 + [50], [50] * 4 + [56]]
    arrival = [0, 0, 1, 1, 2]
    mels = [_mel(sum(s), seed=30 + i).cuda() for i, s in enumerate(schedules)]
    scope = _ieee_fp32() if precision == "ieee" else torch.backends.cudnn.flags(enabled=True, allow_tf32=True)
    with scope:
        refs = [_upstream_stream(mods, model, m, s) for m, s in zip(mels, schedules)]
        core = CausalVocoderCore(mods.BoundedVocoder(copy.deepcopy(model)))
        assert (core.fused is not None) == (precision == "tf32")
        core64 = CausalVocoderCore(mods.BoundedVocoder(copy.deepcopy(model).double()), dtype=torch.float64)
        call = GraphedCall(core.run, name="causal_vocoder_batch")
        states, states64 = [core.new_state() for _ in schedules], [core64.new_state() for _ in schedules]
        done, tick = [0] * len(schedules), 0
        while any(d < len(s) for d, s in zip(done, schedules)):
            ids = [k for k in range(len(schedules)) if arrival[k] <= tick and done[k] < len(schedules[k])]
            chunks = [mels[k][:, :, sum(schedules[k][:done[k]]):sum(schedules[k][:done[k] + 1])] for k in ids]
            last = [done[k] == len(schedules[k]) - 1 for k in ids]
            outs = stream_batch(core, [states[k] for k in ids], chunks, last, call=call, batch_buckets=(1, 2, 4, 8))
            for k, c, f, out in zip(ids, chunks, last, outs):
                out64 = stream_batch(core64, [states64[k]], [c], [f])[0]
                ref = refs[k][0][done[k]]
                bound = 2 * err_rel_fro(ref, out64) + 1e-6
                assert out.shape == ref.shape and err_rel_fro(out, out64) <= bound, f"stream {k} chunk {done[k]}"
                done[k] += 1
            tick += 1
    for k, (_, bounded) in enumerate(refs):
        assert (states[k]["phase"] - bounded.cache["phase"]).abs().max() <= 1e-4
        for key in ("mel", "mel_offset", "source_offset", "source_end", "speech_offset", "finalized"):
            assert torch.equal(states[k][key], bounded.cache[key]), f"stream {k} {key}"
    assert call.graph_count >= 2, call.events


@in_child
@pytest.mark.gpu
def test_gpu_token2wav_after_apply_and_warmup_matches_upstream(mods, flow, hift, prompt, chunks):
    """minicpmo-utils' ``Token2wav`` on CUDA, fp32 (TF32 off): ``stream`` and ``__call__`` after
    ``apply_torch_cfm`` + ``warmup`` (decoder, encoder and vocoder graphs) vs the upstream's;
    the streamed waveform vs the package's vocoder on the same mel within 1e-6."""
    from torch_cfm.integrations.minicpmo import accelerated_minicpmo
    from torch_cfm.integrations.stepaudio2 import accelerated, apply_torch_cfm, undo_torch_cfm, warmup

    with _ieee_fp32():
        up = _run_token2wav(mods, _token2wav(mods, flow, hift, prompt, device="cuda"), chunks)
        t2w = _token2wav(mods, flow, hift, prompt, device="cuda")
        apply_torch_cfm(t2w)
        report = warmup(t2w, prompt_frames=(prompt.frames,), last_tokens=(9,))
        assert report["decoder_graphs"] >= 1 and report["encoder_graphs"] >= 1 and report["vocoder_graphs"] >= 2
        acc = _run_token2wav(mods, t2w, chunks)
        same_mel = _vocode_with_the_package(mods, flow, hift, prompt, acc.mels, device="cuda")
    for i, (a, b) in enumerate(zip(acc.mels, up.mels)):
        assert err_rel_fro(a, b) <= REL, f"chunk {i} mel"
    for i, (a, b) in enumerate(zip(acc.wavs, same_mel)):
        assert a.shape == b.shape and err_rel_fro(a, b.cpu()) <= 1e-6, f"chunk {i} waveform"
    assert err_rel_fro(acc.call_mel, up.call_mel) <= REL
    assert err_rel_fro(torch.cat(acc.wavs, 1), torch.cat(up.wavs, 1)) <= 1e-2
    voc = accelerated_minicpmo(t2w).vocoder
    assert sum(e.replays for e in voc.call.cache.entries()) >= 3, voc.call.events
    assert accelerated(t2w).graph_count() >= 1
    undo_torch_cfm(t2w)
    assert "stream" not in vars(t2w.bounded_vocoder)
