"""#57: one memory model for the planner and the run. `python -m pretrain --config X --plan` weighs the layouts of a
config with the objects `--estimate` reads, so each layout's memory is what `python -m pretrain --estimate` of the
config with the layout's overrides prints, to the byte: both real commands, for the Llama-3 recipes' own layouts and
the planner's top choices, context parallelism at 128K, sequence parallelism at TP 8 and no recomputation."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def pretrain(*args: str) -> object:
    """`python -m pretrain ... --json`'s output, the command run as a user runs it."""
    done = subprocess.run([sys.executable, "-m", "pretrain", "--json", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode in (0, 2), done.stderr  # 2: --estimate of a layout that does not fit
    return json.loads(done.stdout)


def estimate_bytes(config: str, *overrides: str) -> dict:
    return pretrain("--estimate", "--config", config, *overrides)


def recipe_layout(config: str) -> list:
    """The overrides --plan prints for the recipe's own layout, read from the recipe by hand."""
    return {"configs/llama3_8b.toml": ["parallel.tensor=1", "parallel.context=1", "parallel.sequence_parallel=false",
                                       "zero.stage=2", 'model.recompute="full"', "train.micro_batch_size=1"],
            "configs/llama3_70b.toml": ["parallel.tensor=8", "parallel.context=1", "parallel.sequence_parallel=true",
                                        "zero.stage=2", 'model.recompute="full"', "train.micro_batch_size=1"]}[config]


def plain(overrides: list) -> bool:
    """No ZeRO-R, offload or node-aware mode: the recipes' own settings."""
    return all(o in overrides for o in ("zero.partition_activations=false", 'zero.offload_optimizer="none"',
                                        'zero.secondary_partition="none"', 'zero.hybrid="none"',
                                        'zero.quantize_weights="none"', 'zero.quantize_gradients="none"'))


@pytest.mark.parametrize("config", ["configs/llama3_8b.toml", "configs/llama3_70b.toml"])
def test_the_recipes_layout_and_the_planners_top_choice_are_estimated_alike(config):
    planned = pretrain("--plan", "--config", config)
    mine = [c for c in planned if plain(c["overrides"]) and set(recipe_layout(config)) <= set(c["overrides"])]
    assert len(mine) == 1, [c["overrides"] for c in planned][:5]
    assert mine[0]["memory"] == estimate_bytes(config)  # the recipe as written
    top = planned[0]
    assert top["memory"] == estimate_bytes(config, *top["overrides"])


@pytest.mark.parametrize("config, overrides, chosen", [
    # context parallelism at 160K: one node of 8B cannot hold a sequence on a rank at TP 1 (at 128K it can since
    # 2026-11-30, its one micro-batch's gradient shard not held at the peak)
    ("configs/llama3_8b.toml", ["cluster.nodes=1", "train.global_batch_size=8", "model.seq_length=163840"],
     lambda o: "parallel.context=1" not in o),
    # sequence parallelism at TP 8 (the 70B recipe's SP key on every TP > 1 layout)
    ("configs/llama3_70b.toml", [], lambda o: "parallel.tensor=8" in o and "parallel.sequence_parallel=true" in o
     and 'model.recompute="selective"' in o),
    # per-sample document masks, their bytes by micro-batch and accumulation
    ("configs/llama3_8b.toml", ["data.reset_attention_mask=true", "model.seq_length=2048"],
     lambda o: "train.micro_batch_size=2" in o),
    # no recomputation
    ("configs/llama3_8b.toml", ["cluster.nodes=4", "train.global_batch_size=64"],
     lambda o: 'model.recompute="none"' in o and "parallel.tensor=2" in o),
], ids=["cp-at-160k", "sp-at-tp8", "document-masks", "no-recompute"])
def test_a_planned_layout_is_what_estimate_prints_to_the_byte(config, overrides, chosen):
    planned = pretrain("--plan", "--config", config, *overrides)
    picked = [c for c in planned if chosen(c["overrides"])]
    assert picked, [c["overrides"] for c in planned][:5]
    for c in picked[:2]:
        assert c["memory"] == estimate_bytes(config, *overrides, *c["overrides"])


def test_layouts_equal_in_time_are_ranked_by_memory_headroom():
    """The 13B shape of docs/estimator.md on 4 × 8 H100: the top layouts all model 5.61 s at micro-batch 16; hpZ's
    secondary copy (Ψ·2/m more) and hybrid's node-sharded states hold more than plain stage 3, so they rank below it.
    No two consecutive layouts keep an order that time, accumulation and memory do not give. (Megatron's loss holds
    the 16 × 1024 tokens' bf16 logits beside their fp32 copy, 1.65 GB above the 4 bytes a logit counted until
    2026-11-30: 34.7 → 36.3 GB; the one micro-batch's gradient shard, held at the peak only for the output layer's and
    the last layer's units since, 36.3 → 35.5 GB, and hybrid's node-sharded one 56.0 → 52.9 GB; the logits freed
    before the last layer's backward, the peak, since 2026-12-01: 35.5 → 30.6 GB, hpZ 38.8 → 33.9, hybrid 47.9.)"""
    from analysis.cluster import ClusterSpec
    from analysis.planner import plan
    found = plan(ClusterSpec("dgx-h100", nodes=4).cluster("bf16"), layers=40, hidden=5120, heads=40, vocab=50257,
                 seq=1024, global_batch=512, recompute="full", precision="bf16")
    keys = [(-c.samples_per_s, c.accumulation, c.memory.total_bytes) for c in found]
    assert keys == sorted(keys)
    top = [(c.zero.label, round(c.memory.total_bytes / 1e9, 1)) for c in found[:6]]
    assert top == [("P_os+g+p", 30.6), ("P_os+g+p + qwZ", 30.6), ("P_os+g+p + qgZ", 30.6), ("P_os+g+p + hpZ", 33.9),
                   ("P_os+g+p + qwZ+hpZ+qgZ", 33.9), ("P_os+g+p + hybrid", 47.9)]


@pytest.mark.parametrize("config, overrides", [
    ("configs/llama3_70b.toml", []), ("configs/llama3_8b.toml", []),
    ("configs/llama3_8b.toml", ["cluster.nodes=1", "train.global_batch_size=8", "model.seq_length=163840"]),
], ids=["70b", "8b", "8b-at-160k"])
def test_every_planned_layout_is_a_config_the_run_accepts_and_estimates_alike(config, overrides):
    """Beyond the commands above, in one process: each of the 103 / 727 / 152 layouts (hpZ, hybrid, qwZ, qgZ, Pa, CP
    and every recompute policy among them) is a config that loads and validates, whose start-up estimate
    (device_estimate, what --estimate prints and the guard judges) is the planner's, field by field."""
    from pretrain.config import load_config, validate_layout
    from pretrain.memory_check import device_estimate, gpu_budget_bytes
    from pretrain.plan import overrides_of, plan_config
    found = plan_config(load_config(config, overrides))
    assert found
    for c in found:
        cfg = load_config(config, overrides + overrides_of(c))
        world = cfg.cluster.nodes * cfg.cluster.gpus_per_node
        validate_layout(cfg, world)
        assert device_estimate(cfg, world, gpu_budget_bytes(cfg.cluster))[0].to_dict() == c.memory.to_dict()
