"""Every default of mlx_chatcache (and its version): generation settings in one dataclass, the
one default of a chat session that is not a generation setting, and the time
budget of an interruptible model call.

Library functions take ``None`` for "use the default" and read it from
:data:`DEFAULTS`; the CLI builds its flag defaults from the same object.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

VERSION = "0.1.0"  # mlx_chatcache.__version__ (the package's, recorded in every cache file it writes)


@dataclass(frozen=True)
class CacheShape:
    """What shapes a prompt cache, so caches made otherwise are never mixed: a
    rotating window of ``max_kv_size`` tokens (None: unbounded) pinning its first
    ``keep``, and the KV quantization (``kv_bits``, None: float; ``kv_group_size``;
    from ``quantized_kv_start`` tokens on) and the dtype its K/V are held in
    (``kv_dtype``: one of :data:`KV_DTYPES`; "auto" keeps the model's activation
    dtype). Every cache file mlxcc writes records these keys (:data:`SHAPE_KEYS`)
    among its settings; a file that does not record ``kv_dtype`` reads as "auto"."""

    max_kv_size: int | None = None
    keep: int = 4  # tokens pinned by a rotating cache when nothing better is known
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = 0
    kv_dtype: str = "auto"

    def settings(self) -> dict:
        """The shape as a file records it: every key of :data:`SHAPE_KEYS`."""
        return asdict(self)

    @classmethod
    def recorded(cls, settings: dict, path) -> "CacheShape":
        """The shape a file's ``settings`` record (the file at ``path``); keys it does not
        record are the defaults. CacheFormatError when a window is not integers."""
        from .errors import CacheFormatError

        shape = cls(**{k: settings[k] for k in SHAPE_KEYS if k in settings})
        if shape.max_kv_size is not None and (type(shape.max_kv_size) is not int or type(shape.keep) is not int):
            raise CacheFormatError(f"{path}: settings max_kv_size/keep are not integers; the file is damaged")
        if shape.kv_dtype not in KV_DTYPES:
            raise CacheFormatError(f"{path}: settings kv_dtype is {str(shape.kv_dtype)[:40]!r}, not one of "
                                   f"{', '.join(KV_DTYPES)}; the file is damaged")  # fmt: skip
        return shape

    def agrees(self, max_kv_size: int | None, keep: int | None = None) -> bool:
        """Whether a cache of this shape has the window a run asks for: none
        (``max_kv_size`` None) or this one (``keep`` too, unless None). A cache keeps
        the window it was made with; what a run on it uses is
        :meth:`GenerationConfig.windowed`, what a file records :meth:`recording`."""
        return max_kv_size is None or (max_kv_size == self.max_kv_size and keep in (None, self.keep))

    def recording(self, settings: dict, config: "GenerationConfig | None" = None) -> dict:
        """The settings a cache file records for a cache of this shape: ``settings`` (what
        the file recorded before, the weight policy), this window and K/V dtype or, when
        ``config`` runs the cache, this window and the KV settings it runs with (then every
        key of :data:`SHAPE_KEYS`; a run's K/V dtype is the cache's, else it is refused)."""
        if config is None:
            return {**settings, "max_kv_size": self.max_kv_size, "keep": self.keep, "kv_dtype": self.kv_dtype}
        return {**settings, **config.windowed(self).shape.settings()}

    def adopted(self, flags: dict) -> "CacheShape | None":
        """This recorded shape with the settings ``flags`` give (shape keys set by the
        user; the window's ``keep`` is never a flag), or None when they ask for another
        window (``max_kv_size``): the caller refuses in its own words."""
        if not self.agrees(flags.get("max_kv_size")):
            return None
        kv = {k: v for k, v in flags.items() if k in SHAPE_KEYS and k not in ("max_kv_size", "keep")}
        return replace(self, **{k: v for k, v in kv.items() if v is not None})


# the settings that shape a cache, in the order files record them
SHAPE_KEYS: tuple[str, ...] = tuple(f.name for f in fields(CacheShape))


def shape_settings(settings: dict) -> dict:
    """The keys of ``settings`` that shape a cache; ``keep`` only with a window."""
    shape = {k: settings[k] for k in SHAPE_KEYS if k in settings}
    if shape.get("max_kv_size") is None:
        shape.pop("keep", None)
    return shape


def shape_differences(theirs: dict, ours: dict) -> list[str]:
    """The shape keys two settings both record with different values (in SHAPE_KEYS order)."""
    theirs, ours = shape_settings(theirs), shape_settings(ours)
    return [k for k in SHAPE_KEYS if k in theirs and k in ours and theirs[k] != ours[k]]
_SHAPE = CacheShape()


@dataclass(frozen=True)
class GenerationConfig:
    # sampling
    max_tokens: int = 256
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    repetition_penalty: float | None = None
    repetition_context_size: int = 20  # the recent context tokens every penalty looks at (as mlx-lm's 20)
    presence_penalty: float = 0.0  # subtracted once from each token among them
    frequency_penalty: float = 0.0  # subtracted once per occurrence among them
    logit_bias: tuple[tuple[int, float], ...] | None = None  # (token id, added to its logit), ids ascending
    seed: int | None = None
    # prompt processing
    prefill_step_size: int = 2048  # as mlx_lm.generate (DEFAULT_PREFILL_STEP_SIZE)
    # cache shape (CacheShape's fields, its defaults)
    max_kv_size: int | None = _SHAPE.max_kv_size
    keep: int = _SHAPE.keep
    kv_bits: int | None = _SHAPE.kv_bits
    kv_group_size: int = _SHAPE.kv_group_size
    quantized_kv_start: int = _SHAPE.quantized_kv_start
    kv_dtype: str = _SHAPE.kv_dtype
    # speculative decoding (never changes a greedy reply, nor a sampled reply's distribution)
    num_draft_tokens: int | None = None  # tokens drafted per target call (None: the draft source's default); 0: off
    prompt_lookup: str = "off"  # draft from n-gram matches: "prompt" (the request's tokens), "store" (then the store's)
    lookup_ngram: int = 3  # the longest n-gram prompt lookup matches (shorter ones down to LOOKUP_MIN_NGRAM after it)

    @property
    def shape(self) -> CacheShape:
        """The cache shape these settings make."""
        return CacheShape(**{k: getattr(self, k) for k in SHAPE_KEYS})

    def shaped(self, shape: CacheShape) -> "GenerationConfig":
        """A copy whose cache-shape fields are ``shape``'s."""
        return replace(self, **shape.settings())

    def windowed(self, shape: CacheShape) -> "GenerationConfig":
        """A copy with the window (``max_kv_size``, ``keep``) of ``shape``: these settings
        applied to a cache made with that window."""
        return replace(self, max_kv_size=shape.max_kv_size, keep=shape.keep)

    def updated(self, **changes) -> "GenerationConfig":
        """A copy with ``changes`` applied; None values are ignored."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


DEFAULTS = GenerationConfig()


@dataclass(frozen=True)
class Range:
    """The values a setting takes: a number from ``low`` to ``high`` (``open_low``:
    ``low`` itself excluded; None: no bound), an integer when ``integer``, one of
    ``choices`` when given, or None when ``optional``. Floats must be finite."""

    low: float | None = None
    high: float | None = None
    integer: bool = False
    optional: bool = False
    choices: tuple[int | str, ...] = ()  # all ints, or all strings (then the value is one of them)
    open_low: bool = False
    token_map: bool = False  # the value maps token ids (integers >= 0) to numbers in the range

    def describe(self) -> str:
        """The range in words: "an integer >= 1", "between 0 and 1 (0 excluded)", "one of 32, 64"."""
        if self.token_map:
            return f"a map of token ids (integers >= 0) to numbers {replace(self, token_map=False).describe()}"
        if self.choices:
            return "one of " + ", ".join(map(str, self.choices))
        kind = "an integer " if self.integer else ""
        low = None if self.low is None else _num(self.low)
        if low is not None and self.high is not None:
            return f"{kind}between {low} and {_num(self.high)}" + (f" ({low} excluded)" if self.open_low else "")
        if low is not None:  # floats are finite: infinity is no value of a range open at the top
            return f"{kind or 'a finite number '}{'>' if self.open_low else '>='} {low}"
        return kind.strip() or "a finite number"

    def holds(self, v) -> bool:
        """Whether ``v`` (already of the right type) is in the range."""
        if self.choices:
            return v in self.choices
        if self.low is not None and (v < self.low or (self.open_low and v == self.low)):
            return False
        return self.high is None or v <= self.high


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


SEED_LIMIT = 2**64  # mx.random.seed takes 0 <= seed < 2**64
TOKEN_COUNT_MAX = 2**31 - 1  # token counts past this are never meant (and overflow int32 arrays)

# the dtypes a cache may hold its K/V in (CacheShape.kv_dtype); "auto": the activation dtype
# (on the float32 weight policy, float32): float16 kept the demo model's greedy replies but
# decoded no faster on CPU (benchmarks/kv_dtype.py, benchmarks/RESULTS.md), so auto does not cast
KV_DTYPES: tuple[str, ...] = ("auto", "float16", "bfloat16", "float32")

# speculative decoding (generation/speculative.py): the draft sources' defaults. The lookup ones are tuned
# on the demo model (benchmarks/speculative.py --tune replays every n-gram size and draft length over the
# benchmark's greedy replies with measured call costs; RESULTS.md, section speculative_tuning): n-grams of
# 3 then 2 and up to 8 drafts (the length adapts per round) were within 3% of the best on code editing and
# quoting chats, and never below plain decoding on fresh prose
PROMPT_LOOKUP: tuple[str, ...] = ("off", "prompt", "store")  # GenerationConfig.prompt_lookup
DRAFT_MODEL_TOKENS = 3  # tokens a draft model drafts per target call (mlx-lm's --num-draft-tokens default)
LOOKUP_DRAFT_TOKENS = 8  # tokens prompt lookup and store drafts propose per target call at most
LOOKUP_MIN_NGRAM = 2  # the shortest n-gram prompt lookup and store drafts match
MAX_DRAFT_TOKENS = 64
MAX_LOOKUP_NGRAM = 16

# the values each GenerationConfig field takes, checked where a value enters (flags, /set,
# request fields, session files) by check_setting; rules between fields are in check_window
RANGES: dict[str, Range] = {
    "max_tokens": Range(1, TOKEN_COUNT_MAX, integer=True),
    "temp": Range(0.0),
    "top_p": Range(0.0, 1.0, open_low=True),  # 0 would leave the sampler no token
    "top_k": Range(0, TOKEN_COUNT_MAX, integer=True),
    "min_p": Range(0.0, 1.0),
    "min_tokens_to_keep": Range(1, TOKEN_COUNT_MAX, integer=True),
    "repetition_penalty": Range(0.0, open_low=True, optional=True),  # 0 would divide by zero
    "repetition_context_size": Range(1, TOKEN_COUNT_MAX, integer=True),
    "presence_penalty": Range(-2.0, 2.0),  # OpenAI's range
    "frequency_penalty": Range(-2.0, 2.0),
    "logit_bias": Range(-100.0, 100.0, optional=True, token_map=True),
    "seed": Range(0, SEED_LIMIT - 1, integer=True, optional=True),
    "prefill_step_size": Range(1, TOKEN_COUNT_MAX, integer=True),
    "max_kv_size": Range(1, TOKEN_COUNT_MAX, integer=True, optional=True),
    "keep": Range(0, TOKEN_COUNT_MAX, integer=True),
    "kv_bits": Range(integer=True, optional=True, choices=(2, 3, 4, 5, 6, 8)),
    "kv_group_size": Range(integer=True, choices=(32, 64, 128)),
    "quantized_kv_start": Range(0, TOKEN_COUNT_MAX, integer=True),
    "kv_dtype": Range(choices=KV_DTYPES),
    "num_draft_tokens": Range(0, MAX_DRAFT_TOKENS, integer=True, optional=True),
    "prompt_lookup": Range(choices=PROMPT_LOOKUP),
    "lookup_ngram": Range(1, MAX_LOOKUP_NGRAM, integer=True),
}


MAX_CHOICES = 8  # the most choices (``n``) one server request may ask for (ServerConfig.max_n)

# the values of request fields that are not GenerationConfig fields, checked by check_setting too
REQUEST_RANGES: dict[str, Range] = {
    "n": Range(1, MAX_CHOICES, integer=True),
    "top_logprobs": Range(0, 20, integer=True),  # OpenAI's range
    "completion_logprobs": Range(0, 5, integer=True),  # a completion's integer ``logprobs`` (OpenAI's range)
}

# the server settings checked by check_setting too (``mlxcc serve``'s flags)
SERVER_RANGES: dict[str, Range] = {
    "max_batch": Range(1, 64, integer=True),  # rows decoded in one model call
    "drain_seconds": Range(0.0, 3600.0),  # how long a stopping server lets running requests finish
    "api_key_length": Range(1, 1024, integer=True),  # characters of an API key (printable ASCII, no spaces)
}


def range_of(name: str) -> Range:
    """The :class:`Range` of GenerationConfig field or request field ``name``."""
    if name in RANGES:
        return RANGES[name]
    return REQUEST_RANGES[name] if name in REQUEST_RANGES else SERVER_RANGES[name]


class SettingError(ValueError):
    """A setting's value is outside :data:`RANGES` (or its window holds no more than
    ``keep``). ``str()`` is "must be RANGE, got VALUE", to follow the setting's name as
    the user wrote it (a flag, a field); ``named`` is the line with the field's name."""

    def __init__(self, name: str, message: str, named: str | None = None):
        super().__init__(message)
        self.name = name
        self.named = named or f"{name} {message}"


def check_setting(name: str, value):
    """``value`` for GenerationConfig field (or request field, :data:`REQUEST_RANGES`)
    ``name`` (an int given for a float field becomes a float: finite ones only), or
    :class:`SettingError`. None is a value of the optional fields only. A token map
    (a dict, or (id, number) pairs; ids may be decimal strings, as JSON keys are)
    becomes a tuple of (int id, float) pairs in ascending id order."""
    r = range_of(name)
    if value is None and r.optional:
        return None
    if r.token_map:
        pairs = _token_pairs(value, replace(r, token_map=False))
        if pairs is not None:
            return pairs
        ok = False
    elif r.choices and isinstance(r.choices[0], str):
        ok = type(value) is str and r.holds(value)
    elif r.integer:
        ok = type(value) is int and r.holds(value)
    else:
        ok = type(value) in (int, float) and math.isfinite(value) and r.holds(value)
    if not ok:
        shown = repr(value) if isinstance(value, str) else str(value)
        raise SettingError(name, f"must be {r.describe()}, got {shown if len(shown) <= 40 else shown[:37] + '...'}")
    return value if r.integer or isinstance(value, str) else float(value)


def _token_pairs(value, r: Range) -> tuple[tuple[int, float], ...] | None:
    """``value`` as sorted (id, number) pairs with every number in ``r``; None when it is not one."""
    items = value.items() if isinstance(value, dict) else value
    if not isinstance(value, (dict, list, tuple)):
        return None
    out = {}
    for item in items:
        if not (isinstance(item, (list, tuple)) and len(item) == 2):
            return None
        k, v = item
        if type(k) is str and k.isascii() and k.isdecimal() and len(k) <= 10:
            k = int(k)
        if not (type(k) is int and 0 <= k <= TOKEN_COUNT_MAX and k not in out):
            return None
        if not (type(v) in (int, float) and math.isfinite(v) and r.holds(v)):
            return None
        out[k] = float(v)
    return tuple(sorted(out.items()))


def check_config(config: GenerationConfig) -> GenerationConfig:
    """``config`` when every field is in :data:`RANGES`, else :class:`SettingError`
    (the window's rule is :func:`check_window`, checked where a cache is made)."""
    for name in RANGES:
        check_setting(name, getattr(config, name))
    return config


def check_window(max_kv_size: int | None, keep: int) -> None:
    """SettingError unless a rotating window (``max_kv_size``) holds more than its ``keep`` pinned tokens."""
    if max_kv_size is not None and max_kv_size <= keep:
        line = (f"max_kv_size ({max_kv_size}) must be larger than keep ({keep}), the tokens the window pins; "
                f"use --max-kv-size {keep + 1} or more (much larger in practice)")  # fmt: skip
        raise SettingError("max_kv_size", line, named=line)


# CPU backend (Linux): OpenBLAS threads for MLX's float matmuls (see mlx_chatcache.backend.blas;
# MLXCC_BLAS_THREADS overrides) and how weights are held (see mlx_chatcache.models.weights).
# "auto": the cores this process may use minus the 1-minute load average (rounded), 1 to 8:
# on a busy 2-core machine 2 OpenBLAS threads were 2-5x slower than 1, on an idle one ~2x faster.
BLAS_THREADS: int | str = "auto"
BLAS_MAX_AUTO_THREADS = 8
WEIGHTS = "auto"  # q | float32 | auto (--weights)
FLOAT32_MAX_BYTES = 2 * 10**9  # auto: float32 weights when they take at most this (and RAM/4)
PREFILL_DEQUANT_ROWS = 8  # q: calls of at least this many rows use dequantized float32 weights

DEFAULT_MAX_CHECKPOINTS = 4  # chat turns whose cache copies are kept for undo/retry (ChatSession)
SESSION_CHECKPOINT_BYTES = 256 * 2**20  # a session file keeps the newest checkpoint copies up to this many bytes
CONTEXT_WARNING_FRACTION = 0.8  # a chat warns once when a turn may fill this much of the context (or window)

# the longest a model call should take where Ctrl-C must be acted upon (the CLI,
# a chat turn that polls a stop request): prompt processing is split to fit (pacing.py)
INTERRUPTIBLE_CALL_SECONDS = 0.5


def mlxcc_home() -> Path:
    """Where sessions live: ``$MLXCC_HOME`` or ``~/.mlxcc``."""
    return Path(os.environ.get("MLXCC_HOME") or Path.home() / ".mlxcc")


@dataclass(frozen=True)
class ServerConfig:
    """Defaults of ``mlxcc serve`` and its prompt-cache store."""

    host: str = "127.0.0.1"
    port: int = 8080
    history_period_s: float = 10.0  # GET /v1/store: one sample of the served-token totals per period at most
    history_size: int = 360  # samples kept (an hour at 10 s)
    store_report_pins: int = 100  # GET /v1/store lists the keys pinning the most bytes, this many at most
    memory_cache_bytes: int = 2_000_000_000  # memory tier budget (0: no memory tier)
    disk_cache_bytes: int = 16_000_000_000  # disk tier budget (0: no disk tier)
    cache_dir_name: str = "server-cache"  # under mlxcc_home() unless --cache-dir is given
    # every tier keeps a cache of plain K/V layers as blocks of this many tokens, named by their hash
    # chain (a block is one value: a file on disk, a key in Redis); see benchmarks/RESULTS.md for the
    # trade: 50 chats sharing a 1,000-token prompt within 1.25x of their unique tokens' bytes, and a disk
    # checkout opening one file per block
    store_block_tokens: int = 32
    # speculative decoding's store drafts (--store-drafts): the n-gram index of the tokens the store holds
    # for the model keeps this many tokens (int32) and a power of two of slots (int64) of at least 3 per
    # token: 38 MB for the default, fixed when the index is made (store/draft_index.py)
    draft_index_tokens: int = 1_000_000
    draft_index_scopes: int = 4  # scopes (tenants, cache shapes) with an index at once; the least recently used goes
    disk_rescan_seconds: float = 1.0  # a disk tier looks for values other processes added at most this often
    max_queue: int = 64  # requests waiting for the generation worker; more get HTTP 503
    # rows decoded together in one model call (1: one request at a time); decoding on a CPU
    # is bound by reading the weights, which a call does once for all its rows: on the demo
    # model 8 rows still decode 1.7x the tokens/s of 4 (benchmarks/server_batch.py)
    max_batch: int = 8
    max_stop_sequences: int = 4  # as OpenAI's API
    max_n: int = MAX_CHOICES  # choices one request may ask for (each a generation on its own cache copy)
    retry_after_s: int = 1  # the Retry-After of a 503 (queue full, or the server draining)
    drain_seconds: float = 30.0  # on SIGTERM/SIGINT: how long running requests may still finish
    # the Redis tier (--cache-redis; shared by replicas), see mlx_chatcache/store/redis_tier.py; Redis's own
    # maxmemory and eviction policy bound what it holds
    redis_ttl_seconds: int = 24 * 3600  # a value unused this long expires
    redis_key_prefix: str = "mlxcc"
    redis_write_queue: int = 8  # puts waiting for the background writer; more are dropped (counted)
    redis_socket_timeout: float = 1.0  # seconds per Redis operation before the tier counts Redis as down
    redis_connect_timeout: float = 0.5
    redis_backoff_seconds: tuple[float, float] = (0.5, 30.0)  # first and longest wait before reconnecting


SERVER_DEFAULTS = ServerConfig()


def default_cache_dir() -> Path:
    """Where ``mlxcc serve`` keeps its disk tier: ``$MLXCC_HOME/server-cache``."""
    return mlxcc_home() / SERVER_DEFAULTS.cache_dir_name
