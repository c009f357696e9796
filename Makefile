# Two entry points (see README): `make serve` and `make test`. Both build .venv first.
PY := .venv/bin/python
STAMP := .venv/.installed

$(STAMP): pyproject.toml requirements.lock
	python3 -m venv .venv
	.venv/bin/pip install -q torch==2.13.0
	.venv/bin/pip install -q -c requirements.lock -e '.[test]'
	touch $(STAMP)

.PHONY: venv serve test lint
venv: $(STAMP)

# Flags pass through: make serve ARGS="--port 8001 path/to/model"
serve: $(STAMP)
	.venv/bin/recap serve $(ARGS)

test: $(STAMP)
	$(PY) -m ruff check recap tests benchmarks
	$(PY) -m pytest

lint: $(STAMP)
	$(PY) -m ruff check recap tests benchmarks
