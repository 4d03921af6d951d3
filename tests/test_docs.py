"""The docs agree with the program: the CLI reference in docs/cli.md is what `--help` prints today
(and asking its generator for help rewrites nothing), the cache format's versions are the ones
the code writes, and the command lines docs/architecture.md names are commands mlxcc takes."""

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_cli_reference_is_current():
    spec = importlib.util.spec_from_file_location("gen_cli", DOCS / "gen_cli.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (DOCS / "cli.md").read_text() == gen.render(), "docs/cli.md is stale: run python docs/gen_cli.py"


def test_readme_names_the_two_commands():
    readme = (DOCS.parent / "README.md").read_text()
    first_screen = "\n".join(readme.splitlines()[:25])
    assert "make demo" in first_screen and "make test" in first_screen


def test_the_generator_help_writes_nothing():
    before = (DOCS / "cli.md").read_bytes()
    p = subprocess.run([sys.executable, str(DOCS / "gen_cli.py"), "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.startswith("usage: python docs/gen_cli.py") and "--check" in p.stdout
    assert (DOCS / "cli.md").read_bytes() == before
    p = subprocess.run([sys.executable, str(DOCS / "gen_cli.py"), "--check"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "is current" in p.stdout and (DOCS / "cli.md").read_bytes() == before


def test_the_cache_format_doc_names_the_versions_written():
    from mlx_chatcache.files.mlxcc_format import FORMAT_VERSION, SNAPSHOTS_VERSION

    doc = (DOCS / "cache-format.md").read_text()
    assert doc.splitlines()[0] == f"# The mlx_chatcache cache file format (version {FORMAT_VERSION})"
    assert f"| `mlxcc.format_version` | `{FORMAT_VERSION}` (`{SNAPSHOTS_VERSION}`: the same, with snapshots;" in doc
    assert f"says `mlxcc.format_version` `{SNAPSHOTS_VERSION}`" in doc
    assert f"(a file without snapshots stays version {FORMAT_VERSION}," in doc
    stays = re.findall(r"stays version (\d+)", doc)
    assert stays == [str(FORMAT_VERSION)], stays


@pytest.mark.parametrize("line", sorted(set(re.findall(r"`(mlxcc [^`]+)`", (DOCS / "architecture.md").read_text()))))
def test_architecture_names_commands_mlxcc_takes(line):
    from mlx_chatcache.cli.main import build_parser

    build_parser().parse_args(shlex.split(line)[1:])  # SystemExit (exit 2) on anything mlxcc does not take


def test_the_command_line_check_sees_a_wrong_one():
    from mlx_chatcache.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["chat", "NAME"])
