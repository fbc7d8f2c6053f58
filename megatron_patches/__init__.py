"""The only place zero3d touches megatron-core internals: CPU/gloo mode and recompute routing."""
from megatron_patches.cpu import apply_cpu_patches, cpu_patches_applied
from megatron_patches.version import MEGATRON_TESTED, check_megatron_version


def apply(device_type: str) -> None:
    """Make megatron-core usable on `device_type` ("cpu" or "cuda"); a no-op on CUDA."""
    check_megatron_version()
    if device_type == "cpu":
        apply_cpu_patches()
    elif device_type != "cuda":
        raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")


def enable_zero3d_recompute(acts):
    """Route megatron's full per-layer recomputation to zero3d's checkpoint (see recompute.py)."""
    from megatron_patches.recompute import enable_zero3d_recompute as enable
    return enable(acts)


def disable_zero3d_recompute() -> None:
    """Give megatron its own recomputation back."""
    from megatron_patches.recompute import disable_zero3d_recompute as disable
    disable()


def route_recompute_to_zero3d(partition_activations, cpu_checkpointing, contiguous_checkpointing,
                              tp_group, comm_stats=None):
    """zero.{partition_activations,cpu_checkpointing,contiguous_checkpointing} → routed checkpoints."""
    from megatron_patches.recompute import route_recompute_to_zero3d as route
    return route(partition_activations, cpu_checkpointing, contiguous_checkpointing, tp_group, comm_stats)


__all__ = ["apply", "apply_cpu_patches", "cpu_patches_applied", "check_megatron_version",
           "MEGATRON_TESTED", "enable_zero3d_recompute", "disable_zero3d_recompute",
           "route_recompute_to_zero3d"]
