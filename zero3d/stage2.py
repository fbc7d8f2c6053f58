"""Stage 2 (Pos+g): gradients reduced bucket by bucket during backward; each rank keeps only its shard."""
from zero3d.buckets import GradientBuckets
from zero3d.whole_params import WholeParamsEngine


class GradientShardedEngine(WholeParamsEngine):
    """Parameters whole; gradients and optimizer states partitioned; reduction overlaps backward."""

    stage = 2
    full_grads = False

    def __init__(self, model, settings, groups):
        super().__init__(model, settings, groups)
        self.buckets = GradientBuckets(list(self.groups.values()), self.plan, self._deliver_grad_piece,
                                       dtype=settings.dtype, device=self.device, pre_scale=self.pre_scale,
                                       held_elsewhere=frozenset(self.tied), overlap=settings.zero.overlap_comm,
                                       position={p: i for i, p in enumerate(model.parameters())})
        for param in self.buckets.location:
            self.hooks.append(param.register_post_accumulate_grad_hook(self._on_grad_ready))

    def forward(self, *args, **kwargs):
        """The previous micro-batch's last reductions delivered first: their buffers (the embedding's bucket is the
        size of its gradient) are not held through this forward and backward (the Llama-3 8B slice: 1.13 GB)."""
        self.buckets.wait()  # delivered before the forward
        return super().forward(*args, **kwargs)

    __call__ = forward

    @property
    def staging_bytes_peak(self) -> int:
        """Most bytes of bucket gradient buffers alive at once."""
        return self.buckets.buffer_bytes_peak

    def _on_grad_ready(self, param):
        if param in self.tied:  # held whole until summed over its group (finish_backward)
            self.buckets.hold(param)
        else:
            self.buckets.add(param)

    def finish_backward(self):
        """Tied gradients summed over their group and bucketed; the partly used buckets launched.
        The reductions still in flight complete in step()."""
        self.buckets.add_held(self.tied)
        self.buckets.launch_remaining()

    def _reduce_grads(self):
        self.buckets.wait()
        self._all_reduce_shards_across_nodes(list(self.groups.values()))

    def zero_grad(self):
        super().zero_grad()
        for group in self.groups.values():
            for param in group.params:
                param.grad = None
