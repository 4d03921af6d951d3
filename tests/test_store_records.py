"""Records (stored responses) as one more value kind of the store: the key rule, one self-checking
serialization (every damaged byte found), and the tiers keeping them beside caches."""

from __future__ import annotations

import pytest

from mlx_chatcache.errors import ChatCacheError
from mlx_chatcache.store.chain import Chain, is_key, kinds, record_key
from mlx_chatcache.store.disk import DiskTier
from mlx_chatcache.store.records import Record, decode_record, encode_record
from mlx_chatcache.store.tiers import MemoryTier


DOC = {"response": {"id": "resp_" + "ab" * 16, "output": [{"text": "héllo 🙂"}]}, "history": [{"role": "user"}]}


def test_the_key_rule():
    key = record_key("0123456789abcdef" * 2)
    assert key == "r" + "0123456789abcdef" * 2 and is_key(key)
    for bad in ("", "0" * 31, "0" * 33, "G" * 32, "AB" * 16):
        with pytest.raises(ValueError):
            record_key(bad)
    chain = Chain("ns", list(range(200)), 64)
    assert kinds([key, *chain.blocks, chain.entry(150)]) == {"entries": 1, "blocks": 3, "records": 1}


def test_a_record_round_trips_and_names_its_key():
    key = record_key("1" * 32)
    data = encode_record(key, DOC)
    assert decode_record(key, data) == Record(key, data, DOC)
    with pytest.raises(ChatCacheError):
        decode_record(record_key("2" * 32), data)  # the bytes of another key


def test_every_damaged_byte_is_found():
    key = record_key("3" * 32)
    data = encode_record(key, DOC)
    for i in range(len(data)):
        for flip in (0x01, 0x80):
            damaged = bytearray(data)
            damaged[i] ^= flip
            with pytest.raises(ChatCacheError):
                decode_record(key, bytes(damaged))
    for cut in (0, 5, 8, len(data) - 1):
        with pytest.raises(ChatCacheError):
            decode_record(key, data[:cut])
    with pytest.raises(ChatCacheError):
        decode_record(key, data + b"\0")


def test_tiers_keep_records_beside_values(tmp_path):
    key = record_key("4" * 32)
    record = Record(key, encode_record(key, DOC), DOC)
    memory, disk = MemoryTier(1 << 20), DiskTier(tmp_path / "store", 1 << 20)
    for tier in (memory, disk):
        tier.put({key: record})
        assert tier.stats()["records"] == 1 and tier.stats()["entries"] == 0
    again = DiskTier(tmp_path / "store", 1 << 20)  # a restarted server
    assert again.has([key]) == [True] and decode_record(key, again.get([key])[0]).document == DOC
    assert (tmp_path / "store" / f"{key}.safetensors").exists()
