# Two commands do everything on a fresh machine with python3 and pip:
#   make test   create .venv, install jaxmem[test], run the whole suite (notebooks included)
#   make demo   same set-up, then run the main job (python -m jaxmem demo)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_WORKERS ?= 2

.PHONY: test demo bench lint format clean

# Re-installs only when the project metadata changes (the stamp is newer otherwise).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) -q jaxmem tests README.md --nbmake notebooks

demo: $(STAMP)
	$(PY) -m jaxmem demo

bench: $(STAMP)
	$(PY) -m benchmarks.run

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
