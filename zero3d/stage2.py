"""Stage 2 (Pos+g): gradients reduced bucket by bucket during backward; each rank keeps only its shard."""
import torch

from zero3d.buckets import GradientBuckets
from zero3d.engine import DataParallelEngine, GroupState
from zero3d.flat import FlatLayout, flatten_params
from zero3d.stage0 import model_state_bytes
from zero3d.stage1 import gather_params, sharded_master


class GradientShardedEngine(DataParallelEngine):
    """Parameters whole; gradients and optimizer states partitioned; reduction overlaps backward."""

    stage = 2

    def __init__(self, model, settings, groups):
        super().__init__(model, settings, groups)
        self.buckets = GradientBuckets(self, list(self.groups.values()), overlap=settings.overlap_comm)
        self._tied_grads = {}  # tied weight -> its gradient of this step, summed over copies at the end
        for p in self.buckets.location:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _build_group(self, name, named_params):
        layout = FlatLayout(named_params, self.dp.size)
        params = [p for _, p in named_params]
        g = GroupState(name, layout, params, buckets=tuple(layout.buckets(self.settings.bucket_elements)))
        g.param_flat = flatten_params(layout, params, self.settings.dtype, self.device)
        g.grads = torch.zeros(layout.shard_numel, dtype=self.settings.dtype, device=self.device)
        g.master = sharded_master(g.param_flat, layout, self.dp.rank)
        g.norm_ranges = self._norm_ranges(layout, offset=0)
        return g

    @property
    def staging_bytes_peak(self) -> int:
        return self.buckets.staging_bytes_peak

    def _on_grad_ready(self, param):
        if param in self.tied:  # held whole until summed over its group (finish_backward)
            held = self._tied_grads.get(param)
            self._tied_grads[param] = param.grad if held is None else held.add_(param.grad)
            param.grad = None
            return
        self.buckets.add(param)

    def finish_backward(self):
        for p, comm in self.tied.items():
            grad = self._tied_grads.pop(p, None)
            p.grad = torch.zeros_like(p) if grad is None else grad
            comm.all_reduce(p.grad, tag="tied_grads")
            self.buckets.add(p)
        self.buckets.flush()

    def _sum_tied_grads(self):
        pass  # done per micro-batch in finish_backward, before bucketing

    def _reduce_grads(self):
        pass  # done during backward

    def _master_grad(self, g):
        return self._as_fp32(g.grads)

    def _publish_params(self):
        gather_params(self)

    def zero_grad(self):
        for g in self.groups.values():
            g.grads.zero_()
            for p in g.params:
                p.grad = None

    def state_bytes(self):
        return model_state_bytes(self)
