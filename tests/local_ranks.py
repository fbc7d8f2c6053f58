"""Run a function on N local gloo ranks in forked processes; fail, never hang, on timeout."""
import io
import multiprocessing as mp
import os
import socket
import traceback

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank, world_size, port, args, queue):
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


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0) -> list:
    """Run fn(rank, world_size, *args) on `world_size` forked ranks; return the results by rank.

    fn initialises torch.distributed itself (env:// with the variables set here). A rank that
    raises fails the test with its traceback; ranks still running after `timeout` seconds are
    killed and the test fails naming them.
    """
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, args, queue), daemon=True)
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
                for p in procs:
                    p.kill()
                raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f} s "
                                   f"(finished: {sorted(results)}, failed: {sorted(errors)})\n"
                                   + "\n".join(errors.values()))
            continue
        (results if status == "ok" else errors)[rank] = payload
        if errors:  # one failure usually strands the others in a collective: stop them now
            time.sleep(0.5)
            while not queue.empty():
                rank, status, payload = queue.get_nowait()
                (results if status == "ok" else errors)[rank] = payload
            break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    if errors:
        raise RuntimeError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
    return [torch.load(io.BytesIO(results[r]), weights_only=False) for r in range(world_size)]
