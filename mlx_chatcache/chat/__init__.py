"""Chat: multi-turn sessions whose history lives in the prompt cache. ``session`` (``ChatSession``: ask,
undo/retry, save/load), ``rollback`` (turn checkpoints and rolling back to them), ``turn`` (one turn's
prefill and streamed reply), ``checkpoints`` (what a rollback point holds), ``session_file`` (session
files, read and written as prompt caches, the cache also put into the shared store tiers; names and the
session lock), ``session_catalog`` (the saved sessions: list, show, remove, from headers only),
``session_export`` (a conversation as OpenAI messages JSON or Markdown). A library layer with no
terminal I/O (the interactive loop of ``mlxcc chat`` is in ``cli``). May import ``generation``,
``store``, ``files``, ``cache``, ``models``, ``errors`` and ``config``, never ``cli``; importing this
package is cheap (the submodules are not imported here).
"""
