# Two commands do everything on a fresh machine: `make train` (the main job) and `make test`.
# Both install the tested set (src/seqpar/tested.txt: exact versions of every package, the ones CI
# ran together), so a fresh clone runs what CI ran, today and next month.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The tested set (pip constraints). Another set: `make LOCK=other.txt test`.
LOCK ?= src/seqpar/tested.txt
# torch as the tested set pins it (a CPU build here: this machine's pip finds the +cpu wheel). On a GPU
# machine `make TORCH=torch ...` takes the newest build (any torch >= 2.5); the rest stays pinned.
TORCH ?= $(shell grep '^torch==' $(LOCK))
# The internals-sensitive tests: everything that reads transformers' / accelerate's / TRL's private
# code or enumerates their classes (`make test-latest` runs them on the newest releases).
INTERNALS_TESTS := tests/test_compat.py tests/integrations/test_state_passing.py tests/integrations/test_zoo.py \
	tests/integrations/test_vlm.py tests/integrations/test_vlm_zoo.py tests/integrations/test_trainer.py \
	tests/integrations/test_trl_vlm.py tests/integrations/test_hf.py tests/cli/test_env.py \
	tests/integrations/test_trainer_dynamic.py tests/integrations/test_trl_dynamic.py \
	tests/integrations/test_trl_registry.py \
	tests/integrations/test_diffusers_zoo.py
LATEST_VENV ?= .venv-latest

.PHONY: install train test lint bench verify gpu-check test-latest lock docs

$(VENV)/.installed: pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	grep -v '^torch==' $(LOCK) > $(VENV)/constraints.txt
	$(PY) -m pip install -q -c $(VENV)/constraints.txt -e ".[dev]"
	touch $@

install: $(VENV)/.installed

# --overwrite: `make train` again replaces the demo's earlier run (a bare `seqpar train` refuses to
# delete the checkpoints in its --save-dir)
train: install
	$(VENV)/bin/seqpar train --overwrite

# The heavy grids (`-m heavy`: too long for `make test`) and the CLI's attention grid at P = 1..4.
verify: install
	$(PY) -m pytest -p no:cacheprovider -m heavy
	$(VENV)/bin/seqpar verify --nproc 4

test: install
	$(VENV)/bin/ruff check src tests $(wildcard benchmarks)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -p no:cacheprovider --durations=25

# The docs site (mkdocs.yml; docs/ and the API reference from the docstrings) into site/. --strict: a broken
# link, a page missing from the nav or a reference that does not resolve fails the build.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

bench: install
	$(PY) benchmarks/run_all.py

# The newest releases of torch (CPU build), transformers, trl, accelerate, peft, datasets and diffusers in a venv of
# their own ($(LATEST_VENV): no constraints, this machine's cap on torch lifted; on PyPI the newest torch
# is a CUDA build, which runs on a CPU too), then `seqpar env` (which
# features the installed versions leave available, and why not) and the internals-sensitive tests.
test-latest:
	$(PYTHON) -m venv $(LATEST_VENV)
	PIP_CONSTRAINT=/dev/null $(LATEST_VENV)/bin/python -m pip install -q --upgrade torch
	PIP_CONSTRAINT=/dev/null $(LATEST_VENV)/bin/python -m pip install -q --upgrade -e ".[dev]" \
	  transformers trl accelerate peft datasets diffusers
	$(LATEST_VENV)/bin/seqpar env
	$(LATEST_VENV)/bin/python -m pytest -p no:cacheprovider $(INTERNALS_TESTS)

# Write the tested set from the venv that just passed (after a `make LOCK=... test` with new versions).
lock:
	{ sed -n '1,3p' $(LOCK); $(PY) -m pip freeze --exclude-editable | grep -v '^seqpar' | sed 's/+cpu$$//'; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)

# On a machine with a GPU (a CUDA build of torch: `make TORCH=torch gpu-check`), inside 9 minutes: the
# gpu-marked tests (each CUDA kernel and the ring's fused blocks against the float64 oracle, no CUDA sync
# in steady-state layers, the README's example over NCCL), a ring step against SDPA alone, one rank of P at
# Llama-3-8B shapes (MFU, memory, bytes per layer), compiled vs eager, the kernels against dense SDPA,
# ending in one table (benchmarks/gpu_check.sh; logs in /tmp/seqpar-gpu; FULL=1 adds `seqpar train`
# under torchrun and the longest sequence at sp=1).
gpu-check: install
	PY=$(PY) bash benchmarks/gpu_check.sh
