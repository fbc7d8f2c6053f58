"""zero3d: ZeRO-DP stages 0-3 and ZeRO-R over any nn.Module, Megatron tensor-parallel aware.

Glossary (the paper's names → the code):
- Pos (stage 1): optimizer states and fp32 master partitioned — `OptimizerShardedEngine`
  (zero3d/stage1.py; `WholeParamsEngine`, whole_params.py, is what it shares with stage 2); each rank's
  `GroupState.master_pieces` and optimizer states cover its shard.
- Pos+g (stage 2): + gradients — `GradientShardedEngine` (stage2.py); `GradientBuckets`
  (buckets.py) reduce-scatters each bucket during backward into the rank's gradient shard.
- Pos+g+p (stage 3): + parameters — `ParameterShardedEngine` (stage3.py); parameters gathered per
  unit (gather.py) around its forward and backward.
- Pa: partitioned activation checkpoints across the TP group (zero3d/activations.py);
  Pa+cpu: those slices in host memory (`ZeroConfig.cpu_checkpointing`).
- CB: constant-size buckets — `ZeroConfig.bucket_elements`, `flat.Bucket`: one reduce-scatter and
  one all-gather each.
- MD: memory defragmentation — contiguous buffers: `flat.flatten_params/flatten_grads` (one
  allocation per group) and `ZeroConfig.contiguous_checkpointing` (checkpoints in one buffer).
- ZeRO-Offload / ZeRO-Infinity: `ZeroConfig.offload_optimizer`, the engine's `placement`
  (zero3d/placement.py: "none" on the device; "cpu": offload.py; "nvme": nvme.py) and stage 3's
  `offload_params`; see docs/offload.md. Byte accounting: accounting.py.
- K: optimizer-state bytes per parameter — the fp32 master and the states of the engine's `OptimizerSpec`
  (zero3d/optim/, by `optimizer.name`; `ADAMW`, the default, keeps two moments: K = 4 + 8 with fp32 states, 4 + 4
  with `optimizer.state_dtype = "bf16"`), `EngineSettings.optimizer_spec`; the estimator's `OptimizerStates`.
- N_d, Ψ: data-parallel size (`engine.dp.size`), parameters per TP rank.

The package's names are imported on first use (PEP 562): `zero3d.config`, which the config, the planner (the
analysis beside the engine, analysis/) and the Slurm tools read, loads without torch.
"""
import importlib

HOMES = {"wrap_model": "zero3d.wrap", "STAGES": "zero3d.wrap", "DataParallelEngine": "zero3d.engine",
         "EngineSettings": "zero3d.engine", "ParallelGroups": "zero3d.engine", "StepResult": "zero3d.engine",
         "LossScaleConfig": "zero3d.config", "OptimizerConfig": "zero3d.config", "ZeroConfig": "zero3d.config",
         "ZeroConfigError": "zero3d.config", "LossScaler": "zero3d.precision", "CommStats": "zero3d.comm.core",
         "FlatLayout": "zero3d.flat", "OptimizerSpec": "zero3d.optim", "ADAMW": "zero3d.optim"}
__all__ = list(HOMES)


def __getattr__(name: str):
    if name not in HOMES:
        raise AttributeError(f"module 'zero3d' has no attribute {name!r}")
    return getattr(importlib.import_module(HOMES[name]), name)


def __dir__():
    return sorted(list(globals()) + __all__)
