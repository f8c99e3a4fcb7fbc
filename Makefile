# Two commands do everything on a fresh machine with python3 and pip:
#   make test   create .venv-X.Y, install jaxmem[test], run the whole suite (notebooks included)
#   make demo   same set-up, then run the main job (python -m jaxmem demo)
# PYTHON picks the interpreter: by default the newest of python3.13, python3.12, python3.11 that
# runs (a pyenv shim of an installed but unselected version included), else python3. Each X.Y
# gets its own venv (.venv-3.13, .venv-3.11, ...), so versions coexist; each run prints the
# Python and jax it uses. TEST_ARGS picks what pytest runs (default: the whole suite).
#   make test-compat   the oldest supported set-up: PYTHON=python3.11 (pip gives jax 0.10.2),
#                      TEST_ARGS="tests src/jaxmem README.md docs": everything but the notebooks and
#                      the tests of the demo and benchmark scripts (SCRIPT_TESTS)
#   make test PYTHON=python3.11 TEST_ARGS=tests/test_api.py   any interpreter, any selection
# JAXMEM_SHARD=i/n runs shard i of n of what either selects and JAXMEM_DRAWS=k one in k of the
# random draws (conftest.py): .ci/run splits the suite between the two set-ups.

# $(call resolve,python3.13): absolute path of that interpreter, empty when it does not run. A
# pyenv shim of a version installed but not selected ("pyenv: python3.13: command not found")
# is run with PYENV_VERSION set to the newest installed 3.13.x.
resolve = $(shell { $(1) -c 'import sys; print(sys.executable)' || \
	PYENV_VERSION=$$(pyenv latest $(patsubst python%,%,$(notdir $(1)))) \
	$(1) -c 'import sys; print(sys.executable)'; } 2>/dev/null)

ifeq ($(origin PYTHON),undefined)
PYTHON := $(or $(call resolve,python3.13),$(call resolve,python3.12),$(call resolve,python3.11),python3)
endif
PYTHON_EXE := $(or $(call resolve,$(PYTHON)),$(PYTHON))
PYVER := $(shell $(PYTHON_EXE) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
VENV := .venv-$(PYVER)
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_WORKERS ?= 2
# The slowest items first (notebooks, the slowest test modules, the other tests, then the
# doctests), so that --dist loadscope (one worker per module: module fixtures are built once)
# does not end on one long module. pytest collects a file named twice once.
SLOW_FIRST = tests/remat/test_planner.py tests/flax/test_flax_nnx_upstream.py \
	tests/flax/test_lm1b.py tests/flax/test_flax_nnx_memory.py tests/test_multiprocess.py \
	tests/remat/test_heldout_gpt.py
TEST_ARGS ?= --nbmake notebooks $(SLOW_FIRST) tests src/jaxmem README.md docs

.PHONY: test test-compat demo bench bench-frameworks notebooks docs lint format clean

# Re-installs only when the project metadata changes (the stamp is newer otherwise).
$(STAMP): pyproject.toml
	@test -n "$(PYVER)" || { echo "error: PYTHON=$(PYTHON) does not run" >&2; exit 1; }
	test -x $(PY) || $(PYTHON_EXE) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

test: $(STAMP)
	@$(PY) -c "import sys, jax; print('python', sys.version.split()[0], 'jax', jax.__version__)"
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadscope -q $(TEST_ARGS)

test-compat:
	$(MAKE) test PYTHON=python3.11 TEST_ARGS='$(SLOW_FIRST) tests src/jaxmem README.md docs $(SCRIPT_TESTS)'

# The tests of the demo and benchmark scripts (code outside the library, whose JAX-dependent
# parts the library tests cover on both versions) are marked newest: they run on the newest
# Python only (CI time). So does the planner's frontier of the held-out GPT, a benchmarks.planner
# run (the planner is tested on both versions on the reference GPT's frontier).
SCRIPT_TESTS = -m "not newest"

demo: $(STAMP)
	$(PY) -m jaxmem demo

bench: $(STAMP)
	$(PY) -m benchmarks.run

# The frameworks benchmark (benchmarks/frameworks.py): one venv per framework, as their JAX pins
# differ (Levanter pins jax 0.11.2), each with jaxmem installed editable; never needed by
# `make test`. FRAMEWORKS picks a subset, BENCH_ARGS the options (--quick, --no-time, --json).
# Each venv is made once (its stamp); MaxText's wheel declares no dependencies, so they are
# named here, DECOUPLE_GCLOUD=TRUE runs it without Google Cloud.
FRAMEWORKS ?= maxtext levanter penzai
BENCH_ARGS ?=
FW_PYTHON := $(or $(call resolve,python3.13),$(call resolve,python3.12),$(PYTHON_EXE))
PIP_maxtext := maxtext==0.2.5 "jax>=0.11.1" flax omegaconf pydantic jaxtyping aqtp qwix \
	orbax-checkpoint chex ml-collections einops grain drjax tokamax transformers sentencepiece \
	tiktoken optax absl-py pathwaysutils jinja2 pillow sympy
PIP_levanter := --pre marin-levanter marin-haliax jax==0.11.2 jaxlib==0.11.2
PIP_penzai := penzai==0.2.5

.venv-%/.installed-framework:
	test -x .venv-$*/bin/python || $(FW_PYTHON) -m venv .venv-$*
	.venv-$*/bin/python -m pip install --quiet --upgrade pip
	.venv-$*/bin/python -m pip install --quiet -e . $(PIP_$*)
	touch $@

bench-frameworks: $(foreach f,$(FRAMEWORKS),.venv-$(f)/.installed-framework)
	@status=0; for f in $(FRAMEWORKS); do \
		DECOUPLE_GCLOUD=TRUE .venv-$$f/bin/python -m benchmarks.frameworks $(BENCH_ARGS) || status=1; \
	done; exit $$status

# Runs the notebooks at full size (CI unset) and saves them with their outputs, which GitHub and
# the docs show; tests/test_notebooks.py fails until this is re-run after a code cell changes.
# NOTEBOOKS="01 05" runs a subset.
notebooks: $(STAMP)
	$(PY) notebooks/execute.py $(NOTEBOOKS)

# The documentation site (docs/, Sphinx) into docs/_build/html; a warning is an error. The docs
# extra is installed once per venv, with its own stamp, again only when pyproject.toml changes.
DOCS_STAMP := $(VENV)/.installed-docs

$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[docs]"
	touch $(DOCS_STAMP)

docs: $(STAMP) $(DOCS_STAMP)
	$(VENV)/bin/sphinx-build -W --keep-going -b html docs docs/_build/html

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf .venv .venv-* build *.egg-info .pytest_cache
