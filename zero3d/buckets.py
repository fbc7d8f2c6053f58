"""Backward-time gradient reduction (stages 2 and 3): one reduce-scatter per bucket, straight from its buffer."""
import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from zero3d.comm.plan import CommPlan
from zero3d.engine import GroupState
from zero3d.flat import Bucket

MAX_BUCKETS_IN_FLIGHT = 2  # gradient buffers stay within a few buckets, whatever the model size


@dataclass
class BucketRun:
    """One bucket during one backward: its gradient buffer and which gradients are still missing."""

    group: GroupState
    bucket: Bucket
    missing: set
    grads: Optional[torch.Tensor] = None  # the bucket's padded gradient buffer, model dtype
    handle: object = None


class GradientBuckets:
    """Gradients land in their bucket's buffer: each parameter's gradient, as autograd hands it over, is copied
    into its slot (added, when the slot already holds one of this bucket's run: a pipeline schedule's next
    micro-batch while a partly used bucket waits), and the slots no gradient reached and the padding are zeroed
    at launch — no buffer is zero-filled to be added into (a write and a read an element fewer). A complete bucket
    is pre-divided (× `pre_scale`), reduce-scattered in place as `plan` has it (asynchronously when
    `overlap`, on `stream` when given) and, on completion, this rank's piece is handed to
    `deliver(group, shard offset, piece)`, which adds it into the group's gradient shard, so
    micro-batches accumulate. Parameters in `held_elsewhere` (tied weights: their gradient is a partial sum
    over another group) never get a `.grad` view of a bucket buffer: `hold` keeps their gradients whole until
    `add_held` sums each over its group and adds it here.

    A launched bucket is replaced by a fresh one at once, so a bucket may complete once per
    micro-batch inside a pipeline schedule that launches the rest only at the end of the step.

    Launch order: every DP rank must issue the same reduce-scatters in the same order, and the order gradients
    arrive in is not always the same on every rank (a compiled layer hands autograd all its gradients at once,
    in an order that follows its graph, and a graph can differ between ranks: megatron warns on rank 0 only from
    inside its layers, a graph break there alone). So complete buckets launch in one fixed order, `launch_order`:
    by their earliest parameter in the model's order (`position`), latest first — the order eager backward
    completes them in, so an eager run never waits — each once every bucket before it has launched; a bucket that
    completes early waits for those (at most until the end of backward). Buckets holding a `held_elsewhere`
    parameter complete in `add_held`, in its fixed order, outside that sequence."""

    def __init__(self, groups: list[GroupState], plan: CommPlan, deliver: Callable[[GroupState, int, torch.Tensor], None],
                 *, dtype: torch.dtype, device: torch.device, pre_scale: float, held_elsewhere: frozenset,
                 overlap: bool, position: dict, stream=None):
        """`position`: {param: its index in the model's parameters}, the same on every DP rank."""
        self.groups, self.plan, self.deliver = groups, plan, deliver
        self.rank = plan.shard.rank  # this rank's piece of every bucket
        self.dtype, self.device, self.pre_scale, self.held_elsewhere = dtype, device, pre_scale, held_elsewhere
        self.overlap, self.stream = overlap, stream
        self.location = {}  # param -> (group name, slot index, bucket index)
        for group in groups:
            for bucket in group.buckets:
                for i in bucket.slot_indices:
                    self.location[group.params[i]] = (group.name, i, bucket.index)
        self.buffer_bytes_peak = 0
        self.in_flight: list[BucketRun] = []
        self.held: dict = {}  # held_elsewhere param -> its gradient so far (this step's micro-batches summed)
        self.launch_order = launch_order(groups, position, held_elsewhere)
        self._in_order = set(self.launch_order)
        self._next = 0  # launch_order's next bucket to launch
        self._ready: dict = {}  # (group name, bucket index) -> its complete run, waiting for its turn
        self._new_runs()

    def _new_runs(self) -> None:
        self.runs = {group.name: [BucketRun(group, bucket, set(bucket.slot_indices)) for bucket in group.buckets]
                     for group in self.groups}

    def add(self, param: torch.Tensor, grad: Optional[torch.Tensor] = None) -> None:
        """`param.grad` (or `grad`) is in: add it to its bucket's buffer unless it already lives there, drop it."""
        self.plan.stats.poll()
        grad = param.grad if grad is None else grad
        name, slot_index, bucket_index = self.location[param]
        run = self.runs[name][bucket_index]
        view = self._slot_view(run, slot_index)
        if slot_index in run.missing:
            view.copy_(grad.view(-1))
        else:
            view += grad.view(-1)
        param.grad = None
        run.missing.discard(slot_index)
        if not run.missing:
            self.runs[name][bucket_index] = BucketRun(run.group, run.bucket, set(run.bucket.slot_indices))
            if (name, bucket_index) not in self._in_order:  # holds a held_elsewhere gradient: add_held's turn
                self._launch(run)
                return
            self._ready[name, bucket_index] = run
            self._launch_in_turn()

    def _launch_in_turn(self) -> None:
        """The complete buckets whose turn has come, in launch_order (from its start again once it is through)."""
        while self._next < len(self.launch_order) and self.launch_order[self._next] in self._ready:
            self._launch(self._ready.pop(self.launch_order[self._next]))
            self._next += 1
        if self._next == len(self.launch_order):
            self._next = 0

    def hold(self, param: torch.Tensor) -> None:
        """A held_elsewhere parameter's `.grad` is in: kept whole (added to what it already holds), dropped."""
        held = self.held.get(param)
        self.held[param] = param.grad if held is None else held.add_(param.grad)
        param.grad = None

    def add_held(self, tied: dict) -> None:
        """End of backward, for each {param: Comm} in a fixed order (every rank of each group agrees): its held
        gradient (zeros if none arrived) summed over its group, then added to its bucket."""
        for param, comm in tied.items():
            name, slot_index, bucket_index = self.location[param]
            grad = self.held.pop(param, None)
            if grad is None:
                slot = self.runs[name][bucket_index].group.layout.slots[slot_index]
                grad = torch.zeros(slot.shape, dtype=self.dtype, device=self.device)
            comm.all_reduce(grad, tag="tied_grads")
            self.add(param, grad)

    def launch_remaining(self) -> None:
        """End of backward: the complete buckets still waiting for their turn (in launch_order), then those holding
        gradients of a partly used bucket, reduce now, in a fixed order (the DP ranks agree on which)."""
        for key in self.launch_order:
            if key in self._ready:
                self._launch(self._ready.pop(key))
        self._next = 0
        for runs in self.runs.values():
            for run in runs:
                if run.grads is not None:
                    self._launch(run)
        self._new_runs()

    def wait(self) -> None:
        """Every launched bucket reduced and added into its shard."""
        while self.in_flight:
            self._finish(self.in_flight.pop(0))

    def _slot_view(self, run: BucketRun, slot_index: int) -> torch.Tensor:
        slot = run.group.layout.slots[slot_index]
        return self._buffer(run)[slot.start - run.bucket.start:slot.end - run.bucket.start]

    def _buffer(self, run: BucketRun) -> torch.Tensor:
        """The bucket's gradient buffer, unfilled: every slot is written by its gradient or zeroed at launch."""
        if run.grads is None:
            # The compute dtype on the device (the shard it lands in may be an fp32 host one: offload).
            run.grads = torch.empty(run.bucket.numel, dtype=self.dtype, device=self.device)
            live = sum(open_run.grads.numel() * open_run.grads.element_size()
                       for runs in self.runs.values() for open_run in runs if open_run.grads is not None)
            live += sum(launched.grads.numel() * launched.grads.element_size() for launched in self.in_flight)
            self.buffer_bytes_peak = max(self.buffer_bytes_peak, live)
        return run.grads

    def _launch(self, run: BucketRun) -> None:
        group, bucket = run.group, run.bucket
        buffer = self._buffer(run)
        for i in run.missing:  # parameters no gradient reached (unused in this backward): zeros
            self._slot_view(run, i).zero_()
        buffer[max(group.layout.slots[i].end for i in bucket.slot_indices) - bucket.start:].zero_()  # padding
        lo, hi = bucket.piece(self.rank)
        with self._on_stream(buffer):
            if self.pre_scale != 1.0:
                buffer.mul_(self.pre_scale)
            piece = buffer[lo - bucket.start:hi - bucket.start]  # reduced in place
            run.handle = self.plan.reduce_scatter(piece, buffer, self.overlap)
        self.in_flight.append(run)
        while len(self.in_flight) > MAX_BUCKETS_IN_FLIGHT:
            self._finish(self.in_flight.pop(0))

    def _on_stream(self, buffer: torch.Tensor):
        """Stage 3 on GPU: the reduction runs on the side stream, after the gradients it reads."""
        if self.stream is None:
            return contextlib.nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream(buffer.device))
        buffer.record_stream(self.stream)
        return torch.cuda.stream(self.stream)

    def _finish(self, run: BucketRun) -> None:
        if run.handle is not None:
            run.handle.wait()
        if self.stream is not None:
            torch.cuda.current_stream(run.grads.device).wait_stream(self.stream)
        bucket = run.bucket
        lo, hi = bucket.piece(self.rank)
        self.deliver(run.group, bucket.shard_start, run.grads[lo - bucket.start:hi - bucket.start])
        run.grads = None


def launch_order(groups: list[GroupState], position: dict, held_elsewhere: frozenset) -> list[tuple]:
    """[(group name, bucket index)]: the buckets without a held_elsewhere parameter, latest earliest parameter
    (in `position`) first: the order eager backward completes them in."""
    keyed = []
    for group in groups:
        for bucket in group.buckets:
            params = [group.params[i] for i in bucket.slot_indices]
            if not any(p in held_elsewhere for p in params):
                keyed.append((-min(position[p] for p in params), group.name, bucket.index))
    return [(name, index) for _, name, index in sorted(keyed)]
