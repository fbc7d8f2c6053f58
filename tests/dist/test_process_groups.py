"""The gloo groups a CPU rank holds: one per distinct set of ranks, none left behind when a layout is rebuilt."""
import os

import torch.distributed as dist

from gpt_harness import BASE
from ranks import run_ranks

TP, DP = 2, 3  # group sizes 2, 3 and 6: no two of megatron's kinds of group coincide by symmetry
ROUNDS = 3


def _gloo_polling_threads() -> int:
    """Threads gloo starts per group (a TCP device loop polling every 10 ms), counted by their names."""
    return sum(open(f"/proc/self/task/{t}/comm").read().strip() == "gloo_tcp_loop" for t in os.listdir("/proc/self/task"))


def _build_layout_rounds(rank, world_size):
    from pretrain.config import load_config
    from pretrain.runtime.layout import destroy_model_parallel_groups, init_layout
    cfg = load_config(None, BASE + [f"parallel.tensor={TP}", "train.global_batch_size=12"])
    rounds = []
    for _ in range(ROUNDS):
        init_layout(cfg)
        rounds.append({"member_sets": [tuple(sorted(dist.get_process_group_ranks(g)))
                                       for g in dist.distributed_c10d._world.pg_map],
                       "polling_threads": _gloo_polling_threads()})
        destroy_model_parallel_groups()
    rounds.append({"polling_threads": _gloo_polling_threads()})
    return rounds


def test_one_gloo_group_per_rank_set_and_none_left_after_a_rebuild():
    """megatron asks for ~17 groups a rank; on gloo the ones with the same ranks are one group: rank r holds
    the world group and the four sets of its layout (megatron's order: TP pairs, DP strided by TP), each with
    one polling thread; rebuilding the layout three times leaves the same threads, and releasing it, one."""
    results = run_ranks(_build_layout_rounds, TP * DP, timeout=180)
    world = tuple(range(TP * DP))
    for rank, rounds in enumerate(results):
        tp_pair = tuple(range(rank - rank % TP, rank - rank % TP + TP))
        dp_set = tuple(range(rank % TP, TP * DP, TP))
        expected = sorted([world, world, tp_pair, dp_set, (rank,)])  # the default group, then megatron's four
        for built in rounds[:ROUNDS]:
            assert sorted(built["member_sets"]) == expected, f"rank {rank}: {built['member_sets']}"
            assert built["polling_threads"] == len(expected)
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
