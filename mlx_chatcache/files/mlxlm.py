"""Interop with mlx-lm's prompt cache files.

Two layouts exist, both with tensors named by ``tree_flatten`` paths
(``"{layer}.{index}..."``) and a flat string metadata map:

- **0.32 layout** (mlx-lm >= 0.32.0): metadata ``0.*`` = user metadata, ``1.{i}`` =
  class names, ``2.*`` = a list of (tensor path, "scalar"|"string"|"none") pairs
  (``2.0`` is an empty sentinel). ``state`` includes scalars (offset, keep, ...)
  stored as arrays, and K/V buffers may be padded past ``offset``.
- **legacy layout** (mlx-lm <= 0.31): metadata ``0.{i}[.{j}]`` = each layer's
  ``meta_state`` strings, ``1.*`` = user metadata, ``2.{i}`` = class names;
  K/V arrays are already sliced to ``offset``; a rotating buffer keeps its ring
  order, described by ``(keep, max_size, offset, _idx)``.

Both are converted to our classes: live tokens only; a wrapped rotating ring of
``max_size`` slots keeps mlx-lm's slot order (its ``_idx`` becomes our
``ring_idx``), any other rotating buffer is put in temporal order. Writing
(``save_mlx_lm``) builds mlx-lm cache objects and uses mlx-lm's own writer, so
the file is exactly what the installed mlx-lm expects; a wrapped window is
written as its ring buffer with mlx-lm's ``_idx`` set.

mlx-lm's own cache objects are written as they are (their ``state``), so a
cache of mlx-lm's batch classes (``BatchKVCache``, ``BatchRotatingKVCache``),
which we have no equivalent of, can be saved; reading a 0.32 file, those are
built as mlx-lm's classes with their state set once it is checked (they go on
taking tokens), the other classes become ours.

mlx-lm files hold no token ids. When we write one (``mlxcc cache convert --to
mlx-lm``) we add user metadata mlx-lm ignores: ``mlxcc_tokens``,
``mlxcc_messages``, ``mlxcc_text``, ``mlxcc_settings`` (JSON) and
``mlxcc_model`` (the fingerprint as JSON), next to mlx-lm's own ``model`` and
``tokenizer_config`` (which ``mlx_lm.generate --prompt-cache-file`` needs).
Keys have no dots: mlx-lm unflattens its metadata on load. Reading such a file
recovers them (:func:`recorded_metadata` / ``_read_recorded``).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from ..errors import CacheFormatError, UnsupportedCacheError, clipped, shown

from .registry import CacheFileInfo, ForeignFormat, parse_messages, parse_settings, parse_tokens, register_format
from .atomic import write_file_atomic
from .safetensors_file import Header

if TYPE_CHECKING:  # mlx and the cache classes (and so mlx-lm) load only when arrays become layers
    import mlx.core as mx

    from ..cache import ArraysCache, BaseCache, KVCache, RotatingKVCache

_INDEX = re.compile(r"^\d{1,6}$")
_MLX_LM_CLASSES = {"KVCache", "RotatingKVCache", "QuantizedKVCache", "ArraysCache",
                   "ChunkedKVCache", "CacheList", "ConcatenateKVCache"}
# mlx-lm classes we have no equivalent of: read from 0.32 files as mlx-lm's own objects (its
# state setter), after the checks of _batch_state; each name -> the size of its ``state``
_KEPT_AS_MLX_LM = {"BatchKVCache": 5, "BatchRotatingKVCache": 8}


def _classes(meta: dict[str, str], prefix: str, known) -> list[str] | None:
    names, i = [], 0
    while f"{prefix}.{i}" in meta:
        names.append(meta[f"{prefix}.{i}"])
        i += 1
    return names if names and all(isinstance(n, str) and n in known for n in names) else None


def detect_mlx_lm(header: Header):
    """CacheFileInfo for an mlx-lm file, or None if the file is not one."""
    meta = header.metadata
    if meta.get("2.0") == "" and (classes := _classes(meta, "1", _MLX_LM_CLASSES | set(_KEPT_AS_MLX_LM))):
        layout, user = "mlx-lm", _sub(meta, "0")
    elif classes := _classes(meta, "2", _MLX_LM_CLASSES):
        layout, user = "mlx-lm-legacy", _sub(meta, "1")
    else:
        return None
    info = CacheFileInfo(path=str(header.path), format_version=0, layout=layout,
                         classes=classes, metadata=user)
    _read_recorded(info)
    return info


RECORDED = ("mlxcc_tokens", "mlxcc_messages", "mlxcc_text", "mlxcc_settings", "mlxcc_model")


def recorded_metadata(info) -> dict[str, str]:
    """User metadata for an mlx-lm file carrying what ``info`` (a CacheFileInfo) knows."""
    import json

    out = {}
    if info.tokens is not None:
        out["mlxcc_tokens"] = json.dumps(info.tokens)
    if info.messages is not None:
        out["mlxcc_messages"] = json.dumps(info.messages, ensure_ascii=False)
    if info.text is not None:
        out["mlxcc_text"] = info.text
    if info.settings:
        out["mlxcc_settings"] = json.dumps(info.settings)
    if info.model is not None:
        out["mlxcc_model"] = json.dumps(info.model.to_metadata())
    return out


def _read_recorded(info) -> None:
    """Fill ``info`` from the ``mlxcc_*`` keys of an mlx-lm file we wrote (validated as ours)."""
    import json

    from ..models.fingerprint import ModelFingerprint

    user, path = info.metadata, info.path
    info.metadata = {k: v for k, v in user.items() if k not in RECORDED}  # shown as tokens, messages, ...
    info.tokens = parse_tokens(path, user.get("mlxcc_tokens"))
    info.messages = parse_messages(path, user.get("mlxcc_messages"))
    info.text = user.get("mlxcc_text")
    info.settings = parse_settings(path, user.get("mlxcc_settings"))
    if "mlxcc_model" in user:
        try:
            fp = json.loads(user["mlxcc_model"])
        except (ValueError, RecursionError):
            fp = None
        if not (isinstance(fp, dict) and all(isinstance(v, str) for v in fp.values())):
            raise CacheFormatError(f"{path}: metadata mlxcc_model is malformed; the file is damaged")
        info.model = ModelFingerprint.from_metadata(fp)


def _sub(meta: dict[str, str], prefix: str) -> dict[str, str]:
    p = prefix + "."
    return {k[len(p):]: v for k, v in meta.items() if k.startswith(p)}


def _unflatten(flat: dict[str, Any]) -> dict:
    """Nested dicts keyed by int from ``"0.1.2"``-style paths."""
    root: dict = {}
    for path, value in flat.items():
        parts = path.split(".")
        if not all(_INDEX.match(p) for p in parts):
            raise CacheFormatError(f"unexpected mlx-lm tensor name {shown(path)}")
        node = root
        for p in parts[:-1]:
            node = node.setdefault(int(p), {})
            if not isinstance(node, dict):
                raise CacheFormatError(f"conflicting mlx-lm tensor names at {shown(path)}")
        node[int(parts[-1])] = value
    return root


def _as_list(node) -> list:
    if not isinstance(node, dict):
        return node
    return [_as_list(node[k]) for k in sorted(node)]


def load_mlx_lm(header: Header, arrays: dict[str, mx.array], info) -> list[BaseCache]:
    meta = header.metadata
    if info.layout == "mlx-lm":
        arrays = dict(arrays)
        for path, kind in _scalar_specs(meta):
            if path not in arrays:
                raise CacheFormatError(f"mlx-lm scalar {shown(path)} has no array")
            a = arrays[path]
            arrays[path] = None if kind == "none" else _scalar(a, kind)
        tree = _unflatten(arrays)
        return [_from_032(name, _as_list(tree.get(i, {}))) for i, name in enumerate(info.classes)]
    tree = _unflatten(arrays)
    metas = _as_list(_unflatten({k[2:]: v for k, v in meta.items() if k.startswith("0.")}))
    return [
        _from_legacy(name, _as_list(tree.get(i, {})), metas[i] if i < len(metas) else "")
        for i, name in enumerate(info.classes)
    ]


def _scalar_specs(meta: dict[str, str]) -> list[tuple[str, str]]:
    specs, i = [], 1
    while f"2.{i}.0" in meta:
        kind = meta.get(f"2.{i}.1")
        if kind not in ("scalar", "string", "none"):
            raise CacheFormatError(f"unknown mlx-lm scalar kind {shown(kind)}")
        specs.append((meta[f"2.{i}.0"], kind))
        i += 1
    return specs


def _scalar(a: mx.array, kind: str):
    if kind == "string":
        return "".join(chr(int(c)) for c in a.tolist())
    if a.size != 1:
        raise CacheFormatError("mlx-lm scalar is not a single value")
    return a.item()


def _int(v) -> int:
    import mlx.core as mx

    if isinstance(v, mx.array):
        v = v.item()
    if isinstance(v, str) and v.isascii() and v.isdigit():
        v = int(v)
    if not isinstance(v, (int, float)) or int(v) != v or v < 0:
        raise CacheFormatError(f"mlx-lm cache value {shown(v)} is not a non-negative integer")
    return int(v)


def _kv(keys, values, offset: int, start: int = 0) -> tuple:
    n = offset - start
    return (tuple(k[..., :n, :] for k in keys) if isinstance(keys, list) else keys[..., :n, :],
            tuple(v[..., :n, :] for v in values) if isinstance(values, list) else values[..., :n, :])


def _from_032(name: str, s: list) -> BaseCache:
    """Our cache from an mlx-lm 0.32 ``state`` list (scalars already decoded)."""
    from ..cache import CacheList, ChunkedKVCache, KVCache, QuantizedKVCache

    if name in ("KVCache", "ConcatenateKVCache"):
        keys, values = s[0], s[1]
        offset = _int(s[2]) if len(s) > 2 else keys.shape[2]
        return _kv_cache(KVCache(), *_kv(keys, values, offset), offset)
    if name == "QuantizedKVCache":
        keys, values, offset, gs, bits = s
        c = QuantizedKVCache(_int(gs), _int(bits))
        return _kv_cache(c, *_kv(keys, values, _int(offset)), _int(offset))
    if name == "RotatingKVCache":
        keys, values, offset, keep, max_size, idx = s
        return _rotating(keys, values, *map(_int, (offset, keep, max_size, idx)))
    if name == "ChunkedKVCache":
        keys, values, offset, chunk, start = s
        c = ChunkedKVCache(_int(chunk))
        c.start_position = _int(start)
        return _kv_cache(c, *_kv(keys, values, _int(offset), _int(start)), _int(offset))
    if name == "ArraysCache":
        return _arrays(s[0] if s else [], *s[1:3])
    if name == "CacheList":
        return CacheList(*(_from_032(child[1], _as_list(child[0])) for child in s))
    if name in _KEPT_AS_MLX_LM:
        from ..cache import BatchKVCache, BatchRotatingKVCache

        state = _batch_state(name, s)
        # made by its __init__, then its state setter: mlx-lm's from_state skips __init__, and the
        # attributes only __init__ sets (_lengths, _right_padding) would be missing on the next update
        c = BatchKVCache([0]) if name == "BatchKVCache" else BatchRotatingKVCache(state[4], [0])
        c.state = state
        return c
    raise UnsupportedCacheError(f"mlx-lm cache class {_shown(name)} is not supported")


def _batch_state(name: str, s: list) -> tuple:
    """``s`` checked to be a state mlx-lm's ``BatchKVCache``/``BatchRotatingKVCache`` can hold:
    keys/values ``(B, H, slots, D)`` (or both None), per-sequence ``offset``/``left_padding``
    (1-D integers), write position within the slots. mlx-lm checks nothing here; the
    batch sizes are not compared (its own tests save keys of 4 sequences with 2 paddings)."""
    import mlx.core as mx

    if not isinstance(s, list) or len(s) != _KEPT_AS_MLX_LM[name]:
        raise CacheFormatError(f"mlx-lm {name} state has {len(s) if isinstance(s, list) else 'no'} entries")
    keys, values, offset, left_padding, *rest = s
    if (keys is None) != (values is None):
        raise CacheFormatError(f"mlx-lm {name} has keys without values or values without keys")
    if not all(isinstance(a, mx.array) and a.ndim == 1 and mx.issubdtype(a.dtype, mx.integer)
               for a in (offset, left_padding)):  # fmt: skip
        raise CacheFormatError(f"mlx-lm {name} offset/left_padding are not one integer per sequence")
    slots = 0
    if keys is not None:
        if not all(isinstance(a, mx.array) and a.ndim == 4 for a in (keys, values)) or \
                keys.shape[:3] != values.shape[:3]:
            raise CacheFormatError(f"mlx-lm {name} keys/values are not (batch, heads, slots, dim) arrays")
        slots = keys.shape[2]
    if name == "BatchRotatingKVCache":
        max_size, ring_offset, idx, rotated = map(_int, rest)
        if max_size < 1 or rotated > 1:
            raise CacheFormatError(f"mlx-lm {name} max_size/rotated are invalid")
        rest = [max_size, ring_offset, idx, bool(rotated)]
    else:
        idx = _int(rest[0])
        rest = [idx]
    if idx > slots:
        raise CacheFormatError(f"mlx-lm {name} write position {idx} is past its {slots} slots")
    return (keys, values, offset, left_padding, *rest)


def _from_legacy(name: str, s: list, meta) -> BaseCache:
    """Our cache from an mlx-lm <= 0.31 ``state`` plus ``meta_state`` strings."""
    from ..cache import CacheList, ChunkedKVCache, KVCache, QuantizedKVCache

    meta = _as_list(meta) if isinstance(meta, dict) else meta
    if name in ("KVCache", "ConcatenateKVCache"):
        return _kv_cache(KVCache(), s[0], s[1], s[0].shape[2])
    if name == "QuantizedKVCache":
        offset, gs, bits = map(_int, meta)
        return _kv_cache(QuantizedKVCache(gs, bits), *_kv(s[0], s[1], offset), offset)
    if name == "RotatingKVCache":
        keep, max_size, offset, idx = map(_int, meta)
        return _rotating(s[0], s[1], offset, keep, max_size, idx)
    if name == "ChunkedKVCache":
        chunk, start = map(_int, meta)
        c = ChunkedKVCache(chunk)
        c.start_position = start
        return _kv_cache(c, s[0], s[1], start + s[0].shape[2])
    if name == "ArraysCache":
        return _arrays(s)
    if name == "CacheList":
        names, metas = meta[0], meta[1]
        return CacheList(*(_from_legacy(n, _as_list(st), m) for n, st, m in zip(names, s, metas)))
    raise UnsupportedCacheError(f"mlx-lm cache class {_shown(name)} is not supported")


def _shown(name) -> str:
    """A class name read from a file, safe to put in a one-line message."""
    return clipped(repr(name) if isinstance(name, str) else f"<{type(name).__name__}>", 80)


def _kv_cache(c: KVCache, keys, values, offset: int) -> KVCache:
    c.offset = offset
    c.keys = tuple(keys) if isinstance(keys, list) else keys
    c.values = tuple(values) if isinstance(values, list) else values
    return type(c).from_state(c.state, c.meta_state)  # validates shapes


def _rotating(keys, values, offset: int, keep: int, max_size: int, idx: int) -> RotatingKVCache:
    """mlx-lm ring buffer -> our temporal layout (pinned + last max_size - keep)."""
    import mlx.core as mx

    from ..cache import RotatingKVCache

    def temporal(x):
        L = x.shape[2]
        if idx >= L:
            return x
        if idx < offset:
            return mx.concatenate([x[..., :keep, :], x[..., idx:, :], x[..., keep:idx, :]], axis=2)
        return x[..., :idx, :]

    k, v = temporal(keys), temporal(values)
    held = min(offset, max_size)
    if k.shape[2] < held:
        raise CacheFormatError("mlx-lm rotating cache holds fewer tokens than its offset says")
    if k.shape[2] > held:  # keep the pinned prefix and the most recent tokens
        k = mx.concatenate([k[..., :keep, :], k[..., k.shape[2] - (held - keep):, :]], axis=2)
        v = mx.concatenate([v[..., :keep, :], v[..., v.shape[2] - (held - keep):, :]], axis=2)
    # a wrapped ring of exactly max_size slots: keep mlx-lm's slot order (its _idx, the
    # next slot to write, is the oldest token's); a longer buffer (after a multi-token
    # update) has no ring layout we hold, so it stays in temporal order
    ring = offset > max_size and keys.shape[2] == max_size and keep <= idx < max_size
    meta = (str(offset), str(max_size), str(keep), str(idx if ring else keep))
    return RotatingKVCache.from_state([k, v], meta)


def _arrays(slots, left_padding=None, lengths=None) -> ArraysCache:
    """Our ``ArraysCache`` of ``slots``; with a batch's ``left_padding``/``lengths``
    (1-D integer arrays, one per row), a batch."""
    import mlx.core as mx

    from ..cache import ArraysCache

    slots = slots if isinstance(slots, list) else [slots]
    c = ArraysCache(len(slots))
    c.cache = [a if isinstance(a, mx.array) else None for a in slots]
    pads = [p for p in (left_padding, lengths) if p is not None]
    if not all(isinstance(p, mx.array) and p.ndim == 1 and mx.issubdtype(p.dtype, mx.integer) for p in pads):
        raise CacheFormatError("mlx-lm ArraysCache left_padding/lengths are not one integer per sequence")
    if pads:
        c.prepare(lengths=lengths, left_padding=left_padding)
    return c


# ------------------------------------------------------------------ writing
def _to_mlx_lm(c: BaseCache):
    from mlx_lm.models import cache as lm

    name = type(c).__name__
    if not hasattr(c, "flat_state"):  # a batch (ours: mlx-lm's class) or mlx-lm's own object, saved as it is
        from ..cache import BatchKVCache, BatchRotatingKVCache

        theirs = type(c).__module__.startswith("mlx_lm.") or isinstance(c, (BatchKVCache, BatchRotatingKVCache))
        if name not in _MLX_LM_CLASSES | set(_KEPT_AS_MLX_LM) or not theirs:
            raise UnsupportedCacheError(
                f"cannot save a layer of class {_shown(name)}: it is neither an mlx_chatcache cache "
                "nor one of mlx-lm's cache classes"
            )
        return c
    if name == "KVCache":
        out = lm.KVCache()
        out.keys, out.values = c.keys_and_values()
        out.offset = c.offset
    elif name == "QuantizedKVCache":
        out = lm.QuantizedKVCache(c.group_size, c.bits)
        k, v = c.keys_and_values()
        out.keys, out.values = (list(k), list(v)) if k is not None else (None, None)
        out.offset = c.offset
    elif name == "RotatingKVCache":
        out = lm.RotatingKVCache(c.max_size, c.keep)
        if c.keys is not None and c.offset > c.max_size:  # wrapped: the ring as it is, and its oldest slot
            keys, values, idx = c.keys, c.values, int(c.meta_state[3])  # (offset, max_size, keep, ring_idx)
        else:  # temporal order, the next slot to write after the held tokens
            keys, values = c.state or (None, None)
            idx = keys.shape[2] if keys is not None else 0
        out.state = (keys, values, c.offset, c.keep, c.max_size, idx)  # mlx-lm's (keys, values, offset, keep, max_size, _idx)
    elif name == "ArraysCache":
        out = lm.ArraysCache(len(c.cache))
        out.cache = list(c.cache)
        out.left_padding, out.lengths = c.left_padding, c.lengths
    elif name == "CacheList":
        out = lm.CacheList(*(_to_mlx_lm(x) for x in c.caches))
    else:
        raise UnsupportedCacheError(
            f"{name} cannot be written in mlx-lm format (mlx-lm has no equivalent); "
            "save it with format='mlxcc'"
        )
    return out


def save_mlx_lm(path, cache, metadata: dict[str, str]) -> None:
    """Write ``cache`` as mlx-lm 0.32's ``save_prompt_cache`` would, atomically
    (same temp file, fsync, rename and stale-temp cleanup as our own files)."""
    from mlx_lm.models.cache import save_prompt_cache as lm_save

    lm_cache = [_to_mlx_lm(c) for c in cache]
    write_file_atomic(path, lambda tmp: lm_save(tmp, lm_cache, metadata))


register_format(ForeignFormat("mlx-lm", ("mlx-lm", "mlx-lm-legacy"), detect_mlx_lm, load_mlx_lm, save_mlx_lm))
