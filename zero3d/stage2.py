"""Stage 2 (Pos+g): gradients reduced bucket by bucket during backward; each rank keeps only its shard."""
from dataclasses import dataclass, field
from typing import Optional

import torch

from zero3d.engine import DataParallelEngine, GroupState, wait_all
from zero3d.flat import Bucket, FlatLayout, flatten_params
from zero3d.stage0 import model_state_bytes
from zero3d.stage1 import gather_params, reduce_to_owners, sharded_master

MAX_BUCKETS_IN_FLIGHT = 2  # staging memory stays within a few buckets, whatever the model size


@dataclass
class BucketRun:
    """One bucket during one backward: its staging buffer and which gradients are still missing."""

    group: GroupState
    bucket: Bucket
    missing: set
    staging: Optional[torch.Tensor] = None
    handles: list = field(default_factory=list)
    launched: bool = False


class GradientShardedEngine(DataParallelEngine):
    """Parameters whole; gradients and optimizer states partitioned; reduction overlaps backward."""

    stage = 2

    def __init__(self, model, settings, groups):
        self._owner_of = {}  # param -> (group name, slot index, bucket index)
        self.staging_bytes_peak = 0
        super().__init__(model, settings, groups)
        for name, g in self.groups.items():
            for b in g.buckets:
                for i in b.slot_indices:
                    self._owner_of[g.params[i]] = (name, i, b.index)
                    g.params[i].register_post_accumulate_grad_hook(self._on_grad_ready)
        self._new_runs()

    def _build_group(self, name, named_params):
        layout = FlatLayout(named_params, self.dp.size)
        params = [p for _, p in named_params]
        g = GroupState(name, layout, params, buckets=tuple(layout.buckets(self.settings.bucket_elements)))
        g.param_flat = flatten_params(layout, params, self.settings.dtype, self.device)
        g.grads = torch.zeros(layout.shard_numel, dtype=self.settings.dtype, device=self.device)
        g.master = sharded_master(g.param_flat, layout, self.dp.rank)
        g.norm_ranges = self._norm_ranges(layout, offset=0)
        return g

    # ------------------------------------------------------------ backward-time reduction

    def _new_runs(self):
        self._runs = {name: [BucketRun(g, b, set(b.slot_indices)) for b in g.buckets]
                      for name, g in self.groups.items()}
        self._in_flight: list[BucketRun] = []

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        name, slot_index, bucket_index = self._owner_of[param]
        run = self._runs[name][bucket_index]
        if run.launched:
            raise RuntimeError(f"gradient of {run.group.layout.slots[slot_index].name} arrived after its "
                               "bucket was reduced (a parameter used in two separate backward passes)")
        slot = run.group.layout.slots[slot_index]
        self._staging(run)[slot.start - run.bucket.start:slot.end - run.bucket.start] += param.grad.view(-1)
        param.grad = None  # the full-size gradient does not outlive its bucket
        run.missing.discard(slot_index)
        if not run.missing:
            self._launch(run)

    def _staging(self, run: BucketRun) -> torch.Tensor:
        if run.staging is None:
            run.staging = torch.zeros(run.bucket.numel, dtype=self.settings.dtype, device=self.device)
            live = sum(r.staging.numel() * r.staging.element_size()
                       for runs in self._runs.values() for r in runs if r.staging is not None)
            self.staging_bytes_peak = max(self.staging_bytes_peak, live)
        return run.staging

    def _launch(self, run: BucketRun) -> None:
        run.launched = True
        b = run.bucket
        run.handles = reduce_to_owners(self, run.group, self._staging(run), b.start, b.end,
                                       async_op=self.settings.overlap_comm)
        self._in_flight.append(run)
        while len(self._in_flight) > MAX_BUCKETS_IN_FLIGHT:
            self._finish(self._in_flight.pop(0))

    def _finish(self, run: BucketRun) -> None:
        """Wait for a bucket's reduction, add this rank's piece into its gradient shard, free staging."""
        wait_all(run.handles)
        g, b = run.group, run.bucket
        s0, s1 = g.layout.shard_range(self.dp.rank)
        lo, hi = max(b.start, s0), min(b.end, s1)
        if lo < hi:
            g.grads[lo - s0:hi - s0].add_(run.staging[lo - b.start:hi - b.start], alpha=1.0 / self.dp.size)
        run.staging = None

    def backward(self, loss):
        super().backward(loss)
        # Buckets whose parameters got no gradient (unused in this pass) still reduce, in a fixed
        # order, so every rank issues the same collectives.
        for runs in self._runs.values():
            for run in runs:
                if not run.launched:
                    self._launch(run)
        while self._in_flight:
            self._finish(self._in_flight.pop(0))
        self._new_runs()

    # ------------------------------------------------------------ step

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

