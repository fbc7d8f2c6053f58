"""The training loop: config → topology → data → GPTModel → ZeRO wrap → steps → metrics/checkpoints."""
import json
import math
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

import zero3d
from megatron_patches import disable_zero3d_recompute, route_recompute_to_zero3d
from pretrain import checkpoint, metrics
from pretrain.config import Config
from pretrain.memory_check import check_memory
from pretrain.summary import read_records, summary_from_records
from pretrain.model import DTYPES, build_model, gpt_loss, parallel_groups
from pretrain.pipeline import pipeline_micro_batches
from pretrain.topology import Topology, init_topology


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup to optimizer.lr, then cosine decay to optimizer.min_lr (step is 0-based)."""
    o = cfg.optimizer
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    decay_steps = o.decay_steps or cfg.train.steps
    progress = min(1.0, (step - o.warmup_steps) / max(1, decay_steps - o.warmup_steps))
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1.0 + math.cos(math.pi * progress))


def on_main_then_share(topo: Topology, fn):
    """Run fn on rank 0 and hand its result (or its error, raised everywhere) to every rank."""
    box = [None]
    if topo.is_main:
        try:
            box[0] = ("ok", fn())
        except Exception as err:  # noqa: BLE001 - re-raised on every rank below
            box[0] = ("error", err)
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise value
    return value


def engine_settings(cfg: Config) -> zero3d.EngineSettings:
    o, pr = cfg.optimizer, cfg.precision
    scaler = zero3d.LossScaler(scale=pr.initial_loss_scale, min_scale=pr.min_loss_scale,
                               growth_interval=pr.growth_interval, backoff_factor=pr.backoff_factor,
                               hysteresis=pr.hysteresis) if pr.dtype == "fp16" else None
    return zero3d.EngineSettings(
        bucket_elements=cfg.zero.bucket_elements, overlap_comm=cfg.zero.overlap_comm, lr=o.lr,
        weight_decay=o.weight_decay, betas=(o.beta1, o.beta2), eps=o.eps, clip_grad=o.clip_grad,
        dtype=DTYPES[pr.dtype], loss_scaler=scaler,
        param_persistence_threshold=cfg.zero.param_persistence_threshold,
        prefetch_units=cfg.zero.prefetch_units)


class Batches:
    """Which samples each rank reads: step s uses samples [s·G, (s+1)·G) of the shuffled stream,
    split by (DP rank, micro-batch), so any (TP, DP, accumulation) layout sees the same global batch."""

    def __init__(self, dataset, cfg: Config, topo: Topology):
        self.dataset, self.topo = dataset, topo
        self.global_batch, self.micro = cfg.train.global_batch_size, cfg.train.micro_batch_size

    def get(self, step: int, micro_index: int) -> torch.Tensor:
        first = step * self.global_batch + (self.topo.dp_rank * self.topo.grad_accum + micro_index) * self.micro
        tokens = torch.stack([self.dataset.sample(first + i) for i in range(self.micro)])
        return tokens.to(self.topo.device)


def run_micro_batches(engine, micro_batches: list, cfg: Config, topo: Topology, forward_only=False) -> list:
    """Forward (and backward, loss ÷ accumulation) of each micro-batch; returns this rank's losses
    (none on pipeline stages that do not compute the loss)."""
    if topo.pp > 1:
        return pipeline_micro_batches(engine, micro_batches, cfg.model.seq_length, forward_only)
    losses = []
    for tokens in micro_batches:
        loss = gpt_loss(engine, tokens)
        if not forward_only:
            engine.backward(loss / len(micro_batches))
        losses.append(loss.detach())
    return losses


def forward_backward(engine, batches: Batches, step: int, cfg: Config, topo: Topology) -> list:
    return run_micro_batches(engine, [batches.get(step, i) for i in range(topo.grad_accum)], cfg, topo)


def train_step(engine, batches: Batches, step: int, cfg: Config, topo: Topology):
    """One optimizer step over grad_accum micro-batches; returns (mean loss, StepResult)."""
    losses = forward_backward(engine, batches, step, cfg, topo)
    result = engine.step(lr_at(step, cfg))
    loss_value = mean_loss(losses, topo)
    if topo.device.type == "cuda":
        torch.cuda.synchronize()
    return loss_value, result


class StopRequest:
    """SIGUSR1 (Slurm's warning before the time limit or preemption) or SIGTERM asks for a stop.

    A signal may reach some ranks only, or reach them at different steps; `agreed()` all-reduces the
    flag after every step so all ranks save the same checkpoint and leave together.
    """

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

    def __init__(self):
        self.requested = False
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in self.SIGNALS}
        # `python -m pretrain` blocks SIGUSR1 until now: one that came early is delivered here.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, self.SIGNALS)

    def _on_signal(self, signum, frame):
        self.requested = True

    def agreed(self, topo: Topology) -> bool:
        flag = torch.tensor([float(self.requested)], device=topo.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def mean_loss(losses: list[torch.Tensor], topo: Topology) -> float:
    """The mean over micro-batches and DP ranks, computed on the last pipeline stage, known to all."""
    value = torch.zeros(1, dtype=torch.float64, device=topo.device)
    if topo.is_last_stage:
        value += torch.stack(losses).double().sum()
        dist.all_reduce(value, group=topo.dp_group)
        value /= len(losses) * topo.dp
    if topo.pp > 1:
        from megatron.core import parallel_state
        dist.broadcast(value, src=parallel_state.get_pipeline_model_parallel_last_rank(), group=topo.pp_group)
    return value.item()


@torch.no_grad()
def evaluate(engine, valid, cfg: Config, topo: Topology) -> float:
    engine.eval()
    n = cfg.train.micro_batch_size
    micro_batches = [torch.stack([valid.sample((i * topo.dp + topo.dp_rank) * n + j) for j in range(n)])
                     .to(topo.device) for i in range(cfg.train.eval_iters)]
    losses = run_micro_batches(engine, micro_batches, cfg, topo, forward_only=True)
    engine.train()
    return mean_loss(losses, topo)


def route_activation_checkpoints(cfg: Config, topo: Topology, engine):
    """ZeRO-R (Pa, Pa+cpu, MD): megatron's per-layer recomputation runs zero3d's checkpoint; None if off."""
    z = cfg.zero
    return route_recompute_to_zero3d(z.partition_activations, z.cpu_checkpointing, z.contiguous_checkpointing,
                                     topo.tp_group, engine.comm_stats)


def layout_signature(cfg: Config, topo: Topology) -> dict:
    """What a checkpoint's shards depend on; resume refuses a mismatch."""
    return {"world_size": topo.world_size, "tensor": topo.tp, "pipeline": topo.pp, "data": topo.dp,
            "stage": cfg.zero.stage, "dtype": cfg.precision.dtype,
            "model": [cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_attention_heads,
                      cfg.model.padded_vocab_size(topo.tp), cfg.model.seq_length, cfg.model.tie_embeddings]}


def write_status(run_dir: Path, status: str, reason: str, topo: Topology, steps: int) -> None:
    """<run_dir>/status.json, read by the collector: ok | interrupted | failed, and why."""
    if topo.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / "status.json.tmp"
        tmp.write_text(json.dumps({"status": status, "reason": reason, "world_size": topo.world_size,
                                   "steps": steps}, indent=2))
        os.replace(tmp, run_dir / "status.json")


def train(cfg: Config) -> dict:
    """Run the configured job: {"record": last logged record, "end_step", "stopped_early", ...}."""
    topo = init_topology(cfg)
    progress = {"step": 0}
    try:
        result = run_training(cfg, topo, progress)
    except BaseException as err:
        write_status(cfg.run_dir, "failed", f"{type(err).__name__}: {err}".splitlines()[0], topo,
                     progress["step"])
        raise
    stopped = result["stopped_early"]
    write_status(cfg.run_dir, "interrupted" if stopped else "ok",
                 "stop signal: checkpoint saved, resume to continue" if stopped else "", topo, result["end_step"])
    return result


def run_training(cfg: Config, topo: Topology, progress: dict) -> dict:
    from pretrain.data import open_datasets, prepare_files

    check_memory(cfg, topo.world_size, topo.device, topo.is_main)
    run_dir = cfg.run_dir
    save_dir = Path(cfg.train.save_dir) if cfg.train.save_dir else run_dir / "checkpoints"
    d, m = cfg.data, cfg.model
    # Rank 0 trains the tokenizer and writes .bin/.idx (cached); a data error stops every rank.
    files = on_main_then_share(topo, lambda: prepare_files(
        corpus=d.corpus, tokenizer_model=d.tokenizer_model, data_prefix=d.prefix, cache_dir=d.cache_dir,
        vocab_size=m.vocab_size))
    train_ds, valid_ds, _ = open_datasets(*files, seq_length=m.seq_length, valid_fraction=d.valid_fraction,
                                          seed=cfg.train.seed, model_vocab_size=m.vocab_size)

    model = build_model(cfg, topo.device)
    engine = zero3d.wrap_model(model, cfg.zero.stage, engine_settings(cfg), parallel_groups(model, topo))
    activations = route_activation_checkpoints(cfg, topo, engine)
    layout = layout_signature(cfg, topo)
    start = 0
    if cfg.train.resume and (step_dir := checkpoint.latest(save_dir)) is not None:
        start = checkpoint.load(step_dir, layout, model, engine)["step"]

    logger = metrics.make_logger(rank=topo.rank, run_dir=run_dir, config_dict=cfg.to_dict(),
                                 total_steps=cfg.train.steps, console_mode=cfg.logging.console,
                                 use_wandb=cfg.logging.wandb, wandb_project=cfg.logging.wandb_project,
                                 wandb_name=cfg.logging.name, wandb_group=cfg.logging.wandb_group,
                                 start_step=start)
    flops_per_step = metrics.gpt_flops_per_step(m.num_layers, m.hidden_size, m.seq_length,
                                                m.padded_vocab_size(topo.tp), cfg.train.global_batch_size,
                                                recompute=m.recompute == "full")
    peak = metrics.device_peak_tflops(topo.device.type, cfg.precision.dtype)
    batches = Batches(train_ds, cfg, topo)
    tokens_per_step = cfg.train.global_batch_size * m.seq_length
    stop = StopRequest()
    record: dict = {}
    step = start
    engine.train()
    while step < cfg.train.steps:
        engine.comm_stats.reset()
        if activations:
            activations.reset_step()
        t0 = time.perf_counter()
        loss_value, result = train_step(engine, batches, step, cfg, topo)
        step_time = time.perf_counter() - t0
        step += 1
        progress["step"] = step
        last = step == cfg.train.steps
        evaluate_now = cfg.train.eval_interval and (step % cfg.train.eval_interval == 0 or last)
        if step % cfg.logging.log_interval == 0 or last or evaluate_now:
            record = {"train/loss": loss_value, "train/lr": lr_at(step - 1, cfg),
                      "train/grad_norm": result.grad_norm, "train/loss_scale": result.loss_scale,
                      "train/skipped": int(result.skipped), "train/grad_accum": topo.grad_accum,
                      "train/tokens": step * tokens_per_step,
                      **metrics.throughput_metrics(step_time, tokens_per_step, topo.world_size,
                                                   flops_per_step, peak),
                      **metrics.memory_report(topo.device.type, engine.state_bytes()),
                      **engine.comm_stats.report(), **(activations.report() if activations else {})}
            if evaluate_now:
                val = evaluate(engine, valid_ds, cfg, topo)
                record.update({"val/loss": val, "val/ppl": math.exp(min(val, 50.0))})
            logger.log(step, record)
        stopping = stop.agreed(topo)
        if (cfg.train.save_interval and step % cfg.train.save_interval == 0) or stopping \
                or (last and cfg.train.save_final):
            checkpoint.save(save_dir, step, layout, model, engine, {"config": cfg.to_dict()})
        if stopping:
            break
    stop.restore()
    if topo.is_main:
        logger.set_summary(summary_from_records(read_records(run_dir / "metrics.jsonl"),
                                                cfg.logging.summary_warmup_steps, topo.world_size))
    logger.close()
    disable_zero3d_recompute()
    return {"record": record, "start_step": start, "end_step": step, "stopped_early": step < cfg.train.steps}
