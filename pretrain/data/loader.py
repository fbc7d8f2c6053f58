"""Which samples each rank reads, step by step, and how they are loaded (DataLoader workers, pinned memory)."""
from typing import Iterator, Optional

import torch

from pretrain.data.batch import collate, to_device
from pretrain.sections import DataConfig, TrainConfig

CUDA_WORKERS = 2  # data.num_workers unset: DataLoader workers per rank on CUDA (0 on CPU)


class _Samples(torch.utils.data.Dataset):
    """Any object with sample(i) as a map-style dataset, for the DataLoader."""

    def __init__(self, source):
        self.source = source

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.source.sample(index)


class _Plan:
    """The sample indices of every (step, micro-batch) from a given one to the end of the run, in order."""

    def __init__(self, batches: "Batches", step: int, micro_index: int):
        self.batches, self.step, self.micro_index = batches, step, micro_index

    def keys(self) -> Iterator[tuple[int, int]]:
        for step in range(self.step, self.batches.last_step):
            for micro in range(self.micro_index if step == self.step else 0, self.batches.grad_accum):
                yield step, micro

    def __iter__(self) -> Iterator[list[int]]:
        return (self.batches.indices(step, micro) for step, micro in self.keys())


class Batches:
    """Step s reads samples [p + (s - start_step)·G, p + (s - start_step + 1)·G) of the shuffled stream,
    p = consumed_samples at start_step, G the global batch, split by (DP rank, micro-batch), so any
    (TP, DP, accumulation) layout sees the same global batch.

    A fresh run starts at consumed_samples = 0, start_step = 0. A resumed run passes the checkpoint's
    step and the position(step) saved with it, and continues with the next sample, not the first.
    The dataset only needs sample(i) -> the seq_length+1 tokens of sample i.
    """

    def __init__(self, dataset, train: TrainConfig, data: DataConfig, topo, consumed_samples: int = 0,
                 start_step: int = 0):
        if consumed_samples < 0 or start_step < 0:
            raise ValueError(f"consumed_samples {consumed_samples} and start_step {start_step} must be >= 0")
        self.dataset, self.topo = dataset, topo
        self.global_batch, self.micro = train.global_batch_size, train.micro_batch_size
        self.grad_accum, self.last_step = topo.grad_accum, train.steps
        self.consumed_samples, self.start_step = consumed_samples, start_step
        on_cuda = topo.device.type == "cuda"
        workers = data.num_workers
        self.num_workers = (CUDA_WORKERS if on_cuda else 0) if workers is None else workers
        self.pin_memory = data.pin_memory and on_cuda
        self._loader: Optional[Iterator[torch.Tensor]] = None
        self._next: Optional[Iterator[tuple[int, int]]] = None
        self._expected: Optional[tuple[int, int]] = None

    def position(self, step: int) -> int:
        """Samples consumed before step `step` runs: what a checkpoint saved after `step` steps stores."""
        return self.consumed_samples + (step - self.start_step) * self.global_batch

    def indices(self, step: int, micro_index: int) -> list[int]:
        first = self.position(step) + (self.topo.dp_rank * self.grad_accum + micro_index) * self.micro
        return list(range(first, first + self.micro))

    def get(self, step: int, micro_index: int):
        """This rank's micro-batch on its device: the (micro_batch_size, seq_length + 1) tokens, or with
        document boundaries a dict of them and their per-sample fields (pretrain/data/batch.py)."""
        if self.num_workers == 0 and not self.pin_memory:
            return to_device(collate([self.dataset.sample(i) for i in self.indices(step, micro_index)]),
                             self.topo.device)
        if (step, micro_index) != self._expected:  # first call, or out of order: restart the loader there
            self._start_loader(step, micro_index)
        batch = next(self._loader)
        self._expected = next(self._next, None)
        return to_device(batch, self.topo.device, non_blocking=self.pin_memory)

    def close(self) -> None:
        """End the DataLoader workers now (a loader left to the garbage collector can stall up to 5 s a worker
        in its shutdown's join; seen with gloo's threads in the process)."""
        shutdown = getattr(self._loader, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self._loader, self._expected = None, None

    def _start_loader(self, step: int, micro_index: int) -> None:
        self.close()  # the previous stream's workers, if any
        plan = _Plan(self, step, micro_index)
        if step >= self.last_step:  # past the configured run (an extra evaluation or test): one batch
            plan = [self.indices(step, micro_index)]
        loader = torch.utils.data.DataLoader(_Samples(self.dataset), batch_sampler=plan,
                                             num_workers=self.num_workers, pin_memory=self.pin_memory)
        self._loader = iter(loader)
        self._next = plan.keys() if isinstance(plan, _Plan) else iter(())
        self._expected = next(self._next, None)
