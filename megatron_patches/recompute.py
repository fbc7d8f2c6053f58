"""Route megatron-core's full per-layer recomputation to zero3d.checkpointing (ZeRO-R Pa, Pa+cpu, MD).

Two patches on megatron.core.transformer.transformer_block, both undone by `disable_zero3d_recompute`:
1. its module-global `tensor_parallel` becomes a view of the real package whose `checkpoint` is
   zero3d's (so `TransformerBlock._checkpointed_forward` checkpoints each layer through zero3d;
   every other `tensor_parallel.*` name, and every other module, still sees megatron's own);
2. `TransformerBlock._checkpointed_forward` is wrapped to refuse unsupported set-ups and to size
   the MD buffer for the block's checkpoints before its first layer runs.
Only `_checkpointed_forward` (recompute_granularity="full") is affected; selective recompute and
the non-recomputed forward are untouched.
"""
import contextlib
import functools

from megatron_patches.version import check_megatron_version
from zero3d.checkpointing import ActivationCheckpointing, checkpoint

_state: dict = {"acts": None, "tensor_parallel": None, "checkpointed_forward": None}


class _TensorParallelView:
    """megatron.core.tensor_parallel as transformer_block sees it, with `checkpoint` routed to zero3d."""

    def __init__(self, real, acts: ActivationCheckpointing):
        self._real, self._acts = real, acts

    def checkpoint(self, function, distribute_saved_activations, *args):
        # megatron's own Pa (distribute_saved_activations) is refused in the wrapper below.
        return checkpoint(function, self._acts, *args)

    def __getattr__(self, name):
        return getattr(self._real, name)


def _num_checkpoints(block) -> int:
    cfg, layers = block.config, block.num_layers_per_pipeline_rank
    if cfg.recompute_method == "uniform":
        return -(-layers // cfg.recompute_num_layers)
    return min(cfg.recompute_num_layers, layers)  # "block": the first recompute_num_layers layers


def _routed_checkpointed_forward(original):
    @functools.wraps(original)
    def forward(self, hidden_states, *args, **kwargs):
        cfg, acts = self.config, _state["acts"]
        if cfg.fp8 or cfg.fp4:
            raise NotImplementedError("zero3d recompute: fp8/fp4 use Transformer Engine's checkpoint, "
                                      "which zero3d does not route; turn fp8/fp4 off")
        if cfg.sequence_parallel and acts.partition:
            raise ValueError("zero3d Pa with sequence parallelism would partition the already "
                             "sequence-sharded layer input a second time; turn one off")
        if cfg.distribute_saved_activations:
            raise ValueError("config.distribute_saved_activations is megatron's own Pa; with zero3d's "
                             "routing use zero.partition_activations instead")
        acts.reserve(_num_checkpoints(self), hidden_states)
        return original(self, hidden_states, *args, **kwargs)
    return forward


def enable_zero3d_recompute(acts: ActivationCheckpointing) -> ActivationCheckpointing:
    """Switch megatron's full recomputation to zero3d's checkpoint with `acts` (replaces a previous one)."""
    check_megatron_version()
    import megatron.core.tensor_parallel as real_tp
    import megatron.core.transformer.transformer_block as tb

    disable_zero3d_recompute()
    if acts.rng_tracker is None:  # dropout inside TP regions draws from megatron's tracked states
        acts.rng_tracker = real_tp.get_cuda_rng_tracker
    _state.update(acts=acts, tensor_parallel=tb.tensor_parallel,
                  checkpointed_forward=tb.TransformerBlock._checkpointed_forward)
    tb.tensor_parallel = _TensorParallelView(real_tp, acts)
    tb.TransformerBlock._checkpointed_forward = _routed_checkpointed_forward(_state["checkpointed_forward"])
    return acts


def disable_zero3d_recompute() -> None:
    """Restore megatron's own recomputation (a no-op when not routed)."""
    if _state["acts"] is None:
        return
    import megatron.core.transformer.transformer_block as tb
    tb.tensor_parallel = _state["tensor_parallel"]
    tb.TransformerBlock._checkpointed_forward = _state["checkpointed_forward"]
    _state.update(acts=None, tensor_parallel=None, checkpointed_forward=None)


def routed_acts():
    """The ActivationCheckpointing currently routed to, or None."""
    return _state["acts"]


def route_recompute_to_zero3d(partition_activations: bool, cpu_checkpointing: bool,
                              contiguous_checkpointing: bool, tp_group, comm_stats=None):
    """The training loop's entry point: config flags (zero.*) → routed ActivationCheckpointing.

    Returns None (megatron's own recompute stays) when none of the three flags is set.
    """
    if not (partition_activations or cpu_checkpointing or contiguous_checkpointing):
        disable_zero3d_recompute()
        return None
    return enable_zero3d_recompute(ActivationCheckpointing(
        partition=partition_activations, cpu=cpu_checkpointing, contiguous=contiguous_checkpointing,
        tp_group=tp_group, comm_stats=comm_stats))


@contextlib.contextmanager
def zero3d_recompute(acts: ActivationCheckpointing):
    """Scoped routing (tests): megatron's own recompute is back on exit."""
    enable_zero3d_recompute(acts)
    try:
        yield acts
    finally:
        disable_zero3d_recompute()
