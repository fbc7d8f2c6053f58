"""Stage 0: plain data parallelism — replicated states, gradients all-reduced in constant-size buckets."""
from zero3d.engine import DataParallelEngine


class ReplicatedEngine(DataParallelEngine):
    """Every DP rank keeps full parameters, gradients, fp32 master weights and optimizer states."""

    stage = 0

    def _build_group(self, name, named_params, decays, matrix=False):
        return self._replicated_group(name, named_params, decays, matrix)

    def _reduce_grads(self):
        self._sum_tied_grads()
        self._all_reduce_replicated(list(self.groups.values()))

    def _publish_params(self):
        for group in self.groups.values():
            master = group.master_pieces[0][1]
            if master is not group.param_flat:
                group.param_flat.copy_(master)
