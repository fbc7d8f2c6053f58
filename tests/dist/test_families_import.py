"""The published families (issue #53), each a small random model of its own transformers config class
(tests/hf_models.py: GPT-2's gelu_new, Llama-3.2's llama3 RoPE scaling with tied embeddings, Qwen2's Q/K/V biases,
Qwen3's head size ≠ hidden / heads, Mistral's sliding window), imported with `train.init_from`'s loader at TP 2 × DP 2,
ZeRO stage 3, and at TP 1 × DP 2, stage 1: step 1's loss equals transformers' on the same tokens within 1e-5 (fp32;
the tokens are the test's, fed to each DP rank as its micro-batches, not chosen by zero3d's data path); the stage 3
run's checkpoint exported with `export --format hf` gives back the original tensors bit for bit and the original
class. Vocabulary 256: megatron pads nothing at TP 1 or 2; the padded-vocabulary variants (300: 512 rows at TP 2, in the
stage 3 launch) start at transformers' loss too, the padded ids getting no probability (pretrain/model/loss.py)."""
from pathlib import Path

import pytest
import torch

from hf_models import FAMILIES, FAMILY_SEQ, build_family, family_tokens, hf_loss
from ranks import run_ranks

VOCAB, PADDED_VOCAB = 256, 300
LAYOUTS = {"tp2_dp2_stage3": (4, ["parallel.tensor=2", "zero.stage=3"]),
           "tp1_dp2_stage1": (2, ["parallel.tensor=1", "zero.stage=1"])}
MICRO_BATCH = 2  # 8 samples: 2 micro-batches a rank at DP 2
TOLERANCE = 1e-5  # fp32: transformers' and megatron's sums in another order, ~1e-6 of a loss of ~7 measured


def _first_steps(rank, world_size, directories: dict, layout: list, save_root):
    """Each family's HF model imported as train.init_from does (its [model] keys, then load_into before the engine
    takes the weights), one step on the test's tokens: this DP rank's rows, MICRO_BATCH at a time. With `save_root`,
    a checkpoint of the imported weights (step 0) under save_root/<kind>. Returns {kind: step 1's mean loss}."""
    import zero3d
    from checkpoint_harness import synthetic_identity
    from gpt_harness import BASE
    from pretrain.checkpoint.checkpointer import Checkpointer, layout_signature
    from pretrain.checkpoint.hf import ImportedModel, check_matches, load_into, model_overrides
    from pretrain.config import load_config
    from pretrain.model.gpt import build_model, parallel_groups
    from pretrain.runtime.layout import destroy_model_parallel_groups, init_layout
    from pretrain.step import mean_loss, run_micro_batches
    from pretrain.train import engine_settings
    losses = {}
    for kind, directory in directories.items():
        imported = ImportedModel(Path(directory))
        cfg = load_config(None, BASE + model_overrides(imported.model) + layout + [
            f"model.seq_length={FAMILY_SEQ}", f"train.micro_batch_size={MICRO_BATCH}", "train.global_batch_size=8",
            f'train.init_from="{directory}"'])
        check_matches(imported.model, cfg.model, directory)
        topo = init_layout(cfg)
        model = build_model(cfg, topo.device)
        load_into(model, imported)
        engine = zero3d.wrap_model(model, engine_settings(cfg), parallel_groups(model, topo))
        if save_root is not None:
            ckpt = Checkpointer(Path(save_root) / kind, model, engine, async_save=False)
            ckpt.save(0, {"layout": layout_signature(cfg, topo), "identity": synthetic_identity(cfg),
                          "config": cfg.to_dict(), "consumed_samples": 0})
            ckpt.close()
        tokens = family_tokens(cfg.model.vocab_size)
        mine = tokens.chunk(topo.dp)[topo.dp_rank]
        losses[kind] = mean_loss(run_micro_batches(engine, list(mine.split(MICRO_BATCH)), cfg, topo), topo)
        engine.step(cfg.optimizer.lr)
        destroy_model_parallel_groups()
    return losses


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """Every family at both vocabularies, saved; each layout one launch over them (the padded ones at TP 2 alone);
    transformers' losses."""
    root = tmp_path_factory.mktemp("families")
    directories, expected, originals = {}, {}, {}
    for kind in FAMILIES:
        for vocab in (VOCAB, PADDED_VOCAB):
            name = f"{kind}-{vocab}"
            model = build_family(kind, vocab)
            model.save_pretrained(root / name)
            directories[name] = str(root / name)
            expected[name] = hf_loss(model, family_tokens(vocab))
            originals[name] = {k: v.clone() for k, v in model.state_dict().items()}
    losses = {}
    for layout, (world, overrides) in LAYOUTS.items():
        save_root = root / "checkpoints" if layout == "tp2_dp2_stage3" else None
        mine = {name: d for name, d in directories.items() if save_root or name.endswith(f"-{VOCAB}")}
        ranks = run_ranks(_first_steps, world, mine, overrides, save_root and str(save_root), timeout=600)
        assert all(r == ranks[0] for r in ranks)  # every rank holds the same mean
        losses[layout] = ranks[0]
    return {"losses": losses, "expected": expected, "originals": originals, "root": root}


def _assert_loss(families, kind, vocab, layout):
    name = f"{kind}-{vocab}"
    got, expected = families["losses"][layout][name], families["expected"][name]
    assert got == pytest.approx(expected, rel=TOLERANCE, abs=0), (name, layout, got, expected)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", FAMILIES)
def test_step_one_loss_equals_transformers(families, kind, layout):
    _assert_loss(families, kind, VOCAB, layout)


@pytest.mark.parametrize("kind", FAMILIES)
def test_step_one_loss_equals_transformers_with_a_padded_vocabulary(families, kind):
    _assert_loss(families, kind, PADDED_VOCAB, "tp2_dp2_stage3")


@pytest.mark.parametrize("kind", FAMILIES)
def test_the_stage3_checkpoint_exports_the_original_tensors_bitwise(families, kind, tmp_path):
    """`export --format hf` of the checkpoint saved at TP 2 × DP 2, stage 3 (the imported weights, DCP-sharded): the
    original state dict bit for bit (the padded rows dropped), the original class, and transformers' logits."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pretrain.checkpoint.export import export
    name = f"{kind}-{VOCAB}"
    export(families["root"] / "checkpoints" / name, tmp_path / "hf", fmt="hf", with_tokenizer=False)
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    original = families["originals"][name]
    if json.loads((families["root"] / name / "config.json").read_text()).get("tie_word_embeddings", False):
        original.pop("lm_head.weight", None)
    original = {k: v for k, v in original.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    assert exported.keys() == original.keys()
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor), key
    source = json.loads((families["root"] / name / "config.json").read_text())["architectures"][0]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(model).__name__ == source
    tokens = family_tokens(VOCAB)
    reference = AutoModelForCausalLM.from_pretrained(families["root"] / name).eval()
    with torch.no_grad():
        assert torch.equal(model(tokens[:, :-1]).logits, reference(tokens[:, :-1]).logits)


# The published models at their own attention geometry (hidden size, heads, key/value heads, head size,
# RoPE base and scaling, norms, biases, tying, window) with one layer, an MLP 256 wide and 512 tokens of vocabulary:
# small enough for CPU ranks, every layout-bearing size as published.
REAL_SHAPES = ("GPT-2 (124M)", "Llama-3.2-1B", "SmolLM2-135M", "Qwen2.5-0.5B", "Qwen3-0.6B", "Qwen3-1.7B",
               "Mistral-7B-v0.1")
REAL_TOKENS = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(3))


def _one_layer(config: dict) -> dict:
    """The published config.json at one layer, an MLP 256 wide, 512 tokens, in fp32 (transformers would build a
    model of its torch_dtype, bf16)."""
    gpt2 = config["architectures"][0] == "GPT2LMHeadModel"
    keys = {"n_layer": 1, "n_inner": 256} if gpt2 else {"num_hidden_layers": 1, "intermediate_size": 256}
    return {**{k: v for k, v in config.items() if k != "torch_dtype"}, **keys, "vocab_size": 512}


def _real_shape_logits(rank, world_size, directories: dict):
    """Each directory's model imported at TP 1 (RoPE models at 16 tokens), its logits on REAL_TOKENS."""
    from pretrain.checkpoint.hf import ImportedModel, load_into, model_overrides
    from pretrain.config import load_config
    from pretrain.model.gpt import build_model, gpt_inputs
    from pretrain.runtime.layout import destroy_model_parallel_groups, init_layout
    out = {}
    for name, directory in directories.items():
        imported = ImportedModel(Path(directory))
        rope = imported.model["position_embedding"] == "rope"
        cfg = load_config(None, ["logging.wandb=false", "model.loss_chunk_tokens=0", "train.micro_batch_size=2",
                                 "train.global_batch_size=2", *model_overrides(imported.model)]
                          + (["model.seq_length=16"] if rope else []))
        topo = init_layout(cfg)
        model = build_model(cfg, topo.device)
        load_into(model, imported)
        model.eval()
        inputs, positions, mask, _ = gpt_inputs(torch.cat([REAL_TOKENS, REAL_TOKENS[:, :1]], dim=1))
        with torch.no_grad():
            out[name] = model(inputs, positions, mask)[..., :512]
        del model
        destroy_model_parallel_groups()
    return out


def test_published_shapes_at_one_layer_compute_transformers_logits(tmp_path):
    """Each published model of the issue's list, built by transformers from its config.json at one layer (random
    weights, every bias and norm random), imported: its logits equal transformers' within 1e-5."""
    import copy

    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_models import randomise_vectors
    from published_configs import PUBLISHED
    directories, expected = {}, {}
    for name in REAL_SHAPES:
        config = copy.deepcopy(_one_layer(PUBLISHED[name][0]))
        hf_config = AutoConfig.for_model(config.pop("model_type"), **config)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(hf_config).eval()
        randomise_vectors(model)
        directory = tmp_path / name.replace(" ", "_")
        model.save_pretrained(directory)
        directories[name] = str(directory)
        with torch.no_grad():
            expected[name] = model(REAL_TOKENS).logits
        del model
    (got,) = run_ranks(_real_shape_logits, 1, directories, timeout=600)
    for name in REAL_SHAPES:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-5, msg=name)


def _mlp_at_the_gpu_config(rank, world_size, mlp_kind):
    """megatron's MLP built with the TransformerConfig a GPU run gets (transformer_config(on_cuda=True): its fusions),
    on CPU weights, fc1 and fc2 at std 1 so that fc1's outputs span GELU's curved part and fc2 carries the difference;
    (input, fc1, fc2 weights and biases, output)."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    from pretrain.config import load_config
    from pretrain.model.gpt import transformer_config
    from pretrain.runtime.layout import init_layout
    cfg = load_config(None, ["logging.wandb=false", "model.hidden_size=16", "model.num_attention_heads=2",
                             f'model.mlp="{mlp_kind}"', "train.micro_batch_size=1", "train.global_batch_size=1"])
    init_layout(cfg)
    config = dataclasses.replace(transformer_config(cfg, on_cuda=True), use_cpu_initialization=True)
    mlp = build_module(get_gpt_layer_local_spec().submodules.mlp, config=config)
    with torch.no_grad():
        mlp.linear_fc1.weight.normal_(0, 1.0)
        mlp.linear_fc1.bias.uniform_(-1, 1)
        mlp.linear_fc2.weight.normal_(0, 1.0)
    x = torch.randn(8, 1, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out, bias = mlp(x)
    return {"x": x, "out": out + bias, **{n: p.detach().clone() for n, p in mlp.named_parameters()}}


@pytest.mark.parametrize("mlp_kind", ["gelu", "gelu_tanh"])
def test_a_gelu_mlp_computes_its_own_gelu_with_the_gpu_fusions(mlp_kind):
    """megatron fuses an MLP's bias and GELU on GPUs with its tanh approximation whatever the model's GELU: zero3d
    fuses SwiGLU's alone, so the exact GELU stays exact (and the tanh one tanh). Megatron's MLP at a GPU run's config,
    run on CPU (the fused kernel is plain torch), equals the test's own fc1 → GELU → fc2 within fp32 rounding; the two
    GELUs differ there by far more."""
    (got,) = run_ranks(_mlp_at_the_gpu_config, 1, mlp_kind, timeout=300)
    pre = got["x"] @ got["linear_fc1.weight"].t() + got["linear_fc1.bias"]
    expect = {kind: torch.nn.functional.gelu(pre, approximate=approximate) @ got["linear_fc2.weight"].t()
              + got["linear_fc2.bias"] for kind, approximate in (("gelu", "none"), ("gelu_tanh", "tanh"))}
    other = "gelu_tanh" if mlp_kind == "gelu" else "gelu"
    torch.testing.assert_close(got["out"], expect[mlp_kind], rtol=0, atol=1e-5)  # outputs of ~10: fp32 sums
    assert (expect[mlp_kind] - expect[other]).abs().max() > 1e-3
