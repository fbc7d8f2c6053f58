"""`python -m pretrain.launcher --nproc-per-node N [--config ...] [key=value ...]`: start a run's ranks on this node.

The ranks are `python -m pretrain` processes with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). What the console shows is zero3d's, not a launcher's:
- each rank's own one-line error, then one line from the launcher naming the first rank that failed and
  its exit code, which is the launcher's exit code (docs/exit-codes.md); no traceback of its own;
- Ctrl-C (SIGINT) is passed to every rank once: the ranks agree on a stop after the step, save a
  checkpoint and exit 75 (`interrupted`); a second Ctrl-C ends them at once (exit 130);
- SIGTERM and SIGUSR1 are passed on as well (a stop with a checkpoint, as under Slurm).
The ranks run in a session of their own, so a terminal's Ctrl-C reaches them once, through the launcher
(torchrun's agent would add a second SIGINT and end them without a checkpoint), and they die with it if
the launcher itself is killed. Multi-node Slurm jobs start their ranks with srun (slurm/launch.sbatch).
"""
import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
from typing import Optional

from pretrain.runtime.rendezvous import free_port
from pretrain.errors import (EXIT_CONFIG, EXIT_INPUT, EXIT_INTERRUPTED, EXIT_NUMERICAL, EXIT_OK, EXIT_PEER,
                             EXIT_REQUEUE, EXIT_UNEXPECTED)

MEANING = {EXIT_UNEXPECTED: "unexpected error", EXIT_CONFIG: "config error", EXIT_INPUT: "input error",
           EXIT_NUMERICAL: "numerical error", EXIT_PEER: "peer timeout", EXIT_REQUEUE: "interrupted",
           EXIT_INTERRUPTED: "interrupted at once"}
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
PR_SET_PDEATHSIG = 1


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m pretrain.launcher", allow_abbrev=False,
        description="Start N ranks of `python -m pretrain` on this node; every other argument is theirs.",
        epilog="example: python -m pretrain.launcher --nproc-per-node 4 --config configs/tiny.toml zero.stage=3")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="ranks on this node (GPUs, or CPU ranks)")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes in the job (each runs this launcher)")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's index in 0..nnodes-1")
    parser.add_argument("--master-addr", default="127.0.0.1", help="node 0's address (rank 0's rendezvous)")
    parser.add_argument("--master-port", type=int, default=None, help="rendezvous port; default: a free one (one node)")
    parser.add_argument("--grace-seconds", type=float, default=10.0,
                        help="after a rank fails, how long the others may take to exit by themselves before "
                             "they are killed")
    args, rest = parser.parse_known_args(argv)
    checks = [(args.nproc_per_node >= 1, f"--nproc-per-node {args.nproc_per_node}: must be >= 1"),
              (args.nnodes >= 1, f"--nnodes {args.nnodes}: must be >= 1"),
              (0 <= args.node_rank < args.nnodes, f"--node-rank {args.node_rank}: must be in 0..{args.nnodes - 1}"),
              (args.nnodes == 1 or args.master_port is not None, "--nnodes > 1 needs --master-port (the same on "
                                                                 "every node)"),
              (args.master_port is None or 1 <= args.master_port <= 65535,
               f"--master-port {args.master_port}: must be in 1..65535"),
              (args.grace_seconds >= 0, f"--grace-seconds {args.grace_seconds}: must be >= 0")]
    for ok, message in checks:
        if not ok:
            parser.error(message)
    return args, rest


def _die_with_parent() -> None:
    """In the rank, before exec: SIGKILL when the launcher dies (Linux), then a session of its own."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    os.setsid()


def rank_env(args, local_rank: int, port: int) -> dict:
    world = args.nnodes * args.nproc_per_node
    env = dict(os.environ, RANK=str(args.node_rank * args.nproc_per_node + local_rank), WORLD_SIZE=str(world),
               LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(args.nproc_per_node), GROUP_RANK=str(args.node_rank),
               MASTER_ADDR=args.master_addr, MASTER_PORT=str(port))
    # CPU threads per rank: the node's cores shared out (torchrun sets 1), unless the user chose
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc_per_node)))
    return env


def describe(rank: int, code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        return f"rank {rank} was killed by {name}"
    return f"rank {rank} exited with code {code} ({MEANING.get(code, 'error')})"


def exit_status(code: int) -> int:
    return 128 - code if code < 0 else code


def supervise(procs: list[subprocess.Popen], grace_s: float, first_rank: int) -> int:
    """Wait for every rank. The first to fail decides the exit code (of several seen failed in the same look,
    the lowest rank whose failure is not a peer timeout, 5, which a dead peer causes); the others get
    `grace_s` to exit on their own (an agreed error ends them all), then SIGKILL."""
    failed: Optional[tuple[int, int]] = None
    deadline = None
    while True:
        codes = [p.poll() for p in procs]
        if failed is None:
            bad = [(first_rank + local, code) for local, code in enumerate(codes)
                   if code not in (None, EXIT_OK, EXIT_REQUEUE)]
            if bad:  # seen at once: a cause (a kill, the rank's own error) before a peer's timeout it caused
                failed, deadline = min(bad, key=lambda f: (f[1] == EXIT_PEER, f[0])), time.monotonic() + grace_s
        if all(c is not None for c in codes):
            break
        if deadline is not None and time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.05)
    if failed is not None:
        rank, code = failed
        others = "; the other ranks were stopped" if len(procs) > 1 else ""
        print(f"launcher: {describe(rank, code)}{others} (its own line above says why)", file=sys.stderr, flush=True)
        return exit_status(code)
    codes = {p.returncode for p in procs}
    return EXIT_REQUEUE if EXIT_REQUEUE in codes else EXIT_OK


def main(argv=None) -> int:
    args, rest = parse_args(argv)
    port = args.master_port or free_port()
    procs: list[subprocess.Popen] = []

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)
    for sig in FORWARDED:
        signal.signal(sig, forward)
    for local in range(args.nproc_per_node):
        procs.append(subprocess.Popen([sys.executable, "-m", "pretrain", *rest], env=rank_env(args, local, port),
                                      preexec_fn=_die_with_parent))
    try:
        return supervise(procs, args.grace_seconds, args.node_rank * args.nproc_per_node)
    finally:
        # Every rank has exited: a further Ctrl-C (a user pressing again) has nothing left to stop, and must not
        # kill the launcher while it exits (status -SIGINT instead of the ranks' code). Ignored, not default:
        # Python's finalisation keeps an ignored signal ignored.
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_IGN)


if __name__ == "__main__":
    sys.exit(main())
