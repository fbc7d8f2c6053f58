"""Predicted scaling table: the paper's Figure 2 ZeRO rows (1.5B..170B) on a described cluster (docs/estimator.md,
Predicted scaling table). Rows carry slurm/collect.py's columns, so its table and plot writers take them as they are."""
from pathlib import Path

from analysis.cluster import PAPER_CLUSTER, Cluster
from analysis.estimate import Step, gpt_param_count, paper_shape
from analysis.paper_configs import load_paper_runs
from analysis.planner import GPT2_VOCAB, PAPER_SEQ, layout_on, plan, step_time

# What the paper states of Figure 2's measured throughput (docs/zero-paper-facts.md §4.6): only the 100B bar
# (over 38 TFLOP/s per GPU) and the 8B-100B average (15 PFLOP/s on 400 GPUs = 37.5 per GPU); the other bars'
# values exist only in the plot.
PAPER_MEASURED = {"100B": ">38 TFLOP/s/GPU"}
PAPER_AVERAGE = (8e9, 100e9, "8B-100B average 15 PFLOP/s = 37.5 TFLOP/s/GPU")


def figure2_runs(csv_path, sizes=None) -> list:
    """Figure 2's ZeRO rows (PaperRun), in the CSV's order; `sizes` (labels such as "8B") keeps those only."""
    runs = [r for r in load_paper_runs(csv_path) if r.figure == 2 and r.system == "zero"]
    if sizes:
        valid = [r.model for r in runs]
        bad = [s for s in sizes if s not in valid]
        if bad:
            raise ValueError(f"size {bad[0]!r} is not a Figure 2 row; valid: {', '.join(valid)}")
        runs = [r for r in runs if r.model in sizes]
    return runs


def paper_said(run) -> str:
    """The paper's measured throughput for this row, as far as its text states it."""
    if run.model in PAPER_MEASURED:
        return PAPER_MEASURED[run.model]
    params = gpt_param_count(run.layers, run.hidden, GPT2_VOCAB, PAPER_SEQ)
    low, high, text = PAPER_AVERAGE
    return text if 0.9 * low <= params <= 1.1 * high else "plot only"


def predict_rows(cluster: Cluster, csv_path, sizes=None, precision: str = "fp16", gpus=None) -> list:
    """One row per Figure 2 size: the planner's best layout on `gpus` (default: the cluster's) GPUs at the row's
    samples per GPU (global batch = the paper's × gpus / the paper's GPUs, rounded), its memory per GPU and
    modelled TFLOP/s; on the paper's cluster also the paper's own layout (its MP degree, C4 or C5 for 170B, its
    micro-batch) through the same step-time model."""
    gpus = gpus or cluster.gpus
    rows = []
    for run in figure2_runs(csv_path, sizes):
        shape = dict(model=paper_shape(run.hidden, run.layers, run.heads, GPT2_VOCAB, PAPER_SEQ))
        paper_batch = run.batch_per_gpu * run.gpus // run.mp
        batch = max(1, round(paper_batch * gpus / run.gpus))
        found = plan(cluster, gpus=gpus, global_batch=batch, recompute="full", precision=precision,
                     **shape)
        params = gpt_param_count(run.layers, run.hidden, GPT2_VOCAB, PAPER_SEQ)
        row = dict(run=f"predicted {run.model}", figure=2, model=run.model, shrink=1, system="zero", gpus=gpus,
                   params=params, params_B=params / 1e9, comm_elements_per_step=None, steps=None,
                   measured_steps=None, paper="-", paper_layout_tflops=None)
        if cluster == PAPER_CLUSTER and gpus == run.gpus:
            row["paper"] = paper_said(run)
            t = step_time(cluster, shape["model"], layout_on(cluster, gpus, run.mp), run.zero,
                          Step(run.batch_per_gpu, "full", precision), paper_batch,
                          gpt_param_count(run.layers, run.hidden, GPT2_VOCAB, PAPER_SEQ, run.mp))
            row["paper_layout_tflops"] = t["tflops_per_gpu"]
        if not found:
            rows.append(dict(row, config="no layout fits", mp=None, batch_per_gpu=None, global_batch=batch,
                             tokens_per_s=None, tflops_per_gpu=None, pflops=None, peak_mem_GB=None, status="oom",
                             reason="no layout fits, offload included"))
            continue
        c = found[0]
        rows.append(dict(row, config=f"tp {c.tp} {c.zero.label} mb {c.micro_batch} x{c.accumulation}", mp=c.tp,
                         batch_per_gpu=c.micro_batch * c.accumulation, global_batch=batch,
                         tokens_per_s=c.samples_per_s * PAPER_SEQ, tflops_per_gpu=c.tflops_per_gpu,
                         pflops=c.tflops_per_gpu * gpus / 1000, peak_mem_GB=c.memory.total_bytes / 1e9, status="ok",
                         reason=f"predicted (planner's best of {len(found)} layouts)" + (
                             f"; paper's layout {row['paper_layout_tflops']:.1f} TFLOP/s/GPU; paper measured: "
                             f"{row['paper']}" if row["paper_layout_tflops"] is not None else "")))
    return rows


def format_rows(cluster: Cluster, rows: list) -> str:
    """The table as text: layout, memory and predicted TFLOP/s per GPU, and what the paper measured."""
    lines = [f"Figure 2's ZeRO rows predicted on {cluster.name}, {rows[0]['gpus'] if rows else 0} GPUs "
             f"(compute at {cluster.efficiency:.0%} of {cluster.peak_flops / 1e12:g} TFLOP/s; docs/estimator.md)",
             f"{'model':<7}{'B':>6}  {'layout (planner best)':<38}{'GB/GPU':>8}{'TFLOP/s/GPU':>13}{'paper layout':>14}"
             "  paper measured"]
    for r in rows:
        tf = f"{r['tflops_per_gpu']:.1f}" if r["tflops_per_gpu"] is not None else "-"
        mem = f"{r['peak_mem_GB']:.1f}" if r["peak_mem_GB"] is not None else "-"
        own = f"{r['paper_layout_tflops']:.1f}" if r["paper_layout_tflops"] is not None else "-"
        lines.append(f"{r['model']:<7}{r['global_batch']:>6}  {r['config']:<38}{mem:>8}{tf:>13}{own:>14}  {r['paper']}")
    return "\n".join(lines)


def default_csv() -> Path:
    return Path(__file__).resolve().parents[1] / "configs" / "paper" / "reproduction-configs.csv"
