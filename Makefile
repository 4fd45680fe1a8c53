# Two entry points (see README): `make report` and `make test`. Both use .venv; each installs only what it needs:
# `make report` fusegraph itself (torch, transformers: no jax/keras), `make test` also the test and jax extras
# (the JAX tests need them) and keras-hub. One stamp per level, so `make report` after `make test` installs nothing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BASE_STAMP := $(VENV)/.fusegraph-base
TEST_STAMP := $(VENV)/.fusegraph-test

.PHONY: setup setup-base browser report test test-all bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(BASE_STAMP): pyproject.toml setup.py | $(PY)
	$(PY) -m pip install --quiet -e .
	touch $@

$(TEST_STAMP): $(BASE_STAMP) pyproject.toml setup.py
	$(PY) -m pip install --quiet -e '.[test,jax]'
	$(PY) -m pip install --quiet --no-deps keras-hub==0.32.0 flax==0.12.8
	touch $@

setup-base: $(BASE_STAMP)

setup: $(TEST_STAMP)

report: $(BASE_STAMP)
	$(VENV)/bin/fusegraph report --model qwen3-moe-tiny

# the HTML report test renders in headless Chromium (Debian's package); best effort: it skips without it
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		(apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1 || \
		 (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1)) ; } || \
		echo "chromium not available: the HTML report browser test will be skipped"

test: $(TEST_STAMP) browser
	$(PY) -m pytest -q

test-all: $(TEST_STAMP)
	$(PY) -m pytest -q -m ''

bench: $(BASE_STAMP)
	$(PY) benchmarks/bench_capture.py

clean:
	rm -rf $(VENV) bench-results .pytest_cache
