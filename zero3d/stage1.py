"""Stage 1 (Pos): optimizer states and fp32 master weights partitioned over the DP group."""
from zero3d.engine import DataParallelEngine
from zero3d.shard import (model_state_bytes, publish_params, reduce_scatter_in_place, register_param_sync_hooks,
                          sharded_group)


class OptimizerShardedEngine(DataParallelEngine):
    """Full parameters and gradients on every rank; master weights and Adam moments for one shard.

    Per step: one reduce-scatter per bucket of the gradient buffer (in place), the optimizer on
    this rank's pieces, one all-gather per bucket of the parameters, left in flight until the
    next forward reaches the bucket's first module (`zero.overlap_param_gather`)."""

    stage = 1

    def __init__(self, model, settings, groups):
        super().__init__(model, settings, groups)
        register_param_sync_hooks(self)

    def _build_group(self, name, named_params):
        return sharded_group(self, name, named_params, full_grads=True)

    def _reduce_grads(self):
        self._sum_tied_grads()
        reduce_scatter_in_place(self, list(self.groups.values()))

    def _master_grad(self, group):
        return self._as_fp32(group.layout.shard_of(group.grads, self.dp.rank))

    def _publish_params(self):
        publish_params(self, overlap=self.settings.zero.overlap_param_gather)

    def zero_grad(self):
        for group in self.groups.values():
            group.grads.zero_()

    def _state_bytes(self):
        return model_state_bytes(self)
