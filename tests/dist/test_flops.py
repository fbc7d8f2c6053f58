"""The FLOPs formula (model_shape.flops) against torch's own count of one step of the built model."""
import pytest

from gpt_harness import BASE
from ranks import run_ranks

# megatron's local attention: its QKᵀ and AV are aten matmuls the counter sees (it does not count CPU SDPA's fused
# kernel at all: 11% of this model's FLOPs would go missing)
SHAPE = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=64",
         "model.vocab_size=512", "train.micro_batch_size=2", "train.global_batch_size=2", 'model.attention="local"']


def _counted_step(rank, world_size, overrides):
    """Matmul FLOPs torch's FlopCounterMode sees in one forward and backward of this config's model."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from pretrain.config import load_config
    from pretrain.model.gpt import build_model
    from pretrain.runtime.layout import init_layout
    cfg = load_config(None, BASE + SHAPE + list(overrides))
    topo = init_layout(cfg)
    model = build_model(cfg, topo.device)
    b, s = cfg.train.micro_batch_size, cfg.model.seq_length
    tokens = torch.randint(0, cfg.model.vocab_size, (b, s))
    mask = torch.ones(b, 1, s, s, dtype=torch.bool).triu(1)  # megatron's: True where attention is masked
    with FlopCounterMode(display=False) as counter:
        loss = model(tokens, torch.arange(s).expand(b, s), mask, labels=tokens).sum()
        loss.backward()
    flops = cfg.model.flops_per_step(cfg.parallel.tensor, cfg.train.global_batch_size)
    shape = cfg.model.shape
    scaled_mm = sum(n for op, n in counter.get_flop_counts()["Global"].items() if "_scaled_mm" in str(op))
    return {"counted": counter.get_total_flops(), "model": flops.model, "hardware": flops.hardware,
            "linears": flops.linears, "scaled_mm": scaled_mm,
            "names": sorted(n for n, _ in model.named_parameters()), "expected_names": sorted(shape.parameter_names()),
            "params": sum(p.numel() for p in model.parameters()), "expected_params": shape.params()}


LLAMA = ['model.mlp="swiglu"', "model.num_query_groups=2", 'model.position_embedding="rope"', 'model.norm="rmsnorm"',
         "model.bias=false", "model.ffn_hidden_size=96", "model.qk_layernorm=true"]
# Qwen3's head size (4 heads × 24 over a hidden size of 64: Q and the attention's output 96 wide), and Qwen2's
# Q/K/V-only biases on it (parameters, not matmul FLOPs)
QWEN = [k for k in LLAMA if k != "model.qk_layernorm=true"] + ["model.head_dim=24", "model.qkv_bias=true"]


@pytest.mark.parametrize("overrides", [[], ['model.recompute="full"'], ["model.ffn_hidden_size=96"],
                                       ["model.ffn_hidden_size=96", 'model.recompute="full"'],
                                       ['model.mlp="swiglu"'], ["model.num_query_groups=1"],
                                       LLAMA, LLAMA + ['model.recompute="full"'], ['model.mlp="gelu_tanh"'],
                                       LLAMA + ["model.head_dim=24"], QWEN,
                                       ["model.loss_chunk_tokens=32"], ["model.loss_chunk_tokens=0"],
                                       ["model.loss_chunk_tokens=32", "model.loss_recompute=true"],
                                       LLAMA + ['model.recompute="selective"']],
                         ids=["gpt2", "gpt2-recompute", "ffn-3h/2", "ffn-3h/2-recompute", "swiglu", "mqa",
                              "llama", "llama-recompute", "gelu-tanh", "qwen3-head-size", "qwen2-qkv-bias",
                              "fused-loss-chunks", "megatron-loss", "loss-recompute", "llama-selective"])
def test_formula_equals_torch_flop_counter_within_1_percent(overrides):
    """Forward and backward once, the recomputed forward too where recompute is on (the layers', or the chunked
    loss's output layer: 4 chunks of the 128 tokens): torch's count of what ran is the hardware FLOPs; the model
    FLOPs are that less the recomputed forward or equal to it."""
    (out,) = run_ranks(_counted_step, 1, overrides, timeout=180)
    assert out["hardware"] == pytest.approx(out["counted"], rel=0.01)
    # the same GPTShape counts the built model's parameters exactly and names each one
    assert (out["params"], out["names"]) == (out["expected_params"], out["expected_names"])
    if any("selective" in o for o in overrides):  # local attention's two score GEMMs again: 4·s·h a token a layer
        assert out["hardware"] - out["model"] == 2 * 4 * 64 * 64 * 2 * 64
    elif any("model.recompute" in o for o in overrides):
        assert out["model"] < 0.9 * out["hardware"]
    elif "model.loss_recompute=true" in overrides:  # the logits GEMM once more: 2·h·V_pad a token, 2 × 64 tokens
        assert out["hardware"] - out["model"] == 2 * 64 * 512 * 2 * 64
    else:
        assert out["model"] == out["hardware"]


def test_float8_runs_exactly_the_layers_linear_flops():
    """precision.fp8: torch's count of the float8 GEMMs (torch._scaled_mm) in a step is StepFlops.linears, the layers'
    QKV, projection and MLP FLOPs forward and backward, exactly; the whole count still the hardware FLOPs (1%)."""
    (out,) = run_ranks(_counted_step, 1, LLAMA + ["precision.dtype=bf16", "precision.fp8=rowwise"], timeout=180)
    assert out["scaled_mm"] == out["linears"] > 0.5 * out["model"]
    assert out["hardware"] == pytest.approx(out["counted"], rel=0.01)
