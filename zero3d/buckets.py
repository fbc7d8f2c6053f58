"""Backward-time gradient reduction (stages 2 and 3): gradients staged per bucket, reduced to their owners."""
from dataclasses import dataclass, field
from typing import Optional

import torch

from zero3d.engine import GroupState, wait_all
from zero3d.flat import Bucket
from zero3d.stage1 import reduce_to_owners

MAX_BUCKETS_IN_FLIGHT = 2  # staging memory stays within a few buckets, whatever the model size


@dataclass
class BucketRun:
    """One bucket during one backward: its staging buffer and which gradients are still missing."""

    group: GroupState
    bucket: Bucket
    missing: set
    staging: Optional[torch.Tensor] = None
    handles: list = field(default_factory=list)


class GradientBuckets:
    """Each arriving gradient is added into its bucket's staging buffer and freed; a complete bucket
    is reduced to the ranks owning its elements (asynchronously when `overlap`), and on completion
    each rank adds its piece, ÷N_d, into the group's gradient shard (so micro-batches accumulate).

    A launched bucket is replaced by a fresh one at once, so a bucket may complete once per
    micro-batch inside a pipeline schedule that calls flush() only at the end of the step."""

    def __init__(self, engine, groups: list[GroupState], overlap: bool):
        self.engine, self.groups, self.overlap = engine, groups, overlap
        self.location = {}  # param -> (group name, slot index, bucket index)
        for g in groups:
            for b in g.buckets:
                for i in b.slot_indices:
                    self.location[g.params[i]] = (g.name, i, b.index)
        self.staging_bytes_peak = 0
        self.reset()

    def reset(self) -> None:
        self.runs = {g.name: [BucketRun(g, b, set(b.slot_indices)) for b in g.buckets] for g in self.groups}
        self.in_flight: list[BucketRun] = []

    def add(self, param: torch.Tensor) -> None:
        """Stage `param.grad` (then drop it: the full-size gradient does not outlive its bucket)."""
        name, slot_index, bucket_index = self.location[param]
        run = self.runs[name][bucket_index]
        slot = run.group.layout.slots[slot_index]
        self._staging(run)[slot.start - run.bucket.start:slot.end - run.bucket.start] += param.grad.view(-1)
        param.grad = None
        run.missing.discard(slot_index)
        if not run.missing:
            self.runs[name][bucket_index] = BucketRun(run.group, run.bucket, set(run.bucket.slot_indices))
            self._launch(run)

    def flush(self) -> None:
        """End of backward: buckets holding gradients of a partly used bucket reduce now, in a fixed
        order (the DP ranks run the same graph, so they agree on which); then wait for all."""
        for runs in self.runs.values():
            for run in runs:
                if run.staging is not None:
                    self._launch(run)
        while self.in_flight:
            self._finish(self.in_flight.pop(0))
        self.reset()

    def _staging(self, run: BucketRun) -> torch.Tensor:
        if run.staging is None:
            run.staging = torch.zeros(run.bucket.numel, dtype=run.group.grads.dtype, device=run.group.grads.device)
            live = sum(r.staging.numel() * r.staging.element_size()
                       for runs in self.runs.values() for r in runs if r.staging is not None)
            self.staging_bytes_peak = max(self.staging_bytes_peak, live)
        return run.staging

    def _launch(self, run: BucketRun) -> None:
        b = run.bucket
        run.handles = reduce_to_owners(self.engine, run.group, self._staging(run), b.start, b.end, self.overlap)
        self.in_flight.append(run)
        while len(self.in_flight) > MAX_BUCKETS_IN_FLIGHT:
            self._finish(self.in_flight.pop(0))

    def _finish(self, run: BucketRun) -> None:
        wait_all(run.handles)
        g, b = run.group, run.bucket
        dp = self.engine.dp
        s0, s1 = g.layout.shard_range(dp.rank)
        lo, hi = max(b.start, s0), min(b.end, s1)
        if lo < hi:
            g.grads[lo - s0:hi - s0].add_(run.staging[lo - b.start:hi - b.start], alpha=1.0 / dp.size)
        run.staging = None
