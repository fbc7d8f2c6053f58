"""Validates a config and submits it to Slurm through slurm/launch.sbatch (or prints what it would submit)."""
import argparse
import dataclasses
import hashlib
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parent.parent
# The repo's own code, not an installed copy (the container's image has one under /workspace).
sys.path.insert(0, str(REPO_ROOT))
from pretrain.config import Config, ConfigError, load_config, validate_layout  # noqa: E402
from pretrain.errors import EXIT_INPUT  # noqa: E402
from pretrain.runtime.lock import SINGLETON_VARIABLE  # noqa: E402

LAUNCHER = "slurm/launch.sbatch"
# SIGUSR1 warning before the time limit: the loop stops at the next step boundary and every rank then
# writes its checkpoint shard, so the warning must cover one step plus the whole checkpoint's write.
WARNING_SAFETY = 2.0  # file systems slow down when every rank writes at once
WARNING_SLACK_S = 60  # the agreed stop, the barriers, status.json, srun's teardown
WARNING_FLOOR_S = 180
WARNING_MAX_S = 65535  # Slurm's limit for --signal=SIG@TIME


@dataclass
class Job:
    """One sbatch submission: its command line, the environment it adds, and the config it runs."""

    config_path: str
    overrides: list
    cfg: Config
    world_size: int
    sbatch: list
    env: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.cfg.logging.name

    def command_line(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return (env + " " if env else "") + shlex.join(self.sbatch)


def checkpoint_bytes(cfg: Config) -> float:
    """Bytes one checkpoint writes, whatever the world size and ZeRO stage: each element once
    (pretrain/checkpoint/checkpointer.py), the model in its training dtype plus the fp32 master and Adam's two
    moments: 2Ψ + 12Ψ (fp16/bf16), 4Ψ + 12Ψ (fp32), Ψ the whole model's parameters (the estimator's
    count, vocabulary padded as at this TP size); the headers (manifest, DCP metadata) are negligible."""
    from analysis.estimate import PRECISIONS
    m = cfg.model
    psi = dataclasses.replace(m.shape, vocab_divisible_by=m.make_vocab_size_divisible_by * cfg.parallel.tensor).params()
    return (PRECISIONS[cfg.precision.dtype].param_bytes + 12) * psi


def step_seconds(cfg: Config, nodes: int) -> float:
    """One training step of cfg's layout on `nodes` nodes of its [cluster] as the planner models it
    (pretrain/plan.py's config_step: the compute at the share of peak docs/gpu-check.md's rows measured along the
    config's kernel path, exposed communication, offload traffic, the pipeline's bubble)."""
    from pretrain.plan import config_step
    return config_step(dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, nodes=nodes)))["step_s"]


def warning_seconds(cfg: Config, nodes: int) -> int:
    """--signal=USR1@T: T covers one step (step_seconds, the planner's) plus the checkpoint's write at
    cluster.checkpoint_write_gbps, times WARNING_SAFETY, plus slack; at least WARNING_FLOOR_S."""
    write = checkpoint_bytes(cfg) / (cfg.cluster.checkpoint_write_gbps * 1e9)
    needed = WARNING_SAFETY * (write + step_seconds(cfg, nodes)) + WARNING_SLACK_S
    return int(min(WARNING_MAX_S, max(WARNING_FLOOR_S, -(-needed // 1))))


TIME_FORMS = "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS"


def time_limit_seconds(text: str) -> int:
    """Slurm's --time in any of its forms (TIME_FORMS; "1-12" is a day and 12 hours) → seconds; ValueError
    naming the bad value otherwise."""
    days, dash, clock = str(text).strip().partition("-")
    if not dash:
        days, clock = "", days
    fields = clock.split(":")
    if not all(f.isdigit() for f in fields + ([days] if dash else [])) or len(fields) > 3:
        raise ValueError(f"time limit {text!r} is invalid; Slurm's forms: {TIME_FORMS}")
    numbers = [int(f) for f in fields]
    if dash:  # D-HH, D-HH:MM, D-HH:MM:SS: hours first
        hours, minutes, seconds = numbers + [0] * (3 - len(numbers))
    elif len(numbers) == 3:  # HH:MM:SS
        hours, minutes, seconds = numbers
    else:  # MM, MM:SS: minutes first
        hours, (minutes, seconds) = 0, (numbers + [0])[:2]
    return int(days or 0) * 86400 + hours * 3600 + minutes * 60 + seconds


def tensor_span(cfg: Config) -> str:
    """Megatron's TP groups are runs of consecutive ranks and Slurm fills each node with consecutive ranks:
    a group that straddles a node boundary while others do not is refused (ConfigError); groups of whole
    nodes (TP a multiple of cluster.gpus_per_node, as the paper's 16-way MP on 8-GPU nodes) are allowed with
    the returned note, since their all-reduces (and Pa's all-gathers, which run over the TP group) then
    cross the inter-node network; "" when every group lies inside one node."""
    c, tp = cfg.cluster, cfg.parallel.tensor
    if c.nodes == 1 or c.gpus_per_node % tp == 0:
        return ""
    pa = " and activation partitioning (Pa)" if cfg.zero.partition_activations else ""
    if tp % c.gpus_per_node:
        raise ConfigError(f"parallel.tensor = {tp} neither divides nor is a multiple of cluster.gpus_per_node = "
                          f"{c.gpus_per_node}: some tensor-parallel{pa} groups would straddle a node boundary",
                          fix="choose parallel.tensor dividing cluster.gpus_per_node (or a multiple of it)")
    return (f"parallel.tensor = {tp} > cluster.gpus_per_node = {c.gpus_per_node}: each tensor-parallel{pa} group "
            f"spans {tp // c.gpus_per_node} nodes, so its collectives cross the inter-node network "
            "(the paper keeps ZeRO's inside one node)")


def node_counts(cfg: Config) -> range:
    """The node counts a job may get: cluster.min_nodes..cluster.nodes (just cluster.nodes when not elastic)."""
    c = cfg.cluster
    return range(c.nodes if c.min_nodes is None else c.min_nodes, c.nodes + 1)


def nodes_arg(cfg: Config) -> str:
    """sbatch's --nodes: "N", or "MIN-MAX" for an elastic job (the run's DP size follows the allocation)."""
    counts = node_counts(cfg)
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"


def job_name(cfg: Config, run_dir: Path) -> str:
    """The Slurm job name of a run directory: the run's name and 8 hex digits of the directory's absolute path, so
    jobs writing one directory share it (and wait for each other: --dependency=singleton), and others do not."""
    return f"{cfg.logging.name}-{hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:8]}"


def build_job(config_path: str, overrides=(), cpu: bool = False, container=None, requeue: bool = False,
              extra_sbatch=()) -> Job:
    """Load + validate (world = nodes × gpus_per_node) and build the sbatch command; raises ConfigError."""
    overrides = list(overrides)
    cfg = load_config(config_path, overrides)
    # The job runs in the repo root: name the config relative to it (or absolutely, if outside).
    path = Path(config_path).resolve()
    config_path = str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)
    c = cfg.cluster
    world = c.nodes * c.gpus_per_node
    for count in node_counts(cfg):  # an elastic job must train at every node count it may be given
        try:
            validate_layout(cfg, count * c.gpus_per_node)
        except ConfigError as err:
            if count == c.nodes:
                raise
            raise ConfigError(f"cluster.min_nodes = {c.min_nodes}: on {count} node(s) of {c.gpus_per_node}: {err}",
                              fix="raise cluster.min_nodes, or choose a train.global_batch_size every node count "
                                  "in the range divides") from None
    try:
        limit = time_limit_seconds(c.time_limit)
    except ValueError:
        raise ConfigError(f"cluster.time_limit = {c.time_limit!r} is invalid; Slurm's forms: {TIME_FORMS}") from None
    run_dir = cfg.run_dir if cfg.run_dir.is_absolute() else REPO_ROOT / cfg.run_dir
    warning = warning_seconds(cfg, min(node_counts(cfg)))  # an elastic job's fewest nodes step the slowest
    elastic = len(node_counts(cfg)) > 1
    # An elastic job holds whole nodes and no task count: Slurm pins a job's task count to its first
    # allocation's, so a requeue after a lost node could never start on fewer nodes. launch.sbatch starts
    # ZERO3D_TASKS_PER_NODE ranks on each node it got instead.
    tasks = [] if elastic else [f"--ntasks-per-node={c.gpus_per_node}"]
    # One job at a time per run directory: Slurm's singleton dependency holds a job until every earlier job of its
    # name (and user) has ended, and the name is the run directory's (pretrain/runtime/lock.py relies on both).
    sbatch = ["sbatch", "--parsable", f"--job-name={job_name(cfg, run_dir)}", "--dependency=singleton",
              f"--nodes={nodes_arg(cfg)}", *tasks,
              f"--time={c.time_limit}", f"--signal=USR1@{warning}", f"--output={run_dir}/slurm-%j.out",
              f"--chdir={REPO_ROOT}"]
    if elastic and cpu:
        sbatch.append("--exclusive")
    if not cpu:
        # Whole nodes: throughput numbers from shared nodes are not comparable; --mem=0 gives the job
        # all host memory (Pa+cpu keeps activation checkpoints there).
        sbatch += [f"--gpus-per-node={c.gpus_per_node}", "--exclusive", "--mem=0"]
    if c.partition:
        sbatch.append(f"--partition={c.partition}")
    sbatch.append("--requeue" if requeue else "--no-requeue")
    sbatch += list(extra_sbatch)
    sbatch += [LAUNCHER, str(config_path), *overrides]
    env = {"ZERO3D_TASKS_PER_NODE": str(c.gpus_per_node)} if elastic else {}
    env[SINGLETON_VARIABLE] = "1"
    if container:
        env["ZERO3D_CONTAINER"] = container
    if requeue:  # without it launch.sbatch follows the job's own Slurm flag (--no-requeue here: no requeue)
        env["ZERO3D_REQUEUE"] = "1"
    notes = []
    if warning >= limit:
        notes.append(f"the stop warning (USR1 {warning} s before the limit, for a "
                     f"{checkpoint_bytes(cfg) / 1e9:.0f} GB checkpoint at cluster.checkpoint_write_gbps = "
                     f"{c.checkpoint_write_gbps:g}) is longer than cluster.time_limit = {c.time_limit}: "
                     "the run stops at its first step")
    span = tensor_span(cfg)
    if span:
        notes.append(span)
    return Job(str(config_path), overrides, cfg, world, sbatch, env, notes)


def launch_preview(job: Job) -> str:
    """What launch.sbatch will run for this job, from the script itself in its dry-run mode."""
    env = dict(os.environ, **job.env, ZERO3D_DRY_RUN="1", SLURM_JOB_ID="0", SLURM_SUBMIT_DIR=str(REPO_ROOT))
    proc = subprocess.run(["bash", str(REPO_ROOT / LAUNCHER), job.config_path, *job.overrides],
                          env=env, capture_output=True, text=True, cwd=REPO_ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{LAUNCHER} dry run failed: {proc.stderr}")
    return proc.stdout.replace("MASTER_PORT=20000", "MASTER_PORT=<20000 + job id % 10000>")


def submit(job: Job) -> str:
    """Create the run dir (sbatch writes slurm-%j.out there) and submit; returns the job id."""
    out = next(a for a in job.sbatch if a.startswith("--output=")).split("=", 1)[1]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(job.sbatch, env=dict(os.environ, **job.env), capture_output=True, text=True,
                          cwd=REPO_ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"sbatch failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout.strip().split(";")[0]  # --parsable: "jobid" or "jobid;cluster"


class Unstartable(Exception):
    """The job cannot start (slurm/startable.py): one line per reason, exit EXIT_INPUT."""


def refuse_unstartable(cfg: Config, world: int, memory: bool = True, container: Optional[str] = None) -> None:
    """Raise Unstartable with every reason this job cannot start, checked from the repository root; `memory`:
    also the layout against cluster.gpu_memory_gb (not for CPU ranks, nor in the job, where the start-up guard
    judges the real devices); `container`: the paths as the container will see them (slurm/mounts.py: each inside
    a mount, checked at the mount's source here)."""
    from slurm.mounts import MOUNTS_VARIABLE, host_view
    from slurm.startable import refusals
    view, reasons = (cfg, []) if not container else host_view(cfg, REPO_ROOT, os.environ.get(MOUNTS_VARIABLE, ""))
    if view is not None:
        reasons = refusals(view, world, REPO_ROOT, memory)
    if reasons:
        raise Unstartable("\n".join(f"cannot start {cfg.logging.name}: {r}" for r in reasons))


def preflight(config_path: str, overrides: list, world: int) -> Path:
    """Inside the job, once, before hundreds of ranks start: validate for the job's `world` ranks
    (launch.sbatch passes the job's SLURM_NTASKS: in a one-task container step the step's own is 1) and
    return run_dir. It writes nothing: rank 0 writes config.json and job.json once the run has passed
    every start check (a refused start leaves a finished run's records as they were)."""
    cfg = load_config(config_path, overrides)
    validate_layout(cfg, world)
    refuse_unstartable(cfg, world, memory=False)
    return cfg.run_dir


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="slurm/submit.py", description=__doc__)
    parser.add_argument("--config", required=True, help="TOML config; its [cluster] sizes the job")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.steps=20")
    parser.add_argument("--dry-run", action="store_true", help="print the commands and config; submit nothing")
    parser.add_argument("--cpu", action="store_true",
                        help="CPU ranks (local test cluster): no --gpus, nodes × gpus_per_node tasks")
    parser.add_argument("--container", metavar="IMAGE", help="run the ranks in this pyxis/enroot image")
    parser.add_argument("--requeue", action=argparse.BooleanOptionalAction, default=True,
                        help="requeue on preemption, or when the ranks stop after a SIGUSR1 checkpoint (default on; "
                             "--no-requeue: the job ends with exit 75 and is resubmitted by hand)")
    parser.add_argument("--sbatch", action="append", default=[], metavar="ARG",
                        help="extra sbatch argument, e.g. --sbatch=--account=abc (repeatable)")
    parser.add_argument("--preflight", action="store_true", help=argparse.SUPPRESS)  # launch.sbatch's own step
    parser.add_argument("--world-size", type=int, help=argparse.SUPPRESS)  # the job's task count, for --preflight
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.preflight:
            if not args.world_size or args.world_size < 1:
                print(f"--preflight needs --world-size N >= 1 (the job's task count), got {args.world_size}",
                      file=sys.stderr)
                return 2
            print(preflight(args.config, args.overrides, args.world_size))
            return 0
        job = build_job(args.config, args.overrides, cpu=args.cpu, container=args.container,
                        requeue=args.requeue, extra_sbatch=args.sbatch)
        refuse_unstartable(job.cfg, job.world_size, memory=not args.cpu, container=args.container)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    except Unstartable as err:
        print(err, file=sys.stderr)
        return EXIT_INPUT
    for note in job.notes:
        print(f"note: {job.name}: {note}", file=sys.stderr)
    if args.dry_run:
        print(f"# job {job.name}: {nodes_arg(job.cfg)} node(s) × {job.cfg.cluster.gpus_per_node} "
              f"{'CPU rank(s)' if args.cpu else 'GPU(s)'} = {job.world_size} ranks")
        print(f"sbatch:    {job.command_line()}")
        print(launch_preview(job), end="")
        print(json.dumps(job.cfg.to_dict(), indent=2))
        return 0
    try:
        job_id = submit(job)
    except (RuntimeError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(job_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
