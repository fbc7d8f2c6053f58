"""Stage 1 (Pos): optimizer states and fp32 master weights partitioned over the DP group."""
import torch

from zero3d.engine import DataParallelEngine, GroupState, is_gloo, wait_all
from zero3d.flat import FlatLayout, flatten_grads, flatten_params
from zero3d.stage0 import model_state_bytes


def sharded_master(param_flat: torch.Tensor, layout: FlatLayout, dp_rank: int) -> torch.Tensor:
    """This rank's fp32 master shard: a view of the parameters when they are fp32, else a copy."""
    s0, s1 = layout.shard_range(dp_rank)
    shard = param_flat[s0:s1]
    return shard if shard.dtype == torch.float32 else shard.float()


def gather_params(engine: DataParallelEngine) -> None:
    """Cast each rank's updated master shard into its parameter shard, then all-gather the buffer."""
    for g in engine.groups.values():
        s0, s1 = g.layout.shard_range(engine.dp.rank)
        shard = g.param_flat[s0:s1]
        if g.master.data_ptr() != shard.data_ptr():
            shard.copy_(g.master)
        # NCCL gathers in place; gloo gets a separate input so no buffer is read while written.
        source = shard.clone() if is_gloo(engine.dp.group) else shard
        engine.dp.all_gather(g.param_flat, source, tag="params")


def reduce_to_owners(engine: DataParallelEngine, g: GroupState, flat_part: torch.Tensor, start: int,
                     end: int, async_op: bool) -> list:
    """Sum the gradients of flat range [start, end) (held in `flat_part`) onto their owner ranks.

    As the paper does (§7, Pg): at partition boundaries a bucket is split and each piece reduced
    to the rank that owns it; together the pieces move n(N-1)/N elements, as a reduce-scatter.
    """
    return [engine.dp.reduce(flat_part[lo - start:hi - start], owner, tag="grads", async_op=async_op)
            for owner, lo, hi in g.layout.owner_ranges(start, end)]


class OptimizerShardedEngine(DataParallelEngine):
    """Full parameters and gradients on every rank; master weights and Adam moments for one shard."""

    stage = 1

    def _build_group(self, name, named_params):
        layout = FlatLayout(named_params, self.dp.size)
        params = [p for _, p in named_params]
        g = GroupState(name, layout, params, buckets=tuple(layout.buckets(self.settings.bucket_elements)))
        g.param_flat = flatten_params(layout, params, self.settings.dtype, self.device)
        g.grads = flatten_grads(layout, params, self.settings.dtype, self.device)
        g.master = sharded_master(g.param_flat, layout, self.dp.rank)
        g.norm_ranges = self._norm_ranges(layout, offset=0)
        return g

    def _reduce_grads(self):
        handles = []
        for g in self.groups.values():
            for b in g.buckets:
                handles += reduce_to_owners(self, g, g.grads[b.start:b.end], b.start, b.end, True)
        wait_all(handles)
        for g in self.groups.values():
            s0, s1 = g.layout.shard_range(self.dp.rank)
            g.grads[s0:s1].div_(self.dp.size)

    def _master_grad(self, g):
        s0, s1 = g.layout.shard_range(self.dp.rank)
        return self._as_fp32(g.grads[s0:s1])

    def _publish_params(self):
        gather_params(self)

    def zero_grad(self):
        for g in self.groups.values():
            g.grads.zero_()

    def state_bytes(self):
        return model_state_bytes(self)
