"""Command line: `python -m pretrain --config configs/tiny.toml [section.key=value ...]`."""
import signal

if __name__ == "__main__":
    # Slurm's SIGUSR1 (time-limit warning, preemption) can arrive while torch is still importing, and
    # its default action kills the rank. Blocked from the first line, it stays pending until the train
    # loop's handler is installed (StopRequest in pretrain/train.py unblocks it), then stops the run.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    import os as _os
    import warnings as _warnings
    if (_os.environ.get("RANK") or _os.environ.get("SLURM_PROCID") or "0") != "0":
        # megatron-core warns at import about absent Apex/Transformer Engine and deprecated options:
        # the same lines from every rank. Rank 0 prints them, once each.
        _warnings.filterwarnings("ignore", module="megatron")

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from pretrain.config import ConfigError, load_config, validate_layout  # noqa: E402

EXIT_REQUEUE = 75


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m pretrain", description=__doc__)
    parser.add_argument("--config", help="TOML config file (defaults apply where it is silent)")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. zero.stage=2")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config as JSON and exit")
    parser.add_argument("--estimate", action="store_true",
                        help="print the per-GPU memory estimate for the [cluster] layout and exit")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(cfg.to_dict(), indent=2))
        return 0
    if args.estimate:
        from pretrain.memory_check import config_report
        world = cfg.cluster.nodes * cfg.cluster.gpus_per_node
        try:
            validate_layout(cfg, world)
            estimate, table = config_report(cfg, world)
        except (ConfigError, ValueError) as err:
            print(f"config error: {err}", file=sys.stderr)
            return 2
        print(table)
        return 0 if estimate.fits else 1
    from pretrain.train import train
    from pretrain.topology import destroy_topology
    try:
        result = train(cfg)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    finally:
        destroy_topology()
    # 75 (EX_TEMPFAIL): stopped by a signal after saving a checkpoint. slurm/launch.sbatch sets
    # ZERO3D_INTERRUPTED_EXIT=0 (it decides from status.json; a 75 would fire srun's --kill-on-bad-exit).
    return int(os.environ.get("ZERO3D_INTERRUPTED_EXIT", EXIT_REQUEUE)) if result["stopped_early"] else 0


if __name__ == "__main__":
    sys.exit(main())
