"""Command line: `python -m pretrain --config configs/tiny.toml [section.key=value ...]`.

Exit codes (pretrain/errors.py, docs/exit-codes.md): 0 ok, 1 unexpected (traceback shown), 2 config,
3 input (data, tokenizer, checkpoint, environment), 4 numerical, 5 peer/collective timeout,
75 interrupted after a complete checkpoint, 130 interrupted at once (SIGINT during start-up, or twice).
Every known error is one line on stderr, `error: <what> (<where>): <how to fix>`; ZERO3D_DEBUG=1 or
--debug adds its traceback. A start refused by any check writes nothing into the run directory.
"""
import signal

if __name__ == "__main__":
    # Slurm's SIGUSR1 (time-limit warning, preemption) can arrive while torch is still importing, and
    # its default action kills the rank. Blocked from the first line, it stays pending until the train
    # loop's handler is installed (StopRequest in pretrain/runtime/stopping.py unblocks it), then stops the run.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    import warnings as _warnings

    from pretrain.runtime.kernels import MEGATRON_FALLBACK_WARNINGS
    from pretrain.runtime.rendezvous import env_rank as _env_rank
    # megatron-core warns at import about absent Apex/Transformer Engine: rank 0's start-up summary
    # states each fallback once instead (pretrain/runtime/kernels.py).
    _warnings.filterwarnings("ignore", message=MEGATRON_FALLBACK_WARNINGS, module="megatron")
    if _env_rank() != 0:
        # its other import-time warnings (deprecated options) are the same lines from every rank:
        # rank 0 prints them, once each.
        _warnings.filterwarnings("ignore", module="megatron")

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from pretrain.atomic import write_atomically  # noqa: E402
from pretrain.config import ConfigError, load_config, validate_layout  # noqa: E402
from pretrain.runtime.preflight import check_paths  # noqa: E402
from pretrain.runtime.rendezvous import check_master_resolves, env_rank, launcher_env  # noqa: E402
from pretrain.errors import EXIT_CONFIG, EXIT_OK, EXIT_PEER, EXIT_REQUEUE  # noqa: E402
from pretrain.runtime.status import report, sigterm_ignored  # noqa: E402

# --estimate: the layout does not fit the GPU memory, as the start-up guard refuses it (a config error)
EXIT_ESTIMATE_TOO_BIG = EXIT_CONFIG


def config_hint(args) -> str:
    """`python -m pretrain configs/tiny.toml`: a TOML file given where an override belongs."""
    files = [o for o in args.overrides if "=" not in o and o.endswith(".toml")]
    return f"; did you mean --config {files[0]}?" if files and args.config is None else ""


def record_exit_code(code: int, rank) -> None:
    """Rank 0's exit code into $ZERO3D_EXIT_FILE (slurm/launch.sbatch sets it, outside the run directory): the
    batch script's code for a run that wrote no status.json (a refused start), where srun's own would be
    that of the peers it killed (143)."""
    path = os.environ.get("ZERO3D_EXIT_FILE")
    if path and rank == 0:
        try:
            write_atomically(path, f"{code}\n")
        except OSError:
            pass


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m pretrain", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="TOML config file (defaults apply where it is silent)")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. zero.stage=2")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config as JSON and exit")
    parser.add_argument("--estimate", action="store_true",
                        help="print the per-GPU memory estimate for the [cluster] layout and exit")
    parser.add_argument("--plan", action="store_true",
                        help="rank this config's layouts on its [cluster] by the planner, with --estimate's memory")
    parser.add_argument("--top", type=int, default=10, help="--plan: how many layouts to print")
    parser.add_argument("--measured", action="append", default=[], metavar="RUN_DIR",
                        help="--plan: the compute's share of peak from this run's own steps (its metrics.jsonl, "
                             "config.json, status.json) instead of docs/gpu-check.md's rows; repeat for several runs")
    parser.add_argument("--json", action="store_true",
                        help="--estimate / --plan: JSON (the breakdown's exact bytes) instead of the table")
    parser.add_argument("--debug", action="store_true",
                        help="print tracebacks with errors (also: ZERO3D_DEBUG=1)")
    return parser.parse_args(argv)


def estimate(cfg, as_json: bool = False) -> int:
    from pretrain.memory_check import config_report
    world = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    try:
        validate_layout(cfg, world)
        result, table = config_report(cfg, world)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    print(json.dumps(result.to_dict(), indent=1) if as_json else table)
    return EXIT_OK if result.fits else EXIT_ESTIMATE_TOO_BIG


def main(argv=None) -> int:
    args = parse_args(argv)
    debug = args.debug or os.environ.get("ZERO3D_DEBUG", "") not in ("", "0")
    rank, timeout_s, cfg, training = env_rank(), 600.0, None, False
    try:
        cfg = load_config(args.config, args.overrides)
        timeout_s = cfg.train.timeout_minutes * 60
        if args.print_config:
            print(json.dumps(cfg.to_dict(), indent=2))
            return EXIT_OK
        if args.estimate:
            return estimate(cfg, args.json)
        if args.plan:
            from pretrain.plan import plan_report
            print(plan_report(cfg, args.top, args.json, tuple(args.measured)))
            return EXIT_OK
        # Paths, launch environment and layout before torch and megatron are imported: a second.
        check_paths(cfg)
        launch = launcher_env()
        check_master_resolves(launch)
        validate_layout(cfg, launch["world_size"])
        from pretrain.train import train
        training = True
        # config.json, job.json and status.json are written by train() once every start check has passed
        result = train(cfg, launch, job={"config": args.config, "overrides": args.overrides})
    except BaseException as err:  # noqa: BLE001 - every failure becomes one line and an exit code
        if isinstance(err, ConfigError) and (hint := config_hint(args)):
            err = ConfigError(err.what, err.where, (err.fix + hint) if err.fix else hint.lstrip("; "))
        with sigterm_ignored():  # the launcher's SIGTERM after a peer's exit: this rank's line is said first
            code = report(err, rank, timeout_s, debug, sys.stderr)
            record_exit_code(code, rank)
            if code == EXIT_PEER:  # a stuck peer can block the process group's teardown: leave now
                sys.stdout.flush()
                os._exit(code)
        return code
    finally:
        if training:
            from pretrain.runtime.layout import destroy_layout
            destroy_layout()
    if result["stopped_early"] and rank == 0:  # one line from rank 0, not only torchrun's FAILED block
        print(f"stopped by a signal (SIGINT/SIGUSR1/SIGTERM) after step {result['end_step']} of {cfg.train.steps}: "
              f"checkpoint step_{result['end_step']:08d} saved, status.json \"interrupted\"; run the same command "
              "to resume", file=sys.stderr, flush=True)
    # 75 (EX_TEMPFAIL): stopped by a signal after saving a checkpoint. slurm/launch.sbatch sets
    # ZERO3D_INTERRUPTED_EXIT=0 (it decides from status.json; a 75 would fire srun's --kill-on-bad-exit).
    return int(os.environ.get("ZERO3D_INTERRUPTED_EXIT", EXIT_REQUEUE)) if result["stopped_early"] else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
