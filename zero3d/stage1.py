"""Stage 1 (Pos): optimizer states and fp32 master weights partitioned over the DP group."""
from zero3d.comm.core import wait_all
from zero3d.whole_params import WholeParamsEngine


class OptimizerShardedEngine(WholeParamsEngine):
    """Full parameters and gradients on every rank; master weights and Adam moments for one shard.

    Per step: one reduce-scatter per bucket of the gradient buffer (in place), the optimizer on
    this rank's pieces, one all-gather per bucket of the parameters (zero3d/whole_params.py)."""

    stage = 1
    full_grads = True

    def _reduce_grads(self):
        """One reduce-scatter per bucket of the whole gradient buffer, each rank's piece reduced where
        it lies (no copy); then the pieces are post-divided."""
        self._sum_tied_grads()
        handles = []
        for group in self.groups.values():
            if self.pre_scale != 1.0:
                group.grads.mul_(self.pre_scale)
            for bucket, lo, hi in group.layout.pieces(self.dp.rank):
                handles.append(self.dp.reduce_scatter(group.grads[lo:hi], group.grads[bucket.start:bucket.end],
                                                      tag="grads", async_op=True))
        wait_all(handles)
        self.plan.sum_across_replicas([group.grads[lo:hi]  # hybrid: each piece over its replicas on the other nodes
                                       for group in self.groups.values() for _, lo, hi in group.layout.pieces(self.dp.rank)])
        if self.post_scale != 1.0:
            for group in self.groups.values():
                for _, lo, hi in group.layout.pieces(self.dp.rank):
                    group.grads[lo:hi].mul_(self.post_scale)

    def _master_grad(self, group):
        """This rank's shard of the reduced gradient: its pieces of the whole buffer, in shard order, those adjacent
        there as one (a single rank's are the whole buffer)."""
        ranges = []
        for _, start, end in group.layout.pieces(self.dp.rank):
            if ranges and ranges[-1][1] == start:
                ranges[-1][1] = end
            else:
                ranges.append([start, end])
        return self.placement.master_grad(group.name, [group.grads[lo:hi] for lo, hi in ranges])
