"""zero3d: ZeRO-DP stages 0-3 and ZeRO-R over any nn.Module, Megatron tensor-parallel aware.

Glossary (the paper's names → the code):
- Pos (stage 1): optimizer states and fp32 master partitioned — `OptimizerShardedEngine`
  (zero3d/stage1.py; `WholeParamsEngine`, whole_params.py, is what it shares with stage 2); each rank's
  `GroupState.master_pieces` and Adam moments cover its shard.
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
- N_d, Ψ: data-parallel size (`engine.dp.size`), parameters per TP rank.
"""
import dataclasses
from typing import Callable, Optional

from zero3d.comm import CommStats
from zero3d.config import LossScaleConfig, OptimizerConfig, ZeroConfig, ZeroConfigError
from zero3d.engine import DataParallelEngine, EngineSettings, ParallelGroups, StepResult
from zero3d.flat import FlatLayout
from zero3d.precision import LossScaler
from zero3d.stage0 import ReplicatedEngine
from zero3d.stage1 import OptimizerShardedEngine
from zero3d.stage2 import GradientShardedEngine
from zero3d.stage3 import ParameterShardedEngine

STAGES = {0: ReplicatedEngine, 1: OptimizerShardedEngine, 2: GradientShardedEngine,
          3: ParameterShardedEngine}


def wrap_model(model, settings: EngineSettings, groups: ParallelGroups,
               units: Optional[Callable] = None) -> DataParallelEngine:
    """Apply ZeRO-DP stage `settings.zero.stage` to `model` over `groups.dp_group`; the loop then only sees
    the interface. `units` (stage 3: model -> [(name, module[, parameters handed at call time])]) overrides
    `settings.units`.
    """
    stage = settings.zero.stage
    if stage not in STAGES:
        raise ValueError(f"zero.stage = {stage!r} is invalid; valid stages: {sorted(STAGES)}")
    if stage == 3 and groups.tied:
        raise ValueError("ZeRO stage 3 does not support gradients summed over another group (weights "
                         "tied across pipeline stages, sequence-parallel layer norms); use zero.stage <= 2")
    settings = dataclasses.replace(settings, units=units if units is not None else settings.units)
    return STAGES[stage](model, settings, groups)


__all__ = ["wrap_model", "STAGES", "DataParallelEngine", "EngineSettings", "ParallelGroups", "StepResult",
           "LossScaleConfig", "LossScaler", "OptimizerConfig", "CommStats", "FlatLayout", "ZeroConfig", "ZeroConfigError"]
