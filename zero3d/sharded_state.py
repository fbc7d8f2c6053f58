"""The engine's sharded-state view: which range of each parameter this rank holds and which it writes."""
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from optim import OptimizerSpec


class DPRank(Protocol):
    rank: int  # this rank's index in the data-parallel group


class Settings(Protocol):
    optimizer_spec: OptimizerSpec  # the optimizer's state names per kind of group


class ShardedEngine(Protocol):
    """Exactly what this module reads from the engine (`zero3d.engine.DataParallelEngine` is one)."""

    # {name: GroupState}: each group's `layout`, `params`, `param_flat`, `master_pieces` and `matrix`.
    groups: dict
    dp: DPRank
    settings: Settings
    # Over the master pieces (optim/flat_optimizer.py's FlatOptimizer): `state[piece]` holds the spec's
    # states; it says which a piece keeps (`state_names`), makes a piece's first ones (`initial_state`) and
    # keeps the step count (`step_count`, `set_step_count`).
    optimizer: torch.optim.Optimizer

    def masters_loaded(self) -> None:
        """The model-dtype parameters follow the (just loaded) masters."""


def owned_pieces(layout, dp_rank: int) -> list[tuple]:
    """[(slot, param_lo, param_hi, shard_lo)]: the range [param_lo, param_hi) of the flattened
    parameter `slot` that DP rank `dp_rank` owns, found at `shard_lo` in that rank's shard."""
    return [(slot, flat_lo - slot.start, flat_hi - slot.start, shard_lo)
            for slot, flat_lo, flat_hi, shard_lo in layout.owned_slot_ranges(dp_rank)]


@dataclass(frozen=True)
class StatePiece:
    """Elements [lo, hi) of one flattened parameter as this rank holds them: views, no copies."""

    name: str  # as in model.named_parameters()
    shape: tuple  # the TP-local parameter's shape
    lo: int
    hi: int
    tensors: dict  # {"param": model dtype, "master": fp32, and each of its optimizer states (state dtype)}, 1-D views


def _is_full(tensor: torch.Tensor, layout) -> bool:
    return tensor.numel() == layout.padded_numel


def _view(tensor: torch.Tensor, layout, slot, lo: int, hi: int, shard_lo: int) -> torch.Tensor:
    """Elements [lo, hi) of `slot` inside a full-length (flat coordinates) or shard tensor."""
    start = slot.start + lo if _is_full(tensor, layout) else shard_lo
    return tensor.view(-1)[start:start + hi - lo]


def _master_piece(g, slot, lo: int, hi: int, shard_lo: int) -> tuple:
    """(master piece, offset of the slot's elements [lo, hi) in it). The master is one tensor, or one
    piece per bucket (fp32 stages 1/2); a parameter lies in one bucket, so in one piece."""
    full = sum(piece.numel() for _, piece in g.master_pieces) == g.layout.padded_numel
    start = slot.start + lo if full else shard_lo
    for offset, piece in g.master_pieces:
        if offset <= start and start + hi - lo <= offset + piece.numel():
            return piece, start - offset
    raise AssertionError(f"{slot.name}[{lo}:{hi}] lies in no master piece of group {g.name!r}")


def training_states(engine: ShardedEngine) -> tuple:
    """What a resume loads, each a checkpoint tensor: the master and the optimizer's states of the engine's kinds
    of group (the model-dtype parameters follow from the master)."""
    spec = engine.settings.optimizer_spec
    return ("master", *dict.fromkeys(s for g in engine.groups.values() for s in spec.states_of(g.matrix)))


def _all_master_pieces(engine: ShardedEngine) -> list:
    return [piece for g in engine.groups.values() for _, piece in g.master_pieces]


def optimizer_states(engine: ShardedEngine, piece: torch.Tensor) -> dict:
    """The optimizer's per-element states of one master piece, by the spec's names. A piece the
    optimizer has not stepped yet gets the spec's `initial_state` now (what its first step would
    create); any other state lacking one of the spec's names is an error."""
    spec, optimizer = engine.settings.optimizer_spec, engine.optimizer
    names = optimizer.state_names(piece)
    state = optimizer.state[piece]
    if not state:
        steps = optimizer.step_count(_all_master_pieces(engine))
        if steps:
            raise KeyError(f"the {spec.name} optimizer took {steps} steps but holds no state for a master "
                           f"piece of {piece.numel()} elements")
        state.update(optimizer.initial_state(piece))
    missing = [key for key in names if key not in state]
    if missing:
        raise KeyError(f"the {spec.name} optimizer's state of a master piece lacks {missing}: it has "
                       f"{sorted(state)}, the spec needs {list(names)}")
    return {key: state[key] for key in names}


def optimizer_step_count(engine: ShardedEngine) -> int:
    """Optimizer steps taken (skipped fp16 overflow steps excluded), wherever the spec keeps them."""
    return engine.optimizer.step_count(_all_master_pieces(engine))


def set_optimizer_step_count(engine: ShardedEngine, count: int) -> None:
    """The count a checkpoint restores, into every piece's state (created if not stepped yet)."""
    pieces = _all_master_pieces(engine)
    for piece in pieces:
        optimizer_states(engine, piece)
    engine.optimizer.set_step_count(pieces, count)


def _pieces(engine: ShardedEngine, writing: bool) -> list[StatePiece]:
    out = []
    rank = engine.dp.rank
    for g in engine.groups.values():
        master_numel = sum(piece.numel() for _, piece in g.master_pieces)
        replicated = master_numel == g.layout.padded_numel and g.layout.shard_numel != g.layout.padded_numel
        if replicated and not writing:  # every rank needs the whole of a replicated parameter
            ranges = [(slot, 0, slot.numel, None) for slot in g.layout.slots]
        else:  # each DP rank writes (and, sharded, holds) its own range: every element once
            ranges = owned_pieces(g.layout, rank)
        for slot, lo, hi, shard_lo in ranges:
            piece, at = _master_piece(g, slot, lo, hi, shard_lo)
            states = optimizer_states(engine, piece)
            tensors = {"param": _view(g.param_flat, g.layout, slot, lo, hi, shard_lo),
                       "master": piece[at:at + hi - lo],
                       **{k: v.view(-1)[at:at + hi - lo] for k, v in states.items()}}
            out.append(StatePiece(slot.name, slot.shape, lo, hi, tensors))
    return out


def pieces_to_write(engine: ShardedEngine) -> list[StatePiece]:
    """The pieces this rank writes: over the DP group, every element of every parameter exactly once."""
    return _pieces(engine, writing=True)


def pieces_to_load(engine: ShardedEngine) -> list[StatePiece]:
    """The pieces this rank keeps (its shard; the whole of replicated parameters)."""
    return _pieces(engine, writing=False)


def publish_loaded_state(engine: ShardedEngine) -> None:
    """After master weights were loaded: model-dtype parameters recomputed from them on every rank
    (NVMe offload: inside `engine.materialized_states()`, like every read or write of the states)."""
    engine.masters_loaded()


@contextmanager
def parameter_shapes(engine: ShardedEngine):
    """Stage 3 frees parameters outside their unit's use; inside this block every parameter has its
    shape again (a stride-0 placeholder, no storage) so megatron's sharded_state_dict sees it."""
    restore = []
    for g in engine.groups.values():
        for slot, p in zip(g.layout.slots, g.params):
            if tuple(p.shape) != slot.shape:
                restore.append((p, p.data))
                p.data = torch.zeros(1, dtype=p.dtype, device=p.device).expand(slot.shape)
    try:
        yield
    finally:
        for p, data in restore:
            p.data = data
