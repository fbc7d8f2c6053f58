"""What stages 1 and 2 share: whole parameters on every rank, a sharded master, parameters re-gathered after the step."""
from functools import partial

import torch

from zero3d.comm.core import is_gloo
from zero3d.engine import DataParallelEngine, GroupState
from zero3d.flat import flatten_grads, flatten_params


def is_compiled(module: torch.nn.Module) -> bool:
    """Is `module`'s forward a torch.compile'd function (`module.forward = torch.compile(module.forward)`)?"""
    return getattr(module.forward, "_torchdynamo_orig_callable", None) is not None


class WholeParamsEngine(DataParallelEngine):
    """Stages 1/2: every rank keeps whole parameters; the fp32 master and Adam moments cover this
    rank's pieces only (one piece per bucket); after the step each rank's updated pieces are
    all-gathered per bucket, left in flight until the next forward reaches the bucket's first module
    (`zero.overlap_param_gather`). A subclass says whether gradients are kept whole (`full_grads`)."""

    full_grads: bool

    def __init__(self, model, settings, groups):
        super().__init__(model, settings, groups)
        self._register_param_sync_hooks()

    def _build_group(self, name: str, named_params: list, decays: bool, matrix: bool = False) -> GroupState:
        """Whole parameters; the master for this rank's pieces; gradients whole or this rank's shard."""
        layout = self._layout(named_params)
        params = [p for _, p in named_params]
        dtype = self.settings.dtype
        group = GroupState(name, layout, params, decays, bucketed=not self.full_grads, grads_per_step=not self.full_grads,
                           matrix=matrix)
        group.param_flat = flat = flatten_params(layout, params, dtype, self.device)
        if self.full_grads:
            group.grads = flatten_grads(layout, params, dtype, self.device)
        # fp32 parameters: views of this rank's pieces (the parameters are the master); else one fp32
        # copy of the rank's shard.
        if flat.dtype == torch.float32:
            group.master_pieces = tuple((bucket.shard_start, flat[lo:hi]) for bucket, lo, hi in layout.pieces(self.dp.rank))
        else:
            group.master_pieces = ((0, layout.shard_of(flat, self.dp.rank).float()),)
        group.norm_ranges = self._norm_ranges(layout, flat=False)
        return group

    def _publish_params(self) -> None:
        """Each rank's updated master pieces into its parameter pieces, then one all-gather per bucket;
        with `overlap_param_gather` they stay in flight until the module using them runs next."""
        rank = self.dp.rank
        for name, group in self.groups.items():
            # One fp32 master (mixed precision) is cast into the pieces here; fp32 pieces are the master;
            # an offloaded placement has already written the pieces.
            one_master = len(group.master_pieces) == 1 and not self.placement.writes_params
            master = group.master_pieces[0][1] if one_master else None
            for bucket, lo, hi in group.layout.pieces(rank):
                piece = group.param_flat[lo:hi]
                if master is not None:
                    piece.copy_(master[bucket.shard_start:bucket.shard_start + bucket.piece_numel])
                # NCCL gathers in place; gloo gets a separate input so no buffer is read while written.
                source = piece.clone() if is_gloo(self.dp.group) else piece
                pending = self.dp.all_gather(group.param_flat[bucket.start:bucket.end], source, tag="params",
                                             async_op=True)
                if pending is not None:  # None: one DP rank, nothing to gather
                    self.pending_param_gathers[(name, bucket.index)] = pending
        if not self.settings.zero.overlap_param_gather:
            self.finish_param_sync()

    def _register_param_sync_hooks(self) -> None:
        """Forward pre-hooks (as megatron-core's overlap_param_gather): a module waits for the gathers
        of the buckets holding its own parameters; `state_dict()` waits for all of them. A module whose forward is
        torch.compile'd (model.compile: each layer's) waits for its whole subtree's, and nothing inside it hooks: a
        hook in a compiled forward breaks its graph (the wait's host clock), inside megatron's layer context manager
        the whole layer then ran eager."""
        bucket_of = {group.params[i]: (name, bucket.index)
                     for name, group in self.groups.items() for bucket in group.buckets for i in bucket.slot_indices}
        compiled_regions = []
        for path, module in self.model.named_modules():
            if any(region == "" or path.startswith(region + ".") for region in compiled_regions):
                continue
            whole = is_compiled(module)
            if whole:
                compiled_regions.append(path)
            keys = tuple(dict.fromkeys(bucket_of[p] for p in module.parameters(recurse=whole) if p in bucket_of))
            if keys:
                self.hooks.append(module.register_forward_pre_hook(partial(self._wait_for_buckets, keys)))
        self.hooks.append(self.model.register_state_dict_pre_hook(
            lambda module, prefix, keep_vars: self.finish_param_sync()))

    def _wait_for_buckets(self, keys: tuple, module, args) -> None:
        self.comm_stats.poll()
        for key in keys:
            pending = self.pending_param_gathers.pop(key, None)
            if pending is not None:
                pending.wait()
