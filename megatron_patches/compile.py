"""megatron-core's layers made traceable as whole graphs by torch.compile (model.compile)."""


def no_warnings_inside_layers() -> None:
    """megatron's linear layers warn at the first tensor-parallel forward that CUDA_DEVICE_MAX_CONNECTIONS is not 1
    (`linear_with_grad_accumulation_and_async_allreduce.warned`): inside a compiled layer that call is a graph
    break, and it falls on the layers traced before the warning has been given. pretrain states the advice once at
    start-up instead (pretrain/runtime/kernels.py), so here it counts as given."""
    from megatron.core.tensor_parallel import layers
    layers.linear_with_grad_accumulation_and_async_allreduce.warned = True
