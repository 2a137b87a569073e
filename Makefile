# Two commands on a fresh machine: `make train` and `make test`.
# The virtualenv is made from Python 3.12 (jax 0.11 needs it); PYTHON may point
# at any 3.12 interpreter, the default finds the pyenv one or python3.12.
PYTHON ?= $(shell (command -v pyenv >/dev/null && ls "$$(pyenv root)/versions/3.12"*/bin/python3.12 2>/dev/null | tail -n 1) || command -v python3.12)
VENV := .venv
PY := $(VENV)/bin/python
CONFIG ?= smoke
ARGS ?=

.PHONY: train test lint data clean

$(VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON)" || { echo "error: no Python 3.12 found; set PYTHON=/path/to/python3.12" >&2; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	touch $@

train: $(VENV)/.installed
	$(PY) -m gemjax.train --config $(CONFIG) $(ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest -n 2 -q

# Public logs into data/ (ignored by git): ml-100k for source=recbole and
# the tests that read it (they skip without it).
data: $(VENV)/.installed
	$(PY) -m gemjax.data.fetch

lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) runs
