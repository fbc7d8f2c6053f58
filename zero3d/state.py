"""The engine's sharded-state view: which range of each parameter this rank holds and which it writes.

A checkpoint never looks at how a flat buffer is sharded; it asks this module. `owned_pieces` is the
one place that turns the layout's shard coordinates into parameter coordinates: each (parameter,
DP rank) owns at most one contiguous range of the flattened (TP-local) parameter.

A group's tensor is either full-length (`layout.padded_numel` elements: parameters of stages 0-2,
the replicated groups of stage 0 and stage 3's persistent ones) and indexed in flat coordinates,
or a shard (`layout.shard_numel`) indexed in shard coordinates.
"""
from contextlib import contextmanager
from dataclasses import dataclass

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")


def owned_pieces(layout, dp_rank: int) -> list[tuple]:
    """[(slot, param_lo, param_hi, shard_lo)]: the range [param_lo, param_hi) of the flattened
    parameter `slot` that DP rank `dp_rank` owns, found at `shard_lo` in that rank's shard."""
    s0 = layout.shard_range(dp_rank)[0]
    return [(slot, s0 + lo - slot.start, s0 + hi - slot.start, lo)
            for slot, lo, hi in layout.slots_in_shard(dp_rank)]


@dataclass(frozen=True)
class StatePiece:
    """Elements [lo, hi) of one flattened parameter as this rank holds them: views, no copies."""

    name: str  # as in model.named_parameters()
    shape: tuple  # the TP-local parameter's shape
    lo: int
    hi: int
    tensors: dict  # {"param": model dtype, "master": fp32, "exp_avg": fp32, "exp_avg_sq": fp32}, 1-D views


def _is_full(tensor: torch.Tensor, layout) -> bool:
    return tensor.numel() == layout.padded_numel


def _view(tensor: torch.Tensor, layout, slot, lo: int, hi: int, shard_lo: int) -> torch.Tensor:
    """Elements [lo, hi) of `slot` inside a full-length (flat coordinates) or shard tensor."""
    start = slot.start + lo if _is_full(tensor, layout) else shard_lo
    return tensor.view(-1)[start:start + hi - lo]


def adam_moments(engine, g) -> dict:
    """The optimizer's per-element states of group `g`'s master; before the first step, zeros (and a
    step count of 0, as the optimizer would create them)."""
    state = engine.optimizer.state[g.master]
    if not state:
        state["step"] = _step_tensor(engine, g, 0)
    for key in MOMENTS:
        if key not in state:
            state[key] = torch.zeros_like(g.master, memory_format=torch.preserve_format)
    return {key: state[key] for key in MOMENTS}


def _step_tensor(engine, g, count: int) -> torch.Tensor:
    fused = engine.optimizer.defaults.get("fused")  # torch's fused AdamW keeps the count on the device
    return torch.tensor(float(count), dtype=torch.float32, device=g.master.device if fused else "cpu")


def adam_step_count(engine) -> int:
    """Optimizer steps taken (skipped fp16 overflow steps excluded); the same for every group."""
    group = engine.optimizer.param_groups[0]
    if "step" in group:  # apex FusedAdam counts per group
        return int(group["step"])
    g = next(iter(engine.groups.values()))
    return int(engine.optimizer.state.get(g.master, {}).get("step", 0))


def set_adam_step_count(engine, count: int) -> None:
    for pg in engine.optimizer.param_groups:
        if "step" in pg:
            pg["step"] = count
    for g in engine.groups.values():
        adam_moments(engine, g)
        engine.optimizer.state[g.master]["step"] = _step_tensor(engine, g, count)


def _pieces(engine, writing: bool) -> list[StatePiece]:
    out = []
    rank = engine.dp.rank
    for g in engine.groups.values():
        moments = adam_moments(engine, g)
        replicated = _is_full(g.master, g.layout) and g.layout.shard_numel != g.layout.padded_numel
        if replicated and not writing:  # every rank needs the whole of a replicated parameter
            ranges = [(slot, 0, slot.numel, None) for slot in g.layout.slots]
        else:  # each DP rank writes (and, sharded, holds) its own range: every element once
            ranges = owned_pieces(g.layout, rank)
        for slot, lo, hi, shard_lo in ranges:
            tensors = {"param": _view(g.param_flat, g.layout, slot, lo, hi, shard_lo),
                       "master": _view(g.master, g.layout, slot, lo, hi, shard_lo),
                       **{k: _view(v, g.layout, slot, lo, hi, shard_lo) for k, v in moments.items()}}
            out.append(StatePiece(slot.name, slot.shape, lo, hi, tensors))
    return out


def pieces_to_write(engine) -> list[StatePiece]:
    """The pieces this rank writes: over the DP group, every element of every parameter exactly once."""
    return _pieces(engine, writing=True)


def pieces_to_load(engine) -> list[StatePiece]:
    """The pieces this rank keeps (its shard; the whole of replicated parameters)."""
    return _pieces(engine, writing=False)


def publish_loaded_state(engine) -> None:
    """After master weights were loaded: model-dtype parameters recomputed from them on every rank."""
    engine._publish_params()


@contextmanager
def parameter_shapes(engine):
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
