"""Chat: multi-turn sessions whose history lives in the prompt cache. ``session`` (``ChatSession``:
send, rollback, save/resume), ``chat_turn`` (one turn's prefill and streamed reply), ``checkpoints``
(rollback points), ``session_store`` (session files, names and the session lock), ``chat_input`` and
``repl`` (the interactive loop of ``mlxcc chat``). May import ``generation``, ``files``, ``cache``,
``models``, ``errors`` and ``config``, never ``cli``; importing this package is cheap (the submodules
are not imported here).
"""
