"""Verdicts on the paper's reproduction configs (appendix Tables 1–6) and the planner's paper report."""
import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from analysis.estimate import (DEFAULT_BUCKET_ELEMENTS, DEFAULT_MARGIN_FRACTION, GB, GIB, MemoryBreakdown,
                                     estimate_from_shape)
from analysis.planner import (DP_ONLY_GPUS, GPT2_VOCAB, MP_STUDY, PAPER_CLUSTER, PAPER_CONFIGS, PAPER_SEQ,
                            Cluster, ZeroChoice, config_limits, dp_only_limit, format_candidates, plan)

# "facts §N" cites section N of docs/zero-paper-facts.md, the paper facts this project is held to.
# The paper appendix's configurations (configs/paper/reproduction-configs.csv) are read from the path the
# caller passes: the command line (`python -m analysis --csv`) names the repository's copy by default.
PAPER_TARGETS_B = {"C1": 40, "C2": 60, "C3": 50, "C4": 140, "C5": 150}  # Figure 5, for side-by-side print
# Figure numbers are the artifact appendix's (docs/zero-paper-facts.md §8.1): 4 = max model size per
# configuration (SC20 Fig. 5), 5 = max cached memory (SC20 Fig. 6), 6 = throughput per configuration
# (SC20 Fig. 7), 7 = data parallelism only (SC20 Fig. 8).
FIGURE4 = {"40B": "C1", "60B": "C2", "50B": "C3", "140B": "C4", "150B": "C5"}  # facts §4.8
# Figure 6's five 60B batches (2, 4, 32, 32, 8) carry no configuration labels (facts §4.10). They are
# read in the order the same appendix prints Figure 4's configurations (40B C1, 60B C2, 140B C4,
# 150B C5, 50B C3; facts §5 Table 3): C3 (no Pa) gets batch 8, C4 and C5 batch 32 each. Read as
# C1..C5 instead, C3 would get batch 32, whose unpartitioned checkpoints alone (75 × 32 × 1024 × 8192
# × 2 bytes = 40.3 GB) exceed a 32 GiB V100: a run the paper could not have made. This reading also
# gives facts §4.10's "C5 slower than C4 for 60B" at equal batch, from the CPU traffic alone.
FIGURE6_ORDER = ("C1", "C2", "C4", "C5", "C3")


def zero_choices(figure: int, model: str, system: str, mp: int, jobs: int) -> list:
    """[(C-label or None, note)], one per job of a CSV row: the ZeRO settings the paper used.

    Figure 5 rows list one shape that the paper ran in all five configurations (5 jobs).
    """
    if system == "baseline":
        base = "PyTorch DDP" if mp == 1 else "Megatron-LM tensor parallelism"
        return [(None, f"baseline: {base}, no ZeRO (stage 0, no Pa)")] * jobs
    if figure == 4:
        return [(FIGURE4[model], "facts §4.8: the figure's size for this configuration")] * jobs
    if figure == 5:
        return [(c, "facts §4.9: every configuration at both sizes") for c in PAPER_CONFIGS]
    if figure == 6 and jobs > 1:
        note = ("ASSUMPTION (facts §4.10): the table lists five batches but does not say which "
                "configuration each belongs to; they are read in the order the appendix prints Figure 4's "
                "configurations, " + ", ".join(FIGURE6_ORDER) + " (analysis/paper_configs.py)")
        return [(c, note) for c in FIGURE6_ORDER[:jobs]]
    if model == "170B":
        return [("C5", "facts §4.10: 170B needs Pa+cpu (C5) to run without OOM")] * jobs
    if mp == 1:  # Figure 7 and the 1.5B bar of Figure 2
        return [("C3", "DP only: ZeRO-100B's Pos+g with CB and MD; Pa has nothing to split at tp=1, "
                       "so C4 reduces to C3")] * jobs
    return [("C4", "ZeRO-100B = Pos+g with Pa (C4), CB and MD")] * jobs


def paper_expectation(figure: int, model: str, label) -> tuple:
    """("run" | "oom", why): what the paper reports for this job (facts sheet sections cited)."""
    if figure == 5 and model == "100B" and label in ("C1", "C2", "C3"):
        return "oom", (f"the paper reports 100B out of memory in {label}: its largest {label} model at 400 GPUs "
                       f"and MP 16 is {PAPER_TARGETS_B[label]}B (facts §4.8, appendix Figure 4)")
    return "run", ""


@dataclass(frozen=True)
class PaperRun:
    """One job of a CSV row, as configs/generate_paper.py generates it."""

    figure: int
    model: str
    system: str  # "zero" or "baseline"
    gpus: int
    mp: int
    layers: int
    hidden: int
    heads: int
    batch_per_gpu: int  # per DP rank, i.e. the micro-batch every GPU of an MP group runs
    label: Optional[str] = None  # C1..C5, None for a baseline
    expected: str = "run"  # "oom": the paper reports this job out of memory

    @property
    def zero(self) -> ZeroChoice:
        return PAPER_CONFIGS[self.label] if self.label else ZeroChoice(0)


def load_paper_runs(path: str | Path) -> list:
    """Parse the CSV (skipping "#" lines) into one run per generated job: ";"-separated GPU counts or
    batches yield one each, Figure 5 rows one per configuration."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip() and not line.startswith("#")]
    runs = []
    for row in csv.DictReader(lines):
        gpu_counts, batches = row["gpus"].split(";"), row["batch_per_gpu"].split(";")
        # Figure 6 lists five batches for one GPU count: a single value stands for every entry
        count = max(len(gpu_counts), len(batches))
        gpu_counts, batches = (x * count if len(x) == 1 else x for x in (gpu_counts, batches))
        if len(gpu_counts) != len(batches):
            raise ValueError(f"row {row} lists {len(gpu_counts)} GPU counts but {len(batches)} batches")
        figure, model, mp = int(row["figure"]), row["model"], int(row["mp"])
        choices = zero_choices(figure, model, row["system"], mp, count)
        jobs = list(zip(gpu_counts, batches))
        if len(jobs) == 1:
            jobs = jobs * len(choices)
        for (gpus, batch), (label, _) in zip(jobs, choices, strict=True):
            runs.append(PaperRun(figure, model, row["system"], int(gpus), mp, int(row["layers"]),
                                 int(row["hidden"]), int(row["heads"]), int(batch), label,
                                 paper_expectation(figure, model, label)[0]))
    return runs


def run_memory(run: PaperRun, zero: ZeroChoice, bucket, cluster: Cluster) -> MemoryBreakdown:
    """Per-GPU memory of a run: GPT-2 vocabulary, s = 1024, full recomputation, one micro-batch a step (its batch per
    GPU: configs/paper/ runs it as this engine's step, whose gradient shard takes room backward made)."""
    return estimate_from_shape(
        layers=run.layers, hidden=run.hidden, heads=run.heads, vocab=GPT2_VOCAB, seq=PAPER_SEQ, gpus=run.gpus,
        tp=run.mp, stage=zero.stage, micro_batch=run.batch_per_gpu, recompute="full", pa=zero.pa,
        pa_cpu=zero.pa_cpu, bucket_elements=bucket, gpu_memory_bytes=cluster.gpu_memory_bytes, grad_shard_per_step=True)


@dataclass(frozen=True)
class Verdict:
    """Fits or not, with the numbers behind it."""

    run: PaperRun
    zero: ZeroChoice
    memory: MemoryBreakdown
    reason: str

    @property
    def fits(self) -> bool:
        return self.memory.fits


def judge(run: PaperRun, cluster: Cluster = PAPER_CLUSTER) -> Verdict:
    """Memory verdict for one run in its own configuration, with the CB bucket its generated config
    sets (so `--plan csv` and `python -m pretrain --estimate` agree); rows that do not fit also say
    whether C5 (Pa+cpu) would."""
    zero, bucket = run.zero, DEFAULT_BUCKET_ELEMENTS
    m = run_memory(run, zero, bucket, cluster)
    per_param = m.model_state_bytes / m.params_per_rank
    parts = (f"model states {m.model_state_bytes / GB:.1f} GB ({per_param:.2f} B/param × "
             f"{m.params_per_rank / 1e9:.2f}B params/rank), activations {m.activation_bytes / GB:.1f} GB "
             f"(checkpoints {m.checkpoint_bytes / GB:.1f}, layer {m.working_set_bytes / GB:.1f}, logits "
             f"{m.logits_bytes / GB:.1f}), buffers {m.buffer_bytes / GB:.1f} GB, "
             f"margin {m.margin_bytes / GB:.1f} GB")
    room = (m.gpu_memory_bytes - m.total_bytes) / GB
    reason = (f"{m.total_bytes / GB:.1f} of {m.gpu_memory_bytes / GB:.2f} GB, "
              f"{'headroom' if m.fits else 'over by'} {abs(room):.1f} GB; {m.dominant} dominate: {parts}")
    if not m.fits and run.system == "zero" and run.mp > 1 and run.label != "C5":
        c5 = run_memory(run, PAPER_CONFIGS["C5"], bucket, cluster)
        c5_verdict = "fits" if c5.fits else "does not fit"
        reason += f"; with C5 (P_a+cpu): {c5.total_bytes / GB:.2f} GB, {c5_verdict}"
    if run.mp > cluster.gpus_per_node:
        reason += f"; MP {run.mp} crosses nodes ({cluster.gpus_per_node} GPUs/node): memory judged only"
    return Verdict(run, zero, m, reason)


def judge_all(path: str | Path, cluster: Cluster = PAPER_CLUSTER) -> list:
    """One Verdict per run of the CSV."""
    return [judge(run, cluster) for run in load_paper_runs(path)]


def _csv_section(path: str | Path, cluster: Cluster) -> list:
    lines = [f"Reproduction configs on {cluster.name} ({cluster.gpu_memory_bytes / GIB:.0f} GiB = "
             f"{cluster.gpu_memory_bytes / GB:.2f} GB, margin {DEFAULT_MARGIN_FRACTION:.0%}); each job in its "
             "own configuration (C1-C5 as configs/paper/ sets them, baselines stage 0 + MP), figures in "
             "the artifact appendix's numbering; [paper: OOM] marks jobs the paper reports out of memory"]
    for v in judge_all(path, cluster):
        r = v.run
        paper = " [paper: OOM]" if r.expected == "oom" else ""
        lines.append(f"  Fig {r.figure} {r.model:>6} {r.system:<8} {r.label or 'base':<4} {r.gpus:>3} GPUs "
                     f"MP {r.mp:<3} L {r.layers:<3} h {r.hidden:<4} b {r.batch_per_gpu:<3} [{v.zero.label}]{paper} "
                     f"{'FITS' if v.fits else 'DOES NOT FIT'}: {v.reason}")
    return lines


def paper_report(csv_path: str | Path, csv_only: bool = False, cluster: Cluster = PAPER_CLUSTER) -> str:
    """The planner's paper findings (DP-only limits, C1–C5 maxima, a ranking) and the CSV verdicts."""
    if csv_only:
        return "\n".join(_csv_section(csv_path, cluster))
    lines = [f"Planner on {cluster.name}: {cluster.gpu_memory_bytes / GB:.2f} GB per GPU, margin "
             f"{DEFAULT_MARGIN_FRACTION:.0%}, CB {DEFAULT_BUCKET_ELEMENTS:,} elements, recompute full", "",
             f"Data-parallel only ({DP_ONLY_GPUS} GPUs, tp 1, micro-batch 1, best over the Figure 7 "
             "hidden sizes):"]
    for stage, paper in ((0, "paper: 1.4B with PyTorch DDP"), (1, "P_os"), (2, "paper: 13B with ZeRO-100B")):
        best = dp_only_limit(stage, cluster)
        lines.append(f"  stage {stage}: {best.params / 1e9:6.2f}B ({best.layers} layers × h {best.hidden})"
                     f" — {paper}")
    study = MP_STUDY
    lines += ["", f"Max model size per ZeRO configuration (MP {study['tp']}, {study['gpus']} GPUs, batch "
                  f"{study['micro_batch']} per GPU, hidden {study['hidden']}, {study['heads']} heads):"]
    for name, best in config_limits(cluster).items():
        target = PAPER_TARGETS_B[name]
        lines.append(f"  {name} {PAPER_CONFIGS[name].label:<18} {best.params / 1e9:6.1f}B "
                     f"({best.layers} layers)  paper {target}B  ({best.params / 1e9 / target - 1:+.0%})")
    shape = dict(layers=125, hidden=8192, heads=64, global_batch=800)  # Figure 2's 100B run
    scopes = (((0, 1, 2), "stages 0–2, what ZeRO-100B implements"), ((0, 1, 2, 3), "all stages"))
    for stages, scope in scopes:
        lines += ["", f"Top layouts for the 100B model (125 × 8192, global batch 800), {scope}:",
                  format_candidates(plan(cluster, stages=stages, **shape), top=3)]
    return "\n".join(lines + [""] + _csv_section(csv_path, cluster))

