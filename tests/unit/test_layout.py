"""The Layout refuses what does not fit together; the one builder's DP groups are megatron's, on the fake backend."""
import itertools

import pytest
import torch
import torch.distributed as dist

import megatron_patches
from pretrain.config import load_config
from pretrain.runtime.layout import Layout, LayoutError, destroy_layout, init_layout, start_fake
from zero3d.comm.topology import dp_groups

GOOD = dict(rank=5, world_size=8, local_rank=1, tp=2, pp=2, dp=2, tp_rank=1, pp_rank=1, dp_rank=0, grad_accum=4,
            device=torch.device("cpu"), dp_group=None, tp_group=None, pp_group=None, gpus_per_node=4)


def test_a_consistent_layout_is_accepted():
    layout = Layout(**GOOD)
    assert (layout.is_main, layout.is_last_stage, layout.gpus_per_node) == (False, True, 4)


def test_the_dp_ranks_per_node_are_the_node_topologys():
    """What the run's memory check counts for hpZ and hybrid: 1 without a node topology; with one, its DP ranks on a
    node — rank 5's DP group {5, 7} (TP 2 × DP 2 × PP 2) on nodes of 2 ranks puts one of them on each node, on nodes
    of 8 both on one."""
    from zero3d.comm.topology import topology_of
    assert Layout(**GOOD).dp_per_node == 1
    for gpus_per_node, per_node in ((2, 1), (8, 2)):
        node = topology_of(0, [5, 7], gpus_per_node)
        assert Layout(**{**GOOD, "gpus_per_node": gpus_per_node, "node": node}).dp_per_node == per_node


@pytest.mark.parametrize("change,message", [
    ({"world_size": 0}, "world_size = 0 is invalid; valid: an integer >= 1"),
    ({"tp": 0}, "tp = 0 is invalid; valid: an integer >= 1"),
    ({"grad_accum": 0}, "grad_accum = 0 is invalid; valid: an integer >= 1"),
    ({"gpus_per_node": 0}, "gpus_per_node = 0 is invalid; valid: an integer >= 1"),
    ({"gpus_per_node": None}, "gpus_per_node = None is invalid; valid: an integer >= 1"),
    ({"dp": 3}, r"tp × pp × cp × dp = 2 × 2 × 1 × 3 is invalid for world_size = 8; valid: degrees whose product is 8"),
    ({"rank": 8}, r"rank = 8 is invalid; valid: 0 .. 7 \(world_size = 8\)"),
    ({"rank": -1}, r"rank = -1 is invalid; valid: 0 .. 7 \(world_size = 8\)"),
    ({"tp_rank": 2}, r"tp_rank = 2 is invalid; valid: 0 .. 1 \(tp = 2\)"),
    ({"pp_rank": 2}, r"pp_rank = 2 is invalid; valid: 0 .. 1 \(pp = 2\)"),
    ({"dp_rank": -1}, r"dp_rank = -1 is invalid; valid: 0 .. 1 \(dp = 2\)"),
    ({"local_rank": -1}, "local_rank = -1 is invalid; valid: an integer >= 0"),
    ({"cp": 2}, r"tp × pp × cp × dp = 2 × 2 × 2 × 2 is invalid for world_size = 8; valid: degrees whose product is 8"),
    ({"cp": 2, "dp": 1, "cp_rank": 2}, r"cp_rank = 2 is invalid; valid: 0 .. 1 \(cp = 2\)"),
])
def test_each_bad_value_is_named_with_what_is_valid(change, message):
    with pytest.raises(LayoutError, match=message):
        Layout(**{**GOOD, **change})


def test_a_node_topology_of_another_layout_is_refused():
    from zero3d.comm.topology import topology_of
    node = topology_of(0, [1, 3, 5, 7], 4)  # 4 DP ranks; the layout has 2
    with pytest.raises(LayoutError, match="dp_size = 4, gpus_per_node = 4 are invalid; valid: the layout's dp = 2"):
        Layout(**{**GOOD, "node": node})


def brute_force_dp_groups(world: int, tp: int, pp: int) -> list[list[int]]:
    """Ranks sharing every coordinate but the DP one, the coordinates read off megatron-core's order
    tp-cp-ep-dp-pp (the first varies fastest): rank = t + tp·d + tp·dp·p."""
    dp = world // (tp * pp)
    coords = {t + tp * d + tp * dp * p: (t, p) for t, d, p in itertools.product(range(tp), range(dp), range(pp))}
    groups: dict = {}
    for rank in sorted(coords):
        groups.setdefault(coords[rank], []).append(rank)
    return sorted(groups.values())


LAYOUTS = [(w, t, p) for w in range(1, 17) for t in range(1, w + 1) for p in range(1, w + 1) if w % (t * p) == 0]


@pytest.mark.parametrize("world,tp,pp", LAYOUTS)
def test_dp_groups_are_the_brute_force_and_megatrons_rank_generator(world, tp, pp):
    from megatron.core.parallel_state import RankGenerator
    groups = dp_groups(world, tp, pp)
    assert sorted(groups) == brute_force_dp_groups(world, tp, pp)
    megatron = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp").get_ranks("dp")
    assert sorted(groups) == sorted(megatron)


@pytest.fixture
def fake_layout():
    """init_layout on the fake backend (the probe's start), undone afterwards with the CPU patches it applied."""
    undo = not megatron_patches.cpu_patches_applied()

    def build(overrides: list[str], world: int, rank: int, gpus_per_node: int = 8) -> Layout:
        cfg = load_config(None, ["train.global_batch_size=48", "train.micro_batch_size=1", "model.num_layers=12",
                                 "model.num_attention_heads=6", "model.hidden_size=48"] + overrides)
        launch = dict(rank=rank, world_size=world, local_rank=0, env={"LOCAL_WORLD_SIZE": str(gpus_per_node)})
        return init_layout(cfg, launch, device=torch.device("cpu"), start=start_fake)

    yield build
    destroy_layout()
    if undo:
        megatron_patches.undo_cpu_patches()


@pytest.mark.parametrize("world,tp,pp,rank", [(8, 2, 2, 5), (12, 2, 3, 7), (6, 3, 1, 4), (8, 1, 4, 6)])
def test_the_builder_on_the_fake_backend_has_megatrons_dp_group(fake_layout, world, tp, pp, rank):
    layout = fake_layout([f"parallel.tensor={tp}", f"parallel.pipeline={pp}"], world, rank)
    mine = dist.get_process_group_ranks(layout.dp_group)
    assert mine in dp_groups(world, tp, pp) and rank in mine
    assert (layout.tp, layout.pp, layout.dp, layout.dp_rank) == (tp, pp, world // (tp * pp), mine.index(rank))
    assert dist.get_backend() == "fake"


def test_the_builder_on_the_fake_backend_builds_the_node_groups(fake_layout):
    """TP 2 × DP 4 on 2 nodes × 4 (the launch's LOCAL_WORLD_SIZE): rank 5's DP group [1, 3, 5, 7], 2 ranks a node."""
    layout = fake_layout(["parallel.tensor=2", "zero.stage=3", "zero.secondary_partition=node"], 8, 5,
                         gpus_per_node=4)
    node = layout.node
    assert (layout.gpus_per_node, node.gpus_per_node, node.per_node, node.nodes) == (4, 4, 2, 2)
    assert dist.get_process_group_ranks(node.intra_group) == [5, 7]
    assert dist.get_process_group_ranks(node.inter_group) == [1, 5]


def test_layout_text_of_a_damaged_manifest_names_it_without_a_traceback():
    """A checkpoint's layout is words in messages: a context value of the wrong type is shown, not compared."""
    from pretrain.runtime.layout import layout_text
    assert layout_text({"tensor": 1, "pipeline": 1, "data": 2, "context": "x", "stage": 2}) == (
        "tensor 1 × pipeline 1 × data 2 × context x, stage 2")
    assert layout_text({"tensor": 2, "pipeline": 1, "data": 2, "stage": 3}) == "tensor 2 × pipeline 1 × data 2, stage 3"
