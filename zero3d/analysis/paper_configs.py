"""Verdicts on the paper's reproduction configs (appendix Tables 1–6) and the planner's paper report."""
import csv
from dataclasses import dataclass
from pathlib import Path

from zero3d.analysis.estimate import (DEFAULT_BUCKET_ELEMENTS, DEFAULT_MARGIN_FRACTION, GB, MemoryBreakdown,
                             estimate_from_shape)
from zero3d.analysis.planner import (DP_ONLY_GPUS, GPT2_VOCAB, MP_STUDY, PAPER_CLUSTER, PAPER_CONFIGS, PAPER_SEQ,
                            Cluster, ZeroChoice, config_limits, dp_only_limit, format_candidates, plan)

REPO_ROOT = Path(__file__).resolve().parents[2]
CSV_PATH = REPO_ROOT / "configs/paper/reproduction-configs.csv"  # the paper appendix's configurations
PAPER_TARGETS_B = {"C1": 40, "C2": 60, "C3": 50, "C4": 140, "C5": 150}  # Figure 5, for side-by-side print


@dataclass(frozen=True)
class PaperRun:
    """One GPU count of one CSV row."""

    figure: int
    model: str
    system: str  # "zero" or "baseline"
    gpus: int
    mp: int
    layers: int
    hidden: int
    heads: int
    batch_per_gpu: int  # per DP rank, i.e. the micro-batch every GPU of an MP group runs


def load_paper_runs(path=None) -> list:
    """Parse the CSV (skipping "#" lines); ";"-separated GPU counts or batches yield one run each."""
    path = Path(path) if path else CSV_PATH
    lines = [line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    runs = []
    for row in csv.DictReader(lines):
        gpu_counts, batches = row["gpus"].split(";"), row["batch_per_gpu"].split(";")
        # Figure 6 lists five batches for one GPU count: a single value stands for every entry
        count = max(len(gpu_counts), len(batches))
        gpu_counts, batches = (x * count if len(x) == 1 else x for x in (gpu_counts, batches))
        if len(gpu_counts) != len(batches):
            raise ValueError(f"row {row} lists {len(gpu_counts)} GPU counts but {len(batches)} batches")
        for gpus, batch in zip(gpu_counts, batches):
            runs.append(PaperRun(int(row["figure"]), row["model"], row["system"], int(gpus), int(row["mp"]),
                                 int(row["layers"]), int(row["hidden"]), int(row["heads"]), int(batch)))
    return runs


def run_choice(run: PaperRun) -> tuple:
    """(ZeroChoice, CB elements or None) the judgement uses for a run (see docs/estimator.md)."""
    if run.system == "baseline":
        return ZeroChoice(0), None  # Megatron / DDP: stage 0 with the 4Ψ fused fp32 buffer
    if run.figure == 7 or run.mp == 1:
        return ZeroChoice(2), DEFAULT_BUCKET_ELEMENTS  # DP only: P_os+g, nothing for Pa to split
    return PAPER_CONFIGS["C4"], DEFAULT_BUCKET_ELEMENTS


def run_memory(run: PaperRun, zero: ZeroChoice, bucket, cluster: Cluster) -> MemoryBreakdown:
    """Per-GPU memory of a run: GPT-2 vocabulary, s = 1024, full recomputation."""
    return estimate_from_shape(
        layers=run.layers, hidden=run.hidden, heads=run.heads, vocab=GPT2_VOCAB, seq=PAPER_SEQ, gpus=run.gpus,
        tp=run.mp, stage=zero.stage, micro_batch=run.batch_per_gpu, recompute="full", pa=zero.pa,
        pa_cpu=zero.pa_cpu, bucket_elements=bucket, gpu_memory_bytes=cluster.gpu_memory_bytes)


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
    """Memory verdict for one run; rows that do not fit also say whether C5 (Pa+cpu) would."""
    zero, bucket = run_choice(run)
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
    if not m.fits and run.system == "zero" and run.mp > 1:
        c5 = run_memory(run, PAPER_CONFIGS["C5"], bucket, cluster)
        c5_verdict = "fits" if c5.fits else "does not fit"
        reason += f"; with C5 (P_a+cpu): {c5.total_bytes / GB:.2f} GB, {c5_verdict}"
    if run.mp > cluster.gpus_per_node:
        reason += f"; MP {run.mp} crosses nodes ({cluster.gpus_per_node} GPUs/node): memory judged only"
    return Verdict(run, zero, m, reason)


def judge_all(path=None, cluster: Cluster = PAPER_CLUSTER) -> list:
    """One Verdict per run of the CSV."""
    return [judge(run, cluster) for run in load_paper_runs(path)]


def _csv_section(path, cluster: Cluster) -> list:
    lines = [f"Reproduction configs on {cluster.name} ({cluster.gpu_memory_bytes / GB:.2f} GB, margin "
             f"{DEFAULT_MARGIN_FRACTION:.0%}); ZeRO rows C4 (Figure 7 / MP 1: P_os+g), "
             "baselines stage 0 + MP"]
    for v in judge_all(path, cluster):
        r = v.run
        lines.append(f"  Fig {r.figure} {r.model:>6} {r.system:<8} {r.gpus:>3} GPUs MP {r.mp:<3} "
                     f"L {r.layers:<3} h {r.hidden:<4} b {r.batch_per_gpu:<3} [{v.zero.label}] "
                     f"{'FITS' if v.fits else 'DOES NOT FIT'}: {v.reason}")
    return lines


def paper_report(csv_path=None, csv_only: bool = False, cluster: Cluster = PAPER_CLUSTER) -> str:
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

