"""Reading K/V arrays straight into buffers with room to grow.

A cache file holds exactly the tokens a cache holds; a loaded K/V cache then
needs room for the next tokens. :class:`GrownView` lets ``mx.load`` read the
file as if chosen 4-D tensors had more slots on axis 2: it presents a header
with the larger shapes and serves each tensor's bytes row by row (one row per
batch and head: the file's tokens, then zeros for the room) straight into the
buffer ``mx.load`` hands it (``readinto``). So room is made at load in the one
allocation and the one pass over the data that loading costs anyway; no copy
follows at the first update. The reader (:func:`.safetensors_file.read_arrays`)
makes room only where it at most doubles an array.

:func:`live_crc32` is the CRC32 of the file bytes of such an array (its rows
without the room), to check it against the file's checksum.
"""

from __future__ import annotations

import io
import json
import math
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:
    from .safetensors_file import Header

_ZERO_CHUNK = bytes(1 << 16)


class SafetensorsStream(io.RawIOBase):
    """A read-only, seekable safetensors stream made up for ``mx.load``: a header
    listing ``entries`` over ``data_size`` bytes (:meth:`_lay_out`), then data its
    subclass serves in ``readinto``."""

    def _lay_out(self, entries: dict, data_size: int) -> None:
        head = json.dumps(entries, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)
        self.head = len(head).to_bytes(8, "little") + head
        self.size, self.pos = len(self.head) + data_size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos


class GrownView(SafetensorsStream):
    """A read-only, seekable view of the safetensors data in ``source`` (from
    ``header``) in which each tensor named in ``slots`` has that many slots on
    axis 2 (at least its own), the extra ones zero. Only what ``mx.load`` needs."""

    def __init__(self, source: BinaryIO, header: Header, slots: dict[str, int]):
        self.source = source
        entries, self.parts, at = {}, [], 0
        for t in sorted(header.tensors.values(), key=lambda t: t.begin):
            shape, rows = list(t.shape), 1  # a tensor read as it is: one row
            if t.name in slots and len(shape) == 4 and slots[t.name] > shape[2]:
                shape[2], rows = slots[t.name], shape[0] * shape[1]
            size = math.prod(shape) * t.itemsize
            row_virtual = size // rows if rows else 0
            row_real = (t.end - t.begin) // rows if rows else 0
            self.parts.append((at, at + size, header.data_start + t.begin, row_real, row_virtual))
            entries[t.name] = {"dtype": t.dtype, "shape": shape, "data_offsets": [at, at + size]}
            at += size
        self._lay_out(entries, at)

    def readinto(self, buffer) -> int:
        out = memoryview(buffer).cast("B")
        n = min(len(out), max(0, self.size - self.pos))
        done = 0
        while done < n:
            done += self._fill(out[done:n], self.pos + done)
        self.pos += n
        return n

    def _fill(self, out: memoryview, at: int) -> int:
        """Write what lies at virtual offset ``at`` into ``out``; bytes written (> 0)."""
        head = len(self.head)
        if at < head:
            k = min(len(out), head - at)
            out[:k] = self.head[at : at + k]
            return k
        at -= head
        for begin, end, file_at, row_real, row_virtual in self.parts:
            if begin <= at < end:
                row, col = divmod(at - begin, row_virtual)
                if col < row_real:
                    k = min(len(out), row_real - col)
                    self._read_exactly(out[:k], file_at + row * row_real + col)
                else:
                    k = min(len(out), row_virtual - col, len(_ZERO_CHUNK))
                    out[:k] = _ZERO_CHUNK[:k]
                return k
        raise OSError("read past the end of the cache file's arrays")

    def _read_exactly(self, out: memoryview, file_at: int) -> None:
        self.source.seek(file_at)
        got = 0
        while got < len(out):
            k = self.source.readinto(out[got:])
            if not k:
                raise OSError("the cache file ended early")
            got += k
