"""One training step, the loop's and the probe's: micro-batches forward and backward, the engine's step with the step sums."""
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

import zero3d
from pretrain.config import Config
from pretrain.data.batch import collate, loss_tokens, to_device
from pretrain.data.loader import Batches
from pretrain.model.gpt import gpt_loss
from pretrain.pipeline import pipeline_micro_batches
from pretrain.runtime.layout import Layout
from pretrain.runtime.phases import NO_CLOCK
from pretrain.schedule import lr_at


class StepOutcome(NamedTuple):
    """What a training step tells the loop (a tuple: `loss, result, stopping, written = train_step(...)`)."""

    loss: float  # the step's mean loss over micro-batches and DP ranks (step_mean_loss)
    result: zero3d.StepResult  # the engine's: gradient norm, skipped, loss scale, the summed step sums
    stopping: bool  # a stop was requested on some rank: every rank stops after this step
    written: bool  # every rank's part of the pending asynchronous save is on disk


def never() -> bool:
    return False


def no_phase(phase: str) -> None:
    """The loop marks no phases; the probe's hook moves its StepPhases."""


def train_step(engine, batches: Batches, step: int, cfg: Config, topo: Layout,
               stop_requested: Callable[[], bool] = never, save_written: Callable[[], bool] = never,
               on_phase: Callable[[str], None] = no_phase, clock=NO_CLOCK) -> StepOutcome:
    """One optimizer step over grad_accum micro-batches (forward_backward, then finish_step). `on_phase` is
    called with "reduction" before the engine's step and "idle" after it (the probe's phase names); `clock` (the
    loop's PhaseClock) is told each phase the step enters."""
    losses = forward_backward(engine, batches, step, cfg, topo, clock)
    clock.enter("optimizer")
    out = finish_step(engine, losses, step, cfg, topo, stop_requested, save_written, on_phase)
    if topo.device.type == "cuda":
        torch.cuda.synchronize()  # perf/step_time measures the step's kernels, not their launch
    return out


def run_micro_batches(engine, micro_batches: list, cfg: Config, topo: Layout, forward_only=False,
                      clock=NO_CLOCK) -> list:
    """Forward (and backward, loss ÷ accumulation) of each micro-batch; returns this rank's losses
    (none on pipeline stages that do not compute the loss). With loss masks each loss is its masked sum ÷
    the step's mean unmasked count per micro-batch (pretrain.data.batch.loss_tokens)."""
    normaliser = loss_tokens(micro_batches, topo.dp_group)
    if topo.pp > 1:
        clock.enter("forward_backward")  # megatron's schedule interleaves them
        return pipeline_micro_batches(engine, micro_batches, cfg.model.seq_length, forward_only, normaliser,
                                      (topo.cp, topo.cp_rank))
    losses = []
    for batch in micro_batches:
        clock.enter("forward")
        loss = gpt_loss(engine, batch, normaliser, (topo.cp, topo.cp_rank))
        if not forward_only:  # context parallelism: the engine averages over data × context, the shares add up
            clock.enter("backward")
            engine.backward((loss * topo.cp if topo.cp > 1 else loss) / len(micro_batches))
        losses.append(loss.detach())
    return losses


def forward_backward(engine, batches: Batches, step: int, cfg: Config, topo: Layout, clock=NO_CLOCK) -> list:
    clock.enter("data")
    micro_batches = [batches.get(step, i) for i in range(topo.grad_accum)]
    return run_micro_batches(engine, micro_batches, cfg, topo, clock=clock)


def finish_step(engine, losses: list, step: int, cfg: Config, topo: Layout,
                stop_requested: Callable[[], bool] = never, save_written: Callable[[], bool] = never,
                on_phase: Callable[[str], None] = no_phase) -> StepOutcome:
    """The engine's step after the micro-batches' backward, between on_phase("reduction") and on_phase("idle").

    The step's loss sum, this rank's stop request (asked as late as possible: a signal caught during
    this step stops after it) and whether its part of the pending asynchronous save is on disk ride in
    the engine's gradient-norm all-reduce: one host read per step decides overflow and clipping (the
    norm), the stop (requested on any rank), the save's publication (written on all ranks), and gives
    every rank the same loss and norm, so NonfiniteGuard's verdict needs no further agreement."""
    on_phase("reduction")
    lr = lr_at(step, cfg)
    sums = torch.zeros(3, dtype=torch.float64, device=topo.device)
    sums[:1] = loss_share(losses, topo)
    if stop_requested():
        sums[1] = 1.0
    if save_written():
        sums[2] = 1.0
    result = engine.step(lr, sums=sums)
    on_phase("idle")
    return StepOutcome(step_mean_loss(result, topo), result, result.sums[1] > 0, result.sums[2] == topo.world_size)


def loss_share(losses: list[torch.Tensor], topo: Layout) -> torch.Tensor:
    """This rank's share of the step's loss sum, fp64 on the device, for `engine.step(lr, sums=...)`, which
    sums it over every rank: the sum of its micro-batch losses on the last pipeline stage's TP rank 0,
    0 elsewhere (TP ranks hold the same loss, megatron's vocab-parallel cross-entropy all-reduces it over
    TP; earlier stages hold none), so the world sum is the sum over the DP ranks. No host read."""
    value = torch.zeros(1, dtype=torch.float64, device=topo.device)
    if topo.is_last_stage and topo.tp_rank == 0:
        value += torch.stack(losses).double().sum()
    return value


def step_mean_loss(result: zero3d.StepResult, topo: Layout) -> float:
    """The step's mean loss over micro-batches and DP ranks from `loss_share`'s world sum (the same
    value as `mean_loss`, without its all-reduce and read)."""
    return result.sums[0] / (topo.grad_accum * topo.dp)


def mean_loss(losses: list[torch.Tensor], topo: Layout) -> float:
    """The mean over micro-batches and DP ranks, computed on the last pipeline stage, known to all
    (its own all-reduce and host read: `evaluate`; a training step uses `loss_share`)."""
    value = torch.zeros(1, dtype=torch.float64, device=topo.device)
    if topo.is_last_stage:
        value += torch.stack(losses).double().sum()
        dist.all_reduce(value, group=topo.zero_group if topo.cp > 1 else topo.dp_group)  # context shares add up
        value /= len(losses) * topo.dp
    if topo.pp > 1:
        from megatron.core import parallel_state
        dist.broadcast(value, src=parallel_state.get_pipeline_model_parallel_last_rank(), group=topo.pp_group)
    return value.item()


@torch.no_grad()
def evaluate(engine, valid, cfg: Config, topo: Layout) -> float:
    """Mean loss over eval_iters global batches (Megatron's evaluation): the first eval_iters × G
    validation samples, each DP rank its share, so the value does not depend on the layout."""
    engine.eval()
    n, per_rank = cfg.train.micro_batch_size, cfg.train.global_batch_size // topo.dp
    micro_batches = [to_device(collate([valid.sample(k * cfg.train.global_batch_size + topo.dp_rank * per_rank
                                                     + m * n + j) for j in range(n)]), topo.device)
                     for k in range(cfg.train.eval_iters) for m in range(per_rank // n)]
    losses = run_micro_batches(engine, micro_batches, cfg, topo, forward_only=True)
    engine.train()
    return mean_loss(losses, topo)
