"""Optional kernels (Apex, Transformer Engine) and CUDA_DEVICE_MAX_CONNECTIONS: stated once at start-up instead of
megatron's warnings."""
import importlib.util
import os
from typing import Optional

# megatron-core warns at import, once per module and on every rank, that Apex / Transformer Engine are
# absent, and at the first tensor-parallel forward that CUDA_DEVICE_MAX_CONNECTIONS is not 1;
# pretrain/__main__.py silences exactly these and rank 0 prints `fallbacks_line()` instead.
MEGATRON_FALLBACK_WARNINGS = (r"(Apex is|Transformer Engine and Apex are) not installed|When using .* it is "
                              r"recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1")


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def fallbacks_line(tensor_parallel: int, environ=os.environ) -> Optional[str]:
    """One line naming each missing kernel package and what runs instead, and (with TP > 1) a
    CUDA_DEVICE_MAX_CONNECTIONS other than 1; None when there is nothing to say."""
    missing = []
    if not installed("apex"):
        missing.append("Apex not installed (megatron-core uses torch's LayerNorm and its local multi-tensor kernels)")
    if not installed("transformer_engine"):
        missing.append("Transformer Engine not installed (megatron-core's local layers and optimizers)")
    if tensor_parallel > 1 and environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        # Stated, not set: 1 queues every stream's kernels in launch order on GPU, false dependencies
        # between the engine's communication streams and compute.
        missing.append(f"CUDA_DEVICE_MAX_CONNECTIONS {environ.get('CUDA_DEVICE_MAX_CONNECTIONS', 'unset')} (megatron-core "
                       "asks for 1 to queue its async TP all-reduce ahead of the next GEMM on GPU; no effect on CPU)")
    return "kernels: " + "; ".join(missing) if missing else None
