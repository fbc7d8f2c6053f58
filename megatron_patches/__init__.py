"""The only place zero3d patches megatron-core: CPU/gloo mode (cpu.py, groups.py), its import made lean (lean.py), its
layers traced whole by torch.compile (compile.py)."""
from megatron_patches.compile import no_warnings_inside_layers
from megatron_patches.cpu import (apply_cpu_patches, cpu_patches_applied, tied_embeddings_stay_on_cpu,
                                  undo_cpu_patches)
from megatron_patches.groups import destroy_megatron_groups, one_gloo_group_per_rank_set
from megatron_patches.version import MEGATRON_TESTED, check_megatron_version


def apply(device_type: str) -> None:
    """Make megatron-core usable on `device_type` ("cpu" or "cuda"); a no-op on CUDA."""
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
    check_megatron_version()
    if device_type == "cpu":
        apply_cpu_patches()


__all__ = ["apply", "apply_cpu_patches", "undo_cpu_patches", "cpu_patches_applied", "tied_embeddings_stay_on_cpu",
           "one_gloo_group_per_rank_set", "destroy_megatron_groups", "check_megatron_version", "MEGATRON_TESTED",
           "no_warnings_inside_layers"]
