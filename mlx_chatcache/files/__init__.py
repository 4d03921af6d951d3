"""Files: prompt caches on disk. ``prompt_cache`` holds ``PromptCache``, the value a file holds (layers,
their token ids, shape, what the tokens are) and that the store hands out: its ``save``/``load`` write
and read every file a user names, ``named_file`` the checks of such a file's header (no MLX).
``cache_file`` is the door every command and the chat use to a file the user names (``claim`` before
work starts, ``write`` the only writer, ``hold`` for a file only read), ``lock`` the per-file lock it
takes (``SessionLock``, of the real path); ``atomic`` writes (temp file + fsync + rename),
``safetensors_file`` reads headers and arrays with full validation, ``checksum`` the CRC32s that make a
damaged file fail to load; ``mlxcc_format`` is our self-describing format (docs/cache-format.md) and the
one save/load API; ``registry`` holds ``CacheFileInfo``, the parsers of its recorded fields and the
registry of other programs' formats, with which readers such as ``mlxlm`` (mlx-lm's layouts) register
themselves, so that no format module imports another; ``convert`` is the whole-file operations of
``mlxcc cache`` (convert, trim, diff); ``tokens`` the one common-prefix length of token runs (standard
library only). May import ``cache``, ``models.fingerprint``, ``errors`` and ``config``, never
``generation``, ``chat`` or ``cli``.
"""

from . import mlxlm  # noqa: F401  (registers mlx-lm's layouts with .registry)
