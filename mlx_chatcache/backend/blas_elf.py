"""The names a shared library exports: ``dynamic_symbols(path) -> list[str]``.

Reads the ``.dynsym`` section and its string table of a 64-bit little-endian
ELF file (x86-64, aarch64) with the standard library only (no binutils on a
fresh machine). Returns the defined symbols (section index != 0) in table
order. Any other file raises ``ValueError``.
"""

from __future__ import annotations

import struct
from pathlib import Path

SHT_DYNSYM = 11
SYM_SIZE = 24  # Elf64_Sym


def dynamic_symbols(path: Path) -> list[str]:
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = []
    for _name, kind, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
        if kind != SHT_DYNSYM:
            continue
        str_off = sections[link][4]
        for at in range(offset, offset + size, entsize or SYM_SIZE):
            st_name, _st_info, _st_other, st_shndx = struct.unpack_from("<IBBH", data, at)
            if st_shndx == 0 or st_name == 0:
                continue  # undefined (imported) or unnamed
            end = data.index(b"\0", str_off + st_name)
            names.append(data[str_off + st_name : end].decode("ascii", "replace"))
    return names
