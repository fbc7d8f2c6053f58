"""What the ZeRO stages share: replicated and sharded groups, bucket collectives, parameter publishing."""
from functools import partial

import torch

from zero3d.comm import is_gloo, wait_all
from zero3d.engine import DataParallelEngine, GroupState
from zero3d.flat import FlatLayout, flatten_grads, flatten_params


def replicated_group(engine: DataParallelEngine, name: str, named_params: list) -> GroupState:
    """Full parameters, gradients, master and optimizer states on every rank (stage 0, stage 3's small ones)."""
    layout = engine._layout(named_params)
    params = [p for _, p in named_params]
    dtype = engine.settings.dtype
    group = GroupState(name, layout, params)
    group.param_flat = flatten_params(layout, params, dtype, engine.device)
    group.grads = flatten_grads(layout, params, dtype, engine.device)
    # fp32 models train their own storage; fp16/bf16 ones get a full fp32 master copy.
    master = group.param_flat if dtype == torch.float32 else group.param_flat.float()
    group.master_pieces = ((0, master),)
    # Each DP rank counts its own pieces, so the norm sums every element once.
    group.norm_ranges = engine._norm_ranges(layout, flat=True)
    return group


def sharded_group(engine: DataParallelEngine, name: str, named_params: list, full_grads: bool) -> GroupState:
    """Stages 1/2: whole parameters; the master and optimizer states for this rank's pieces only;
    gradients whole (`full_grads`, stage 1) or this rank's shard (stage 2)."""
    layout = engine._layout(named_params)
    params = [p for _, p in named_params]
    dtype = engine.settings.dtype
    group = GroupState(name, layout, params)
    group.param_flat = flatten_params(layout, params, dtype, engine.device)
    group.grads = flatten_grads(layout, params, dtype, engine.device) if full_grads else \
        torch.zeros(layout.shard_numel, dtype=dtype, device=engine.device)
    group.master_pieces = sharded_master_pieces(group.param_flat, layout, engine.dp.rank)
    group.norm_ranges = engine._norm_ranges(layout, flat=False)
    return group


def sharded_master_pieces(param_flat: torch.Tensor, layout: FlatLayout, dp_rank: int) -> tuple:
    """fp32 parameters: views of this rank's pieces (the parameters are the master); else one fp32
    copy of the rank's shard."""
    if param_flat.dtype == torch.float32:
        return tuple((bucket.shard_start, param_flat[lo:hi]) for bucket, lo, hi in layout.pieces(dp_rank))
    return ((0, layout.shard_of(param_flat, dp_rank).float()),)


def all_reduce_replicated(engine: DataParallelEngine, groups: list) -> None:
    """Stage 0 (and stage 3's persistent groups): one all-reduce per bucket, pre/post-divided."""
    for group in groups:
        if engine.pre_scale != 1.0:
            group.grads.mul_(engine.pre_scale)
    wait_all([engine.dp.all_reduce(group.grads[bucket.start:bucket.end], tag="grads", async_op=True)
              for group in groups for bucket in group.buckets])
    for group in groups:
        if engine.post_scale != 1.0:
            group.grads.mul_(engine.post_scale)


def reduce_scatter_in_place(engine: DataParallelEngine, groups: list) -> None:
    """Stage 1: one reduce-scatter per bucket of the whole gradient buffer, each rank's piece
    reduced where it lies (no copy); then the pieces are post-divided."""
    handles = []
    for group in groups:
        if engine.pre_scale != 1.0:
            group.grads.mul_(engine.pre_scale)
        for bucket, lo, hi in group.layout.pieces(engine.dp.rank):
            handles.append(engine.dp.reduce_scatter(group.grads[lo:hi], group.grads[bucket.start:bucket.end],
                                                    tag="grads", async_op=True))
    wait_all(handles)
    if engine.post_scale != 1.0:
        for group in groups:
            for _, lo, hi in group.layout.pieces(engine.dp.rank):
                group.grads[lo:hi].mul_(engine.post_scale)


def publish_params(engine: DataParallelEngine, overlap: bool) -> None:
    """Stages 1/2: each rank's updated master pieces into its parameter pieces, then one all-gather
    per bucket; with `overlap` they stay in flight until the module using them runs next."""
    rank = engine.dp.rank
    for name, group in engine.groups.items():
        # One fp32 master (mixed precision) is cast into the pieces here; fp32 pieces are the master;
        # with the optimizer offloaded, the offload has already written the pieces.
        master = group.master_pieces[0][1] if len(group.master_pieces) == 1 and engine.offload is None else None
        for bucket, lo, hi in group.layout.pieces(rank):
            piece = group.param_flat[lo:hi]
            if master is not None:
                piece.copy_(master[bucket.shard_start:bucket.shard_start + bucket.piece_numel])
            # NCCL gathers in place; gloo gets a separate input so no buffer is read while written.
            source = piece.clone() if is_gloo(engine.dp.group) else piece
            pending = engine.dp.all_gather(group.param_flat[bucket.start:bucket.end], source, tag="params",
                                           async_op=True)
            if pending is not None:  # None: one DP rank, nothing to gather
                engine.pending_param_gathers[(name, bucket.index)] = pending
    if not overlap:
        engine.finish_param_sync()


def register_param_sync_hooks(engine: DataParallelEngine) -> None:
    """Forward pre-hooks (as megatron-core's overlap_param_gather): a module waits for the gathers
    of the buckets holding its own parameters; `state_dict()` waits for all of them."""
    bucket_of = {group.params[i]: (name, bucket.index)
                 for name, group in engine.groups.items() for bucket in group.buckets for i in bucket.slot_indices}
    for module in engine.model.modules():
        keys = tuple(dict.fromkeys(bucket_of[p] for p in module.parameters(recurse=False) if p in bucket_of))
        if keys:
            module.register_forward_pre_hook(partial(wait_for_buckets, engine, keys))
    engine.model.register_state_dict_pre_hook(lambda module, prefix, keep_vars: engine.finish_param_sync())


def wait_for_buckets(engine: DataParallelEngine, keys: tuple, module, args) -> None:
    engine.comm_stats.poll()
    for key in keys:
        pending = engine.pending_param_gathers.pop(key, None)
        if pending is not None:
            pending.wait()


def model_state_bytes(engine: DataParallelEngine) -> dict:
    """Bytes per category that this rank keeps between steps (the paper's model states)."""
    def nbytes(tensor):
        return tensor.numel() * tensor.element_size()
    return {"params": sum(nbytes(group.param_flat) for group in engine.groups.values()),
            "grads": sum(nbytes(group.grads) for group in engine.groups.values()),
            "master_params": engine._master_bytes(),
            "optimizer_states": engine.optimizer_state_bytes()}
