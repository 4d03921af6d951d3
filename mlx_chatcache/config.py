"""Every default of mlx_chatcache: generation settings in one dataclass, the
one default of a chat session that is not a generation setting, and the time
budget of an interruptible model call.

Library functions take ``None`` for "use the default" and read it from
:data:`DEFAULTS`; the CLI builds its flag defaults from the same object.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path


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
    repetition_context_size: int = 20
    seed: int | None = None
    # prompt processing
    prefill_step_size: int = 2048  # as mlx_lm.generate (DEFAULT_PREFILL_STEP_SIZE)
    # cache shape
    max_kv_size: int | None = None
    keep: int = 4  # tokens pinned by a rotating cache when nothing better is known
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = 0

    def updated(self, **changes) -> "GenerationConfig":
        """A copy with ``changes`` applied; None values are ignored."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


DEFAULTS = GenerationConfig()

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
    memory_cache_bytes: int = 2_000_000_000  # memory tier budget (0: no memory tier)
    disk_cache_bytes: int = 16_000_000_000  # disk tier budget (0: no disk tier)
    cache_dir_name: str = "server-cache"  # under mlxcc_home() unless --cache-dir is given
    max_queue: int = 64  # requests waiting for the generation worker; more get HTTP 503
    max_stop_sequences: int = 4  # as OpenAI's API
    # the Redis tier (--cache-redis; shared by replicas), see mlx_chatcache/store/redis_tier.py
    redis_cache_bytes: int = 8 << 30  # byte budget of all entries under the key prefix
    redis_ttl_seconds: int = 24 * 3600  # an entry unused this long expires
    redis_chunk_bytes: int = 16 << 20  # values are split in chunks of this size (Redis caps one at 512 MiB)
    redis_block_tokens: int = 64  # the hash chain's block: prefixes are found at multiples of it
    redis_key_prefix: str = "mlxcc"
    redis_write_queue: int = 8  # entries waiting for the background writer; more are dropped (counted)
    redis_socket_timeout: float = 1.0  # seconds per Redis operation before the tier counts Redis as down
    redis_connect_timeout: float = 0.5
    redis_backoff_seconds: tuple[float, float] = (0.5, 30.0)  # first and longest wait before reconnecting


SERVER_DEFAULTS = ServerConfig()


def default_cache_dir() -> Path:
    """Where ``mlxcc serve`` keeps its disk tier: ``$MLXCC_HOME/server-cache``."""
    return mlxcc_home() / SERVER_DEFAULTS.cache_dir_name
