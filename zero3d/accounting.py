"""Model-state byte accounting — parameters, gradients, fp32 masters, optimizer states — in one place."""
import torch

# The categories a stage's accounting moves off the device when the optimizer is offloaded.
OFFLOADED_CATEGORIES = ("master_params", "optimizer_states")


def nbytes(tensor) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def optimizer_state_bytes(optimizer, masters=None) -> int:
    """Bytes of the optimizer's per-element states (its OptimizerSpec.states) — of every parameter, or of
    `masters` only; scalar step counters excluded (`step_counter_bytes`)."""
    states = optimizer.state.values() if masters is None else [optimizer.state.get(m, {}) for m in masters]
    return sum(nbytes(v) for state in states for v in state.values() if torch.is_tensor(v) and v.dim() > 0)


def step_counter_bytes(optimizer) -> int:
    """Bytes of the optimizer's scalar states (e.g. torch AdamW's per-parameter step counters)."""
    return sum(nbytes(v) for state in optimizer.state.values() for v in state.values()
               if torch.is_tensor(v) and v.dim() == 0)


def grad_bytes(group) -> int:
    """Bytes of the group's gradients, as a step holds them (a shard allocated per step: its size, also between steps)."""
    if group.grads is not None:
        return nbytes(group.grads)
    return group.layout.shard_numel * group.param_flat.element_size()


def master_bytes(groups) -> int:
    """fp32 master bytes of `groups` that are not shared with the model's own parameter storage."""
    total = 0
    for group in groups:
        for _, piece in group.master_pieces:
            # Storage identity, not data_ptr(): fake tensors (the rank-local probe) all report 0.
            if group.param_flat is None or piece.untyped_storage() is not group.param_flat.untyped_storage():
                total += nbytes(piece)
    return total


def model_state_bytes(groups, optimizer) -> dict:
    """Bytes per category that this rank keeps for a step for `groups` (the paper's model states; a gradient shard
    allocated per step counts whole: grad_bytes)."""
    groups = list(groups)
    return {"params": sum(nbytes(group.param_flat) for group in groups),
            "grads": sum(grad_bytes(group) for group in groups),
            "master_params": master_bytes(groups),
            "optimizer_states": optimizer_state_bytes(optimizer, [piece for group in groups
                                                                  for _, piece in group.master_pieces])}


def secondary_bytes(groups) -> int:
    """Stage 3 hpZ: bytes of the groups' secondary (node-local) parameter shards, Ψb/m per rank."""
    return sum(nbytes(group.secondary) for group in groups)


def moved_off_device(stage_bytes: dict, held_grad_bytes: int, off_device: dict) -> dict:
    """A stage's accounting with the offloaded categories moved: device master/optimizer bytes are 0,
    gradient shards held on the host leave `grads` (the keys keep their device meaning); the
    host_*/nvme_* keys of `off_device` say where those bytes went."""
    out = {k: (0 if k.endswith(OFFLOADED_CATEGORIES) else v) for k, v in stage_bytes.items()}
    out["grads"] -= held_grad_bytes
    out.update(off_device)
    return out
