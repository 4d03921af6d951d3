"""The ``mlxcc`` command: thin subcommands over library functions."""
