"""CP attention (pretrain/model/context.py, SDPAttention at CP > 1) equals full causal SDPA; its Comm counts its K/V."""
from fractions import Fraction

import pytest
import torch

from ranks import run_ranks

S, B, D, HEADS = 48, 2, 8, 4  # 48: 2C equal chunks at C = 2, 3 and 4
CASES = {"mha": 4, "gqa": 2}  # key/value heads for HEADS query heads
SCALE = 0.3  # not SDPA's default 1/√d: the scale must be passed through


def inputs(kv_heads):
    """q [B, HEADS, S, D], k and v [B, kv_heads, S, D] and the upstream gradient, identical wherever made."""
    g = torch.Generator().manual_seed(kv_heads)
    q = torch.randn(B, HEADS, S, D, generator=g)
    k, v = torch.randn(2, B, kv_heads, S, D, generator=g)
    return q, k, v, torch.randn(B, HEADS, S, D, generator=g)


def local(t, rank, size):
    """Rank `rank`'s tokens of a [b, h, S, d] tensor (as megatron's get_batch_on_this_cp_rank slices them)."""
    from pretrain.model.context import local_positions
    return t[:, :, local_positions(rank, size, t.shape[2] // size)]


def cp_rank(rank, size):
    """Per case: this rank's output and q, k, v gradients from context_parallel_attention; the SDPAttention
    layer's output at CP = size; its refusals."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from pretrain.model.attention import SDPAttention
    from pretrain.model.context import context_parallel_attention
    from zero3d.comm.core import Comm, CommStats
    dist.init_process_group("gloo")
    comm = Comm(dist.group.WORLD, CommStats())
    out = {}
    for name, kv_heads in CASES.items():
        q, k, v, grad = (local(t, rank, size).requires_grad_(i < 3) for i, t in enumerate(inputs(kv_heads)))
        o = context_parallel_attention(q, k, v, comm, SCALE, enable_gqa=kv_heads < HEADS)
        o.backward(grad)
        out[name] = (o.detach(), q.grad, k.grad, v.grad)
    out["counted"] = dict(comm.stats.bytes)
    tp = [dist.new_group([r]) for r in range(size)][rank]
    pgs = ProcessGroupCollection(tp=tp, cp=dist.group.WORLD)
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * D, num_attention_heads=HEADS, num_query_groups=2,
                               attention_dropout=0.0, context_parallel_size=size, use_cpu_initialization=True)
    layer = SDPAttention(config, 1, AttnMaskType.causal, "self", pg_collection=pgs, context_comm=comm)
    q, k, v, _ = (local(t, rank, size).permute(2, 0, 1, 3) for t in inputs(2))  # [s, b, heads, d]
    out["layer"] = (layer(q, k, v, None), config.context_parallel_size)
    refusals = []
    for mask_type, dropout, comm_type, given in ((AttnMaskType.padding, 0.0, None, comm),
                                                (AttnMaskType.causal, 0.1, None, comm),
                                                (AttnMaskType.causal, 0.0, "p2p", comm),
                                                (AttnMaskType.causal, 0.0, None, None)):
        try:
            SDPAttention(config, 1, mask_type, "self", attention_dropout=dropout, cp_comm_type=comm_type,
                         pg_collection=pgs, context_comm=given)
        except ValueError as err:
            refusals.append(str(err))
    try:
        layer(q, k, v, None, attn_mask_type=AttnMaskType.arbitrary)
    except ValueError as err:
        refusals.append(str(err))
    return out, refusals


@pytest.mark.parametrize("size", [2, 3, 4])  # 3: rank 1 holds chunks 1 and 4, no symmetry to hide behind
def test_context_parallel_attention_is_full_causal_attention(size):
    ranks = run_ranks(cp_rank, size, timeout=90)
    for name, kv_heads in CASES.items():
        q, k, v, grad = inputs(kv_heads)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE,
                                                                enable_gqa=kv_heads < HEADS)
        full.backward(grad)
        for rank, (out, _) in enumerate(ranks):
            for what, got, want in zip(("output", "q grad", "k grad", "v grad"), out[name],
                                       (full.detach(), q.grad, k.grad, v.grad)):
                # fp32 (ε ≈ 1.2e-7), the same terms summed in another order (masked rows of S keys instead of
                # the causal kernel's blocks; K/V gradients summed over the group's pieces, GQA's over the
                # repeated heads): within 1e-6, relative and absolute (a V gradient of ~2 differs by ~1.7e-6).
                torch.testing.assert_close(got, local(want, rank, size), rtol=1e-6, atol=1e-6,
                                           msg=lambda m: f"C={size} {name} rank {rank} {what}: {m}")
    # Counted by the Comm: per case one ring all-gather of K and V ([S, 2, B, kv_heads, D] fp32) and one
    # reduce-scatter of their gradients, each rank sending (size − 1)/size of it.
    sent = sum(Fraction(2 * S * B * kv_heads * D * 4 * (size - 1), size) for kv_heads in CASES.values())
    for out, _ in ranks:
        assert out["counted"] == {("all_gather", "context_kv"): sent, ("reduce_scatter", "context_kv"): sent}
    q, k, v, _ = inputs(2)
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for rank, (out, refusals) in enumerate(ranks):
        layer_out, config_cp = out["layer"]
        want = local(full, rank, size).permute(2, 0, 1, 3).flatten(2)  # [s_local, b, heads·d]
        torch.testing.assert_close(layer_out, want, rtol=1e-6, atol=1e-6)
        assert config_cp == size  # the layer's config is the model's, not the CP-1 copy its parent saw
        assert [r.split("(")[0] for r in refusals] == [
            "model.attention = 'sdpa' with context parallelism > 1 supports the causal mask only, not padding ",
            "model.attention = 'sdpa' with context parallelism > 1 needs attention dropout 0, got 0.1 ",
            "model.attention = 'sdpa' with context parallelism > 1 all-gathers K and V, not cp_comm_type 'p2p' ",
            f"model.attention = 'sdpa' at context parallelism {size} needs context_comm, a zero3d Comm over the {size} "
            "CP ranks ",
            "model.attention = 'sdpa' with context parallelism > 1 supports the causal mask only, not arbitrary "]
