"""The cache file format (see docs/cache-format.md) and its save/load API.

``save_prompt_cache(path, cache, metadata, tokens=..., model=..., messages=...)``
writes a self-describing safetensors file atomically. ``load_prompt_cache(path)``
validates everything it reads and returns our cache objects; it also reads files
written by mlx-lm (0.32 layout and the older meta_state layout). Both take
mlx-lm's arguments first, with its meaning; ``load_cache_file`` returns the
file's whole self-description (:class:`CacheFileInfo`) with the layers.
``prompt_cache_bytes`` / ``load_prompt_cache_bytes`` do the same with the file
held in memory (values of a remote store tier). With
``format="mlx-lm"`` we write a file mlx-lm 0.32's ``load_prompt_cache`` accepts.

Layout of our files (format version 5):
- tensors ``layer.{i}.{j}``: array ``j`` of layer ``i``'s ``flat_state()``: its
  ``state``, K/V arrays holding exactly the live tokens (version 2-4 files carry
  zeroed room up to the next multiple of 256 tokens after them); a loader reads
  them into buffers with room to grow (``grown_slots``); rotating caches in
  temporal order, their ``meta_state`` ending in the ring position
  (``ring_idx``) that restores the live slot order (version 1 and 2 files lack
  it and load in temporal slot order);
- metadata ``mlxcc.format_version``, ``mlxcc.num_layers``,
  ``mlxcc.layer.{i}.class`` / ``.meta`` (JSON list of strings) / ``.arrays`` (count),
  ``mlxcc.tokens`` (JSON list of ints), ``mlxcc.messages`` (JSON, chats only),
  ``model.id`` / ``model.weights_hash`` / ``model.tokenizer_hash``, ``user.*``;
- checksums (version 4 on; :mod:`.checksum`): ``mlxcc.tensor_crc32``,
  ``mlxcc.header_crc32``. A version 4 file without them is refused; older
  files have none and load unchecked.
- snapshots (version 6, written only by a file that has some: a chat session's
  checkpoints): ``mlxcc.snapshots`` (count); for snapshot ``s``
  ``mlxcc.snapshot.{s}.layers`` (JSON list of the layer indices copied) and, per
  copied layer ``i``, ``mlxcc.snapshot.{s}.layer.{i}.class`` / ``.meta`` /
  ``.arrays`` with tensors ``snapshot.{s}.layer.{i}.{j}`` (checksummed like the
  layers). :func:`load_snapshots` reads them; loading the cache ignores them.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Sequence

from ..config import VERSION
from ..errors import (
    CacheFormatError, ChatCacheError, ModelMismatchError, UnsupportedCacheError, clipped, one_line,
)  # fmt: skip
from ..models.fingerprint import ModelFingerprint
from . import registry
from .registry import CacheFileInfo
from .atomic import safetensors_bytes, write_atomic
from .safetensors_file import Header, host_tensors, read_arrays, read_header, read_header_bytes

if TYPE_CHECKING:  # the cache classes (and so mlx-lm) load only when arrays become layers
    from ..cache import BaseCache

FORMAT_NAME = "mlx_chatcache"
FORMAT_VERSION = 5  # 5: K/V arrays hold exactly the live tokens; 4: checksums; 3: rotating meta_state
# ends in ring_idx; 2: K/V room; 1: live tokens only
SNAPSHOTS_VERSION = 6  # a file with snapshots (layer copies of earlier points); the newest version read
MAX_SNAPSHOTS = 64
CHECKSUMS_SINCE = 4
MAX_LAYERS = 4096
# the names in mlx_chatcache.cache.CACHE_CLASSES (a test keeps them equal): reading a header checks a
# layer's class name against these without importing the cache classes, hence mlx-lm; any other
# name goes to cache.cache_class, which refuses it with the reason
CACHE_CLASS_NAMES = frozenset({"KVCache", "QuantizedKVCache", "RotatingKVCache", "QuantizedRotatingKVCache",
                               "ChunkedKVCache", "ArraysCache", "CacheList"})


# ------------------------------------------------------------------ save
def save_prompt_cache(
    file_name: str | os.PathLike,
    cache: Sequence[BaseCache],
    metadata: dict[str, str] | None = None,
    *,
    tokens: Sequence[int] | None = None,
    model: ModelFingerprint | None = None,
    messages: list[dict] | None = None,
    text: str | None = None,
    settings: dict | None = None,
    format: str = "mlxcc",
    snapshots: Sequence[Sequence[BaseCache | None]] = (),
) -> None:
    """Save ``cache`` (one cache per layer) atomically to ``file_name`` (mlx-lm's signature).

    ``metadata``: free string metadata; ``tokens``: the token ids the cache holds;
    ``model``: the fingerprint of the model that made it; ``messages``: the chat it
    holds; ``text``: the raw text it holds (no chat template); ``settings``:
    JSON-able shape/sampling settings; ``snapshots``: copies of some layers at
    earlier points (None for a layer not copied), see the module doc. A cache with layers that are not
    our one-sequence caches (a batch, e.g. a ``BatchKVCache``, or mlx-lm's own classes) is written in
    mlx-lm's layout, whatever ``format`` says (see :mod:`.mlxlm`).
    """
    foreign = next((type(c).__name__ for c in cache if not _is_ours(c)), None)
    if format != "mlxcc" or foreign:
        writer = registry.writer_named("mlx-lm" if format == "mlxcc" else format)
        if writer is None:
            names = " or ".join(repr(n) for n in ["mlxcc", *registry.format_names()])
            raise CacheFormatError(f"unknown cache file format {format!r}; use {names}")
        given = [k for k, v in (("tokens", tokens), ("model", model), ("messages", messages), ("text", text),
                                ("settings", settings or None), ("snapshots", snapshots or None))
                 if v is not None]  # fmt: skip
        if given:
            why = f"a {foreign} layer (mlx-lm's class)" if format == "mlxcc" else f"format={format!r}"
            raise UnsupportedCacheError(
                f"cannot save {', '.join(given)} with {why}: that file layout holds only the layers "
                "and string metadata; pass them in metadata or save our cache classes"
            )
        return writer.save(file_name, cache, metadata or {})
    write_atomic(file_name, *_file_contents(file_name, cache, tokens, model, messages, text, settings, metadata,
                                            snapshots))  # fmt: skip


def _is_ours(layer) -> bool:
    """Whether ``layer`` is one of our one-sequence caches (our classes alone have
    ``flat_state``; a batch of ours, see ``batched``, is written in mlx-lm's layout)."""
    return hasattr(layer, "flat_state") and not getattr(layer, "batched", lambda: False)()


def prompt_cache_bytes(
    cache: Sequence[BaseCache],
    *,
    tokens: Sequence[int] | None = None,
    model: ModelFingerprint | None = None,
    settings: dict | None = None,
    metadata: dict[str, str] | None = None,
) -> bytes:
    """The file ``save_prompt_cache`` would write (our format), as bytes."""
    return safetensors_bytes(*_file_contents("cache", cache, tokens, model, None, None, settings, metadata))


def _file_contents(path, cache, tokens, model, messages, text, settings, metadata, snapshots=()):
    """``(arrays, metadata)`` of our file for ``cache``."""
    _check_tokens_match(path, cache, None if tokens is None else list(tokens))
    stored = [c.flat_state() for c in cache]
    meta = _header_metadata(cache, stored, tokens, model, messages, metadata)
    if text is not None:
        meta["mlxcc.text"] = text
    if settings:
        meta["mlxcc.settings"] = json.dumps(settings)
    arrays = {f"layer.{i}.{j}": a for i, layer in enumerate(stored) for j, a in enumerate(layer)}
    if snapshots:
        _add_snapshots(meta, arrays, snapshots, len(cache))
    return arrays, meta


def _add_snapshots(meta: dict, arrays: dict, snapshots, num_layers: int) -> None:
    if len(snapshots) > MAX_SNAPSHOTS:
        raise UnsupportedCacheError(f"a cache file holds at most {MAX_SNAPSHOTS} snapshots, not {len(snapshots)}")
    meta["mlxcc.format_version"] = str(SNAPSHOTS_VERSION)
    meta["mlxcc.snapshots"] = str(len(snapshots))
    for s, snap in enumerate(snapshots):
        if len(snap) != num_layers:
            raise UnsupportedCacheError(f"snapshot {s} has {len(snap)} layers, the cache {num_layers}")
        copied = [i for i, c in enumerate(snap) if c is not None]
        meta[f"mlxcc.snapshot.{s}.layers"] = json.dumps(copied)
        for i in copied:
            state = snap[i].flat_state()
            meta[f"mlxcc.snapshot.{s}.layer.{i}.class"] = type(snap[i]).__name__
            meta[f"mlxcc.snapshot.{s}.layer.{i}.meta"] = json.dumps(list(snap[i].meta_state))
            meta[f"mlxcc.snapshot.{s}.layer.{i}.arrays"] = str(len(state))
            arrays.update({f"snapshot.{s}.layer.{i}.{j}": a for j, a in enumerate(state)})


def _header_metadata(cache, stored, tokens, model, messages, metadata) -> dict[str, str]:
    meta = {
        "mlxcc.format": FORMAT_NAME,
        "mlxcc.format_version": str(FORMAT_VERSION),
        "mlxcc.created_by": f"mlx_chatcache {VERSION}",
        "mlxcc.num_layers": str(len(cache)),
    }
    for i, c in enumerate(cache):
        meta[f"mlxcc.layer.{i}.class"] = type(c).__name__
        meta[f"mlxcc.layer.{i}.meta"] = json.dumps(list(c.meta_state))
        meta[f"mlxcc.layer.{i}.arrays"] = str(len(stored[i]))
    if tokens is not None:
        meta["mlxcc.tokens"] = json.dumps([int(t) for t in tokens])
    if messages is not None:
        meta["mlxcc.messages"] = json.dumps(messages, ensure_ascii=False)
    if model is not None:
        meta.update(model.to_metadata())
    for k, v in (metadata or {}).items():
        meta[f"user.{k}"] = str(v)
    return meta


# ------------------------------------------------------------------ load
def read_cache_info(path: str | os.PathLike) -> CacheFileInfo:
    """The file's self-description, validated, without reading its arrays."""
    return info_from_header(read_header(path))


def verify_cache_file(path: str | os.PathLike) -> bool:
    """Read every tensor's bytes of ``path`` and check the file against its checksums
    (without MLX): True when it carries them and they all match, False when it carries
    none (an older file, an mlx-lm file); damage raises CacheFileError (a header that
    lost its checksums must still be one of those files, whole)."""
    header = read_header(path)
    if header.checksums is None:
        info_from_header(header)
        return False
    for _ in host_tensors(header):  # each tensor read and checked, then let go
        pass
    return True


def load_prompt_cache(
    file_name: str | os.PathLike,
    return_metadata: bool = False,
    *,
    model: ModelFingerprint | None = None,
    what: str = "cache file",
):
    """Load a cache file (ours or mlx-lm's; mlx-lm's signature). With ``model``, refuse
    a file made for another model (before reading its arrays; ``what`` names the file
    in the ModelMismatchError). Returns the cache, or ``(cache, metadata)`` with the
    string metadata it was saved with. :func:`load_cache_file` returns all the file says."""
    cache, info = _load(read_header(file_name), model, what)
    return (cache, info.metadata) if return_metadata else cache


def load_cache_file(path: str | os.PathLike, *, model: ModelFingerprint | None = None,
                    what: str = "cache file") -> tuple[list[BaseCache], CacheFileInfo]:  # fmt: skip
    """:func:`load_prompt_cache` returning ``(cache, CacheFileInfo)``: the layers and
    everything the file says about them (tokens, model, messages, settings...). Only
    our cache classes: a file of mlx-lm's batch classes is refused (UnsupportedCacheError)."""
    cache, info = _load(read_header(path), model, what)
    foreign = next((type(c).__name__ for c in cache if not _is_ours(c)), None)
    if foreign:
        raise UnsupportedCacheError(
            f"{path} holds mlx-lm {foreign} layers (batched generation), which mlx_chatcache does not "
            "generate with; load it with mlx_chatcache.load_prompt_cache or mlx-lm"
        )
    return cache, info


def load_prompt_cache_bytes(data: bytes, name: str, *, model: ModelFingerprint | None = None):
    """:func:`load_prompt_cache` for a file held in memory (``name`` stands for
    its path in messages): the same checks. Returns ``(cache, CacheFileInfo)``."""
    return load_header(read_header_bytes(data, name), model=model)


def load_header(header: Header, *, model: ModelFingerprint | None = None):
    """``(cache, CacheFileInfo)`` of the file whose validated header is ``header`` (its
    arrays read as :func:`load_prompt_cache` reads them; ``header.checked``: not checked again)."""
    return _load(header, model, str(header.path))


def _load(header: Header, model: ModelFingerprint | None, what: str):
    info = info_from_header(header)
    if model is not None:
        model.check(info.model, what=what)
    try:
        if info.layout == "mlxcc":
            cache = _build_layers(header, info)
        else:
            cache = registry.reader_for(info.layout).load(header, read_arrays(header), info)
    except ChatCacheError:
        raise
    except Exception as e:  # a malformed array/meta combination we did not foresee
        detail = one_line(f"{type(e).__name__}: {e}", 200)  # one line, even for array reprs
        raise CacheFormatError(
            f"{header.path}: cache layers are inconsistent ({detail}); delete the file or rebuild it"
        ) from e
    _check_tokens_match(header.path, cache, info.tokens)
    return cache, info


def _build_layers(header: Header, info: CacheFileInfo) -> list[BaseCache]:
    """The layers, their K/V arrays read straight into buffers with room to grow."""
    from ..cache import cache_class

    layers = info.extra["layers"]
    names = [f"layer.{i}.{j}" for i, (_, count) in enumerate(layers) for j in range(count)]
    slots = {}
    for i, name in enumerate(info.classes):
        for j in range(layers[i][1]):
            t = header.tensors[f"layer.{i}.{j}"]
            if len(t.shape) == 4:
                slots[t.name] = cache_class(name).grown_slots(t.shape[2])
    arrays = read_arrays(header, names, slots=slots)
    cache = []
    for i, name in enumerate(info.classes):
        meta, count = info.extra["layers"][i]
        state = [arrays.pop(f"layer.{i}.{j}") for j in range(count)]  # the cache owns them alone
        cache.append(cache_class(name).from_flat_state(state, meta))
    return cache


def _check_tokens_match(path, cache, tokens) -> None:
    if tokens is None:
        return
    for i, c in enumerate(cache):
        if _is_ours(c) and c.offset not in (0, len(tokens)):  # mlx-lm's batch layers: one offset per sequence
            raise CacheFormatError(
                f"{path}: layer {i} holds {c.offset} tokens but {len(tokens)} token ids are "
                "listed; the cache and its tokens disagree (tampered or damaged file): rebuild it"
            )


# ------------------------------------------------------------------ header parsing
def info_from_header(header: Header) -> CacheFileInfo:
    """What a validated header (:func:`.safetensors_file.read_header`) says about its file."""
    meta = header.metadata
    nbytes = sum(t.end - t.begin for t in header.tensors.values())
    if meta.get("mlxcc.format") == FORMAT_NAME:
        info = _parse_ours(header)
    else:
        info = registry.detect(header)
        if info is None:
            raise CacheFormatError(
                f"{header.path} is a safetensors file but not a prompt cache (no mlx_chatcache "
                "or mlx-lm cache metadata); pass a file made by mlxcc or mlx-lm"
            )
    info.nbytes = nbytes
    info.slots = max((t.shape[2] for t in header.tensors.values() if len(t.shape) == 4), default=0)
    return info


def _parse_ours(header: Header) -> CacheFileInfo:
    meta, path = header.metadata, header.path
    version = _int_field(path, meta, "mlxcc.format_version")
    if version > SNAPSHOTS_VERSION or FORMAT_VERSION < version < SNAPSHOTS_VERSION:
        raise CacheFormatError(
            f"{path} uses cache format version {version}, newer than this mlx_chatcache "
            f"understands ({FORMAT_VERSION}, {SNAPSHOTS_VERSION} with snapshots); upgrade mlx_chatcache"
        )
    if version < 1:
        raise CacheFormatError(f"{path}: invalid cache format version {version}")
    if version >= CHECKSUMS_SINCE and header.checksums is None:
        raise CacheFormatError(
            f"{path} is damaged (a version {version} file carries checksums, this one has none): "
            "nothing was loaded: delete it or rebuild it (mlxcc cache-prompt)"
        )
    n = _int_field(path, meta, "mlxcc.num_layers")
    if n > MAX_LAYERS:
        raise CacheFormatError(f"{path}: implausible layer count {n}")
    classes, layers = [], []
    for i in range(n):
        name = meta.get(f"mlxcc.layer.{i}.class")
        if name not in CACHE_CLASS_NAMES:  # unknown or hostile names fail here, before any array is read
            from ..cache import cache_class

            cache_class(name)
        lm, count = _layer_record(header, f"mlxcc.layer.{i}", f"layer.{i}", f"layer {i}")
        classes.append(name)
        layers.append((lm, count))
    expected = {f"layer.{i}.{j}" for i, (_, c) in enumerate(layers) for j in range(c)}
    snapshots = _parse_snapshots(header, n) if version >= SNAPSHOTS_VERSION else []
    expected |= {f"snapshot.{s}.layer.{i}.{j}" for s, snap in enumerate(snapshots)
                 for i, (_, _, c) in snap.items() for j in range(c)}  # fmt: skip
    if set(header.tensors) != expected:
        raise CacheFormatError(f"{path}: the file holds arrays no layer claims; it was tampered with")
    return CacheFileInfo(
        path=str(path),
        format_version=version,
        layout="mlxcc",
        classes=classes,
        tokens=registry.parse_tokens(path, meta.get("mlxcc.tokens")),
        model=ModelFingerprint.from_metadata(meta),
        messages=registry.parse_messages(path, meta.get("mlxcc.messages")),
        text=meta.get("mlxcc.text"),
        settings=registry.parse_settings(path, meta.get("mlxcc.settings")),
        metadata={k[5:]: v for k, v in meta.items() if k.startswith("user.")},
        extra={"layers": layers, "snapshots": snapshots},
    )


def _layer_record(header: Header, key: str, arrays: str, what: str) -> tuple[tuple[str, ...], int]:
    """``(meta state, array count)`` of the layer record under metadata ``key``, its
    arrays ``{arrays}.0 ..`` all present; CacheFormatError naming ``what`` otherwise."""
    meta, path = header.metadata, header.path
    lm = _json_field(path, meta, f"{key}.meta")
    if not isinstance(lm, list) or not all(isinstance(x, str) for x in lm):
        raise CacheFormatError(f"{path}: {what} meta state is not a list of strings")
    count = _int_field(path, meta, f"{key}.arrays")
    for j in range(count):
        if f"{arrays}.{j}" not in header.tensors:
            raise CacheFormatError(f"{path}: array {arrays}.{j} is missing; the file is damaged")
    return tuple(lm), count


def _parse_snapshots(header: Header, num_layers: int) -> list[dict[int, tuple[str, tuple, int]]]:
    """Per snapshot ``{layer index: (class, meta, array count)}``, checked like the layers."""
    meta, path = header.metadata, header.path
    n = _int_field(path, meta, "mlxcc.snapshots")
    if n > MAX_SNAPSHOTS:
        raise CacheFormatError(f"{path}: implausible snapshot count {n}")
    out = []
    for s in range(n):
        copied = _json_field(path, meta, f"mlxcc.snapshot.{s}.layers")
        if not (isinstance(copied, list) and all(type(i) is int and 0 <= i < num_layers for i in copied)
                and len(set(copied)) == len(copied)):  # fmt: skip
            raise CacheFormatError(f"{path}: snapshot {s} lists invalid layers; the file is damaged")
        snap = {}
        for i in copied:
            key = f"mlxcc.snapshot.{s}.layer.{i}"
            name = meta.get(f"{key}.class")
            if name not in CACHE_CLASS_NAMES:
                raise CacheFormatError(f"{path}: snapshot {s} layer {i} has an unknown class; the file is damaged")
            lm, count = _layer_record(header, key, f"snapshot.{s}.layer.{i}", f"snapshot {s} layer {i}")
            snap[i] = (name, lm, count)
        out.append(snap)
    return out


def load_snapshots(path: str | os.PathLike) -> list[list[BaseCache | None]]:
    """The snapshots of the cache file ``path`` (see the module doc), one list of
    layers per snapshot (None: a layer not copied); [] for a file without any.
    Their arrays are checked against the file's checksums."""
    from ..cache import cache_class

    header = read_header(path)
    info = info_from_header(header)
    snaps = (info.extra or {}).get("snapshots") or []
    names = [f"snapshot.{s}.layer.{i}.{j}" for s, snap in enumerate(snaps) for i, (_, _, c) in snap.items()
             for j in range(c)]  # fmt: skip
    if not names:
        return []
    arrays = read_arrays(header, names)
    try:
        return [[cache_class(snap[i][0]).from_flat_state([arrays.pop(f"snapshot.{s}.layer.{i}.{j}")
                                                     for j in range(snap[i][2])], snap[i][1])
                 if i in snap else None for i in range(len(info.classes))]
                for s, snap in enumerate(snaps)]  # fmt: skip
    except ChatCacheError:
        raise
    except Exception as e:
        detail = one_line(f"{type(e).__name__}: {e}", 200)
        raise CacheFormatError(f"{path}: a snapshot is inconsistent ({detail}); the file is damaged") from e


def _int_field(path, meta: dict, key: str) -> int:
    v = meta.get(key)
    if not isinstance(v, str) or not (v.isascii() and v.isdigit()) or len(v) > 12:
        raise CacheFormatError(
            f"{path}: metadata {key} is missing or not a number ({clipped(repr(v), 40)}); the file is damaged"
        )
    return int(v)


def _json_field(path, meta: dict, key: str):
    try:
        return json.loads(meta[key])
    except (KeyError, ValueError, RecursionError):  # ValueError: bad JSON, too-long integers
        raise CacheFormatError(f"{path}: metadata {key} is missing or not JSON; the file is damaged") from None


def check_cache_fits_model(cache: Sequence[BaseCache], expected: Sequence[BaseCache], path="cache") -> None:
    """Refuse a cache whose layer count or layer kinds differ from the model's own."""
    if len(cache) != len(expected):
        raise ModelMismatchError(
            f"{path} has {len(cache)} layers but the model has {len(expected)}; "
            "it was made with another model: use that model or rebuild the cache"
        )
    for i, (c, e) in enumerate(zip(cache, expected)):
        if _family(c) != _family(e):
            raise ModelMismatchError(
                f"{path} layer {i} is a {type(c).__name__} but the model needs a "
                f"{type(e).__name__}; it was made with another model: rebuild the cache"
            )


def _family(c: BaseCache) -> str:
    name = type(c).__name__
    return "arrays" if name == "ArraysCache" else "list" if name == "CacheList" else "kv"


__all__ = [
    "CacheFileInfo",
    "save_prompt_cache",
    "prompt_cache_bytes",
    "load_prompt_cache",
    "load_cache_file",
    "load_prompt_cache_bytes",
    "read_cache_info",
    "info_from_header",
    "verify_cache_file",
    "check_cache_fits_model",
    "FORMAT_VERSION",
    "SNAPSHOTS_VERSION",
    "load_snapshots",
]
