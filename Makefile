# runwatch: `make demo` and `make test` work on a fresh machine. `make demo` installs only what the demo
# runs (the `demo` extra); `make setup` (run by `make test`) adds the test tooling and the other extras
# on top of it. docs/install.md says what each extra holds.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_STAMP := $(VENV)/.runwatch-demo-installed
STAMP := $(VENV)/.runwatch-installed

.PHONY: setup demo-setup clients browser demo test test-fast lint bench clean deploy-check

setup: $(STAMP)
demo-setup: $(DEMO_STAMP)

# torch first, pinned, so the project's torch range is already satisfied by the local CPU wheel
# and pip never reaches for the multi-GB CUDA build.
$(DEMO_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[demo]"
	touch $(DEMO_STAMP)

# Only adds to the demo's environment: the test tooling, the framework callbacks, the embedded engine,
# grafana-client.
$(STAMP): $(DEMO_STAMP)
	# grafana-client's niquests needs urllib3-future; built from source with URLLIB3_NO_OVERRIDE=1 it sits beside
	# urllib3 instead of overwriting it (its wheel replaces urllib3 environment-wide, under clickhouse-connect).
	URLLIB3_NO_OVERRIDE=1 $(PY) -m pip install --quiet --no-binary urllib3-future "urllib3-future>=2.12,<3" urllib3
	$(PY) -m pip install --quiet -e ".[torch,embedded,dev,lightning,hf,grafana,server,otlp]"
	touch $(STAMP)

# Non-Python clients for tests/contract/test_non_python_client.py, which runs the examples of
# docs/publishing-without-python.md: Node.js with kafkajs (pinned; it has no dependencies) and
# Debian's kcat. Installed with apt-get when missing and we are root; otherwise a message says what
# to install (the test fails in CI, skips elsewhere).
KAFKAJS_VERSION := 2.2.4
CLIENTS_DIR := .runwatch/clients
CLIENTS_STAMP := $(CLIENTS_DIR)/kafkajs-$(KAFKAJS_VERSION).installed
define apt_install
if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(1) >/dev/null; \
else \
  echo "runwatch: the integration tests need $(1) (Debian: sudo apt-get install $(1))" >&2; \
fi
endef

clients: $(CLIENTS_STAMP)
	@command -v kcat >/dev/null || { $(call apt_install,kcat); }

$(CLIENTS_STAMP):
	@command -v npm >/dev/null || { $(call apt_install,nodejs npm); }
	@if command -v npm >/dev/null; then \
	  npm install --prefix $(CLIENTS_DIR) --no-save --no-package-lock --no-audit --no-fund --loglevel=error \
	    kafkajs@$(KAFKAJS_VERSION) && touch $@; \
	else \
	  echo "runwatch: no npm, so no kafkajs: the non-Python client test cannot run" >&2; \
	fi

# Headless Chromium for tests/sinks/test_report.py, which opens `runwatch report`'s HTML in a real
# browser: Debian's chromium, installed with apt-get when missing and we are root; otherwise a message.
browser:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || { $(call apt_install,chromium); }

demo: demo-setup
	$(VENV)/bin/runwatch demo --scenario nan

# The type check first: mypy strict over every package, reading the rooms as they are (pyproject's [tool.mypy]);
# then ruff's lint and format check; then the suite.
test: setup clients browser lint
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest -q -p no:cacheprovider

# Two workers (pytest-xdist), and bytecode written even where PYTHONDONTWRITEBYTECODE is set, so that a
# rerun skips pytest's assertion rewriting (about 7 s of the collection on a 2-core machine).
test-fast: setup
	env -u PYTHONDONTWRITEBYTECODE $(VENV)/bin/pytest -q -m "not integration" -n 2

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: setup
	$(PY) tests/benchmarks/bench_publish.py
	$(PY) tests/benchmarks/bench_watch_overhead.py
	$(PY) tests/benchmarks/bench_detectors.py
	$(PY) tests/benchmarks/bench_latency.py
	$(PY) tests/benchmarks/bench_throughput.py
	$(PY) tests/benchmarks/bench_baselines.py
	$(PY) tests/benchmarks/bench_state.py

# The runwatch image built from the Dockerfile and the stack's runwatch services run as containers, with a
# real training run acted on (deploy/README.md, section 3). As root: Podman, runc and debootstrap come from
# Debian's packages; the trainer runs in this venv.
deploy-check: demo-setup
	deploy/check/podman-setup.sh
	$(PY) deploy/check/deploy_check.py

clean:
	rm -rf .runwatch build dist *.egg-info
