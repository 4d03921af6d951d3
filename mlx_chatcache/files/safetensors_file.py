"""Reading and writing safetensors files defensively.

``read_header`` parses and validates the header of a file a stranger may have
handed us: the declared header size, JSON, dtypes, shapes and byte ranges are all
checked against the real file size before a byte of tensor data is read, so a
lying header can neither crash the process nor make it allocate more than the
file holds. ``read_header_bytes`` does the same for a file held in memory (a
store value). ``host_tensors`` then reads the tensors of exactly the file whose
header was validated (same device, inode, size and mtime) into host buffers,
with room to grow where asked, and ``read_arrays`` makes MLX arrays of them.

A header carrying checksums (:mod:`.checksum`) is checked against its own
when it is parsed, and every tensor read against its checksum where its bytes
landed, before anything becomes an MLX array.

Writing (atomic: temp file + fsync + rename) lives in :mod:`.atomic`.
A file that does not start like a safetensors file (a text file) is refused
as "not a safetensors file", not by its byte counts.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, NamedTuple

import numpy as np

from ..errors import CacheFileError, CacheFormatError, clipped
from .checksum import crc32, damaged, header_checksums

if TYPE_CHECKING:  # mlx loads when arrays are read or written: parsing a header needs none
    import mlx.core as mx

MAX_HEADER_BYTES = 64 << 20
MAX_DIMS = 8
MAX_DIM = 2**31 - 1  # mlx shapes are int32
_PREADV = hasattr(os, "preadv")
_IOV_MAX = 512  # buffers per scatter read (within every system's IOV_MAX)

# safetensors dtype -> (bytes per element, the name of the mlx dtype to read it as)
DTYPES: dict[str, tuple[int, str]] = {
    "F32": (4, "float32"),
    "F16": (2, "float16"),
    "BF16": (2, "bfloat16"),
    "U32": (4, "uint32"),
    "I32": (4, "int32"),
    "U16": (2, "uint16"),
    "I16": (2, "int16"),
    "U8": (1, "uint8"),
    "I8": (1, "int8"),
    "U64": (8, "uint64"),
    "I64": (8, "int64"),
    "BOOL": (1, "bool_"),
}
# the NumPy dtype a tensor is read into on the host (bfloat16, which NumPy lacks, as its bits)
NUMPY_DTYPES = {name: np.dtype("uint16" if name == "BF16" else mlx) for name, (_, mlx) in DTYPES.items()}


class TensorEntry(NamedTuple):
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte range inside the data section
    end: int

    @property
    def itemsize(self) -> int:
        """Bytes per element of its dtype."""
        return DTYPES[self.dtype][0]


@dataclass(frozen=True)
class Header:
    path: Path
    tensors: dict[str, TensorEntry]  # in file order
    metadata: dict[str, str]
    data_start: int  # file offset of the data section
    file_size: int
    identity: tuple = ()  # (st_dev, st_ino, st_size, st_mtime_ns) of the validated file
    data: bytes | None = field(default=None, repr=False)  # the whole file, when it was read from memory
    checksums: dict[str, int] | None = None  # each tensor's CRC32, when the file carries them (verified header)
    checked: bool = False  # its tensors were checked against their checksums already (a store value)


def _bad(path: Path, what: str) -> CacheFileError:
    return CacheFileError(
        f"{path} is not a valid cache file ({clipped(what, 200)}); it may be truncated or damaged: "
        "delete it or rebuild it (mlxcc cache-prompt)"
    )


def read_header(path: str | os.PathLike) -> Header:
    """Parse and validate the safetensors header of ``path``."""
    path = Path(path)
    if path.is_dir():
        raise CacheFileError(f"{path} is a folder, not a cache file; give the path of a .safetensors file in it")
    if not path.is_file():
        raise CacheFileError(f"cache file not found: {path}; check the path")
    with open(path, "rb") as f:
        return _header_of_open(f, path)


def _header_of_open(f, path: Path) -> Header:
    """The validated header of the open file ``f`` (named ``path``), with its identity."""
    identity = _identity(os.fstat(f.fileno()))
    f.seek(0)
    head = f.read(9)
    if not _looks_like_safetensors(head):
        raise not_safetensors(path)
    n = _declared_header_size(path, head[:8], identity[2])
    f.seek(8)
    raw = f.read(n)
    if len(raw) != n:
        raise _bad(path, "the file ended early")
    return _parse_header(path, raw, identity[2], identity)


def read_header_bytes(data: bytes, name: str) -> Header:
    """Parse and validate the header of a safetensors file held in memory
    (``name`` stands for its path in messages); :func:`read_arrays` then reads
    the arrays from ``data`` itself."""
    path = Path(name)
    if not _looks_like_safetensors(data[:9]):
        raise not_safetensors(path)
    raw = data[8 : 8 + _declared_header_size(path, data[:8], len(data))]
    return replace(_parse_header(path, raw, len(data)), data=data)


def _declared_header_size(path: Path, head: bytes, size: int) -> int:
    if len(head) < 8:
        raise _bad(path, f"only {size} bytes")
    (n,) = struct.unpack("<Q", head)
    if n > size - 8 or n > MAX_HEADER_BYTES:
        raise _bad(path, f"header declares {n} bytes but the file has {size}")
    return n


def _parse_header(path: Path, raw: bytes, size: int, identity: tuple = ()) -> Header:
    """The validated header whose JSON is ``raw``, of a file of ``size`` bytes."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):  # bad UTF-8 or JSON, too-long integers, deep nesting
        raise _bad(path, "header is not JSON") from None
    if not isinstance(header, dict):
        raise _bad(path, "header is not a JSON object")
    metadata = _parse_metadata(path, header.pop("__metadata__", None) or {})
    data_len = size - 8 - len(raw)
    tensors = {name: _parse_entry(path, name, e, data_len) for name, e in header.items()}
    _check_ranges(path, tensors, data_len)
    tensors = dict(sorted(tensors.items(), key=lambda x: x[1].begin))  # in file order
    sums = header_checksums(path, raw, metadata, tensors)
    return Header(path, tensors, metadata, 8 + len(raw), size, identity, checksums=sums)


def _looks_like_safetensors(head: bytes) -> bool:
    """Whether the first 9 bytes can start a safetensors file: an 8-byte header
    length (checked against the file later), then the header's opening brace."""
    if len(head) < 9:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return n >= 2 and head[8:9] == b"{"


def not_safetensors(path: Path) -> CacheFileError:
    return CacheFormatError(
        f"{path} is not a safetensors file (it does not start with a safetensors header); "
        "pass a prompt cache file made by mlxcc or mlx-lm"
    )


def _identity(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _parse_metadata(path: Path, meta) -> dict[str, str]:
    if not isinstance(meta, dict) or not {*map(type, meta), *map(type, meta.values())} <= {str}:
        raise _bad(path, "metadata is not a string-to-string map")
    try:  # JSON escapes can smuggle in lone surrogates, which no file can hold
        "".join(meta).encode("utf-8"), "".join(meta.values()).encode("utf-8")
    except UnicodeEncodeError:
        raise _bad(path, "metadata is not valid Unicode") from None
    return meta


_ENTRY_FIELDS = {"dtype", "shape", "data_offsets"}


def _parse_entry(path: Path, name: str, e, data_len: int) -> TensorEntry:
    if type(e) is not dict or e.keys() != _ENTRY_FIELDS:
        raise _bad(path, f"tensor {name!r} entry is malformed")
    dtype, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
    if type(dtype) is not str or dtype not in DTYPES:
        raise _bad(path, f"tensor {name!r} has unsupported dtype {dtype!r}")
    nbytes = DTYPES[dtype][0]
    if type(shape) is not list or len(shape) > MAX_DIMS:
        raise _bad(path, f"tensor {name!r} has an invalid shape")
    for d in shape:
        if type(d) is not int or not 0 <= d <= MAX_DIM:
            raise _bad(path, f"tensor {name!r} has an invalid shape")
        nbytes *= d
    if type(offs) is not list or len(offs) != 2 or type(offs[0]) is not int or type(offs[1]) is not int:
        raise _bad(path, f"tensor {name!r} has invalid data offsets")
    begin, end = offs
    if not 0 <= begin <= end <= data_len or end - begin != nbytes:
        raise _bad(path, f"tensor {name!r} byte range {offs} does not fit its shape or the file")
    return TensorEntry(name, dtype, tuple(shape), begin, end)


def _check_ranges(path: Path, tensors: dict[str, TensorEntry], data_len: int) -> None:
    pos = 0
    for t in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if t.begin != pos:
            raise _bad(path, f"tensor {t.name!r} overlaps another or leaves a gap")
        pos = t.end
    if pos != data_len:
        raise _bad(path, f"data section has {data_len - pos} unexplained bytes")


def read_arrays(header: Header, names=None, slots: dict[str, int] | None = None) -> dict[str, mx.array]:
    """Read the tensors ``names`` (default: all) of a validated header as evaluated MLX arrays.

    ``slots``: tensor name -> slots on axis 2 to read that 4-D tensor into (room to
    grow after its own, zeroed). Room larger than the tensor's own slots is not made
    (a file never makes the reader allocate more than twice its bytes): such a
    tensor is read as it is.

    Each tensor's bytes are read into a host buffer (:func:`host_tensors`), checked
    there, and then become an MLX array: one read, one copy into the device's memory,
    whatever the device; one host buffer at a time.
    """
    import mlx.core as mx

    out = {}
    for name, host in host_tensors(header, names, slots):
        a = mx.array(host)
        out[name] = a.view(mx.bfloat16) if header.tensors[name].dtype == "BF16" else a
    mx.eval(list(out.values()))
    return out


def host_tensors(header: Header, names=None, slots: dict[str, int] | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, array)`` of each tensor ``names`` of a validated header, in turn, as a NumPy
    array (bfloat16 as its 16 bits) with ``slots`` as :func:`read_arrays` takes them, checked
    against the file's checksum (when it carries them, and is not ``checked``) where its
    bytes landed.

    A file is opened once and checked to be the one ``read_header`` validated (a file
    replaced or rewritten since is refused); its data is read with scatter reads
    (``os.preadv``) straight into the buffers' rows. A header read from memory
    (:func:`read_header_bytes`) is copied from its bytes."""
    names = list(header.tensors) if names is None else list(names)
    slots = {n: k for n, k in (slots or {}).items()
             if n in names and len(header.tensors[n].shape) == 4 and _room_ok(header.tensors[n].shape[2], k)}
    path = header.path
    need, limit = sum(_bytes_read(header.tensors[n], slots.get(n)) for n in names), memory_limit()
    if limit and need > limit:  # e.g. a sparse file: huge apparent size, no content; never allocate that
        raise CacheFileError(
            f"{path} holds {need / 1e9:.1f} GB of arrays (with room to grow), more than this machine's "
            f"memory ({limit / 1e9:.1f} GB): it cannot be loaded here (or it is damaged)"
        )
    with _source(header) as fill:
        for n in names:
            t = header.tensors[n]
            buf = _buffer(t, slots.get(n))
            rows = _live_rows(buf, t)
            fill(t, rows)
            if header.checksums is not None and not header.checked:
                crc = 0
                for row in rows:
                    crc = crc32(row, crc)
                if crc != header.checksums[n]:
                    raise damaged(path, f"tensor {n!r} does not match its checksum")
            yield n, buf


@contextmanager
def _source(header: Header):
    """``fill(tensor, rows)``, which copies a tensor's bytes into ``rows`` in order, from
    the header's bytes or its file (open meanwhile, and checked unchanged around it)."""
    if header.data is not None:
        data = memoryview(header.data)

        def copy(t: TensorEntry, rows: list[memoryview]) -> None:
            at = header.data_start + t.begin
            for row in rows:
                row[:] = data[at : at + row.nbytes]
                at += row.nbytes

        yield copy
        return
    path, changed = header.path, "the file changed since its header was read; load it again"
    try:
        with open(path, "rb", buffering=0) as f:
            if header.identity and _identity(os.fstat(f.fileno())) != header.identity:
                raise _bad(path, changed)
            yield lambda t, rows: _read_exactly_into(f, header.data_start + t.begin, [r for r in rows if r.nbytes], path)
            if header.identity and _identity(os.fstat(f.fileno())) != header.identity:
                raise _bad(path, changed)
    except OSError as e:  # the file vanished, an I/O error
        raise _bad(path, f"file shrank or changed while reading: {e}") from None


def check_data(header: Header) -> Header:
    """``header`` (checksummed, read from memory: :func:`read_header_bytes`), marked ``checked``
    once every tensor matched its checksum where its bytes are (no copy)."""
    data = memoryview(header.data)
    for name, t in header.tensors.items():
        if crc32(data[header.data_start + t.begin : header.data_start + t.end]) != header.checksums[name]:
            raise damaged(header.path, f"tensor {name!r} does not match its checksum")
    return replace(header, checked=True)


def _buffer(t: TensorEntry, slots: int | None) -> np.ndarray:
    """A host buffer for tensor ``t`` (with ``slots`` on axis 2: the room after its own zeroed)."""
    shape = t.shape if slots is None else (*t.shape[:2], slots, *t.shape[3:])
    buf = np.empty(shape, dtype=NUMPY_DTYPES[t.dtype])
    if slots is not None:
        buf[:, :, t.shape[2] :] = 0
    return buf


def _live_rows(buf: np.ndarray, t: TensorEntry) -> list[memoryview]:
    """The bytes of ``buf`` that tensor ``t``'s file bytes go to, in file order (one row
    per index of the first two axes when ``buf`` has room, else one)."""
    if not buf.nbytes:
        return []
    flat = memoryview(buf).cast("B")
    if buf.shape == t.shape:
        return [flat]
    step, live = flat.nbytes // (t.shape[0] * t.shape[1]), t.end - t.begin
    live //= t.shape[0] * t.shape[1]
    return [flat[r : r + live] for r in range(0, flat.nbytes, step)]


def _read_exactly_into(f, offset: int, bufs: list[memoryview], path: Path) -> None:
    """Fill ``bufs`` in order from ``offset`` of the open file ``f``."""
    bufs, i = list(bufs), 0
    while i < len(bufs):
        if _PREADV:
            got = os.preadv(f.fileno(), bufs[i : i + _IOV_MAX], offset)
        else:
            f.seek(offset)
            got = f.readinto(bufs[i])
        if not got:
            raise _bad(path, "the file shrank or changed while reading: it ended early")
        offset += got
        while got:
            if got >= bufs[i].nbytes:
                got -= bufs[i].nbytes
                i += 1
            else:
                bufs[i], got = bufs[i][got:], 0


def _room_ok(own: int, slots: int) -> bool:
    return own < slots <= 2 * own


def _bytes_read(t: TensorEntry, slots: int | None) -> int:
    """Bytes the array of ``t`` takes once read (into ``slots`` on axis 2 when given)."""
    return (t.end - t.begin) if slots is None else (t.end - t.begin) // t.shape[2] * slots


def memory_limit() -> int | None:
    """Bytes of memory this process can have at most: physical RAM, or the
    cgroup (container) limit when lower; None if unknown."""
    limits = []
    try:
        limits.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        pass
    for f in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            v = Path(f).read_text().strip()
        except OSError:
            continue
        if v.isdigit():
            limits.append(int(v))
    limits = [v for v in limits if v > 0]
    return min(limits) if limits else None
