"""megatron-core GPTModel from the config: local spec, or Transformer Engine's on GPU when importable."""
import torch

from pretrain.config import Config

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def layer_spec(on_cuda: bool):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    if on_cuda:
        try:
            import transformer_engine  # noqa: F401
            from megatron.core.models.gpt.gpt_layer_specs import (
                get_gpt_layer_with_transformer_engine_spec)
            return get_gpt_layer_with_transformer_engine_spec()
        except ImportError:
            pass
    return get_gpt_layer_local_spec()


def transformer_config(cfg: Config, on_cuda: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig
    m, dtype = cfg.model, cfg.precision.dtype
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) \
        if m.recompute == "full" else {}
    return TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_size, tensor_model_parallel_size=cfg.parallel.tensor,
        pipeline_model_parallel_size=cfg.parallel.pipeline, pipeline_dtype=DTYPES[dtype],
        sequence_parallel=cfg.parallel.sequence_parallel,
        hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std, params_dtype=DTYPES[dtype],
        bf16=dtype == "bf16", fp16=dtype == "fp16",
        # CPU init draws the full weights from one generator and then slices them, so every TP
        # layout starts from identical weights (what the cross-layout tests compare).
        use_cpu_initialization=not on_cuda,
        # Fusions are CUDA kernels; on CPU they are off.
        bias_activation_fusion=on_cuda, masked_softmax_fusion=on_cuda, persist_layer_norm=on_cuda,
        bias_dropout_fusion=on_cuda, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        **recompute)


def build_model(cfg: Config, device: torch.device):
    """This rank's piece of the GPTModel (its TP slice of its pipeline stage) on `device`."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    on_cuda = device.type == "cuda"
    model = GPTModel(config=transformer_config(cfg, on_cuda), transformer_layer_spec=layer_spec(on_cuda),
                     vocab_size=cfg.model.padded_vocab_size(cfg.parallel.tensor),
                     max_sequence_length=cfg.model.seq_length, position_embedding_type="learned_absolute",
                     share_embeddings_and_output_weights=cfg.model.tie_embeddings,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage())
    # As Megatron's Float16Module does: every parameter in the training dtype (layer norms too).
    return model.to(device=device, dtype=DTYPES[cfg.precision.dtype])


def parallel_groups(model, topo):
    """The engine's view of the layout. Gradients summed over another group before the DP reduction:
    word embeddings tied to the last pipeline stage's output layer (megatron's embedding group;
    counted once in the norm) and sequence-parallel layer norms / biases (the TP group)."""
    import zero3d
    from megatron.core import parallel_state
    tied, excluded = {}, frozenset()
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    if topo.pp > 1 and weight is not None:  # middle stages hold no copy
        tied = {weight: parallel_state.get_embedding_group()}
        excluded = frozenset([weight]) if getattr(weight, "shared", False) else frozenset()  # last stage's copy
    if model.config.sequence_parallel:  # each TP rank saw a sequence slice: its grad is a partial sum
        tied.update({p: parallel_state.get_tensor_model_parallel_group()
                     for p in model.parameters() if getattr(p, "sequence_parallel", False)})
    return zero3d.ParallelGroups(dp_group=topo.dp_group, tp_rank=topo.tp_rank, tied=tied, norm_excluded=excluded)


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


def gpt_inputs(tokens: torch.Tensor):
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(inputs.shape[1], device=inputs.device).unsqueeze(0).expand_as(inputs)
    return inputs, positions, labels


def gpt_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of a [batch, seq+1] token block (megatron's vocab-parallel cross entropy)."""
    inputs, positions, labels = gpt_inputs(tokens)
    per_token = model(inputs, positions, None, labels=labels)
    return per_token.float().mean()
