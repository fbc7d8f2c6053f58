# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
NPROC ?= 4

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -e ".[cpu,dev]"
	@# the bytecode pip would write file by file, on every core (59 CPU-s: 65 s on one core of two, 35 s on both); a
	@# file that does not compile (torch ships one in Python 3.12 syntax) is skipped, as pip's own compile skips it
	$(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null || true
	touch $@

install: $(VENV)/.installed

demo: install  ## tiny GPT on 4 CPU ranks, TP=2 x DP=2, ZeRO stage 2
	WANDB_MODE=$${WANDB_MODE:-offline} $(PY) -m pretrain.launcher --nproc-per-node $(NPROC) \
		--config configs/tiny.toml $(ARGS)

test: install  ## the whole suite: unit, docs (the commands the docs mark), dist (gloo ranks) and slurm tiers, in two lanes (tools/run_suite.py)
	$(PY) tools/run_suite.py -- $(PYTEST_ARGS)

slurm-setup:  ## slurm-wlm for the slurm tier (root + apt-get); a no-op where slurmctld exists or apt is absent
	@if command -v slurmctld >/dev/null 2>&1 || [ -x /usr/sbin/slurmctld ]; then echo "slurm-setup: slurmctld present"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm \
		|| echo "slurm-setup: apt-get install slurm-wlm failed; the slurm tier will skip"; \
	else echo "slurm-setup: no root or no apt-get; the slurm tier will skip (install slurm-wlm to run it)"; fi

test-fast: install  ## the unit tier only: single-process, under a minute
	$(VENV)/bin/pytest -q --timeout 300 tests/unit $(PYTEST_ARGS)

mutants: install  ## curated one-line bugs (tests/mutants.toml), each against its tests; all must be killed (docs/testing.md)
	$(PY) tools/mutants.py $(ARGS)

gpu-check:  ## on a GPU machine (torch+CUDA; megatron-core from .whl/ if missing): runs/gpu-check/report.md
	$${PYTHON_GPU:-python3} tools/gpu_check.py $(ARGS)

.PHONY: install demo test test-fast gpu-check slurm-setup mutants
