# Set-up and entry points. Every target creates the virtual environment on first use.
# torch is pinned to 2.13.0: on this platform that installs a local CPU wheel in ~20 s, while an
# unpinned install would pull a multi-GB CUDA build. The package itself only requires torch>=2.6.
# `make demo` installs only what the demo needs (torch, numpy, the package, scikit-learn for its data);
# `make test` adds the test tools and the optional loggers the tests read back, lints, then runs the suite.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# Two test files at a time (pytest-xdist): a third of the CPU sat idle in a serial run (tests waiting for
# a timeout, a rendezvous, Slurm's scheduler), measured with vmstat on this 2-core machine.
TEST_WORKERS ?= 2

.PHONY: demo test test-fast soak lint bytecode venv clean gpu-check gpu-bench

venv: $(VENV)/.demo-installed

# torch comes through pip (the local CPU wheel: uv does not look there); everything else through uv, which
# installs the test tools and loggers in 16 s where pip took 4 min 15 s here (resolving and installing in
# parallel). uv keeps the torch already installed, as pip does. --compile-bytecode: uv, unlike pip, writes
# no bytecode by default, and where PYTHONDONTWRITEBYTECODE is set (this machine, many container images)
# every process would compile matplotlib, tensorboard, rich, pytest... again at each import: test_trainer_real
# took 106 s of CPU without it, 80 s with it; compiling costs ~28 s once, at install.
$(VENV)/.demo-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0 numpy uv
	$(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) -e ".[examples]"
	touch $@

$(VENV)/.test-installed: $(VENV)/.demo-installed pyproject.toml
	$(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) -e ".[test,examples]"
	touch $@

demo: $(VENV)/.demo-installed
	$(VENV)/bin/multigpu run --nproc 2 examples/digits/train.py examples/digits/hparams.yaml
	@echo
	@echo "multigpu is installed in $(VENV). To use the command: source $(VENV)/bin/activate  (or call $(VENV)/bin/multigpu)"

# Lint first: ruff's formatter (100 columns: the size cap in tests/test_architecture.py judges its layout)
# and ruff with the rules in pyproject.toml (a second), then mypy with its settings there, in one
# process. Not mypy 2's --num-workers (49 s in two where one took 61 s on a clean clone here): mypy gives a
# worker 3 s to start (mypy/defaults.py WORKER_START_TIMEOUT), and on these 2 busy cores 2 lint runs of 5
# failed with "Failed to establish connection with worker" - a bound that is luck.
lint: $(VENV)/.test-installed
	$(VENV)/bin/ruff format --check src tests benchmarks examples
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/mypy

# Bytecode for the package and the test scripts, written once: an editable install is never compiled by
# pip, and where PYTHONDONTWRITEBYTECODE is set (this machine, many container images) every process the
# tests start would compile multigpu again - 0.36 s of CPU per process, measured here.
bytecode: $(VENV)/.test-installed
	$(PY) -m compileall -q src tests/scripts examples > /dev/null

test: lint bytecode
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-fast: bytecode
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not slow and not infra" $(PYTEST_ARGS)

# The soak tier: the PyTorch DDP tutorial's program 30 times in a row under multigpu run and under torchrun
# (SOAK_LAUNCHES=N to change the count), 0 hangs required; ~6 min on 2 cores. Not part of `make test`.
soak: bytecode
	$(PY) -m pytest -p no:randomly -s --soak -m soak $(PYTEST_ARGS)

# On a machine with an NVIDIA GPU and a CUDA build of torch (no virtual environment, no network needed):
# every GPU test, and the speed and packing figures. See .ci/gpu-check.
gpu-check:
	bash .ci/gpu-check tests

gpu-bench:
	bash .ci/gpu-check bench

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache
	find src tests examples -name __pycache__ -prune -exec rm -rf {} +
