"""Stage 2 (Pos+g): gradients reduced bucket by bucket during backward; each rank keeps only its shard."""
import torch

from zero3d.buckets import GradientBuckets
from zero3d.engine import DataParallelEngine
from zero3d.shard import model_state_bytes, publish_params, register_param_sync_hooks, sharded_group


class GradientShardedEngine(DataParallelEngine):
    """Parameters whole; gradients and optimizer states partitioned; reduction overlaps backward."""

    stage = 2

    def __init__(self, model, settings, groups):
        super().__init__(model, settings, groups)
        self.buckets = GradientBuckets(self, list(self.groups.values()), overlap=settings.zero.overlap_comm)
        self._tied_grads = {}  # tied weight -> its gradient of this step, summed over copies at the end
        for param in self.buckets.location:
            param.register_post_accumulate_grad_hook(self._on_grad_ready)
        register_param_sync_hooks(self)

    def _build_group(self, name, named_params):
        return sharded_group(self, name, named_params, full_grads=False)

    @property
    def staging_bytes_peak(self) -> int:
        """Most bytes of bucket gradient buffers alive at once."""
        return self.buckets.buffer_bytes_peak

    def _on_grad_ready(self, param):
        if param in self.tied:  # held whole until summed over its group (finish_backward)
            held = self._tied_grads.get(param)
            self._tied_grads[param] = param.grad if held is None else held.add_(param.grad)
            param.grad = None
            return
        self.buckets.add(param)

    def finish_backward(self):
        """Tied gradients summed over their group and bucketed; the partly used buckets launched.
        The reductions still in flight complete in step()."""
        for param, comm in self.tied.items():
            grad = self._tied_grads.pop(param, None)
            param.grad = torch.zeros_like(param) if grad is None else grad
            comm.all_reduce(param.grad, tag="tied_grads")
            self.buckets.add(param)
        self.buckets.launch_remaining()

    def _reduce_grads(self):
        self.buckets.wait()

    def _grads_reduced_in_buckets(self, name):
        return True

    def _master_grad(self, group):
        return self._as_fp32(group.grads)

    def _publish_params(self):
        publish_params(self, overlap=self.settings.zero.overlap_param_gather)

    def zero_grad(self):
        for group in self.groups.values():
            group.grads.zero_()
            for param in group.params:
                param.grad = None

    def _state_bytes(self):
        return model_state_bytes(self)
