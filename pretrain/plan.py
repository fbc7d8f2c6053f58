"""`python -m pretrain --config X --plan`: the planner (analysis/planner.py) over a run config, with the memory model
`--estimate` uses. The config is read once into the analysis's objects by estimate_args (pretrain/memory_check.py);
the planner varies only the layout (TP, CP, ZeRO stage and activation options, offload, the node-aware mode, the
recompute policy, the micro-batch) and keeps the rest of the step as the config has it: attention kernel, loss
chunking, sequence parallelism (at TP > 1), float8, optimizer states, buckets, document masks. Each layout is
printed with the overrides that make the config that layout, and `--estimate` of the config with those overrides is
the layout's memory to the byte."""
import json

from analysis.cluster import PRESET_OF_GPU, ClusterSpec
from analysis.estimate import GB, RECOMPUTE
from analysis.planner import Candidate, format_candidates, plan
from pretrain.config import Config, ConfigError
from pretrain.memory_check import estimate_args, gpu_budget_bytes
from zero3d.comm.modes import CARDS


def plan_config(cfg: Config) -> list:
    """Every layout of `cfg`'s model on its [cluster] that fits, best modelled throughput first (analysis.planner.plan),
    each step holding what cfg's does (estimate_args), the recompute policy the planner's choice."""
    p = cfg.parallel
    if p.pipeline > 1:
        raise ConfigError(f"--plan lays out TP × CP × DP; parallel.pipeline = {p.pipeline} is not planned",
                          "config", "plan with parallel.pipeline=1, or --estimate the pipelined layout")
    if cfg.cluster.gpu not in PRESET_OF_GPU:
        raise ConfigError(f"cluster.gpu = {cfg.cluster.gpu!r} has no node preset for the planner's time model",
                          "config", f"set cluster.gpu to one of {', '.join(PRESET_OF_GPU)}")
    world = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    shape, _, zero, step, budget, _ = estimate_args(cfg, world, gpu_budget_bytes(cfg.cluster))
    cluster = ClusterSpec(PRESET_OF_GPU[cfg.cluster.gpu], nodes=cfg.cluster.nodes,
                          gpus_per_node=cfg.cluster.gpus_per_node,
                          gpu_memory_gb=cfg.cluster.gpu_memory_gb).cluster(cfg.precision.dtype)
    try:
        return plan(cluster, model=shape, gpus=world, global_batch=cfg.train.global_batch_size, recompute=RECOMPUTE,
                    margin_fraction=budget.margin_fraction, optimizer=cfg.optimizer.name,
                    state_dtype=cfg.optimizer.state_dtype, step=step, zero=zero,
                    document_masks=cfg.data.reset_attention_mask)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def overrides_of(candidate: Candidate) -> list:
    """The `section.key=value` overrides that make the config the candidate's layout."""
    z, step = candidate.zero, candidate.step
    modes = z.modes
    return ([f"parallel.tensor={candidate.tp}", f"parallel.context={candidate.cp}",
             f"parallel.sequence_parallel={str(step.sequence_parallel).lower()}", f"zero.stage={z.stage}",
             f"zero.partition_activations={str(z.pa).lower()}", f"zero.cpu_checkpointing={str(z.pa_cpu).lower()}",
             f'zero.offload_optimizer="{z.offload_optimizer}"', f'zero.offload_params="{z.offload_params}"']
            + [f'zero.{card.key}="{card.key_value(modes)}"' for card in CARDS]
            + [f'model.recompute="{step.recompute}"', f"train.micro_batch_size={candidate.micro_batch}"])


def plan_report(cfg: Config, top: int, as_json: bool) -> str:
    """The ranked layouts: a line each with its overrides and exact bytes, or (`as_json`) every one as JSON."""
    found = plan_config(cfg)
    if as_json:
        return json.dumps([{"overrides": overrides_of(c), "total_bytes": c.memory.total_bytes,
                            "memory": c.memory.to_dict(), "step_s": c.step_s, "tflops_per_gpu": c.tflops_per_gpu}
                           for c in found], indent=1)
    world = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    lines = [f"{len(found)} feasible layouts of this config on {cfg.cluster.nodes} × {cfg.cluster.gpus_per_node} "
             f"{cfg.cluster.gpu} ({world} GPUs, {cfg.cluster.gpu_memory_gb:g} GiB); best first:"]
    for c in found[:top]:
        lines += [format_candidates([c], 1), f"      {c.memory.total_bytes:,.0f} B = {c.memory.total_bytes / GB:.3f} GB: "
                  + " ".join(overrides_of(c))]
    return "\n".join(lines if found else lines + [format_candidates([])])
