"""The CLI reference in docs/cli.md is what `--help` prints today."""

import importlib.util
from pathlib import Path

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
