"""zero3d: ZeRO-DP stages 0-3 and ZeRO-R over any nn.Module, Megatron tensor-parallel aware."""
from zero3d.comm import CommStats
from zero3d.engine import DataParallelEngine, EngineSettings, ParallelGroups, StepResult
from zero3d.precision import LossScaler
from zero3d.stage0 import ReplicatedEngine
from zero3d.stage1 import OptimizerShardedEngine
from zero3d.stage2 import GradientShardedEngine
from zero3d.stage3 import ParameterShardedEngine

STAGES = {0: ReplicatedEngine, 1: OptimizerShardedEngine, 2: GradientShardedEngine,
          3: ParameterShardedEngine}


def wrap_model(model, stage: int, settings: EngineSettings, groups: ParallelGroups) -> DataParallelEngine:
    """Apply ZeRO-DP `stage` to `model` over `groups.dp_group`; the loop then only sees the interface."""
    if stage not in STAGES:
        raise ValueError(f"zero.stage = {stage!r} is invalid; valid stages: {sorted(STAGES)}")
    return STAGES[stage](model, settings, groups)


__all__ = ["wrap_model", "STAGES", "DataParallelEngine", "EngineSettings", "ParallelGroups",
           "StepResult", "LossScaler", "CommStats"]
