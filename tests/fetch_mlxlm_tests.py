"""Fetch the ``tests`` folder of the installed mlx-lm's source distribution from PyPI.

``python tests/fetch_mlxlm_tests.py [DIR]`` runs ``pip download --no-deps --no-binary
:all: mlx-lm==<installed version>`` and unpacks only ``mlx_lm-<version>/tests/`` into
DIR (default: :func:`default_dir`; ``MLXCC_MLXLM_SDIST_DIR`` overrides it). Nothing is
installed and nothing of mlx-lm lands in the repository. Prints the folder it filled.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path


def installed_version() -> str:
    return importlib.metadata.version("mlx-lm")


def default_dir() -> Path:
    """``$MLXCC_MLXLM_SDIST_DIR``, else ``.pytest_cache/mlx-lm-sdist`` in the checkout."""
    where = os.environ.get("MLXCC_MLXLM_SDIST_DIR")
    return Path(where) if where else Path(__file__).resolve().parent.parent / ".pytest_cache" / "mlx-lm-sdist"


def sdist_tests_dir(root: Path, version: str) -> Path:
    """Where the tests of mlx-lm ``version`` are (or will be) under ``root``."""
    return root / f"mlx_lm-{version}" / "tests"


def mlx_lm_test_file(name: str) -> Path:
    """mlx-lm's ``tests/NAME``: from ``$MLXCC_MLXLM_TESTS`` (a checkout or its tests folder),
    else from the fetched source distribution; skips (fails under CI) when neither has it."""
    import pytest

    where = os.environ.get("MLXCC_MLXLM_TESTS")
    places = [Path(where), Path(where) / "tests"] if where else []
    places.append(sdist_tests_dir(default_dir(), installed_version()))
    for folder in places:
        if (folder / name).is_file():
            return folder / name
    why = (f"mlx-lm {installed_version()}'s tests/{name} is not in {', '.join(map(str, places))}; "
           "fetch it with `make mlxlm-tests` (python tests/fetch_mlxlm_tests.py)")  # fmt: skip
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)


def fetch(root: Path) -> Path:
    version = installed_version()
    target = sdist_tests_dir(root, version)
    if all((target / name).is_file() for name in ("test_server.py", "test_prompt_cache.py", "test_generate.py")):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"mlx-lm=={version}", "-d", tmp], check=True)  # fmt: skip
        (archive,) = Path(tmp).glob("mlx_lm-*.tar.gz")
        prefix = f"mlx_lm-{version}/tests/"
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
            tar.extractall(root, members=members, filter="data")
    return target


if __name__ == "__main__":
    print(fetch(Path(sys.argv[1]) if len(sys.argv) > 1 else default_dir()))
