"""The probe's pieces: α-β collective times, the layer extrapolation, the verdict, CLI refusals, --real on CPU."""
import json

import pytest

from pretrain.probe import cli as probe
from zero3d.analysis.comm_model import Links, collective_seconds, comm_breakdown, ring_kind
from zero3d.analysis.estimate import DEFAULT_MARGIN_FRACTION
from pretrain.probe.report import GIB, extrapolate_layers, judge, relative_gap


def test_allreduce_inside_a_node_is_nvswitch_alpha_beta():
    tp_group = tuple(range(16))  # one DGX-2 node
    seconds = collective_seconds("allreduce_", 10**9, tp_group)
    assert seconds == pytest.approx(30 * 5e-6 + 2 * 15 / 16 * 10**9 / 300e9)


def test_dp_group_across_nodes_shares_the_nodes_infiniband():
    dp_group = tuple(range(1, 400, 16))  # TP rank 1 of each of the 25 nodes
    seconds = collective_seconds("_reduce_scatter_base_", 10**9, dp_group)
    per_gpu = 100e9 / 16  # 8 × 100 Gb/s per node, shared by 16 GPUs
    assert seconds == pytest.approx(24 * 10e-6 + 24 / 25 * 10**9 / per_gpu)
    faster = collective_seconds("_reduce_scatter_base_", 10**9, dp_group, Links(ib_bandwidth_per_node=200e9))
    assert faster < seconds


def test_comm_breakdown_names_collective_link_and_group():
    out = comm_breakdown([{"op": "_allgather_base_", "nbytes": 1000, "ranks": (0, 1)},
                          {"op": "allreduce_", "nbytes": 1000, "ranks": (0, 16)}])
    assert set(out) == {"allgather over NVSwitch (group of 2)", "allreduce over IB (group of 2)"}


def test_unknown_collective_and_bad_links_are_refused():
    with pytest.raises(ValueError, match="collective 'alltoall_' has no α-β model"):
        ring_kind("alltoall_")
    with pytest.raises(ValueError, match="nvswitch_bandwidth = 0 is invalid"):
        Links(nvswitch_bandwidth=0)


def test_layer_extrapolation_is_the_line_through_two_probes():
    fit = extrapolate_layers(2, 5_000, 4, 9_000, usable_bytes=41_000)
    assert (fit.per_layer, fit.fixed, fit.max_layers) == (2_000, 1_000, 20)
    with pytest.raises(ValueError, match="peak did not grow with layers"):
        extrapolate_layers(2, 5_000, 4, 5_000, usable_bytes=41_000)


def test_verdict_uses_device_gib_minus_margin():
    usable = 32 * GIB * (1 - DEFAULT_MARGIN_FRACTION)  # the estimator's margin, one convention
    assert judge(int(usable), 32).fits and not judge(int(usable) + 1, 32).fits
    assert f"{DEFAULT_MARGIN_FRACTION:.0%} margin" in judge(0, 32).describe()
    assert relative_gap(105, 100) == pytest.approx(0.05) and relative_gap(0, 0) == 0.0


def test_bad_rank_and_steps_are_refused_before_any_work(capsys):
    assert probe.main(["--config", "configs/paper/fig2_100B_zero.toml", "--rank", "400"]) == 2
    assert "--rank 400 is invalid; valid ranks: 0 .. 399" in capsys.readouterr().err
    assert probe.main(["--config", "configs/tiny.toml", "--steps", "0"]) == 2
    assert "--steps 0 is invalid; must be >= 1" in capsys.readouterr().err
    assert probe.main(["--config", "configs/tiny.toml", "--world", "5"]) == 2
    assert "world size 5 is not divisible by parallel.tensor × parallel.pipeline = 2" in capsys.readouterr().err


def test_real_mode_on_cpu_times_phases_and_models_the_collectives(capsys):
    code = probe.main(["--config", "configs/tiny.toml", "--world", "4", "--rank", "3", "--steps", "1", "--real",
                       "--json", "model.num_layers=2", "train.global_batch_size=8"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["mode"] == "real"
    timing = out["timing"]
    assert set(timing["phase_s_per_step"]) == {"forward", "backward", "reduction", "optimizer step", "gather"}
    assert timing["compute_s_per_step"] == pytest.approx(sum(timing["phase_s_per_step"].values()))
    # TP 2 × DP 2 on one node: megatron's TP all-reduces and ZeRO's DP reductions, all over NVSwitch.
    assert "allreduce over NVSwitch (group of 2)" in timing["comm_s_per_step"]
    assert "reduce_scatter over NVSwitch (group of 2)" in timing["comm_s_per_step"]  # one per bucket
    assert timing["predicted_job_step_s"] == pytest.approx(
        timing["compute_s_per_step"] + sum(timing["comm_s_per_step"].values()))
    assert timing["mfu"] is None  # no peak for a CPU


def test_phase_lines_pick_the_phase_that_limits_first():
    from pretrain.probe.report import extrapolate_phases
    # backward grows 2 000 per layer from 1 000; the optimizer step 3 000 per layer from 0.
    phase, fit = extrapolate_phases(4, {"backward": 9_000, "optimizer step": 12_000},
                                    16, {"backward": 33_000, "optimizer step": 48_000}, usable_bytes=60_000)
    assert (phase, fit.max_layers) == ("optimizer step", 20)


def _probe_json(capsys, *overrides):
    code = probe.main(["--config", "configs/tiny.toml", "--world", "4", "--steps", "2", "--json",
                       "model.num_layers=2", "train.global_batch_size=8", "zero.stage=2", *overrides])
    return code, json.loads(capsys.readouterr().out)["run"]


def test_offloaded_optimizer_leaves_the_device_and_its_traffic_is_counted(capsys):
    """ZeRO-Offload in the probe: the master, Adam moments and (stage 2) the gradient shard count as
    host memory, not device memory; the PCIe traffic per step is each micro-batch's reduced gradient
    shard down (piece by piece as its buckets reduce) and the updated parameter shard up once."""
    _, device = _probe_json(capsys)
    _, offloaded = _probe_json(capsys, "zero.offload_optimizer=cpu")
    state, micro_batches = offloaded["engine_state_bytes"], offloaded["micro_batches"]
    counters = offloaded["optimizer_step_counter_bytes"]  # Adam's 0-dim step tensors
    assert device["model_states"]["optimizer"] >= device["engine_state_bytes"]["optimizer_states"] > 0
    assert offloaded["model_states"]["optimizer"] == counters
    assert offloaded["host_peak_by_category"]["optimizer"] == \
        state["host_master_params"] + state["host_optimizer_states"] > 0
    assert device["model_states"]["grads"] == device["engine_state_bytes"]["grads"] > 0
    assert offloaded["model_states"]["grads"] == state["grads"] == 0
    assert offloaded["host_peak_by_category"]["grads"] == device["engine_state_bytes"]["grads"]
    shard_bytes = state["host_master_params"]  # fp32: gradient, master and parameter shards have one size
    assert offloaded["host_traffic_per_step"] == {"to_host": micro_batches * shard_bytes, "to_device": shard_bytes}
    assert offloaded["peak_bytes"] < device["peak_bytes"]
    assert device["host_traffic_per_step"] == {"to_host": 0, "to_device": 0}


def test_nvme_offload_is_refused_on_fake_tensors(capsys, tmp_path):
    assert probe.main(["--config", "configs/tiny.toml", "zero.stage=2", "zero.offload_optimizer=nvme",
                       f"zero.nvme_path={tmp_path}"]) == 2
    assert "the NVMe placements do file I/O, which fake tensors cannot do" in capsys.readouterr().err


@pytest.mark.parametrize("gib,flag,fits", [(0.01, None, False), (0.01, 32, True)])
def test_budget_is_the_configs_gpu_memory_unless_the_flag_says(gib, flag, fits, capsys):
    """The tiny rank peaks at a few MB: under a 0.01 GiB card it cannot fit, under 32 GiB (the flag) it does;
    --estimate judges the same cluster.gpu_memory_gb."""
    args = ["--config", "configs/tiny.toml", f"cluster.gpu_memory_gb={gib}", "--steps", "1", "--json"]
    code = probe.main(args + (["--memory-gb", str(flag)] if flag else []))
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"]["device_bytes"] == int((flag or gib) * 2**30)
    assert (code, out["verdict"]["fits"]) == ((0, True) if fits else (1, False))


def _probe_full(capsys, *overrides):
    code = probe.main(["--config", "configs/tiny.toml", "--world", "4", "--steps", "2", "--json", "model.num_layers=2",
                       "train.global_batch_size=16", "parallel.tensor=1", "zero.stage=3", "cluster.gpus_per_node=2",
                       *overrides])
    assert code == 0
    return json.loads(capsys.readouterr().out)


def test_hpz_and_hybrid_memory_in_engine_probe_and_estimator_agree(capsys):
    """4 ranks as 2 nodes × 2 (N = 4, m = 2): hpZ adds the Ψb/m secondary shard = 2× the Ψb/N parameter
    shard; hybrid shards over m, doubling every state. Executed (the probe) = estimated, per category."""
    plain = _probe_full(capsys)
    hpz = _probe_full(capsys, "zero.secondary_partition=node")
    hybrid = _probe_full(capsys, "zero.hybrid=node")
    shard = plain["run"]["engine_state_bytes"]["params"]
    assert hpz["run"]["engine_state_bytes"]["secondary_params"] == 2 * shard
    assert hpz["run"]["model_states"]["params"] == 3 * shard
    assert hybrid["run"]["model_states"]["params"] == 2 * shard
    assert hybrid["run"]["model_states"]["grads"] == 2 * plain["run"]["model_states"]["grads"]
    for out in (plain, hpz, hybrid):
        by = {row["category"]: row for row in out["comparison"]}
        for category in ("params", "grads"):
            assert by[category]["estimate_bytes"] == by[category]["executed_bytes"], (category, out["config"])


def test_quantized_modes_are_refused_on_fake_tensors(capsys):
    assert probe.main(["--config", "configs/tiny.toml", "zero.stage=3", "zero.quantize_weights=int8",
                       "cluster.gpus_per_node=2"]) == 2
    assert "probe: zero.quantize_weights = 'int8': the quantization scales are data" in capsys.readouterr().err
