"""Collects run directories into the paper's scaling table (CSV, markdown, PNG) and the run summaries."""
import argparse
import csv
import json
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# "facts §N" cites section N of docs/zero-paper-facts.md, the paper facts this project is held to.
sys.path.insert(0, str(REPO_ROOT))

from pretrain.atomic import replacing, write_atomically  # noqa: E402
from pretrain.config import RESOLVED_CONFIG  # noqa: E402
from pretrain.summary import read_records, summary_from_records  # noqa: E402
from analysis.cluster import add_cluster_flags  # noqa: E402

DEFAULT_WARMUP = 10  # steps left out of the medians: allocator growth, NCCL set-up, first-step compiles
# Only figures the facts sheet states (§4.6, §4.11); all approximate ("over", "about", "under").
# (figure, system, lowest B, highest B, metric, value, label): a point when lowest == highest, else a span.
PAPER_FIGURES = [
    (2, "zero", 100, 100, "tflops_per_gpu", 38.0, ">38 TFLOP/s/GPU at 100B"),
    (2, "zero", 100, 100, "pflops", 15.0, ">15 PFLOP/s at 100B"),
    (2, "zero", 8, 100, "pflops", 15.0, "15 PFLOP/s average, 8B-100B"),
    (2, "baseline", 40, 40, "tflops_per_gpu", 5.0, "Megatron 40B across 2 nodes ~5"),
    (2, "baseline", 0, 20, "tflops_per_gpu", 30.0, "Megatron within a node ~30"),
    # §4.11: ">40 TFLOP/s per GPU" is the average over the DP-only ZeRO runs up to 13B, not the 13B bar
    (7, "zero", 1.5, 13, "tflops_per_gpu", 40.0, "DP-only average 1.5B-13B >40"),
    (7, "baseline", 1.1, 1.45, "tflops_per_gpu", 20.0, "1.4B DDP <20"),
]
OOM = re.compile(r"CUDA out of memory|OutOfMemoryError|out of memory|oom[-_]kill", re.IGNORECASE)
SLURM_END = re.compile(r"CANCELLED AT \S+ DUE TO (TIME LIMIT|PREEMPTION|NODE FAILURE)")
EXCEPTION = re.compile(r"\b[\w.]*(Error|Exception): ")  # a Python exception line: the cause
ERROR = re.compile(r"\berror:", re.IGNORECASE)  # srun/slurmstepd errors: the symptom
RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s*")  # torch.distributed prefixes each rank's traceback
COLUMNS = ["run", "figure", "model", "shrink", "system", "config", "gpus", "mp", "batch_per_gpu", "global_batch",
           "params", "params_B", "tokens_per_s", "tflops_per_gpu", "pflops", "peak_mem_GB", "comm_elements_per_step",
           "steps", "measured_steps", "status", "reason"]


def param_count(cfg: dict) -> int:
    """Ψ of the whole model as trained and exported (python -m pretrain.export): every weight and bias, the
    vocabulary padded as at the run's TP size, the output layer unless tied — GPTShape's count of the run's model
    section (a config.json from before the architecture keys is the GPT-2 their defaults describe)."""
    import dataclasses

    from pretrain.sections import ModelConfig
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    m = ModelConfig(**{k: v for k, v in cfg["model"].items() if k in known})
    return dataclasses.replace(m.shape, vocab_divisible_by=m.make_vocab_size_divisible_by
                               * cfg["parallel"]["tensor"]).params()


def system_of(cfg: dict) -> tuple:
    """("zero" | "baseline", configuration label: C1..C5, DDP or Megatron)."""
    z, tp = cfg["zero"], cfg["parallel"]["tensor"]
    if z["stage"] == 0:
        return "baseline", "DDP" if tp == 1 else "Megatron"
    if z["stage"] == 1:
        return "zero", "C2" if z["partition_activations"] else "C1"
    if z["stage"] == 2:
        return "zero", "C5" if z["cpu_checkpointing"] else "C4" if z["partition_activations"] else "C3"
    return "zero", f"stage {z['stage']}"


def run_status(run_dir: Path, records: list, total_steps: int) -> tuple:
    """(status, reason) from status.json (written by the loop), the Slurm log, then the metrics."""
    logs = sorted(run_dir.glob("slurm-*.out"), key=lambda p: p.stat().st_mtime)
    log = logs[-1].read_text(errors="replace") if logs else ""
    oom = next((line.strip() for line in log.splitlines() if OOM.search(line)), None)
    status_file = run_dir / "status.json"
    if status_file.is_file():
        data = json.loads(status_file.read_text())
        status, reason = data.get("status", "unknown"), data.get("reason", "")
        oom = oom or next((t for t in (reason, data.get("error", "")) if t and OOM.search(t)), None)
        if status != "ok" and oom:
            return "oom", oom[:200]
        return status, reason
    if records and records[-1].get("step", 0) >= total_steps:
        return "ok", "no status.json; every step logged"
    if oom:
        return "oom", oom[:200]
    if end := SLURM_END.search(log):
        return end.group(1).lower().replace(" ", "_"), end.group(0)
    if not records and not log:
        return "missing", "no metrics.jsonl and no Slurm log"
    lines = log.splitlines()
    # the cause before the symptom: zero3d's one-line error (a refused start writes no status.json), an
    # exception, then srun's and slurmstepd's own error lines
    errors = ([ln for ln in lines if ln.startswith("error: ")] or [ln for ln in lines if EXCEPTION.search(ln)]
              or [ln for ln in lines if ERROR.search(ln)])
    last = "; " + RANK_PREFIX.sub("", errors[-1].strip())[:200] if errors else ""
    return "failed", f"no status.json; {len(records)}/{total_steps} steps logged{last}"


class CollectError(Exception):
    """A run directory that cannot be collected; the message names it and what to do."""


def load_run_config(run_dir: Path, config_path=None) -> dict:
    """The resolved config: <run_dir>/config.json (every run writes it at start), else the given TOML
    (a figure's job that never ran has no directory: its row says "missing")."""
    if run_dir.exists() and not run_dir.is_dir():
        raise CollectError(f"run directory {str(run_dir)!r} is not a directory")
    if not run_dir.exists() and config_path is None:
        raise CollectError(f"run directory {str(run_dir)!r} does not exist")
    if (run_dir / RESOLVED_CONFIG).is_file():
        return json.loads((run_dir / RESOLVED_CONFIG).read_text())
    if config_path is None:
        raise CollectError(f"{run_dir} has no {RESOLVED_CONFIG} (a run from before configs were saved); "
                           "pass the config it ran with: --config FILE.toml")
    from pretrain.config import ConfigError, load_config
    try:
        return load_config(config_path).to_dict()
    except ConfigError as err:
        raise CollectError(f"--config {config_path}: {err}") from None


def collect_run(run_dir, config_path=None, warmup: int = DEFAULT_WARMUP) -> dict:
    """One table row for a run directory."""
    run_dir = Path(run_dir)
    cfg = load_run_config(run_dir, config_path)
    m, c, t = cfg["model"], cfg["cluster"], cfg["train"]
    job = json.loads((run_dir / "job.json").read_text()) if (run_dir / "job.json").is_file() else {}
    # The ranks that trained (status.json, from rank 0) over the job's task count over the config's.
    status_file = run_dir / "status.json"
    trained = json.loads(status_file.read_text()).get("world_size") if status_file.is_file() else None
    world = trained or job.get("world_size") or c["nodes"] * c["gpus_per_node"]
    records = read_records(run_dir / "metrics.jsonl")
    summary = summary_from_records(records, warmup, world)
    status, reason = run_status(run_dir, records, t["steps"])
    if summary.get("summary/warmup_only"):
        note = (f"warm-up only: {len(records)} logged step(s), none past --warmup {warmup}; "
                "the medians include warm-up steps")
        reason = f"{reason}; {note}" if reason else note
    system, config = system_of(cfg)
    name = cfg["logging"]["name"]
    match = re.fullmatch(r"fig(\d+)_([0-9p]+B)_.*", name)
    params = param_count(cfg)
    peak = summary.get("summary/peak_mem_bytes")
    row = {"run": name, "figure": int(match.group(1)) if match else "",
           "model": match.group(2).replace("p", ".") if match else _size(params),
           "shrink": cfg.get("paper", {}).get("shrink", 1),  # slurm/sweep.py --shrink N: every shape ÷ N
           "system": system, "config": config, "gpus": world, "mp": cfg["parallel"]["tensor"],
           "batch_per_gpu": t["micro_batch_size"], "global_batch": t["global_batch_size"],
           "params": params, "params_B": round(params / 1e9, 3),
           "tokens_per_s": summary.get("summary/tokens_per_s"), "tflops_per_gpu": summary.get("summary/tflops_per_gpu"),
           "pflops": summary.get("summary/pflops"), "peak_mem_GB": peak / 1e9 if peak is not None else None,
           "comm_elements_per_step": summary.get("summary/comm_elements_per_step"),
           "steps": summary["summary/steps"], "measured_steps": summary["summary/measured_steps"],
           "warmup_only": bool(summary.get("summary/warmup_only")), "status": status, "reason": reason}
    return row


def _size(params: int) -> str:
    return f"{params / 1e9:.3g}B" if params >= 1e9 else f"{params / 1e6:.3g}M"


def figure_runs(figure, configs_dir: Path = REPO_ROOT / "configs/paper", runs_dir: Path = REPO_ROOT / "runs") -> list:
    """(run_dir, config) for every generated config of a figure (None: all), as <runs_dir>/<name>."""
    pattern = "fig*_*.toml" if figure is None else f"fig{figure}_*.toml"
    return [(runs_dir / p.stem, p) for p in sorted(configs_dir.glob(pattern))]


def order_key(r: dict) -> tuple:
    """Rows by figure, then model size (the exact count: scaled-down models round to 0.0 billion), GPUs, config."""
    return str(r["figure"]), r["params"], r["gpus"], r["config"], r["system"]


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def write_tables(rows: list, out: Path, paper: bool = True) -> list:
    """table.csv and table.md of `rows` (COLUMNS) under `out`; `paper`: list the paper's figures for comparison."""
    out.mkdir(parents=True, exist_ok=True)
    with replacing(out / "table.csv") as tmp, open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_fmt(r[c]).replace("|", "/") for c in COLUMNS) + " |" for r in rows]
    refs = [f"- figure {f}, {s}: {label} (paper, approx)" for f, s, _, _, _, _, label in PAPER_FIGURES
            if any(r["figure"] == f for r in rows)]
    text = "\n".join(lines)
    if shrinks := sorted({r.get("shrink", 1) for r in rows} - {1}):  # CPU ranks: the paper's figures do not compare
        text += (f"\n\nScaled down (slurm/sweep.py --cpu --shrink {'/'.join(map(str, shrinks))}): every model shape "
                 "÷ N on CPU ranks; `model` is the paper's row, `params` the model trained.")
    elif refs and paper:
        text += "\n\nReported in the paper:\n" + "\n".join(refs)
    text += "\n"
    write_atomically(out / "table.md", text)
    return [out / "table.csv", out / "table.md"]


def _variant(r: dict) -> str:
    return f"{r['gpus']} GPUs" if r["figure"] == 3 else r["config"] if r["figure"] in (4, 5, 6) else ""


def bar_slots(rows: list) -> tuple:
    """([(model, variant)] x groups, {row index: (x, width)}): every run its own bar, side by side inside
    its group (ZeRO before baseline, then by figure), so no two bars overlap."""
    keys, members = [], {}
    for i, r in enumerate(rows):
        key = (r["model"], _variant(r))
        if key not in members:
            keys.append(key)
            members[key] = []
        members[key].append(i)
    slots = {}
    for x, key in enumerate(keys):
        group = sorted(members[key], key=lambda i: (rows[i]["system"] != "zero", str(rows[i]["figure"])))
        width = 0.8 / len(group)
        for k, i in enumerate(group):
            slots[i] = (x - 0.4 + width * (k + 0.5), width)
    return keys, slots


def plot(rows: list, path: Path, kind: str = "measured", paper: bool = True) -> tuple:
    """Bars of TFLOP/s per GPU and aggregate PFLOP/s per run, ZeRO vs baseline, with the paper's figures
    (`paper`); `kind` names the bars in the legend ("measured", or "predicted" for --predict).

    The legend lists only what is drawn; runs whose medians include warm-up steps are hatched.
    Returns (path, legend labels).
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: order_key(r)[1:])
    keys, slots = bar_slots(rows)
    shrinks = sorted({r.get("shrink", 1) for r in rows})
    fig, axes = plt.subplots(2, 1, figsize=(max(6, 0.9 * len(keys) + 2), 8), sharex=True)
    colors = {"zero": "tab:blue", "baseline": "tab:orange"}
    names = {"zero": f"ZeRO ({kind})", "baseline": f"baseline ({kind})"}
    legend = {}
    for ax, metric, label in zip(axes, ("tflops_per_gpu", "pflops"), ("TFLOP/s per GPU", "aggregate PFLOP/s")):
        for i, r in enumerate(rows):
            x, width = slots[i]
            if r[metric] is not None and r["status"] == "ok":
                hatch = "//" if r.get("warmup_only") else None
                ax.bar(x, r[metric], width=width, color=colors[r["system"]], hatch=hatch, edgecolor="black")
                legend[names[r["system"]]] = plt.Rectangle((0, 0), 1, 1, color=colors[r["system"]])
                if hatch:
                    legend["median includes warm-up steps"] = plt.Rectangle(
                        (0, 0), 1, 1, facecolor="white", edgecolor="black", hatch=hatch)
            else:
                ax.text(x, 0, r["status"], rotation=90, ha="center", va="bottom", fontsize=8)
        for figure, system, lo, hi, key, value, text in PAPER_FIGURES if shrinks == [1] and paper else ():
            # a point belongs to the run of that size label; a span to the runs inside it (±10%)
            idx = [i for i, r in enumerate(rows) if key == metric and r["system"] == system
                   and r["figure"] in (figure, "")
                   and (r["model"] == f"{lo:g}B" if lo == hi else 0.9 * lo <= r["params_B"] <= 1.1 * hi)]
            if idx:  # over exactly those runs' bars
                left = min(slots[i][0] - slots[i][1] / 2 for i in idx)
                right = max(slots[i][0] + slots[i][1] / 2 for i in idx)
                ax.hlines(value, left, right, colors="black", linestyles="--")
                ax.annotate(text, (left, value), fontsize=7, xytext=(0, 3), textcoords="offset points")
                legend["paper, approx"] = plt.Line2D([0], [0], color="black", linestyle="--")
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    if legend:
        fig.legend(handles=list(legend.values()), labels=list(legend), loc="upper center", ncol=2, fontsize=8)
    psi = {(r["model"], _variant(r)): _size(r["params"]) for r in rows}
    ticks = [f"{m}\n{v}" if v else m for m, v in keys]
    if shrinks != [1]:  # the paper's row, then the scaled-down model that ran for it
        ticks = [f"{t}\n{psi[key]}" for t, key in zip(ticks, keys)]
        worlds = sorted({r["gpus"] for r in rows})
        axes[0].set_title(f"scaled down (slurm/sweep.py --shrink {'/'.join(map(str, shrinks))}): every shape ÷ N, "
                          f"{'/'.join(map(str, worlds))} CPU ranks; the paper's figures not drawn", fontsize=9)
    axes[1].set_xticks(range(len(keys)), ticks, fontsize=8)
    axes[1].set_xlabel("model size (paper's row" + (", then the model trained)" if shrinks != [1] else ")"))
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp:
        fig.savefig(tmp, dpi=120, format=path.suffix.lstrip(".") or "png")
    plt.close(fig)
    return path, list(legend)


def predict(parser, args) -> int:
    """--predict: the predicted Figure 2 table on the described cluster, as table.csv / table.md / scaling.png."""
    from analysis.cluster import PAPER_CLUSTER, spec_from_args
    from analysis.predict_table import default_csv, format_rows, predict_rows
    try:
        cluster = spec_from_args(args).cluster(args.precision)
        rows = predict_rows(cluster, default_csv(), args.sizes.split(",") if args.sizes else None, args.precision)
    except (ValueError, OSError) as err:
        parser.error(str(err))
    out, paper = Path(args.out), cluster == PAPER_CLUSTER
    written = write_tables(rows, out, paper=paper)
    if not args.no_plot:
        written.append(plot(rows, out / "scaling.png", kind="predicted", paper=paper)[0])
    print(format_rows(cluster, rows))
    print("wrote " + ", ".join(map(str, written)))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="slurm/collect.py", description=__doc__)
    parser.add_argument("run_dirs", nargs="*", help="run directories (runs/<name>)")
    parser.add_argument("--figure", type=int, help="every generated config of this figure, as runs/<name>")
    parser.add_argument("--all", action="store_true", help="every generated config")
    parser.add_argument("--out", default="results", help="directory for table.csv, table.md, scaling.png")
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, help="steps left out of the medians")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--config", help="the TOML the given run directories ran with, for a run without config.json")
    parser.add_argument("--runs-dir", default=str(REPO_ROOT / "runs"),
                        help="with --figure/--all: where the runs are, DIR/<name> (a --shrink N sweep: runs/shrinkN)")
    parser.add_argument("--predict", action="store_true",
                        help="no runs: Figure 2's ZeRO rows predicted on the described cluster (analysis."
                             "predict_table), written as the measured table and plot are")
    parser.add_argument("--sizes", help="with --figure/--all or --predict: the rows to keep, e.g. 8B,20B (default: all)")
    parser.add_argument("--precision", choices=["fp16", "bf16", "fp32"], default="fp16", help="--predict's dtype")
    add_cluster_flags(parser)
    args = parser.parse_args(argv)
    if args.predict:
        return predict(parser, args)
    runs = [(Path(d), args.config) for d in args.run_dirs]
    for d in args.run_dirs:  # named on the command line: it must be there
        if not Path(d).is_dir():
            print(f"error: run directory {d!r} does not exist" if not Path(d).exists() else
                  f"error: run directory {d!r} is not a directory", file=sys.stderr)
            return 2
    if args.figure is not None or args.all:
        from slurm.sweep import select_sizes
        found = figure_runs(args.figure, runs_dir=Path(args.runs_dir))
        try:
            picked = select_sizes([cfg for _, cfg in found], args.sizes.split(",") if args.sizes else None)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        runs += [(d, cfg) for d, cfg in found if cfg in picked]
    elif args.sizes:
        parser.error("--sizes picks rows of --figure N, --all or --predict")
    if not runs:
        parser.error("give run directories, --figure N or --all")
    try:
        rows = [collect_run(d, cfg, args.warmup) for d, cfg in runs]
    except CollectError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    rows.sort(key=order_key)
    out = Path(args.out)
    written = write_tables(rows, out)
    if not args.no_plot:
        written.append(plot(rows, out / "scaling.png")[0])
    print((out / "table.md").read_text())
    print("wrote " + ", ".join(map(str, written)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
