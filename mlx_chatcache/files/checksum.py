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
sums, which :func:`check_tensors` compares with each array read. :func:`crc32` is
the project's one checksum (the Redis tier checks its chunks with it too): it finds
damage, it does not authenticate (anyone can recompute it).
"""

from __future__ import annotations

import json
import os
import re
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
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
PARALLEL_BYTES = 16 << 20  # below this a thread pool costs more than it saves
MAX_THREADS = 8
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


def live_crc32(a: mx.array, tokens: int) -> int:
    """CRC32 of the first ``tokens`` slots (axis 2) of the 4-D array ``a``, in
    row order: the bytes a file holding exactly those slots stores."""
    import numpy as np

    rows = a.shape[0] * a.shape[1]
    flat = np.frombuffer(memoryview(a).cast("B"), dtype=np.uint8).reshape(rows, -1)
    real = flat.shape[1] // a.shape[2] * tokens
    crc = 0
    for r in range(rows):
        crc = crc32(flat[r, :real], crc)
    return crc


def arrays_crc32(arrays: list[mx.array]) -> list[int]:
    """:func:`array_crc32` of each array, spread over threads when there is enough
    to share (zlib releases the GIL; mlx is only touched on this thread)."""
    views = [memoryview(a) for a in arrays]
    if any(not v.c_contiguous for v in views):
        return [array_crc32(a) for a in arrays]
    workers = min(len(views), os.cpu_count() or 1, MAX_THREADS)
    if workers < 2 or sum(v.nbytes for v in views) < PARALLEL_BYTES:
        return [crc32(v) for v in views]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(crc32, views))


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


def check_file_tensors(path: Path, data_start: int, ranges: dict[str, tuple[int, int]],
                       expected: dict[str, int]) -> None:  # fmt: skip
    """:func:`check_tensors` over the file's own bytes (``ranges``: each tensor's byte range in
    the data section), one tensor at a time and without MLX: for commands that only inspect."""
    with open(path, "rb") as f:
        for name, (begin, end) in ranges.items():
            f.seek(data_start + begin)
            if crc32(f.read(end - begin)) != expected[name]:
                raise damaged(path, f"tensor {name!r} does not match its checksum")


def check_tensors(path: Path, arrays: dict[str, mx.array], expected: dict[str, int]) -> None:
    """Raise :func:`damaged` unless each array read as ``name`` has the checksum ``expected[name]``."""
    names = list(arrays)
    for name, got in zip(names, arrays_crc32([arrays[n] for n in names])):
        if got != expected[name]:
            raise damaged(path, f"tensor {name!r} does not match its checksum")
