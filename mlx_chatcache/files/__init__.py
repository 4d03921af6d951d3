"""Files: prompt caches on disk. ``safetensors_file`` reads safetensors headers and arrays with full
validation and writes files atomically (temp file + fsync + rename); ``cache_io`` is our self-describing
format (docs/cache-format.md) and the save/load API; ``mlxlm_compat`` reads and writes mlx-lm's layouts.
May import ``cache``, ``models.fingerprint``, ``errors`` and ``config``, never ``generation``, ``chat``
or ``cli``; importing this package is cheap (the submodules are not imported here).
"""
