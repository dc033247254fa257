"""Triton kernels of torch_cfm: ``@triton.jit`` bodies, their tile heuristics and host launchers.

Nothing here registers torch.library ops (that lives in :mod:`torch_cfm.ops`); importing a kernel
module compiles nothing. One kernel (or op) per module, named after it: ``cfm_attention.py`` (its
launch parameters and per-shape rule in ``cfm_attention_config.py``), ``cache_trim.py``; the fused
body's ``rownorm.py``, ``qk_cache.py``, ``dit_attention.py`` (the "fused_attention" plan's attention +
cache kernel), ``cfg_euler.py``, the SM90a GEMM's wrapper ``dit_linear_cuda.py``, the tuning table
``body_plans.py`` and the body driver ``dit_body.py``; the vocoder's ``vocoder_conv.py`` (its tuning
table ``vocoder_tiles.py``), ``vocoder_elementwise.py`` and ``vocoder_source.py``. Small launch helpers
shared by kernels are in ``_launch.py``.
"""
