"""The gloo groups a CPU rank holds: one per distinct set of ranks, none left behind when a layout is rebuilt."""
import os
import threading

import torch.distributed as dist

from gpt_harness import BASE
from ranks import run_ranks

TP, DP = 2, 3  # group sizes 2, 3 and 6: no two of megatron's kinds of group coincide by symmetry
ROUNDS = 3


def _gloo_polling_threads() -> int:
    """Threads gloo starts per group (a TCP device loop polling every 10 ms), counted by their names."""
    return len(_priorities()["gloo_tcp_loop"])


def _priorities() -> dict:
    """{thread name: [nice value of each thread of that name]} of this process."""
    found = {}
    for t in os.listdir("/proc/self/task"):
        name = open(f"/proc/self/task/{t}/comm").read().strip()
        found.setdefault(name, []).append(os.getpriority(os.PRIO_PROCESS, int(t)))
    found.setdefault("gloo_tcp_loop", [])
    return found


def _build_layout_rounds(rank, world_size):
    from pretrain.config import load_config
    from pretrain.runtime.layout import destroy_model_parallel_groups, init_layout
    cfg = load_config(None, BASE + [f"parallel.tensor={TP}", "train.global_batch_size=12"])
    rounds, started = [], os.getpriority(os.PRIO_PROCESS, threading.get_native_id())  # 0 unless run under `nice`
    for _ in range(ROUNDS):
        init_layout(cfg)
        rounds.append({"member_sets": [tuple(sorted(dist.get_process_group_ranks(g)))
                                       for g in dist.distributed_c10d._world.pg_map],
                       "polling_threads": _gloo_polling_threads(), "priorities": _priorities(), "started": started,
                       "this_thread": os.getpriority(os.PRIO_PROCESS, threading.get_native_id())})
        destroy_model_parallel_groups()
    rounds.append({"polling_threads": _gloo_polling_threads()})
    return rounds


def test_one_gloo_group_per_rank_set_and_none_left_after_a_rebuild():
    """megatron asks for ~17 groups a rank; on gloo the ones with the same ranks are one group: rank r holds
    the world group and the four sets of its layout (megatron's order: TP pairs, DP strided by TP), each with
    one polling thread; rebuilding the layout three times leaves the same threads, and releasing it, one. Every
    polling thread runs at nice 19 (where ranks outnumber cores a poller spun on a socket whose lock a descheduled
    collective thread held: zero3d/comm/gloo.py lower_gloo_poller_priority), every other thread, the training
    thread among them, at the nice it started with."""
    results = run_ranks(_build_layout_rounds, TP * DP, timeout=180)
    world = tuple(range(TP * DP))
    for rank, rounds in enumerate(results):
        tp_pair = tuple(range(rank - rank % TP, rank - rank % TP + TP))
        dp_set = tuple(range(rank % TP, TP * DP, TP))
        expected = sorted([world, world, tp_pair, dp_set, (rank,)])  # the default group, then megatron's four
        for built in rounds[:ROUNDS]:
            assert sorted(built["member_sets"]) == expected, f"rank {rank}: {built['member_sets']}"
            assert built["polling_threads"] == len(expected)
            assert built["priorities"].pop("gloo_tcp_loop") == [19] * len(expected), built["priorities"]
            others = [n for nices in built["priorities"].values() for n in nices]
            assert built["this_thread"] == built["started"] and others.count(built["started"]) == len(others), built
        assert rounds[ROUNDS]["polling_threads"] == 1  # the world group's alone


def _layout_times(rank, world_size, late_s):
    """(when this rank's init_layout returned, when its last step before the closing barrier ended): rank 1 spends
    `late_s` longer after building its groups, as a slow rank still in gloo's connectFullMesh would."""
    import time

    from pretrain.config import load_config
    from pretrain.runtime import layout
    resolve, done = layout.layout_gpus_per_node, {}

    def slow_on_rank_1(cfg, launch):
        time.sleep(late_s if rank == 1 else 0)
        done["built"] = time.time()
        return resolve(cfg, launch)

    layout.layout_gpus_per_node = slow_on_rank_1
    layout.init_layout(load_config(None, BASE + [f"parallel.tensor={TP}", "train.global_batch_size=12"]))
    returned = time.time()
    layout.destroy_model_parallel_groups()
    return returned, done["built"]


def test_no_rank_leaves_init_layout_before_every_rank_has_built_its_groups():
    """A rank that left init_layout and ended its groups at once closed sockets a slower peer was still handshaking
    on (CI: "Connection closed by peer" in connectFullMesh): with rank 1 two seconds slower after its groups, every
    rank returns after rank 1 got there."""
    times = run_ranks(_layout_times, TP * DP, 2.0, timeout=180)
    slow_rank_done = times[1][1]
    assert all(returned >= slow_rank_done for returned, _ in times), (slow_rank_done, times)


def _groups_outside_a_layout(rank, world_size):
    """The priorities of this rank's gloo pollers: the world group's alone, then after zero3d's node groups, then after
    the checkpoint writers' group (the groups built outside init_layout)."""
    from datetime import timedelta
    from types import SimpleNamespace

    from pretrain.checkpoint.checkpointer import Checkpointer
    from zero3d.comm.topology import build_node_topology
    dist.init_process_group("gloo")
    seen = {"world": _priorities()["gloo_tcp_loop"],
            "started": os.getpriority(os.PRIO_PROCESS, threading.get_native_id())}
    build_node_topology(None, gpus_per_node=3)
    seen["node groups"] = _priorities()["gloo_tcp_loop"]
    Checkpointer._writer_group(SimpleNamespace(_group=None, _timeout=timedelta(minutes=1)))
    seen["checkpoint writers"] = _priorities()["gloo_tcp_loop"]
    dist.destroy_process_group()
    return seen


def test_gloo_pollers_of_node_groups_and_checkpoint_writers_run_at_nice_19():
    """zero3d's node groups (2 nodes × 3: an intra-node group of 3 and an inter-node pair a rank) and the checkpoint
    writers' group, each built outside init_layout, leave every polling thread at nice 19, the world group's (built
    first) included."""
    for seen in run_ranks(_groups_outside_a_layout, 6, timeout=120):
        assert seen["world"] == [seen["started"]], seen
        assert seen["node groups"] == [19] * 3 and seen["checkpoint writers"] == [19] * 4, seen
