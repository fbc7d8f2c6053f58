"""Submits every generated job of a paper figure (or all of them) and prints the Slurm job ids."""
import argparse
import math
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
from pretrain.config import ConfigError, load_config  # noqa: E402
from slurm.submit import EXIT_INPUT, Unstartable, build_job, launch_preview, refuse_unstartable, submit  # noqa: E402

CONFIGS = REPO_ROOT / "configs/paper"
OOM_OVERRIDE = "train.ignore_memory_estimate=true"  # --include-oom: let the paper's out-of-memory jobs run out
MIN_VOCAB = 512  # --shrink: sentencepiece's 256 byte pieces plus room for learned ones
# --shrink: GPT-2's 50,257 ids (the paper configs' tokenizer) would index past the shrunk embedding, so the scaled-down
# jobs go back to the default tokenizer, a sentencepiece of the shrunk vocabulary trained from the demo corpus.
SHRUNK_TOKENIZER = ["~data.tokenizer_kind", "~data.tokenizer_model", "~data.tokenizer_merges"]


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


def size_label(path: Path) -> str:
    """The paper's row label of a generated config, as the CSV writes it: fig2_1p5B_zero.toml -> "1.5B"."""
    return path.stem.split("_")[1].replace("p", ".")


def select_sizes(paths: list, sizes) -> list:
    """The configs of the given rows (labels such as "1.5B", "100B"; None: all), in their order."""
    if not sizes:
        return paths
    valid = sorted({size_label(p) for p in paths}, key=lambda label: float(label[:-1]))
    bad = [s for s in sizes if s not in valid]
    if bad:
        raise ConfigError(f"--sizes {bad[0]} is not a row of these configs; valid: {', '.join(valid)}")
    return [p for p in paths if size_label(p) in sizes]


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


def paper_size(name: str) -> float:
    """The paper's model size in billions from a job name: fig2_1p5B_zero -> 1.5."""
    match = re.fullmatch(r"fig\d+_([0-9p]+)B_.*", name)
    if not match:
        raise ConfigError(f"{name!r} is not a paper job name (figN_<size>B_...): --shrink keeps the paper's rows")
    return float(match.group(1).replace("p", "."))


def shrink_plan(cfg, n: int, nodes: int, ranks_per_node: int) -> dict:
    """A paper job scaled down to nodes × ranks_per_node CPU ranks, every shape ÷ n; {override key: value}.

    Layers, heads, sequence, vocabulary (at least MIN_VOCAB) and micro-batch: ÷ n rounded up. TP: gcd(paper
    TP, ranks per node), so each TP group stays inside a node (the paper's TPs are powers of 2). Heads: then
    rounded up to a multiple of TP; hidden: ÷ n rounded up to a multiple of the heads. Global batch:
    micro-batch × DP, one micro-batch per step as in every paper job. The paper's GPU count becomes
    nodes × ranks_per_node; precision, ZeRO stage and settings stay the paper's.
    """
    m, world = cfg.model, nodes * ranks_per_node
    tp = math.gcd(cfg.parallel.tensor, ranks_per_node)
    heads = -(-(-(-m.num_attention_heads // n)) // tp) * tp
    micro = -(-cfg.train.micro_batch_size // n)
    return {"model.num_layers": -(-m.num_layers // n), "model.hidden_size": -(-m.hidden_size // (n * heads)) * heads,
            "model.num_attention_heads": heads, "model.seq_length": -(-m.seq_length // n),
            "model.vocab_size": max(MIN_VOCAB, -(-m.vocab_size // n)), "parallel.tensor": tp,
            "train.micro_batch_size": micro, "train.global_batch_size": micro * (world // tp),
            "cluster.nodes": nodes, "cluster.gpus_per_node": ranks_per_node, "paper.shrink": n}


def shrunk_params(cfg, plan: dict) -> int:
    """Ψ of the scaled-down model (the estimator's count, as slurm/collect.py reports it)."""
    import dataclasses
    ffn = None if cfg.model.ffn_hidden_size is None else -(-cfg.model.ffn_hidden_size // plan["paper.shrink"])
    heads = plan.get("model.num_attention_heads", cfg.model.num_attention_heads)
    heads = math.gcd(heads, plan["model.hidden_size"])  # a plan that keeps the paper's heads: any divisor counts the same
    groups = cfg.model.num_query_groups and math.gcd(cfg.model.num_query_groups, heads)
    return dataclasses.replace(cfg.model.shape, layers=plan["model.num_layers"], hidden=plan["model.hidden_size"],
                               heads=heads, seq=plan["model.seq_length"],
                               vocab=plan["model.vocab_size"], ffn=ffn, query_groups=groups,
                               vocab_divisible_by=cfg.model.make_vocab_size_divisible_by * plan["parallel.tensor"]
                               ).params()


def out_of_order(cfgs: dict, n: int, nodes: int, ranks_per_node: int):
    """The first two jobs (by paper size) whose order of model size --shrink n would reverse or tie, or None."""
    sized = sorted((paper_size(name), shrunk_params(cfg, shrink_plan(cfg, n, nodes, ranks_per_node)), name)
                   for name, cfg in cfgs.items())
    return next(((a, b) for a in sized for b in sized if a[0] < b[0] and a[1] >= b[1]), None)


def shrink_overrides(paths: list, n: int, nodes: int, ranks_per_node: int, runs_dir: str) -> dict:
    """{config path: overrides} for --cpu --shrink n (the tokenizer: SHRUNK_TOKENIZER); raises ConfigError where the
    paper's size order is lost."""
    cfgs = {p.stem: load_config(p) for p in paths}
    if bad := out_of_order(cfgs, n, nodes, ranks_per_node):
        (_, pa, a), (_, pb, b) = bad
        best = next(k for k in range(n - 1, 0, -1) if out_of_order(cfgs, k, nodes, ranks_per_node) is None)
        raise ConfigError(f"--shrink {n} is invalid for these jobs: {a} (Ψ = {pa:,}) would not be smaller than "
                          f"{b} (Ψ = {pb:,}), as in the paper; the largest --shrink that keeps the order: {best}")
    return {p: [f"{k}={v}" for k, v in shrink_plan(cfgs[p.stem], n, nodes, ranks_per_node).items()]
            + SHRUNK_TOKENIZER + [f"logging.run_dir={runs_dir}/{p.stem}",
                                  f"logging.wandb_group={cfgs[p.stem].logging.wandb_group}-shrink{n}"] for p in paths}


def describe_shrunk(cfg) -> str:
    """One dry-run line: the scaled-down shape a job trains, beside the paper's size."""
    m, world = cfg.model, cfg.cluster.nodes * cfg.cluster.gpus_per_node
    plan = {"model.num_layers": m.num_layers, "model.hidden_size": m.hidden_size, "model.vocab_size": m.vocab_size,
            "model.seq_length": m.seq_length, "parallel.tensor": cfg.parallel.tensor, "paper.shrink": 1}
    return (f"÷{cfg.paper.shrink}: {m.num_layers} layers × hidden {m.hidden_size}, {m.num_attention_heads} heads, "
            f"seq {m.seq_length}, vocab {m.vocab_size}, TP {cfg.parallel.tensor} × DP {world // cfg.parallel.tensor} "
            f"on {cfg.cluster.nodes} × {cfg.cluster.gpus_per_node} ranks, micro-batch {cfg.train.micro_batch_size}, "
            f"Ψ = {shrunk_params(cfg, plan):,} (paper: {paper_size(cfg.logging.name):g}B)")


def shrink_errors(args) -> str:
    """The one-line error for --shrink/--nodes/--ranks-per-node misuse, or ''."""
    if args.shrink is None:
        if args.nodes is not None or args.ranks_per_node is not None or args.runs_dir is not None:
            return "--nodes, --ranks-per-node and --runs-dir size a scaled-down sweep: they need --cpu --shrink N"
        return ""
    if not args.cpu:
        return f"--shrink {args.shrink} needs --cpu: it maps the paper's GPUs to CPU ranks"
    if args.gpus_per_node is not None:
        return "--gpus-per-node does not apply with --shrink: give --nodes and --ranks-per-node (CPU ranks)"
    for flag, value in (("--shrink", args.shrink), ("--nodes", args.nodes), ("--ranks-per-node", args.ranks_per_node)):
        if value is not None and value < 1:
            return f"{flag} {value} is invalid; must be an integer >= 1"
    return ""


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
    parser.add_argument("--shrink", type=int, metavar="N",
                        help="with --cpu: the same rows with every model shape ÷ N on CPU ranks (shrink_plan)")
    parser.add_argument("--nodes", type=int, help="with --shrink: nodes per job (default 2)")
    parser.add_argument("--ranks-per-node", type=int, help="with --shrink: CPU ranks per node (default 2)")
    parser.add_argument("--runs-dir", help="with --shrink: run directories DIR/<name> (default runs/shrinkN)")
    parser.add_argument("--sizes", help="only these rows, e.g. 1.5B,100B (default: every row)")
    args = parser.parse_args(argv)
    if error := shrink_errors(args):
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        paths = figure_configs(None if args.all else args.figure, Path(args.configs_dir))
        # the shrink keeps every row's size order, so it is planned over the whole figure before --sizes picks rows
        shrunk = {} if args.shrink is None else shrink_overrides(
            paths, args.shrink, args.nodes or 2, args.ranks_per_node or 2, args.runs_dir or f"runs/shrink{args.shrink}")
        paths = select_sizes(paths, args.sizes.split(",") if args.sizes else None)
        jobs, skipped = [], []
        for path in paths:  # build (and so validate) every job before submitting any
            overrides = node_overrides(path, args.gpus_per_node) + shrunk.get(path, []) + list(args.overrides)
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
    unstartable = []  # every job checked before any is queued (slurm/startable.py)
    for job in jobs:
        try:
            refuse_unstartable(job.cfg, job.world_size, memory=not args.cpu, container=args.container)
        except Unstartable as err:
            unstartable.append(str(err))
    if unstartable:
        print("\n".join(unstartable), file=sys.stderr)
        return EXIT_INPUT
    failures = 0
    for job in jobs:
        for note in job.notes:
            print(f"note: {job.name}: {note}", file=sys.stderr)
        if args.dry_run:
            print(f"{job.name}: {job.command_line()}")
            if args.shrink is not None:
                print("    " + describe_shrunk(job.cfg))
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
