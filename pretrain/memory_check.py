"""Start-up memory estimate of a config: printed, and a run that cannot fit is refused before it starts. The config is
read once into the analysis's objects (`estimate_args`), which the estimator takes whole."""
import dataclasses
from typing import Optional

from analysis.estimate import (GB, GIB, PRECISIONS, Budget, MemoryBreakdown, OptimizerStates, Parallelism, Step,
                               ZeroChoice, document_mask_bytes, estimate, format_breakdown)
from analysis.offload_estimate import OffloadBreakdown, format_offload, offload_breakdown
from pretrain.config import Config, ConfigError
from pretrain.sections import ClusterConfig
from zero3d.comm.topology import TopologyError, dp_ranks_per_node


def gpu_budget_bytes(cluster: ClusterConfig) -> float:
    """The device memory a config's [cluster] describes: gpu_memory_gb in GiB, the unit vendors label cards in
    (a "32 GB" V100 carries 32 GiB); the planner budgets the same (docs/estimator.md)."""
    return cluster.gpu_memory_gb * GIB


def estimate_args(cfg: Config, world_size: int, gpu_memory_bytes: float, gpus_per_node: Optional[int] = None) -> tuple:
    """(shape, layout, zero, step, budget, optimizer): a rank of this config as the estimator (analysis.estimate) takes
    it. Pipeline stages: one stage's layers, with both the embeddings and the output layer counted (the first and last
    stages hold one each: an upper bound for either). `gpus_per_node`: the ranks per node the run's Layout resolved
    (default: cluster.gpus_per_node)."""
    m, p = cfg.model, cfg.parallel
    shape = dataclasses.replace(m.shape, layers=m.num_layers // p.pipeline)
    layout = Parallelism(world_size // p.pipeline, p.tensor, p.context, dp_per_node(cfg, world_size, gpus_per_node))
    step = Step(micro_batch=cfg.train.micro_batch_size, recompute=m.recompute, precision=cfg.precision.dtype,
                attention=attention_kind(m.attention), loss_chunk_tokens=m.loss_chunk_tokens,
                loss_recompute=m.loss_recompute, float8=cfg.precision.fp8, mask_bytes=mask_bytes(cfg, world_size),
                sequence_parallel=p.sequence_parallel, compiled=m.compile in (True, "auto"))
    optimizer = OptimizerStates.of_shape(shape, p.tensor, cfg.optimizer.name, cfg.optimizer.state_dtype)
    return shape, layout, ZeroChoice.of(cfg.zero), step, Budget(gpu_memory_bytes), optimizer


def estimate_config(cfg: Config, world_size: int, gpu_memory_bytes: float,
                    gpus_per_node: Optional[int] = None) -> MemoryBreakdown:
    """The estimator for this config's model, layout and ZeRO settings (estimate_args)."""
    return estimate(*estimate_args(cfg, world_size, gpu_memory_bytes, gpus_per_node))


def mask_bytes(cfg: Config, world_size: int) -> int:
    """The per-sample attention masks data.reset_attention_mask puts on each rank (estimate.document_mask_bytes):
    the step's micro-batches all at once, one bias per micro-batch in flight (the pipeline's stages at most)."""
    if not cfg.data.reset_attention_mask:
        return 0
    m = cfg.model
    return document_mask_bytes(m.seq_length, cfg.train.micro_batch_size, accumulation(cfg, world_size),
                               cfg.parallel.pipeline, PRECISIONS[cfg.precision.dtype].activation_bytes,
                               attention_kind(m.attention))


def accumulation(cfg: Config, world_size: int) -> int:
    """Micro-batches per step on each rank (at least 1: the estimate of a layout that does not divide)."""
    t, p = cfg.train, cfg.parallel
    return max(1, t.global_batch_size // (t.micro_batch_size * (world_size // (p.tensor * p.pipeline * p.context))))


def attention_kind(choice: str) -> str:
    """The estimator's attention term (estimate.ATTENTION_KINDS) for model.attention = `choice`: "local" keeps
    the [b·a, s, s] scores; "sdpa", "te" and "auto" (te where importable, else sdpa: pretrain/model/attention.py's
    resolve) run fused kernels on a GPU, which keep only the softmax statistics."""
    return "local" if choice == "local" else "fused"


def dp_per_node(cfg: Config, world_size: int, gpus_per_node: Optional[int] = None) -> int:
    """DP ranks on one node for hpZ and hybrid, by the engine's rank → node rule (zero3d.comm.topology): TP takes its
    share of the node first; 1 without a node-aware mode. A layout whose DP groups do not split evenly into nodes is
    the ConfigError the run's start gives."""
    if not cfg.zero.node_aware():
        return 1
    try:
        return dp_ranks_per_node(world_size, cfg.parallel.tensor, cfg.parallel.pipeline,
                                 gpus_per_node or cfg.cluster.gpus_per_node)
    except TopologyError as err:
        raise ConfigError(str(err), "config", "set cluster.gpus_per_node to the ranks each node runs") from None


def device_estimate(cfg: Config, world_size: int, gpu_memory_bytes: float,
                    gpus_per_node: Optional[int] = None) -> tuple:
    """(what stays on the device, OffloadBreakdown or None): with zero.offload_* on, the check judges only
    the device's bytes (estimate_config stays the whole model states' estimate: checkpoint sizes)."""
    shape, layout, zero, step, budget, optimizer = estimate_args(cfg, world_size, gpu_memory_bytes, gpus_per_node)
    whole = estimate(shape, layout, zero, step, budget, optimizer)
    if zero.offload_optimizer == "none" and zero.offload_params == "none":
        return whole, None
    offload = offload_breakdown(whole, layout, zero, step.precision, accumulation(cfg, world_size), optimizer)
    return offload.device, offload


def _table(estimate: MemoryBreakdown, offload: Optional[OffloadBreakdown], header: str, device: str,
           cpu_note: Optional[str] = None) -> str:
    """The breakdown, its verdict (or, on CPU ranks, `cpu_note` last instead) and where offload put states."""
    table = format_breakdown(estimate, header, device=device)
    if cpu_note is not None:
        table = table.rsplit("\n", 1)[0]
    return "\n".join([table] + ([format_offload(offload)] if offload else []) + ([cpu_note] if cpu_note else []))


def describe(cfg: Config, world_size: int) -> str:
    p = cfg.parallel
    cp = f" × CP {p.context}" if p.context > 1 else ""
    dp = world_size // (p.tensor * p.pipeline * p.context)
    return (f"{cfg.model.num_layers} layers × hidden {cfg.model.hidden_size}, seq {cfg.model.seq_length}; "
            f"{world_size} ranks = TP {p.tensor} × PP {p.pipeline}{cp} × DP {dp}; "
            f"ZeRO stage {cfg.zero.stage}, micro-batch {cfg.train.micro_batch_size}, {cfg.precision.dtype}; "
            f"{cfg.optimizer.name}, {cfg.optimizer.state_dtype} states")


def config_report(cfg: Config, world_size: int, cpu_note: Optional[str] = None,
                  gpus_per_node: Optional[int] = None) -> tuple:
    """(estimate, table) for the device the config describes (`--estimate`, no device at hand)."""
    estimate, offload = device_estimate(cfg, world_size, gpu_budget_bytes(cfg.cluster), gpus_per_node)
    device = f"{cfg.cluster.gpu} (cluster.gpu_memory_gb = {cfg.cluster.gpu_memory_gb:g} GiB)"
    return estimate, _table(estimate, offload, describe(cfg, world_size), device, cpu_note)


def check_memory(cfg: Config, world_size: int, device, is_main: bool,
                 gpus_per_node: Optional[int] = None) -> MemoryBreakdown:
    """Print the estimate on rank 0; on CUDA refuse (every rank alike) a config that does not fit.

    The smallest device memory over all ranks is the budget, so every rank takes the same decision.
    On CPU ranks there is no device budget: the table is printed for the device the config
    describes, and the verdict says that nothing was checked. `gpus_per_node`: the run's Layout's.
    """
    import torch
    import torch.distributed as dist
    if device.type != "cuda":
        estimate, table = config_report(cfg, world_size, cpu_note=(
            f"CPU run: no device memory check (the estimate is for {cfg.cluster.gpu}, "
            f"{cfg.cluster.gpu_memory_gb:g} GiB)"), gpus_per_node=gpus_per_node)
        if is_main:
            print(table, flush=True)
        return estimate
    budget = torch.tensor([float(torch.cuda.get_device_properties(device).total_memory)], device=device)
    dist.all_reduce(budget, op=dist.ReduceOp.MIN)
    gpu_memory = budget.item()
    estimate, offload = device_estimate(cfg, world_size, gpu_memory, gpus_per_node)
    name = torch.cuda.get_device_name(device)
    table = _table(estimate, offload, describe(cfg, world_size), f"{name} (smallest over the ranks)")
    if is_main:
        print(table, flush=True)
    if not estimate.fits and not cfg.train.ignore_memory_estimate:
        raise ConfigError(f"the memory estimate exceeds the device memory "
                          f"({estimate.total_bytes / GB:.2f} GB > {gpu_memory / GB:.2f} GB); lower "
                          "train.micro_batch_size, raise zero.stage or parallel.tensor, enable "
                          "zero.partition_activations / model.recompute, or set "
                          f"train.ignore_memory_estimate = true to run anyway.\n{table}")
    return estimate
