"""The training loop: config → topology → data → GPTModel → ZeRO wrap → steps → metrics/checkpoints."""
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist

import zero3d
from pretrain import metrics
from pretrain.checkpoint.checkpointer import LATEST, Checkpointer, layout_signature, run_identity
from pretrain.checkpoint.export import check_save_final_hf, write_final_hf
from pretrain.checkpoint.hf import ImportedModel, check_matches, load_into
from pretrain.checkpoint.recovery import find_usable, recover
from pretrain.config import Config
from pretrain.schedule import lr_at
from pretrain.sections import TrainConfig
from model_shape.flops import StepFlops
from pretrain.data.loader import Batches  # noqa: F401 - also imported from here by the tests
from pretrain.runtime.agreement import from_rank0
from pretrain.runtime.kernels import fallbacks_line
from pretrain.runtime.preflight import check_paths
from pretrain.errors import EXIT_OK, EXIT_REQUEUE, ConfigError, NumericalError
from pretrain.memory_check import check_memory
from pretrain.summary import read_records, summary_from_records
from pretrain.model.fp8 import check_float8_device
from pretrain.model.gpt import (DTYPES, activation_checkpointing, build_model, gather_units, parallel_groups,
                                record_context_into)
from pretrain.step import evaluate, train_step
from pretrain.runtime.stopping import NonfiniteGuard, StopRequest
from pretrain.runtime.stragglers import Stragglers, straggler_text
from pretrain.runtime.status import write_status
from pretrain.runtime.layout import Layout, init_layout, launcher_env
from pretrain.runtime.lifecycle import (abort_now, record_rank_failure, resume_line, say, start_run,
                                        start_watchdog)
from pretrain.runtime.phases import PhaseClock
from pretrain.runtime.lock import acquire as acquire_lock, check_free, release as release_lock
from pretrain.runtime.resume import finished_line, init_from_line, schedule_lines
from pretrain.runtime.watchdog import Watchdog


def engine_settings(cfg: Config, **seams) -> zero3d.EngineSettings:
    """The engine's settings: the config's own zero3d sections, the dtype and megatron's gather units;
    `seams` (the probe's fused_optimizer / read_host_floats) pass through."""
    fp16 = cfg.precision.dtype == "fp16"
    return zero3d.EngineSettings(zero=cfg.zero, optimizer=cfg.optimizer, dtype=DTYPES[cfg.precision.dtype],
                                 loss_scale=cfg.precision if fp16 else None, units=gather_units, **seams)


def build_and_wrap(cfg: Config, topo: Layout, initial=None, cuda_kernels: bool = False, **seams):
    """config → (GPTModel, ZeRO engine, ZeRO-R activation checkpoints or None), counted in one CommStats (the
    checkpoints' and context parallelism's collectives too);
    `initial` (train.init_from's ImportedModel): its weights, split onto this rank, before the engine takes them;
    `cuda_kernels`: build_model's (the probe's stand-ins for a CUDA rank); `seams`: engine_settings'."""
    check_float8_device(cfg.precision.fp8, topo.device)  # the probe's --real builds here too, not via run_training
    activations = activation_checkpointing(cfg.zero, topo.tp_group)
    model = build_model(cfg, topo.device, activations, cuda_kernels)
    if initial is not None:
        load_into(model, initial)
    engine = zero3d.wrap_model(model, engine_settings(cfg, **seams), parallel_groups(model, topo))
    if activations is not None:
        activations.record_into(engine.comm_stats)
    record_context_into(model, engine.comm_stats)
    return model, engine, activations


def train(cfg: Config, launch: Optional[dict] = None, job: Optional[dict] = None) -> dict:
    """Run the configured job: {"record": last logged record, "end_step", "stopped_early", ...}; {"finished": True}
    when the checkpoint already reached train.steps (said in one line; nothing trained or written).

    Nothing of this run is written into the run directory until every check that can refuse it has passed on
    every rank — paths, memory, kernels, data, tokenizer, the checkpoint's model, vocabulary and schedule, the
    datasets, the model's build and the checkpoint's load (`run_training`, then `start_run`, the one place that
    writes the run's records); rank 0 holds the run directory's lock from before the save directory is first
    touched (an interrupted save's repair) until the process ends, and releases it on every way out. A refused
    start leaves a previous run's config.json and status.json as they were. From then on a failure is
    recorded by the rank it happens on (see pretrain.runtime.status); the final status is written
    between two barriers, after every rank has finished saving and before any rank leaves, so a
    launcher that kills the others when the first rank exits still finds it complete. `job`: the
    command's config path and overrides, for job.json under Slurm.
    """
    progress = {"step": 0, "started": False, "job": job or {}}
    topo = None
    timeout_s = cfg.train.timeout_minutes * 60
    try:
        try:
            launch = launch or launcher_env()
            check_paths(cfg)
            if cfg.train.save_final_hf:
                check_save_final_hf(cfg)
            topo = init_layout(cfg, launch)
            result = run_training(cfg, topo, progress)
        except BaseException as err:
            if progress["started"]:
                record_rank_failure(err, cfg.run_dir, launch, topo, progress["step"], timeout_s)
            raise
        if result.get("finished"):  # said by rank 0; the finished run's records stay as they are
            return result
        stopped = result["stopped_early"]
        dist.barrier()  # every rank has finished its last save
        if topo.is_main:
            write_status(cfg.run_dir, "interrupted" if stopped else "ok",
                         "stop signal: checkpoint saved, resume to continue" if stopped else "", topo.world_size,
                         result["end_step"], EXIT_REQUEUE if stopped else EXIT_OK)
        dist.barrier()  # status.json is complete before any rank exits
        if topo.is_main and cfg.train.save_final_hf and not stopped:  # the others may leave: rank 0 alone reads it
            write_final_hf(cfg, topo.world_size, result["end_step"])
        return result
    finally:
        release_lock()


def check_attention_kernel(cfg: Config, topo: Layout) -> None:
    """model.attention as it can run on this rank's device (pretrain/model/attention.py's `resolved_attention`, as
    the layer spec resolves it), before anything is built: 'te' without Transformer Engine, off CUDA, under ZeRO-R
    or selective recomputation is a config error in one line."""
    from pretrain.model.attention import resolved_attention
    try:
        resolved_attention(cfg, topo.device.type == "cuda")
    except ValueError as err:
        raise ConfigError(str(err)) from None


def imported_model(directory: str, m) -> ImportedModel:
    """The HF directory train.init_from names, its model the run's (CheckpointError naming each key that differs)."""
    initial = ImportedModel(Path(directory))
    check_matches(initial.model, m, directory)
    return initial


def run_training(cfg: Config, topo: Layout, progress: dict) -> dict:
    from pretrain.data.datasets import open_datasets, prepare_files

    check_attention_kernel(cfg, topo)  # before the memory check, which resolves the attention too
    check_memory(cfg, topo.world_size, topo.device, topo.is_main, topo.dp_per_node)
    check_float8_device(cfg.precision.fp8, topo.device)  # precision.fp8 on a GPU without float8 matmuls: one line
    if topo.is_main and (kernels := fallbacks_line(topo.tp)):
        print(kernels, flush=True)
    run_dir = cfg.run_dir
    save_dir = cfg.save_dir
    d, m, t = cfg.data, cfg.model, cfg.train
    from_rank0(lambda: check_free(run_dir))  # a run directory a live job writes: refused before any data work
    # Rank 0 checks the data files, or trains the tokenizer and writes .bin/.idx (cached); a data error
    # stops every rank. Then the checkpoint to resume is verified (files, hashes, identity) before the
    # model is built, and every rank opens megatron's datasets (rank 0 builds the indices first).
    # train.init_from (weights only: step 0, a fresh optimizer): every rank reads the HF directory's config and
    # tensor headers, checked against the run's model before any data work, unless a save of this run may resume.
    may_resume = t.resume and (save_dir / LATEST).is_file()
    initial = None if may_resume or not t.init_from else imported_model(t.init_from, m)
    files = from_rank0(lambda: prepare_files(d, m.vocab_size))
    say(topo, list(files.notes))
    # what the run's checkpoints record of it: its layout, its identity (model, tokenizer, data), its tokenizer's spec
    layout = layout_signature(cfg, topo)
    identity = run_identity(cfg.model, topo.tp, files.tokenizer_path, " ".join(files.prefixes()))
    tokenizer_record = files.tokenizer_record()
    say(topo, from_rank0(lambda: acquire_lock(run_dir)))  # before the save directory's repair, its first write
    usable = None
    if t.resume:
        say(topo, recover(save_dir, t.keep_checkpoints))
        usable = find_usable(save_dir, identity, (cfg.optimizer.name, cfg.optimizer.state_dtype))
    if usable is not None:
        if line := finished_line(usable, cfg):
            say(topo, [line])
            return {"finished": True, "record": {}, "start_step": usable["manifest"]["step"],
                    "end_step": usable["manifest"]["step"], "stopped_early": False}
        say(topo, schedule_lines(usable, cfg) + [x for x in [init_from_line(usable, cfg)] if x])
    if t.init_from and usable is None and initial is None:  # no save of this run was usable after all
        initial = imported_model(t.init_from, m)
    train_ds, valid_ds, _ = open_datasets(files, d, m.seq_length, t.seed, m.vocab_size,
                                          train_samples=t.steps * t.global_batch_size,
                                          valid_samples=t.eval_iters * t.global_batch_size
                                          if t.eval_interval else 0)

    model, engine, activations = build_and_wrap(cfg, topo, initial)
    checkpoints = Checkpointer(save_dir, model, engine, keep=t.keep_checkpoints, async_save=t.async_save,
                               timeout_minutes=t.timeout_minutes, max_failed_saves=t.max_failed_saves)
    start, consumed = 0, 0
    if usable is not None:
        resumed = checkpoints.load(usable, layout, t.seed)
        start = resumed["step"]
        # The data position saved with the checkpoint: the next sample, whatever the batch size was.
        consumed = (resumed["consumed_samples"] if resumed["consumed_samples"] is not None
                    else start * t.global_batch_size)
    start_run(cfg, topo, progress)  # every refusal is behind us: the run directory is this run's now
    say(topo, [resume_line(usable, save_dir, t.resume)] + ([f"train.init_from: the weights of {t.init_from} "
                                                            "(step 0, a fresh optimizer)"] if initial else []))

    logger = metrics.make_logger(rank=topo.rank, run_dir=run_dir, config_dict=cfg.to_dict(),
                                 total_steps=cfg.train.steps, console_mode=cfg.logging.console,
                                 use_wandb=cfg.logging.wandb, wandb_project=cfg.logging.wandb_project,
                                 wandb_name=cfg.logging.name, wandb_group=cfg.logging.wandb_group,
                                 start_step=start, use_tensorboard=cfg.logging.tensorboard)
    flops_per_step = m.flops_per_step(topo.tp, cfg.train.global_batch_size)
    peak = metrics.device_peak_tflops(topo.device.type, metrics.peak_dtype(cfg.precision.dtype, cfg.precision.fp8))
    batches = Batches(train_ds, cfg.train, cfg.data, topo, consumed_samples=consumed, start_step=start)
    run = LoopParts(cfg=cfg, topo=topo, engine=engine, model=model, batches=batches, valid_ds=valid_ds,
                    activations=activations, logger=logger, checkpoints=checkpoints, layout=layout,
                    identity=identity, tokenizer=tokenizer_record,
                    flops_per_step=flops_per_step, peak=peak,
                    stragglers=Stragglers(cfg.logging.straggler_factor, topo.device),
                    clock=PhaseClock(lambda: engine.comm_stats.exposed_seconds, topo.device.type == "cuda"))
    engine.train()
    try:
        step, record = run_loop(run, start, usable["path"].name if usable is not None else "none saved", progress)
    except NumericalError:  # agreed on every rank: let the last good save finish before leaving
        checkpoints.close()
        raise
    finally:
        engine.close()  # NVMe offload: its I/O thread and state files (a save has staged its copies already)
    checkpoints.close()
    if topo.is_main:
        logger.set_summary(summary_from_records(read_records(run_dir / "metrics.jsonl"),
                                                cfg.logging.summary_warmup_steps, topo.world_size))
    logger.close()
    return {"record": record, "start_step": start, "end_step": step, "stopped_early": step < cfg.train.steps}


@dataclass
class LoopParts:
    """What the step loop works with, built once by run_training."""
    cfg: Config
    topo: Layout
    engine: object
    model: object
    batches: Batches
    valid_ds: object
    activations: object
    logger: object
    checkpoints: Checkpointer
    layout: dict
    identity: dict
    tokenizer: dict  # the manifest's record of the tokenizer (export --format hf writes it out)
    flops_per_step: StepFlops
    peak: Optional[float]
    stragglers: Stragglers
    clock: PhaseClock  # the step's phase times (data, forward, backward, optimizer, exposed communication)


def run_loop(run: LoopParts, step: int, last_good: str, progress: dict) -> tuple[int, dict]:
    """Steps until train.steps or an agreed stop, under the watchdog; returns (last step, last record)."""
    stop = StopRequest(abort=lambda: abort_now(run.cfg, run.topo, progress["step"]))
    guard, watchdog = NonfiniteGuard(run.cfg), start_watchdog(run.cfg, run.topo, progress)
    try:
        record: dict = {}
        while step < run.cfg.train.steps:
            watchdog.beat()
            step, loss, result, stopping, written, logged = one_step(run, step, watchdog, lambda: stop.requested)
            record = logged or record
            progress["step"] = step
            if written:  # every rank's part of the pending save is on disk: publish it now
                run.checkpoints.wait()
            nonfinite = guard.is_nonfinite(loss, result.grad_norm, result.loss_scale)
            guard.update(nonfinite, step, loss, result.grad_norm, last_good)
            if wants_checkpoint(run.cfg.train, step, stopping):
                if guard.streak:  # a non-finite step never replaces the last good checkpoint
                    if run.topo.is_main:
                        print(f"warning: step {step} was not finite; checkpoint not saved, {last_good} stays "
                              "latest", file=sys.stderr, flush=True)
                else:
                    watchdog.beat()
                    run.checkpoints.save(step, {"config": run.cfg.to_dict(), "layout": run.layout,
                                                "identity": run.identity, "tokenizer": run.tokenizer,
                                                "consumed_samples": run.batches.position(step)})
                    last_good = f"step_{step:08d}"
            if stopping:
                break
    finally:
        watchdog.stop()
        stop.restore()
    return step, record


def wants_checkpoint(t: TrainConfig, step: int, stopping: bool) -> bool:
    return bool((t.save_interval and step % t.save_interval == 0) or stopping
                or (step == t.steps and t.save_final))


def one_step(run: LoopParts, step: int, watchdog: Watchdog, stop_requested: Callable[[], bool] = lambda: False):
    """Train one step; log it (and evaluate) when due. Returns (step, loss, StepResult, stop agreed,
    pending save written everywhere, logged record or None)."""
    cfg, topo, engine, m = run.cfg, run.topo, run.engine, run.cfg.model
    engine.comm_stats.reset()
    if run.activations:
        run.activations.reset_step()
    t0 = time.perf_counter()
    run.clock.start()
    loss_value, result, stopping, written = train_step(engine, run.batches, step, cfg, topo, stop_requested,
                                                       run.checkpoints.written, clock=run.clock)
    run.clock.stop()
    step_time = time.perf_counter() - t0
    step += 1
    last = step == cfg.train.steps
    evaluate_now = cfg.train.eval_interval and (step % cfg.train.eval_interval == 0 or last)
    if not (step % cfg.logging.log_interval == 0 or last or evaluate_now):
        return step, loss_value, result, stopping, written, None
    tokens_per_step = cfg.train.global_batch_size * m.seq_length
    record = {"train/loss": loss_value, "train/lr": lr_at(step - 1, cfg),
              "train/grad_norm": result.grad_norm, "train/loss_scale": result.loss_scale,
              "train/skipped": int(result.skipped), "train/grad_accum": topo.grad_accum,
              "train/tokens": step * tokens_per_step,
              **metrics.throughput_metrics(step_time, tokens_per_step, topo.world_size, run.flops_per_step,
                                           run.peak), **run.clock.report(),
              **metrics.memory_report(topo.device.type, engine.state_bytes()),
              **(comm := engine.comm_stats.report()), **metrics.bandwidth_report(comm),
              **(run.activations.report() if run.activations else {}),
              **run.checkpoints.report(), **run.stragglers.record(step_time, engine.comm_stats.exposed_seconds)}
    if "perf/straggler_rank" in record and topo.is_main:
        print(f"step {step}: {straggler_text(record)}", file=sys.stderr, flush=True)
    if evaluate_now:
        watchdog.beat()
        val = evaluate(engine, run.valid_ds, cfg, topo)
        record.update({"val/loss": val, "val/ppl": math.exp(min(val, 50.0))})
    run.logger.log(step, record)
    return step, loss_value, result, stopping, written, record
