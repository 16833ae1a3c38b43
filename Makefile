# `make run` and `make test` set up a local virtual environment on first use, then reuse it.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
RECIPE ?= tiny_omni

.PHONY: run test bench setup clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found; install Python 3.11 or run 'make PYTHON=python3 ...'"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(PY) -m recipes $(RECIPE)

test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadgroup --durations=20 tests

clean:
	rm -rf $(VENV) runs
