"""A seeded generator of bad cache files, and the checker the loader must pass.

Used by ``tests/test_fuzz_loader.py`` (a few thousand files per run) and by
``benchmarks/fuzz_long.py`` (any number). Importable on its own::

    seeds = build_seeds()                      # valid files, bytes in memory
    for case in generate(seeds, count, seed):  # FuzzCase(index, kind, seed_name, what, data)
        outcome = check_file(path_holding(case.data), workdir)

Seed files cover every layout and class we read: our format (KVCache,
RotatingKVCache wrapped and not, QuantizedKVCache, QuantizedRotatingKVCache,
ChunkedKVCache, ArraysCache with an empty slot, CacheList, empty layers, tokens,
messages, fingerprint, user metadata), mlx-lm 0.32 files written by mlx-lm itself
(KV, rotating, quantized, chunked, ArraysCache, CacheList) and files in the
mlx-lm <= 0.31 ("legacy") layout built from its documented shape.

Each generated file is one seed with one *mutation class* applied (see
``MUTATIONS``): truncations in every region, header-length lies, corrupted header
text, non-object / deeply nested / huge-number JSON, tensor entry lies (offsets,
shapes, dtypes, entries), header-consistent lies (reshapes, dtype swaps, swapped
tensors: they pass the safetensors checks and reach the cache classes), our
metadata lies (counts, class names, meta states, token ids, misc fields), mlx-lm
and legacy metadata lies, data-section rewrites, random flips, random bytes and
splices of two files. Our seeds carry checksums: a mutation that rebuilds the
header recomputes the header's (as a forger would, so the lie reaches the checks
behind it; header text edits do so half the time), data rewrites forge the
tensor's checksum half the time; flips and truncations never do, and the
checksums must find them.

``check_file`` is the contract: loading either succeeds, and then the result is
consistent (state shapes, ``from_state`` rebuild, quantized arrays dequantize,
save -> load round-trips exactly, ``read_cache_info`` agrees), or it raises a
:class:`ChatCacheError` subclass (and ``read_cache_info`` either agrees or fails
the same way); never another exception type, and mlx never allocates more than
a small multiple of the file size.
"""

from __future__ import annotations

import json
import math
import random
import struct
import tempfile
import tracemalloc
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import mlx.core as mx

from mlx_chatcache.cache import (
    ArraysCache,
    BaseCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    QuantizedRotatingKVCache,
    RotatingKVCache,
)
from mlx_chatcache.files.mlxcc_format import load_cache_file, read_cache_info, save_prompt_cache
from mlx_chatcache.errors import ChatCacheError
from mlx_chatcache.files.checksum import TENSORS_KEY, seal_bytes
from mlx_chatcache.models.fingerprint import ModelFingerprint

# mlx may allocate at most this multiple of the file size (+ constant) while loading
MEM_FACTOR = 4
MEM_CONST = 1 << 20
# ... and Python at most this (when tracemalloc is tracing): parsed JSON is bigger than its text
PY_MEM_FACTOR = 16
PY_MEM_CONST = 4 << 20


# ====================================================================== seeds
@dataclass(frozen=True)
class SeedFile:
    name: str
    layout: str  # "mlxcc" | "mlx-lm" | "mlx-lm-legacy"
    data: bytes

    @property
    def header(self) -> dict:
        return split(self.data)[0]

    @property
    def payload(self) -> bytes:
        return split(self.data)[1]


def split(raw: bytes) -> tuple[dict, bytes]:
    """(header dict, data section) of a well-formed safetensors file."""
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


class Raw(str):
    """A JSON fragment inserted verbatim by :func:`dumps` (huge numbers, NaN...)."""


def dumps(obj) -> str:
    """``json.dumps`` that writes :class:`Raw` values verbatim."""
    raws: list[str] = []

    def sub(o):
        if isinstance(o, Raw):
            raws.append(str(o))
            return f"\x00RAW{len(raws) - 1}\x00"
        if isinstance(o, dict):
            return {k: sub(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [sub(v) for v in o]
        return o

    text = json.dumps(sub(obj))
    for i, r in enumerate(raws):
        text = text.replace(json.dumps(f"\x00RAW{i}\x00"), r, 1)
    return text


def assemble(header, payload: bytes, length: int | None = None, seal: bool = True) -> bytes:
    """A safetensors file from a header (dict, str or bytes) and a data section.

    With ``seal``, a header checksum the header carries is recomputed, as a
    forger would: the lie then reaches the checks behind the checksum."""
    if isinstance(header, dict):
        header = dumps(header)
    if isinstance(header, str):
        header = header.encode("utf-8", "surrogatepass")
    n = len(header) if length is None else length
    data = struct.pack("<Q", n % 2**64) + header + payload
    return forge_header_checksum(data) if seal else data


def forge_header_checksum(data: bytes) -> bytes:
    """``data`` with its header checksum recomputed, when it has exactly one."""
    try:
        return seal_bytes(data)
    except (ValueError, struct.error):
        return data


def forge_tensor_checksum(h: dict, name: str, data: bytes) -> None:
    """Set tensor ``name``'s checksum in header ``h`` to that of ``data``, when ``h`` lists checksums."""
    meta = h.get("__metadata__") or {}
    if TENSORS_KEY in meta:
        sums = json.loads(meta[TENSORS_KEY])
        sums[name] = f"{zlib.crc32(data):08x}"
        meta[TENSORS_KEY] = json.dumps(sums)


def _rnd(shape, seed):
    return mx.random.normal(shape, key=mx.random.key(seed))


def _fill(c, sizes, seed, dim=32, heads=2):
    for i, n in enumerate(sizes):
        c.update_and_fetch(_rnd((1, heads, n, dim), seed + i), _rnd((1, heads, n, dim), seed + 100 + i))
    return c


def _ours(tmp: Path, name: str, cache, **kw) -> SeedFile:
    p = tmp / f"{name}.safetensors"
    save_prompt_cache(p, cache, **kw)
    return SeedFile(name, "mlxcc", p.read_bytes())


def build_seeds() -> list[SeedFile]:
    """Valid cache files of every layout and class, as bytes (a few KB each)."""
    from mlx_lm.models import cache as lm

    fp = ModelFingerprint("tiny/model", "ab" * 16, "cd" * 16)
    seeds = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        arrays = ArraysCache(3)
        arrays[0] = _rnd((1, 3, 8), 1)
        arrays[2] = _rnd((1, 2, 4, 4), 2)
        arrays.offset = 7
        n = 7  # tokens every non-empty layer of the "all" seed holds
        all_kinds = [
            _fill(KVCache(), (5, 1, 1), 10),
            _fill(RotatingKVCache(5, 2), (4, 1, 1, 1), 20),  # wrapped ring
            _fill(RotatingKVCache(16, 1), (6, 1), 30),  # not full
            _fill(QuantizedKVCache(32, 4), (6, 1), 40),
            _fill(QuantizedRotatingKVCache(6, 1, 32, 8), (3, 1, 1, 1, 1), 50),
            _fill(ChunkedKVCache(4), (7,), 60),
            arrays,
            CacheList(_fill(KVCache(), (7,), 70), ArraysCache(1)),
        ]
        all_kinds[5].maybe_trim_front()
        msgs = [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "hi"}]
        seeds.append(_ours(tmp, "ours-all", all_kinds, tokens=list(range(100, 100 + n)), model=fp,
                           messages=msgs, metadata={"note": "seed"}))
        seeds.append(_ours(tmp, "ours-kv", [_fill(KVCache(), (9,), 80) for _ in range(2)],
                           tokens=list(range(3, 12)), model=fp))
        seeds.append(_ours(tmp, "ours-empty", [KVCache(), ArraysCache(2), RotatingKVCache(4, 0)], tokens=[]))
        seeds.append(_ours(tmp, "ours-nested", [CacheList(_fill(QuantizedKVCache(64, 8), (3,), 90, dim=64),
                                                          _fill(RotatingKVCache(4, 1), (2, 1, 1), 95))]))

        # mlx-lm 0.32, written by mlx-lm itself
        def lm_fill(c, sizes, seed, dim=32):
            for i, k in enumerate(sizes):
                c.update_and_fetch(_rnd((1, 2, k, dim), seed + i), _rnd((1, 2, k, dim), seed + 50 + i))
            return c

        lm_arrays = lm.ArraysCache(2)
        lm_arrays[1] = _rnd((1, 4, 6), 3)
        lm_caches = [
            lm_fill(lm.KVCache(), (6, 1), 110),
            lm_fill(lm.RotatingKVCache(5, 1), (4, 1, 1, 1, 1), 120),
            lm_fill(lm.QuantizedKVCache(32, 8), (6, 1), 130),
            lm_fill(lm.ChunkedKVCache(8), (7,), 140),
            lm_arrays,
            lm.CacheList(lm_fill(lm.KVCache(), (7,), 150), lm.ArraysCache(1)),
        ]
        p = tmp / "lm.safetensors"
        lm.save_prompt_cache(str(p), lm_caches, {"who": "mlx-lm"})
        seeds.append(SeedFile("mlx-lm-all", "mlx-lm", p.read_bytes()))
        lm.save_prompt_cache(str(p), [lm_fill(lm.RotatingKVCache(4, 0), (9,), 160)])
        seeds.append(SeedFile("mlx-lm-rotating", "mlx-lm", p.read_bytes()))

        # mlx-lm <= 0.31 layout: 0.{i}[.{j}] meta_state, 1.* user, 2.{i} class names
        kv = lm_fill(lm.KVCache(), (5,), 170)
        rot = lm_fill(lm.RotatingKVCache(6, 2), (5, 1, 1, 1), 180)
        q = lm_fill(lm.QuantizedKVCache(32, 4), (4,), 190)
        ch = lm_fill(lm.ChunkedKVCache(16), (3,), 200)
        arrays = {
            "0.0": kv.keys[..., :5, :], "0.1": kv.values[..., :5, :],
            "1.0": rot.keys, "1.1": rot.values,
            **{f"2.0.{j}": a[..., :4, :] for j, a in enumerate(q.keys)},
            **{f"2.1.{j}": a[..., :4, :] for j, a in enumerate(q.values)},
            "3.0": ch.keys[..., :3, :], "3.1": ch.values[..., :3, :],
            "4.0": _rnd((1, 3, 5), 4), "4.1": _rnd((1, 2, 2), 5),
        }
        meta = {
            "0.0": "",
            "0.1.0": str(rot.keep), "0.1.1": str(rot.max_size), "0.1.2": str(rot.offset), "0.1.3": str(rot._idx),
            "0.2.0": "4", "0.2.1": "32", "0.2.2": "4",
            "0.3.0": "16", "0.3.1": "0",
            "1.user": "legacy",
            "0.4": "",
            "2.0": "KVCache", "2.1": "RotatingKVCache", "2.2": "QuantizedKVCache", "2.3": "ChunkedKVCache",
            "2.4": "ArraysCache",
        }
        mx.save_safetensors(str(p), arrays, meta)
        seeds.append(SeedFile("legacy", "mlx-lm-legacy", p.read_bytes()))
    return seeds


# ====================================================================== lies
# integers written as metadata strings
INT_STR_LIES = [
    "-1", "1.5", "1e3", "0x10", " 1", "1 ", "+1", "", "abc", "٣", "²", "1_0", "9" * 19, "9" * 5000,
    str(2**62), str(2**63), str(2**64), "NaN", "true", "null", "[1]", "0", "00000000000001", "\x00",
    "4097", "999999999999", "2",
]
# values inside a JSON list (token ids, meta states) or header field
JSON_LIES = [
    -1, -(2**63), 2**31, 2**62, 2**64, Raw("1" + "0" * 5000), Raw("-" + "9" * 4400), 1.5, 1e308, Raw("1e999"),
    Raw("NaN"), Raw("-Infinity"), True, False, None, "1", "", "x" * 10000, [1], [[[]]], {"a": 1}, 0, 7,
]
HOSTILE_NAMES = [
    "__class__", "os.system", "globals", "../x", "..", "/etc/passwd", "KVCache\x00", "KVCache ", "kvcache",
    "BaseCache", "LayerCache", "BatchKVCache", "ConcatenateKVCache", "__init__", "__import__", "eval",
    "mlx_lm.models.cache.KVCache", "", "A" * 100000, "\ud800", "ArraysCache.__new__", "CacheList()",
    "builtins.exec", "KVCache;rm -rf /", "🙂",
]
DTYPE_LIES = ["F64", "f32", "", "Q4", "F8_E4M3", "C64", None, 1, ["F32"], {"a": 1}, "F32 ", "U32\x00", True]
SHAPE_DIM_LIES = [-1, -(2**62), 2**40, 2**62, 2**64, 1.0, 0.5, True, "2", None, [2], Raw("1" + "0" * 5000)]
OFFSET_LIES = [-1, -(2**62), 2**62, 2**64 - 1, 2**64, 1.0, 0.5, True, False, "0", None, [0], Raw("9" * 5000)]


def _pick(rng: random.Random, seq):
    return seq[rng.randrange(len(seq))]


def _json_lie(rng) -> object:
    return _pick(rng, JSON_LIES)


def _tensor_names(h: dict) -> list[str]:
    return sorted(k for k in h if k != "__metadata__")


def _meta(h: dict) -> dict:
    return h.setdefault("__metadata__", {})


def _set_tensor_field(rng, h, field, value):
    name = _pick(rng, _tensor_names(h))
    h[name][field] = value
    return f"{name}.{field}={_short(value)}"


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


# ---------------------------------------------------------------------- mutations
# each takes (rng, seed) and returns (description, file bytes)

def m_truncate(rng, s: SeedFile):
    (n,) = struct.unpack("<Q", s.data[:8])
    region = rng.randrange(4)
    if region == 0:
        cut = rng.randrange(8)
    elif region == 1:
        cut = rng.randrange(8, 8 + n)
    elif region == 2:
        cut = rng.randrange(8 + n, len(s.data)) if len(s.data) > 8 + n else 8 + n - 1
    else:
        cut = _pick(rng, [8, 8 + n, 8 + n + 1, len(s.data) - 1, 8 + n - 1, 9])
    return f"cut at {cut}/{len(s.data)}", s.data[:cut]


def m_header_length(rng, s):
    (n,) = struct.unpack("<Q", s.data[:8])
    size = len(s.data)
    v = _pick(rng, [0, 1, 2, n - 1, n + 1, n + rng.randrange(2, 64), n - rng.randrange(2, min(n, 64)), size,
                    size - 8, size - 7, 2**62, 2**63, 2**64 - 1, 2**32 + n, (64 << 20) + 1, rng.randrange(2**64),
                    rng.randrange(size)])
    return f"header length {v}", struct.pack("<Q", v) + s.data[8:]


def m_header_bytes(rng, s):
    (n,) = struct.unpack("<Q", s.data[:8])
    text = bytearray(s.data[8 : 8 + n])
    what = []
    for _ in range(rng.randint(1, 4)):
        op, i = rng.randrange(5), rng.randrange(len(text))
        if op == 0:
            text[i] = rng.randrange(256)
        elif op == 1:
            del text[i]
        elif op == 2:
            text[i:i] = bytes([rng.randrange(256)])
        elif op == 3:
            text[i] = ord(_pick(rng, '{}[]",:0123456789-.eE \\'))
        else:
            text[i:i] = _pick(rng, [b"\xff", b"\xc3", b"\xed\xa0\x80", b"\\ud800", b"\\u0000", b"\x00"])
        what.append(f"op{op}@{i}")
    fix_len, seal = rng.random() < 0.8, rng.random() < 0.5
    return ("header text " + ",".join(what) + (" (length fixed)" if fix_len else "") + (" (sealed)" if seal else ""),
            assemble(bytes(text), s.payload, None if fix_len else n, seal))


def m_header_json(rng, s):
    h = s.header
    depth = rng.choice([100, 1000, 10**5, 10**6])
    choice = rng.randrange(14)
    text = [
        "[]", "1", '"x"', "null", "true", "", "   ", "{", "}",
        "[" * depth + "]" * depth,
        '{"a":' * depth + "1" + "}" * depth,
        dumps({**h, "__metadata__": {**h.get("__metadata__", {}), "k": Raw("[" * depth + "]" * depth)}}),
        dumps({"__metadata__": h.get("__metadata__", {}), **{k: v for k, v in h.items() if k != "__metadata__"},
               "__metadata__x": Raw("1" + "0" * 10000)}),
        '\ufeff' + dumps(h),
    ][choice]
    if choice == 12 and rng.random() < 0.5:  # duplicate keys: last one wins in Python
        text = text[:-1] + ', "__metadata__": ' + dumps(_pick(rng, [{}, [], "x", {"a": 1}, None])) + "}"
    return f"header json #{choice}", assemble(text, s.payload)


def m_tensor_offsets(rng, s):
    h = s.header
    names = _tensor_names(h)
    if not names:
        return m_header_json(rng, s)
    name = _pick(rng, names)
    b, e = h[name]["data_offsets"]
    op = rng.randrange(9)
    if op == 0:
        d = rng.choice([-1, 1, -4, 4, 2**62])
        h[name]["data_offsets"] = [b + d, e + d]
    elif op == 1 and len(names) > 1:
        other = _pick(rng, names)
        h[name]["data_offsets"], h[other]["data_offsets"] = h[other]["data_offsets"], h[name]["data_offsets"]
    elif op == 2:
        h[name]["data_offsets"] = [e, b]
    elif op == 3:
        h[name]["data_offsets"] = [_pick(rng, OFFSET_LIES), e]
    elif op == 4:
        h[name]["data_offsets"] = [b, _pick(rng, OFFSET_LIES)]
    elif op == 5:
        h[name]["data_offsets"] = _pick(rng, [[b], [b, e, e], [], None, "0,4", {"0": b, "1": e}, [[b, e]], b])
    elif op == 6:  # overlap the previous tensor
        h[name]["data_offsets"] = [max(0, b - rng.randrange(1, 64)), e]
    elif op == 7:
        h[name]["data_offsets"] = [0, 2**62]
    else:
        for t in names:
            h[t]["data_offsets"] = [0, h[t]["data_offsets"][1] - h[t]["data_offsets"][0]]
    return f"offsets op{op} {name}={_short(h[name]['data_offsets'])}", assemble(h, s.payload)


def m_tensor_shape(rng, s):
    h = s.header
    names = _tensor_names(h)
    if not names:
        return m_header_json(rng, s)
    name = _pick(rng, names)
    shape = list(h[name]["shape"])
    op = rng.randrange(7)
    if op == 0 and shape:
        shape[rng.randrange(len(shape))] = _pick(rng, SHAPE_DIM_LIES)
    elif op == 1:
        shape = _pick(rng, [None, "1,2", {"0": 1}, 3, [[1, 2]], [], [1] * 9, [1] * 64, [2**40], [2**20, 2**20],
                            [2**31, 2**31, 2**31], [0] * 8, [0, 2**31 - 1, 2**31 - 1], [0, 2**31], [1, 2, 0, 2**31 - 1],
                            [0, 2**62, 2**62]])
    elif op == 2:
        shape = shape + [1]
    elif op == 3 and shape:
        shape[-1] += rng.choice([-1, 1, 7])
    elif op == 4:  # consistent byte count but absurd element count is impossible; claim 2**40 elements
        shape = [2**20, 2**20]
        b = h[name]["data_offsets"][0]
        h[name]["data_offsets"] = [b, b + 4 * 2**40]
    elif op == 5:
        shape = shape[::-1]
    else:
        shape = [math.prod(shape)] if shape else [1]
    h[name]["shape"] = shape
    return f"shape op{op} {name}={_short(shape)}", assemble(h, s.payload)


def m_tensor_dtype(rng, s):
    h = s.header
    if not _tensor_names(h):
        return m_header_json(rng, s)
    return "dtype " + _set_tensor_field(rng, h, "dtype", _pick(rng, DTYPE_LIES)), assemble(h, s.payload)


def m_tensor_entries(rng, s):
    h = s.header
    names = _tensor_names(h)
    op = rng.randrange(8)
    name = _pick(rng, names) if names else None
    payload = s.payload
    if op == 0 and name:
        del h[name]
    elif op == 1:  # an extra tensor no layer claims, with its data
        h[_pick(rng, ["layer.99.0", "extra", "0.9", "9.0", "layer.0.9", "../x", "__class__"])] = {
            "dtype": "U8", "shape": [4], "data_offsets": [len(payload), len(payload) + 4]}
        payload += b"\x01\x02\x03\x04"
    elif op == 2 and name:
        h[_pick(rng, ["layer.0", "layer.0.0.0", "x.0.0", "0.x", "0.0.0.0.0", "-1.0", "1e3.0", "0.99999999",
                      "layer.-1.0", "layer.0.00", "٠.٠", "__metadata__ ", "9999999.0", "x" * 1000,
                      "0." * 500 + "0"])] = h.pop(name)
    elif op == 3 and name:
        h[name] = _pick(rng, [None, [], "x", 1, {"dtype": "F32"}, {**h[name], "extra": 1},
                              {"dtype": h[name]["dtype"], "shape": h[name]["shape"]}])
    elif op == 4 and name:  # rename onto another tensor's name (dropping it)
        other = _pick(rng, names)
        h[other] = h.pop(name)
    elif op == 5:
        for t in names:
            del h[t]
        payload = b""
    elif op == 6 and len(names) > 1:  # swap two entries' names (shapes move with the data)
        a, b = rng.sample(names, 2)
        h[a], h[b] = h[b], h[a]
    else:
        h["__metadata__"] = _pick(rng, [None, [], "x", 1, {"a": 1}, {"a": None}, {"a": ["b"]}, {1: "x"}, {}])
    return f"entries op{op} {name}", assemble(h, payload)


def m_consistent(rng, s):
    """Header-valid lies: same byte ranges, other shapes or dtypes."""
    h = s.header
    names = [n for n in _tensor_names(h) if h[n]["shape"]]
    if not names:
        return m_meta_misc(rng, s)
    name = _pick(rng, names)
    e = h[name]
    shape, dtype = list(e["shape"]), e["dtype"]
    op = rng.randrange(6)
    if op == 0:
        rng.shuffle(shape)
    elif op == 1:
        shape = [math.prod(shape)]
    elif op == 2 and len(shape) >= 2:
        shape = shape[:-2] + [shape[-2] * shape[-1]] + [1]
    elif op == 3:
        same = {"F32": ["I32", "U32"], "U32": ["F32", "I32"], "I32": ["F32", "U32"], "F16": ["BF16", "I16", "U16"],
                "BF16": ["F16", "U16"], "U8": ["I8", "BOOL"], "I64": ["U64"], "U64": ["I64"]}
        dtype = _pick(rng, same.get(dtype, [dtype]))
    elif op == 4:  # half the item size, twice the last dim (or the reverse)
        wider = {"F32": "F16", "U32": "U16", "I32": "F16", "F16": "U8", "BF16": "U8"}
        narrower = {"F16": "F32", "BF16": "F32", "U16": "U32", "I16": "I32"}
        if dtype in narrower and shape[-1] % 2 == 0:
            dtype, shape[-1] = narrower[dtype], shape[-1] // 2
        elif dtype in wider:
            dtype, shape[-1] = wider[dtype], shape[-1] * 2
    else:
        shape = [1] + shape if len(shape) < 8 else shape[1:]
    e["shape"], e["dtype"] = shape, dtype
    return f"consistent op{op} {name}={dtype}{shape}", assemble(h, s.payload)


def m_meta_counts(rng, s):
    h = s.header
    meta = _meta(h)
    keys = [k for k in meta if k == "mlxcc.num_layers" or k.endswith(".arrays")] or ["mlxcc.num_layers"]
    key = _pick(rng, keys)
    old = meta.get(key, "1")
    v = _pick(rng, INT_STR_LIES + ["__inc", "__dec", "__inc", "__dec"])
    if v == "__inc":
        v = str(int(old) + rng.randint(1, 3)) if old.isdigit() else "1"
    elif v == "__dec":
        v = str(max(0, int(old) - 1)) if old.isdigit() else "0"
    meta[key] = v
    return f"{key}={_short(v)}", assemble(h, s.payload)


def m_meta_class(rng, s):
    h = s.header
    meta = _meta(h)
    if s.layout == "mlxcc":
        keys = [k for k in meta if k.endswith(".class")]
    elif s.layout == "mlx-lm":
        keys = [k for k in meta if k.startswith("1.")]
    else:
        keys = [k for k in meta if k.startswith("2.")]
    op = rng.randrange(4)
    key = _pick(rng, keys)
    if op == 0:
        meta[key] = _pick(rng, HOSTILE_NAMES)
    elif op == 1:  # a valid name of another class
        meta[key] = _pick(rng, ["KVCache", "QuantizedKVCache", "RotatingKVCache", "QuantizedRotatingKVCache",
                                "ChunkedKVCache", "ArraysCache", "CacheList", "ConcatenateKVCache"])
    elif op == 2 and len(keys) > 1:
        a, b = rng.sample(keys, 2)
        meta[a], meta[b] = meta[b], meta[a]
    else:  # a hostile name inside a CacheList child spec, or any .meta
        metas = [k for k in meta if k.endswith(".meta") and "CacheList" in meta.get(k[:-5] + ".class", "")]
        if metas:
            k = _pick(rng, metas)
            lst = json.loads(meta[k])
            lst[1] = _pick(rng, HOSTILE_NAMES)
            meta[k] = json.dumps(lst)
            key = k
        else:
            meta[key] = _pick(rng, HOSTILE_NAMES)
    return f"class op{op} {key}={_short(meta[key])}", assemble(h, s.payload)


def m_meta_state(rng, s):
    h = s.header
    meta = _meta(h)
    keys = [k for k in meta if k.endswith(".meta")]
    if not keys:
        return m_meta_misc(rng, s)
    key = _pick(rng, keys)
    lst = json.loads(meta[key])
    cls = meta.get(key[:-5] + ".class", "")
    op = rng.randrange(8)
    if op == 0 and lst:
        lst[rng.randrange(len(lst))] = _pick(rng, INT_STR_LIES)
    elif op == 1 and lst:
        lst[rng.randrange(len(lst))] = _json_lie(rng)
    elif op == 2:
        lst = lst[: rng.randrange(len(lst) + 1)] if lst and rng.random() < 0.5 else lst + ["1"]
    elif op == 3:  # semantic lies the classes must refuse
        if "Rotating" in cls and len(lst) in (4, 6) and rng.random() < 0.5:  # ring_idx outside the ring
            keep, max_size = int(lst[2]), int(lst[1])
            lst[-1] = str(rng.choice([max_size, max_size + 1, 10**6] + ([keep - 1] if keep else [])))
        elif "Rotating" in cls and len(lst) >= 3:
            lst[2] = str(int(lst[1]) + rng.choice([0, 1, 100]))  # keep >= max_size
        elif "Quantized" in cls and len(lst) >= 3:
            lst[-1] = _pick(rng, ["7", "0", "1", "9", "16", "32"])  # bits
        elif "Chunked" in cls:
            lst[1] = "0"
        elif cls == "ArraysCache":
            lst[1] = _pick(rng, ["", "2", "10", "1" * 65, "1" * 64, "01x", "-", "--"])
        elif cls == "CacheList":
            lst[0] = _pick(rng, ["0", "5", "-1", "x", "²", "9" * 30])
    elif op == 4:
        if "Quantized" in cls and len(lst) >= 3:
            lst[-2] = _pick(rng, ["0", "1", "16", "33", "256", "63"])  # group size
        elif lst:
            lst[0] = str(int(lst[0]) + rng.choice([-1, 1, 2**40])) if lst[0].isdigit() else "1"
    elif op == 5:
        meta[key] = _pick(rng, ["", "{}", "1", '"x"', "null", "[", "[" * 10**5 + "]" * 10**5, '[["1"]]',
                                "[1, 2, 3]", '["' + "9" * 5000 + '"]', "[" + "9" * 5000 + "]"])
        return f"meta {key}={_short(meta[key])}", assemble(h, s.payload)
    elif op == 6 and cls == "CacheList" and len(lst) >= 4:  # lie inside a child's meta state
        child = json.loads(lst[2])
        if child:
            child[rng.randrange(len(child))] = _pick(rng, INT_STR_LIES)
        lst[2] = json.dumps(child) if rng.random() < 0.5 else _pick(rng, ["", "x", "{}", "[1]", "[[]]", "[" * 10**5,
                                                                         "[" + "9" * 5000 + "]"])
        lst[3] = _pick(rng, [lst[3], lst[3], "9", "-1", "x"])
    else:
        lst = [str(_json_lie(rng)) for _ in range(rng.randint(0, 6))]
    meta[key] = dumps(lst)
    return f"meta op{op} {key}={_short(meta[key])}", assemble(h, s.payload)


def m_meta_tokens(rng, s):
    h = s.header
    meta = _meta(h)
    toks = json.loads(meta.get("mlxcc.tokens", "[1, 2, 3]"))
    op = rng.randrange(6)
    if op == 0 and toks:
        toks[rng.randrange(len(toks))] = _json_lie(rng)
        text = dumps(toks)
    elif op == 1:
        text = dumps(toks + [1] * rng.choice([1, 2, 1000]))
    elif op == 2:
        text = dumps(toks[:-1])
    elif op == 3:
        text = _pick(rng, ["", "x", "{}", "null", "1", "[", '["1"]', "[1.0]", "[true]", "[-0]", "[1e2]",
                           "[" * 10**5 + "]" * 10**5, "[" + "1" * 5000 + "]", "[" + ",".join(["7"] * 10**5) + "]",
                           "[NaN]", "[Infinity]", "[2147483648]", "[2147483647]"])
    elif op == 4:
        text = dumps([_json_lie(rng) for _ in range(len(toks))])
    else:
        meta.pop("mlxcc.tokens", None)
        return "tokens removed", assemble(h, s.payload)
    meta["mlxcc.tokens"] = text
    return f"tokens op{op} {_short(text)}", assemble(h, s.payload)


def m_meta_misc(rng, s):
    h = s.header
    meta = _meta(h)
    op = rng.randrange(12)
    if op == 0:
        key, v = "mlxcc.format_version", _pick(rng, INT_STR_LIES + ["3", "2", "0", "1"])
    elif op == 1:
        key, v = "mlxcc.format", _pick(rng, ["", "mlx_chatcache ", "MLX_CHATCACHE", "mlx-lm", "x" * 100000])
    elif op == 2:
        key = "mlxcc.messages"
        v = _pick(rng, ["", "x", "{}", "[1]", '[{"role": 1, "content": "x"}]', '[{"role": "user"}]',
                        '[{"role": "user", "content": "\\ud800"}]', "[" * 10**5 + "]" * 10**5,
                        '[{"role": "u", "content": "' + "x" * 10**6 + '"}]', "null", "[]", "[[]]"])
    elif op == 3:
        key = _pick(rng, ["model.id", "model.weights_hash", "model.tokenizer_hash"])
        v = _pick(rng, ["", "x" * 100000, "\ud800", "../../etc", "\n\r", "0" * 32])
    elif op == 4:
        key, v = _pick(rng, ["user.", "user.x" * 1000, "user.\ud800", "user.__class__"]), _pick(rng, ["", "x" * 10**6, "\ud800", "\x00"])
    elif op == 5:
        key = _pick(rng, sorted(meta)) if meta else "x"
        meta.pop(key, None)
        return f"removed {key}", assemble(h, s.payload)
    elif op == 6:
        key, v = _pick(rng, sorted(meta)) if meta else "x", _pick(rng, [1, None, [], {}, 1.5, True])
    elif op == 7:
        key, v = _pick(rng, sorted(meta)) if meta else "x", "\ud800"
    elif op == 8:  # turn one layout into another
        key, v = _pick(rng, [("mlxcc.format", "mlx_chatcache"), ("2.0", ""), ("1.0", "KVCache"), ("2.0", "KVCache")])
    elif op == 9:
        key, v = f"zz.{rng.randrange(10**6)}", "x" * rng.choice([1, 10**5, 10**6])
    elif op == 10:
        key = "mlxcc.settings"
        v = _pick(rng, ["", "x", "[]", "null", "1", '{"max_kv_size": ' + "9" * 5000 + "}", "{" * 10**5,
                        '{"max_kv_size": -1}', '{"max_kv_size": "x"}', '{"keep": 1e999}', '{"a": "\\ud800"}',
                        "[" * 10**5 + "]" * 10**5, '{"max_kv_size": 16, "keep": 4}'])
    else:
        key, v = "mlxcc.text", _pick(rng, ["", "x" * 10**6, "\x00", "\ud800", "héllo"])
    meta[key] = v
    return f"misc op{op} {_short(key)}={_short(v)}", assemble(h, s.payload)


def m_mlxlm_meta(rng, s):
    """mlx-lm 0.32 and legacy metadata lies."""
    h = s.header
    meta = _meta(h)
    names = _tensor_names(h)
    op = rng.randrange(9)
    if s.layout == "mlx-lm":
        specs = [k for k in meta if k.startswith("2.") and k.endswith(".0") and k != "2.0"]
        if op == 0 and specs:  # a scalar spec pointing at a missing tensor
            meta[_pick(rng, specs)] = _pick(rng, ["99.0", "0.9", "x", "", "0", "0.0.0.0", "../x", "1.0.5"])
        elif op == 1 and specs:
            meta[_pick(rng, specs)[:-1] + "1"] = _pick(rng, ["int", "", "scalar ", "None", "object", "\ud800"])
        elif op == 2:
            k = f"2.{len(specs) + 1}"
            meta[k + ".0"] = _pick(rng, names) if names else "0.0"
            meta[k + ".1"] = _pick(rng, ["scalar", "string", "none"])
        elif op == 3:
            meta.pop("2.0", None)
        elif op == 4:  # scalar specs that name non-scalar tensors (K/V buffers)
            for k in specs[: rng.randint(1, max(1, len(specs)))]:
                meta[k] = _pick(rng, names) if names else "0.0"
        elif op == 5:
            i = len([k for k in meta if k.startswith("1.")])
            meta[f"1.{i}"] = _pick(rng, ["KVCache", "CacheList", "ArraysCache", "RotatingKVCache"])
        elif op == 6:
            meta[_pick(rng, [k for k in meta if k.startswith("1.")])] = _pick(rng, HOSTILE_NAMES)
        elif op == 7 and specs:
            del meta[_pick(rng, specs)]
        else:
            meta[f"2.{rng.randrange(1, 40)}.1"] = "string"
    else:  # legacy
        metas = [k for k in meta if k.startswith("0.")]
        if op in (0, 1) and metas:
            meta[_pick(rng, metas)] = _pick(rng, INT_STR_LIES)
        elif op == 2 and metas:
            del meta[_pick(rng, metas)]
        elif op == 3:
            meta[_pick(rng, ["0.1.9", "0.0.0", "0.x", "0.2.0.0", "0.99", "0.1"])] = "1"
        elif op == 4:
            meta[_pick(rng, [k for k in meta if k.startswith("2.")])] = _pick(rng, HOSTILE_NAMES)
        elif op == 5:
            i = len([k for k in meta if k.startswith("2.")])
            meta[f"2.{i}"] = _pick(rng, ["KVCache", "CacheList", "QuantizedKVCache", "RotatingKVCache"])
        elif op == 6:
            meta["2.1"] = "CacheList"
            meta["0.1.0"] = _pick(rng, ["", "KVCache", "x"])
        elif op == 7:
            meta["2.0"] = ""  # now looks like the 0.32 layout
        else:
            for k in metas:
                meta[k] = str(rng.choice([0, 1, 3, 2**40]))
    return f"mlx-lm op{op}", assemble(h, s.payload)


def m_data(rng, s):
    """Rewrite bytes of the data section (the header stays valid)."""
    payload = bytearray(s.payload)
    h = s.header
    if not payload:
        return m_random_flips(rng, s)
    op = rng.randrange(4)
    names = [n for n in _tensor_names(h) if h[n]["data_offsets"][1] > h[n]["data_offsets"][0]]
    name = _pick(rng, names)
    b, e = h[name]["data_offsets"]
    if op == 0:
        payload[b:e] = rng.randbytes(e - b)
    elif op == 1:  # extreme values in every element (scalars of mlx-lm files live here)
        item = {"F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I64": 8, "U64": 8}.get(h[name]["dtype"], 1)
        pat = _pick(rng, [b"\xff", b"\x7f", b"\x80", b"\x00"]) * (item - 1) + _pick(rng, [b"\xff", b"\x7f", b"\x80"])
        payload[b:e] = (pat * ((e - b) // item + 1))[: e - b]
    elif op == 2:
        payload[b:e] = bytes(e - b)
    else:  # NaN floats
        payload[b:e] = (b"\x00\x00\xc0\x7f" * ((e - b) // 4 + 1))[: e - b]
    forged = rng.random() < 0.5  # else a checksum-carrying file is found damaged
    if forged:
        forge_tensor_checksum(h, name, bytes(payload[b:e]))
    return f"data op{op} {name}" + (" (checksum forged)" if forged else ""), assemble(h, bytes(payload))


def m_random_flips(rng, s):
    data = bytearray(s.data)
    (n,) = struct.unpack("<Q", s.data[:8])
    k = rng.choice([1, 1, 2, 4, 16, 64])
    where = rng.choice(["any", "header", "data"])
    lo, hi = {"any": (0, len(data)), "header": (8, 8 + n), "data": (8 + n, len(data))}[where]
    if hi <= lo:
        lo, hi = 0, len(data)
    for _ in range(k):
        i = rng.randrange(lo, hi)
        data[i] ^= 1 << rng.randrange(8)
    return f"{k} flips in {where}", bytes(data)


def m_random_bytes(rng, s):
    op = rng.randrange(4)
    size = rng.choice([0, 1, 7, 8, 9, 100, 4096, 65536])
    if op == 0:
        return f"random {size}", rng.randbytes(size)
    if op == 1:  # plausible length + random
        return f"len+random {size}", struct.pack("<Q", size) + rng.randbytes(size)
    if op == 2:  # random printable json-ish text
        text = "".join(rng.choice('{}[]":,0123456789abc-.eE \n') for _ in range(size))
        return f"json-ish {size}", assemble(text, b"")
    return f"zeros {size}", bytes(size)


def m_splice(rng, s, seeds: list[SeedFile]):
    other = _pick(rng, seeds)
    op = rng.randrange(4)
    if op == 0:
        return f"header of {s.name} + data of {other.name}", assemble(s.header, other.payload)
    if op == 1:
        return f"{s.name} + {other.name}", s.data + other.data
    if op == 2:
        return "garbage appended", s.data + rng.randbytes(rng.choice([1, 8, 100]))
    return "data duplicated", s.data + s.payload


MUTATIONS: dict[str, Callable] = {
    "truncate": m_truncate,
    "header_length": m_header_length,
    "header_bytes": m_header_bytes,
    "header_json": m_header_json,
    "tensor_offsets": m_tensor_offsets,
    "tensor_shape": m_tensor_shape,
    "tensor_dtype": m_tensor_dtype,
    "tensor_entries": m_tensor_entries,
    "consistent_lies": m_consistent,
    "meta_counts": m_meta_counts,
    "meta_class": m_meta_class,
    "meta_state": m_meta_state,
    "meta_tokens": m_meta_tokens,
    "meta_misc": m_meta_misc,
    "mlxlm_meta": m_mlxlm_meta,
    "data_values": m_data,
    "random_flips": m_random_flips,
    "random_bytes": m_random_bytes,
    "splice": m_splice,
}
# which seed layouts a mutation class applies to (default: all)
_LAYOUTS = {
    "meta_counts": ("mlxcc",),
    "meta_state": ("mlxcc",),
    "meta_tokens": ("mlxcc",),
    "meta_misc": ("mlxcc", "mlxcc", "mlx-lm", "mlx-lm-legacy"),
    "mlxlm_meta": ("mlx-lm", "mlx-lm-legacy"),
}


@dataclass(frozen=True)
class FuzzCase:
    index: int
    kind: str  # the mutation class
    seed_name: str
    what: str
    data: bytes


def generate(seeds: list[SeedFile], count: int, seed: int = 0) -> Iterator[FuzzCase]:
    """``count`` mutated files, mutation classes in turn, fully determined by ``seed``."""
    kinds = list(MUTATIONS)
    for i in range(count):
        rng = random.Random(f"{seed}:{i}")
        kind = kinds[i % len(kinds)]
        layouts = _LAYOUTS.get(kind)
        pool = [s for s in seeds if layouts is None or s.layout in layouts]
        if layouts:
            pool = [s for s in seeds if s.layout == _pick(rng, layouts)] or pool
        s = _pick(rng, pool)
        fn = MUTATIONS[kind]
        what, data = fn(rng, s, seeds) if kind == "splice" else fn(rng, s)
        yield FuzzCase(i, kind, s.name, what, data)


# ====================================================================== the contract
class ContractViolation(AssertionError):
    """The loader broke the fuzz contract on one file."""


def check_file(path: Path, workdir: Path) -> str:
    """Feed ``path`` to the loader; return the outcome ("loaded" or the error class).

    ``check_file.info_outcome`` is then what ``read_cache_info`` did ("ok" or the
    error class): it reads only the header, so it accepts some files the loader refuses.

    Raises :class:`ContractViolation` when an exception other than a
    ChatCacheError escapes, when a loaded cache is inconsistent, when
    ``read_cache_info`` and ``load_cache_file`` disagree, or when mlx allocates
    more than ``MEM_FACTOR`` x the file size (+ ``MEM_CONST``).
    """
    size = path.stat().st_size
    info_err = None
    try:
        info = read_cache_info(path)
    except ChatCacheError as e:
        info_err = e
    except Exception as e:
        raise ContractViolation(f"read_cache_info raised {type(e).__name__}: {e}") from e
    _one_line(info_err, path)
    check_file.info_outcome = "ok" if info_err is None else type(info_err).__name__

    before = mx.get_active_memory()
    mx.reset_peak_memory()
    py_before = _py_reset()
    try:
        cache, linfo = load_cache_file(path)
    except ChatCacheError as e:
        _one_line(e, path)
        _check_memory(before, py_before, size)
        return type(e).__name__
    except Exception as e:
        raise ContractViolation(f"load_cache_file raised {type(e).__name__}: {e}") from e
    _check_memory(before, py_before, size)
    if info_err is not None:
        raise ContractViolation(f"read_cache_info failed ({info_err}) but the file loads")
    if info.classes != linfo.classes or info.tokens != linfo.tokens:
        raise ContractViolation("read_cache_info and load_cache_file disagree")
    try:
        check_loaded(cache, linfo, workdir)
    except ContractViolation:
        raise
    except Exception as e:
        raise ContractViolation(f"loaded cache is inconsistent: {type(e).__name__}: {e}") from e
    return "loaded"


MAX_MESSAGE = 500  # characters of an error message, not counting the file's path


def _one_line(err, path: Path) -> None:
    if err is None:
        return
    msg = str(err)
    if "\n" in msg or not msg.strip():
        raise ContractViolation(f"error message is not one non-empty line: {msg!r}")
    if len(msg.replace(str(path), "")) > MAX_MESSAGE:
        raise ContractViolation(f"error message is {len(msg)} characters long: {msg[:200]!r}...")


def _py_reset() -> int:
    if not tracemalloc.is_tracing():
        return 0
    tracemalloc.reset_peak()
    return tracemalloc.get_traced_memory()[0]


def _check_memory(before: int, py_before: int, size: int) -> None:
    used = mx.get_peak_memory() - before
    if used > MEM_FACTOR * size + MEM_CONST:
        raise ContractViolation(f"mlx allocated {used} bytes loading a {size}-byte file")
    if tracemalloc.is_tracing():
        used = tracemalloc.get_traced_memory()[1] - py_before
        if used > PY_MEM_FACTOR * size + PY_MEM_CONST:
            raise ContractViolation(f"Python allocated {used} bytes loading a {size}-byte file")


def _kv_checks(c: KVCache) -> None:
    held = c.size()
    st = c.flat_state()
    if not st:
        if held:
            raise ContractViolation(f"{type(c).__name__} holds {held} tokens but has no arrays")
        return
    for a in st:
        if a.ndim != 4 or a.shape[2] != held or a.shape[:2] != st[0].shape[:2]:
            raise ContractViolation(f"{type(c).__name__} array {a.shape} does not hold {held} tokens")
    if isinstance(c, (QuantizedKVCache, QuantizedRotatingKVCache)) and held:  # mlx cannot dequantize 0 tokens
        for w, sc, b in c.state:
            full = mx.dequantize(w, sc, b, group_size=c.group_size, bits=c.bits)
            mx.eval(full)


def check_loaded(cache: list, info, workdir: Path) -> None:
    """A cache that loaded must be consistent and survive save -> load unchanged."""
    if not isinstance(cache, list) or len(cache) != len(info.classes):
        raise ContractViolation("load returned the wrong number of layers")
    layers = list(cache)
    while layers:
        c = layers.pop()
        if not isinstance(c, BaseCache):
            raise ContractViolation(f"layer is a {type(c).__name__}")
        st, flat, ms = c.state, c.flat_state(), c.meta_state
        if not all(isinstance(a, mx.array) for a in flat) or not all(isinstance(m, str) for m in ms):
            raise ContractViolation(f"{type(c).__name__} state/meta_state have wrong types")
        mx.eval(flat)
        again = type(c).from_state(st, ms)
        if again.meta_state != ms or len(again.flat_state()) != len(flat):
            raise ContractViolation(f"{type(c).__name__}.from_state(state, meta_state) differs")
        if isinstance(c, KVCache):
            _kv_checks(c)
        if isinstance(c, CacheList):
            layers.extend(c.caches)
        c.nbytes, c.size(), c.empty(), c.is_trimmable()
    rt = workdir / "roundtrip.safetensors"
    save_prompt_cache(rt, cache, tokens=info.tokens, model=info.model, messages=info.messages,
                      metadata=info.metadata if info.layout == "mlxcc" else None)
    back, binfo = load_cache_file(rt)
    if [type(c) for c in back] != [type(c) for c in cache] or binfo.tokens != info.tokens:
        raise ContractViolation("save -> load changed the layers or tokens")
    for x, y in zip(back, cache):
        if x.meta_state != y.meta_state or len(x.flat_state()) != len(y.flat_state()):
            raise ContractViolation(f"save -> load changed {type(y).__name__}'s meta state")
        for a, b in zip(x.flat_state(), y.flat_state()):
            if a.dtype != b.dtype or a.shape != b.shape or not mx.array_equal(a, b, equal_nan=True):
                raise ContractViolation(f"save -> load changed {type(y).__name__}'s arrays")
