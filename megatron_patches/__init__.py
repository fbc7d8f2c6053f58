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


__all__ = ["apply", "apply_cpu_patches", "cpu_patches_applied", "check_megatron_version",
           "MEGATRON_TESTED"]
