"""The ``mlxcc`` command: thin subcommands over library functions (``main`` dispatches to one module
per subcommand; ``common`` holds shared flags and their translation to ``GenerationConfig``), plus the
terminal side of ``mlxcc chat`` (``repl``, ``chat_file``, ``chat_report``, ``chat_input``). The top layer: may import every layer
below it, and nothing imports it; every error reaches the user as one line (see ``main``).
"""
