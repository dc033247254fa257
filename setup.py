"""Build torch_cfm: the C++ extension (op schemas + CPU kernels) and the Python packages.

Install with ``pip install --no-build-isolation -e .`` so the build uses the torch already
installed (build isolation would download a CUDA torch of several GB).
"""

import glob
import os
import shutil
import sys

from setuptools import setup

try:
    import torch  # noqa: F401
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:  # pragma: no cover - install-time message
    sys.exit("torch_cfm: PyTorch must be installed before building (pip install torch==2.13.0), "
             "then pip install --no-build-isolation -e .")

if shutil.which(os.environ.get("CXX", "c++")) is None and shutil.which("g++") is None:
    sys.exit("torch_cfm: a C++ compiler (g++ or clang++) is required to build csrc/; "
             "install one (e.g. apt-get install g++) and retry.")

here = os.path.dirname(os.path.abspath(__file__))
sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")) + glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
debug = os.environ.get("DEBUG", "0") == "1"

setup(
    name="torch_cfm",
    version="0.1.0",
    description="Fast, compile-ready flow-matching (CFM) DiT speech decoders for PyTorch",
    python_requires=">=3.10",
    packages=[
        "torch_cfm", "torch_cfm.ops", "torch_cfm.kernels", "torch_cfm.reference", "torch_cfm.models",
        "torch_cfm.compile_rules", "torch_cfm.compile_rules.passes",
    ],
    package_dir={"torch_cfm.compile_rules": "compile_rules",
                 "torch_cfm.compile_rules.passes": "compile_rules/passes"},
    ext_modules=[
        CppExtension(
            "torch_cfm._C",
            sources,
            # no -std flag: BuildExtension adds the standard torch's headers were built with
            # (C++20 for torch >= 2.10); a different one breaks c10's inline types (crashes
            # when a TORCH_CHECK throws).
            extra_compile_args={"cxx": ["-O0" if debug else "-O2"]},
            py_limited_api=False,
        )
    ],
    cmdclass={"build_ext": BuildExtension},
    install_requires=["torch>=2.11", "numpy"],
    extras_require={"test": ["pytest", "hypothesis", "triton>=3.4; platform_system == 'Linux'"]},
    entry_points={"torch_dynamo_backends": ["torch_cfm = torch_cfm.compile_rules.backend:torch_cfm_backend"]},
)
