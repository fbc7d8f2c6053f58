"""A Llama-shaped decoder (RoPE, SwiGLU, RMSNorm, GQA 2 groups × 2 heads, q/k norms, no biases, untied output) under
every ZeRO stage and layout, held to one rank's run; its parameter count to GPTShape's; a TP 2 × DP 2 stage 3
checkpoint resumed at TP 1 × DP 4 stage 1."""
import pytest
import torch

from checkpoint_harness import train_segment
from gpt_harness import BASE, run_gpt_steps
from ranks import run_ranks

LLAMA = ('model.position_embedding="rope"', "model.rope_base=500000", 'model.mlp="swiglu"', 'model.norm="rmsnorm"',
         "model.num_query_groups=2", "model.qk_layernorm=true", "model.bias=false", "model.ffn_hidden_size=48",
         "train.global_batch_size=8", "model.make_vocab_size_divisible_by=64", "optimizer.weight_decay=0.1",
         'optimizer.no_weight_decay="embedding.*, output_layer.weight"')  # the same padded vocabulary at TP 1 and 2
STEPS = 4
# name -> overrides, on 4 ranks; each against the one-rank run (micro-batch 2 × 4 accumulation steps)
RUNS = {"stage0": ("zero.stage=0",), "stage1": ("zero.stage=1",), "stage2": ("zero.stage=2",),
        "stage3": ("zero.stage=3",),
        "tp2_dp2_sp_stage2": ("parallel.tensor=2", "parallel.sequence_parallel=true", "zero.stage=2"),
        "tp2_dp2_pa_cpu_stage1": ("parallel.tensor=2", "zero.stage=1", 'model.recompute="full"',
                                  "zero.partition_activations=true", "zero.cpu_checkpointing=true"),
        "pp2_dp2_stage1": ("parallel.pipeline=2", "zero.stage=1")}


def _count(out: dict, overrides: tuple) -> dict:
    from pretrain.config import load_config
    cfg = load_config(None, BASE + list(LLAMA) + list(overrides))
    return {"psi": out["psi"], "expected": cfg.model.shape.params(cfg.parallel.tensor)}


def _runs(rank, world_size):
    """Every RUNS entry in one launch, megatron's groups rebuilt between them; each from the same weights."""
    from pretrain.runtime.layout import destroy_model_parallel_groups
    out = {}
    for name, overrides in RUNS.items():
        run = run_gpt_steps(rank, world_size, list(LLAMA) + list(overrides), STEPS, layout_free_init=True)
        out[name] = {"loss": run["loss"], "grad_norm": run["grad_norm"], "params": run["params"],
                     **_count(run, overrides)}
        destroy_model_parallel_groups()
    return out


@pytest.fixture(scope="module")
def one_rank():
    (out,) = run_ranks(run_gpt_steps, 1, list(LLAMA), STEPS, None, True, timeout=300)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_runs, 4, timeout=600)


def test_one_rank_trains_and_counts_its_parameters_as_gpt_shape(one_rank):
    from pretrain.config import load_config
    assert one_rank["loss"][-1] < one_rank["loss"][0]
    assert one_rank["psi"] == load_config(None, BASE + list(LLAMA)).model.shape.params()
    shape = load_config(None, BASE + list(LLAMA)).model.shape
    names = set(one_rank["params"])
    assert names == set(shape.parameter_names())  # GPTShape names what megatron builds (no positions, no biases)
    assert "embedding.position_embeddings.weight" not in names and not any(n.endswith(".bias") for n in names)
    # optimizer.no_weight_decay: the embedding and output matrices join the norms in the no-decay group
    assert one_rank["decaying"] == sorted(n for n in names if ".layers." in n and "norm" not in n)
    assert one_rank["params"]["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * 48, 32)  # [gate; up]
    assert one_rank["params"]["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (32 + 2 * 2 * 8, 32)


@pytest.mark.parametrize("name", list(RUNS))
def test_every_stage_and_layout_equals_one_rank(runs, one_rank, name):
    """fp32: losses and gradient norms within 1e-6 of the one-rank run; at TP 1 without PP every parameter too.
    Each rank's parameter count equals GPTShape's for its TP size (PP: a stage holds part of the model)."""
    for out in (r[name] for r in runs):
        torch.testing.assert_close(torch.tensor(out["loss"]), torch.tensor(one_rank["loss"]), rtol=1e-6, atol=0)
        torch.testing.assert_close(torch.tensor(out["grad_norm"]), torch.tensor(one_rank["grad_norm"]),
                                   rtol=1e-6, atol=0)
        if "pp2" not in name:
            assert out["psi"] == out["expected"]
        if "tp2" not in name and "pp2" not in name:
            for key, p in one_rank["params"].items():
                torch.testing.assert_close(out["params"][key], p, rtol=1e-6, atol=1e-6, msg=key)


def test_tp2_dp2_stage3_checkpoint_resumes_at_tp1_dp4_stage1(tmp_path):
    """Saved after step 3 of 6 at TP 2 × DP 2, stage 3 (SwiGLU's fc1 stored as one global [gate; up] tensor; the
    q/k norms' gradients, partial sums over TP, summed at the end of stage 3's backward): steps 4-6 resumed at stage 1
    equal stage 3's."""
    _resumes_at_tp1_dp4_stage1(list(LLAMA), tmp_path)


# Qwen2's Q/K/V-only biases on Qwen3's head size (4 heads × 12 = 48 over a hidden size of 32): QKV rows of 96 and
# their biases grouped by key/value head, split over TP 2 and read back whole at TP 1
QWEN = [k for k in LLAMA if k != "model.qk_layernorm=true"] + ["model.qkv_bias=true", "model.head_dim=12"]


def test_qwen_shaped_tp2_dp2_stage3_checkpoint_resumes_at_tp1_dp4_stage1(tmp_path):
    """The same resume with Q/K/V-only biases and a head size apart from hidden / heads (#53's model keys)."""
    _resumes_at_tp1_dp4_stage1(QWEN, tmp_path)


def _resumes_at_tp1_dp4_stage1(llama: list, tmp_path):
    whole = run_ranks(train_segment, 4, llama + ["parallel.tensor=2", "zero.stage=3"], tmp_path, 0, 6, (3,),
                      timeout=300)[0]["loss"]
    resumed = run_ranks(train_segment, 4, llama + ["parallel.tensor=1", "zero.stage=1"], tmp_path, 3, 6, (),
                        True, timeout=300)[0]
    assert resumed["resumed"]["step"] == 3
    torch.testing.assert_close(torch.tensor(resumed["loss"]), torch.tensor(whole[3:]), rtol=1e-6, atol=0)
    # The global tensors are megatron's TP-1 layout (an independent reference: the TP 1 model's own parameters
    # after loading), not merely a layout that reads back consistently: fc1 is [gate; up], QKV grouped by KV head.
    from pretrain.checkpoint.export import consolidated, read_model_tensors, resolve_step_dir
    manifest, tensors = read_model_tensors(resolve_step_dir(tmp_path))
    exported = consolidated(tensors, manifest["parameter_names"])
    assert exported.keys() == resumed["params_at_resume"].keys()
    for name, p in resumed["params_at_resume"].items():
        assert torch.equal(exported[name], p), name
