"""Rank-local probe: one rank of a configured job runs whole training steps of pretrain's own code on
fake tensors and a fake process group (or, with --real, on real tensors of the local device), and
reports its memory peak per category and phase beside zero3d's estimate.

    python -m pretrain.probe --config configs/paper/fig2_100B_zero.toml [section.key=value ...]
        [--world 400] [--rank 17] [--steps 2] [--memory-gb GiB (default cluster.gpu_memory_gb)] [--real]
        [--profile DIR] [--json]
    python -m pretrain.probe --max-model [--verify] [--memory-gb 32] [--json]

Device semantics (fake mode): tensors are CPU fake tensors that hold no data; every storage the rank
would allocate on its GPU is counted at numel × element size. Host memory (Pa+cpu checkpoints) is
reported apart. Collectives run on torch's `fake` backend: they do nothing but keep shapes.
"""
import argparse
import sys
from pathlib import Path

from pretrain.config import ConfigError, load_config, validate_layout
from pretrain.probe.commands import max_model_command, probe_command
from pretrain.probe.rank import refuse_what_fake_tensors_cannot_run

MAX_MODEL_MEMORY_GB = 32.0  # --max-model studies the paper's C1-C5 on its 32 GB V100s


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m pretrain.probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="TOML config (defaults apply where it is silent)")
    ap.add_argument("overrides", nargs="*", help="section.key=value, e.g. zero.stage=2")
    ap.add_argument("--world", type=int, help="world size (default: cluster.nodes × cluster.gpus_per_node)")
    ap.add_argument("--rank", type=int, default=0, help="which rank to probe (default 0)")
    ap.add_argument("--steps", type=int, default=2, help="training steps (default 2: optimizer states exist "
                    "from the second step's start)")
    ap.add_argument("--memory-gb", type=float, default=None,
                    help="device memory in GiB as GPUs are labelled (32 = a V100-32GB); default: the config's "
                         f"cluster.gpu_memory_gb (--max-model: {MAX_MODEL_MEMORY_GB:g}, the paper's V100)")
    ap.add_argument("--real", action="store_true", help="real tensors on the local device (collectives "
                    "still fake): CUDA peak, phase times, TFLOP/s, predicted job step time")
    ap.add_argument("--profile", metavar="DIR", help="with --real: one more step after the measured ones under "
                    "torch.profiler, its kernels by kind and by launching op in the report, its chrome trace gzipped "
                    "in DIR")
    ap.add_argument("--max-model", action="store_true",
                    help="largest model of the paper's C1-C5 study that fits, by probe and by estimator")
    ap.add_argument("--verify", action="store_true",
                    help="--max-model: also probe the extrapolated depth itself (slower)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.steps < 1:
        print(f"probe error: --steps {args.steps} is invalid; must be >= 1", file=sys.stderr)
        return 2
    if args.memory_gb is not None and args.memory_gb <= 0:
        print(f"probe error: --memory-gb {args.memory_gb} is invalid; must be > 0", file=sys.stderr)
        return 2
    if args.profile is not None and (args.max_model or not args.real):
        print(f"probe error: --profile {args.profile} needs --real (fake tensors run no kernels) and no --max-model",
              file=sys.stderr)
        return 2
    if args.max_model:
        args.memory_gb = MAX_MODEL_MEMORY_GB if args.memory_gb is None else args.memory_gb
        return max_model_command(args)
    try:
        cfg = load_config(args.config, args.overrides)
        world = args.world or cfg.cluster.nodes * cfg.cluster.gpus_per_node
        validate_layout(cfg, world)
        if not 0 <= args.rank < world:
            raise ConfigError(f"--rank {args.rank} is invalid; valid ranks: 0 .. {world - 1}")
        refuse_what_fake_tensors_cannot_run(cfg, fake=not args.real)
        if args.memory_gb is None:  # the budget --estimate and the start-up guard use
            args.memory_gb = cfg.cluster.gpu_memory_gb
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    if args.profile is not None:  # made only once everything else was accepted: a refused probe writes nothing
        try:
            Path(args.profile).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            print(f"probe error: --profile {args.profile}: cannot make that folder ({err.strerror})", file=sys.stderr)
            return 2
    return probe_command(cfg, world, args)

