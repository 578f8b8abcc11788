# One command per job: `make demo` and `make test` set everything up on a fresh machine first.
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO ?= mlp

.PHONY: setup demo test test-fast gpu-check lint check clean

setup: $(VENV)/.installed

# torch is pinned to the CPU wheel for development; it is not a dependency of the tdbg package.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

demo: setup
	$(PY) demos/launch.py $(DEMO)

# The suite starts a few hundred interpreters (training jobs, the CLI, the TUI): they share
# compiled bytecode even where the environment turns writing it off (PYTHONDONTWRITEBYTECODE).
# Serially it is CPU-bound on one core: it runs on two pytest-xdist workers, each test file
# whole on one (its module fixtures start once; tests/conftest.py). TEST_WORKERS= (empty) runs
# it serially, TEST_WORKERS=N on N workers.
TEST_WORKERS ?= 2
PYTEST := PYTHONDONTWRITEBYTECODE= $(PY) -m pytest $(if $(TEST_WORKERS),-n $(TEST_WORKERS) --dist loadfile)

test: setup
	$(PYTEST)

# The quick subset while working: everything but the end-to-end tests marked slow (CI runs all).
test-fast: setup
	$(PYTEST) -m "not slow"

# The CUDA paths on a real GPU (no added sync, NVML, allocator, snapshot, profile, cost);
# says so and exits 0 on a machine without CUDA.
gpu-check: setup
	$(PY) benchmarks/gpu_check.py

lint: setup
	$(VENV)/bin/ruff check tdbg tests demos benchmarks
	$(VENV)/bin/ruff format --check tdbg tests demos benchmarks
	$(VENV)/bin/mypy tdbg tests
	$(VENV)/bin/lint-imports --no-cache --no-logo  # the import contracts in pyproject.toml
	./.ci/no-unsafe-decoding

check: lint test

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .mypy_cache .ruff_cache
