"""A run's start and its ends outside the loop: the lines it says, the records a started run writes, the
watchdog, and the second SIGINT."""
import os
import sys
import time
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from pretrain.config import Config, save_resolved
from pretrain.errors import EXIT_PEER, PeerTimeoutError, RunInterrupted, peer_error
from pretrain.runtime.status import clear_status, record_failure, record_job, sigterm_ignored
from pretrain.runtime.layout import Layout, layout_text, lost_peers
from pretrain.runtime.lock import release as release_lock
from pretrain.runtime.watchdog import Watchdog


def say(topo: Layout, lines: list[str]) -> None:
    """Rank 0 prints each line (what every rank agreed on), at once."""
    if topo.is_main:
        for line in lines:
            print(line, flush=True)


def resume_line(usable: Optional[dict], save_dir: Path, resume: bool) -> str:
    """Where the run starts, said out loud."""
    if usable is not None:
        m = usable["manifest"]
        return (f"resumed from {usable['path'].name} (saved at layout {layout_text(m['layout'])}): "
                f"continuing at step {m['step'] + 1}")
    if not resume:
        return f"train.resume = false: starting at step 1 (checkpoints in {save_dir} are not read)"
    return f"no checkpoint in {save_dir}: starting at step 1"


def start_run(cfg: Config, topo: Layout, progress: dict) -> None:
    """Collective, once every check that can refuse the run has passed (the model built, its checkpoint loaded):
    the one place a start first writes the run's records. Rank 0 writes config.json (and job.json under Slurm)
    and clears a previous run's status.json; failures are recorded from here on, and the loop's logs follow."""
    if topo.is_main:
        save_resolved(cfg)  # slurm/collect.py reads any run directory from it
        record_job(cfg.run_dir, progress["job"], topo.world_size)
        clear_status(cfg.run_dir)
    dist.barrier()
    progress["started"] = True


def record_rank_failure(err: BaseException, run_dir: Path, launch: Optional[dict], topo: Optional[Layout], step: int,
                        timeout_s: float) -> None:
    """A started run's failure on this rank into status.json, a lost collective's silent peers named first.

    SIGTERM is ignored meanwhile: the launcher terminates every rank once the first failed one has exited, and every
    rank that failed at the same moment spends lost_peers' settle here, so a rank whose own timeout fired a moment
    after its peer's died by that SIGTERM, silent and unrecorded (a live rank without its error line in one loaded
    suite run of three, test_fail_fast). Its line follows (pretrain/__main__.py's report, SIGTERM ignored too)."""
    with sigterm_ignored():
        lost = lost_peers() if topo is not None and peer_error(err, topo.rank, timeout_s) else ""
        record_failure(err, run_dir, launch and launch["rank"], launch["world_size"] if launch else 0, step,
                       timeout_s, lost)


def start_watchdog(cfg: Config, topo: Layout, progress: dict) -> Watchdog:
    """No step for 2 × train.timeout_minutes: status.json "failed" (peer timeout), exit 5 at once.

    Twice the collective timeout, so a stuck peer is reported by the collective that waits on it
    (with its group) first; the watchdog covers what no collective sees.
    """
    limit = 2 * cfg.train.timeout_minutes * 60

    def expire(idle: float) -> None:
        err = PeerTimeoutError(f"no training progress for {idle:.0f} s (limit 2 × train.timeout_minutes)",
                               f"rank {topo.rank}, watchdog",
                               "a data loader or this rank is stuck outside collectives; see py-spy dump")
        record_failure(err, cfg.run_dir, topo.rank, topo.world_size, progress["step"], limit / 2)
        print(err.line(), file=sys.stderr, flush=True)
        release_lock()  # os._exit runs no finally
        os._exit(EXIT_PEER)

    return Watchdog(limit, expire)


def abort_now(cfg: Config, topo: Layout, step: int) -> None:
    """A second SIGINT: rank 0 says so in one line and records it; the process then ends at once. The other
    ranks give it half a second first, so that their exit does not reach it as a lost peer before its line."""
    if not topo.is_main:
        time.sleep(0.5)
    if topo.is_main:
        err = RunInterrupted(f"interrupted twice (SIGINT) at step {step}: stopped at once, no checkpoint saved now",
                             "", "run the same command to resume from the latest complete checkpoint")
        record_failure(err, cfg.run_dir, topo.rank, topo.world_size, step, 0.0)
        print(err.line(), file=sys.stderr, flush=True)
        release_lock()  # the process ends with os._exit next, which runs no finally
