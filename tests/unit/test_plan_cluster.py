"""The user's cluster (#39): presets, custom flags and [cluster] TOML feed the planner; one layout on 4 × 8 H100 by hand."""
import math

import pytest

from analysis import planner
from analysis.__main__ import main
from analysis.cluster import PAPER_CLUSTER, ClusterSpec, spec_from_toml

GIB = 2**30
# 13B-class shape (Llama-2 13B's 40 × 5120) at the paper's sequence and GPT-2 vocabulary
L, H, A, S, V, B = 40, 5120, 40, 1024, 50257, 512


def test_paper_preset_is_the_paper_cluster():
    """Paper §4.1: 25 DGX-2 × 16 V100-32GB, NVSwitch 300 GB/s, 8 × 100 Gb/s IB, 125 TFLOP/s fp16, 39/125 sustained."""
    c = PAPER_CLUSTER
    assert (c.nodes, c.gpus_per_node, c.gpus) == (25, 16, 400)
    assert (c.gpu_memory_bytes, c.peak_flops, c.efficiency) == (32 * GIB, 125e12, 39 / 125)
    assert (c.intra_node_bandwidth, c.inter_node_bandwidth, c.pcie_bandwidth) == (300e9, 100e9, 15.75e9)
    assert (c.intra_latency, c.inter_latency) == (5e-6, 10e-6)


def test_h100_layout_by_hand():
    """tp 8 fills an 8-GPU node: dp 4, one DP rank per node, so the stage-0 all-reduce crosses nodes whole, at
    the GPU's 1/8 share of 8 × 400 Gb/s; micro-batch 1, 128 accumulation steps; bf16 on 80 GiB at 989 TFLOP/s."""
    cluster = ClusterSpec("dgx-h100", nodes=4).cluster("bf16")
    found = planner.plan(cluster, layers=L, hidden=H, heads=A, vocab=V, seq=S, global_batch=B, recompute="full",
                         precision="bf16")
    c = next(c for c in found if c.tp == 8 and c.zero == planner.ZeroChoice(0) and c.micro_batch == 1)
    t, dp, b, acc = 8, 4, 1, 128
    assert (c.dp, c.accumulation) == (dp, acc)
    # parameters on one TP rank (docs/estimator.md table): vocabulary padded to a multiple of 128·8 = 51200
    v_pad = 51200
    per_layer = (3 * H * H + 3 * H + H * H + 4 * H * H + 4 * H + 4 * H * H) // t + H + H + 4 * H
    psi = L * per_layer + 2 * H + v_pad * H // t + S * H + v_pad * H // t
    assert c.memory.params_per_rank == psi
    # memory: 16Ψ, checkpoints L·b·s·h·2, one layer's activations, the slice's bf16 logits beside their fp32 copy
    # (megatron's loss, eager: 2 + 4 bytes each), one 5e7 bucket, 10%; or, when larger, the step's moment: beside the
    # 16Ψ the chunk of the bf16 gradient it casts to fp32 at once, 2²² elements of 4 bytes (no copy of the whole, 4Ψ)
    layer = S * b * H * 10 + (S * b * (8 * H + 4 * 4 * H) + A * S * S * b * 5) // t
    backward = L * b * S * H * 2 + layer + b * S * v_pad // t * (2 + 4) + 4 * 50_000_000
    total = 16 * psi + max(backward, 4 * 2**22) + 0.1 * 80 * GIB
    assert c.memory.total_bytes == pytest.approx(total, rel=1e-12)
    # time: FLOPs = 96·B·s·L·h²·(1 + s/(6h) + V/(16·L·h)) at 31.2% of 989 TFLOP/s on 32 GPUs, V the logit GEMM's
    # width: the vocabulary padded at this TP size (as the training loop's metrics count it)
    flops = 96 * B * S * L * H**2 * (1 + S / (6 * H) + v_pad / (16 * L * H))
    compute = flops / (32 * 989e12 * 39 / 125)
    mp = acc * 12 * b * S * H * L * 2 / 900e9  # 6 all-reduces of b·s·h, twice the bytes, over NVLink 4
    buckets = math.ceil(psi / 50e6) + 1
    allreduce = buckets * 2 * (dp - 1) * 10e-6 + 2 * psi * 2 * (dp - 1) / dp / (400e9 / 8)
    dp_exposed = max(0.0, allreduce - compute / acc * 3 / 4)  # under the last backward
    assert (c.compute_s, c.mp_s, c.dp_s) == pytest.approx((compute, mp, dp_exposed), rel=1e-9)
    assert dp_exposed > 0
    assert c.tflops_per_gpu == pytest.approx(flops / (compute + mp + dp_exposed) / 32 / 1e12, rel=1e-9)


def test_cli_plan_rank_on_h100(capsys):
    argv = (f"--plan rank --cluster dgx-h100 --nodes 4 --precision bf16 --layers {L} --hidden {H} --heads {A} "
            f"--global-batch {B} --recompute full --top 3").split()
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "on 4 DGX H100 × 8 H100-SXM5-80GB (32 GPUs)" in out
    # the paper's kernels (--attention local, eager): measured on a V100 only, so its share, stated
    assert out.splitlines()[1] == ("compute at 31.2% of peak, the mean of 1 measured row(s) (none on H100 along local "
                                   "attention, eager; rows of the same attention, compiled, float8): V100: Megatron-LM, "
                                   "one V100 (Shoeybi et al. 2019)")
    # nothing exposed at tp 1 stage 3: 39/125 of 989 TFLOP/s
    assert f"{989 * 39 / 125:5.1f} TFLOP/s/GPU" in out.splitlines()[2]


def test_custom_flags_and_toml(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[cluster]\npreset = "dgx-a100"\nnodes = 2\ninter_bw = 25\n')
    c = spec_from_toml(str(toml)).cluster("bf16")
    assert (c.gpus, c.peak_flops, c.gpu_memory_bytes) == (16, 312e12, 80 * GIB)
    assert c.inter_node_bandwidth == 25e9 * 8 and c.intra_node_bandwidth == 600e9
    c = ClusterSpec(gpus_per_node=4, gpu_peak_tflops=100, gpu_memory_gb=24, intra_bw=50, nodes=3).cluster()
    assert (c.gpus, c.peak_flops, c.gpu_memory_bytes, c.intra_node_bandwidth) == (12, 100e12, 24 * GIB, 50e9)
    assert c.inter_node_bandwidth == 100e9  # the DGX-2's 8 × 100 Gb/s per node, kept


@pytest.mark.parametrize("argv,message", [
    ("--plan rank --cluster dgx-9", "argument --cluster: invalid choice: 'dgx-9'"),
    ("--plan rank --nodes 0", "cluster nodes = 0 is invalid; must be a positive integer"),
    ("--plan paper --cluster dgx-h100", "--plan paper judges the paper's runs on the paper's cluster"),
    ("--plan rank --inter-bw -1", "cluster inter_bw = -1.0 is invalid; must be a number > 0"),
    ("--plan rank --precision bf16 --layers 2 --hidden 64 --heads 4 --global-batch 8",
     "precision bf16 is invalid on V100-SXM3-32GB (no bf16 tensor cores); valid: fp16, fp32"),
])
def test_bad_cluster_is_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv.split())
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert exit_.value.code == 2 and len(errors) == 1 and message in errors[0]  # one line names the bad value


def test_toml_without_cluster_section(tmp_path, capsys):
    (tmp_path / "x.toml").write_text("[model]\nlayers = 2\n")
    with pytest.raises(SystemExit):
        main(["--plan", "rank", "--cluster-file", str(tmp_path / "x.toml")])
    assert "has no [cluster] section; keys: preset, nodes" in capsys.readouterr().err


def test_largest_on_64_h100_keeps_the_trained_aspect(capsys):
    """Stage 3 on 64 H100: the deepest fitting model at each hidden, capped at hidden/32 layers, none below
    hidden/131; the answer's shape is within the rule and its one-more-layer model does not fit."""
    assert main("--largest --cluster dgx-h100 --gpus 64 --stage 3 --recompute full --precision bf16 --json".split()) == 0
    import json
    out = json.loads(capsys.readouterr().out)
    layers, hidden, heads = out["layers"], out["hidden"], out["heads"]
    assert 32 <= hidden / layers <= 131 and heads == hidden // 128 and hidden % 1024 == 0
    assert out["device"]["fits"] and out["device"]["gpu_memory_bytes"] == 80 * GIB
    assert "32 ≤ hidden/layers ≤ 131" in out["shape_rule"]
    assert out["params"] > 200e9


def test_run_configs_gpu_names_its_links_and_peak():
    """cluster.gpu of a run config (the probe's α-β prediction, metrics' MFU): the preset's node at the config's
    GPUs per node; the DGX-2's are the paper's (comm_model.PAPER_LINKS)."""
    from analysis.cluster import links_for_gpu
    from analysis.comm_model import PAPER_LINKS
    from pretrain.metrics import PEAK_TFLOPS
    assert links_for_gpu("V100", 16) == PAPER_LINKS
    h100 = links_for_gpu("H100", 4)
    assert (h100.gpus_per_node, h100.nvswitch_bandwidth, h100.ib_bandwidth_per_node) == (4, 900e9, 400e9)
    assert PEAK_TFLOPS["H100"] == {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0, "fp8": 1979.0} and "bf16" not in PEAK_TFLOPS["V100"]
    with pytest.raises(ValueError, match="cluster.gpu = 'B200' has no node preset for the α-β model; valid: V100, A100"):
        links_for_gpu("B200", 8)


def test_a_run_configs_cluster_section_describes_the_cluster(tmp_path, capsys):
    """configs/paper/fig2_100B_zero.toml's [cluster] (25 nodes × 16, gpu V100, 32 GiB, time_limit): the paper's
    cluster exactly; tiny's (1 × 4 H100) the DGX H100 preset at 4 GPUs per node; an unknown gpu one line."""
    assert spec_from_toml("configs/paper/fig2_100B_zero.toml").cluster() == PAPER_CLUSTER
    c = spec_from_toml("configs/tiny.toml").cluster("bf16")
    assert (c.nodes, c.gpus_per_node, c.peak_flops, c.inter_node_bandwidth) == (1, 4, 989e12, 400e9)
    (tmp_path / "b.toml").write_text('[cluster]\ngpu = "B200"\nnodes = 2\n')
    with pytest.raises(SystemExit):
        main(["--plan", "rank", "--cluster-file", str(tmp_path / "b.toml")])
    assert "[cluster] gpu = 'B200' in " in capsys.readouterr().err
