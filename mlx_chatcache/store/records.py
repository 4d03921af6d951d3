"""Records: JSON documents the store keeps beside caches (a stored response), one value kind.

Contract
--------
A record is keyed ``"r" + its id`` (:func:`~.chain.record_key`) and serialized as a
safetensors file with no tensors: its metadata holds the format's name, the key and
the document as JSON, sealed by the header checksum every cache file carries
(:mod:`mlx_chatcache.files.checksum`), so one flipped byte anywhere is found. The
same bytes sit in the memory tier, in a disk tier's folder (``KEY.safetensors``)
and in Redis, as other values do; tiers keep only ``data``.

- :func:`encode_record` ``(key, document)``: the bytes (document: any JSON object);
- :func:`decode_record` ``(key, data)``: the :class:`Record` those bytes hold;
  CacheFormatError (a ChatCacheError) when they are damaged, are not a record, or
  are the record of another key.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

from ..errors import CacheFileError, CacheFormatError
from ..files.checksum import checksummed, seal_bytes
from ..files.safetensors_file import read_header_bytes

FORMAT = "mlxcc-record"
VERSION = "1"


@dataclass(frozen=True)
class Record:
    """A checked record: its key, bytes and document."""

    key: str
    data: bytes
    document: dict


def encode_record(key: str, document: dict) -> bytes:
    """The bytes of the record ``key`` holding ``document``."""
    meta = checksummed({}, {"mlxcc.record": FORMAT, "mlxcc.record_version": VERSION, "store.key": key,
                            "record": json.dumps(document, ensure_ascii=False, separators=(",", ":"))})  # fmt: skip
    header = json.dumps({"__metadata__": meta}, separators=(",", ":")).encode()
    return seal_bytes(struct.pack("<Q", len(header)) + header)


def decode_record(key: str, data: bytes) -> Record:
    """The record ``key`` in ``data`` (see the module doc)."""
    try:
        header = read_header_bytes(data, f"store record {key}")
    except CacheFileError as e:
        raise CacheFormatError(str(e)) from None
    meta = header.metadata
    if (header.checksums is None or header.tensors or meta.get("mlxcc.record") != FORMAT
            or meta.get("mlxcc.record_version") != VERSION or meta.get("store.key") != key):  # fmt: skip
        raise CacheFormatError(f"store record {key} is not that record")
    try:
        document = json.loads(meta.get("record", ""))
    except (ValueError, RecursionError):
        document = None
    if not isinstance(document, dict):
        raise CacheFormatError(f"store record {key} holds no JSON object")
    return Record(key, data, document)


__all__ = ["Record", "decode_record", "encode_record"]
