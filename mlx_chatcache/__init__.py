"""mlx_chatcache: multi-turn LLM work on MLX that never pays twice for the same tokens."""

# First, before anything imports mlx.core: on Linux with the CPU backend, MLX's
# float matmuls switch to OpenBLAS (see mlx_chatcache.blas; MLXCC_BLAS=off keeps
# the bundled BLAS).
from . import blas as _blas

_blas.activate()

__version__ = "0.1.0"

from .loading import load  # noqa: E402

__all__ = ["load", "__version__"]
