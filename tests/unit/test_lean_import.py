"""Imports made lean: megatron-core's unused set-up, TorchDynamo in ranks, zero3d's names until first used."""
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_patches.lean import HideModules, compile_on_first_call

pytestmark = pytest.mark.one_core  # one process, tens of seconds: the side lane (tools/run_suite.py)

REPO = Path(__file__).resolve().parents[2]


def test_a_decorated_function_is_compiled_once_at_its_first_call_with_its_options():
    calls = []

    def fake_compile(fn, **options):
        calls.append((fn.__name__, options))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    lazy = compile_on_first_call(fake_compile)

    @lazy
    def double(x):
        return 2 * x

    @lazy(dynamic=False, fullgraph=True)
    def square(x):
        """Squares."""
        return x * x

    assert calls == [] and double.__name__ == "double" and square.__doc__ == "Squares."
    assert double(3) == ("compiled", 6) and double(4) == ("compiled", 8)
    assert square(5) == ("compiled", 25)
    assert calls == [("double", {}), ("square", {"dynamic": False, "fullgraph": True})]


def test_hidden_modules_import_as_if_absent_and_others_import():
    name = "imaplib"  # stdlib, imported by nothing here
    sys.modules.pop(name, None)
    hidden = HideModules([name])
    sys.meta_path.insert(0, hidden)
    try:
        with pytest.raises(ImportError, match="imaplib is not imported while megatron-core loads"):
            importlib.import_module(name)
        assert importlib.import_module("poplib").__name__ == "poplib"
    finally:
        sys.meta_path.remove(hidden)
    assert importlib.import_module(name).__name__ == name


def test_a_rank_imports_and_builds_its_optimizer_without_dynamo_inductor_wandb_or_tensorboard():
    """A fresh process importing what a rank imports and building its optimizer, as every rank of a torchrun or Slurm
    job does: megatron-core is in, the unused set-up is not (TorchDynamo and Inductor 0.7 CPU-s, wandb 1 s,
    TensorBoard 0.2 s), torch.compile is torch's own again, megatron's fused kernels are compiled on first call (the
    lazy decorator), and the optimizer keeps torch's own param-group checks. TorchDynamo came in through torch's
    `Optimizer.add_param_group` (its guard imports TorchDynamo on first call) and `torch.nn.attention.bias`."""
    code = ("import sys, json, torch\n"
            "real = torch.compile\n"
            "import pretrain.train, pretrain.model.gpt, pretrain.preprocess, pretrain.export\n"
            "import pretrain.model.attention, pretrain.model.context, pretrain.model.loss  # a model's build\n"
            "import megatron.core.jit as jit\n"
            "from megatron.core.fusions.fused_bias_gelu import bias_gelu\n"
            "from optim import spec_named\n"
            "from optim.config import OptimizerConfig\n"
            "from optim.flat_optimizer import FlatOptimizer, FlatTensor\n"
            "piece = torch.zeros(8)\n"
            "opt = FlatOptimizer([FlatTensor(piece, 0.1, 'decay')], spec_named('adamw'), OptimizerConfig(lr=1e-3),\n"
            "                    fused=False)\n"
            "try:\n"
            "    opt.add_param_group({'params': [piece]})\n"
            "    duplicate = 'accepted'\n"
            "except ValueError as e:\n"
            "    duplicate = str(e)\n"
            "print(json.dumps({'megatron': 'megatron.core' in sys.modules,\n"
            "  'loaded': sorted(m for m in ('torch._dynamo', 'torch._inductor', 'wandb', 'tensorboard')\n"
            "                   if m in sys.modules),\n"
            "  'compile_restored': torch.compile is real, 'jit_fuser': jit.jit_fuser.__qualname__,\n"
            "  'bias_gelu_wrapped': bias_gelu.__wrapped__.__name__,\n"
            "  'groups': [(g['weight_decay'], g['group'], g['lr']) for g in opt.param_groups],\n"
            "  'duplicate': duplicate}))\n")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, cwd=REPO,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.splitlines()[-1])
    assert found == {"megatron": True, "loaded": [], "compile_restored": True,
                     "jit_fuser": "compile_on_first_call.<locals>.lazy_compile", "bias_gelu_wrapped": "bias_gelu",
                     "groups": [[0.1, "decay", 1e-3]],
                     "duplicate": "some parameters appear in more than one parameter group"}


def test_wandb_still_imports_for_zero3d_after_megatron():
    import megatron_patches.lean  # noqa: F401
    assert "megatron.core" in sys.modules and not any(isinstance(f, HideModules) for f in sys.meta_path)
    assert torch.compile.__module__ == "torch"
    assert importlib.import_module("wandb").__name__ == "wandb"


def test_every_module_importing_megatron_at_its_top_imports_it_lean_first():
    """Whichever of them a process imports first, megatron-core arrives lean: `import megatron_patches.lean` comes
    before each module-level megatron import (imports inside functions run after some module-level one)."""
    import ast
    late = []
    for path in sorted((REPO / "pretrain").rglob("*.py")):
        lean_seen = False
        for node in ast.parse(path.read_text()).body:
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            lean_seen |= "megatron_patches.lean" in names
            if any(n == "megatron" or n.startswith("megatron.") for n in names) and not lean_seen:
                late.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert late == []


def test_the_config_planner_and_slurm_tools_load_without_torch():
    """zero3d's names load on first use: what `submit.py`, `collect.py`, `sweep.py` and the planner import pulls in
    no torch (2.7 s of CPU each, at every submission, preflight and doc command), and the names still resolve."""
    code = ("import sys, json\n"
            "import slurm.submit, slurm.collect, slurm.sweep, analysis.__main__, pretrain.config\n"
            "loaded = 'torch' in sys.modules\n"
            "import zero3d, zero3d.wrap\n"
            "print(json.dumps({'torch': loaded, 'wrap': zero3d.wrap_model is zero3d.wrap.wrap_model,\n"
            "                  'stages': sorted(zero3d.STAGES), 'all': all(hasattr(zero3d, n) for n in zero3d.__all__)}))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout) == {"torch": False, "wrap": True, "stages": [0, 1, 2, 3], "all": True}
    import zero3d
    with pytest.raises(AttributeError, match="module 'zero3d' has no attribute 'wrap_models'"):
        zero3d.wrap_models


def test_a_submission_and_its_preflight_run_without_torch(tmp_path):
    """What runs on a login node at `sbatch` time and on the batch host before the ranks start: a dry-run submission
    and the job's preflight (which checks WANDB_MODE: logging.wandb is on in configs/tiny.toml) import no torch.
    The preflight once did, through the W&B check's module: 2.6 CPU-s a job where it now takes 0.2."""
    code = ("import sys, contextlib, io\n"
            "from slurm import submit\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "    codes = [submit.main(['--cpu', '--config', 'configs/tiny.toml', '--dry-run']),\n"
            "             submit.main(['--preflight', '--world-size', '4', '--config', 'configs/tiny.toml'])]\n"
            "print(codes, 'torch' in sys.modules, 'runs/tiny' in out.getvalue())\n")
    env = dict(os.environ, WANDB_MODE="offline")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["[0,", "0]", "False", "True"], proc.stdout


def test_the_installed_packages_import_from_bytecode():
    """`make install` writes the bytecode of every installed module (pip --no-compile, then compileall on every core):
    where PYTHONDONTWRITEBYTECODE is set (this project's machines) no import writes any, and every Python process the
    suite starts (Slurm ranks, torchrun jobs, CLI runs) would compile what it imports of torch, megatron-core and
    transformers from source."""
    import importlib.util

    import megatron.core
    import transformers
    for module in (torch, torch.distributed.checkpoint, megatron.core, transformers):
        cached = importlib.util.cache_from_source(module.__file__)
        assert os.path.exists(cached), f"{module.__name__}: no bytecode at {cached}"
