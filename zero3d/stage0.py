"""Stage 0: plain data parallelism — replicated states, gradients all-reduced in constant-size buckets."""
from zero3d.engine import DataParallelEngine
from zero3d.shard import all_reduce_replicated, model_state_bytes, replicated_group


class ReplicatedEngine(DataParallelEngine):
    """Every DP rank keeps full parameters, gradients, fp32 master weights and optimizer states."""

    stage = 0

    def _build_group(self, name, named_params):
        return replicated_group(self, name, named_params)

    def _reduce_grads(self):
        self._sum_tied_grads()
        all_reduce_replicated(self, list(self.groups.values()))

    def _master_grad(self, group):
        return self._as_fp32(group.grads)

    def _publish_params(self):
        for group in self.groups.values():
            master = group.master_pieces[0][1]
            if master is not group.param_flat:
                group.param_flat.copy_(master)

    def zero_grad(self):
        for group in self.groups.values():
            group.grads.zero_()

    def _state_bytes(self):
        return model_state_bytes(self)
