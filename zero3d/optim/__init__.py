"""The engine's optimizers as specs (`OptimizerSpec`), one module each, named by `optimizer.name`; `ADAMW` the default.

Nothing else in zero3d or pretrain names an optimizer's states or their bytes: the placements (device, host,
NVMe), the checkpoint's tensors and manifest, the byte accounting and the estimator ask the spec (its `states`,
`state_bytes`), and the engine steps `FlatOptimizer` (zero3d/optim/flat_optimizer.py), which runs the spec's update.
Importing this package imports no torch: the planner and the estimator read the specs without it.
"""
from zero3d.optim.adamw import ADAMW
from zero3d.optim.lion import LION
from zero3d.optim.muon import MUON
from zero3d.optim.sgd import SGD
from zero3d.optim.spec import MASTER_BYTES, STATE_DTYPES, MatrixRule, OptimizerSpec

SPECS = {spec.name: spec for spec in (ADAMW, LION, SGD, MUON)}


def spec_named(name: str) -> OptimizerSpec:
    """The spec of `optimizer.name`."""
    if name not in SPECS:
        raise ValueError(f"optimizer.name = {name!r} is invalid; valid values: {', '.join(map(repr, SPECS))}")
    return SPECS[name]


__all__ = ["ADAMW", "LION", "MASTER_BYTES", "MUON", "MatrixRule", "OptimizerSpec", "SGD", "SPECS", "STATE_DTYPES",
           "spec_named"]
