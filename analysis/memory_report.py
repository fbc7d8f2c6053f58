"""One rank's device memory as a run's start-up check and `--estimate` print it: the estimate, what offload moves to
the host, and the table; `RankJob` holds the rank (pretrain/memory_check.py reads it from a config once)."""
from dataclasses import dataclass
from typing import Optional

from analysis.estimate import MemoryBreakdown, estimate, format_breakdown
from analysis.job import Budget, Parallelism, Step, ZeroChoice
from analysis.model_states import OptimizerStates
from analysis.offload_estimate import OffloadBreakdown, format_offload, offload_breakdown
from model_shape.gpt import GPTShape


@dataclass(frozen=True)
class RankJob:
    """One rank of a run, as the estimator takes it."""

    shape: GPTShape  # one pipeline stage's layers
    layout: Parallelism
    zero: ZeroChoice
    step: Step
    budget: Budget
    optimizer: OptimizerStates

    def describe(self) -> str:
        """The job in a line, the table's header: the whole model, the ranks and their degrees, ZeRO, the step, the
        optimizer."""
        shape, layout, pp = self.shape, self.layout, self.layout.pp
        cp = f" × CP {layout.cp}" if layout.cp > 1 else ""
        return (f"{shape.layers * pp} layers × hidden {shape.hidden}, seq {shape.seq}; "
                f"{layout.gpus * pp} ranks = TP {layout.tp} × PP {pp}{cp} × DP {layout.dp // layout.cp}; "
                f"ZeRO stage {self.zero.stage}, micro-batch {self.step.micro_batch}, {self.step.precision}; "
                f"{self.optimizer.name}, {self.optimizer.state_dtype} states")

    def whole(self) -> MemoryBreakdown:
        """The model states' estimate with nothing offloaded (what a checkpoint holds)."""
        return estimate(self.shape, self.layout, self.zero, self.step, self.budget, self.optimizer)


def device_memory(job: RankJob) -> tuple[MemoryBreakdown, Optional[OffloadBreakdown]]:
    """(what stays on the device, OffloadBreakdown or None): with zero.offload_* on, only the device's bytes are
    judged against the budget."""
    whole = job.whole()
    if job.zero.offload_optimizer == "none" and job.zero.offload_params == "none":
        return whole, None
    offload = offload_breakdown(whole, job.layout, job.zero, job.step.precision, job.step.accumulation,
                                job.optimizer)
    return offload.device, offload


def memory_table(on_device: MemoryBreakdown, offload: Optional[OffloadBreakdown], header: str, device: str,
                 cpu_note: Optional[str] = None) -> str:
    """The breakdown, its verdict (or, on CPU ranks, `cpu_note` last instead) and where offload put states."""
    table = format_breakdown(on_device, header, device=device)
    if cpu_note is not None:
        table = table.rsplit("\n", 1)[0]
    return "\n".join([table] + ([format_offload(offload)] if offload else []) + ([cpu_note] if cpu_note else []))


def device_report(job: RankJob, device: str, cpu_note: Optional[str] = None) -> tuple:
    """(what stays on the device, its table headed by the job's line): device_memory, then memory_table."""
    on_device, offload = device_memory(job)
    return on_device, memory_table(on_device, offload, job.describe(), device, cpu_note)
