# Two entry points (see README): `make serve` and `make test`. Both build .venv first.
# `make serve` installs torch and recap's runtime dependencies only; `make test` adds the test extras
# (pytest, Ray Serve, lm-eval, guidellm, LangChain, ...). Each set has its own stamp, so `make test` after
# `make serve` installs just the extras and `make serve` after `make test` installs nothing.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
SERVE_STAMP := $(VENV)/.serve-installed
TEST_STAMP := $(VENV)/.test-installed

# torch first, from `pip install torch==2.13.0` (the CPU wheel where pip finds one): recap pins the same
# version, so no later dependency replaces it (pip keeps an installed torch that satisfies the pin).
$(SERVE_STAMP): pyproject.toml requirements.lock
	@echo "==> [1/3] virtual environment $(VENV)"
	python3 -m venv $(VENV)
	@echo "==> [2/3] torch 2.13.0"
	$(PIP) install --progress-bar on torch==2.13.0
	@echo "==> [3/3] recap and its runtime dependencies (pinned by requirements.lock)"
	$(PIP) install --progress-bar on -c requirements.lock -e .
	touch $@
	@echo "==> serving set installed"

$(TEST_STAMP): $(SERVE_STAMP)
	@echo "==> test extras (pytest, Ray Serve, lm-eval, guidellm, LangChain, triton; pinned by requirements.lock)"
	$(PIP) install --progress-bar on -c requirements.lock -e '.[test]'
	touch $@
	@echo "==> test set installed"

.PHONY: venv serve test lint
venv: $(SERVE_STAMP)

# Flags pass through: make serve ARGS="--port 8001 path/to/model"
serve: $(SERVE_STAMP)
	$(VENV)/bin/recap serve $(ARGS)

# One pytest worker per core (at most 4), a test file per worker: a file's module-level references and the
# session's tiny checkpoints are built once per worker, not once per test (per-test distribution rebuilt them
# and ran slower than one process). `pytest` alone still runs serially.
test: $(TEST_STAMP)
	$(PY) -m ruff check recap tests benchmarks
	$(PY) -m pytest -n auto --maxprocesses 4 --dist loadfile

lint: $(TEST_STAMP)
	$(PY) -m ruff check recap tests benchmarks
