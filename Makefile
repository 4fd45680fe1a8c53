# Two entry points (see README): `make report` and `make test`. Both create .venv and install fusegraph into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fusegraph-installed

.PHONY: setup browser report test test-all bench clean

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[test,jax]'
	$(PY) -m pip install --quiet --no-deps keras-hub==0.32.0
	touch $(STAMP)

setup: $(STAMP)

report: setup
	$(VENV)/bin/fusegraph report --model qwen3-moe-tiny

# the HTML report test renders in headless Chromium (Debian's package); best effort: it skips without it
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		(apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1 || \
		 (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1)) ; } || \
		echo "chromium not available: the HTML report browser test will be skipped"

test: setup browser
	$(PY) -m pytest -q

test-all: setup
	$(PY) -m pytest -q -m ''

bench: setup
	$(PY) benchmarks/bench_capture.py

clean:
	rm -rf $(VENV) bench-results .pytest_cache
