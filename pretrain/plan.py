"""`python -m pretrain --config X --plan`: the planner (analysis/planner.py) over a run config, with the memory model
`--estimate` uses. The config is read once into one rank's job by config_job (pretrain/memory_check.py);
the planner varies only the layout (TP, CP, ZeRO stage and activation options, offload, the node-aware mode, the
recompute policy, the micro-batch) and keeps the rest of the step as the config has it: attention kernel, loss
chunking, sequence parallelism (at TP > 1), float8, optimizer states, buckets, document masks. Each layout is
printed with the overrides that make the config that layout, and `--estimate` of the config with those overrides is
the layout's memory to the byte. The compute runs at the share of peak measured along the config's kernel path
(analysis/throughput.py: docs/gpu-check.md's rows, or with `--measured RUN_DIR` a run of the user's own)."""
import dataclasses
import json
import statistics
from pathlib import Path

from analysis.cluster import PRESET_OF_GPU, Cluster, ClusterSpec
from analysis.estimate import GB, RECOMPUTE
from analysis.gpus import GPU_KINDS
from analysis.modes import zero_keys
from analysis.offload_estimate import offload_breakdown
from analysis.planner import Candidate, format_candidates, plan, step_time
from analysis.throughput import MEASURED_ROWS, KernelPath, MeasuredRow
from pretrain.config import RESOLVED_CONFIG, Config, ConfigError, _merge, validate
from pretrain.memory_check import attention_kind, config_job, gpu_budget_bytes
from pretrain.summary import read_records


def config_cluster(cfg: Config, rows: tuple = MEASURED_ROWS) -> Cluster:
    """The planner's Cluster for cfg's [cluster] (its GPU's node preset), its efficiency from `rows`."""
    if cfg.cluster.gpu not in PRESET_OF_GPU:
        raise ConfigError(f"cluster.gpu = {cfg.cluster.gpu!r} has no node preset for the planner's time model",
                          "config", f"set cluster.gpu to one of {', '.join(PRESET_OF_GPU)}")
    cluster = ClusterSpec(PRESET_OF_GPU[cfg.cluster.gpu], nodes=cfg.cluster.nodes,
                          gpus_per_node=cfg.cluster.gpus_per_node,
                          gpu_memory_gb=cfg.cluster.gpu_memory_gb).cluster(cfg.precision.dtype)
    return dataclasses.replace(cluster, rows=rows)


def measured_row(run_dir: str) -> MeasuredRow:
    """A finished run of the user's as a measured row: its config.json's model, layout and kernel path, and the
    median over its logged steps after logging.summary_warmup_steps of the step time less the exposed communication
    (metrics.jsonl's perf/step_time_s − perf/phase/comm_exposed_s), on its world size (status.json) of
    cluster.gpu. A pipelined run's bubble counts as compute."""
    run = Path(run_dir)
    needed = [run / RESOLVED_CONFIG, run / "metrics.jsonl", run / "status.json"]
    missing = [str(p) for p in needed if not p.is_file()]
    if missing:
        raise ConfigError(f"--measured {run_dir!r} is not a run directory: {', '.join(missing)} missing",
                          fix="give the logging.run_dir of a run that logged steps")
    cfg, defaults = Config(), Config().to_dict()
    try:  # whatever its bytes: a file that is not what pretrain writes is one line, never a traceback
        tree = json.loads(needed[0].read_text())  # the resolved tree: merge what differs from the defaults
        _merge(cfg, {s: {k: v for k, v in keys.items() if v != defaults.get(s, {}).get(k)}
                     for s, keys in tree.items()}, str(needed[0]))
        world = int(json.loads(needed[2].read_text())["world_size"])
        records = read_records(needed[1])
        past = [r for r in records if r.get("step", 0) > cfg.logging.summary_warmup_steps] or records
        compute = [float(r["perf/step_time_s"]) - float(r.get("perf/phase/comm_exposed_s", 0.0)) for r in past
                   if r.get("perf/step_time_s")]
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ConfigError(f"--measured {run_dir!r}: its config.json, status.json or metrics.jsonl is not what "
                          f"pretrain writes ({type(err).__name__}: {err})") from None
    validate(cfg)
    if not compute:
        raise ConfigError(f"--measured {run_dir!r}: {needed[1]} has no step with perf/step_time_s",
                          fix="give a run that trained at least one step (logging.log_interval = 1 logs each)")
    if cfg.cluster.gpu not in GPU_KINDS or world < 1:
        raise ConfigError(f"--measured {run_dir!r}: cluster.gpu = {cfg.cluster.gpu!r} on {world} rank(s) has no peak "
                          f"to measure against", fix=f"a run with cluster.gpu one of {', '.join(GPU_KINDS)}")
    m = cfg.model
    row = MeasuredRow(str(run), "measured run", cfg.cluster.gpu,
                      KernelPath(attention_kind(m.attention), m.compile in (True, "auto"), cfg.precision.fp8),
                      m.shape, cfg.train.global_batch_size, statistics.median(compute), m.recompute,
                      m.loss_chunk_tokens > 0 and m.loss_recompute, cfg.parallel.tensor, world)
    share = row.efficiency if 0 < row.step_s < float("inf") else float("nan")
    if not 0 < share <= 1:  # NaN fails too
        raise ConfigError(f"--measured {run_dir!r}: a {row.step_s:g} s compute step is {share:.3g} of "
                          f"{cfg.cluster.gpu}'s peak; valid: a step whose share of peak is in (0, 1]")
    return row


def config_step(cfg: Config, rows: tuple = MEASURED_ROWS) -> dict:
    """The planner's modelled step of cfg's own layout (analysis.planner.step_time: compute at the measured share of
    peak, exposed communication, offload traffic) and its parts, with its cluster's `efficiency` (an Efficiency). A
    pipelined config: one stage's step (config_job) × (m + p − 1) / m, the 1F1B bubble of p stages over m
    micro-batches."""
    world = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    cluster = config_cluster(cfg, rows)
    job = config_job(cfg, world, gpu_budget_bytes(cfg.cluster))
    shape, layout, zero, step = job.shape, job.layout, job.zero, job.step
    memory = job.whole()
    pcie = 0.0
    if zero.offloaded:
        pcie = offload_breakdown(memory, layout, zero, step.precision, accumulation=step.accumulation,
                                 optimizer=job.optimizer).pcie_bytes_per_step
    try:
        timing = step_time(cluster, shape, layout, zero, step, cfg.train.global_batch_size, memory.params_per_rank,
                           pcie, cfg.optimizer.name)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    stages, micro = cfg.parallel.pipeline, timing["accumulation"]
    bubble = (micro + stages - 1) / micro
    step_s = bubble * sum(timing[k] for k in ("compute_s", "mp_s", "pa_s", "offload_s", "dp_s", "pcie_s", "cp_s",
                                              "optimizer_s"))
    return dict(timing, step_s=step_s, efficiency=cluster.efficiency_along(KernelPath.of(step)))


def plan_config(cfg: Config, rows: tuple = MEASURED_ROWS) -> list:
    """Every layout of `cfg`'s model on its [cluster] that fits, best modelled throughput first (analysis.planner.plan),
    each step holding what cfg's does (config_job), the recompute policy the planner's choice, the compute at the
    share of peak `rows` measured along cfg's kernel path."""
    p = cfg.parallel
    if p.pipeline > 1:
        raise ConfigError(f"--plan lays out TP × CP × DP; parallel.pipeline = {p.pipeline} is not planned",
                          "config", "plan with parallel.pipeline=1, or --estimate the pipelined layout")
    cluster = config_cluster(cfg, rows)
    world = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    job = config_job(cfg, world, gpu_budget_bytes(cfg.cluster))
    shape, zero, step, budget = job.shape, job.zero, job.step, job.budget
    try:
        return plan(cluster, model=shape, gpus=world, global_batch=cfg.train.global_batch_size, recompute=RECOMPUTE,
                    margin_fraction=budget.margin_fraction, optimizer=cfg.optimizer.name,
                    state_dtype=cfg.optimizer.state_dtype, step=step, zero=zero)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def overrides_of(candidate: Candidate) -> list:
    """The `section.key=value` overrides that make the config the candidate's layout."""
    z, step = candidate.zero, candidate.step
    return ([f"parallel.tensor={candidate.tp}", f"parallel.context={candidate.cp}",
             f"parallel.sequence_parallel={str(step.sequence_parallel).lower()}", f"zero.stage={z.stage}",
             f"zero.partition_activations={str(z.pa).lower()}", f"zero.cpu_checkpointing={str(z.pa_cpu).lower()}",
             f'zero.offload_optimizer="{z.offload_optimizer}"', f'zero.offload_params="{z.offload_params}"']
            + [f'zero.{key}="{value}"' for key, value in zero_keys(z.modes).items()]
            + [f'model.recompute="{step.recompute}"', f"train.micro_batch_size={candidate.micro_batch}"])


def plan_report(cfg: Config, top: int, as_json: bool, measured: tuple = ()) -> str:
    """The ranked layouts: a line each with its overrides and exact bytes, or (`as_json`) every one as JSON. `measured`:
    run directories whose steps (measured_row) replace docs/gpu-check.md's rows as the efficiency's source."""
    rows = tuple(measured_row(d) for d in measured) or MEASURED_ROWS
    found = plan_config(cfg, rows)
    if as_json:
        return json.dumps([{"overrides": overrides_of(c), "total_bytes": c.memory.total_bytes,
                            "memory": c.memory.to_dict(), "step_s": c.step_s, "tflops_per_gpu": c.tflops_per_gpu}
                           for c in found], indent=1)
    world = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    world_step = config_job(cfg, world, gpu_budget_bytes(cfg.cluster)).step
    lines = [f"{len(found)} feasible layouts of this config on {cfg.cluster.nodes} × {cfg.cluster.gpus_per_node} "
             f"{cfg.cluster.gpu} ({world} GPUs, {cfg.cluster.gpu_memory_gb:g} GiB); best first:",
             f"compute at {config_cluster(cfg, rows).efficiency_along(KernelPath.of(world_step))}"]
    for c in found[:top]:
        lines += [format_candidates([c], 1), f"      {c.memory.total_bytes:,.0f} B = {c.memory.total_bytes / GB:.3f} GB: "
                  + " ".join(overrides_of(c))]
    return "\n".join(lines if found else lines + [format_candidates([])])
