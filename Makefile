# Two commands do everything on a fresh machine: `make train` (the main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU build of torch is enough here; on a GPU machine use `make TORCH=torch ...` (any torch >= 2.5).
TORCH ?= torch==2.13.0

.PHONY: install train test lint bench verify gpu-check

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
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

bench: install
	$(PY) benchmarks/run_all.py

# On a machine with a GPU (a CUDA build of torch: `make TORCH=torch gpu-check`), inside 9 minutes: the
# gpu-marked tests (each CUDA kernel and the ring's fused blocks against the float64 oracle, no CUDA sync
# in steady-state layers, the README's example over NCCL), a ring step against SDPA alone, one rank of P at
# Llama-3-8B shapes (MFU, memory, bytes per layer), compiled vs eager, the kernels against dense SDPA,
# ending in one table (benchmarks/gpu_check.sh; logs in /tmp/seqpar-gpu; FULL=1 adds `seqpar train`
# under torchrun and the longest sequence at sp=1).
gpu-check: install
	PY=$(PY) bash benchmarks/gpu_check.sh
