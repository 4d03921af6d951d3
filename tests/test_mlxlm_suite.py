"""mlx-lm's own ``tests/test_prompt_cache.py``, run on our functions and classes.

The file comes from ``MLXCC_MLXLM_TESTS`` (an mlx-lm checkout or its ``tests`` folder) or
from the installed version's source distribution fetched by ``make mlxlm-tests`` (CI does).
That file is imported as a module; its globals naming mlx-lm's single-sequence cache
classes, prompt-cache functions and ``generate_step`` are rebound to ours (``REBOUND``);
mlx-lm's batch classes and mask helpers stay theirs (``KEPT``); its Hugging Face model
load is replaced by the tiny llama model. Then ``unittest`` runs it.

Contract: every case passes except those listed in ``MAY_FAIL`` (mlx-lm's batched
generation: ``merge``/``extract``/``extend``/``prepare``/left padding, which our classes
refuse) and ``KNOWN_DIFFERENCES`` (a documented difference, with its reason); at least
``MIN_CASES`` cases run; no other mlx-lm object is left in the module's globals.
The result of a run is recorded in docs/mlx-lm-compat.md.
"""

from __future__ import annotations

import importlib.util
import sys
import unittest
from pathlib import Path


import mlx_chatcache
from mlx_chatcache import cache as ours
from mlx_chatcache.generation.loop import generate_step

sys.path.insert(0, str(Path(__file__).parent))
from fetch_mlxlm_tests import mlx_lm_test_file  # noqa: E402

REBOUND = {
    **{name: getattr(ours, name) for name in (
        "ArraysCache", "CacheList", "ChunkedKVCache", "KVCache", "QuantizedKVCache", "RotatingKVCache",
        "make_prompt_cache", "trim_prompt_cache",
    )},  # fmt: skip
    "save_prompt_cache": mlx_chatcache.save_prompt_cache,
    "load_prompt_cache": mlx_chatcache.load_prompt_cache,
    "generate_step": generate_step,
}
KEPT = {"BatchKVCache", "BatchRotatingKVCache", "create_attention_mask", "create_causal_mask"}

MAY_FAIL: set[str] = set()  # none: mlx-lm 0.32.2's file passes in full
KNOWN_DIFFERENCES: dict[str, str] = {}
MIN_CASES = 20


def mlx_lm_prompt_cache_test_file() -> Path:
    return mlx_lm_test_file("test_prompt_cache.py")


def mlx_lm_module(path: Path, model_dir: Path):
    """The test file as a module, its mlx-lm names rebound to ours and its load to ``model_dir``."""
    spec = importlib.util.spec_from_file_location("mlxlm_suite_test_prompt_cache", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    missing = sorted(set(REBOUND) - set(vars(module)))
    assert not missing, f"{path} no longer uses {missing}: update REBOUND"
    for name, value in REBOUND.items():
        setattr(module, name, value)
    module.load = lambda *_args, **_kw: mlx_chatcache.load(str(model_dir))
    left = sorted(name for name, value in vars(module).items()
                  if name not in KEPT and name != "load" and str(getattr(value, "__module__", "")).startswith("mlx_lm."))  # fmt: skip
    assert not left, f"mlx-lm objects the run would test instead of ours: {left}: add them to REBOUND or KEPT"
    return module


def raised(trace: str) -> str:
    """The exception line of a formatted traceback."""
    lines = trace.strip().splitlines()
    return next((line for line in lines[1:] if line and not line.startswith(" ")), lines[-1])


def test_mlx_lms_prompt_cache_tests_pass_on_our_classes(tiny_model_dirs):
    module = mlx_lm_module(mlx_lm_prompt_cache_test_file(), tiny_model_dirs["llama"])
    suite = unittest.defaultTestLoader.loadTestsFromModule(module)
    result = unittest.TestResult()
    suite.run(result)
    failed = {getattr(test, "_testMethodName", str(test)): raised(trace) for test, trace in result.failures + result.errors}
    unexpected = {name: why for name, why in failed.items() if name not in MAY_FAIL | set(KNOWN_DIFFERENCES)}
    assert result.testsRun >= MIN_CASES
    assert not unexpected, f"{len(unexpected)} of {result.testsRun} cases fail beyond the batch ones: {unexpected}"
