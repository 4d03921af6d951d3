"""Reading and writing safetensors files defensively.

``read_header`` parses and validates the header of a file a stranger may have
handed us: the declared header size, JSON, dtypes, shapes and byte ranges are all
checked against the real file size before a byte of tensor data is read, so a
lying header can neither crash the process nor make it allocate more than the
file holds. ``read_arrays`` then reads the tensors of exactly the file whose
header was validated (same device, inode, size and mtime) with ``mx.load``,
which reads straight into the arrays (one copy, like mlx-lm's loader), and
checks every array's shape and dtype against the validated header.

A header carrying checksums (:mod:`.checksum`) is checked against its own
when it is parsed, and every array read against its tensor's checksum.

``read_header_bytes`` does the same for a file held in memory (a value from a
remote store): same checks, no file.

``read_into`` reads a checksummed file's tensors straight into buffers of the
caller's (rows of a larger array: a store puts a cache together from block
files with it), in scatter reads, then checks them where they landed;
``start_read_into`` does the header part now and hands back the reading and
checking, for another thread.

Writing (atomic: temp file + fsync + rename) lives in :mod:`.atomic`.
A file that does not start like a safetensors file (a text file) is refused
as "not a safetensors file", not by its byte counts.
"""

from __future__ import annotations

import io
import json
import math
import os
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..errors import CacheFileError, CacheFormatError, clipped
from .checksum import check_tensors, crc32, damaged, header_checksums, live_crc32
from .grown_read import GrownView

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


@dataclass(frozen=True)
class TensorEntry:
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
    table: dict | None = field(default=None, repr=False, compare=False)  # the JSON ``tensors`` were read from


def _bad(path: Path, what: str) -> CacheFileError:
    return CacheFileError(
        f"{path} is not a valid cache file ({clipped(what, 200)}); it may be truncated or damaged: "
        "delete it or rebuild it (mlxcc cache-prompt)"
    )


def read_header(path: str | os.PathLike) -> Header:
    """Parse and validate the safetensors header of ``path``."""
    path = Path(path)
    if not path.is_file():
        raise CacheFileError(f"cache file not found: {path}; check the path")
    with open(path, "rb") as f:
        return _header_of_open(f, path)


def _header_of_open(f, path: Path, like: Header | None = None) -> Header:
    """The validated header of the open file ``f`` (named ``path``), with its identity
    (``like``: :func:`_parse_header`)."""
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
    return _parse_header(path, raw, identity[2], identity, like)


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


def _parse_header(path: Path, raw: bytes, size: int, identity: tuple = (), like: Header | None = None) -> Header:
    """The validated header whose JSON is ``raw``, of a file of ``size`` bytes. A tensor
    table equal to that of ``like`` (a header validated before, over as many data bytes)
    validates the same: the result shares ``like.tensors``. Equal means exactly: a JSON
    fraction is parsed as :class:`_Fraction` (never equal to an int) and a header that
    spells ``true`` or ``false`` anywhere is validated on its own."""
    try:
        header = json.loads(raw.decode("utf-8"), parse_float=_Fraction)
    except (ValueError, RecursionError):  # bad UTF-8 or JSON, too-long integers, deep nesting
        raise _bad(path, "header is not JSON") from None
    if not isinstance(header, dict):
        raise _bad(path, "header is not a JSON object")
    metadata = _parse_metadata(path, header.pop("__metadata__", None) or {})
    n = len(raw)
    data_len = size - 8 - n
    if (like is not None and like.file_size - like.data_start == data_len and like.table == header
            and b"true" not in raw and b"false" not in raw):  # fmt: skip
        tensors = like.tensors
    else:
        tensors = {name: _parse_entry(path, name, e, data_len) for name, e in header.items()}
        _check_ranges(path, tensors, data_len)
        tensors = dict(sorted(tensors.items(), key=lambda x: x[1].begin))  # in file order
    sums = header_checksums(path, raw, metadata, tensors)
    return Header(path, tensors, metadata, 8 + n, size, identity, checksums=sums, table=header)


class _Fraction(str):
    """A JSON number with a fraction or an exponent, kept as its text: no header field
    may hold one (each check refuses its type), and it never equals an int."""


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


def _parse_entry(path: Path, name: str, e, data_len: int) -> TensorEntry:
    if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
        raise _bad(path, f"tensor {name!r} entry is malformed")
    dtype, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise _bad(path, f"tensor {name!r} has unsupported dtype {dtype!r}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(type(d) is int and 0 <= d <= MAX_DIM for d in shape)
    ):
        raise _bad(path, f"tensor {name!r} has an invalid shape")
    if not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int for o in offs):
        raise _bad(path, f"tensor {name!r} has invalid data offsets")
    begin, end = offs
    nbytes = math.prod(shape) * DTYPES[dtype][0]
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
    """Read (and evaluate) the tensors ``names`` (default: all) of a validated header.

    ``slots``: tensor name -> slots on axis 2 to read that 4-D tensor into
    (room to grow after its own, zeroed; see :mod:`.grown_read`): one
    allocation and one pass, as without room. Room larger than the tensor's
    own slots is not made (a file never makes the reader allocate more than
    twice its bytes): such a tensor is read as it is.

    The file is opened once and checked to be the one ``read_header`` validated
    (a file replaced or rewritten since is refused). ``mx.load`` then reads it
    through ``/proc/self/fd`` (the same open file, not the path, where /proc
    exists) directly into the arrays: about 1.7x faster than reading each range
    into a bytes object and copying it into an mx.array. Its own header parse
    must agree with ours on every tensor's shape and dtype.
    """
    import mlx.core as mx

    names = list(header.tensors) if names is None else list(names)
    if not names:
        return {}
    slots = {n: k for n, k in (slots or {}).items()
             if n in names and len(header.tensors[n].shape) == 4 and _room_ok(header.tensors[n].shape[2], k)}
    path = header.path
    need, limit = sum(_bytes_read(header.tensors[n], slots.get(n)) for n in names), memory_limit()
    if limit and need > limit:  # e.g. a sparse file: huge apparent size, no content; never allocate that
        raise CacheFileError(
            f"{path} holds {need / 1e9:.1f} GB of arrays (with room to grow), more than this machine's "
            f"memory ({limit / 1e9:.1f} GB): it cannot be loaded here (or it is damaged)"
        )
    if header.data is not None:
        return _read_arrays_bytes(header, names, slots)
    changed = "the file changed since its header was read; load it again"
    try:
        with open(path, "rb", buffering=0) as f:
            if header.identity and _identity(os.fstat(f.fileno())) != header.identity:
                raise _bad(path, changed)
            proc = f"/proc/self/fd/{f.fileno()}"
            if slots:
                loaded = mx.load(GrownView(f, header, slots), format="safetensors")
            else:
                loaded = mx.load(proc if os.path.exists(proc) else str(path), format="safetensors")
            out = _checked_arrays(header, names, loaded, changed, slots)
            if header.identity and _identity(os.fstat(f.fileno())) != header.identity:
                raise _bad(path, changed)
    except (RuntimeError, ValueError, OSError) as e:  # short read, file vanished, ...
        raise _bad(path, f"file shrank or changed while reading: {e}") from None
    return out


def read_into(path: str | os.PathLike, place: Callable[[Header], list[list[memoryview]]]) -> Header:
    """Read the tensors of the safetensors file ``path`` into the caller's buffers:
    :func:`start_read_into`, then its ``finish()``, on this thread."""
    return start_read_into(path, place).finish()


def start_read_into(path: str | os.PathLike, place: Callable[[Header], list[list[memoryview]]],
                    like: Header | None = None) -> PendingRead:  # fmt: skip
    """Open ``path`` and validate its header; the :class:`PendingRead` returned reads the data.

    The header is parsed and validated as :func:`read_header` does and must carry
    checksums (``like``: a header validated before, whose tensor table this file's
    is expected to equal, e.g. the previous block file of one cache: an equal one
    is not validated again, and the header shares ``like.tensors``).
    ``place(header)`` gives, for each tensor in file order (``header.tensors``), the
    buffers it is read into (it may raise to refuse the header): writable byte buffers
    (``memoryview`` of format ``B``) whose sizes add up to the tensor's bytes, taken in
    order. A file that is short, lacks checksums or does not fit the buffers
    raises CacheFileError; one that cannot be opened or read (gone, too many open files,
    an I/O error) raises the OSError: its bytes are not known to be wrong. The file is
    closed either way.
    """
    path = Path(path)
    f = open(path, "rb", buffering=0)
    try:
        header = _header_of_open(f, path, like)
        if header.checksums is None:
            raise damaged(path, "it carries no checksums")
        dest = place(header)
        size = sum(b.nbytes for t in dest for b in t)
        if len(dest) != len(header.tensors) or size != header.file_size - header.data_start:
            raise _bad(path, "its tensors do not fit the buffers they are read into")
    except BaseException:
        f.close()
        raise
    return PendingRead(f, header, dest)


class PendingRead:
    """An open file whose header :func:`start_read_into` validated and placed.

    ``finish()`` (on any thread: reads and checksums free the GIL) reads the data
    section straight into the buffers with scatter reads (``os.preadv``: the one
    copy), checks each tensor against its checksum where it landed, closes the
    file and returns the header; a short read or a checksum that does not match
    raises CacheFileError, a read that fails the OSError (the buffers then hold
    part of the file). ``close()`` drops it unread."""

    def __init__(self, f, header: Header, dest: list[list[memoryview]]):
        self._f, self.header, self._dest = f, header, dest

    def finish(self) -> Header:
        header, path = self.header, self.header.path
        with self._f:
            _read_exactly_into(self._f, header.data_start, [b for t in self._dest for b in t if b.nbytes], path)
        for name, tensor in zip(header.tensors, self._dest):
            crc = 0
            for b in tensor:
                crc = crc32(b, crc)
            if crc != header.checksums[name]:
                raise damaged(path, f"tensor {name!r} does not match its checksum")
        return header

    def close(self) -> None:
        self._f.close()


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
            raise _bad(path, "the file ended early")
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


def _read_arrays_bytes(header: Header, names: list[str], slots: dict[str, int]) -> dict[str, mx.array]:
    import mlx.core as mx

    try:
        source = io.BytesIO(header.data)
        loaded = mx.load(GrownView(source, header, slots) if slots else source, format="safetensors")
        return _checked_arrays(header, names, loaded, "mlx read it differently", slots)
    except (RuntimeError, ValueError) as e:
        raise _bad(header.path, f"arrays could not be read: {e}") from None


def _checked_arrays(header: Header, names: list[str], loaded: dict, why: str,
                    slots: dict[str, int]) -> dict[str, mx.array]:  # fmt: skip
    """``loaded[name]`` for ``names``, each checked against the validated header
    (shape, with ``slots`` where given, dtype and, when it has them, checksum), evaluated."""
    import mlx.core as mx

    out = {}
    for name in names:
        t, a = header.tensors[name], loaded.get(name)
        shape = t.shape if name not in slots else (*t.shape[:2], slots[name], *t.shape[3:])
        if a is None or tuple(a.shape) != shape or a.dtype != getattr(mx, DTYPES[t.dtype][1]):
            raise _bad(header.path, why)
        out[name] = a
    mx.eval(list(out.values()))
    if header.checksums is not None:
        check_tensors(header.path, {n: a for n, a in out.items() if n not in slots}, header.checksums)
        for name in slots:
            if live_crc32(out[name], header.tensors[name].shape[2]) != header.checksums[name]:
                raise damaged(header.path, f"tensor {name!r} does not match its checksum")
    return out


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
