"""Cache file checksums: any damaged byte of a file of our format (tensor data or
header) is found on load, in one line, and nothing is changed; files written
before checksums existed still load; ``mlxcc cache info`` says which it is."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mlx_chatcache.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache
from mlx_chatcache.chat.session import ChatSession
from mlx_chatcache.cli.main import main
from mlx_chatcache.config import DEFAULTS
from mlx_chatcache.errors import CacheFileError
from mlx_chatcache.files.mlxcc_format import (
    FORMAT_VERSION,
    load_cache_file,
    load_prompt_cache,
    load_prompt_cache_bytes,
    prompt_cache_bytes,
    read_cache_info,
    save_prompt_cache,
    verify_cache_file,
)
from mlx_chatcache.files.checksum import HEADER_KEY, TENSORS_KEY

TOKENS = list(range(10))


def _cache():
    def kv(c, seed):
        c.update_and_fetch(mx.random.normal((1, 2, 10, 32), key=mx.random.key(seed)),
                           mx.random.normal((1, 2, 10, 32), key=mx.random.key(seed + 1)))  # fmt: skip
        return c

    arrays = ArraysCache(2)
    arrays[0] = mx.arange(12.0).reshape(1, 3, 4)
    return [kv(KVCache(), 0), kv(RotatingKVCache(8, 2), 2), kv(QuantizedKVCache(32, 8), 4), arrays]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``(path, bytes, cache)`` of a valid file of every common layer kind."""
    p = tmp_path_factory.mktemp("sums") / "c.safetensors"
    cache = _cache()
    save_prompt_cache(p, cache, tokens=TOKENS, metadata={"note": "x"})
    return p, p.read_bytes(), cache


def _split(data: bytes) -> tuple[int, dict]:
    (n,) = struct.unpack("<Q", data[:8])
    return n, json.loads(data[8 : 8 + n])


def _with_header(data: bytes, edit) -> bytes:
    n, h = _split(data)
    edit(h)
    new = json.dumps(h).encode()
    return struct.pack("<Q", len(new)) + new + data[8 + n :]


def test_files_carry_checksums_and_verify(saved):
    path, data, cache = saved
    _, h = _split(data)
    assert {HEADER_KEY, TENSORS_KEY} <= set(h["__metadata__"])
    assert read_cache_info(path).format_version == FORMAT_VERSION == 5
    assert verify_cache_file(path) is True
    assert load_prompt_cache_bytes(prompt_cache_bytes(cache, tokens=TOKENS), "mem")[1].tokens == TOKENS


def _damage(data: bytes, region: str, start: float, length: int, flip: bool, fill: bytes) -> bytes:
    n, _ = _split(data)
    lo, hi = {"header": (0, 8 + n), "data": (8 + n, len(data)), "any": (0, len(data))}[region]
    at = lo + int(start * (hi - lo - 1))
    out = bytearray(data)
    end = min(at + length, len(out))
    for k, i in enumerate(range(at, end)):
        b = fill[k % len(fill)]
        out[i] = out[i] ^ (b or 1) if flip else b
    return bytes(out)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    region=st.sampled_from(["header", "data", "any"]),
    start=st.floats(0, 1),
    length=st.integers(1, 4096),
    flip=st.booleans(),
    fill=st.binary(min_size=1, max_size=64),
)
def test_damage_anywhere_is_found(saved, tmp_path_factory, region, start, length, flip, fill):
    """Flipped or overwritten bytes at any offset and length, in the header or the
    data: load raises CacheFileError (from a path and from memory), never returns
    a cache, and the file is left as it was."""
    _, data, _ = saved
    bad = _damage(data, region, start, length, flip, fill)
    assume(bad != data)
    p = tmp_path_factory.mktemp("bad") / "bad.safetensors"
    p.write_bytes(bad)
    with pytest.raises(CacheFileError) as e:
        load_prompt_cache(p)
    assert "\n" not in str(e.value)
    with pytest.raises(CacheFileError):
        load_prompt_cache_bytes(bad, "mem")
    with pytest.raises(CacheFileError):
        verify_cache_file(p)
    assert p.read_bytes() == bad


def test_damaged_tensor_is_named(saved, tmp_path):
    path, data, _ = saved
    n, _ = _split(data)
    p = tmp_path / "bad.safetensors"
    p.write_bytes(_damage(data, "data", 0.5, 100, True, b"\xff"))
    with pytest.raises(CacheFileError, match=r"is damaged \(tensor 'layer\.\d\.\d' does not match its checksum\)"):
        load_prompt_cache(p)
    p.write_bytes(data[:-1] + bytes([data[-1] ^ 0x20]))
    with pytest.raises(CacheFileError, match="does not match its checksum"):
        load_prompt_cache(p)


def _strip(h, version="3"):
    h["__metadata__"].pop(HEADER_KEY)
    h["__metadata__"].pop(TENSORS_KEY)
    h["__metadata__"]["mlxcc.format_version"] = version


def test_files_without_checksums_still_load(saved, tmp_path):
    """A version 3 file (written before checksums) loads, the same cache; cache info says it has none."""
    _, data, cache = saved
    p = tmp_path / "v3.safetensors"
    p.write_bytes(_with_header(data, _strip))
    loaded, info = load_cache_file(p)
    assert info.format_version == 3 and info.tokens == TOKENS
    for a, b in zip(cache, loaded):
        for x, y in zip(a.flat_state(), b.flat_state()):
            assert mx.array_equal(x, y)
    assert verify_cache_file(p) is False


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda h: _strip(h, "4"), "carries checksums, this one has none"),
        (lambda h: h["__metadata__"].pop(HEADER_KEY), "one of its two checksums is missing"),
        (lambda h: h["__metadata__"].pop(TENSORS_KEY), "one of its two checksums is missing"),
        (lambda h: h["__metadata__"].update({HEADER_KEY: "zz"}), "header checksum is malformed"),
        (lambda h: h["__metadata__"].update({TENSORS_KEY: "{}"}), "header does not match"),
    ],
)
def test_missing_or_malformed_checksums_are_refused(saved, tmp_path, edit, match):
    _, data, _ = saved
    p = tmp_path / "bad.safetensors"
    p.write_bytes(_with_header(data, edit))
    with pytest.raises(CacheFileError, match=match):
        load_prompt_cache(p)


def test_cache_info_says_verified_none_or_the_error(saved, tmp_path, capsys):
    path, data, _ = saved
    assert main(["cache", "info", str(path)]) == 0
    out, _ = capsys.readouterr()
    assert "checksums:   verified" in out
    assert main(["cache", "info", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr()[0])["checksums"] == "verified"
    old = tmp_path / "v3.safetensors"
    old.write_bytes(_with_header(data, _strip))
    assert main(["cache", "info", str(old)]) == 0
    assert "checksums:   none (format version 3" in capsys.readouterr()[0]
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(_damage(data, "data", 0.3, 8, True, b"\x01"))
    assert main(["cache", "info", str(bad)]) != 0
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "does not match its checksum" in err


def _damaged_copy(path, tmp_path):
    data = path.read_bytes()
    bad = _damage(data, "data", 0.5, 100 << 10 if len(data) > 200 << 10 else 64, False, bytes(range(1, 256)))
    out = tmp_path / "damaged.safetensors"
    out.write_bytes(bad)
    return out, bad


def test_generate_refuses_a_damaged_prompt_cache_file(tiny_model_dirs, tmp_path, capsys):
    """Random bytes written in the middle of a named cache file: one error line,
    exit non-zero, no reply, the file unchanged (not rewritten by the save)."""
    model = str(tiny_model_dirs["llama"])
    f = tmp_path / "c.safetensors"
    assert main(["generate", "--model", model, "-p", "hello there", "-m", "4", "--save-prompt-cache", str(f)]) == 0
    capsys.readouterr()
    bad, data = _damaged_copy(f, tmp_path)
    argv = ["generate", "--model", model, "-p", "hello there, and more", "-m", "4", "--prompt-cache-file", str(bad)]
    assert main(argv) != 0
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "is damaged" in err, err
    assert bad.read_bytes() == data
    r = subprocess.run([sys.executable, "-m", "mlx_chatcache", *argv], capture_output=True, text=True, timeout=120)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode != 0 and r.stdout == "" and len(lines) == 1 and "is damaged" in lines[0], r.stderr
    assert bad.read_bytes() == data


def test_a_damaged_session_is_refused_and_left_alone(llama_model, tmp_path):
    model, tokenizer = llama_model
    s = ChatSession(model, tokenizer, system_prompt="Be short.", config=DEFAULTS.updated(max_tokens=4))
    s.ask("Hello!")
    path = tmp_path / "s.safetensors"
    s.save(path)
    bad, data = _damaged_copy(path, tmp_path)
    with pytest.raises(CacheFileError, match="is damaged"):
        ChatSession.load(bad, model, tokenizer).ask("And then?")
    assert bad.read_bytes() == data


def test_a_damaged_disk_tier_value_is_a_miss(llama_model, tmp_path):
    """A store value whose array bytes were overwritten (same size, header intact)
    is never served: the lookup misses and counts it corrupt."""
    from mlx_chatcache.files.prompt_cache import PromptCache
    from mlx_chatcache.generation.templates import feed_all
    from mlx_chatcache.store.disk import DiskTier
    from mlx_chatcache.store.store import PromptStore, make_scope

    model, _ = llama_model
    tokens = [3 + (i * 7) % 300 for i in range(20)]
    state = PromptCache.new(model)
    feed_all(model, state, tokens, 512)
    scope = make_scope(model.fingerprint, {"max_kv_size": None, "keep": 4})
    PromptStore([DiskTier(tmp_path, 1 << 30)]).put(scope, tokens, state.cache)
    (path,) = tmp_path.glob("e*.safetensors")  # 20 tokens: no full block, one entry value
    data = path.read_bytes()
    n, _ = _split(data)
    at = 8 + n + 16  # the first live token's K/V of the first tensor in the file
    path.write_bytes(data[:at] + bytes(64) + data[at + 64 :])
    assert path.read_bytes() != data
    store = PromptStore([DiskTier(tmp_path, 1 << 30)])
    assert store.checkout(scope, model, tokens + [9])[1] is None
    assert store.tiers[0].stats()["corrupt"] == 1 and not path.exists()


def test_a_lying_tensor_table_is_refused(saved, tmp_path):
    """A header whose tensor table lies (two tensors over one byte range; offsets
    written as floats, equal in Python; a 1 written as true; more data bytes than the
    tensors explain) is refused by the header parser, before any data is read."""
    from mlx_chatcache.files.safetensors_file import read_header

    p, data, _ = saved
    n, header = _split(data)
    a, b = "layer.0.0", "layer.0.1"  # the first layer's keys and values
    assert header[a]["dtype"] == header[b]["dtype"] and header[a]["shape"] == header[b]["shape"]
    lying = tmp_path / "lying.safetensors"

    def write(h, tail=b""):
        raw = json.dumps(h).encode()
        lying.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :] + tail)

    offsets = header[b]["data_offsets"]
    header[b]["data_offsets"] = header[a]["data_offsets"]
    write(header)
    with pytest.raises(CacheFileError, match="overlaps"):
        read_header(lying)
    header[b]["data_offsets"] = [float(o) for o in offsets]
    write(header)
    with pytest.raises(CacheFileError, match="invalid data offsets"):
        read_header(lying)
    header[b]["data_offsets"] = offsets
    assert header[b]["shape"][0] == 1
    header[b]["shape"][0] = True
    write(header)
    with pytest.raises(CacheFileError, match="invalid shape"):
        read_header(lying)
    header[b]["shape"][0] = 1
    write(header, tail=b"\0" * 4)
    with pytest.raises(CacheFileError, match="unexplained bytes"):
        read_header(lying)
