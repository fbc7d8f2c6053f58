"""Straggler detection: every log interval the ranks all-gather (step, compute, comm) seconds; the slowest is named."""
import socket
import statistics
import time

import torch
import torch.distributed as dist


def straggler_record(times: list, hosts: list, factor: float) -> dict:
    """perf/slowest_rank and perf/slowest_ratio (its compute seconds ÷ the median rank's) from every rank's
    [step, compute, comm] seconds; perf/straggler_* too when the ratio exceeds `factor`.

    Compute, not step time: a synchronous step waits for the slowest rank, so every rank's step lasts as
    long as its; the others spend the difference blocked in communication."""
    compute = [t[1] for t in times]
    median = statistics.median(compute)
    slowest = max(range(len(compute)), key=compute.__getitem__)
    ratio = compute[slowest] / median if median > 0 else 1.0
    record = {"perf/slowest_rank": slowest, "perf/slowest_ratio": ratio}
    if ratio > factor:
        record.update({"perf/straggler_rank": slowest, "perf/straggler_host": hosts[slowest],
                       "perf/straggler_compute_s": compute[slowest], "perf/median_compute_s": median})
    return record


def straggler_text(record: dict) -> str:
    """The console's line for a record that names a straggler."""
    return (f"straggler: rank {record['perf/straggler_rank']} on {record['perf/straggler_host']} computes "
            f"{record['perf/slowest_ratio']:.2f}× the median rank's time ({record['perf/straggler_compute_s']:.3f} s "
            f"vs {record['perf/median_compute_s']:.3f} s a step)")


class Stragglers:
    """Collective: each call all-gathers one 3-element tensor per rank (hosts are gathered once, here)."""

    def __init__(self, factor: float, device, group=None):
        self.factor, self.device, self.group = factor, device, group
        self.world = dist.get_world_size(group)
        self.hosts = [None] * self.world
        dist.all_gather_object(self.hosts, socket.gethostname(), group=group)

    def record(self, step_s: float, comm_s: float) -> dict:
        t0 = time.perf_counter()
        mine = torch.tensor([step_s, max(0.0, step_s - comm_s), comm_s], dtype=torch.float64, device=self.device)
        everyone = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(everyone, mine, group=self.group)
        record = straggler_record([t.tolist() for t in everyone], self.hosts, self.factor)
        record["perf/straggler_gather_s"] = time.perf_counter() - t0
        return record

