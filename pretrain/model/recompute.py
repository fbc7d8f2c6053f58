"""Selective recomputation of a transformer layer (`model.recompute = "selective"`): its GEMMs' and fused attention's
outputs kept for backward, every other op recomputed from them in backward.

torch's selective activation checkpointing (`torch.utils.checkpoint` with a policy, torchtitan's op-level "selective"
mode) over the layer's forward: the outputs of its GEMMs (QKV, projection, fc1, fc2) and of fused attention are cached
in forward and handed back when the layer is recomputed in backward; the norms, RoPE, the MLP's activation function, the residual adds and megatron's
materialised attention scores and softmax (its `core_attn` recompute) run again instead of being kept. Collectives
that reduce in place (the tensor-parallel all-reduces) are kept too; those that fill a new buffer (sequence
parallelism's gathers and reduce-scatters, context parallelism's K/V gathers) run again, as under full recomputation;
dropout is recomputed from the random state the forward began with — torch's
generators (the checkpoint's own) and megatron's tensor-parallel RNG tracker (set back for the recomputation) —
so the recomputed layer equals the one computed in forward bit for bit. The cost is the recomputed non-GEMM ops (and, with megatron's local attention,
its two batched score GEMMs: model_shape/flops.py counts them), against `full`'s whole second forward.
"""
import contextlib
import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_aten = torch.ops.aten
# The linear layers' GEMMs (2-D after megatron's reshapes; _scaled_mm: FP8) and the fused attention kernels (flash /
# memory-efficient / cuDNN on CUDA, flash on CPU): kept. fc2's output too, though backward never reads it: torch's
# recomputation stops only once every tensor backward needs is made again, and a megatron linear hands autograd its
# input (fc2's: the activation's output) after its GEMM has run, so not keeping it costs fc2's GEMM again. Batched
# GEMMs (bmm, baddbmm: the materialised attention's scores and its weighted values) are not kept: they are the core
# attention megatron recomputes.
SAVED_OPS = frozenset({
    _aten.mm.default, _aten.addmm.default, _aten._scaled_mm.default,
    _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default, _aten._scaled_dot_product_flash_attention_for_cpu.default,
})
# Collectives that reduce a tensor in place (the row-parallel all-reduces of the kept projection and fc2 outputs):
# kept, so the recomputation reads the reduced GEMM output back without reducing it again. The others write a new
# buffer (sequence parallelism's gathers and reduce-scatters, context parallelism's K/V gathers): recomputed, as
# megatron's full recomputation does, since their callers read the buffer they allocated, not the op's result.
KEPT_COLLECTIVES = frozenset({"c10d::allreduce_", "c10d::allreduce_coalesced_", "_c10d_functional::all_reduce_"})


def keep_or_recompute(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The policy: keep GEMMs, fused attention and in-place reductions; recompute the rest."""
    if op in SAVED_OPS or op.name() in KEPT_COLLECTIVES:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts():
    """(forward context, recomputation context) of one layer call: the policy's, and the recomputation run with
    megatron's RNG tracker as it was when the forward began (the tensor-parallel dropout's generator). Compiled (the
    checkpoint traced into the layer's graph: TP 1), torch's two modes as they are: it refuses any other context
    there, and the compiled graph draws its random numbers its own way (tests/dist/test_recompute.py: no dropout)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    # A kept GEMM output that a kept in-place collective then reduces (the row-parallel all-reduce) is cached as
    # reduced, and the collective's own entry is that same tensor: the recomputation reads the reduced value, as
    # the forward's next op did.
    forward, recomputation = create_selective_checkpoint_contexts(keep_or_recompute, allow_cache_entry_mutation=True)
    if torch.compiler.is_compiling():  # traced into a compiled layer's graph, where torch takes its own two modes only
        return forward, recomputation
    tracker = get_cuda_rng_tracker()
    return forward, _with_tracker_states(recomputation, tracker, tracker.get_states())


@contextlib.contextmanager
def _with_tracker_states(context, tracker, states: dict):
    current = tracker.get_states()
    tracker.set_states(dict(states))
    try:
        with context:
            yield
    finally:
        tracker.set_states(current)


def selective_recompute_layer_class():
    """megatron's TransformerLayer whose forward runs under selective recomputation when it builds a graph."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    class SelectiveRecomputeLayer(TransformerLayer):
        """A transformer layer keeping only its GEMM and fused-attention outputs for backward (module docstring)."""

        def forward(self, *args, **kwargs):
            if not torch.is_grad_enabled():
                return super().forward(*args, **kwargs)
            return checkpoint(functools.partial(super().forward), *args, use_reentrant=False,
                              context_fn=selective_contexts, **kwargs)

    return SelectiveRecomputeLayer
