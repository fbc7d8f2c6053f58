"""Optional kernels (Apex, Transformer Engine): the ones missing, stated once at start-up instead of megatron's warnings."""
import importlib.util
from typing import Optional

# megatron-core warns at import, once per module and on every rank, that Apex / Transformer Engine are
# absent; pretrain/__main__.py silences exactly these and rank 0 prints `fallbacks_line()` instead.
MEGATRON_FALLBACK_WARNINGS = r"(Apex is|Transformer Engine and Apex are) not installed"


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def fallbacks_line() -> Optional[str]:
    """One line naming each missing kernel package and what runs instead; None when both are installed."""
    missing = []
    if not installed("apex"):
        missing.append("Apex not installed (megatron-core uses torch's LayerNorm and its local multi-tensor kernels)")
    if not installed("transformer_engine"):
        missing.append("Transformer Engine not installed (megatron-core's local layers and optimizers)")
    return "kernels: " + "; ".join(missing) if missing else None
