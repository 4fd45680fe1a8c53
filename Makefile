# Two entry points (see README): `make report` and `make test`. Both create .venv and install fusegraph into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fusegraph-installed

.PHONY: setup report test test-all bench clean

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

report: setup
	$(VENV)/bin/fusegraph report --model qwen3-moe-tiny

test: setup
	$(PY) -m pytest -q

test-all: setup
	$(PY) -m pytest -q -m ''

bench: setup
	$(PY) benchmarks/bench_capture.py

clean:
	rm -rf $(VENV) bench-results .pytest_cache
