"""`wrap_model`: the ZeRO-DP stage a config names, applied to a model over its data-parallel group."""
import dataclasses
from typing import Callable, Optional

from zero3d.engine import DataParallelEngine, EngineSettings, ParallelGroups
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
    settings = dataclasses.replace(settings, units=units if units is not None else settings.units)
    return STAGES[stage](model, settings, groups)
