"""One exception hierarchy for mlx_chatcache.

Every error a user can cause (a bad file, the wrong model, a bad flag) is a
subclass of :class:`ChatCacheError`. Messages say what went wrong *and* what to
do about it, in one line, so the CLI can print ``str(err)`` and exit.
"""


class ChatCacheError(Exception):
    """Base class of every error raised on purpose by mlx_chatcache."""


class CacheFileError(ChatCacheError):
    """A cache file is missing, corrupt, truncated, tampered with or foreign."""


class CacheFormatError(CacheFileError):
    """A cache file is readable but its layout or metadata is not one we accept."""


class UnsupportedCacheError(ChatCacheError):
    """A cache class is unknown, or known but not supported for this operation."""


class ModelMismatchError(ChatCacheError):
    """A cache (or session) belongs to another model or tokenizer."""


class ModelLoadError(ChatCacheError):
    """A model could not be found or loaded."""


class SessionError(ChatCacheError):
    """A chat session name, file or lock is unusable."""


class UsageError(ChatCacheError, ValueError):
    """A command-line flag or argument has a bad value (a ValueError too, as mlx-lm's
    functions raise for the arguments they refuse)."""


class TokenIdError(ChatCacheError):
    """A token id is not one the model has: negative, or not below its vocabulary size."""


class CacheNotUpdatedError(UnsupportedCacheError):
    """A model was given tokens but one of its layers' caches did not take them
    (the model does not use our cache for that layer): its output would be wrong."""


def clipped(text: str, limit: int) -> str:
    """``text`` if it has at most ``limit`` characters, else its start and ``"..."``
    (``limit`` characters in all): text quoted in a message can be huge."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def one_line(text: str, limit: int) -> str:
    """``text`` with each run of whitespace made one space, then :func:`clipped`."""
    return clipped(" ".join(text.split()), limit)


def shown(v, limit: int = 40) -> str:
    """``repr(v)`` on one line, cut to ``limit`` characters: values quoted from a hostile file can be huge."""
    return one_line(repr(v), limit)
