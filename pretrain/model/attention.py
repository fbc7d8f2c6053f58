"""Core attention through torch's `scaled_dot_product_attention`, as megatron-core's core-attention submodule.

`SDPAttention` takes `DotProductAttention`'s constructor and forward (megatron-core 0.16.1: query, key,
value [s, b, heads, head_dim]; returns [s, b, heads·head_dim]) and replaces the baddbmm + masked softmax
over a materialized [b·h, s, s] score tensor with one SDPA call (flash / memory-efficient / cuDNN on GPU).
Causal attention uses `is_causal` and ignores `attention_mask` (no mask is needed or built); padding /
arbitrary masks are passed to SDPA: megatron's bool mask (True = masked) inverted, or an additive float bias
as it is. Document boundaries (data.reset_attention_mask) make the layers' mask type arbitrary: the batch's
block-causal mask, turned once per forward into the bias all layers share (`shared_attention_bias`). GQA:
causal attention hands SDPA the key/value groups as they are (`enable_gqa`); masked attention repeats them. What it cannot honour is refused at construction or call: packed
sequences, attention bias, sliding windows, non-vanilla softmax, causal attention with unequal query/key lengths.
Attention dropout runs inside SDPA under megatron's TP RNG fork (as DotProductAttention's dropout).
Context parallelism (CP > 1; DotProductAttention asserts CP = 1, so its constructor sees a copy of the config at
CP 1 and only for that assert): causal attention over the whole sequence through `context.context_parallel_attention`
(K and V all-gathered over the CP group through `context_comm`, the one zero3d Comm the model's layers share, which
counts them); masks and attention dropout are refused there.
"""
import copy

import torch
import megatron_patches.lean  # noqa: F401  (megatron-core without its unused torch.compile/wandb set-up)
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import is_layer_window_attention

from pretrain.model.context import context_parallel_attention

CHOICES = ("auto", "sdpa", "local", "te")


def own_key_and_value(query, key, value):
    """K and V as tensors of their own where that frees the fused QKV GEMM's output. megatron splits Q, K and V out
    of it as views; with grouped queries it reshapes Q into a copy, and RoPE rotates Q and K into new tensors. Saved
    for backward as views, K or V would keep the whole fused output alive for their share of it: copied, it goes
    once attention has run ((a + g)·d·s·b·e less a layer under GQA). Where Q itself is still a view of it (multi-head
    attention, learned positions) the output stays alive anyway, and copies would only add 2·a·d·s·b·e. The same holds
    in a compiled layer: inductor's partitioner saved V as the view it was handed, counting the view's bytes, not those
    of the storage it keeps (a compiled Llama layer kept 1.25 s·b·h·e more than an eager one, the GQA share of the fused
    output)."""
    fused = query._base
    if fused is not None and (key._base is fused or value._base is fused):
        return key, value
    return key.contiguous(), value.contiguous()


class SDPAttention(DotProductAttention):
    """megatron's DotProductAttention contract computed by `torch.nn.functional.scaled_dot_product_attention`."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, context_comm=None):
        """`context_comm`: at context parallelism > 1, the zero3d Comm over the CP group that gathers K and V
        (build_model's `context_comm`, one for all layers, so the engine's CommStats counts it)."""
        if config.softmax_type != "vanilla":
            raise ValueError(f"model.attention = 'sdpa' supports softmax_type 'vanilla', not {config.softmax_type!r}")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise ValueError(f"model.attention = 'sdpa' has no sliding window (window_size = {config.window_size}); "
                             "use 'local' or 'te'")
        cp_size, parent_config = config.context_parallel_size, config
        if cp_size > 1:
            refuse_context_parallel(attn_mask_type, config.attention_dropout if attention_dropout is None
                                    else attention_dropout, cp_comm_type)
            if context_comm is None or context_comm.size != cp_size:
                raise ValueError(f"model.attention = 'sdpa' at context parallelism {cp_size} needs context_comm, a "
                                 f"zero3d Comm over the {cp_size} CP ranks (build_model passes one), got "
                                 f"{'None' if context_comm is None else f'one over {context_comm.size} ranks'}")
            # The parent reads context_parallel_size only in its assert: it gets a copy at CP 1, the layer the config.
            parent_config = copy.copy(config)
            parent_config.context_parallel_size = 1
        super().__init__(parent_config, layer_number, attn_mask_type, attention_type,
                         attention_dropout=attention_dropout, softmax_scale=softmax_scale, cp_comm_type=cp_comm_type,
                         pg_collection=pg_collection)
        self.config, self.cp_size, self.cp_comm = config, cp_size, context_comm if cp_size > 1 else None
        # DotProductAttention divides the scale by layer_number under query-key layer scaling and multiplies
        # the scores back in the softmax: the net scale is the unscaled one.
        self.sdpa_scale = self.softmax_scale * (self.layer_number if config.apply_query_key_layer_scaling else 1)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None:
            raise ValueError("model.attention = 'sdpa' does not take packed sequences (packed_seq_params); use 'te'")
        if attention_bias is not None:
            raise ValueError("model.attention = 'sdpa' does not take an attention_bias; use 'local'")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        causal = mask_type == AttnMaskType.causal
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        key, value = own_key_and_value(query, key, value)
        if self.cp_size > 1:
            refuse_context_parallel(mask_type)
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            context = context_parallel_attention(q, k, v, self.cp_comm, self.sdpa_scale, enable_gqa=groups > 1)
            return context.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], self.hidden_size_per_partition)
        # GQA: each key/value head serves `groups` query heads (megatron's layout, SDPA's enable_gqa grouping).
        # Causal: the kernel takes the groups as they are (CUDA's flash kernel, CPU's flash kernel), keeping K and
        # V unrepeated for backward; with a mask (CUDA's memory-efficient kernel, which has no GQA) they are
        # repeated to the query heads first, which SDPA would otherwise do on its quadratic-memory math path.
        gqa = groups > 1 and causal
        if groups > 1 and not causal:
            key, value = key.repeat_interleave(groups, dim=2), value.repeat_interleave(groups, dim=2)
        if causal and query.shape[0] != key.shape[0]:
            raise ValueError(f"model.attention = 'sdpa': causal attention needs equal query and key lengths, got "
                             f"{query.shape[0]} and {key.shape[0]}")
        mask = None if causal or mask_type == AttnMaskType.no_mask else sdpa_mask(attention_mask, mask_type)
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout = self.attention_dropout.p if self.training else 0.0
        if dropout > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = self._sdpa(q, k, v, mask, causal, dropout, gqa)
        else:
            context = self._sdpa(q, k, v, mask, causal, dropout, gqa)
        # [b, h, s, d] -> [s, b, h·d]
        return context.permute(2, 0, 1, 3).reshape(context.shape[2], context.shape[0], self.hidden_size_per_partition)

    def _sdpa(self, q, k, v, mask, causal, dropout, gqa=False):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                                is_causal=causal, scale=self.sdpa_scale,
                                                                **({"enable_gqa": True} if gqa else {}))


def refuse_context_parallel(mask_type, dropout=0.0, comm_type=None):
    """ValueError for what context-parallel SDPA attention cannot compute exactly (a non-causal mask, dropout) or
    does otherwise (a cp_comm_type other than its all-gather of K and V)."""
    if mask_type != AttnMaskType.causal:
        raise ValueError(f"model.attention = 'sdpa' with context parallelism > 1 supports the causal mask only, not "
                         f"{mask_type.name} (document boundaries / padding would need the whole sequence's mask); "
                         "use context parallelism 1")
    if dropout > 0.0:
        raise ValueError(f"model.attention = 'sdpa' with context parallelism > 1 needs attention dropout 0, got "
                         f"{dropout} (its random mask would differ from context parallelism 1's); set it to 0")
    if comm_type not in (None, "all_gather"):
        raise ValueError(f"model.attention = 'sdpa' with context parallelism > 1 all-gathers K and V, not "
                         f"cp_comm_type {comm_type!r} (Transformer Engine's); use 'all_gather' or None")


def sdpa_mask(attention_mask, mask_type):
    """SDPA's attn_mask from megatron's: a bool mask (True = masked out) inverted (SDPA: True = attends), an
    additive float bias as it is; an arbitrary mask type without a mask is refused (it would attend everywhere)."""
    if attention_mask is None:
        if mask_type == AttnMaskType.arbitrary:
            raise ValueError("model.attention = 'sdpa' with document boundaries (data.reset_attention_mask) needs "
                             "the batch's attention_mask; got None")
        return None
    return attention_mask if attention_mask.is_floating_point() else ~attention_mask


def shared_attention_bias(block, args, kwargs):
    """A forward pre-hook of the decoder (TransformerBlock): its bool attention mask (True = masked out) as one
    additive bias (0 / -inf, the layers' dtype) that every layer's SDPA takes and keeps for backward as it is;
    given the bool mask, SDPA would build and keep its own [b, 1, s, s] bias in each layer."""
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dtype == torch.bool:
        bias = torch.zeros(mask.shape, dtype=block.config.params_dtype, device=mask.device)
        kwargs["attention_mask"] = bias.masked_fill_(mask, float("-inf"))
    return args, kwargs


def resolve(choice: str, on_cuda: bool, zero_recompute: bool, document_mask: bool = False,
            selective: bool = False, float8: bool = False) -> str:
    """The attention `model.attention` = `choice` runs: "te", "sdpa" or "local". `auto` is Transformer Engine
    on GPU where importable (and no ZeRO-R or `selective` recomputation layer class is needed) unless a
    `document_mask` must be applied (data.reset_attention_mask: config validation refuses 'te' with it) or the
    linears are `float8` (megatron's local ones, pretrain/model/fp8.py; config validation refuses 'te' with
    precision.fp8), else SDPA; `te` is refused where it can't run."""
    if choice not in CHOICES:
        raise ValueError(f"model.attention = {choice!r} is invalid; valid values: {', '.join(map(repr, CHOICES))}")
    te = on_cuda and not zero_recompute and not selective and _te_importable()
    if choice == "te" and not te:
        why = ("Transformer Engine is not importable" if not _te_importable() else
               "it needs a CUDA device" if not on_cuda else
               "ZeRO-R's recomputed layers (zero.partition_activations / cpu / contiguous) use megatron's local layers"
               if zero_recompute else
               "selective recomputation (model.recompute = 'selective') keeps aten GEMM outputs, which Transformer "
               "Engine's layers do not run")
        raise ValueError(f"model.attention = 'te' cannot run here: {why}; use 'auto', 'sdpa' or 'local'")
    if choice == "auto":
        return "te" if te and not (document_mask or float8) else "sdpa"
    return choice


def resolved_attention(cfg, on_cuda: bool) -> str:
    """`resolve` of the Config `cfg`'s model.attention as its layer spec resolves it on a CUDA (`on_cuda`) or CPU rank
    (ZeRO-R's recomputed layers: zero.partition_activations / cpu_checkpointing / contiguous_checkpointing)."""
    z = cfg.zero
    return resolve(cfg.model.attention, on_cuda,
                   zero_recompute=z.partition_activations or z.cpu_checkpointing or z.contiguous_checkpointing,
                   document_mask=cfg.data.reset_attention_mask, selective=cfg.model.recompute == "selective",
                   float8=cfg.precision.fp8 != "none")


def _te_importable() -> bool:
    import importlib.util
    return importlib.util.find_spec("transformer_engine") is not None
