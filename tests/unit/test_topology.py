"""Node topology of the DP group: the rank arithmetic against a brute-force placement, and the launcher's counts."""
import itertools

import pytest

from pretrain.runtime.rendezvous import NodeSizeError, resolve_gpus_per_node
from zero3d.comm.topology import TopologyError, node_layout, topology_of


def megatron_dp_groups(tp: int, dp: int, pp: int) -> list[list[int]]:
    """megatron-core's order tp-cp-ep-dp-pp (cp = ep = 1), by coordinates: rank = t + tp·(d + dp·p)."""
    return [[t + tp * (d + dp * p) for d in range(dp)] for p in range(pp) for t in range(tp)]


def launcher_nodes(world: int, gpus_per_node: int) -> list[list[int]]:
    """Ranks dealt to nodes one node at a time, as torchrun and Slurm's block distribution do."""
    ranks = list(range(world))
    return [ranks[i:i + gpus_per_node] for i in range(0, world, gpus_per_node)]


def brute_force(group: list[int], gpus_per_node: int):
    """(node index, local index) of each DP rank by searching the launcher's node lists, or None when the
    group's ranks are not spread evenly and consecutively over the nodes it touches."""
    hosts = launcher_nodes(max(group) + 1, gpus_per_node)
    on = [next(i for i, host in enumerate(hosts) if g in host) for g in group]
    touched = sorted(set(on))
    members = {h: [d for d, n in enumerate(on) if n == h] for h in touched}
    sizes = {len(v) for v in members.values()}
    consecutive = all(v == list(range(v[0], v[0] + len(v))) for v in members.values())
    ordered = [members[h][0] for h in touched] == sorted(members[h][0] for h in touched)
    if len(sizes) != 1 or not consecutive or not ordered:
        return None
    return [(touched.index(on[d]), members[on[d]].index(d)) for d in range(len(group))]


# every TP × DP × PP layout of up to 16 ranks (groups of 3, 5, 6, 7 ... where symmetry hides nothing), and paper-sized
# ones, under every node size up to 16
LAYOUTS = ([(tp, dp, pp) for tp, dp, pp in itertools.product(range(1, 17), repeat=3) if tp * dp * pp <= 16]
           + [(tp, dp, pp) for tp, dp, pp in itertools.product((1, 2, 4, 8), (1, 2, 3, 4, 6, 8), (1, 2))])


@pytest.mark.parametrize("gpn", range(1, 17))
def test_rank_arithmetic_matches_brute_force(gpn):
    for tp, dp, pp in LAYOUTS:
        check_layout(tp, dp, pp, gpn)


def check_layout(tp, dp, pp, gpn):
    for group in megatron_dp_groups(tp, dp, pp):
        expected = brute_force(group, gpn)
        if expected is None:
            with pytest.raises(TopologyError, match="does not split evenly into nodes"):
                node_layout(group, gpn)
            continue
        nodes = max(n for n, _ in expected) + 1
        for d in range(dp):
            t = topology_of(d, group, gpn)
            assert (t.node, t.local) == expected[d]
            assert t.nodes == nodes and t.per_node * nodes == dp
            assert t.intra_ranks() == [e for e in range(dp) if expected[e][0] == expected[d][0]]
            assert t.inter_ranks() == [e for e in range(dp) if expected[e][1] == expected[d][1]]


def test_tp_takes_its_share_of_each_node():
    # 16 ranks, 8 per node, TP 2: every DP group has 4 ranks on each of the 2 nodes
    for group in megatron_dp_groups(2, 8, 1):
        t = topology_of(0, group, 8)
        assert (t.nodes, t.per_node) == (2, 4)
    # TP filling the node: one DP rank per node
    t = topology_of(3, megatron_dp_groups(8, 4, 1)[5], 8)
    assert (t.nodes, t.per_node, t.node, t.local) == (4, 1, 3, 0)


def test_uneven_and_scattered_groups_are_refused():
    with pytest.raises(TopologyError, match=r"global ranks \[0, 1, 2\]"):
        node_layout([0, 1, 2], 2)  # 2 + 1
    with pytest.raises(TopologyError, match="does not split evenly"):
        node_layout([0, 2, 1, 3], 2)  # node 0's DP ranks 0 and 2 are not consecutive


@pytest.mark.parametrize("env,expected", [
    ({"SLURM_NTASKS_PER_NODE": "4", "LOCAL_WORLD_SIZE": "2"}, 4),
    ({"SLURM_TASKS_PER_NODE": "8(x4)"}, 8),
    ({"SLURM_TASKS_PER_NODE": "2,2", "LOCAL_WORLD_SIZE": "4"}, 2),
    ({"LOCAL_WORLD_SIZE": "3"}, 3),
])
def test_launcher_counts(env, expected):
    assert resolve_gpus_per_node(None, env) == expected
    assert resolve_gpus_per_node(2, env) == 2  # the explicit value wins


@pytest.mark.parametrize("env,gpn,message", [
    ({"SLURM_TASKS_PER_NODE": "8(x2),4"}, None, "different numbers of ranks"),
    ({"SLURM_NTASKS_PER_NODE": "eight"}, None, "SLURM_NTASKS_PER_NODE = 'eight' is invalid"),
    ({}, None, "ranks per node unknown"),
    ({}, 0, "gpus_per_node = 0 is invalid"),
])
def test_launcher_refusals(env, gpn, message):
    with pytest.raises(NodeSizeError, match=message):
        resolve_gpus_per_node(gpn, env)


def test_the_memory_check_and_the_planner_place_dp_ranks_as_the_engine_does():
    """Issue #54: one rank → node rule. For every TP × DP layout of up to 16 ranks (PP 1) under every node size up to
    16, the DP ranks a node holds of rank 0's DP group (the brute-force placement) are what the memory check counts
    for hpZ and the planner weighs; a layout with a DP group that does not split evenly is the engine's one-line
    refusal in the memory check and no node-aware mode in the planner."""
    from analysis.cluster import ClusterSpec
    from analysis.planner import dp_per_node, node_split
    from pretrain.config import load_config
    from pretrain.errors import ConfigError
    from pretrain.memory_check import config_dp_per_node as memory_dp_per_node
    for gpn in range(1, 17):
        cluster = ClusterSpec(gpus_per_node=gpn).cluster()
        for tp, dp in {(tp, dp) for tp, dp, pp in LAYOUTS}:
            expected = [brute_force(group, gpn) for group in megatron_dp_groups(tp, dp, 1)]
            world = tp * dp
            cfg = load_config(None, [f"parallel.tensor={tp}", "zero.stage=3", "zero.secondary_partition=node",
                                     f"cluster.gpus_per_node={gpn}", "model.num_attention_heads=48",
                                     "model.hidden_size=96", f"train.global_batch_size={4 * dp}"], check=False)
            if None in expected:
                assert node_split(cluster, world, tp) is None and dp_per_node(cluster, world, tp) == 1
                with pytest.raises(ConfigError, match="does not split evenly into nodes"):
                    memory_dp_per_node(cfg, world)
                continue
            per_node = sum(1 for node, _ in expected[0] if node == 0)
            assert node_split(cluster, world, tp) == dp_per_node(cluster, world, tp) == per_node, (tp, dp, gpn)
            assert memory_dp_per_node(cfg, world) == per_node, (tp, dp, gpn)
