# `make run` and `make test` set up a local virtual environment on first use, then reuse it.
# The Python is the newest one the whole stack is tested on (3.12, else 3.11), found on PATH or under pyenv;
# `make PYTHON=/path/to/python VENV=.venv-other test` picks another.
TESTED_PYTHONS := 3.12 3.11
ifeq ($(origin PYTHON),undefined)
PYTHON := $(shell for v in $(TESTED_PYTHONS); do \
	  for c in python$$v $$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/$$v*/bin/python$$v 2>/dev/null | sort -rV); do \
	    $$c -c 'import venv, ensurepip' >/dev/null 2>&1 && { command -v $$c; exit 0; }; \
	  done; done)
endif
VENV   ?= .venv
PY     := $(VENV)/bin/python
# what running needs; then that, the test extra and the gpu extra: everything the tests need
RUN_STAMP := $(VENV)/.installed-run
STAMP  := $(VENV)/.installed
RECIPE ?= tiny_omni
# tests: 2 workers (this project's machines have 2 cores); the slowest 20 are listed after every run
PYTEST_ARGS ?= -n 2 --dist loadgroup --durations=20

.PHONY: run test bench setup clean

# The gpu extra's CUDA plugin compiles for GPUs anywhere (dryrun target=...) and runs on them; on a machine
# without one, jax is told to stay on the CPU instead of logging its failed driver probe (a JAX_PLATFORMS you set
# wins).
NO_GPU := $(if $(wildcard /dev/nvidia0),,1)

# `make run` installs what running needs: omnijax's dependencies, and the gpu extra on a machine with an NVIDIA
# GPU. The test extra (torch with its CUDA libraries, transformers, peft: several GB) comes with `make test` /
# `make setup`, which also install the gpu extra (the tests compile for GPU targets).
# pip byte-compiles every .py file it installs (~19k: ~75 of a clean install's ~145 CPU-s) one after another;
# compileall writes the same .pyc files on every core. They are needed: with PYTHONDONTWRITEBYTECODE set (as on
# this project's machines) a module without one is compiled again by every process that imports it.
SITE_PACKAGES = $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
define NEW_VENV
	@test -n "$(PYTHON)" || { echo "error: no Python $(TESTED_PYTHONS) found (on PATH or under pyenv); install one, or run 'make PYTHON=python3 ...'"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "setup: $(VENV) on $$($(PY) --version)"
	$(PY) -m pip install -q --upgrade pip
endef

$(RUN_STAMP): pyproject.toml
	$(NEW_VENV)
	$(PY) -m pip install -q --no-compile -e '.$(if $(NO_GPU),,[gpu])'
	$(PY) -m compileall -q -j 0 $(SITE_PACKAGES) >/dev/null || true  # as pip: a file that does not compile (a vendored test) stays a source
	touch $(RUN_STAMP)

# one install of everything (one resolve, one editable build), which holds what running needs: `make run` reuses it
$(STAMP): pyproject.toml
	$(NEW_VENV)
	$(PY) -m pip install -q --no-compile -e '.[test,gpu]'
	$(PY) -m compileall -q -j 0 $(SITE_PACKAGES) >/dev/null || true  # as pip: a file that does not compile (a vendored test) stays a source
	touch $(RUN_STAMP) $(STAMP)

setup: $(STAMP)

run: $(RUN_STAMP)
	$(if $(NO_GPU),JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} )$(PY) -m recipes $(RECIPE)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS) tests

clean:
	rm -rf $(VENV) runs
