# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
NPROC ?= 4

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[cpu,dev]"
	touch $@

install: $(VENV)/.installed

demo: install  ## tiny GPT on 4 CPU ranks, TP=2 x DP=2, ZeRO stage 2
	WANDB_MODE=$${WANDB_MODE:-offline} $(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) \
		-m pretrain --config configs/tiny.toml $(ARGS)

test: install  ## the whole suite: unit, dist (gloo ranks) and slurm tiers
	$(VENV)/bin/pytest -q --timeout 900 tests $(PYTEST_ARGS)

test-fast: install  ## the unit tier only: single-process, under a minute
	$(VENV)/bin/pytest -q --timeout 300 tests/unit $(PYTEST_ARGS)

gpu-check:  ## on a GPU machine (torch+CUDA; megatron-core from .whl/ if missing): runs/gpu-check/report.md
	$${PYTHON_GPU:-python3} tools/gpu_check.py $(ARGS)

.PHONY: install demo test test-fast gpu-check
