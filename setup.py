"""Build torch_cfm's C++ extension (op schemas + CPU kernels; the CUDA kernels where nvcc exists).

Metadata and packages are declared in pyproject.toml. Install with
``python3 -m pip install --no-build-isolation -e .`` so the extension builds against the torch
already installed (build isolation would download a CUDA torch of several GB into a throwaway
build environment and compile against that one; see pyproject.toml).
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
    sys.exit("torch_cfm: PyTorch must be installed before building (python3 -m pip install torch), "
             "then build against it without build isolation: python3 -m pip install --no-build-isolation -e .")

if shutil.which(os.environ.get("CXX", "c++")) is None and shutil.which("g++") is None:
    sys.exit("torch_cfm: a C++ compiler (g++ or clang++) is required to build csrc/; "
             "install one (e.g. apt-get install g++) and retry.")


def _load_build_check():
    """torch_cfm/_build_check.py, loaded by path (the package is not importable before its build)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_torch_cfm_build_check", os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_cfm", "_build_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildCheckedExtension(BuildExtension):
    """BuildExtension, then refuse an extension that does not load the shared C++ runtime.

    On the H200 box the default compiler (CXX=/opt/gcc/bin/g++) linked libstdc++ statically: the
    op built and ran, but every C++ error it raised (TORCH_CHECK_VALUE -> ValueError) crashed the
    process, and so did loading AOTInductor packages built the same way; the system g++ (the
    GCC torch was built with, shared libstdc++) fixed both. See torch_cfm/_build_check.py."""

    def build_extensions(self) -> None:
        super().build_extensions()
        if not sys.platform.startswith("linux") or os.environ.get("TORCH_CFM_ALLOW_STATIC_LIBSTDCXX") == "1":
            return
        check = _load_build_check()
        for ext in self.extensions:
            path = self.get_ext_fullpath(ext.name)
            needed = check.elf_needed(path)
            if needed and not check.loads_cxx_runtime(needed):
                os.remove(path)
                sys.exit(f"torch_cfm: {path} does not load libstdc++ dynamically (needs {needed}): the compiler "
                         f"({os.environ.get('CXX', 'c++')}) links the C++ runtime statically, and C++ errors "
                         "raised by the op would crash the process. Build with the compiler torch was built "
                         "with, e.g. CXX=g++ CC=gcc pip install --no-build-isolation -e . "
                         "(TORCH_CFM_ALLOW_STATIC_LIBSTDCXX=1 skips this check).")


def _cuda_extension():
    """The optional torch_cfm._C_cuda (hand-written CUDA kernels, csrc/cuda/), or None with a reason.

    Built only where torch has CUDA and nvcc exists; elsewhere (CI, CPU wheels) the package runs
    the Triton kernels, and ``torch_cfm.explain()`` says the CUDA kernel is not built and why.
    ``TORCH_CFM_BUILD_CUDA=0`` skips it, ``=1`` makes a missing toolkit an install error."""
    wanted = os.environ.get("TORCH_CFM_BUILD_CUDA", "auto").strip().lower()
    if wanted in ("0", "off", "false", "no"):
        return None, "TORCH_CFM_BUILD_CUDA=0"
    from torch.utils.cpp_extension import CUDA_HOME, CUDAExtension

    if torch.version.cuda is None:
        why = f"torch {torch.__version__} has no CUDA"
    elif CUDA_HOME is None or not os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")):
        why = "nvcc not found (set CUDA_HOME)"
    else:
        cuda_sources = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")) + glob.glob(os.path.join("csrc", "cuda", "*.cpp")))
        return CUDAExtension(
            "torch_cfm._C_cuda",
            cuda_sources,
            extra_compile_args={"cxx": ["-O2"], "nvcc": ["-O3", "-std=c++17"]},
            py_limited_api=False,
        ), ""
    if wanted in ("1", "on", "true", "yes"):
        sys.exit(f"torch_cfm: TORCH_CFM_BUILD_CUDA=1 but the CUDA extension cannot be built: {why}")
    print(f"torch_cfm: skipping the optional CUDA extension ({why}); the Triton kernels serve CUDA", file=sys.stderr)
    return None, why


sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")) + glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
debug = os.environ.get("DEBUG", "0") == "1"

cuda_extension, _ = _cuda_extension()

# Metadata, packages and extras are in pyproject.toml; setup.py adds what needs code: the extensions.
setup(
    ext_modules=[
        CppExtension(
            "torch_cfm._C",
            sources,
            # no -std flag: BuildExtension adds the one torch's headers need
            extra_compile_args={"cxx": ["-O0" if debug else "-O2"]},
            py_limited_api=False,
        )
    ] + ([cuda_extension] if cuda_extension is not None else []),
    cmdclass={"build_ext": BuildCheckedExtension},
)
