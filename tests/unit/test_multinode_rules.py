"""Multi-node launch pieces in one process: TP groups across nodes, elastic node ranges, the per-rank host
line, naming lost peers, and the local cluster's /etc/hosts lines."""
import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from pretrain.config import ConfigError, load_config  # noqa: E402
from slurm import local_cluster, submit  # noqa: E402

TINY = "configs/tiny.toml"


def test_tensor_groups_inside_nodes_pass_straddling_ones_are_refused_whole_node_ones_noted():
    # TP 2 on 2-GPU nodes: ranks {0,1} on node 1, {2,3} on node 2; no note
    assert submit.build_job(TINY, ["cluster.nodes=2", "cluster.gpus_per_node=2"], cpu=True).notes == []
    # TP 2 on 3-GPU nodes: ranks {2,3} would straddle nodes 1 and 2
    with pytest.raises(ConfigError, match=r"parallel.tensor = 2 neither divides nor is a multiple of "
                                          r"cluster.gpus_per_node = 3: some tensor-parallel groups would straddle"):
        submit.build_job(TINY, ["cluster.nodes=2", "cluster.gpus_per_node=3", "train.global_batch_size=12"], cpu=True)
    # ... named with Pa, which runs over the same group
    with pytest.raises(ConfigError, match="tensor-parallel and activation partitioning \\(Pa\\) groups would straddle"):
        submit.build_job(TINY, ["cluster.nodes=2", "cluster.gpus_per_node=3", "train.global_batch_size=12",
                                "zero.partition_activations=true", "model.recompute=\"full\""], cpu=True)
    # one node: no group can span nodes, whatever the sizes
    assert submit.build_job(TINY, ["cluster.gpus_per_node=4"], cpu=True).notes == []
    # the paper's 16-way MP on 8-GPU nodes: each group is 2 whole nodes, allowed with the reason
    (note,) = submit.build_job("configs/paper/fig2_100B_zero.toml", ["cluster.gpus_per_node=8", "cluster.nodes=50"]).notes
    assert note == ("parallel.tensor = 16 > cluster.gpus_per_node = 8: each tensor-parallel and activation "
                    "partitioning (Pa) group spans 2 nodes, so its collectives cross the inter-node network "
                    "(the paper keeps ZeRO's inside one node)")


def test_an_elastic_job_asks_for_a_node_range_of_whole_nodes_and_must_train_at_each_count():
    job = submit.build_job(TINY, ["cluster.nodes=2", "cluster.min_nodes=1", "cluster.gpus_per_node=2"], cpu=True)
    assert "--nodes=1-2" in job.sbatch and "--exclusive" in job.sbatch
    assert not any(a.startswith("--ntasks") for a in job.sbatch)  # Slurm would pin it to the first allocation's
    assert job.env == {"ZERO3D_TASKS_PER_NODE": "2", "ZERO3D_SINGLETON": "1"}
    fixed = submit.build_job(TINY, ["cluster.nodes=2", "cluster.gpus_per_node=2"], cpu=True)
    assert "--nodes=2" in fixed.sbatch and "--ntasks-per-node=2" in fixed.sbatch and "--exclusive" not in fixed.sbatch
    assert fixed.env == {"ZERO3D_SINGLETON": "1"}
    # global batch = micro-batch 4 × DP × accumulation: 48 at DP 1-4; 16 not at DP 3 (3 nodes)
    assert "--nodes=1-4" in submit.build_job(TINY, ["cluster.nodes=4", "cluster.min_nodes=1", "cluster.gpus_per_node=2",
                                                    "train.global_batch_size=48"], cpu=True).sbatch
    with pytest.raises(ConfigError, match=r"cluster.min_nodes = 1: on 3 node\(s\) of 2: train.global_batch_size = 16 "
                                          r"is not divisible by train.micro_batch_size × data-parallel size = 4 × 3"):
        submit.build_job(TINY, ["cluster.nodes=4", "cluster.min_nodes=1", "cluster.gpus_per_node=2"], cpu=True)
    with pytest.raises(ConfigError, match=r"cluster.min_nodes = 3 is invalid; must be in 1..cluster.nodes \(2\)"):
        load_config(REPO / TINY, ["cluster.nodes=2", "cluster.min_nodes=3"])


def test_the_launcher_starts_the_tasks_per_node_on_the_nodes_it_got(monkeypatch):
    job = submit.build_job(TINY, ["cluster.nodes=2", "cluster.min_nodes=1", "cluster.gpus_per_node=2"], cpu=True)
    preview = submit.launch_preview(job)
    assert "--ntasks=\\<SLURM_JOB_NUM_NODES\\ ×\\ 2\\> --ntasks-per-node=2" in preview, preview
    assert "--world-size \\<SLURM_JOB_NUM_NODES\\ ×\\ 2\\>" in preview, preview


def test_every_rank_names_its_host_and_node(monkeypatch):
    from pretrain.runtime.rendezvous import host_line
    monkeypatch.setenv("SLURMD_NODENAME", "z3node2")
    monkeypatch.setattr("socket.gethostname", lambda: "gpu17")
    launch = {"rank": 3, "world_size": 4, "local_rank": 1, "master_addr": "z3node1", "master_port": "25001"}
    assert host_line(launch) == "rank 3/4: host gpu17, node z3node2, local rank 1, master z3node1:25001"
    monkeypatch.delenv("SLURMD_NODENAME")
    assert host_line(launch).startswith("rank 3/4: host gpu17, node gpu17,")  # outside Slurm: the host


def test_lost_peers_are_the_ranks_that_do_not_answer_on_the_store(monkeypatch):
    import torch.distributed as dist
    from pretrain.runtime import layout
    store = dist.HashStore()
    for rank, node in enumerate(["z3node1", "z3node1", "z3node2", "z3node2", "z3node3", "z3node3"]):
        store.set(f"{layout.NODE_KEY}{rank}", node)
    for rank in (1, 4, 5):  # the other survivors answered before this rank looked
        store.set(f"{layout.ALIVE_KEY}{rank}", "1")
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
    monkeypatch.setattr(dist, "get_world_size", lambda: 6)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    assert layout.lost_peers(settle_s=0) == "ranks 2, 3 on z3node2"
    store.set(f"{layout.ALIVE_KEY}3", "1")
    assert layout.lost_peers(settle_s=0) == "rank 2 on z3node2"
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: (_ for _ in ()).throw(RuntimeError()))
    assert layout.lost_peers(settle_s=0) == ""  # the store went with rank 0's node: nothing to name


def test_a_survivor_still_silent_beside_a_lost_node_is_not_named(monkeypatch):
    """A lost node, while a rank of the node left is still blocked in its collective (until train.timeout_minutes):
    only the silent node's ranks are named (the 2-node Slurm test once named rank 0 "lost" beside node 2's ranks);
    a rank lost alone on a live node, no node silent, is named."""
    import torch.distributed as dist
    from pretrain.runtime import layout
    store = dist.HashStore()
    for rank, node in enumerate(["z3node1", "z3node1", "z3node2", "z3node2"]):
        store.set(f"{layout.NODE_KEY}{rank}", node)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    assert layout.lost_peers(settle_s=0) == "ranks 2, 3 on z3node2"  # rank 0 has not answered
    store.set(f"{layout.ALIVE_KEY}2", "1")  # node 2 answered in part: no node silent, every missing rank is named
    assert layout.lost_peers(settle_s=0) == "rank 0 on z3node1; rank 3 on z3node2"
    store.set(f"{layout.ALIVE_KEY}0", "1")
    assert layout.lost_peers(settle_s=0) == "rank 3 on z3node2"


def test_the_lost_peers_lead_the_failure_reason(tmp_path):
    from pretrain.runtime.status import record_failure
    err = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:48834")
    record_failure(err, tmp_path, 0, 4, 7, 15.0, "ranks 2, 3 on z3node2")
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["reason"] == ("lost ranks 2, 3 on z3node2: RuntimeError: [pair.cc:553] Connection closed by peer "
                                "[127.0.0.1]:48834")
    assert (status["status"], status["exit_code"], status["steps"]) == ("failed", 5, 7)


def test_node_names_go_into_the_hosts_file_and_come_out_again_stale_ones_too(tmp_path, monkeypatch):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n")
    monkeypatch.setattr(local_cluster, "HOSTS_FILE", hosts)
    crashed = tmp_path / "crashed"  # an earlier cluster that died without its stop: its daemons are gone
    crashed.mkdir()
    (crashed / "daemons.json").write_text(json.dumps({"slurmctld": 2 ** 22 + 1}))
    hosts.write_text(hosts.read_text() + f"127.0.0.11 z3node1 {local_cluster.HOSTS_MARKER} {crashed}\n")
    cluster = local_cluster.LocalCluster(tmp_path / "c", nodes=3)
    cluster._add_hosts()
    assert hosts.read_text() == "127.0.0.1 localhost\n" + "".join(
        f"127.0.0.{10 + i} z3node{i} {local_cluster.HOSTS_MARKER} {cluster.root}\n" for i in (1, 2, 3))
    with pytest.raises(RuntimeError, match="already names z3node1"):  # a live cluster's names are not taken over
        (tmp_path / "c" / "daemons.json").parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "c" / "daemons.json").write_text(json.dumps({"slurmctld": os.getpid()}))
        local_cluster.LocalCluster(tmp_path / "d", nodes=2)._add_hosts()
    (tmp_path / "c" / "daemons.json").unlink()  # (this test's own pid stood in for a live daemon)
    cluster.stop()
    assert hosts.read_text() == "127.0.0.1 localhost\n"
    with pytest.raises(ValueError, match="nodes = 5 is not a node count 1..4"):
        local_cluster.LocalCluster(tmp_path / "e", nodes=5)
