"""`python -m analysis --zeropp`: α-β step time per link for stage 3 and its ZeRO++ modes on the paper's rows."""
from dataclasses import dataclass

from analysis.cluster import PAPER_CLUSTER, Cluster, ClusterSpec
from analysis.comm_model import (ZEROPP_MODES, collectives_per_pass, link_bytes, link_seconds, row_mode,
                                       zeropp_collectives)
from analysis.estimate import DEFAULT_BUCKET_ELEMENTS, estimate_from_shape, extra_state_bytes, gpt_param_count, GB
from analysis.paper_configs import load_paper_runs
from model_shape.flops import gpt_flops_per_step
from analysis.modes import COSTS
from analysis.planner import PAPER_SEQ, GPT2_VOCAB
from zero3d.comm.topology import dp_ranks_per_node

# The report's default machines: the paper's DGX-2 nodes and DGX H100 nodes (cluster.PRESETS). Compute runs at
# each cluster's `efficiency`: Megatron-LM's V100 share, assumed for the H100.
DGX2 = PAPER_CLUSTER
H100 = ClusterSpec("dgx-h100", nodes=50).cluster("bf16")  # 400 GPUs, as the paper's rows


def predict(machine: Cluster, *, layers: int, hidden: int, heads: int, gpus: int, tp: int, micro_batch: int,
            global_batch: int, grad_bits: int = 4, block: int = 256,
            bucket_elements: int = DEFAULT_BUCKET_ELEMENTS) -> dict:
    """Per mode: bytes per link per rank, the α-β communication time per step (α per ring step of every
    bucket's and unit's collective: comm_model.collectives_per_pass, units = layers + 2), and the step time
    with communication not overlapped (serial) and fully overlapped with compute (max of the two)."""
    links = machine.links
    if tp > links.gpus_per_node or links.gpus_per_node % tp:
        raise ValueError(f"tp = {tp} does not fit a node of {links.gpus_per_node} GPUs; valid: a divisor of it")
    dp, per_node = gpus // tp, dp_ranks_per_node(gpus, tp, 1, links.gpus_per_node)
    accumulation = global_batch // (micro_batch * dp)
    if accumulation < 1 or global_batch % (micro_batch * dp):
        raise ValueError(f"global_batch = {global_batch} is not a multiple of micro_batch × dp = {micro_batch} × {dp}")
    psi = gpt_param_count(layers, hidden, GPT2_VOCAB, PAPER_SEQ, tp)
    compute = gpt_flops_per_step(layers, hidden, PAPER_SEQ, GPT2_VOCAB, global_batch, True) / (
        gpus * machine.peak_flops * machine.efficiency)
    memory = estimate_from_shape(layers=layers, hidden=hidden, heads=heads, vocab=GPT2_VOCAB, seq=PAPER_SEQ,
                                 gpus=gpus, tp=tp, stage=3, micro_batch=micro_batch, recompute="full",
                                 pa=tp > 1, gpu_memory_bytes=machine.gpu_memory_bytes)
    buckets, gathers = collectives_per_pass(psi, bucket_elements, layers + 2)
    rows = []
    for mode in ZEROPP_MODES:
        colls = zeropp_collectives(mode, psi, dp, per_node, grad_bits=grad_bits, block=block,
                                   accumulation=accumulation, buckets=buckets, gathers=gathers)
        intra, inter = link_bytes(colls)
        comm = sum(link_seconds(c, links) for c in colls)
        extra = extra_state_bytes(row_mode(mode), psi, dp, per_node)
        rows.append(dict(mode=mode, intra_bytes=float(intra), inter_bytes=float(inter), comm_s=comm,
                         serial_s=compute + comm, overlapped_s=max(compute, comm), extra_bytes=extra,
                         fits=memory.total_bytes + extra <= machine.gpu_memory_bytes))
    base = rows[0]
    for r in rows:
        r["gain_serial"] = base["serial_s"] / r["serial_s"]
        r["gain_overlapped"] = base["overlapped_s"] / r["overlapped_s"]
    return dict(psi=psi, dp=dp, per_node=per_node, accumulation=accumulation, compute_s=compute,
                stage3_total_bytes=memory.total_bytes, rows=rows)


def format_prediction(title: str, p: dict) -> str:
    lines = [title,
             f"  Ψ = {p['psi'] / 1e9:.2f}B per TP slice, N = {p['dp']} DP ranks, {p['per_node']} per node, "
             f"{p['accumulation']} micro-batch(es); compute {p['compute_s']:.3f} s/step; stage 3 needs "
             f"{p['stage3_total_bytes'] / GB:.1f} GB per GPU (estimator)",
             f"  {'mode':<13}{'intra GB':>10}{'inter GB':>10}{'comm s':>9}{'step s':>9}{'gain':>7}"
             f"{'overlap s':>11}{'gain':>7}{'extra GB':>10}  memory"]
    for r in p["rows"]:
        lines.append(f"  {r['mode']:<13}{r['intra_bytes'] / GB:10.2f}{r['inter_bytes'] / GB:10.2f}{r['comm_s']:9.3f}"
                     f"{r['serial_s']:9.3f}{r['gain_serial']:7.2f}{r['overlapped_s']:11.3f}{r['gain_overlapped']:7.2f}"
                     f"{r['extra_bytes'] / GB:10.2f}  {'fits' if r['fits'] else 'does not fit'}")
    return "\n".join(lines)


def zeropp_report(csv_path, models=("100B", "170B"), grad_bits: int = 4, block: int = 256,
                  clusters: tuple = (DGX2, H100)) -> str:
    """The paper's 400-GPU ZeRO rows of Figure 2 (as the CSV lays them out, and with TP 1 at one sample
    per GPU, the layout ZeRO++ evaluates) on each of `clusters` (default: DGX-2 and DGX H100 nodes)."""
    wire = ", ".join(note for note in (costs.wire_note(grad_bits) for costs in COSTS.values()) if note)
    memory = ", ".join(costs.memory_note for costs in COSTS.values() if costs.memory_note)
    header = ("ZeRO++ modes at stage 3, α-β per link (bytes and seconds per rank per step; 'step s': compute + "
              f"communication, 'overlap s': the larger of the two; gain against stage 3). {wire}, {block}-element "
              f"blocks with fp32 scales. Compute at {clusters[0].efficiency:.0%} of peak (Megatron-LM's V100 share; "
              f"assumed for the H100). 'extra GB': {memory}; 'memory': the stage-3 estimate (full recompute, Pa where "
              "tp > 1) plus it, against the GPU.")
    out = [header]
    runs = {r.model: r for r in load_paper_runs(csv_path) if r.figure == 2 and r.system == "zero"}
    for model in models:
        if model not in runs:
            raise ValueError(f"model {model!r} has no Figure 2 ZeRO row; valid: {', '.join(runs)}")
        r = runs[model]
        for machine in clusters:
            # the cluster's GPUs at the paper's samples per GPU (400 GPUs on the default machines: the paper's batch)
            gpus = machine.gpus
            batch = max(1, r.batch_per_gpu * gpus // r.mp)
            shape = dict(layers=r.layers, hidden=r.hidden, heads=r.heads, gpus=gpus)
            tp = min(r.mp, machine.links.gpus_per_node)
            layouts = [(tp, max(1, batch // (gpus // tp)), batch, "paper's layout" if tp == r.mp else
                        f"tp {tp} (the paper's {r.mp} exceeds a node), the paper's samples per GPU"),
                       (1, 1, gpus, "tp 1, one sample per GPU")]
            for tp_, mb, gb, what in layouts:
                p = predict(machine, tp=tp_, micro_batch=mb, global_batch=gb, grad_bits=grad_bits, block=block,
                            **shape)
                out.append(format_prediction(f"\n{model} ({r.layers} layers × {r.hidden}) on {gpus} GPUs, "
                                             f"{machine.name}; {what}: tp {tp_}, micro-batch {mb}, "
                                             f"global batch {gb}", p))
    return "\n".join(out)
