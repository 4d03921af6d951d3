"""mlx_chatcache: multi-turn LLM work on MLX that never pays twice for the same tokens.

The public API, flat as mlx-lm's (``from mlx_chatcache import load, generate, ...``). The names are
imported from their subpackages on first use (module ``__getattr__``), so ``import mlx_chatcache``
itself imports neither MLX nor mlx-lm. The layers and what each may import: docs/architecture.md.
"""

from typing import TYPE_CHECKING

# First, before anything imports mlx.core: on Linux with the CPU backend, MLX's
# float matmuls switch to OpenBLAS (mlx_chatcache/backend/blas.py, standard
# library only; MLXCC_BLAS=off keeps the bundled BLAS). The only import at run time.
from .backend import blas as _blas

_blas.activate()

from .config import VERSION as __version__  # noqa: E402  (the config is standard library only)

# public name -> the module (under mlx_chatcache) that defines it
_EXPORTS = {
    "load": "models.loading",
    "generate": "generation.text",
    "stream_generate": "generation.text",
    "batch_generate": "generation.batch_api",
    "BatchGenerator": "generation.batch_api",
    "PromptCache": "files.prompt_cache",
    "make_prompt_cache": "cache",
    "save_prompt_cache": "files.mlxcc_format",
    "load_prompt_cache": "files.mlxcc_format",
    "ChatSession": "chat.session",
}

__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:  # for type checkers and IDEs only; at run time see __getattr__
    from .cache import make_prompt_cache
    from .generation.batch_api import BatchGenerator, batch_generate
    from .chat.session import ChatSession
    from .files.mlxcc_format import load_prompt_cache, save_prompt_cache
    from .files.prompt_cache import PromptCache
    from .generation.text import generate, stream_generate
    from .models.loading import load


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
