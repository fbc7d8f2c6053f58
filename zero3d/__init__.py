"""zero3d: ZeRO-DP stages 0-3 and ZeRO-R over any nn.Module, Megatron tensor-parallel aware (docs/engine.md)."""
import importlib

# Imported on first use (PEP 562): zero3d.config, which the config, the analysis and the Slurm tools read, loads
# without torch.
HOMES = {"wrap_model": "zero3d.wrap", "STAGES": "zero3d.wrap", "DataParallelEngine": "zero3d.engine",
         "EngineSettings": "zero3d.engine", "ParallelGroups": "zero3d.engine", "StepResult": "zero3d.engine",
         "LossScaleConfig": "zero3d.config", "OptimizerConfig": "optim.config", "ZeroConfig": "zero3d.config",
         "ZeroConfigError": "zero3d.config", "LossScaler": "zero3d.precision", "CommStats": "zero3d.comm.core",
         "FlatLayout": "zero3d.flat", "OptimizerSpec": "optim", "ADAMW": "optim"}
__all__ = list(HOMES)


def __getattr__(name: str):
    if name not in HOMES:
        raise AttributeError(f"module 'zero3d' has no attribute {name!r}")
    return getattr(importlib.import_module(HOMES[name]), name)


def __dir__():
    return sorted(list(globals()) + __all__)
