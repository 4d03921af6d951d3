"""mlx_chatcache: multi-turn LLM work on MLX that never pays twice for the same tokens."""

__version__ = "0.1.0"

from .models.loading import load  # noqa: E402

__all__ = ["load", "__version__"]
