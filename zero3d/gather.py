"""Stage 3 gather units: which modules' parameters are materialised together, and in what order."""
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn


@dataclass(eq=False)
class Unit:
    """One gather unit: its module, its sharded groups (one per decay class) and its gather state."""

    index: int
    name: str
    module: nn.Module
    params: list  # owned trainable parameters, persistent ones included
    groups: list = field(default_factory=list)  # GroupState of the sharded ones (set by the engine)
    borrows: list = field(default_factory=list)  # Units whose parameters this module also uses
    full: Optional[list] = None  # gathered buffers (one per group) while materialised
    handles: list = field(default_factory=list)  # pending all-gathers into `full`
    gather_tag: str = ""  # the purpose of the gather that filled `full` (hpZ keeps a forward one's slice)
    pending: set = field(default_factory=set)  # owned sharded params still awaiting their gradient
    entered: bool = False  # its own backward has begun (this backward pass)

    @property
    def numel(self) -> int:
        """Elements materialised when this unit is gathered (padded group buffers)."""
        return sum(group.layout.padded_numel for group in self.groups)

    @property
    def entry(self) -> list:
        """What running this module needs gathered: itself and the units it borrows from."""
        return [self] + self.borrows

    @property
    def entry_numel(self) -> int:
        return sum(unit.numel for unit in self.entry)


def unit_modules(model: nn.Module, units: Optional[Callable] = None) -> list[tuple]:
    """[(name, module, params it is handed at call time)]: `units(model)` — entries (name, module)
    or (name, module, [parameters]) — else the top-level children."""
    named = units(model) if units is not None else list(model.named_children())
    return [(entry[0], entry[1], list(entry[2]) if len(entry) > 2 else []) for entry in named]


def build_units(model: nn.Module, units: Optional[Callable] = None) -> list[Unit]:
    """Units in module-definition order (the prefetch order until a forward has been recorded)."""
    owner: dict = {}  # param -> unit name
    found: dict[str, tuple[nn.Module, list]] = {}
    handed: dict[str, list] = {}  # unit name -> parameters its module is given when called
    for name, module, used in unit_modules(model, units):
        params = [p for p in module.parameters() if p.requires_grad and p not in owner]
        for p in params:
            owner[p] = name
        found[name] = (module, params)
        handed[name] = used
    declared = set(found)
    for pname, p in model.named_parameters():  # leftovers: a unit per module holding them
        if p.requires_grad and p not in owner:
            mname = pname.rpartition(".")[0] or "<root>"
            module = model.get_submodule(pname.rpartition(".")[0])
            owner[p] = mname
            found.setdefault(mname, (module, []))[1].append(p)
    position = {module: i for i, (_, module) in enumerate(model.named_modules())}
    ordered = sorted(found.items(), key=lambda item: position[item[1][0]])
    units = [Unit(i, name, module, params) for i, (name, (module, params)) in enumerate(ordered)]
    by_name = {unit.name: unit for unit in units}
    by_param = {p: by_name[owner[p]] for p in owner}
    for unit in units:  # a declared module using a parameter owned elsewhere (shared weight)
        if unit.name not in declared:
            continue  # a leftover holder's own direct parameters are all its own
        for p in [*unit.module.parameters(), *handed[unit.name]]:
            lender = by_param.get(p)
            if lender is not None and lender is not unit and lender not in unit.borrows:
                unit.borrows.append(lender)
    return units


def tensors_in(value) -> list[torch.Tensor]:
    """Tensors in a module's inputs or outputs (tensor, tuple/list, dict values), one level deep."""
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for v in value if torch.is_tensor(v)]
    if isinstance(value, dict):
        return [v for v in value.values() if torch.is_tensor(v)]
    return []


def hook_grads(value, fn: Callable) -> None:
    """Call fn() when the gradient of any grad-requiring tensor in `value` is computed (once each)."""
    for t in tensors_in(value):
        if t.requires_grad:
            t.register_hook(lambda grad: fn())
