"""Command line: `python -m pretrain --config configs/tiny.toml [section.key=value ...]`."""
import argparse
import json
import sys

from pretrain.config import ConfigError, load_config, validate_layout

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
        from pretrain.memory_check import describe, estimate_config
        from zero3d.analysis.estimate import GB, format_breakdown
        world = cfg.cluster.nodes * cfg.cluster.gpus_per_node
        try:
            validate_layout(cfg, world)
            estimate = estimate_config(cfg, world, cfg.cluster.gpu_memory_gb * GB)
        except (ConfigError, ValueError) as err:
            print(f"config error: {err}", file=sys.stderr)
            return 2
        print(format_breakdown(estimate, describe(cfg, world)))
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
    # 75 (EX_TEMPFAIL): stopped by a signal after saving a checkpoint; slurm/launch.sbatch requeues.
    return EXIT_REQUEUE if result["stopped_early"] else 0


if __name__ == "__main__":
    sys.exit(main())
