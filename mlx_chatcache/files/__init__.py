"""Files: prompt caches on disk. ``safetensors_file`` reads safetensors headers and arrays with full
validation, ``atomic`` writes files atomically (temp file + fsync + rename); ``mlxcc_format`` is our self-describing
format (docs/cache-format.md) and the one save/load API; ``registry`` holds ``CacheFileInfo`` and the
registry of other programs' formats, with which readers such as ``mlxlm`` (mlx-lm's layouts)
register themselves, so that no format module imports another. May import ``cache``,
``models.fingerprint``, ``errors`` and ``config``, never ``generation``, ``chat`` or ``cli``.
"""

from . import mlxlm  # noqa: F401  (registers mlx-lm's layouts with .registry)
