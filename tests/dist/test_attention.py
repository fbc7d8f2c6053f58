"""SDPA core attention trains like megatron's local attention (fp32, 10 steps), one run per attention and
layout: TP 1; TP 2 × DP 2 with Pa+cpu (stage 2); TP 2 × PP 2 with SP (Pa and SP are mutually exclusive)."""
import pytest
import torch

from ranks import run_ranks

STEPS = 10
LAYOUTS = {
    "tp1": (1, ["train.global_batch_size=4"]),
    "tp2_dp2_pa_cpu": (4, ["parallel.tensor=2", "model.recompute=full", "zero.partition_activations=true",
                           "zero.cpu_checkpointing=true", "zero.stage=2", "train.global_batch_size=4"]),
    "tp2_pp2_sp": (4, ["parallel.tensor=2", "parallel.pipeline=2", "parallel.sequence_parallel=true",
                       "zero.stage=1", "train.global_batch_size=4"]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sdpa_trains_like_local_attention(layout, gpt_run):
    world, overrides = LAYOUTS[layout]
    overrides = overrides + ["optimizer.lr=3e-3", "optimizer.min_lr=3e-3"]  # visible progress in 10 steps
    local = gpt_run(world, overrides + ["model.attention=local"], STEPS)
    sdpa = gpt_run(world, overrides + ["model.attention=sdpa"], STEPS)
    # it trains: each step's 4 samples differ, so the last 3 steps against the first 3 (at TP 2 the padded
    # vocabulary, half the output layer here, takes no probability: no easy first steps of pushing it down)
    assert sum(local[0]["loss"][-3:]) < sum(local[0]["loss"][:3]), local[0]["loss"]
    # Losses and gradient norms (the acceptance); parameters are not compared: the key bias's gradient is
    # zero up to rounding (softmax is shift-invariant), and Adam turns that rounding noise into ±lr steps.
    for r_local, r_sdpa in zip(local, sdpa):
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(torch.tensor(r_sdpa[key]), torch.tensor(r_local[key]), rtol=1e-5, atol=0)


def contract_rank(rank, world_size):
    """SDPAttention against megatron's DotProductAttention on the same q, k, v: causal (SDPA given no mask,
    local given the explicit one), GQA, a padding mask; and what it refuses."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from gpt_harness import BASE
    from pretrain.model.attention import SDPAttention
    from pretrain.config import load_config
    from pretrain.runtime.layout import init_layout
    init_layout(load_config(None, BASE + ["train.global_batch_size=2"]))
    s, b, heads, d = 7, 2, 4, 8
    g = torch.Generator().manual_seed(0)
    causal = torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s)
    padding = torch.rand(b, 1, s, s, generator=g) < 0.4
    padding &= ~torch.eye(s, dtype=torch.bool)  # every query attends at least to itself
    out = {}
    for name, groups, mask_type, local_mask, sdpa_mask in [
            ("causal", heads, AttnMaskType.causal, causal, None), ("gqa", 2, AttnMaskType.causal, causal, None),
            ("padding", heads, AttnMaskType.padding, padding, padding),
            ("gqa_padding", 2, AttnMaskType.padding, padding, padding)]:  # masked GQA: the groups repeated
        config = TransformerConfig(num_layers=1, hidden_size=heads * d, num_attention_heads=heads,
                                   num_query_groups=groups, attention_dropout=0.0, use_cpu_initialization=True)
        q = torch.randn(s, b, heads, d, generator=g)
        k, v = torch.randn(2, s, b, groups, d, generator=g)
        args = (config, 1, mask_type, "self")
        out[name] = (SDPAttention(*args)(q, k, v, sdpa_mask), DotProductAttention(*args)(q, k, v, local_mask))
    sdpa = SDPAttention(config, 1, AttnMaskType.causal, "self")
    refusals = []
    for kwargs in (dict(packed_seq_params=PackedSeqParams()), dict(attention_bias=torch.zeros(1))):
        try:
            sdpa(q, k, v, None, **kwargs)
        except ValueError as err:
            refusals.append(str(err))
    return out, refusals


def test_sdpa_module_matches_megatron_dot_product_attention():
    out, refusals = run_ranks(contract_rank, 1, timeout=60)[0]
    for name, (sdpa, local) in out.items():
        assert sdpa.shape == local.shape == (7, 2, 32), name
        torch.testing.assert_close(sdpa, local, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert [r.split(";")[0].split("(")[0].strip() for r in refusals] == [
        "model.attention = 'sdpa' does not take packed sequences", "model.attention = 'sdpa' does not take an attention_bias"]


def _attention_saves(rank, world_size, position_embedding, groups, compiled):
    """The 4-D tensors one Llama-shaped layer (`groups` key/value heads of 4; `compiled`: model.compile) saves for
    backward, Q, K, V and the attention output as SDPA keeps them ([b, heads, s, d]): (shape, the address of its
    storage, that storage's bytes) each, and the layer's sizes. Compiled by aot_eager: TorchDynamo's graph and
    AOTAutograd's saved tensors without inductor's C++ build (a forked rank with an empty cache outran 240 s in the
    suite); the view of the fused output was saved under both backends (a layer kept 19.94 s·b·h·e, eager 18.81)."""
    import torch

    import pretrain.model.gpt as gpt
    from gpt_harness import BASE
    from pretrain.config import load_config
    from pretrain.model.gpt import build_model
    from pretrain.runtime.layout import init_layout
    cfg = load_config(None, BASE + [f'model.position_embedding="{position_embedding}"', 'model.mlp="swiglu"',
                                    'model.norm="rmsnorm"', "model.bias=false", f"model.num_query_groups={groups}",
                                    "model.num_layers=1", 'model.attention="sdpa"', f"model.compile={str(compiled).lower()}"])
    topo = init_layout(cfg)
    gpt.COMPILE_BACKEND = "aot_eager"
    layer = build_model(cfg, topo.device).decoder.layers[0]
    s, b, h = cfg.model.seq_length, 2, cfg.model.hidden_size
    rotary = None
    if position_embedding == "rope":
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
        rotary = RotaryEmbedding(h // cfg.model.num_attention_heads, 1.0, rotary_base=cfg.model.rope_base)(s)
    saved = []

    def pack(t):
        if t.dim() == 4 and t.shape[0] == b:
            saved.append((tuple(t.shape), t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(torch.randn(s, b, h, requires_grad=True), attention_mask=None, rotary_pos_emb=rotary)
    return saved, dict(s=s, b=b, a=cfg.model.num_attention_heads, d=h // cfg.model.num_attention_heads)


@pytest.mark.parametrize("position_embedding,groups,compiled", [("rope", 2, False), ("learned", 2, False),
                                                                ("rope", 4, False), ("learned", 4, False),
                                                                ("rope", 2, True), ("learned", 2, True)])
def test_attention_keeps_its_own_k_and_v_not_the_fused_qkv_output(position_embedding, groups, compiled):
    """megatron cuts Q, K and V out of the fused QKV GEMM's output as views (Q reshaped into a copy under GQA, Q and
    K rotated into new tensors under RoPE); K or V saved as a view kept the whole output alive ((a + g)·d·s·b·e a
    layer under GQA, 80 MiB in a Llama-3 8B layer at 8K tokens), copies where Q is a view too (multi-head attention,
    learned positions) would add 2·a·d·s·b·e. Either way the storages SDPA keeps for backward come to the fused
    output's size plus the attention output's, (a + 2g)·d·s·b·e + a·d·s·b·e, e = 4 (fp32) — in a compiled layer too,
    whose graph saved V as a view of the fused output (18,432 and 16,384 B here, against 12,288)."""
    saved, n = run_ranks(_attention_saves, 1, position_embedding, groups, compiled, timeout=120)[0]
    assert len(saved) >= 3  # Q, K, V (and the output)
    storages = {address: nbytes for _, address, nbytes in saved}
    assert sum(storages.values()) == (n["a"] + 2 * groups + n["a"]) * n["d"] * n["s"] * n["b"] * 4, saved
