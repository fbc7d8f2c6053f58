"""Run a function on N local gloo ranks in forked processes; fail, never hang, on timeout."""
import faulthandler
import io
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import traceback
from pathlib import Path

import torch

from pretrain.runtime.rendezvous import free_port  # noqa: F401 - the tests' rendezvous ports too


def _rank_main(fn, rank, world_size, port, args, queue, stacks_dir):
    # On a timeout the parent sends SIGUSR2: every thread's Python stack goes to a file it reads back.
    stack_file = open(Path(stacks_dir) / f"rank_{rank}.txt", "w")
    faulthandler.register(signal.SIGUSR2, file=stack_file, all_threads=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        # Serialised to bytes: tensors sent as shared-memory handles die with the rank's process.
        buf = io.BytesIO()
        torch.save(fn(rank, world_size, *args), buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


def _stacks_of(procs, ranks, stacks_dir) -> str:
    """Where each hung rank is: its threads' Python stacks (faulthandler, on SIGUSR2)."""
    import time
    for r in ranks:
        if procs[r].is_alive():
            os.kill(procs[r].pid, signal.SIGUSR2)
    time.sleep(1.0)
    return "".join(f"\n--- rank {r} stacks ---\n" + (Path(stacks_dir) / f"rank_{r}.txt").read_text()[-6000:]
                   for r in ranks if (Path(stacks_dir) / f"rank_{r}.txt").exists())


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0) -> list:
    """Run fn(rank, world_size, *args) on `world_size` forked ranks; return the results by rank.

    fn initialises torch.distributed itself (env:// with the variables set here). A rank that
    raises fails the test with its traceback; ranks still running after `timeout` seconds are
    killed and the test fails naming them.
    """
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    stacks_dir = tempfile.mkdtemp(prefix="ranks-")
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, args, queue, stacks_dir), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    import queue as queue_mod
    import time
    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world_size:
        remaining = deadline - time.monotonic()
        try:
            rank, status, payload = queue.get(timeout=max(0.1, min(remaining, 1.0)))
        except queue_mod.Empty:
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results and r not in errors]
            if dead and all(not p.is_alive() for p in procs):
                errors.update({r: f"rank {r} exited with code {procs[r].exitcode} and no result" for r in dead})
                break
            if remaining <= 0:
                missing = [r for r in range(world_size) if r not in results and r not in errors]
                stacks = _stacks_of(procs, missing, stacks_dir)
                for p in procs:
                    p.kill()
                raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f} s "
                                   f"(finished: {sorted(results)}, failed: {sorted(errors)}, port {port})\n"
                                   + "\n".join(errors.values()) + stacks)
            continue
        (results if status == "ok" else errors)[rank] = payload
        if errors:  # one failure usually strands the others in a collective: collect what the others report
            # until every rank has exited (a peer's closed connection ends their collectives) or 3 s have passed,
            # then stop them; a fixed 0.5 s lost the second rank's own error on a loaded machine
            settle = time.monotonic() + 3.0
            while time.monotonic() < settle:
                try:
                    rank, status, payload = queue.get(timeout=0.1)
                    (results if status == "ok" else errors)[rank] = payload
                except queue_mod.Empty:
                    if all(not p.is_alive() for p in procs):
                        break
            break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    shutil.rmtree(stacks_dir, ignore_errors=True)
    if errors:
        raise RuntimeError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
    return [torch.load(io.BytesIO(results[r]), weights_only=False) for r in range(world_size)]
