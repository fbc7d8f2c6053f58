"""Start-up memory estimate of a config: printed, and a run that cannot fit is refused before it starts. The config is
read once into one rank's job (`rank_job`), which the analysis (analysis/memory_report.py) estimates and tables."""
import dataclasses
from typing import Optional

from analysis.estimate import GB, GIB, Budget, MemoryBreakdown, OptimizerStates, Parallelism, Step, ZeroChoice
from analysis.memory_report import RankJob, device_memory, device_report
from pretrain.config import Config, ConfigError
from pretrain.sections import ClusterConfig
from zero3d.comm.topology import TopologyError, dp_ranks_per_node


def gpu_budget_bytes(cluster: ClusterConfig) -> float:
    """The device memory a config's [cluster] describes: gpu_memory_gb in GiB, the unit vendors label cards in
    (a "32 GB" V100 carries 32 GiB); the planner budgets the same (docs/estimator.md)."""
    return cluster.gpu_memory_gb * GIB


def rank_job(cfg: Config, world_size: int, gpu_memory_bytes: float, dp_per_node: int,
             compiled: Optional[bool] = None) -> RankJob:
    """A rank of this config as the estimator (analysis.memory_report) takes it. Pipeline stages: one stage's layers,
    with both the embeddings and the output layer counted (the first and last stages hold one each: an upper bound for
    either). `dp_per_node`: the DP ranks on each node (a run's Layout.dp_per_node, or `config_dp_per_node`).
    `compiled`: whether model.compile compiles the run's layers (pretrain/model/gpt.py's `compiles`); default, as on
    the config's GPUs with megatron's local layers: model.compile true or "auto"."""
    m, p = cfg.model, cfg.parallel
    shape = dataclasses.replace(m.shape, layers=m.num_layers // p.pipeline)
    layout = Parallelism(world_size // p.pipeline, p.tensor, p.context, dp_per_node, p.pipeline)
    micro_batches = accumulation(cfg, world_size)
    step = Step(micro_batch=cfg.train.micro_batch_size, recompute=m.recompute, precision=cfg.precision.dtype,
                attention=attention_kind(m.attention), loss_chunk_tokens=m.loss_chunk_tokens,
                loss_recompute=m.loss_recompute, float8=cfg.precision.fp8, accumulation=micro_batches,
                document_masks=cfg.data.reset_attention_mask, sequence_parallel=p.sequence_parallel,
                compiled=m.compile in (True, "auto") if compiled is None else compiled,
                grad_shard_per_step=micro_batches == 1 and p.pipeline == 1)
    optimizer = OptimizerStates.of_shape(shape, p.tensor, cfg.optimizer.name, cfg.optimizer.state_dtype)
    return RankJob(shape, layout, ZeroChoice.of(cfg.zero), step, Budget(gpu_memory_bytes), optimizer)


def config_job(cfg: Config, world_size: int, gpu_memory_bytes: float, compiled: Optional[bool] = None) -> RankJob:
    """rank_job of a config with no run's Layout at hand (`--estimate`, `--plan`, the probe, sbatch's check): its DP
    ranks per node by the engine's rank → node rule (config_dp_per_node)."""
    return rank_job(cfg, world_size, gpu_memory_bytes, config_dp_per_node(cfg, world_size), compiled)


def estimate_config(cfg: Config, world_size: int, gpu_memory_bytes: float) -> MemoryBreakdown:
    """The estimator for this config's model, layout and ZeRO settings, nothing offloaded (config_job)."""
    return config_job(cfg, world_size, gpu_memory_bytes).whole()


def accumulation(cfg: Config, world_size: int) -> int:
    """Micro-batches per step on each rank (at least 1: the estimate of a layout that does not divide)."""
    t, p = cfg.train, cfg.parallel
    return max(1, t.global_batch_size // (t.micro_batch_size * (world_size // (p.tensor * p.pipeline * p.context))))


def attention_kind(choice: str) -> str:
    """The estimator's attention term (estimate.ATTENTION_KINDS) for model.attention = `choice`: "local" keeps
    the [b·a, s, s] scores; "sdpa", "te" and "auto" (te where importable, else sdpa: pretrain/model/attention.py's
    resolve) run fused kernels on a GPU, which keep only the softmax statistics."""
    return "local" if choice == "local" else "fused"


def config_dp_per_node(cfg: Config, world_size: int) -> int:
    """DP ranks on one node for hpZ and hybrid, by the engine's rank → node rule (zero3d.comm.topology) on
    cluster.gpus_per_node: TP takes its share of the node first; 1 without a node-aware mode. A layout whose DP groups
    do not split evenly into nodes is the ConfigError the run's start gives."""
    if not cfg.zero.node_aware():
        return 1
    try:
        return dp_ranks_per_node(world_size, cfg.parallel.tensor, cfg.parallel.pipeline, cfg.cluster.gpus_per_node)
    except TopologyError as err:
        raise ConfigError(str(err), "config", "set cluster.gpus_per_node to the ranks each node runs") from None


def device_estimate(cfg: Config, world_size: int, gpu_memory_bytes: float, compiled: Optional[bool] = None) -> tuple:
    """(what stays on the device, OffloadBreakdown or None): with zero.offload_* on, the check judges only
    the device's bytes (estimate_config stays the whole model states' estimate: checkpoint sizes). `compiled`:
    rank_job's."""
    return device_memory(config_job(cfg, world_size, gpu_memory_bytes, compiled))


def config_device(cfg: Config) -> str:
    """The device the config describes, as the table's verdict names it."""
    return f"{cfg.cluster.gpu} (cluster.gpu_memory_gb = {cfg.cluster.gpu_memory_gb:g} GiB)"


def config_report(cfg: Config, world_size: int, cpu_note: Optional[str] = None) -> tuple:
    """(estimate, table) for the device the config describes (`--estimate`, no device at hand)."""
    job = config_job(cfg, world_size, gpu_budget_bytes(cfg.cluster))
    return device_report(job, config_device(cfg), cpu_note)


def check_memory(cfg: Config, world_size: int, device, is_main: bool, dp_per_node: int) -> MemoryBreakdown:
    """Print the estimate on rank 0; on CUDA refuse (every rank alike) a config that does not fit.

    The smallest device memory over all ranks is the budget, so every rank takes the same decision.
    On CPU ranks there is no device budget: the table is printed for the device the config
    describes, and the verdict says that nothing was checked. `dp_per_node`: the run's Layout's. The step is the
    one this rank runs: its layers compiled or not as build_model compiles them (the fused loss's bytes a logit).
    """
    import torch
    import torch.distributed as dist

    from pretrain.model.gpt import compiles_layers
    on_cuda = device.type == "cuda"
    if on_cuda:
        budget = torch.tensor([float(torch.cuda.get_device_properties(device).total_memory)], device=device)
        dist.all_reduce(budget, op=dist.ReduceOp.MIN)
        gpu_memory, cpu_note = budget.item(), None
        judged = f"{torch.cuda.get_device_name(device)} (smallest over the ranks)"
    else:
        gpu_memory, judged = gpu_budget_bytes(cfg.cluster), config_device(cfg)
        cpu_note = (f"CPU run: no device memory check (the estimate is for {cfg.cluster.gpu}, "
                    f"{cfg.cluster.gpu_memory_gb:g} GiB)")
    job = rank_job(cfg, world_size, gpu_memory, dp_per_node, compiles_layers(cfg, on_cuda))
    estimate, table = device_report(job, judged, cpu_note)
    if is_main:
        print(table, flush=True)
    if on_cuda and not estimate.fits and not cfg.train.ignore_memory_estimate:
        raise ConfigError(f"the memory estimate exceeds the device memory "
                          f"({estimate.total_bytes / GB:.2f} GB > {gpu_memory / GB:.2f} GB); lower "
                          "train.micro_batch_size, raise zero.stage or parallel.tensor, enable "
                          "zero.partition_activations / model.recompute, or set "
                          f"train.ignore_memory_estimate = true to run anyway.\n{table}")
    return estimate
