"""The engine's optimizers as specs (`OptimizerSpec`), one module each, named by `optimizer.name`; `ADAMW` the default."""
from optim.adamw import ADAMW
from optim.lion import LION
from optim.muon import MUON
from optim.sgd import SGD
from optim.spec import MASTER_BYTES, STATE_DTYPES, MatrixRule, OptimizerSpec

SPECS = {spec.name: spec for spec in (ADAMW, LION, SGD, MUON)}


def spec_named(name: str) -> OptimizerSpec:
    """The spec of `optimizer.name`."""
    if name not in SPECS:
        raise ValueError(f"optimizer.name = {name!r} is invalid; valid values: {', '.join(map(repr, SPECS))}")
    return SPECS[name]


__all__ = ["ADAMW", "LION", "MASTER_BYTES", "MUON", "MatrixRule", "OptimizerSpec", "SGD", "SPECS", "STATE_DTYPES",
           "spec_named"]
