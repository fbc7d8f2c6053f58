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
