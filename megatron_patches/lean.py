"""`import megatron_patches.lean`: megatron-core imported without import-time work zero3d never uses (torch.compile, wandb, TensorBoard).

megatron-core 0.16 decorates its fused kernels with `torch.compile` when the module is imported (megatron.core.jit),
which pulls in TorchDynamo and Inductor (≈3.5 s of CPU per process), its inference engine imports wandb (≈1 s) and
its timers TensorBoard's SummaryWriter (≈0.2 s). zero3d calls none of those kernels on CPU and logs to wandb and
TensorBoard itself, yet every rank, test subprocess and CLI paid all three at start-up. `import_megatron_lean()`
imports megatron.core once with:
  - `torch.compile` deferred: a decorated function is compiled on its first call, with the same options, so a
    kernel megatron does call behaves exactly as before;
  - wandb and tensorboard hidden from megatron's optional `try: import ...` (inference and timer logging, unused
    here); zero3d's own sinks import them later as usual.
Both are undone before it returns; a process that already imported megatron.core is left as it is.
"""
import functools
import importlib.abc
import sys

import torch

HIDDEN = ("wandb", "tensorboard")


def compile_on_first_call(compile_):
    """A `torch.compile` stand-in: same signature, compiling each function when it is first called."""
    def lazy_compile(model=None, **options):
        if model is None:  # used as @torch.compile(...)
            return lambda fn: lazy_compile(fn, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_(model, **options)
            return compiled(*args, **kwargs)
        return call
    return lazy_compile


class HideModules(importlib.abc.MetaPathFinder):
    """Makes `import NAME` (and its submodules) raise ImportError, as if NAME were not installed."""

    def __init__(self, names):
        self.names = tuple(names)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.names:
            raise ImportError(f"{fullname} is not imported while megatron-core loads (megatron_patches.lean_import)")
        return None


def import_megatron_lean() -> None:
    """Import megatron.core (once per process) with torch.compile deferred and wandb and tensorboard hidden."""
    if "megatron.core" in sys.modules:
        return
    hidden = HideModules(name for name in HIDDEN if name not in sys.modules)
    real_compile = torch.compile
    torch.compile = compile_on_first_call(real_compile)
    sys.meta_path.insert(0, hidden)
    try:
        import megatron.core  # noqa: F401
    finally:
        sys.meta_path.remove(hidden)
        torch.compile = real_compile


import_megatron_lean()  # `import megatron_patches.lean` before a module's first megatron import does it
