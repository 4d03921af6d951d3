"""mlx-lm's own ``tests/test_generate.py``, run on our generation functions.

The file comes from ``MLXCC_MLXLM_TESTS`` (an mlx-lm checkout or its ``tests`` folder) or from the
installed version's source distribution fetched by ``make mlxlm-tests`` (CI does). It is imported
as a module twice, with its hub model (``mlx-community/Qwen1.5-0.5B-Chat-4bit``) replaced by the
tiny llama model each time:

- as it is (mlx-lm's functions): the reference;
- with its globals naming mlx-lm's generation functions and classes and the two cache classes it
  makes rebound to ours (``REBOUND``); mlx-lm's sampler and logits-processor makers stay theirs
  (``KEPT``: their signatures are not ours, and what they make are plain functions our loops call).

Contract: with ours, every case passes except those in ``MODEL_DEPENDENT`` (they assert what the
hub model says), and each of those fails with exactly the failure mlx-lm's own functions give on
the same local model: the same exception line, so the same generated text. At least
``MIN_CASES`` run; no other mlx-lm object is left in the module's globals. The result of a run is
recorded in docs/mlx-lm-compat.md.
"""

from __future__ import annotations

import importlib.util
import sys
import unittest
from pathlib import Path

import mlx_chatcache
from mlx_chatcache import cache as ours
from mlx_chatcache.generation import batch_api, loop, text

sys.path.insert(0, str(Path(__file__).parent))
from fetch_mlxlm_tests import mlx_lm_test_file  # noqa: E402

REBOUND = {
    "BatchGenerator": batch_api.BatchGenerator,
    "StopSequences": batch_api.StopSequences,
    "batch_generate": batch_api.batch_generate,
    "GenerationResponse": text.GenerationResponse,
    "generate": text.generate,
    "stream_generate": text.stream_generate,
    "generate_step": loop.generate_step,
    "KVCache": ours.KVCache,
    "RotatingKVCache": ours.RotatingKVCache,
}
KEPT = {"make_logits_processors", "make_sampler"}
MODEL_DEPENDENT = {
    "test_generate_with_logit_bias": "asserts the text of the hub model's token 0 ('!'); the tiny model's is another",
    "test_stream_generate_input_embeddings": "asserts the hub model's reply 'TEST'",
    "test_stream_generate_input_embeddings_prefill": "asserts the hub model's reply 'TEST'",
}
MIN_CASES = 39  # the cases of mlx-lm 0.32.2


def mlx_lm_generate_test_file() -> Path:
    return mlx_lm_test_file("test_generate.py")


def load_module(path: Path, model_dir: Path, name: str, rebind: bool):
    """The test file as a module whose ``load`` gives the model of ``model_dir`` (``rebind``:
    its mlx-lm names bound to ours)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.load = lambda *_args, **_kw: mlx_chatcache.load(str(model_dir))
    if not rebind:
        return module
    missing = sorted(set(REBOUND) - set(vars(module)))
    assert not missing, f"{path} no longer uses {missing}: update REBOUND"
    for key, value in REBOUND.items():
        setattr(module, key, value)
    left = sorted(key for key, value in vars(module).items()
                  if key not in KEPT and key != "load" and str(getattr(value, "__module__", "")).startswith("mlx_lm"))  # fmt: skip
    assert not left, f"mlx-lm objects the run would test instead of ours: {left}: add them to REBOUND or KEPT"
    return module


def raised(trace: str) -> str:
    """The exception line of a formatted traceback."""
    lines = trace.strip().splitlines()
    return next((line for line in lines if line and not line.startswith((" ", "Traceback"))), lines[-1])


def run(module) -> tuple[int, dict[str, str]]:
    """Cases run and ``{case: exception line}`` of those that failed."""
    result = unittest.TestResult()
    unittest.defaultTestLoader.loadTestsFromModule(module).run(result)
    failed = {getattr(t, "_testMethodName", str(t)): raised(trace) for t, trace in result.failures + result.errors}
    return result.testsRun, failed


def test_mlx_lms_generate_tests_pass_on_our_functions(tiny_model_dirs):
    path, model_dir = mlx_lm_generate_test_file(), tiny_model_dirs["llama"]
    count, failed = run(load_module(path, model_dir, "mlxlm_suite_test_generate", rebind=True))
    assert count >= MIN_CASES
    unexpected = {k: v for k, v in failed.items() if k not in MODEL_DEPENDENT}
    assert not unexpected, f"{len(unexpected)} of {count} cases fail: {unexpected}"
    if not failed:
        return
    reference = load_module(path, model_dir, "mlxlm_suite_test_generate_reference", rebind=False)
    for name in failed:
        case = unittest.defaultTestLoader.loadTestsFromName(name, getattr(reference, _class_of(reference, name)))
        _, theirs = run_suite(case)
        assert failed[name] == theirs.get(name), (
            f"{name} fails with ours ({failed[name]}) but not so with mlx-lm's functions on the same model "
            f"({theirs.get(name, 'passes')})"
        )


def _class_of(module, case: str) -> str:
    return next(k for k, v in vars(module).items()
                if isinstance(v, type) and issubclass(v, unittest.TestCase) and hasattr(v, case))  # fmt: skip


def run_suite(suite) -> tuple[int, dict[str, str]]:
    result = unittest.TestResult()
    suite.run(result)
    return result.testsRun, {getattr(t, "_testMethodName", str(t)): raised(tr) for t, tr in result.failures + result.errors}
