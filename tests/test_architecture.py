"""The package layout of docs/architecture.md holds: imports point down the layers, no cycles.

Every ``import`` and ``from ... import`` in mlx_chatcache/ (function-level ones and those of
``if TYPE_CHECKING:`` blocks included) is read with :mod:`ast` and resolved to the module it
names. The top-level package's own imports are checked apart: at run time it imports only the
BLAS switch and the config (its API is imported on first use, or by type checkers).
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PKG_DIR = Path(__file__).resolve().parent.parent / "mlx_chatcache"
PKG = "mlx_chatcache"

# layer -> rank: a layer may import only layers of lower rank (and itself). "store" is the
# prompt-cache store, "server" the OpenAI-compatible server.
RANK = {
    "errors": 0,
    "config": 1,
    "backend": 2,
    "cache": 2,
    "models": 2,
    "files": 3,
    "store": 4,
    "generation": 5,
    "chat": 6,
    "server": 7,
    "cli": 8,
    "__main__": 9,
}
MAX_LINES = 500  # docs/architecture.md: modules stay under ~400 lines


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG_DIR.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG_DIR.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return isinstance(t, ast.Name) and t.id == "TYPE_CHECKING" or isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"


def _walk(tree, type_checking: bool):
    """Every node (``type_checking`` False: skips the bodies of ``if TYPE_CHECKING:``, which never run)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not type_checking and isinstance(child, ast.If) and _is_type_checking(child):
                stack.extend(child.orelse)
            else:
                stack.append(child)


def imports_of(name: str, path: Path, modules: dict[str, Path], type_checking: bool = True) -> set[str]:
    """The package modules ``name`` imports (a package's ``__init__`` is the package's name);
    ``type_checking`` False: only those imported at run time."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _walk(ast.parse(path.read_text(), str(path)), type_checking):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # "from pkg import sub" imports the submodule sub
            targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # "import a.b.c" of a name inside a module: the module
                t = t.rpartition(".")[0]
            if t.startswith(PKG):
                found.add(t)
    found.discard(name)
    return found


def layer_of(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None  # None: the top-level package itself


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_every_module_is_in_a_known_layer(graph):
    unknown = sorted(n for n in graph if layer_of(n) is not None and layer_of(n) not in RANK)
    assert not unknown, f"modules outside the layers of docs/architecture.md: {unknown} (add them to RANK and the doc)"


def test_imports_point_down_the_layers(graph):
    bad = []
    for name, targets in graph.items():
        src = layer_of(name)
        if src is None:  # the top-level package: test_top_level_package_imports_... below
            continue
        for t in targets:
            dst = layer_of(t)
            if dst is None:
                bad.append(f"{name} -> {t} (nothing imports the top-level package: its API is the layers')")
            elif dst != src and RANK[dst] >= RANK[src]:
                bad.append(f"{name} -> {t} ({src} may not import {dst})")
    assert not bad, "imports against the layer order:\n" + "\n".join(sorted(bad))


def test_top_level_package_imports_only_the_blas_switch_at_run_time():
    # backend.blas must run before anything imports mlx.core (docs/architecture.md); the
    # version lives in the config, which the switch reads anyway
    modules = all_modules()
    run_time = {name: imports_of(name, path, modules, type_checking=False) for name, path in modules.items()}
    assert run_time[PKG] == {f"{PKG}.backend.blas", f"{PKG}.config"}
    assert run_time[f"{PKG}.backend.blas"] <= {f"{PKG}.backend.blas_elf", f"{PKG}.config"}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(graph, WHITE)
    path: list[str] = []

    def visit(n):
        color[n] = GREY
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if color.get(m) == GREY:
                return path[path.index(m):] + [m]
            if color.get(m) == WHITE and (found := visit(m)):
                return found
        path.pop()
        color[n] = BLACK
        return None

    for n in sorted(graph):
        if color[n] == WHITE and (found := visit(n)):
            return found
    return None


def test_no_import_cycles(graph):
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_graph_counts_type_checking_imports():
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "m.py"
        f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mlx_chatcache import config\n")
        modules = {f"{PKG}.config": f, f"{PKG}.cli.m": f}
        assert imports_of(f"{PKG}.cli.m", f, modules) == {f"{PKG}.config"}
        assert imports_of(f"{PKG}.cli.m", f, modules, type_checking=False) == set()


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_import_resolution_on_a_known_module():
    modules = all_modules()
    got = imports_of(f"{PKG}.files.mlxcc_format", modules[f"{PKG}.files.mlxcc_format"], modules)
    assert {f"{PKG}.files.registry", f"{PKG}.cache", f"{PKG}.models.fingerprint", f"{PKG}.config"} <= got


def test_modules_are_small():
    long = {n: len(p.read_text().splitlines()) for n, p in all_modules().items()}
    long = {n: k for n, k in long.items() if k > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them): {long}"


# config imports nothing of ours, so that ``import mlx_chatcache`` stays cheap (test_import_is_cheap)
CLIPS_ITS_OWN_TEXT = {f"{PKG}.errors", f"{PKG}.config"}
CUT = re.compile(r"""\+ *(['"])\.\.\.\1|\.split\(\)\)\[:""")  # `s[:77] + "..."`, `" ".join(t.split())[:200]`


def test_text_is_cut_for_a_message_in_one_place():
    """Text quoted in a message is cut by ``errors.clipped``/``one_line``/``shown``, never by a copy."""
    copies = {n: i + 1 for n, p in all_modules().items() if n not in CLIPS_ITS_OWN_TEXT
              for i, line in enumerate(p.read_text().splitlines()) if CUT.search(line)}  # fmt: skip
    assert not copies, f"text cut for a message outside mlx_chatcache.errors: {copies}"


def test_the_cut_check_sees_a_copy():
    assert CUT.search("s if len(s) <= 80 else s[:77] + \"...\"")
    assert CUT.search("detail = \" \".join(str(e).split())[:200]")
    assert not CUT.search("return clipped(text, 80)")


def test_one_common_prefix_function():
    """Token runs are compared by ``files.tokens.common_prefix_len`` only."""
    own = re.compile(r"def \w*(prefix_len|lcp)\b|commonprefix\(")
    found = sorted(n for n, p in all_modules().items() if own.search(p.read_text()))
    assert found == [f"{PKG}.files.tokens"], found


def _private_uses(tree: ast.AST) -> list[str]:
    """Private names imported from another module, and private attributes read off anything but
    ``self``/``cls`` (another object's internals)."""
    out = []
    for n in ast.walk(tree):
        private = (lambda name: name.startswith("_") and not name.startswith("__"))
        if isinstance(n, ast.ImportFrom) and n.level > 0:
            out += [f"{n.lineno}: import {a.name}" for a in n.names if private(a.name)]
        elif isinstance(n, ast.Attribute) and private(n.attr) and not (
            isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")
        ):
            out.append(f"{n.lineno}: {ast.unparse(n)}")
    return out


def test_no_module_reaches_into_another():
    """No module imports another's private names; the file formats read caches and each other
    through public names only (a private parser or field shared across modules is made public)."""
    imports = {n: u for n, p in all_modules().items()
               if (u := [x for x in _private_uses(ast.parse(p.read_text())) if " import " in x])}  # fmt: skip
    assert not imports, imports
    files = {n: u for n, p in all_modules().items() if n.startswith(f"{PKG}.files.")
             if (u := _private_uses(ast.parse(p.read_text())))}  # fmt: skip
    assert not files, files


def test_the_private_use_check_sees_one():
    code = "from .mlxcc_format import _parse_tokens\nk = c._fetch()\nself._x = 1\nfrom . import registry"
    assert _private_uses(ast.parse(code)) == ["1: import _parse_tokens", "2: c._fetch"]


def test_one_checksum_function():
    """Every CRC32 (cache files, Redis chunks) is ``files.checksum.crc32``."""
    found = sorted(n for n, p in all_modules().items() if re.search(r"\bzlib\b", p.read_text()))
    assert found == [f"{PKG}.files.checksum"], found


def test_flat_public_api():
    import mlx_chatcache

    names = {"load", "generate", "stream_generate", "PromptCache", "make_prompt_cache",
             "save_prompt_cache", "load_prompt_cache", "ChatSession"}
    assert names <= set(mlx_chatcache.__all__)
    for n in mlx_chatcache.__all__:
        assert getattr(mlx_chatcache, n) is not None
    assert callable(mlx_chatcache.generate)  # the function, not a module of that name
    with pytest.raises(AttributeError):
        mlx_chatcache.no_such_name  # noqa: B018


def test_import_is_cheap():
    """``import mlx_chatcache`` loads only the (standard-library) BLAS switch and the
    config, and neither MLX nor mlx-lm."""
    code = (
        "import sys, mlx_chatcache; "
        "print(sorted(m for m in sys.modules if m.startswith(('mlx_chatcache.', 'mlx_lm', 'mlx.', 'mlx'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    switch = ["mlx_chatcache", "mlx_chatcache.backend", "mlx_chatcache.backend.blas", "mlx_chatcache.backend.blas_elf",
              "mlx_chatcache.config"]
    assert out.strip() == repr(switch)


# ------------------------------------------------------------------ the door
# The low-level writers of a cache file, and the session lock: only the door
# (files.cache_file), the format modules under it, and the store's own tiers
# (DiskTier writes store-named files in its marked folder) may name them; every
# command, the chat and generation write through files.cache_file.
WRITERS = {"write_atomic", "write_file_atomic", "save_prompt_cache", "save_mlx_lm", "save_safetensors", "SessionLock"}
WRITER_HOMES = {
    f"{PKG}.files.atomic", f"{PKG}.files.mlxcc_format", f"{PKG}.files.mlxlm", f"{PKG}.files.cache_file",
    f"{PKG}.files.lock",
    f"{PKG}.store.disk",  # DiskTier: its own marked folder
    PKG,  # the public re-export of save_prompt_cache
}
LOCK_USERS = {f"{PKG}.chat.session_catalog"}  # 'sessions rm' deletes a session under its lock (no write)


def names_used(path: Path) -> set[str]:
    """Every name a module refers to: names, imported names and called attributes
    (``io.save_prompt_cache(...)``; ``args.save_prompt_cache`` is a flag's value)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            found.add(node.func.attr)
        elif isinstance(node, ast.alias):
            found.add(node.name.rpartition(".")[2])
    return found


def test_only_the_door_names_the_low_level_writers():
    bad = {}
    for name, path in all_modules().items():
        used = names_used(path) & WRITERS
        if name in LOCK_USERS:
            used -= {"SessionLock"}
        if used and name not in WRITER_HOMES:
            bad[name] = sorted(used)
    assert not bad, f"write cache files through mlx_chatcache.files.cache_file (claim/write), not: {bad}"


def test_the_door_check_sees_a_writer():
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "m.py"
        f.write_text("from x import save_mlx_lm as z\nimport a.save_prompt_cache\n"
                     "def f(io, args):\n    io.write_file_atomic(args.write_atomic)\n")
        assert names_used(f) & WRITERS == {"save_mlx_lm", "save_prompt_cache", "write_file_atomic"}


# Options that name no file a command writes (any command). A new option must be
# listed here, in NOT_DOORS (with why), or in tests/test_doors_cli.py's DOORS.
NEVER_A_FILE = {
    "help", "version", "model", "adapter_path", "trust_remote_code", "weights", "prompt", "system_prompt",
    "max_tokens", "temp", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "max_kv_size", "kv_bits", "kv_dtype",
    "kv_group_size", "quantized_kv_start", "prefill_step_size", "ignore_chat_template", "chat_template_config",
    "extra_eos_token", "force", "verbose", "json", "to", "n", "drop", "host", "port", "cache_bytes",
    "disk_cache_bytes", "cache_redis", "context_length", "max_queue", "max_batch", "log_level", "served_model_name",
    "ui", "no_ui", "format", "stop", "api_key", "shared_store", "drain_seconds", "log_format",
    "draft_model", "num_draft_tokens", "prompt_lookup", "lookup_ngram",
}
NOT_DOORS = {
    "generate --prompt-file": "read", "cache-prompt --prompt-file": "read", "generate --json-schema": "read",
    "generate --prompt-cache-file": "read (locked while generate runs: files.cache_file.hold)",
    "chat --prompt-cache-file": "read only (the chat saves to its own session)",
    "generate --cache-dir": "the store's own marked folder", "chat --cache-dir": "the store's own marked folder",
    "serve --cache-dir": "the store's own marked folder", "serve --api-key-file": "read",
    "cache info FILE": "read", "cache convert INPUT": "read", "cache diff A": "read", "cache diff B": "read",
    "sessions show NAME": "read", "sessions rm NAME": "deleted under the session lock",
    "sessions export NAME": "read",
    "sessions export --output": "a text file, not a cache: refused when it exists (unless --force), written by "
    "files.atomic.write_text_atomic",
}


def cli_options():
    """``("generate --save-prompt-cache", dest)`` for every option and positional of every subcommand."""
    import argparse

    from mlx_chatcache.cli.main import build_parser

    def walk(parser, prefix):
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    yield from walk(sub, prefix + [name])
            elif prefix:
                yield " ".join(prefix + [a.option_strings[0] if a.option_strings else a.dest.upper()]), a.dest

    return list(walk(build_parser(), []))


def test_every_option_that_names_a_written_file_is_a_door():
    from test_doors_cli import DOORS

    options = cli_options()
    assert ("generate --save-prompt-cache", "save_prompt_cache") in options  # the walk sees options
    unknown = sorted(key for key, dest in options if dest not in NEVER_A_FILE and key not in NOT_DOORS and key not in DOORS)
    assert not unknown, (f"options that may name a file: {unknown}; add the ones that write one to DOORS in "
                         "tests/test_doors_cli.py (and write through files.cache_file), the others to NOT_DOORS")
    written = {key for key, dest in options if key in DOORS}
    repl = {key for key in DOORS if key.startswith("/")}
    assert set(DOORS) == written | repl, f"DOORS rows that are no option: {sorted(set(DOORS) - written - repl)}"


def test_every_repl_command_that_takes_a_file_is_a_door():
    import re

    from mlx_chatcache.cli.repl import HELP
    from test_doors_cli import DOORS

    takes_file = {f"/{m}" for m in re.findall(r"^\s+/(\w+) FILE", HELP, re.M)}
    assert takes_file == {"/save", "/load"}
    assert takes_file <= set(DOORS)
