"""Submits every generated job of a paper figure (or all of them) and prints the Slurm job ids."""
import argparse
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
from pretrain.config import ConfigError, load_config  # noqa: E402
from slurm.submit import build_job, launch_preview, submit  # noqa: E402

CONFIGS = REPO_ROOT / "configs/paper"
OOM_OVERRIDE = "train.ignore_memory_estimate=true"  # --include-oom: let the paper's out-of-memory jobs run out


def figure_configs(figure=None, configs_dir: Path = CONFIGS) -> list:
    pattern = "fig*_*.toml" if figure is None else f"fig{figure}_*.toml"
    found = sorted(configs_dir.glob(pattern))
    if not found:
        have = sorted({int(m[1]) for p in configs_dir.glob("fig*_*.toml") if (m := re.match(r"fig(\d+)_", p.name))})
        if have:
            raise FileNotFoundError(f"--figure {figure} is invalid: {configs_dir} has no {pattern}; valid figures: "
                                    + ", ".join(map(str, have)))
        raise FileNotFoundError(f"no {pattern} in {configs_dir}; run configs/generate_paper.py --out {configs_dir}")
    return found


def node_overrides(path: Path, gpus_per_node) -> list:
    """Re-spread a job's GPUs over nodes of `gpus_per_node` GPUs, keeping the world size the paper used."""
    if gpus_per_node is None:
        return []
    cluster = load_config(path).cluster
    world = cluster.nodes * cluster.gpus_per_node
    nodes = -(-world // gpus_per_node)
    if world % nodes:
        raise ConfigError(f"{path.name}: {world} GPUs cannot be spread evenly over {gpus_per_node}-GPU nodes")
    return [f"cluster.nodes={nodes}", f"cluster.gpus_per_node={world // nodes}"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="slurm/sweep.py", description=__doc__)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--figure", type=int, help="appendix figure number: 2, 3, 4, 5, 6 or 7")
    which.add_argument("--all", action="store_true", help="every generated job")
    parser.add_argument("overrides", nargs="*", help="section.key=value for every job, e.g. precision.dtype=fp16")
    parser.add_argument("--dry-run", action="store_true", help="print each sbatch command; submit nothing")
    parser.add_argument("--gpus-per-node", type=int, help="nodes with this many GPUs (default: the configs' 16)")
    parser.add_argument("--group", help="W&B group for the sweep's runs (default: figN, from the configs)")
    parser.add_argument("--container", metavar="IMAGE", help="pyxis/enroot image for the ranks")
    parser.add_argument("--requeue", action="store_true", help="requeue after preemption / SIGUSR1 checkpoints")
    parser.add_argument("--cpu", action="store_true", help="CPU ranks (local test cluster)")
    parser.add_argument("--sbatch", action="append", default=[], metavar="ARG", help="extra sbatch argument")
    parser.add_argument("--include-oom", action="store_true",
                        help='also submit jobs the paper reports out of memory ([paper] expected = "oom"), with '
                             f'{OOM_OVERRIDE} so they really run out of memory; collect.py marks them oom')
    parser.add_argument("--configs-dir", default=str(CONFIGS),
                        help="generated configs (default configs/paper; configs/generate_paper.py --out writes others)")
    args = parser.parse_args(argv)
    try:
        paths = figure_configs(None if args.all else args.figure, Path(args.configs_dir))
        jobs, skipped = [], []
        for path in paths:  # build (and so validate) every job before submitting any
            overrides = node_overrides(path, args.gpus_per_node) + list(args.overrides)
            if args.group:
                overrides.append(f"logging.wandb_group={args.group}")
            job = build_job(str(path), overrides, cpu=args.cpu, container=args.container,
                            requeue=args.requeue, extra_sbatch=args.sbatch)
            if job.cfg.paper.expected == "oom" and not args.include_oom:
                skipped.append(job)
            elif job.cfg.paper.expected == "oom":
                # the start-up guard would refuse it (exit 2) before the OOM the paper reports could happen
                jobs.append(build_job(str(path), overrides + [OOM_OVERRIDE], cpu=args.cpu, container=args.container,
                                      requeue=args.requeue, extra_sbatch=args.sbatch))
            else:
                jobs.append(job)
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for job in skipped:
        print(f"skipped {job.name}: {job.cfg.paper.reason} (--include-oom submits it)", file=sys.stderr)
    failures = 0
    for job in jobs:
        for note in job.notes:
            print(f"note: {job.name}: {note}", file=sys.stderr)
        if args.dry_run:
            print(f"{job.name}: {job.command_line()}")
            print("    " + launch_preview(job).strip().replace("\n", "\n    "))
            continue
        try:
            print(f"{job.name}\t{submit(job)}", flush=True)
        except (RuntimeError, OSError) as err:
            failures += 1
            print(f"{job.name}\tFAILED: {err}", file=sys.stderr, flush=True)
    if args.dry_run:
        print(f"{len(jobs)} jobs (dry run, nothing submitted); {len(skipped)} the paper reports out of memory "
              "skipped")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
