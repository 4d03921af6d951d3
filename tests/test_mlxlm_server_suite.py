"""mlx-lm's own ``tests/test_server.py``: its HTTP cases, run against ``mlxcc serve``.

The file is the one of the *installed* mlx-lm version (it imports that version's
server module), found in ``MLXCC_MLXLM_TESTS`` (an mlx-lm checkout or its tests
folder), else in the folder ``tests/fetch_mlxlm_tests.py`` fills from the PyPI
source distribution (``MLXCC_MLXLM_SDIST_DIR`` or ``.pytest_cache/mlx-lm-sdist``;
``make mlxlm-tests``). Without it the test skips, naming the command; under CI
(``CI`` set) it fails instead.

The file is imported as a module. Its HTTP cases are computed, not listed: every
case whose source uses ``self.port`` and none of mlx-lm's in-process objects
(``HOLDS_INTERNALS``). For each class holding such cases only ``setUpClass`` and
``tearDownClass`` are replaced: they start and stop ``mlxcc serve`` on the tiny
llama model with ``--served-model-name chat_model`` (the name mlx-lm's chat cases
send) and set ``port``. Nothing else of the file is changed; ``unittest`` runs the
cases. Contract: at least ``MIN_CASES`` run and all pass. The result of a run is
recorded in docs/mlx-lm-compat.md.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import unittest
from pathlib import Path


import requests  # noqa: F401 # mlx-lm's test file uses it

from fetch_mlxlm_tests import installed_version, mlx_lm_test_file  # noqa: E402
from server_process import ServerProcess  # noqa: E402

HOLDS_INTERNALS = ("response_generator", "prompt_cache", "model_provider")  # mlx-lm's own server objects
MIN_CASES = 9  # the HTTP cases of mlx-lm 0.32.0; 0.32.2 has 11
SERVED_AS = ("chat_model",)


def mlx_lm_server_test_file() -> Path:
    return mlx_lm_test_file("test_server.py")


def http_cases(module) -> dict[type, list[str]]:
    """The TestCase classes of ``module`` and their cases that only talk HTTP to ``self.port``."""
    found = {}
    for cls in vars(module).values():
        if not (isinstance(cls, type) and issubclass(cls, unittest.TestCase)):
            continue
        names = [name for name in unittest.TestLoader().getTestCaseNames(cls)
                 if _talks_http_only(inspect.getsource(getattr(cls, name)))]  # fmt: skip
        if names:
            found[cls] = names
    return found


def _talks_http_only(source: str) -> bool:
    """Whether a case's source reaches the server only through ``self.port``: no
    attribute of mlx-lm's in-process objects (the ``def`` line's name does not count)."""
    return "self.port" in source and not any(f"self.{name}" in source or f"cls.{name}" in source
                                             for name in HOLDS_INTERNALS)  # fmt: skip


def test_mlx_lm_server_http_cases_pass_against_mlxcc_serve(tiny_model_dirs, tmp_path):
    path = mlx_lm_server_test_file()
    spec = importlib.util.spec_from_file_location("mlxlm_suite_test_server", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    flags = [f for name in SERVED_AS for f in ("--served-model-name", name)]
    suite = unittest.TestSuite()
    for cls, names in http_cases(module).items():
        def set_up(cls, folder=tmp_path / cls.__name__):
            cls.mlxcc = ServerProcess(tiny_model_dirs["llama"], folder, "--max-tokens", "16", *flags).__enter__()
            cls.port = cls.mlxcc.port

        def tear_down(cls):
            cls.mlxcc.__exit__(None, None, None)

        cls.setUpClass, cls.tearDownClass = classmethod(set_up), classmethod(tear_down)
        suite.addTests(cls(name) for name in names)
    result = unittest.TextTestRunner(stream=sys.stdout, verbosity=2).run(suite)
    problems = [f"{case.id()}:\n{trace}" for case, trace in result.failures + result.errors]
    print(f"mlx-lm {installed_version()} tests/test_server.py: "
          f"{result.testsRun - len(problems)}/{result.testsRun} HTTP cases pass")
    assert not problems, "\n".join(problems)
    assert result.testsRun >= MIN_CASES, f"only {result.testsRun} HTTP cases found in {path}"
