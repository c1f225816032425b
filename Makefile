# runwatch: `make demo` and `make test` work on a fresh machine; `make setup` is their shared first step.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.runwatch-installed

.PHONY: setup demo test test-fast lint bench clean

setup: $(STAMP)

# torch first, pinned, so the project's torch range is already satisfied by the local CPU wheel
# and pip never reaches for the multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[embedded,dev,lightning,hf]"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/runwatch demo --scenario nan

test: setup
	$(VENV)/bin/pytest -q -p no:cacheprovider

test-fast: setup
	$(VENV)/bin/pytest -q -m "not integration"

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(PY) tests/benchmarks/bench_publish.py
	$(PY) tests/benchmarks/bench_watch_overhead.py
	$(PY) tests/benchmarks/bench_detectors.py
	$(PY) tests/benchmarks/bench_latency.py
	$(PY) tests/benchmarks/bench_throughput.py

clean:
	rm -rf .runwatch build dist *.egg-info
