"""Build-time check of the C++ extension's dynamic dependencies (used by setup.py and a test).

On the H200 box an extension built by a compiler that links libstdc++ statically
(``CXX=/opt/gcc/bin/g++``, a different GCC than torch's) crashed the process whenever its C++
code threw (``TORCH_CHECK_VALUE`` -> ``ValueError``). The check is conservative: it asks for the
shared C++ runtime, the configuration torch itself is built and tested with.
"""

from __future__ import annotations

import struct

_SHT_DYNAMIC = 6
_DT_NEEDED = 1


def elf_needed(path: str) -> list[str]:
    """DT_NEEDED entries of a 64-bit little-endian ELF shared object ([] if it is not one)."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:6] != b"\x7fELF\x02\x01":
        return []
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    # Elf64_Shdr: name, type, flags, addr, offset, size, link, info, addralign, entsize
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    for sec in sections:
        if sec[1] != _SHT_DYNAMIC:
            continue
        strtab = sections[sec[6]][4]  # sh_link: the dynamic string table
        names = []
        for off in range(sec[4], sec[4] + sec[5], 16):
            tag, val = struct.unpack_from("<qQ", data, off)
            if tag == _DT_NEEDED:
                end = data.index(b"\0", strtab + val)
                names.append(data[strtab + val:end].decode())
        return names
    return []


def loads_cxx_runtime(needed: list[str]) -> bool:
    """True if the DT_NEEDED list loads a shared C++ runtime (libstdc++ or libc++)."""
    return any(n.startswith(("libstdc++", "libc++")) for n in needed)
