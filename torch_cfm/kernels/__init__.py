"""Triton kernels of torch_cfm: ``@triton.jit`` bodies, their tile heuristics and host launchers.

Nothing here registers torch.library ops (that lives in :mod:`torch_cfm.ops`); importing a kernel
module compiles nothing. Each op's kernel sits in a module named after the op
(``cfm_attention.py``); small launch helpers shared by kernels are in ``_launch.py``.
"""
