"""CRC32 checksums that make a damaged cache file fail to load.

A file of our format (version 4 on) carries two metadata keys:

- ``mlxcc.tensor_crc32``: a JSON object, each tensor's name -> the CRC32 of its
  raw bytes in the data section (8 lowercase hex digits);
- ``mlxcc.header_crc32``: the CRC32 of the file's first ``8 + header length``
  bytes (the length and the JSON header) with this key's own value written as
  ``00000000``.

Together they cover every byte of the file: the tensors tile the data section
exactly (the header parser checks that). :func:`checksummed` adds both keys
(the header's as a placeholder) before a write; :func:`seal_file` /
:func:`seal_bytes` fill in the header's value once the header bytes exist.
:func:`header_checksums` checks a parsed header and returns the tensors'
sums, which a reader compares with each tensor's bytes
(:func:`~.safetensors_file.host_tensors`). :func:`crc32` is the project's one
checksum: it finds damage, it does not authenticate (anyone can recompute it).
"""

from __future__ import annotations

import json
import re
import struct
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CacheFileError

if TYPE_CHECKING:
    import mlx.core as mx

HEADER_KEY = "mlxcc.header_crc32"
TENSORS_KEY = "mlxcc.tensor_crc32"
PLACEHOLDER = "00000000"
# the key and its value (any 8 characters) in the JSON header, whatever the spacing
_FIELD = re.compile(rb'"mlxcc\.header_crc32"[ \t\n\r]*:[ \t\n\r]*"([^"\\]{8})"')
_HEX = re.compile(r"[0-9a-f]{8}")
_HEXES = re.compile(r"[0-9a-f]*")


# crc32(buf, value=0): CRC32 of a bytes-like object (any C-contiguous buffer), continuing from ``value``
crc32 = zlib.crc32


def array_crc32(a: mx.array) -> int:
    """CRC32 of ``a``'s bytes as a safetensors file stores them (row-major)."""
    import mlx.core as mx

    view = memoryview(a)
    if not view.c_contiguous:
        view = memoryview(mx.contiguous(a))
    return crc32(view)


def checksummed(arrays: dict[str, mx.array], metadata: dict[str, str]) -> dict[str, str]:
    """``metadata`` plus the tensors' checksums and the header checksum's placeholder."""
    sums = {name: f"{array_crc32(a):08x}" for name, a in arrays.items()}
    return {**metadata, TENSORS_KEY: json.dumps(sums, separators=(",", ":")), HEADER_KEY: PLACEHOLDER}


def _value_offset(head: bytes) -> int | None:
    """Offset in ``head`` (length + header) of the header checksum's 8 characters,
    when the key occurs exactly once."""
    found = list(_FIELD.finditer(head))
    return found[0].start(1) if len(found) == 1 else None


def _header_crc(head: bytes, at: int) -> int:
    return zlib.crc32(head[at + 8 :], zlib.crc32(PLACEHOLDER.encode(), zlib.crc32(head[:at])))


def seal_bytes(data: bytes) -> bytes:
    """``data`` (a file whose metadata has the header checksum key, e.g. from
    :func:`checksummed`) with that checksum's value computed and filled in."""
    (n,) = struct.unpack("<Q", data[:8])
    head = bytearray(data[: 8 + n])
    at = _value_offset(head)
    if at is None:
        raise ValueError("the header checksum's placeholder is missing")
    head[at : at + 8] = f"{_header_crc(head, at):08x}".encode()
    return bytes(head) + data[8 + n :]


def seal_file(path: str) -> None:
    """:func:`seal_bytes` in place, for a file on disk (rewrites 8 bytes of its header)."""
    with open(path, "rb+") as f:
        prefix = f.read(8)
        (n,) = struct.unpack("<Q", prefix)
        head = prefix + f.read(n)
        at = _value_offset(head)
        if at is None:
            raise ValueError("the header checksum's placeholder is missing")
        f.seek(at)
        f.write(f"{_header_crc(head, at):08x}".encode())


def damaged(path: Path, what: str) -> CacheFileError:
    return CacheFileError(
        f"{path} is damaged ({what}): its bytes changed after it was written; "
        "nothing was loaded: delete it or rebuild it (mlxcc cache-prompt)"
    )


def header_checksums(path: Path, raw: bytes, metadata: dict[str, str], names) -> dict[str, int] | None:
    """The tensors' checksums a header declares, after checking the header's own
    (``raw``: the JSON header bytes; ``names``: its tensors); None when it carries
    none. A header with one key and not the other, a malformed value, or a sum
    that does not match raises :func:`damaged`."""
    has = (HEADER_KEY in metadata, TENSORS_KEY in metadata)
    if not any(has):
        return None
    if not all(has):
        raise damaged(path, "one of its two checksums is missing")
    head = struct.pack("<Q", len(raw)) + raw
    at = _value_offset(head)
    value = metadata[HEADER_KEY]
    if at is None or not _HEX.fullmatch(value) or head[at : at + 8] != value.encode():
        raise damaged(path, "its header checksum is malformed")
    if _header_crc(head, at) != int(value, 16):
        raise damaged(path, "the header does not match its checksum")
    try:
        sums = json.loads(metadata[TENSORS_KEY])
    except (ValueError, RecursionError):
        sums = None
    if not isinstance(sums, dict) or set(sums) != set(names) or not (
        set(map(type, sums.values())) <= {str} and set(map(len, sums.values())) <= {8}
        and _HEXES.fullmatch("".join(sums.values()))
    ):
        raise damaged(path, "its tensor checksums do not list its tensors")
    return {k: int(v, 16) for k, v in sums.items()}
