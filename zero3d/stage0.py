"""Stage 0: plain data parallelism — replicated states, gradients all-reduced in constant-size buckets."""
import torch

from zero3d.engine import DataParallelEngine, GroupState, wait_all
from zero3d.flat import FlatLayout, flatten_grads, flatten_params


class ReplicatedEngine(DataParallelEngine):
    """Every DP rank keeps full parameters, gradients, fp32 master weights and optimizer states."""

    stage = 0

    def _build_group(self, name, named_params):
        return replicated_group(self, name, named_params)

    def _reduce_grads(self):
        handles = [self.dp.all_reduce(g.grads[b.start:b.end], tag="grads", async_op=True)
                   for g in self.groups.values() for b in g.buckets]
        wait_all(handles)
        for g in self.groups.values():
            g.grads.div_(self.dp.size)

    def _master_grad(self, g):
        return self._as_fp32(g.grads)

    def _publish_params(self):
        for g in self.groups.values():
            if g.master is not g.param_flat:
                g.param_flat.copy_(g.master)

    def zero_grad(self):
        for g in self.groups.values():
            g.grads.zero_()

    def state_bytes(self):
        return model_state_bytes(self)


def replicated_group(engine: DataParallelEngine, name: str, named_params: list) -> GroupState:
    """Full parameters, gradients, master and optimizer states on every rank (also stage 3's small ones)."""
    layout = FlatLayout(named_params, engine.dp.size)
    params = [p for _, p in named_params]
    dtype = engine.settings.dtype
    g = GroupState(name, layout, params, buckets=tuple(layout.buckets(engine.settings.bucket_elements)))
    g.param_flat = flatten_params(layout, params, dtype, engine.device)
    g.grads = flatten_grads(layout, params, dtype, engine.device)
    # fp32 models train their own storage; fp16/bf16 ones get a full fp32 master copy.
    g.master = g.param_flat if dtype == torch.float32 else g.param_flat.float()
    # Each DP rank counts its own shard's range, so the norm sums every element once.
    g.norm_ranges = engine._norm_ranges(layout, offset=layout.shard_range(engine.dp.rank)[0])
    return g


def model_state_bytes(engine: DataParallelEngine) -> dict:
    """Bytes per category that this rank keeps between steps (the paper's model states)."""
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    return {"params": sum(nbytes(g.param_flat) for g in engine.groups.values()),
            "grads": sum(nbytes(g.grads) for g in engine.groups.values()),
            "master_params": engine._master_bytes(),
            "optimizer_states": engine.optimizer_state_bytes()}
