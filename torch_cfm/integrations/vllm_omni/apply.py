"""Installing torch_cfm on a vLLM-Omni ``BatchedToken2Wav``, and taking it off again.

The one place the integration builds its :class:`Token2wavServer` (and imports it).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from ...serving import Token2wavServer

from .backend import TorchCfmBatchedToken2Wav
from .options import METHODS, Options, log_once, say, serving_context, state_base, support_reason, unsupported_reason

__all__ = ["apply_torch_cfm_to_vllm_omni", "undo_torch_cfm_from_vllm_omni", "accelerated_backend", "build_server",
           "construct_patched"]

_ATTR = "_torch_cfm"  # the adapter, in the backend's __dict__ while applied


def build_server(flow: Any, hift: Any, n_timesteps: int, options: Options) -> Token2wavServer:
    """The :class:`Token2wavServer` serving these modules with ``options`` (raises TypeError or
    ValueError when their layout is not the one it serves)."""
    with serving_context():  # its copy of the estimator's weights is made in the default dtype
        return Token2wavServer(flow, hift, max_streams=options.max_streams,
                               max_prompt_frames=options.max_prompt_frames, max_chunk_tokens=options.max_chunk_tokens,
                               n_timesteps=int(n_timesteps), dtype=options.dtype, graphs=options.graphs,
                               max_memory_bytes=options.max_memory_bytes, encoder_batching=options.encoder_batching,
                               vocoder=options.vocoder)


def accelerated_backend(backend: Any) -> Optional[TorchCfmBatchedToken2Wav]:
    """The torch_cfm adapter installed on ``backend`` (None: it runs vLLM-Omni's own path)."""
    return vars(backend).get(_ATTR) if hasattr(backend, "__dict__") else None


def attach(backend: Any, server: Token2wavServer, options: Options) -> TorchCfmBatchedToken2Wav:
    """Install an adapter over a built ``server`` on ``backend`` (and warm it up when asked)."""
    adapter = TorchCfmBatchedToken2Wav(backend, server, options)
    for name in METHODS:
        vars(backend)[name] = getattr(adapter, name)
    vars(backend)[_ATTR] = adapter
    run_warmup = server.graphs if options.warmup is None else options.warmup
    if run_warmup:
        adapter.warmup()
    else:
        say(options.progress, f"Code2Wav on torch_cfm (no warm-up); {adapter.describe_memory(adapter.memory_report())}")
    return adapter


def _server_or_reason(flow: Any, hift: Any, n_timesteps: int, options: Options,
                      reason: Optional[str]) -> tuple[Optional[Token2wavServer], Optional[str]]:
    """(the server, None) when the parts are supported (``reason`` None) and :func:`build_server`
    takes them, else (None, why not)."""
    if reason is not None:
        return None, reason
    try:
        return build_server(flow, hift, n_timesteps, options), None
    except (TypeError, ValueError, AttributeError) as exc:
        return None, f"unknown layout: {exc}"


def apply_torch_cfm_to_vllm_omni(backend: Any, *, strict: bool = False,
                                 **options) -> Optional[TorchCfmBatchedToken2Wav]:
    """Serve vLLM-Omni's ``BatchedToken2Wav`` (``backend``) with torch_cfm, in place.

    ``setup_batch``, ``decode_batch`` and ``decode_ragged_batch`` become methods of a
    :class:`TorchCfmBatchedToken2Wav` set on the instance (the class is untouched); everything else
    (``prepare_prompt``, ``evict_prompt``, the modules) stays the backend's. Applying twice returns
    the adapter already there.

    Args:
        backend: a built ``BatchedToken2Wav``. Build it with ``enable_hift_graph`` /
            ``enable_cfm_graph`` off if you can: torch_cfm replays its own graphs, and the
            original's stay allocated (the plugin builds it that way).
        strict: raise instead of falling back when the configuration is not supported.
        **options: :class:`Options`.
    Returns:
        the adapter, or None when ``backend`` stays on vLLM-Omni's own path (the reason is logged
        once: TensorRT stepper, NPU or another device, an unknown layout).
    Raises:
        ValueError: a bad option (the message names it).
        NotImplementedError: ``strict`` and not supported.
    """
    existing = accelerated_backend(backend)
    if existing is not None:
        return existing
    opts = Options(**options)
    reason = unsupported_reason(backend)
    server, reason = _server_or_reason(getattr(backend, "flow", None), getattr(backend, "hift", None),
                                       getattr(backend, "n_timesteps", 10), opts, reason)
    if server is None:
        if strict:
            raise NotImplementedError(f"apply_torch_cfm_to_vllm_omni: not supported yet: {reason}")
        log_once(f"apply:{reason}", f"MiniCPM-o Code2Wav stays on vLLM-Omni's own path: {reason}")
        return None
    return attach(backend, server, opts)


def undo_torch_cfm_from_vllm_omni(backend: Any) -> bool:
    """Back to vLLM-Omni's own methods: every stream closed, the server dropped (the backend's
    modules and buffers are bitwise what they were: the server never modifies them). States made
    by torch_cfm are not valid afterwards. Returns False when nothing was applied."""
    adapter = vars(backend).pop(_ATTR, None) if hasattr(backend, "__dict__") else None
    if adapter is None:
        return False
    for name in METHODS:
        vars(backend).pop(name, None)
    adapter.close()
    return True


def construct_patched(original_init: Callable, backend: Any, token2wav: Any, args: tuple, kwargs: dict,
                      options: dict) -> None:
    """``BatchedToken2Wav.__init__`` as the plugin runs it: the parts are checked and the server
    built first; when torch_cfm serves them, the original is built without its own CUDA graphs
    (it would capture HiFT graphs now and hold their pools) and the adapter is attached; else the
    original is built as configured and the reason logged once."""
    opts = Options(**options)
    trt = kwargs.get("trt_stepper", args[0] if args else None)
    flow, hift = getattr(token2wav, "flow", None), getattr(token2wav, "hift", None)
    server, reason = _server_or_reason(flow, hift, getattr(token2wav, "n_timesteps", 10), opts,
                                       support_reason(flow, hift, trt, state_base(type(backend))))
    if server is not None:
        kwargs = dict(kwargs, hift_graph_config={"enabled": False}, cfm_graph_config={"enabled": False})
    original_init(backend, token2wav, *args, **kwargs)
    if server is None:
        log_once(f"apply:{reason}", f"MiniCPM-o Code2Wav stays on vLLM-Omni's own path: {reason}")
        return
    attach(backend, server, opts)
