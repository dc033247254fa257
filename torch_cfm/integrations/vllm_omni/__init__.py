"""MiniCPM-o 4.5's Code2Wav stage in vLLM-Omni, served by torch_cfm.

vLLM-Omni (PyPI ``vllm-omni``) runs MiniCPM-o 4.5's token2wav in its Code2Wav stage through the
backend ``vllm_omni.model_executor.models.minicpmo_4_5.batched_token2wav.BatchedToken2Wav``: the
flow built from the checkpoint's ``flow.yaml`` (the CosyVoice2 modules the ``stepaudio2`` package
ships) and vLLM-Omni's own copy of the CosyVoice ``HiFTGenerator``, streamed the way
``stepaudio2``'s ``Token2wav.stream`` streams it. This package serves that backend with a
:class:`~torch_cfm.serving.Token2wavServer` behind the backend's own
contract.

* :mod:`.backend`: :class:`TorchCfmBatchedToken2Wav`, the contract (states and their lifecycle,
  per-request fallback, warm-up, memory report);
* :mod:`.apply`: :func:`apply_torch_cfm_to_vllm_omni` / :func:`undo_torch_cfm_from_vllm_omni`
  (whole-backend fallbacks: TensorRT stepper, NPU, unknown layouts);
* :mod:`.plugin`: the vLLM general plugin, switched on by ``TORCH_CFM_VLLM_OMNI``;
* :mod:`.options`: :class:`Options` and the support checks.

As a vLLM plugin (installed with torch_cfm)::

    TORCH_CFM_VLLM_OMNI=1 vllm-omni serve openbmb/MiniCPM-o-4_5 --deploy-config ...   # every process
    TORCH_CFM_VLLM_OMNI=max_streams=32 ...                                              # with options

For a backend you build yourself::

    from torch_cfm.integrations.vllm_omni import apply_torch_cfm_to_vllm_omni, undo_torch_cfm_from_vllm_omni

    backend = BatchedToken2Wav(token2wav)                 # vLLM-Omni's class, built as usual
    apply_torch_cfm_to_vllm_omni(backend, max_streams=32)  # setup_batch / decode_batch / decode_ragged_batch
    ...                                                    # ... drive it exactly as before
    undo_torch_cfm_from_vllm_omni(backend)                 # vLLM-Omni's own methods again

Importing this package imports neither vLLM nor vLLM-Omni.
"""

from .apply import accelerated_backend, apply_torch_cfm_to_vllm_omni, undo_torch_cfm_from_vllm_omni
from .backend import TorchCfmBatchedToken2Wav, is_torch_cfm_state
from .options import Options, unsupported_reason
from .plugin import ENV, install, plugin_options, register, unregister

__all__ = ["register", "unregister", "install", "plugin_options", "ENV", "Options", "TorchCfmBatchedToken2Wav",
           "apply_torch_cfm_to_vllm_omni", "undo_torch_cfm_from_vllm_omni", "accelerated_backend",
           "unsupported_reason", "is_torch_cfm_state"]
