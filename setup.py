"""Build torch_cfm: the C++ extension (op schemas + CPU kernels) and the Python packages.

Install with ``pip install --no-build-isolation -e .`` so the build uses the torch already
installed (build isolation would download a CUDA torch of several GB).
"""

import glob
import os
import shutil
import struct
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

def elf_needed(path: str) -> list[str]:
    """DT_NEEDED entries of a 64-bit little-endian ELF shared object ([] if it is not one)."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:6] != b"\x7fELF\x02\x01":
        return []
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    for sec in sections:
        if sec[1] != 6:  # SHT_DYNAMIC; sh_link is its string table
            continue
        strtab_off = sections[sec[6]][4]
        names = []
        for off in range(sec[4], sec[4] + sec[5], 16):
            tag, val = struct.unpack_from("<qQ", data, off)
            if tag == 1:  # DT_NEEDED
                end = data.index(b"\0", strtab_off + val)
                names.append(data[strtab_off + val:end].decode())
        return names
    return []


class BuildCheckedExtension(BuildExtension):
    """BuildExtension, then refuse an extension that carries its own copy of libstdc++.

    Seen on a GPU box whose default compiler (CXX=/opt/gcc/bin/g++) links libstdc++ statically:
    the op built fine and ran, but every C++ error it raised (TORCH_CHECK_VALUE -> ValueError)
    crashed the process, because the exception was thrown by one C++ runtime and handled by
    torch's. The extension must use the libstdc++ torch uses."""

    def build_extensions(self) -> None:
        super().build_extensions()
        if not sys.platform.startswith("linux") or os.environ.get("TORCH_CFM_ALLOW_STATIC_LIBSTDCXX") == "1":
            return
        for ext in self.extensions:
            path = self.get_ext_fullpath(ext.name)
            needed = elf_needed(path)
            if needed and not any(n.startswith("libstdc++") or n.startswith("libc++") for n in needed):
                os.remove(path)
                sys.exit(f"torch_cfm: {path} does not load libstdc++ dynamically (needs {needed}): the compiler "
                         f"({os.environ.get('CXX', 'c++')}) links the C++ runtime statically, and C++ errors "
                         "raised by the op would crash the process. Build with the compiler torch was built "
                         "with, e.g. CXX=g++ CC=gcc pip install --no-build-isolation -e . "
                         "(TORCH_CFM_ALLOW_STATIC_LIBSTDCXX=1 skips this check).")


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
            # no -std flag: BuildExtension adds the one torch's headers need
            extra_compile_args={"cxx": ["-O0" if debug else "-O2"]},
            py_limited_api=False,
        )
    ],
    cmdclass={"build_ext": BuildCheckedExtension},
    install_requires=["torch>=2.11", "numpy"],
    extras_require={"test": ["pytest", "hypothesis", "triton>=3.4; platform_system == 'Linux'"]},
    entry_points={"torch_dynamo_backends": ["torch_cfm = torch_cfm.compile_rules.backend:torch_cfm_backend"]},
)
