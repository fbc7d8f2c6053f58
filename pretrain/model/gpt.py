"""megatron-core GPTModel from the config, through megatron's public seams: layer specs, config flags, forward args.

CPU runs need no patched attention mask or norm: the causal mask is passed to `GPTModel.forward`
(`attention_mask`), the norm is chosen in the spec (`TorchNorm`, LayerNorm or RMSNorm, which also serves
sequence parallelism), and ZeRO-R's recompute is a layer class in the spec (`ZeroRecomputeLayer`).
Document boundaries (data.reset_attention_mask) set the self-attention's mask type to megatron's
`arbitrary` in the spec, so the batch's block-causal mask is applied (not is_causal / the causal kernels).
"""
import dataclasses
from typing import Optional

import torch

from pretrain.config import Config
from pretrain.data.batch import context_chunks, field, token_mean, tokens_of
from pretrain.model.norm import CudaKeepingTorchNorm, TorchNorm
from pretrain.model.rope import scale_rope_frequencies
from zero3d.activations import ActivationCheckpointing, checkpoint
from zero3d.comm.core import Comm, CommStats
from zero3d.config import ZeroConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation (GPT-2's gelu_new, megatron's openai_gelu), in one torch kernel."""
    return torch.nn.functional.gelu(x, approximate="tanh")


NONLINEARITY = {"gelu": torch.nn.functional.gelu, "gelu_tanh": gelu_tanh,
                "swiglu": torch.nn.functional.silu}  # swiglu: silu-gated
NORMALIZATION = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}
COMPILE_BACKEND = "inductor"  # model.compile's torch.compile backend


def _importable(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


def _row_parallel_linear_class():
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    class RowParallelLinearWithGroup(RowParallelLinear):
        """megatron's RowParallelLinear handing its own TP group to the matmul, where megatron-core 0.16 passes None
        and its fallback warns on global rank 0 only: inside a compiled layer, a graph break on that rank alone,
        so rank 0 ran other graphs (and handed autograd its gradients in another order) than the others."""

        def _forward_impl(self, input, weight, *args, **kwargs):
            if kwargs.get("tp_group") is None:
                kwargs["tp_group"] = self.tp_group
            return super()._forward_impl(input, weight, *args, **kwargs)

    return RowParallelLinearWithGroup


def _zero_recompute_layer_class():
    from megatron.core.transformer.transformer_layer import TransformerLayer

    class ZeroRecomputeLayer(TransformerLayer):
        """A transformer layer recomputed in backward from a ZeRO-R checkpoint of its input (Pa, Pa+cpu,
        MD): stands in for megatron's `recompute_granularity="full"`, which is off in this model."""

        def __init__(self, *args, activations: ActivationCheckpointing, **kwargs):
            super().__init__(*args, **kwargs)
            self.activations = activations

        def forward(self, *args, **kwargs):
            hidden_states = kwargs.pop("hidden_states") if "hidden_states" in kwargs else args[0]
            args = args[1:] if "hidden_states" not in kwargs and args else args
            tensor_names = [k for k, v in kwargs.items() if torch.is_tensor(v)]
            others = {k: v for k, v in kwargs.items() if k not in tensor_names}

            def run(hidden, *tensors):
                return super(ZeroRecomputeLayer, self).forward(hidden, *args, **others,
                                                               **dict(zip(tensor_names, tensors)))
            return checkpoint(run, self.activations, hidden_states, *(kwargs[k] for k in tensor_names))

    return ZeroRecomputeLayer


def activation_checkpointing(z: ZeroConfig, tp_group) -> Optional[ActivationCheckpointing]:
    """ZeRO-R (zero.partition_activations / cpu_checkpointing / contiguous_checkpointing) for
    `build_model`, or None (megatron's own recomputation, when model.recompute = "full")."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    if not (z.partition_activations or z.cpu_checkpointing or z.contiguous_checkpointing):
        return None
    return ActivationCheckpointing(partition=z.partition_activations, cpu=z.cpu_checkpointing,
                                   contiguous=z.contiguous_checkpointing, tp_group=tp_group,
                                   rng_tracker=get_cuda_rng_tracker)


def context_comm(cfg: Config) -> Optional[Comm]:
    """At parallel.context > 1: the one zero3d Comm over megatron's context-parallel group through which every SDPA
    layer of the model gathers K and V (tag pretrain.model.context.TAG); counted in a CommStats of its own until
    `record_context_into` points it at the engine's. None at context 1."""
    from megatron.core import parallel_state
    if cfg.parallel.context == 1:
        return None
    return Comm(parallel_state.get_context_parallel_group(), CommStats())


def record_context_into(model, stats: CommStats) -> None:
    """Count the model's context-parallel K/V collectives in `stats` (the engine's, built after the model), so the
    loop's comm/* metrics hold them beside ZeRO's; a model without them (context 1, Transformer Engine) is left as is."""
    from pretrain.model.attention import SDPAttention
    for comm in {id(m.cp_comm): m.cp_comm for m in model.modules()
                 if isinstance(m, SDPAttention) and m.cp_comm is not None}.values():
        comm.record_into(stats)


def layer_spec(cfg: Config, on_cuda: bool, activations: Optional[ActivationCheckpointing] = None,
               cp_comm: Optional[Comm] = None, cuda_kernels: bool = False):
    """The decoder's spec: Transformer Engine's layers when `model.attention` resolves to "te", else
    megatron's local layers (with `TorchNorm` where apex is missing or the norm is RMSNorm) whose core attention is
    `SDPAttention` ("sdpa", given `cp_comm` at context > 1) or megatron's DotProductAttention ("local"); ZeRO-R
    layers when `activations`. `cuda_kernels` off CUDA: norms keeping for backward what CUDA's keep (build_model)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from pretrain.model.attention import SDPAttention, resolved_attention
    documents = cfg.data.reset_attention_mask
    attention = resolved_attention(cfg, on_cuda)
    qk_norm = cfg.model.qk_layernorm
    if attention == "te":
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_norm)
    layer = specs.get_gpt_layer_local_spec(qk_layernorm=qk_norm)
    norm = (specs.LNImpl if specs.HAVE_APEX and cfg.model.norm == "layernorm"
            else CudaKeepingTorchNorm if cuda_kernels and not on_cuda else TorchNorm)
    self_attention = layer.submodules.self_attention
    if qk_norm:  # megatron sums these weights' gradients over TP (each rank normalises its own heads)
        self_attention = dataclasses.replace(self_attention, submodules=dataclasses.replace(
            self_attention.submodules, q_layernorm=norm, k_layernorm=norm))
    if attention == "sdpa":
        self_attention = dataclasses.replace(self_attention, submodules=dataclasses.replace(
            self_attention.submodules, core_attention=ModuleSpec(SDPAttention, params={"context_comm": cp_comm})))
    if documents:  # the batch's mask is applied as given: SDPA gets it instead of is_causal, local's softmax too
        self_attention = dataclasses.replace(
            self_attention, params={**(self_attention.params or {}), "attn_mask_type": AttnMaskType.arbitrary})
    row_parallel = _row_parallel_linear_class()
    self_attention = dataclasses.replace(self_attention, submodules=dataclasses.replace(
        self_attention.submodules, linear_proj=row_parallel))
    mlp = dataclasses.replace(layer.submodules.mlp, submodules=dataclasses.replace(
        layer.submodules.mlp.submodules, linear_fc2=row_parallel))
    layer = dataclasses.replace(layer, submodules=dataclasses.replace(
        layer.submodules, input_layernorm=norm, pre_mlp_layernorm=norm, self_attention=self_attention, mlp=mlp))
    if cfg.precision.fp8 != "none":  # QKV, projection, fc1, fc2 in float8 (pretrain/model/fp8.py)
        from pretrain.model.fp8 import float8_layer
        layer = float8_layer(layer, cfg.precision.fp8)
    if activations is not None:
        layer = dataclasses.replace(layer, module=_zero_recompute_layer_class(),
                                    params={**(layer.params or {}), "activations": activations})
    elif cfg.model.recompute == "selective":
        from pretrain.model.recompute import selective_recompute_layer_class
        layer = dataclasses.replace(layer, module=selective_recompute_layer_class())
    config = transformer_config(cfg, on_cuda, zero_recompute=activations is not None, cuda_kernels=cuda_kernels)
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config), layer_norm=norm)


def transformer_config(cfg: Config, on_cuda: bool, zero_recompute: bool = False, cuda_kernels: bool = False):
    """megatron's TransformerConfig; with `zero_recompute` its own recomputation is off (ZeroRecomputeLayer);
    `cuda_kernels`: CUDA's fused SwiGLU on any device (build_model)."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    m, dtype = cfg.model, cfg.precision.dtype
    recompute = (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
                 if m.recompute == "full" and not zero_recompute else {})
    return TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups, ffn_hidden_size=m.ffn_size, kv_channels=m.head_dim,
        gated_linear_unit=m.mlp == "swiglu", activation_func=NONLINEARITY[m.mlp], add_bias_linear=m.bias,
        add_qkv_bias=m.qkv_bias,
        normalization=NORMALIZATION[m.norm], layernorm_epsilon=m.norm_epsilon, qk_layernorm=m.qk_layernorm,
        tensor_model_parallel_size=cfg.parallel.tensor,
        pipeline_model_parallel_size=cfg.parallel.pipeline, pipeline_dtype=DTYPES[dtype],
        context_parallel_size=cfg.parallel.context,
        sequence_parallel=cfg.parallel.sequence_parallel,
        hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std, params_dtype=DTYPES[dtype],
        bf16=dtype == "bf16", fp16=dtype == "fp16",
        # CPU init draws the full weights from one generator and then slices them, so every TP
        # layout starts from identical weights (what the cross-layout tests compare).
        use_cpu_initialization=not on_cuda,
        # Fusions are CUDA kernels, off on CPU; the softmax and persistent-norm ones are compiled
        # extensions (apex / megatron's fused kernels) used only where importable.
        # SwiGLU only: megatron's fused bias-GELU is GELU's tanh approximation (fused_bias_gelu.py), so an exact
        # GELU fused would compute another function, and it fuses no other activation
        bias_activation_fusion=(on_cuda or cuda_kernels) and m.mlp == "swiglu", masked_softmax_fusion=on_cuda and _importable("scaled_masked_softmax_cuda"),
        persist_layer_norm=on_cuda and _importable("apex"),
        bias_dropout_fusion=on_cuda, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        # The pipeline's batched p2p synchronises the CUDA device afterwards; there is none on CPU.
        batch_p2p_sync=on_cuda,
        # No CUDA graphs; [] is megatron-core 0.16's spelling of its default "full" scope, which it deprecates.
        cuda_graph_scope=[], **recompute)


def position_embedding(m) -> dict:
    """GPTModel's position-embedding arguments: GPT-2's learned table, or RoPE (its base; Llama-3.1's scaling is
    set on the built model: pretrain/model/rope.py)."""
    if m.position_embedding == "learned":
        return {"position_embedding_type": "learned_absolute"}
    return {"position_embedding_type": "rope", "rotary_base": m.rope_base}


def build_model(cfg: Config, device: torch.device, activations: Optional[ActivationCheckpointing] = None,
                cuda_kernels: bool = False):
    """This rank's piece of the GPTModel (its TP slice of its pipeline stage) on `device`; with
    `activations` (ZeRO-R), every layer is recomputed from a checkpoint stored through it; its loss and logits over
    the real vocabulary (pretrain/model/loss.py: padding at −inf; model.loss_chunk_tokens: in chunks); at parallel.context > 1
    its attention layers share one `context_comm` (`record_context_into` counts it in the engine's CommStats).
    `cuda_kernels` (a CPU or fake rank standing in for a CUDA one: the probe): its layers keep for backward what a
    CUDA rank's keep — megatron's fused SwiGLU (its input alone, where the CPU's composite also keeps the gate's
    activation) and an RMSNorm keeping x and an fp32 rstd (pretrain/model/norm.py) — so its activations are a GPU's."""
    import contextlib

    from megatron.core import parallel_state
    from megatron_patches import tied_embeddings_stay_on_cpu

    from pretrain.model.loss import LossGPTModel, compiled_softmax
    on_cuda = device.type == "cuda"
    with contextlib.nullcontext() if on_cuda else tied_embeddings_stay_on_cpu():
        model = LossGPTModel(real_vocab=cfg.model.vocab_size, chunk_tokens=cfg.model.loss_chunk_tokens,
                         loss_recompute=cfg.model.loss_recompute,
                         config=transformer_config(cfg, on_cuda, zero_recompute=activations is not None,
                                                   cuda_kernels=cuda_kernels),
                         transformer_layer_spec=layer_spec(cfg, on_cuda, activations, context_comm(cfg), cuda_kernels),
                         vocab_size=cfg.model.padded_vocab_size(cfg.parallel.tensor),
                         max_sequence_length=cfg.model.seq_length, **position_embedding(cfg.model),
                         share_embeddings_and_output_weights=cfg.model.tie_embeddings,
                         pre_process=parallel_state.is_pipeline_first_stage(),
                         post_process=parallel_state.is_pipeline_last_stage())
    scale_rope_frequencies(model, cfg.model)
    if cfg.data.reset_attention_mask and _has_sdpa(model):  # one [b, 1, s, s] bias for all layers, not one each
        from pretrain.model.attention import shared_attention_bias
        model.decoder.register_forward_pre_hook(shared_attention_bias, with_kwargs=True)
    if compiles_layers(cfg, on_cuda):  # each layer's forward compiled; hooks (ZeRO's) stay eager
        from megatron_patches import no_warnings_inside_layers
        no_warnings_inside_layers()
        for layer in model.decoder.layers:
            layer.forward = torch.compile(layer.forward, backend=COMPILE_BACKEND)
        if model.post_process and cfg.precision.dtype != "fp32":  # the fused loss's softmax (loss.SoftmaxKernels)
            model.output_layer.kernels = compiled_softmax(COMPILE_BACKEND)
    if activations is not None:  # MD: the block's checkpoints get one buffer before its first layer runs
        model.decoder.register_forward_pre_hook(
            lambda block, args, kwargs: activations.reserve(len(block.layers), kwargs["hidden_states"]),
            with_kwargs=True)
    # As Megatron's Float16Module does: every parameter in the training dtype (layer norms too).
    return model.to(device=device, dtype=DTYPES[cfg.precision.dtype])


def compiles(choice, on_cuda: bool, te_layers: bool = False) -> bool:
    """Whether model.compile = `choice` compiles the layers: true, false, or "auto" = on CUDA with megatron's local
    layers (measured faster there: docs/gpu-check.md); Transformer Engine's layers (their own fused kernels, never
    measured compiled) stay eager under auto."""
    return (on_cuda and not te_layers) if choice == "auto" else bool(choice)


def compiles_layers(cfg: Config, on_cuda: bool) -> bool:
    """Whether `build_model` compiles the layers of `cfg` on a CUDA (`on_cuda`) or CPU rank: `compiles`, with the
    attention its layer spec resolves (pretrain/model/attention.py's `resolved_attention`)."""
    from pretrain.model.attention import resolved_attention
    return compiles(cfg.model.compile, on_cuda, te_layers=resolved_attention(cfg, on_cuda) == "te")


def _has_sdpa(model) -> bool:
    from pretrain.model.attention import SDPAttention
    return any(isinstance(module, SDPAttention) for module in model.modules())


def parallel_groups(model, topo):
    """The engine's process groups: the layout's (Layout.engine_groups: ZeRO over data × context, whose ranks hold the
    same parameters, each the gradient of its chunks), with the gradients summed over another of its groups before the
    DP reduction: word embeddings tied to the last pipeline stage's output layer (megatron's embedding group; counted
    once in the norm) and sequence-parallel layer norms / biases (the TP group)."""
    tied, excluded = {}, frozenset()
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    if topo.pp > 1 and weight is not None:  # middle stages hold no copy
        tied = {weight: topo.embedding_group}
        excluded = frozenset([weight]) if getattr(weight, "shared", False) else frozenset()  # last stage's copy
    if model.config.sequence_parallel:  # each TP rank saw a sequence slice: its grad is a partial sum
        tied.update({p: topo.tp_group for p in model.parameters() if getattr(p, "sequence_parallel", False)})
    if model.config.qk_layernorm and topo.tp > 1:  # each TP rank normalised its own heads: a partial sum too
        tied.update({p: topo.tp_group for name, p in model.named_parameters()
                     if "q_layernorm" in name or "k_layernorm" in name})
    return topo.engine_groups(tied, excluded)


def gather_units(model) -> list[tuple]:
    """ZeRO stage 3's gather units for megatron's GPTModel: the embedding, each transformer layer,
    the output layer — which, with tied embeddings on one pipeline stage, is handed the word
    embedding weight at call time (so it borrows the embedding's unit)."""
    units = [("embedding", getattr(model, "embedding", None))]
    units += [(f"decoder.layers.{i}", layer) for i, layer in enumerate(model.decoder.layers)]
    output_layer = getattr(model, "output_layer", None)
    if output_layer is not None and model.share_embeddings_and_output_weights:
        units.append(("output_layer", output_layer, [model.shared_embedding_or_output_weight()]))
    else:
        units.append(("output_layer", output_layer))
    return [unit for unit in units if unit[1] is not None]


def gpt_inputs(batch, causal_mask: bool = True):
    """(inputs, positions, attention_mask, labels) of a micro-batch (pretrain/data/batch.py): its token block
    [batch, seq+1] cut into inputs and labels, and its position ids and attention mask where the run's
    document-boundary keys carry them. Otherwise positions count from 0 and the causal mask (True = masked) is
    explicit on CPU, where megatron's default one would be built on "cuda" (only `model.attention = "local"`
    reads it: SDPA applies `is_causal` without a mask); on GPU it is None and the fused causal kernels apply it.
    `causal_mask=False`: no causal mask is built (context parallelism, whose attention applies it by position)."""
    tokens = tokens_of(batch)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    seq = inputs.shape[1]
    positions = field(batch, "position_ids")
    if positions is None:
        positions = torch.arange(seq, device=inputs.device).unsqueeze(0).expand_as(inputs)
    mask = field(batch, "attention_mask")
    if mask is None and causal_mask and not inputs.is_cuda:
        mask = torch.ones(seq, seq, dtype=torch.bool).triu_(1).view(1, 1, seq, seq)  # in place: one [s, s] at a time
    return inputs, positions, mask, labels


def local_inputs(batch, context: tuple = (1, 0)) -> tuple:
    """(inputs, positions, attention_mask, labels, loss_mask) of a micro-batch as this rank runs them: gpt_inputs's
    and its loss mask (None without one), or with `context` = (cp, cp_rank), cp > 1, this rank's two chunks of every
    sequence and no mask tensor (the causal mask is by position across the chunks: the attention builds it,
    pretrain/model/context.py, and gathers the others' keys and values)."""
    cp, cp_rank = context
    inputs, positions, mask, labels = gpt_inputs(batch, causal_mask=cp == 1)  # cp > 1: no [s, s] mask built
    loss_mask = field(batch, "loss_mask")
    if cp == 1:
        return inputs, positions, mask, labels, loss_mask
    inputs, positions, labels = (context_chunks(t, cp, cp_rank) for t in (inputs, positions, labels))
    return inputs, positions, None, labels, None if loss_mask is None else context_chunks(loss_mask, cp, cp_rank)


def gpt_loss(model, batch, loss_tokens: Optional[torch.Tensor] = None, context: tuple = (1, 0)) -> torch.Tensor:
    """Next-token loss of a micro-batch (megatron's vocab-parallel cross entropy): the mean over its tokens, or
    with a loss mask (data.eod_mask_loss) the masked sum ÷ `loss_tokens` (pretrain.data.batch.token_mean).
    `context` = (cp, cp_rank): with cp > 1 this rank runs its chunks (local_inputs) and returns its share."""
    inputs, positions, mask, labels, loss_mask = local_inputs(batch, context)
    per_token = model(inputs, positions, mask, labels=labels, loss_mask=loss_mask)
    return token_mean(per_token, loss_mask, loss_tokens, context[0])
